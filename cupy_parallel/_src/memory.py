"""A caching allocator for host memory, the host-side twin of CuPy's ``MemoryPool``.

Freshly allocated host memory page-faults on first touch, which costs more than the copy that
fills it. CuPy avoids the GPU equivalent (``cudaMalloc`` per array) by keeping freed blocks in a
pool; this module does the same for the buffers that ``"cpu"`` and ``"host:k"`` arrays live in.
Blocks at least ``POOL_THRESHOLD`` bytes long are pooled; smaller ones come from NumPy, whose
allocator already recycles them cheaply.

How blocks are chosen follows CuPy's ``cupy/cuda/memory.pyx`` (``SingleDeviceMemoryPool``):

- sizes are rounded up to ``ALLOCATION_UNIT`` (512 bytes);
- a request takes the *smallest* cached chunk that is large enough (best fit), and the part it
  does not need is split off and stays cached, so a batch of 90 rows reuses the block a batch of
  100 rows left behind (exact-size caching would keep one block per batch size seen, and grow
  without bound when batch sizes vary);
- a chunk that is freed merges with its free neighbours from the same segment (one ``np.empty``
  buffer), so splitting does not fragment memory for good;
- :meth:`HostMemoryPool.free_all_blocks` drops every cached segment that is wholly free, and a
  limit (:meth:`HostMemoryPool.set_limit`) caps the bytes the pool holds: past it, cached blocks
  are dropped, the garbage collector runs, and if that is not enough ``MemoryError`` is raised.

A block goes back to the pool when the last array viewing it is garbage collected: the arrays'
``base`` chain ends in a :class:`_Block`, whose finalizer returns the chunk. That finalizer may
run *inside* the pool (the garbage collector can start at any allocation, including one the pool
makes while holding its lock, and collect a cycle that holds a pooled array), so it never waits
for the lock: when the lock is taken it leaves the chunk on a pending list (``list.append`` is
atomic), which the next operation that holds the lock folds in. CuPy's pool does the same
(``add_pending_free_atomic``).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import math
import os
import threading
from typing import Any

import numpy as np

from cupy_parallel._src.arguments import read_int, read_real

__all__ = ["ALLOCATION_UNIT", "POOL_THRESHOLD", "HostMemoryPool", "get_host_memory_pool"]

POOL_THRESHOLD = 1 << 17
"""Allocations of at least this many bytes (128 KiB) are served from the pool."""

ALLOCATION_UNIT = 512
"""Pooled sizes are rounded up to multiples of this many bytes (CuPy's ``ALLOCATION_UNIT_SIZE``)."""


class _Chunk:
    """``size`` bytes at ``offset`` in a segment, linked to its neighbours in that segment."""

    __slots__ = ("free", "key", "next", "offset", "prev", "segment", "size")

    def __init__(self, segment: np.ndarray, offset: int, size: int, serial: int) -> None:
        self.segment = segment
        self.offset = offset
        self.size = size
        self.key = (size, serial)  # the chunk's place in the pool's sorted index
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None
        self.free = False


class _Block:
    """Owns one chunk while arrays view it; hands it back to the pool when they are gone."""

    __slots__ = ("__weakref__", "_chunk", "_pool", "_view")

    def __init__(self, pool: HostMemoryPool, chunk: _Chunk) -> None:
        self._pool = pool
        self._chunk = chunk
        self._view = chunk.segment[chunk.offset : chunk.offset + chunk.size]

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._view.__array_interface__

    def __del__(self) -> None:
        self._pool._release(self._chunk)


def _physical_memory() -> int:
    """The machine's physical memory in bytes (for ``set_limit(fraction=...)``)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError) as error:  # not POSIX
        raise NotImplementedError(
            "set_limit(fraction=...) needs the machine's physical memory, which this platform "
            "does not report; pass set_limit(size=...) in bytes instead."
        ) from error


class HostMemoryPool:
    """Caches freed host buffers so that later allocations reuse warm pages, as CuPy's pool does.

    The interface is the one ``cupy.get_default_memory_pool()`` offers: :meth:`used_bytes`,
    :meth:`free_bytes`, :meth:`total_bytes`, :meth:`n_free_blocks`, :meth:`free_all_blocks`,
    :meth:`set_limit` and :meth:`get_limit`. The pool accounts for what it serves, the arrays
    of at least ``POOL_THRESHOLD`` bytes that :func:`cupy_parallel.empty`, ``to_device``
    and the ``comm`` functions allocate; smaller arrays and the results NumPy computes
    (``h + 1``) come from NumPy's allocator and are outside its counts and its limit.

    Thread-safe; freeing from any thread (or from the garbage collector inside the pool) never
    blocks.

    Example:
        >>> import numpy as np
        >>> pool = HostMemoryPool()
        >>> a = pool.empty((1 << 18,), np.uint8)
        >>> del a
        >>> pool.used_bytes(), pool.free_bytes()
        (0, 262144)
        >>> b = pool.empty((1 << 16,), np.float32)  # same size: the cached block is reused
        >>> pool.free_bytes(), pool.total_bytes()
        (0, 262144)
        >>> c = pool.empty((200_000,), np.uint8)  # best fit: a new block, then split on reuse
        >>> del b, c
        >>> d = pool.empty((150_000,), np.uint8)  # takes 150,016 bytes of the 200,192 block
        >>> pool.used_bytes(), pool.total_bytes()
        (150016, 462336)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[_Chunk] = []  # freed while the lock was taken; folded in under it
        self._index: list[tuple[int, int]] = []  # sorted keys (size, serial) of the free chunks
        self._free_chunks: dict[tuple[int, int], _Chunk] = {}
        self._serial = itertools.count()
        self._used_bytes = 0
        self._total_bytes = 0
        self._limit = 0

    # -- allocation ---------------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
        """Return an uninitialised C-contiguous NumPy array, pooled when it is large enough.

        Raises:
            MemoryError: the pool has a limit (:meth:`set_limit`) and holding this block too
                would exceed it even after dropping every cached block.
        """
        dtype = np.dtype(dtype)
        nbytes = int(math.prod(shape)) * dtype.itemsize
        if nbytes < POOL_THRESHOLD:
            return np.empty(shape, dtype)
        size = -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT
        chunk = self._take(size)
        flat = np.asarray(_Block(self, chunk))[:nbytes]
        return flat.view(dtype).reshape(shape)

    def _take(self, size: int) -> _Chunk:
        """A chunk of exactly ``size`` bytes: the best cached fit, split, or a new segment."""
        with self._lock:
            self._commit_pending()
            chunk = self._best_fit(size)
            if chunk is None and self._fits(size):
                chunk = self._new_segment(size)
        if chunk is None:  # over the limit: collect unreachable arrays (cycles), then retry once
            gc.collect()
            with self._lock:
                self._commit_pending()
                chunk = self._best_fit(size)
                if chunk is None:
                    if not self._fits(size):
                        raise MemoryError(
                            f"host memory pool: allocating {size:,} bytes would exceed the "
                            f"limit of {self._limit:,} bytes set with set_limit (the pool holds "
                            f"{self._total_bytes:,} bytes, {self._used_bytes:,} of them in live "
                            "arrays); free arrays or raise the limit with set_limit(size=...)."
                        )
                    chunk = self._new_segment(size)
        return chunk

    def _fits(self, size: int) -> bool:
        """Whether a new segment of ``size`` bytes stays within the limit (dropping cached ones)."""
        if self._limit == 0 or self._total_bytes + size <= self._limit:
            return True
        self._drop_free_segments()
        return self._total_bytes + size <= self._limit

    def _best_fit(self, size: int) -> _Chunk | None:
        """Remove and return the smallest free chunk of at least ``size`` bytes, split to size."""
        i = bisect.bisect_left(self._index, (size, -1))
        if i == len(self._index):
            return None
        chunk = self._free_chunks.pop(self._index.pop(i))
        chunk.free = False
        if chunk.size > size:  # split: the tail stays cached
            tail = _Chunk(chunk.segment, chunk.offset + size, chunk.size - size, next(self._serial))
            tail.prev, tail.next = chunk, chunk.next
            if chunk.next is not None:
                chunk.next.prev = tail
            chunk.next = tail
            chunk.size, chunk.key = size, (size, next(self._serial))
            self._insert_free(tail)
        self._used_bytes += size
        return chunk

    def _new_segment(self, size: int) -> _Chunk:
        try:
            segment = np.empty(size, np.uint8)
        except MemoryError:  # the system is out of memory: give back what we cache, retry once
            self._drop_free_segments()
            segment = np.empty(size, np.uint8)
        self._total_bytes += size
        self._used_bytes += size
        return _Chunk(segment, 0, size, next(self._serial))

    # -- freeing ------------------------------------------------------------------------------

    def _release(self, chunk: _Chunk) -> None:
        """Return ``chunk``; never waits (it may run inside the pool, from the collector)."""
        if not self._lock.acquire(blocking=False):
            self._pending.append(chunk)
            return
        try:
            self._free_chunk(chunk)
            self._commit_pending()
        finally:
            self._lock.release()

    def _commit_pending(self) -> None:
        while self._pending:  # the collector may append while this loop runs: pop until empty
            self._free_chunk(self._pending.pop())

    def _free_chunk(self, chunk: _Chunk) -> None:
        self._used_bytes -= chunk.size
        for neighbour in (chunk.next, chunk.prev):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                first, second = (
                    (chunk, neighbour) if neighbour is chunk.next else (neighbour, chunk)
                )
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                chunk = first
        chunk.key = (chunk.size, next(self._serial))
        self._insert_free(chunk)

    def _insert_free(self, chunk: _Chunk) -> None:
        chunk.free = True
        bisect.insort(self._index, chunk.key)
        self._free_chunks[chunk.key] = chunk

    def _remove_free(self, chunk: _Chunk) -> None:
        del self._index[bisect.bisect_left(self._index, chunk.key)]
        del self._free_chunks[chunk.key]
        chunk.free = False

    def _drop_free_segments(self) -> None:
        """Forget every cached chunk that is a whole segment (split segments are still in use)."""
        for chunk in list(self._free_chunks.values()):
            if chunk.prev is None and chunk.next is None:
                self._remove_free(chunk)
                self._total_bytes -= chunk.size

    # -- CuPy's MemoryPool interface -----------------------------------------------------------

    def free_all_blocks(self) -> None:
        """Drop every cached block that no array uses, returning its memory to the system.

        Example:
            >>> import numpy as np
            >>> pool = HostMemoryPool()
            >>> a = pool.empty((1 << 18,), np.uint8)
            >>> del a
            >>> pool.free_bytes()
            262144
            >>> pool.free_all_blocks()
            >>> pool.free_bytes(), pool.total_bytes()
            (0, 0)
        """
        with self._lock:
            self._commit_pending()
            self._drop_free_segments()

    def used_bytes(self) -> int:
        """Bytes held by live arrays (each rounded up to ``ALLOCATION_UNIT``)."""
        with self._lock:
            self._commit_pending()
            return self._used_bytes

    def free_bytes(self) -> int:
        """Bytes cached for reuse: :meth:`total_bytes` minus :meth:`used_bytes`."""
        with self._lock:
            self._commit_pending()
            return self._total_bytes - self._used_bytes

    def n_free_blocks(self) -> int:
        """How many cached chunks there are (CuPy's ``MemoryPool.n_free_blocks``)."""
        with self._lock:
            self._commit_pending()
            return len(self._index)

    def total_bytes(self) -> int:
        """Bytes the pool holds from the system, in use or cached."""
        with self._lock:
            self._commit_pending()
            return self._total_bytes

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        """Cap :meth:`total_bytes` at ``size`` bytes, or at ``fraction`` of physical memory.

        CuPy's signature and rules: ``set_limit()`` (neither) or ``size=0`` removes the limit;
        giving both is an error. An allocation that would exceed the limit first drops the
        cached blocks and runs the garbage collector, then raises ``MemoryError``. A limit below
        what is already held takes effect for later allocations (nothing is taken from live
        arrays).

        Example:
            >>> import numpy as np
            >>> pool = HostMemoryPool()
            >>> pool.set_limit(size=1 << 20)
            >>> pool.get_limit()
            1048576
            >>> pool.empty((1 << 21,), np.uint8)
            Traceback (most recent call last):
            ...
            MemoryError: host memory pool: allocating 2,097,152 bytes would exceed the limit ...
            >>> pool.set_limit()
            >>> pool.get_limit()
            0
        """
        if size is not None and fraction is not None:
            raise ValueError(
                f"set_limit takes size or fraction, not both; got size={size!r} and "
                f"fraction={fraction!r}."
            )
        if fraction is not None:
            read_real(fraction, "fraction", expected="a number in [0, 1]")
            if not 0 <= fraction <= 1:
                raise ValueError(f"fraction must be in [0, 1], got {fraction!r}.")
            limit = int(fraction * _physical_memory())
        else:
            limit = 0 if size is None else read_int(size, "size", minimum=0)
        with self._lock:
            self._limit = limit

    def get_limit(self) -> int:
        """The limit set with :meth:`set_limit` in bytes; 0 means none (CuPy's convention)."""
        return self._limit


_POOL = HostMemoryPool()


def get_host_memory_pool() -> HostMemoryPool:
    """The process-wide pool behind ``"cpu"`` and ``"host:k"`` allocations.

    Example:
        >>> pool = get_host_memory_pool()
        >>> pool.free_all_blocks()
        >>> pool.free_bytes()
        0
    """
    return _POOL
