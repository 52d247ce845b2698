"""Simulated ``cupy.cuda.Device``, ``Stream``, ``ExternalStream``, ``Event`` and current streams.

As in CuPy, the current device and the current stream of each device are per host thread; a
thread starts on device 0 with the default stream, which is ``Stream.null`` (the legacy null
stream, ``ptr == 0``) or, when the simulation runs with per-thread default streams
(``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``), ``Stream.ptds`` (``ptr == 2``). Both singletons have
``device_id == -1`` and mean "that stream of the *current* device (and, for ``ptds``, of the
*calling thread*)", resolved when work is queued: so a ``Stream.ptds`` handed to another thread
means that thread's own stream there, as in CUDA.

``with stream:`` requires the stream's device to be current (CuPy raises ``RuntimeError``).
Kernels must run on a stream of the current device; copies may use a stream of any device.
An ``Event`` belongs to the device current at its creation and can only be recorded on a stream
of that device; ``Stream.wait_event`` accepts events of any device.

For add-ons (:mod:`.sim_nccl`): :func:`timeline_of` resolves a stream (or ``None``: the current
stream) to its :class:`.clock.Timeline`; :func:`from_handle` reads a raw stream handle
(``stream.ptr``, as NCCL calls take it); :func:`current_device` / :func:`set_device`;
``Event.op`` is the recorded :class:`.clock.Op` (``None`` before ``record``).
"""

from __future__ import annotations

import itertools
import threading
import warnings
from typing import Any, ClassVar

from cupy_parallel._src.simcuda.cargs import as_c_int
from cupy_parallel._src.simcuda.clock import (
    Op,
    Simulation,
    SimulationError,
    Timeline,
    join,
    state,
)

__all__ = [
    "BaseStream",
    "Device",
    "Event",
    "ExternalStream",
    "Stream",
    "contexts",
    "current_device",
    "from_handle",
    "get_current_stream",
    "set_device",
    "timeline_of",
    "use_context",
]

_LEGACY_PTR = 0
_PER_THREAD_PTR = 2
_pointers = itertools.count(0x7E5700)
_EXTERNAL_DEPRECATED = (  # CuPy 14's words
    "ExternalStream is deprecated. Use Stream.from_external() instead to interoperate with "
    "external streams that implement the CUDA stream protocol."
)


def _local(simulation: Simulation) -> threading.local:
    tls = simulation.extensions.get("tls")
    if tls is None:
        with simulation.lock:
            tls = simulation.extensions.setdefault("tls", threading.local())
    return tls


def current_device() -> int:
    """The calling thread's current GPU (0 until set)."""
    return int(getattr(_local(state()), "device", 0))


def use_context() -> None:
    """Note that the calling thread uses the CUDA context of its current device.

    A thread's first CUDA call creates (or binds) the primary context of its current device,
    which is GPU 0 in a thread that never set one: on a real GPU that costs memory on GPU 0
    (about 0.5 GiB on an H100) for every process whose helper threads forget to set their
    device. :func:`contexts` tells which thread used which device, for tests.
    """
    simulation = state()
    used = simulation.extensions.setdefault("contexts", {})
    used.setdefault(threading.current_thread().name, set()).add(current_device())


def contexts() -> dict[str, set[int]]:
    """The GPUs whose context each thread (by name) has used so far in the simulation."""
    return {name: set(devices) for name, devices in state().extensions.get("contexts", {}).items()}


def set_device(device: int) -> None:
    """Make ``device`` the calling thread's current GPU (``cudaSetDevice``)."""
    simulation = state()
    simulation.check_device(device)
    _local(simulation).device = device


class Device:
    """A simulated GPU; as a context manager it is the current device for the block."""

    def __init__(self, device: Any = None) -> None:
        self.id = current_device() if device is None else int(device)
        self._previous: list[int] = []

    def __enter__(self) -> Device:
        previous = current_device()
        set_device(self.id)
        self._previous.append(previous)
        return self

    def __exit__(self, *exc_info: object) -> None:
        set_device(self._previous.pop())

    def use(self) -> None:
        """Make this device current (without restoring the previous one)."""
        set_device(self.id)

    def synchronize(self) -> None:
        """The host waits for all work queued on every stream of this device."""
        simulation = state()
        simulation.check_device(self.id)
        with simulation.lock:
            for timeline in simulation.timelines:
                if timeline.device == self.id:
                    simulation.synchronize_host(timeline.clock)

    @property
    def compute_capability(self) -> str:
        return "90"

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    # As CuPy's Device: comparable, convertible with int(), but not hashable and no __index__.
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class BaseStream:
    """What every simulated stream is and does (CuPy's ``_BaseStream``).

    ``Stream`` and ``ExternalStream`` both derive from it, as in CuPy: an ``ExternalStream`` is
    not a ``Stream``.
    """

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: Any = None,
    ) -> None:
        self._simulation: Simulation | None = None
        self._timeline: Timeline | None = None
        self._non_blocking = False
        if null:
            self.ptr, self.device_id = _LEGACY_PTR, -1
        elif ptds:
            self.ptr, self.device_id = _PER_THREAD_PTR, -1
        else:
            simulation = state()
            device = current_device()
            kind = "non_blocking" if non_blocking else "blocking"
            self.ptr, self.device_id = next(_pointers) * 16, device
            name = f"stream {self.ptr:#x} ({kind.replace('_', '-')}) of cuda:{device}"
            self._simulation = simulation
            self._timeline = simulation.new_timeline(name, kind, device)
            self._non_blocking = non_blocking
            simulation.extensions.setdefault("streams", {})[self.ptr] = self

    def timeline(self) -> Timeline:
        """The queue this stream means now (for the singletons: current device and thread)."""
        simulation = state()
        if self._timeline is None:
            device = current_device()
            if self.ptr == _PER_THREAD_PTR:
                return simulation.per_thread_stream(device)
            return simulation.legacy[device]
        if self._simulation is not simulation:
            raise SimulationError(f"{self!r} belongs to a CUDA simulation that has ended.")
        return self._timeline

    @property
    def is_non_blocking(self) -> bool:
        """Whether the stream skips the legacy null stream's implicit synchronisation."""
        return self._non_blocking

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BaseStream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"

    def __enter__(self) -> BaseStream:
        device = _check_current(self.device_id)
        local = _local(state())
        local.__dict__.setdefault("stack", []).append((device, get_current_stream(device)))
        _set_current(device, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        device, previous = _local(state()).stack.pop()
        _set_current(device, previous)

    def use(self) -> BaseStream:
        """Make this stream current on its device."""
        _set_current(_check_current(self.device_id), self)
        return self

    @property
    def done(self) -> bool:
        """Whether all queued work is known complete (the host synchronised with it)."""
        use_context()
        simulation = state()
        with simulation.lock:
            timeline = self.timeline()
            return simulation.host.clock.get(timeline.id, 0) >= timeline.clock.get(timeline.id, 0)

    def synchronize(self) -> None:
        """The host waits for all work queued on this stream."""
        use_context()
        simulation = state()
        with simulation.lock:
            simulation.synchronize_host(self.timeline().clock)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one by default) after the work queued so far."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        """Future work on this stream waits for the work ``event`` captured when recorded."""
        simulation = state()
        with simulation.lock:
            timeline = self.timeline()
            if event.op is not None:
                join(timeline.clock, event.op.clock)
            simulation.enqueue(timeline, "wait_event")

    def launch_host_func(self, callback: Any, arg: Any) -> None:
        """Call ``callback(arg)`` once the work queued so far is complete (on host sync)."""
        simulation = state()
        with simulation.lock:
            op = simulation.enqueue(self.timeline(), f"host function {callback!r}")
            simulation.add_host_func(op, callback, arg)

    def add_callback(self, callback: Any, arg: Any) -> None:
        """Call ``callback(stream, 0, arg)`` once the work queued so far is complete."""
        self.launch_host_func(lambda a: callback(self, 0, a), arg)


class Stream(BaseStream):
    """A simulated CUDA stream (``null``/``ptds`` singletons, or a new stream of the device)."""

    null: ClassVar[Stream]
    ptds: ClassVar[Stream]


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)


class ExternalStream(BaseStream):
    """A stream given by its handle ``ptr`` (a simulated stream's ``ptr``, 0 or 2).

    Deprecated in CuPy 14, which warns when one is made (``DeprecationWarning``); so does this.
    """

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        warnings.warn(_EXTERNAL_DEPRECATED, DeprecationWarning, stacklevel=2)
        self._attach(ptr, device_id)

    def _attach(self, ptr: int, device_id: int) -> None:
        super().__init__(null=True)
        self.ptr, self.device_id = int(ptr), int(device_id)
        if self.ptr not in (_LEGACY_PTR, _PER_THREAD_PTR):
            simulation = state()
            known = simulation.extensions.get("streams", {}).get(self.ptr)
            if known is None:
                raise SimulationError(f"cudaErrorInvalidResourceHandle: no stream {self.ptr:#x}.")
            self._simulation, self._timeline = simulation, known.timeline()
            self._non_blocking = known.is_non_blocking


def from_handle(handle: int) -> BaseStream:
    """The stream with raw handle ``handle`` (``Stream.ptr``; 0 or 1 legacy, 2 per-thread)."""
    if handle in (_LEGACY_PTR, 1):
        return Stream.null
    if handle == _PER_THREAD_PTR:
        return Stream.ptds
    stream = ExternalStream.__new__(ExternalStream)  # no deprecation: not the caller's doing
    stream._attach(handle, -1)
    return stream


def _check_current(device_id: int) -> int:
    current = current_device()
    if device_id not in (-1, current):
        raise RuntimeError(
            f"The device that the stream is created on ({device_id}) does not match with "
            f"the current device ({current})"
        )
    return current


def _set_current(device: int, stream: BaseStream) -> None:
    _local(state()).__dict__.setdefault("current", {})[device] = stream


def get_current_stream(device_id: int = -1) -> BaseStream:
    """The calling thread's current stream on ``device_id`` (default: the current device)."""
    device_id = as_c_int(device_id, "device_id")
    simulation = state()
    device = current_device() if device_id == -1 else device_id
    simulation.check_device(device)
    current = _local(simulation).__dict__.get("current", {})
    stream = current.get(device)
    if stream is None:
        if simulation.extensions.get("threads_start_non_blocking"):
            # every thread starts with a non-blocking stream of its own made current on each
            # GPU, as a program that makes one current in each of its threads
            with Device(device):
                stream = Stream(non_blocking=True)
            _local(simulation).__dict__.setdefault("current", {})[device] = stream
            return stream
        return Stream.ptds if simulation.per_thread_default_stream else Stream.null
    return stream


def timeline_of(stream: BaseStream | None) -> Timeline:
    """The timeline of ``stream``, or of the current stream of the current device."""
    return (get_current_stream() if stream is None else stream).timeline()


class Event:
    """A simulated CUDA event of the device current at creation."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self.device = current_device()
        self.op: Op | None = None

    def record(self, stream: BaseStream | None = None) -> None:
        """Capture the work queued so far on ``stream`` (default: the current stream)."""
        simulation = state()
        with simulation.lock:
            timeline = timeline_of(stream)
            if timeline.device != self.device:
                raise SimulationError(
                    f"cudaErrorInvalidResourceHandle: an event created on cuda:{self.device} "
                    f"cannot be recorded on the {timeline.name}."
                )
            self.op = simulation.enqueue(timeline, "record event")

    @property
    def done(self) -> bool:
        """Whether the captured work is known complete (never-recorded events are done)."""
        use_context()
        return self.op is None or state().known_done(self.op)

    def synchronize(self) -> None:
        """The host waits for the captured work."""
        use_context()
        simulation = state()
        with simulation.lock:
            if self.op is not None:
                simulation.synchronize_host(self.op.clock)
