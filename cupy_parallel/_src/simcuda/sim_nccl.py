"""Simulated ``cupy.cuda.nccl``: NCCL communicators whose members are threads or GPUs of a thread.

The API is CuPy's (``cupy_backends/cuda/libs/nccl.pyx``, CuPy >= 14): :class:`NcclCommunicator`
(``NcclCommunicator(ndev, commId: bytes, rank)``, ``initAll(devices)``, ``allReduce``,
``reduce``, ``broadcast``, ``bcast``, ``reduceScatter``, ``allGather``, ``send``, ``recv``,
``abort``, ``destroy``, ``check_async_error``, ``device_id``, ``rank_id``, ``size``),
:func:`get_unique_id`, :func:`groupStart`/:func:`groupEnd`, :func:`get_version`,
:func:`get_build_version`, :class:`NcclError` and the ``NCCL_*`` constants. Buffers are device
pointers (``x.data.ptr``) and streams are handles (``stream.ptr``), as with the real library.

How it runs:

- A member is a communicator of one rank on one GPU (the current device when it was made). The
  ranks of a communicator can be threads (one ``NcclCommunicator(n, uid, rank)`` each, the unique
  id handed over as bytes) or the GPUs of one thread (``initAll``, or several constructors inside
  ``groupStart``/``groupEnd``).
- Each call is an NCCL kernel on the member's stream. When the last member has launched its
  call (at the call, or at ``groupEnd`` inside a group), every member's kernel is stamped with
  the simulation's vector clock, all together (each completes only after all started, as NCCL's
  kernels synchronise), and reads its send buffer and writes its receive buffer through the race
  checker: using a buffer before the work that produced it is ordered before the call, or
  reusing it while the call may still read it, raises ``RaceError`` naming both operations and
  their streams.
- Calls of a communicator match in order: the k-th collective of every member, and the k-th
  send from rank a to rank b with the k-th receive at b from a. Members that disagree (another
  operation, count, datatype, reduction or root) raise :class:`SimulationError` naming both
  calls; real NCCL would hang or corrupt data.
- The data moves when the last member has launched its call, and the launching thread blocks
  (in the call, or in ``groupEnd``) until then, so what it queues afterwards on the stream sees
  the result. A member that never comes therefore blocks its peers on the host, as NCCL's lazy
  connection set-up inside a first ``groupEnd`` can; ``abort()`` of a blocked member's
  communicator (from another thread, as a watchdog does) makes the wait raise
  :class:`NcclError`, and a wait longer than :func:`set_deadlock_limit` (default 60 s) raises
  :class:`SimulationError`. Creating communicators waits for every rank the same way.
- Reductions compute in the wire datatype, rank after rank (``float16`` stays ``float16``);
  ``NCCL_AVG`` divides the sum by the number of ranks, integers toward zero. ``bfloat16`` is
  widened to float32 per step and rounded to nearest even.
- As on the simulated GPU in general, an event recorded after a call is ``done`` only once the
  host waited for it (see :mod:`.clock`); code that polls ``done`` with a timeout (a watchdog)
  sees a GPU that never finishes unless the host synchronises.

Knobs for tests: :func:`set_version` (the NCCL version both getters report; default 2.18.5),
:func:`set_deadlock_limit`, :meth:`NcclCommunicator.inject_async_error`.

Example:
    >>> import cupy_parallel
    >>> from cupy_parallel.testing import simulated_cuda
    >>> with simulated_cuda(2) as cupy:
    ...     nccl = cupy.cuda.nccl
    ...     comms = nccl.NcclCommunicator.initAll([0, 1])
    ...     xs = []
    ...     for device in (0, 1):
    ...         with cupy.cuda.Device(device):
    ...             xs.append(cupy.full(3, device + 1.0))
    ...     nccl.groupStart()
    ...     for comm, x in zip(comms, xs):
    ...         with cupy.cuda.Device(comm.device_id()):
    ...             comm.allReduce(x.data.ptr, x.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
    ...     nccl.groupEnd()
    ...     [x.get().tolist() for x in xs]
    [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cupy_parallel._src.simcuda.cargs import as_c_int
from cupy_parallel._src.simcuda.clock import Op, Simulation, SimulationError, Timeline, state
from cupy_parallel._src.simcuda.memory import Region, access, resolve
from cupy_parallel._src.simcuda.streams import current_device, from_handle, set_device

__all__ = [
    "NCCL_AVG",
    "NCCL_BFLOAT16",
    "NCCL_FLOAT16",
    "NCCL_FLOAT32",
    "NCCL_FLOAT64",
    "NCCL_INT8",
    "NCCL_INT32",
    "NCCL_INT64",
    "NCCL_MAX",
    "NCCL_MIN",
    "NCCL_PROD",
    "NCCL_SUM",
    "NCCL_UINT8",
    "NCCL_UINT32",
    "NCCL_UINT64",
    "NcclCommunicator",
    "NcclError",
    "available",
    "get_build_version",
    "get_unique_id",
    "get_version",
    "groupEnd",
    "groupStart",
    "set_deadlock_limit",
    "set_version",
]

available = True

# ncclDataType_t
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
# ncclRedOp_t
NCCL_SUM = 0
NCCL_PROD = 1
NCCL_MAX = 2
NCCL_MIN = 3
NCCL_AVG = 4
# ncclResult_t (NCCL 2 numbering)
NCCL_ERROR_INVALID_ARGUMENT = 4
NCCL_ERROR_INVALID_USAGE = 5
NCCL_ERROR_REMOTE_ERROR = 6

_UNIQUE_ID_BYTES = 128
_DEFAULT_VERSION = 21805
_ERROR_NAMES = {
    NCCL_ERROR_INVALID_ARGUMENT: "NCCL_ERROR_INVALID_ARGUMENT",
    NCCL_ERROR_INVALID_USAGE: "NCCL_ERROR_INVALID_USAGE",
    NCCL_ERROR_REMOTE_ERROR: "NCCL_ERROR_REMOTE_ERROR",
}
# datatype -> the NumPy dtype of its values (bfloat16: its bits, as uint16)
_WIRE: dict[int, np.dtype[Any]] = {
    NCCL_INT8: np.dtype(np.int8),
    NCCL_UINT8: np.dtype(np.uint8),
    NCCL_INT32: np.dtype(np.int32),
    NCCL_UINT32: np.dtype(np.uint32),
    NCCL_INT64: np.dtype(np.int64),
    NCCL_UINT64: np.dtype(np.uint64),
    NCCL_FLOAT16: np.dtype(np.float16),
    NCCL_FLOAT32: np.dtype(np.float32),
    NCCL_FLOAT64: np.dtype(np.float64),
    NCCL_BFLOAT16: np.dtype(np.uint16),
}
_OPS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}
_OP_NAMES = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}


class NcclError(RuntimeError):
    """An NCCL call failed; ``status`` is its ``ncclResult_t``."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        name = _ERROR_NAMES.get(status, f"NCCL error {status}")
        super().__init__(f"{name}: {detail}" if detail else name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, str(self)))


# ---------------------------------------------------------------------------------------------
# Per-simulation state


@dataclass(eq=False)
class _Clique:
    """The members of one communicator (one unique id), and their calls waiting to match."""

    nranks: int
    members: dict[int, NcclCommunicator] = field(default_factory=dict)
    error: str | None = None  # why the communicator could not be created
    issued: dict[Any, int] = field(default_factory=dict)  # channel -> calls issued so far
    slots: dict[Any, _Slot] = field(default_factory=dict)


@dataclass(eq=False)
class _Slot:
    """One operation of a communicator: the calls of its members so far."""

    expected: int
    calls: dict[Any, _Call] = field(default_factory=dict)
    done: bool = False
    error: str | None = None  # the members' calls do not match


@dataclass(eq=False)
class _Call:
    kind: str
    comm: NcclCommunicator
    args: dict[str, int]
    timeline: Timeline | None = None
    op: Op | None = None

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.args.items() if k not in ("send", "recv"))
        return f"{self.kind}({shown}) by rank {self.comm._rank}"


class _State:
    def __init__(self) -> None:
        self.version = _DEFAULT_VERSION
        self.deadlock_limit = 60.0
        self.cliques: dict[bytes, _Clique] = {}
        self.changed = threading.Condition(threading.Lock())


def _state(simulation: Simulation | None = None) -> _State:
    simulation = simulation or state()
    found = simulation.extensions.get("nccl")
    if found is None:
        with simulation.lock:
            found = simulation.extensions.setdefault("nccl", _State())
    return found


_local = threading.local()  # the calling thread's open group: a list of pending calls


def set_version(code: int) -> None:
    """Make :func:`get_version` and :func:`get_build_version` report ``code`` (e.g. 2909)."""
    _state().version = int(code)


def set_deadlock_limit(seconds: float) -> None:
    """After how long a call waiting for its peers raises :class:`SimulationError`."""
    _state().deadlock_limit = float(seconds)


def get_version() -> int:
    """The (simulated) NCCL version code, ``NCCL_VERSION(2, 18, 5)`` unless set."""
    return _state().version


def get_build_version() -> int:
    """The version CuPy was built with: the same as :func:`get_version` here."""
    return _state().version


def get_unique_id() -> bytes:
    """A new unique id: 128 random bytes (CuPy >= 14 returns bytes)."""
    return os.urandom(_UNIQUE_ID_BYTES)


def groupStart() -> None:  # noqa: N802 - NCCL's name
    """Start a group: calls made until :func:`groupEnd` are launched together there."""
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.pending = []
    _local.depth = depth + 1


def groupEnd() -> None:  # noqa: N802 - NCCL's name
    """Launch the group's calls and wait until every one of them has matched its peers."""
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        raise NcclError(NCCL_ERROR_INVALID_USAGE, "groupEnd() without groupStart()")
    _local.depth = depth - 1
    if depth > 1:
        return
    pending: list[Any] = _local.pending
    _local.pending = []
    _run(pending)


def _run(pending: list[Any]) -> None:
    """Launch ``pending`` (calls, and cliques to join) in order, then wait for all of them.

    NCCL forbids calls on one communicator from two threads at once (a communicator is not
    thread-safe; only ``ncclCommAbort`` and ``ncclCommGetAsyncError`` may come from another
    thread): a call while another thread is inside a call of the same member raises
    :class:`SimulationError` naming both threads.
    """
    nccl = _state()
    comms = list(dict.fromkeys(item.comm for item in pending if isinstance(item, _Call)))
    me = threading.current_thread()
    with nccl.changed:
        for comm in comms:
            other = comm._user
            if other is not None and other[0] is not me:
                raise SimulationError(
                    f"simulated NCCL: thread {me.name!r} calls rank {comm._rank}'s communicator "
                    f"while thread {other[0].name!r} is inside {other[1]} on it; NCCL forbids "
                    "concurrent calls on one communicator (serialise them, e.g. with a lock)."
                )
        what = " + ".join(item.describe() for item in pending if isinstance(item, _Call))
        for comm in comms:
            comm._user = (me, f"nccl {what}")
    try:
        _wait_for(nccl, pending)
    finally:
        with nccl.changed:
            for comm in comms:
                comm._user = None


def _wait_for(nccl: _State, pending: list[Any]) -> None:
    """Launch ``pending`` in order, then wait until each has matched its peers."""
    waits: list[tuple[Any, _Slot | _Clique, NcclCommunicator]] = []
    for item in pending:
        if isinstance(item, NcclCommunicator):
            waits.append(("join", item._clique, item))
        else:
            waits.append(_launch(nccl, item))
            time.sleep(0)  # let other threads launch in between, as they can on a machine
    deadline = time.monotonic() + nccl.deadlock_limit
    with nccl.changed:
        for what, target, comm in waits:
            while True:
                if target.error is not None:
                    if isinstance(target, _Clique):
                        raise NcclError(NCCL_ERROR_INVALID_USAGE, target.error)
                    raise SimulationError(target.error)
                if _settled(what, target):
                    break
                if comm._aborted:
                    raise NcclError(
                        NCCL_ERROR_REMOTE_ERROR,
                        f"communicator of rank {comm._rank} was aborted while waiting for its "
                        "peers",
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SimulationError(
                        f"simulated NCCL: {_waiting(what, target, comm)} waited "
                        f"{nccl.deadlock_limit:g} s for its peers (a deadlock, or a rank that "
                        "never makes the matching call)."
                    )
                nccl.changed.wait(min(left, 0.05))


def _settled(what: str, target: Any) -> bool:
    if what == "join":
        return len(target.members) == target.nranks
    return bool(target.done)


def _waiting(what: str, target: Any, comm: NcclCommunicator) -> str:
    if what == "join":
        return f"rank {comm._rank} joining a communicator of {target.nranks} ranks"
    return " and ".join(call.describe() for call in target.calls.values())


def _call(comm: NcclCommunicator, kind: str, **args: int) -> None:
    comm._check_usable()
    call = _Call(kind, comm, args)
    if getattr(_local, "depth", 0) > 0:
        _local.pending.append(call)
    else:
        _run([call])


# ---------------------------------------------------------------------------------------------
# Launching and matching


def _block_of(
    simulation: Simulation, comm: NcclCommunicator, ptr: int, nbytes: int, what: str
) -> tuple[Any, int]:
    """The device block and offset of a buffer of ``comm``'s GPU (else NCCL's error)."""
    found = resolve(simulation, ptr, nbytes)
    if found is None or found[0].kind != "device":
        raise NcclError(
            NCCL_ERROR_INVALID_ARGUMENT,
            f"{what}: {ptr:#x} is not device memory (NCCL takes device pointers)",
        )
    block, offset = found
    if block.device != comm._device:
        raise SimulationError(
            f"{what}: the buffer at {ptr:#x} is on cuda:{block.device}, but rank "
            f"{comm._rank}'s communicator drives cuda:{comm._device}."
        )
    return block, offset


def _regions(call: _Call) -> list[tuple[int, int, bool]]:
    """The (pointer, bytes, write) accesses of one member's call."""
    a, comm = call.args, call.comm
    size = _WIRE[a["datatype"]].itemsize
    n = a["count"] * size
    kind, rank, nranks = call.kind, comm._rank, comm._clique.nranks
    if kind == "allReduce":
        return [(a["send"], n, False), (a["recv"], n, True)]
    if kind == "reduce":
        return [(a["send"], n, False)] + ([(a["recv"], n, True)] if rank == a["root"] else [])
    if kind == "broadcast":
        return ([(a["send"], n, False)] if rank == a["root"] else []) + [(a["recv"], n, True)]
    if kind == "bcast":
        return [(a["recv"], n, rank != a["root"])]
    if kind == "reduceScatter":
        return [(a["send"], n * nranks, False), (a["recv"], n, True)]
    if kind == "allGather":
        return [(a["send"], n, False), (a["recv"], n * nranks, True)]
    if kind == "send":
        return [(a["send"], n, False)]
    return [(a["recv"], n, True)]  # recv


def _launch(nccl: _State, call: _Call) -> tuple[str, _Slot, NcclCommunicator]:
    """Check ``call``'s stream and buffers and deposit it; the last member runs the operation."""
    simulation = state()
    comm = call.comm
    with simulation.lock:
        previous = current_device()
        set_device(comm._device)  # a null/per-thread stream handle means the comm's GPU's
        try:
            call.timeline = from_handle(call.args["stream"]).timeline()
        finally:
            set_device(previous)
        if call.timeline.device != comm._device:
            raise SimulationError(
                f"nccl {call.kind} of rank {comm._rank} (communicator on cuda:{comm._device}) "
                f"was launched on the {call.timeline.name}."
            )
        for ptr, nbytes, _ in _regions(call):
            if nbytes:
                _block_of(simulation, comm, ptr, nbytes, f"nccl {call.kind}")
    clique = comm._clique
    with nccl.changed:
        if call.kind in ("send", "recv"):
            peer = call.args["peer"]
            src, dst = (comm._rank, peer) if call.kind == "send" else (peer, comm._rank)
            channel: Any = ("p2p", src, dst, call.kind)
            member: Any = call.kind
            expected = 2
        else:
            channel, member, expected = ("collective", comm._rank), comm._rank, clique.nranks
        sequence = clique.issued.get(channel, 0)
        clique.issued[channel] = sequence + 1
        key = (channel[0], *channel[1:3], sequence) if call.kind in ("send", "recv") else sequence
        slot = clique.slots.setdefault(key, _Slot(expected))
        for other in slot.calls.values():
            mismatch = _mismatch(call, other)
            if mismatch is not None:
                slot.error = mismatch
                nccl.changed.notify_all()
                raise SimulationError(mismatch)
        slot.calls[member] = call
        if len(slot.calls) == expected:
            try:
                with simulation.lock:
                    _run_matched(simulation, slot)
            except Exception as error:
                slot.error = f"{type(error).__name__}: {error}"
                raise
            finally:
                del clique.slots[key]
                nccl.changed.notify_all()
            slot.done = True
    return ("call", slot, comm)


def _run_matched(simulation: Simulation, slot: _Slot) -> None:
    """Stamp every member's kernel, check their memory accesses, and move the data.

    The members' kernels are stamped together (:meth:`.clock.Simulation.enqueue_group`): each
    completes only after the members it receives data from have started (:func:`_sources`), so
    work queued after the call on a receiver's stream is ordered after what every sender queued
    before it, while a member that only sends may be done before its peers start.
    """
    calls = [slot.calls[k] for k in sorted(slot.calls, key=str)]
    timelines = [call.timeline for call in calls]
    ops = simulation.enqueue_group(timelines, "nccl", _sources(calls))  # type: ignore[arg-type]
    for call, op in zip(calls, ops, strict=True):
        op.name = f"nccl {call.describe()}"
        call.op = op
        for ptr, nbytes, write in _regions(call):
            if nbytes:
                block, offset = _block_of(simulation, call.comm, ptr, nbytes, op.name)
                access(simulation, block, Region(offset, offset + nbytes), op, write=write)
    _perform(slot)


def _sources(calls: list[_Call]) -> list[list[int]] | None:
    """For each call (in ``calls``' order), the calls whose data it receives; ``None``: all.

    ``allReduce``, ``allGather`` and ``reduceScatter`` receive from every rank; a broadcast's
    non-roots from the root, a ``reduce``'s root from everyone (its other ranks only send);
    a ``recv`` from its ``send``. A member that receives nothing depends on itself only.
    """
    kind = calls[0].kind
    if kind in ("send", "recv"):
        sender = next(i for i, call in enumerate(calls) if call.kind == "send")
        return [[i, sender] if call.kind == "recv" else [i] for i, call in enumerate(calls)]
    if kind not in ("broadcast", "bcast", "reduce"):
        return None
    root = next(i for i, call in enumerate(calls) if call.comm._rank == call.args["root"])
    everyone = list(range(len(calls)))
    if kind == "reduce":
        return [everyone if i == root else [i] for i in everyone]
    return [[i] if i == root else [i, root] for i in everyone]


def _mismatch(call: _Call, other: _Call) -> str | None:
    """Why two calls that meet in one operation do not match, or ``None``."""
    if call.kind in ("send", "recv"):
        same = call.args["count"] == other.args["count"] and (
            call.args["datatype"] == other.args["datatype"]
        )
    else:
        keys = ("count", "datatype", "op", "root")
        same = call.kind == other.kind and all(call.args.get(k) == other.args.get(k) for k in keys)
    if same:
        return None
    return (
        f"simulated NCCL: mismatched calls on one communicator: {call.describe()} meets "
        f"{other.describe()} (every rank must make the same calls in the same order)."
    )


def _memory(ptr: int, count: int, wire: np.dtype[Any]) -> np.ndarray:
    simulation = state()
    found = resolve(simulation, ptr, count * wire.itemsize)
    assert found is not None  # checked at launch
    block, offset = found
    return block.buffer[offset : offset + count * wire.itemsize].view(wire)


def _reduce(parts: list[np.ndarray], op: int, datatype: int) -> np.ndarray:
    bf16 = datatype == NCCL_BFLOAT16
    values = [_widen(p) for p in parts] if bf16 else parts
    ufunc = _OPS.get(op, np.add)
    with np.errstate(all="ignore"):
        total = values[0].copy()
        for part in values[1:]:
            ufunc(total, part, out=total)
        if op == NCCL_AVG:
            n = len(parts)
            if total.dtype.kind in "iu":
                total = (total - np.fmod(total, n)) // n  # C division, toward zero
            else:
                total = total / total.dtype.type(n)
    return _narrow(total) if bf16 else total


def _widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _narrow(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _perform(slot: _Slot) -> None:
    """Move the data of a fully matched operation (every member's call is in ``slot``)."""
    calls = slot.calls
    if "send" in calls:
        send, recv = calls["send"].args, calls["recv"].args
        wire = _WIRE[send["datatype"]]
        _memory(recv["recv"], recv["count"], wire)[...] = _memory(send["send"], send["count"], wire)
        return
    ranks = sorted(calls)
    first = calls[ranks[0]]
    kind, a = first.kind, first.args
    wire, count, n = _WIRE[a["datatype"]], a["count"], len(ranks)
    if count == 0:
        return
    if kind in ("broadcast", "bcast"):
        root = calls[a["root"]].args
        data = _memory(root["send"], count, wire).copy()
        for r in ranks:
            _memory(calls[r].args["recv"], count, wire)[...] = data
    elif kind == "allGather":
        sends = [_memory(calls[r].args["send"], count, wire).copy() for r in ranks]
        for r in ranks:
            out = _memory(calls[r].args["recv"], n * count, wire)
            for q in ranks:
                out[q * count : (q + 1) * count] = sends[q]
    elif kind == "reduceScatter":
        sends = [_memory(calls[r].args["send"], n * count, wire).copy() for r in ranks]
        for r in ranks:
            chunk = [s[r * count : (r + 1) * count] for s in sends]
            _memory(calls[r].args["recv"], count, wire)[...] = _reduce(
                chunk, a["op"], a["datatype"]
            )
    else:  # allReduce, reduce
        sends = [_memory(calls[r].args["send"], count, wire).copy() for r in ranks]
        total = _reduce(sends, a["op"], a["datatype"])
        targets = ranks if kind == "allReduce" else [a["root"]]
        for r in targets:
            _memory(calls[r].args["recv"], count, wire)[...] = total


# ---------------------------------------------------------------------------------------------
# The communicator


def _check_datatype(datatype: int) -> int:
    value = as_c_int(datatype, "datatype")
    if value not in _WIRE:
        raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"unknown datatype {datatype}")
    return value


def _check_op(op: int) -> int:
    value = as_c_int(op, "op")
    if value not in _OP_NAMES:
        raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"unknown reduction {op}")
    return value


class NcclCommunicator:
    """One rank of a simulated NCCL communicator, driving the GPU current when it was made."""

    def __init__(self, ndev: int, commId: bytes, rank: int, config: Any = None) -> None:  # noqa: N803 - CuPy's
        ndev = as_c_int(ndev, "ndev")
        if not isinstance(commId, bytes):
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected bytes, got "
                f"{type(commId).__name__})"
            )
        rank = as_c_int(rank, "rank")
        if len(commId) != _UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {_UNIQUE_ID_BYTES}.")
        if config is not None:
            raise NotImplementedError("The simulated NCCL does not model NcclConfig: pass None.")
        if ndev < 1 or not 0 <= rank < ndev:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"rank {rank} of {ndev} ranks")
        nccl = _state()
        self._rank = rank
        self._device = current_device()
        self._aborted = False
        self._destroyed = False
        self._async_error: int | None = None
        self._user: tuple[threading.Thread, str] | None = None  # the thread inside a call
        with nccl.changed:
            clique = nccl.cliques.get(commId)
            if clique is None:
                clique = nccl.cliques[commId] = _Clique(ndev)
            if clique.nranks != ndev:
                raise SimulationError(
                    f"simulated NCCL: rank {rank} joins a communicator of {clique.nranks} ranks "
                    f"as one of {ndev} (every rank must pass the same ndev)."
                )
            if rank in clique.members:
                raise SimulationError(
                    f"simulated NCCL: rank {rank} joined the same communicator twice."
                )
            for other in clique.members.values():
                if other._device == self._device and clique.error is None:
                    clique.error = (
                        f"Duplicate GPU detected: rank {other._rank} and rank {rank} both on "
                        f"CUDA device {self._device}"
                    )
            clique.members[rank] = self
            self._clique = clique
            nccl.changed.notify_all()
        if getattr(_local, "depth", 0) > 0:  # inside a group: wait at groupEnd
            _local.pending.append(self)
        else:
            _run([self])

    @staticmethod
    def initAll(devices: int | list[int]) -> list[NcclCommunicator]:  # noqa: N802 - CuPy's
        """One communicator per GPU of ``devices`` (a list, or a count of GPUs from 0)."""
        if isinstance(devices, list):
            ids = devices
        elif isinstance(devices, int):
            ids = list(range(devices))
        else:
            raise ValueError('"devices" should be an int or a list of int.')
        simulation = state()
        uid = get_unique_id()
        comms = []
        groupStart()
        try:
            for rank, device in enumerate(ids):
                simulation.check_device(int(device))
                previous = current_device()
                set_device(int(device))
                try:
                    comms.append(NcclCommunicator(len(ids), uid, rank))
                finally:
                    set_device(previous)
        finally:
            groupEnd()
        return comms

    def _check_usable(self) -> None:
        if self._aborted or self._destroyed:
            raise NcclError(
                NCCL_ERROR_INVALID_ARGUMENT,
                f"rank {self._rank}'s communicator was "
                f"{'aborted' if self._aborted else 'destroyed'}",
            )

    @property
    def comm(self) -> int:
        """The ``ncclComm_t`` handle (0 once destroyed or aborted)."""
        return 0 if self._aborted or self._destroyed else id(self)

    def destroy(self) -> None:
        """``ncclCommDestroy``."""
        self._destroyed = True

    def abort(self) -> None:
        """``ncclCommAbort``: a call of this member waiting for its peers raises ``NcclError``."""
        nccl = _state()
        with nccl.changed:
            self._aborted = True
            nccl.changed.notify_all()

    def inject_async_error(self, status: int = NCCL_ERROR_REMOTE_ERROR) -> None:
        """Test knob: make :meth:`check_async_error` report ``status`` (e.g. a peer died)."""
        self._async_error = status

    def check_async_error(self) -> None:
        """``ncclCommGetAsyncError``: raise the asynchronous error of this member, if any."""
        self._check_usable()
        if self._async_error is not None:
            raise NcclError(self._async_error, f"asynchronous error on rank {self._rank}")

    def device_id(self) -> int:
        """The GPU this member drives."""
        self._check_usable()
        return self._device

    def rank_id(self) -> int:
        """This member's rank."""
        self._check_usable()
        return self._rank

    def size(self) -> int:
        """The number of ranks."""
        self._check_usable()
        return self._clique.nranks

    def _root(self, root: int, name: str = "root") -> int:
        value = as_c_int(root, name)
        if not 0 <= value < self._clique.nranks:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"root {root} of {self._clique.nranks}")
        return value

    def allReduce(  # noqa: N802, PLR0917 - CuPy's name and signature
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        """``ncclAllReduce``."""
        _call(
            self,
            "allReduce",
            send=as_c_int(sendbuf, "sendbuf", "intptr_t"),
            recv=as_c_int(recvbuf, "recvbuf", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            op=_check_op(op),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def reduce(  # noqa: PLR0917 - CuPy's name and signature
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int
    ) -> None:
        """``ncclReduce``."""
        _call(
            self,
            "reduce",
            send=as_c_int(sendbuf, "sendbuf", "intptr_t"),
            recv=as_c_int(recvbuf, "recvbuf", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            op=_check_op(op),
            root=self._root(root),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def broadcast(  # noqa: PLR0917 - CuPy's name and signature
        self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int
    ) -> None:
        """``ncclBroadcast``."""
        _call(
            self,
            "broadcast",
            send=as_c_int(sendbuff, "sendbuff", "intptr_t"),
            recv=as_c_int(recvbuff, "recvbuff", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            root=self._root(root),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        """``ncclBcast`` (in place)."""
        _call(
            self,
            "bcast",
            send=as_c_int(buff, "buff", "intptr_t"),
            recv=as_c_int(buff, "buff", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            root=self._root(root),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def reduceScatter(  # noqa: N802, PLR0917 - CuPy's name and signature
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        """``ncclReduceScatter``."""
        _call(
            self,
            "reduceScatter",
            send=as_c_int(sendbuf, "sendbuf", "intptr_t"),
            recv=as_c_int(recvbuf, "recvbuf", "intptr_t"),
            count=as_c_int(recvcount, "recvcount", "size_t"),
            datatype=_check_datatype(datatype),
            op=_check_op(op),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        """``ncclAllGather``."""
        _call(
            self,
            "allGather",
            send=as_c_int(sendbuf, "sendbuf", "intptr_t"),
            recv=as_c_int(recvbuf, "recvbuf", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """``ncclSend``."""
        _call(
            self,
            "send",
            send=as_c_int(sendbuf, "sendbuf", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            peer=self._root(peer, "peer"),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """``ncclRecv``."""
        _call(
            self,
            "recv",
            recv=as_c_int(recvbuf, "recvbuf", "intptr_t"),
            count=as_c_int(count, "count", "size_t"),
            datatype=_check_datatype(datatype),
            peer=self._root(peer, "peer"),
            stream=as_c_int(stream, "stream", "intptr_t"),
        )
