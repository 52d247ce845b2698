"""A caching allocator for host memory, the host-side twin of CuPy's ``MemoryPool``.

Freshly allocated host memory page-faults on first touch, which costs more than the copy that
fills it. CuPy avoids the GPU equivalent (``cudaMalloc`` per array) by keeping freed blocks in a
pool; this module does the same for the buffers that ``"cpu"`` and ``"host:k"`` arrays live in.
Blocks at least :data:`POOL_THRESHOLD` bytes long are pooled; smaller ones come from NumPy, whose
allocator already recycles them cheaply.

A block goes back to the pool when the last array viewing it is garbage collected: the arrays'
``base`` chain ends in a :class:`_Block`, whose finalizer returns the raw buffer.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import numpy as np

__all__ = ["POOL_THRESHOLD", "HostMemoryPool", "get_host_memory_pool"]

POOL_THRESHOLD = 1 << 17
"""Allocations of at least this many bytes (128 KiB) are served from the pool."""

_ROUND = 1 << 12  # pooled sizes are rounded up to whole 4 KiB pages


class _Block:
    """Owns one raw buffer while arrays view it; hands it back to the pool when they are gone."""

    __slots__ = ("__weakref__", "_pool", "_raw")

    def __init__(self, pool: HostMemoryPool, raw: np.ndarray) -> None:
        self._pool = pool
        self._raw = raw

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._raw.__array_interface__

    def __del__(self) -> None:
        self._pool._release(self._raw)


class HostMemoryPool:
    """Caches freed host buffers by size so that repeated allocations reuse warm pages.

    Example:
        >>> pool = HostMemoryPool()
        >>> a = pool.empty((1 << 18,), np.uint8)
        >>> del a
        >>> pool.free_bytes()
        262144
        >>> b = pool.empty((1 << 16,), np.float32)  # same size: the cached block is reused
        >>> pool.free_bytes()
        0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)
        self._free_bytes = 0
        self._used_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any] | type) -> np.ndarray:
        """Return an uninitialised C-contiguous NumPy array, pooled when it is large enough."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < POOL_THRESHOLD:
            return np.empty(shape, dtype)
        size = -(-nbytes // _ROUND) * _ROUND
        with self._lock:
            bucket = self._free.get(size)
            raw = bucket.pop() if bucket else None
            if raw is not None:
                self._free_bytes -= size
            self._used_bytes += size
        if raw is None:
            raw = np.empty(size, np.uint8)
        flat = np.asarray(_Block(self, raw))[:nbytes]
        return flat.view(dtype).reshape(shape)

    def _release(self, raw: np.ndarray) -> None:
        with self._lock:
            self._free[raw.nbytes].append(raw)
            self._free_bytes += raw.nbytes
            self._used_bytes -= raw.nbytes

    def used_bytes(self) -> int:
        """Bytes held by live arrays."""
        return self._used_bytes

    def free_bytes(self) -> int:
        """Bytes cached for reuse."""
        return self._free_bytes

    def free_all_blocks(self) -> None:
        """Drop every cached block, returning its memory to the system."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0


_POOL = HostMemoryPool()


def get_host_memory_pool() -> HostMemoryPool:
    """The process-wide pool behind ``"cpu"`` and ``"host:k"`` allocations.

    Example:
        >>> get_host_memory_pool().free_all_blocks()
    """
    return _POOL
