"""Vector clocks, timelines and the happens-before rules of the simulated CUDA.

Every place work runs in order is a :class:`Timeline`: one per CUDA stream (the legacy null stream
of each GPU, each thread's per-thread default stream on each GPU, every created stream) and one
for the host. Each timeline carries a vector clock (``dict[timeline id, tick]``). Enqueueing an
operation on a stream joins the host's clock into the stream's (work starts after it is launched),
applies the legacy null stream's implicit synchronisation, ticks the stream and stamps the
operation (:class:`Op`) with a copy of the clock. ``record`` copies a stream's clock into an
event, ``wait_event`` joins it into a stream, and host synchronisation (``Stream.synchronize``,
``Event.synchronize``, ``Device.synchronize``, blocking copies) joins clocks into the host's.

An operation ``a`` happens before ``b`` iff ``a.clock[a.timeline] <= b.clock[a.timeline]``.

Host threads share ONE host timeline: Python threads hand data over through locks, queues and
``join``, which the simulator does not see, so host-side order between threads is assumed (only
device work and its ordering against the host is checked). Execution is eager: an operation's
effect on memory happens when it is enqueued, under one global lock; the clocks decide whether the
order used was one CUDA guarantees, and :mod:`.memory` raises :class:`RaceError` when it is not.

The simulated GPU completes work only when the host waits for it: ``Event.done`` and
``Stream.done`` are ``True`` only for work the host has already synchronised with (the most
adversarial legal schedule), and host functions (``Stream.launch_host_func``) run when the host
synchronises with a point after them.

Public (for :mod:`.sim_nccl` and tests): :func:`state`, :class:`Simulation` (``enqueue``,
``enqueue_group`` for collectives, ``host_op``, ``synchronize_host``, ``known_done``, ``lock``,
``extensions`` for add-on state, ``races``), :func:`happens_before`, :class:`Timeline`,
:class:`Op`, :class:`RaceError`. An add-on operation on memory does, under ``state().lock``:
``op = state().enqueue(streams.timeline_of(stream), "name")`` (or ``enqueue_group``), then
``memory.access(sim, block, Region(offset, offset + n), op, write=...)`` for each buffer
(``memory.resolve(sim, ptr, n)`` gives ``(block, offset)``), then the effect (``ctypes.memmove``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "Op",
    "RaceError",
    "Simulation",
    "SimulationError",
    "Timeline",
    "activate",
    "deactivate",
    "happens_before",
    "state",
]

Clock = dict[int, int]


class SimulationError(RuntimeError):
    """Misuse of the simulated CUDA that real CUDA would reject (wrong device, ended simulation)."""


class RaceError(RuntimeError):
    """Two conflicting accesses to device or pinned memory that CUDA does not order.

    The message names both operations and the streams they ran on.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.testing import RaceError, simulated_cuda
        >>> with simulated_cuda(1) as cupy:
        ...     x = cupy.zeros(3)  # written on the legacy null stream
        ...     with cupy.cuda.Stream(non_blocking=True):  # which this one does not wait for
        ...         try:
        ...             x += 1
        ...         except RaceError as error:
        ...             print(str(error).split(":")[0])
        Data race on cuda
    """


def join(into: Clock, other: Clock) -> None:
    """``into = max(into, other)`` elementwise, in place."""
    for key, tick in other.items():
        if into.get(key, 0) < tick:
            into[key] = tick


@dataclass(eq=False)
class Timeline:
    """One in-order queue of work: a stream on a device, or the host.

    ``kind`` is ``"legacy"`` (the legacy null stream), ``"ptds"`` (a per-thread default stream),
    ``"blocking"`` / ``"non_blocking"`` (created streams) or ``"host"``.
    """

    id: int
    name: str
    kind: str
    device: int
    clock: Clock = field(default_factory=dict)

    @property
    def blocking(self) -> bool:
        """Whether the legacy null stream synchronises with this stream implicitly."""
        return self.kind in ("blocking", "ptds")

    def tick(self) -> Clock:
        self.clock[self.id] = self.clock.get(self.id, 0) + 1
        return dict(self.clock)


@dataclass(eq=False)
class Op:
    """One operation: what it was, where it ran, and its vector clock."""

    name: str
    timeline: Timeline
    clock: Clock

    @property
    def tick(self) -> int:
        return self.clock[self.timeline.id]

    def __str__(self) -> str:
        return f"{self.name} on {self.timeline.name}"


def happens_before(a: Op, b: Op) -> bool:
    """Whether ``a`` happens before ``b`` (or is ``b``)."""
    return a.tick <= b.clock.get(a.timeline.id, 0)


class Simulation:
    """The state of one simulated machine: its GPUs, timelines and host clock."""

    def __init__(self, n_devices: int, *, per_thread_default_stream: bool) -> None:
        self.n_devices = n_devices
        self.per_thread_default_stream = per_thread_default_stream
        self.lock = threading.RLock()
        self.active = True
        self._ids = itertools.count(1)
        self.host = self.new_timeline("the host", "host", -1)
        self.timelines: list[Timeline] = []
        self.legacy = [
            self.new_timeline(f"legacy null stream of cuda:{d}", "legacy", d)
            for d in range(n_devices)
        ]
        self._ptds: dict[tuple[int, int], Timeline] = {}
        self.races: list[RaceError] = []
        self.deferred: list[RuntimeError] = []
        self.in_host_func = False  # while host functions (cudaLaunchHostFunc) run
        self._host_funcs: list[tuple[Op, Callable[[Any], None], Any]] = []
        self._end_checks: list[Callable[[], None]] = []
        self.extensions: dict[str, Any] = {}  # per-simulation state of add-ons (e.g. NCCL)
        self._device_barriers: dict[int, Clock] = {}  # cudaMemcpyPeer: future work after it
        self._external: list[tuple[Op, Callable[[], bool]]] = []  # see external()

    def new_timeline(self, name: str, kind: str, device: int) -> Timeline:
        """A new timeline: a stream of GPU ``device``, or (``device`` -1) the host or an outsider.

        Only streams are kept in :attr:`timelines` (the legacy null stream and device barriers
        look through them).
        """
        timeline = Timeline(next(self._ids), name, kind, device)
        if device >= 0:
            self.timelines.append(timeline)
        return timeline

    def per_thread_stream(self, device: int) -> Timeline:
        """The calling thread's per-thread default stream on ``device``."""
        thread = threading.current_thread()
        key = (thread.ident or 0, device)
        timeline = self._ptds.get(key)
        if timeline is None:
            name = f"per-thread default stream of thread {thread.name!r} on cuda:{device}"
            timeline = self._ptds[key] = self.new_timeline(name, "ptds", device)
        return timeline

    def check_device(self, device: int) -> None:
        if not 0 <= device < self.n_devices:
            raise SimulationError(
                f"cudaErrorInvalidDevice: invalid device ordinal {device} "
                f"(the simulation has {self.n_devices} GPUs)."
            )

    # -- ordering -------------------------------------------------------------------------

    def enqueue(self, timeline: Timeline, name: str) -> Op:
        """Stamp a new operation on a stream: after the host's past and CUDA's implicit syncs."""
        self._prepare(timeline)
        return Op(name, timeline, timeline.tick())

    def enqueue_group(
        self,
        timelines: list[Timeline],
        name: str,
        sources: list[list[int]] | None = None,
    ) -> list[Op]:
        """Stamp one operation on each stream, each completing after the members it receives from.

        For collectives (an NCCL call on each rank's stream inside one group). Member ``i``'s
        operation happens after everything queued before it on its own stream and on the streams
        of ``sources[i]``, the members whose data it receives (default: every member, as for
        ``allReduce``): a receiver is ordered after each sender's writes of what it sends, while a
        member that only sends (a broadcast's root, a ``reduce``'s other ranks, a ``send``) may
        finish before its peers even start, as NCCL's buffered protocols allow.
        """
        for timeline in timelines:
            self._prepare(timeline)
        before = [dict(timeline.clock) for timeline in timelines]
        everyone = list(range(len(timelines)))
        ops = []
        for i, timeline in enumerate(timelines):
            for j in everyone if sources is None else sources[i]:
                join(timeline.clock, before[j])
            ops.append(Op(name, timeline, timeline.tick()))
        return ops

    def enqueue_device_barrier(self, timeline: Timeline, devices: tuple[int, ...], name: str) -> Op:
        """Stamp an operation ordered after all pending and before all future work on ``devices``.

        (``cudaMemcpyPeer``'s serialisation.) Every stream of those devices, existing or made
        later, starts its next operation after this one; the host does not wait.
        """
        self._prepare(timeline)
        for other in self.timelines:
            if other.device in devices:
                join(timeline.clock, other.clock)
        op = Op(name, timeline, timeline.tick())
        for device in devices:
            join(self._device_barriers.setdefault(device, {}), op.clock)
        return op

    def external(self, op: Op, finished: Callable[[], bool]) -> None:
        """Order the host after ``op`` (work outside CUDA) once ``finished()`` says it is done.

        For a library that accesses device memory itself, such as a CUDA-aware MPI: the host
        learns of its completion outside CUDA (an MPI request tested done), so ``finished`` is
        asked before each new operation is stamped, and the first time it answers ``True`` the
        host's clock joins ``op``'s (work queued after that is ordered after ``op``).
        """
        self._external.append((op, finished))

    def _learn_external(self) -> None:
        if not self._external:
            return
        done = [entry for entry in self._external if entry[1]()]
        if done:
            self._external = [entry for entry in self._external if entry not in done]
            for op, _ in done:
                join(self.host.clock, op.clock)

    def _prepare(self, timeline: Timeline) -> None:
        self._learn_external()
        clock = timeline.clock
        join(clock, self.host.clock)
        barrier = self._device_barriers.get(timeline.device)
        if barrier is not None:
            join(clock, barrier)
        if timeline.kind == "legacy":
            for other in self.timelines:
                if other.blocking and other.device == timeline.device:
                    join(clock, other.clock)
        elif timeline.blocking:
            join(clock, self.legacy[timeline.device].clock)

    def host_op(self, name: str) -> Op:
        """Stamp an operation of the host (e.g. a host write of pinned memory)."""
        self._learn_external()
        return Op(name, self.host, self.host.tick())

    def synchronize_host(self, clock: Clock) -> None:
        """The host waits for every operation ``clock`` covers; due host functions run."""
        join(self.host.clock, clock)
        self._run_host_funcs()

    def add_host_func(self, op: Op, func: Callable[[Any], None], arg: Any) -> None:
        self._host_funcs.append((op, func, arg))

    def at_end(self, check: Callable[[], None]) -> None:
        """Run ``check()`` when the simulation ends (it may :meth:`defer` races)."""
        self._end_checks.append(check)

    def finish(self) -> None:
        """The end of the simulation: run the end checks (their races are deferred)."""
        for check in self._end_checks:
            check()

    def _run_host_funcs(self) -> None:
        due = [entry for entry in self._host_funcs if self.known_done(entry[0])]
        if not due:
            return
        self._host_funcs = [entry for entry in self._host_funcs if entry not in due]
        running, self.in_host_func = self.in_host_func, True
        try:
            for _, func, arg in due:
                func(arg)
        finally:
            self.in_host_func = running

    def known_done(self, op: Op) -> bool:
        """Whether the host has already synchronised with ``op`` (so it is complete)."""
        return self.host.clock.get(op.timeline.id, 0) >= op.tick

    def race(self, error: RaceError) -> RaceError:
        """Note a race that is raised where it happens; returns it for ``raise``."""
        self.races.append(error)
        return error

    def defer(self, error: RuntimeError) -> None:
        """Note a race or misuse found where nothing can raise (a finaliser); raised at the end."""
        if isinstance(error, RaceError):
            self.races.append(error)
        self.deferred.append(error)


_active: Simulation | None = None


def activate(simulation: Simulation) -> None:
    global _active
    if _active is not None:
        raise SimulationError("A CUDA simulation is already active; simulations do not nest.")
    _active = simulation


def deactivate(simulation: Simulation) -> None:
    global _active
    simulation.active = False
    if _active is simulation:
        _active = None


def state() -> Simulation:
    """The active simulation; :class:`SimulationError` outside ``simulated_cuda``."""
    simulation = _active
    if simulation is None:
        raise SimulationError(
            "The simulated CUDA is used outside its simulation; use it inside "
            "`with cupy_parallel.testing.simulated_cuda(n):`."
        )
    return simulation
