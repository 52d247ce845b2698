"""Simulated ``Memory``/``MemoryPointer``, pinned memory, allocation and every copy.

``alloc(size)`` takes a block from the current device's pool for the current stream (CuPy's rule,
see :mod:`.memory`); the block returns to the pool when the last :class:`Memory` reference goes.
``alloc_pinned_memory(size)`` returns a :class:`PinnedMemoryPointer`, which supports the buffer
protocol (``numpy.frombuffer(pointer, dtype, count)``), as CuPy's does.

:func:`copy` is the one copy primitive (``cudaMemcpyAsync``): it resolves both addresses
(device block, pinned block, or pageable host memory), stamps one operation on the stream and
checks a read of the source and a write of the destination. A copy into pageable host memory
makes the host wait for it (as CUDA does); the synchronous variants (``copy_from_host``,
``runtime.memcpy``, ...) run on the legacy null stream of the current device and make the host
wait too.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from cupy_parallel._src.simcuda.cargs import as_c_int
from cupy_parallel._src.simcuda.clock import (
    Clock,
    Op,
    RaceError,
    Simulation,
    SimulationError,
    happens_before,
    state,
)
from cupy_parallel._src.simcuda.memory import (
    Block,
    Chunk,
    DevicePool,
    PinnedPool,
    Region,
    access,
    check_pinned_free,
    handed_to_host,
    new_pinned_block,
    resolve,
)
from cupy_parallel._src.simcuda.streams import (
    BaseStream,
    Device,
    Stream,
    current_device,
    timeline_of,
)

__all__ = [
    "Memory",
    "MemoryPointer",
    "PinnedMemoryPointer",
    "alloc",
    "alloc_pinned_memory",
    "copy",
    "device_pool",
    "pinned_pool",
    "set_pinned_memory_allocator",
]


def device_pool() -> DevicePool:
    """The simulation's device memory pool (``cupy.get_default_memory_pool()``)."""
    simulation = state()
    pool = simulation.extensions.get("pool")
    if pool is None:
        pool = simulation.extensions["pool"] = DevicePool(simulation)
    return pool


def pinned_pool() -> PinnedPool:
    """The simulation's pinned memory pool (``cupy.get_default_pinned_memory_pool()``)."""
    simulation = state()
    pool = simulation.extensions.get("pinned_pool")
    if pool is None:
        pool = simulation.extensions["pinned_pool"] = PinnedPool(simulation)
    return pool


class Memory:
    """One pooled device allocation (a chunk of a block); it returns to the pool when it goes."""

    def __init__(self, chunk: Chunk | None, device: int, simulation: Simulation) -> None:
        self.chunk = chunk
        self.block = None if chunk is None else chunk.block
        self.device_id = device
        self.size = 0 if chunk is None else chunk.size
        self.ptr = 0 if chunk is None else chunk.block.address + chunk.offset
        self._simulation = simulation

    def __del__(self) -> None:
        if self.chunk is not None and self._simulation.active:
            with self._simulation.lock:
                self._simulation.extensions["pool"].free(self.chunk)


def _address(mem: Any) -> int:
    if isinstance(mem, ctypes.c_void_p):
        return int(mem.value or 0)
    return int(mem)


class MemoryPointer:
    """A pointer into a :class:`Memory` (``ptr`` is the simulated device address)."""

    def __init__(self, mem: Memory, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + as_c_int(offset, "offset", "ptrdiff_t")
        self.device_id = mem.device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

    def __sub__(self, offset: int) -> MemoryPointer:
        return self + -int(offset)

    def copy_from_device_async(
        self, src: MemoryPointer, size: int, stream: BaseStream | None = None
    ) -> None:
        """Copy ``size`` bytes from device pointer ``src`` (any GPU) on ``stream``."""
        copy(
            self.ptr,
            _device_pointer(src).ptr,
            as_c_int(size, "size", "size_t"),
            stream,
            "copy_from_device_async",
            into="device",
            out_of="device",
        )

    def copy_from_host_async(self, mem: Any, size: int, stream: BaseStream | None = None) -> None:
        """Copy ``size`` bytes from host address ``mem`` (pinned for true asynchrony)."""
        copy(
            self.ptr,
            _address(mem),
            as_c_int(size, "size", "size_t"),
            stream,
            "copy_from_host_async",
            into="device",
            out_of="host",
        )

    def copy_to_host_async(self, mem: Any, size: int, stream: BaseStream | None = None) -> None:
        """Copy ``size`` bytes to host address ``mem``."""
        copy(
            _address(mem),
            self.ptr,
            as_c_int(size, "size", "size_t"),
            stream,
            "copy_to_host_async",
            into="host",
            out_of="device",
        )

    def copy_from_async(self, mem: Any, size: int, stream: BaseStream | None = None) -> None:
        """Copy from a device pointer or a host address."""
        if isinstance(mem, MemoryPointer):
            self.copy_from_device_async(mem, size, stream)
        else:
            self.copy_from_host_async(mem, size, stream)

    def copy_from_device(self, src: MemoryPointer, size: int) -> None:
        """Synchronous copy on the legacy null stream (CuPy's ``cudaMemcpy``)."""
        copy(
            self.ptr,
            _device_pointer(src).ptr,
            as_c_int(size, "size", "size_t"),
            Stream.null,
            "copy_from_device",
            into="device",
            out_of="device",
            blocking=True,
        )

    def copy_from_host(self, mem: Any, size: int) -> None:
        """Synchronous copy from host memory on the legacy null stream."""
        copy(
            self.ptr,
            _address(mem),
            as_c_int(size, "size", "size_t"),
            Stream.null,
            "copy_from_host",
            into="device",
            out_of="host",
            blocking=True,
        )

    def copy_to_host(self, mem: Any, size: int) -> None:
        """Synchronous copy to host memory on the legacy null stream."""
        copy(
            _address(mem),
            self.ptr,
            as_c_int(size, "size", "size_t"),
            Stream.null,
            "copy_to_host",
            into="host",
            out_of="device",
            blocking=True,
        )

    def copy_from(self, mem: Any, size: int) -> None:
        """Synchronous copy from a device pointer or a host address."""
        if isinstance(mem, MemoryPointer):
            self.copy_from_device(mem, size)
        else:
            self.copy_from_host(mem, size)

    def memset_async(self, value: int, size: int, stream: BaseStream | None = None) -> None:
        """Set ``size`` bytes to ``value`` on ``stream``."""
        value, size = as_c_int(value, "value"), as_c_int(size, "size", "size_t")
        simulation = state()
        with simulation.lock:
            if size == 0:
                return
            found = _device_range(simulation, self.ptr, size, "memset_async")
            op = simulation.enqueue(timeline_of(stream), "memset_async")
            access(simulation, found[0], Region(found[1], found[1] + size), op, write=True)
            ctypes.memset(self.ptr, value, size)


def alloc(size: int) -> MemoryPointer:
    """``size`` bytes on the current device, from the pool of the current stream."""
    size = as_c_int(size, "size", "size_t")  # CuPy's MemoryPool.malloc(size_t size)
    simulation = state()
    with simulation.lock:
        device = current_device()
        if size == 0:
            return MemoryPointer(Memory(None, device, simulation), 0)
        key = timeline_of(None).id
        chunk = device_pool().malloc(device, size, key)
        return MemoryPointer(Memory(chunk, device, simulation), 0)


def _device_pointer(src: Any) -> MemoryPointer:
    """``src`` when a :class:`MemoryPointer` (CuPy's parameter is typed), else Cython's error."""
    if not isinstance(src, MemoryPointer):
        raise TypeError(
            "Argument 'src' has incorrect type (expected cupy.cuda.memory.MemoryPointer, got "
            f"{type(src).__name__})"
        )
    return src


def _device_range(simulation: Simulation, address: int, size: int, what: str) -> tuple[Block, int]:
    found = resolve(simulation, address, size)
    if found is None or found[0].kind != "device":
        raise SimulationError(
            f"cudaErrorInvalidValue: {what} needs device memory, got address {address:#x}."
        )
    return found


def copy(
    dst: int,
    src: int,
    size: int,
    stream: BaseStream | None,
    name: str,
    *,
    into: str | None,
    out_of: str | None,
    blocking: bool = False,
    serialize_devices: tuple[int, ...] = (),
) -> None:
    """Copy ``size`` bytes from ``src`` to ``dst`` on ``stream`` (``None``: current stream).

    ``into``/``out_of`` (``"device"``, ``"host"`` or ``None`` for either) say which memory each
    side must be, as the direction of ``cudaMemcpyHostToDevice`` etc.; a mismatch raises
    :class:`SimulationError`.

    How long the host waits follows CUDA's "API synchronization behavior", no more:

    - asynchronous copies (``blocking=False``) return at once, except into pageable host
      memory, which returns when the copy is done;
    - synchronous copies (``blocking=True``, the ``cudaMemcpy`` family): into host memory
      (pageable or pinned; host to host too) the host waits for the copy; from pinned host
      memory to a device, too (synchronous with respect to the host); from pageable host memory
      to a device, the host waits for the stream's earlier work only (the copy is then staged
      and may still be writing the device when the call returns); device to device, no
      host-side synchronisation at all.
    - ``serialize_devices`` (``cudaMemcpyPeer``): the copy is ordered after all pending work on
      every stream of those devices and before all their future work, without the host waiting.
    """
    simulation = state()
    with simulation.lock:
        if size == 0:
            return
        ends = []
        for address, side in ((src, out_of), (dst, into)):
            found = resolve(simulation, address, size)
            is_device = found is not None and found[0].kind == "device"
            if side is not None and is_device != (side == "device"):
                raise SimulationError(
                    f"cudaErrorInvalidValue: {name} expects {side} memory at {address:#x}, got "
                    f"{'device' if is_device else 'host'} memory."
                )
            ends.append(found)
        timeline = timeline_of(stream)
        if serialize_devices:
            op = simulation.enqueue_device_barrier(
                timeline, serialize_devices, f"{name} ({size} bytes)"
            )
        else:
            op = simulation.enqueue(timeline, f"{name} ({size} bytes)")
        for found, write in zip(ends, (False, True), strict=True):
            if found is not None:
                block, offset = found
                access(simulation, block, Region(offset, offset + size), op, write=write)
        source, target = (_memory_kind(found) for found in ends)
        if target == "pageable" or (blocking and target == "pinned"):
            wait: Clock | None = op.clock  # into host memory: returns when done
        elif blocking and source == "pinned":
            wait = op.clock  # pinned to device: synchronous
        elif blocking and source == "pageable":
            wait = dict(op.clock)
            wait[timeline.id] -= 1  # the stream's earlier work, then staging
        else:
            wait = None
        host_waits = wait is op.clock
        pending = _pending_host_copies(simulation)
        pending.flush_before(op)  # earlier downloads into the pinned memory this copy touches
        if target == "pinned" and not host_waits:
            pending.download(op, dst, ctypes.string_at(src, size))
        else:
            ctypes.memmove(dst, src, size)
        if source == "pinned" and not host_waits:
            pending.watch_source(op, src, size)
        if wait is not None:
            simulation.synchronize_host(wait)


class PendingHostCopies:
    """Asynchronous copies to or from pinned memory that the host has not waited for yet.

    CUDA reads and writes the pinned side of ``cudaMemcpyAsync`` while the host runs on, so the
    host must not touch it before synchronising with the copy. The simulator cannot see host
    loads and stores, so it makes them show: a download into pinned memory leaves the
    destination filled with ``0xFF`` bytes (NaN for floats; on a GPU it is undefined until the
    copy is done) and writes the data only when the host has waited for the copy, or when later
    device work ordered after it touches that memory; a host write meanwhile is reported, as is
    a host write to the pinned source of an upload before the upload is done (the bytes are
    compared with a snapshot when the host waits for the copy, or when the simulation ends).
    Such races are deferred (:meth:`.clock.Simulation.defer`) and raised when the simulation
    ends.
    """

    POISON = 0xFF

    def __init__(self, simulation: Simulation) -> None:
        self._simulation = simulation
        self._downloads: list[tuple[Op, int, bytes]] = []
        self._sources: list[tuple[Op, int, bytes]] = []

    def download(self, op: Op, dst: int, data: bytes) -> None:
        """Write ``data`` to pinned ``dst`` once ``op`` is done; poison it until then."""
        ctypes.memset(dst, self.POISON, len(data))
        entry = (op, dst, data)
        self._downloads.append(entry)
        self._simulation.add_host_func(op, self._land, entry)

    def watch_source(self, op: Op, src: int, size: int) -> None:
        """Check at ``op``'s completion that the host left pinned ``src`` as ``op`` read it."""
        entry = (op, src, ctypes.string_at(src, size))
        self._sources.append(entry)
        self._simulation.add_host_func(op, self._check_source, entry)

    def flush_before(self, op: Op) -> None:
        """Land the downloads ``op`` is ordered after (device work sees them in stream order)."""
        for entry in [e for e in self._downloads if happens_before(e[0], op)]:
            self._land(entry)

    def finish(self) -> None:
        """At the end of the simulation: check what the host never waited for."""
        for entry in list(self._sources):
            self._check_source(entry)
        for op, dst, data in self._downloads:
            self._check_poison(op, dst, len(data))

    def _land(self, entry: tuple[Op, int, bytes]) -> None:
        if entry not in self._downloads:
            return  # landed already
        self._downloads.remove(entry)
        op, dst, data = entry
        self._check_poison(op, dst, len(data))
        ctypes.memmove(dst, data, len(data))

    def _check_poison(self, op: Op, dst: int, size: int) -> None:
        """Report a host write into a pending download's target (its poison changed)."""
        if ctypes.string_at(dst, size) != bytes([self.POISON]) * size:
            self._host_wrote("into", dst, size, op)

    def _check_source(self, entry: tuple[Op, int, bytes]) -> None:
        if entry not in self._sources:
            return
        self._sources.remove(entry)
        op, src, snapshot = entry
        if ctypes.string_at(src, len(snapshot)) != snapshot:
            self._host_wrote("from", src, len(snapshot), op)

    def _host_wrote(self, direction: str, address: int, size: int, op: Op) -> None:
        self._simulation.defer(
            RaceError(
                f"Data race on pinned host memory [{address:#x}, +{size}): the host wrote it "
                f"while `{op}` may still have been copying {direction} it (an asynchronous copy "
                "reads and writes pinned memory after the call returns: touch it only after "
                "synchronising with the copy, e.g. stream.synchronize() or an event)."
            )
        )


def _pending_host_copies(simulation: Simulation) -> PendingHostCopies:
    pending = simulation.extensions.get("pending_host_copies")
    if pending is None:
        pending = simulation.extensions["pending_host_copies"] = PendingHostCopies(simulation)
        simulation.at_end(pending.finish)
    return pending


def _memory_kind(found: tuple[Block, int] | None) -> str:
    """``"device"``, ``"pinned"`` or ``"pageable"`` (memory the simulation does not manage)."""
    return "pageable" if found is None else found[0].kind


@functools.cache
def _pinned_type(size: int) -> Any:
    return type("PinnedMemoryPointer", (ctypes.c_ubyte * size, _PinnedMixin), {})


class _PinnedMixin:
    block: Block
    ptr: int
    size: int
    _simulation: Simulation

    _pooled: bool

    def __del__(self) -> None:
        if self._simulation.active:
            with self._simulation.lock:
                if self._pooled:
                    self._simulation.extensions["pinned_pool"].free(self.block)
                else:
                    _free_host(self._simulation, self.block)


PinnedMemoryPointer = _PinnedMixin


def alloc_pinned_memory(size: int) -> Any:
    """``size`` bytes of pinned host memory (buffer protocol supported).

    From the pinned pool, or with ``cudaHostAlloc`` after ``set_pinned_memory_allocator(None)``
    (then dropping the last reference calls ``cudaFreeHost``, a CUDA call).
    """
    size = as_c_int(size, "size", "size_t")
    simulation = state()
    allocator = simulation.extensions.get("pinned_allocator", _POOLED)
    if allocator is not _POOLED and allocator is not None:
        return allocator(size)
    with simulation.lock:
        pooled = allocator is _POOLED
        block = pinned_pool().malloc(size) if pooled else _host_alloc(simulation, size)
        pointer = _pinned_type(max(int(size), 1)).from_buffer(block.buffer)
        pointer.block, pointer.ptr, pointer.size = block, block.address, int(size)
        pointer._simulation, pointer._pooled = simulation, pooled
        return pointer


_POOLED: Any = object()  # the default pinned allocator: the simulation's pool


def _host_alloc(simulation: Simulation, size: int) -> Block:
    """``cudaHostAlloc``: a new pinned block (the pool disabled), which the host then writes."""
    block = new_pinned_block(simulation, max(size, 1))
    handed_to_host(simulation, block)
    return block


def _free_host(simulation: Simulation, block: Block) -> None:
    """``cudaFreeHost``: a CUDA call, which CUDA forbids inside a host function."""
    check_pinned_free(simulation, block)
    if simulation.in_host_func:
        simulation.defer(
            SimulationError(
                f"cudaErrorNotPermitted: cudaFreeHost of {block.describe()} inside a host "
                "function (cudaLaunchHostFunc): CUDA forbids CUDA calls there, and with the "
                "pinned pool disabled (set_pinned_memory_allocator(None)) dropping the last "
                "reference to pinned memory calls it; drop it on a host thread instead."
            )
        )


def set_pinned_memory_allocator(allocator: Any = None) -> None:
    """CuPy's ``set_pinned_memory_allocator``: ``None`` disables the pinned pool.

    Without the pool every allocation is a ``cudaHostAlloc`` and every drop a ``cudaFreeHost``;
    ``cupy.get_default_pinned_memory_pool().malloc`` (the default) restores it, and any other
    callable taking a size and returning pinned memory is used as it is.
    """
    simulation = state()
    if allocator is not None and not callable(allocator):
        raise TypeError(f"allocator must be callable or None, got {type(allocator).__name__}.")
    simulation.extensions["pinned_allocator"] = (
        _POOLED if allocator is not None and allocator == pinned_pool().malloc else allocator
    )
