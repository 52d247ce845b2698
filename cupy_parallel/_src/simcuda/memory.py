"""Simulated device and pinned memory: blocks, the race checker, and CuPy's two pools.

Device memory is host memory: a :class:`Block` is a NumPy ``uint8`` buffer whose real address is
the simulated device pointer (one address space, as CUDA's unified addressing), so
:func:`resolve` maps any pointer back to its block and offset, and copies are ``ctypes.memmove``.

Every access to a block is checked by :func:`access` against the block's history: each earlier
access that conflicts (write/read, read/write, write/write) on overlapping bytes must happen
before the new one (:func:`.clock.happens_before`), else :class:`.clock.RaceError` names both
operations and their streams. The history survives freeing, so reuse of a pooled block by a new
array is checked against the block's previous life. A write that covers an earlier access and is
ordered after it retires that access from the history.

Pools follow CuPy: :class:`DevicePool` keeps one arena per GPU per stream (the stream current
when the block was allocated); a freed chunk goes, without any synchronisation, to the next
allocation on the same stream that fits it (best fit, split, freed neighbours merged).
:class:`PinnedPool` reuses freed pinned blocks for any allocation (CuPy's pinned pool does not
track streams); the host is taken to write a pinned block when it allocates it, so reuse before
the device finished reading it is a race.
Freeing a pinned block while a device operation on it may still run is reported too (CuPy leaves
keeping it alive to the caller), as a race recorded on the simulation.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupy_parallel._src.simcuda.clock import (
    Op,
    RaceError,
    Simulation,
    SimulationError,
    happens_before,
)

__all__ = [
    "Block",
    "Chunk",
    "DevicePool",
    "PinnedPool",
    "Region",
    "access",
    "check_pinned_free",
    "handed_to_host",
    "new_pinned_block",
    "resolve",
    "round_pinned_size",
    "round_size",
]

_UNIT = 512  # CuPy's allocation unit
_EXACT_LIMIT = 1 << 20  # above this many elements a strided region is checked by its span


def round_size(size: int) -> int:
    """``size`` rounded up to CuPy's 512-byte allocation unit (at least one unit)."""
    return max(-(-size // _UNIT), 1) * _UNIT


def round_pinned_size(size: int) -> int:
    """A pinned block's size: whole units, then the next power of two (CuPy's ``clp2``).

    Example:
        >>> round_pinned_size(1), round_pinned_size(600), round_pinned_size(1536)
        (512, 1024, 2048)
    """
    return 1 << (round_size(size) - 1).bit_length()


@dataclass(frozen=True)
class Region:
    """Bytes ``[start, end)`` of a block; ``offsets`` (element starts) when strided with gaps."""

    start: int
    end: int
    offsets: np.ndarray | None = None
    itemsize: int = 1

    @classmethod
    def of_view(
        cls, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
    ) -> Region:
        """The bytes an array view with this layout touches, ``offset`` from the block start."""
        if 0 in shape:
            return cls(offset, offset)
        low = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
        high = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0)
        size = int(np.prod(shape, dtype=np.int64))
        dense = high - low + itemsize == size * itemsize
        if dense or size > _EXACT_LIMIT:
            return cls(low, high + itemsize)
        grids = np.indices(shape, dtype=np.int64).reshape(len(shape), -1)
        offsets = offset + np.asarray(strides, np.int64) @ grids
        return cls(low, high + itemsize, np.unique(offsets), itemsize)

    def bytes(self) -> np.ndarray:
        if self.offsets is None:
            return np.arange(self.start, self.end)
        return (self.offsets[:, None] + np.arange(self.itemsize)).ravel()

    def overlaps(self, other: Region) -> bool:
        if self.start >= other.end or other.start >= self.end:
            return False
        if self.offsets is None and other.offsets is None:
            return True
        return bool(np.intersect1d(self.bytes(), other.bytes(), assume_unique=True).size)

    def covers(self, other: Region) -> bool:
        return self.offsets is None and self.start <= other.start and other.end <= self.end


@dataclass(eq=False)
class Access:
    region: Region
    write: bool
    op: Op


class Block:
    """One allocation of simulated memory: a host buffer at a fixed address, with its history."""

    def __init__(self, kind: str, device: int, size: int, arena: Any = None) -> None:
        self.kind = kind  # "device" or "pinned"
        self.device = device
        self.size = size
        self.arena = arena
        self.buffer = np.zeros(size, np.uint8)
        self.address = int(self.buffer.ctypes.data)
        self.history: list[Access] = []

    def describe(self) -> str:
        where = f"cuda:{self.device}" if self.kind == "device" else "pinned host memory"
        return f"{where} block {self.address:#x} ({self.size} bytes)"


def access(simulation: Simulation, block: Block, region: Region, op: Op, *, write: bool) -> None:
    """Check ``op``'s access to ``region`` of ``block`` against the history, then record it."""
    if region.start == region.end:
        return
    for past in block.history:
        if not (write or past.write) or happens_before(past.op, op):
            continue
        if not past.region.overlaps(region):
            continue
        raise simulation.race(
            RaceError(
                f"Data race on {block.describe()}, bytes [{region.start}, {region.end}): "
                f"the {'write' if write else 'read'} by `{op}` is not ordered after the "
                f"{'write' if past.write else 'read'} by `{past.op}` (CUDA orders them only "
                "through stream order, events, the legacy null stream or host synchronisation)."
            )
        )
    if write and region.offsets is None:
        block.history = [
            past
            for past in block.history
            if not (region.covers(past.region) and happens_before(past.op, op))
        ]
    block.history.append(Access(region, write, op))


class Registry:
    """Address → block for every block of a simulation (blocks live as long as it does)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._blocks: list[Block] = []

    def add(self, block: Block) -> None:
        i = bisect.bisect(self._starts, block.address)
        self._starts.insert(i, block.address)
        self._blocks.insert(i, block)

    def find(self, address: int) -> Block | None:
        i = bisect.bisect(self._starts, address) - 1
        if i >= 0:
            block = self._blocks[i]
            if address < block.address + max(block.size, 1):
                return block
        return None


def resolve(simulation: Simulation, address: int, nbytes: int) -> tuple[Block, int] | None:
    """The block holding ``[address, address + nbytes)`` and the offset, ``None`` for pageable.

    A range that starts in a block but runs past its end raises :class:`SimulationError`
    (``cudaErrorInvalidValue`` on a GPU, or memory corruption).
    """
    registry: Registry = simulation.extensions["registry"]
    block = registry.find(address)
    if block is None:
        return None
    offset = address - block.address
    if offset + nbytes > block.size:
        raise SimulationError(
            f"cudaErrorInvalidValue: {nbytes} bytes at {address:#x} run past the end of "
            f"{block.describe()} (offset {offset})."
        )
    return block, offset


def registry_of(simulation: Simulation) -> Registry:
    registry = simulation.extensions.get("registry")
    if registry is None:
        registry = simulation.extensions["registry"] = Registry()
    return registry


class Chunk:
    """A piece of a device :class:`Block` handed out by the pool (CuPy's ``_Chunk``).

    ``prev``/``next`` are the neighbouring chunks of the same block, so that freed neighbours
    merge back; ``arena`` is the (device, stream) free list the block belongs to.
    """

    __slots__ = ("arena", "block", "in_use", "next", "offset", "prev", "size")

    def __init__(self, block: Block, offset: int, size: int, arena: Any) -> None:
        self.block, self.offset, self.size, self.arena = block, offset, size, arena
        self.prev: Chunk | None = None
        self.next: Chunk | None = None
        self.in_use = False

    def split(self, size: int) -> Chunk | None:
        """Keep the first ``size`` bytes; the rest becomes a new chunk after this one."""
        if self.size == size:
            return None
        rest = Chunk(self.block, self.offset + size, self.size - size, self.arena)
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next, self.size = rest, size
        return rest

    def absorb_next(self) -> None:
        """Merge the (free) next chunk into this one."""
        nxt = self.next
        assert nxt is not None
        self.size += nxt.size
        self.next = nxt.next
        if nxt.next is not None:
            nxt.next.prev = self


class DevicePool:
    """CuPy's device memory pool: per GPU, one arena per stream (the allocating stream).

    As CuPy's ``SingleDeviceMemoryPool``: sizes are rounded to 512-byte units; an allocation
    takes the smallest free chunk of its arena that is large enough (best fit) and splits off
    the rest, which stays free; a freed chunk merges with free neighbours of the same block.
    Reuse needs no synchronisation: a freed chunk goes, without a sync, to the next allocation
    on the same stream, including part of a larger freed chunk, so a kernel still reading the
    old array's bytes races with the new array's first write (the block's history is checked).
    """

    def __init__(self, simulation: Simulation) -> None:
        self._simulation = simulation
        self._free: dict[Any, dict[int, list[Chunk]]] = defaultdict(lambda: defaultdict(list))
        self._used = 0
        self._total = 0

    def malloc(self, device: int, size: int, stream_key: Any) -> Chunk:
        """A chunk of at least ``size`` bytes on ``device`` for work on stream ``stream_key``."""
        rounded = round_size(size)
        arena = (device, stream_key)
        sizes = [n for n, chunks in self._free[arena].items() if chunks and n >= rounded]
        if sizes:
            chunk = self._free[arena][min(sizes)].pop()
            rest = chunk.split(rounded)
            if rest is not None:
                self._free[arena][rest.size].append(rest)
        else:
            block = Block("device", device, rounded, arena)
            registry_of(self._simulation).add(block)
            self._total += rounded
            chunk = Chunk(block, 0, rounded, arena)
        chunk.in_use = True
        self._used += chunk.size
        return chunk

    def free(self, chunk: Chunk) -> None:
        """Return ``chunk`` to its arena, merged with its free neighbours."""
        free = self._free[chunk.arena]
        chunk.in_use = False
        self._used -= chunk.size
        if chunk.next is not None and not chunk.next.in_use:
            free[chunk.next.size].remove(chunk.next)
            chunk.absorb_next()
        if chunk.prev is not None and not chunk.prev.in_use:
            previous = chunk.prev
            free[previous.size].remove(previous)
            previous.absorb_next()
            chunk = previous
        free[chunk.size].append(chunk)

    def used_bytes(self) -> int:
        """Bytes held by live arrays."""
        return self._used

    def total_bytes(self) -> int:
        """Bytes allocated from the (simulated) driver, live or cached."""
        return self._total

    def n_free_blocks(self) -> int:
        """How many free chunks wait in the free lists."""
        return sum(len(chunks) for sizes in self._free.values() for chunks in sizes.values())

    def free_all_blocks(self, stream: Any = None) -> None:
        """Release the free chunks that are whole blocks (CuPy keeps split ones until merged).

        ``cudaFree`` synchronises, so nothing can race with a released block.
        """
        for sizes in self._free.values():
            for chunks in sizes.values():
                whole = [c for c in chunks if c.prev is None and c.next is None]
                self._total -= sum(c.size for c in whole)
                chunks[:] = [c for c in chunks if c not in whole]


def new_pinned_block(simulation: Simulation, size: int) -> Block:
    """A new pinned block of ``size`` bytes (``cudaHostAlloc``), known to the simulation."""
    block = Block("pinned", -1, size)
    registry_of(simulation).add(block)
    return block


def handed_to_host(simulation: Simulation, block: Block) -> None:
    """Stamp the host writing a pinned block it is handed (reuse in flight is then a race)."""
    op = simulation.host_op("the host writing pinned memory from alloc_pinned_memory")
    access(simulation, block, Region(0, block.size), op, write=True)


def check_pinned_free(simulation: Simulation, block: Block) -> None:
    """Report freeing pinned memory that device work may still access (deferred: a finaliser)."""
    busy = [a for a in block.history if not simulation.known_done(a.op)]
    if busy and simulation.active:
        simulation.defer(
            RaceError(
                f"{block.describe()} was freed (its last reference dropped) while "
                f"`{busy[-1].op}` may still access it: keep pinned memory alive until an "
                "event recorded after that work has completed."
            )
        )


class PinnedPool:
    """CuPy's pinned memory pool: freed blocks are reused by any later allocation of their size.

    (The size after rounding to a power of two of allocation units, as CuPy's pool rounds.)
    """

    def __init__(self, simulation: Simulation) -> None:
        self._simulation = simulation
        self._free: dict[int, list[Block]] = defaultdict(list)

    def malloc(self, size: int) -> Block:
        """A pinned block of at least ``size`` bytes, which the host is about to write.

        Sizes are rounded as CuPy's pinned pool rounds them (:func:`round_pinned_size`), so a
        freed block serves any later request that rounds to its size: a 600-byte request reuses
        a freed 1,024-byte block, whose tail a pending copy may still read.
        """
        rounded = round_pinned_size(size)
        free = self._free[rounded]
        block = free.pop() if free else new_pinned_block(self._simulation, rounded)
        handed_to_host(self._simulation, block)
        return block

    def free(self, block: Block) -> None:
        """Take ``block`` back for reuse (no CUDA call, so host functions may drop memory)."""
        check_pinned_free(self._simulation, block)
        self._free[block.size].append(block)

    def n_free_blocks(self) -> int:
        """How many freed pinned blocks wait for reuse."""
        return sum(len(blocks) for blocks in self._free.values())

    def free_all_blocks(self) -> None:
        """Forget the cached free blocks."""
        self._free.clear()
