"""An in-process MPI for thread ranks: the part of mpi4py's ``MPI`` the MPI backend uses.

:func:`~cupy_parallel.distributed.spawn` runs the MPI backend itself (``mpi.MPIBackend``) on
thread ranks of one process: each rank's ``load_mpi()`` returns its :class:`ThreadMPI`, a module
stand-in whose ``COMM_WORLD`` is that rank's view of a :class:`ThreadWorld` shared by the ranks.
Everything above this module (the arguments' checks, the ranks' comparisons of every call, the
debug mode, the timeouts, the messages) is the MPI backend's code, unchanged.

What it implements, as MPI defines it:

* Communicators (:class:`Comm`): ``Get_rank``/``Get_size``, ``Dup``/``Idup``, ``Split``,
  ``Split_type``, ``Get_group().Incl`` with ``Create_group``, ``Get_attr(TAG_UB)``, ``Free``,
  ``Abort``; the nonblocking collectives ``Ibarrier``, ``Ibcast``, ``Iallreduce``, ``Ireduce``,
  ``Iallgather``, ``Igather``, ``Iscatter``, ``Ireduce_scatter_block``, ``Ialltoallv`` and the
  pickled ``allgather``; point-to-point ``Isend``/``Irecv`` with tags and ``ANY_SOURCE``, and
  their persistent forms ``Send_init``/``Recv_init`` (:class:`Prequest`, ``Startall``).
* Matching: a communicator's collectives pair in the order each rank issues them (each rank
  counts its calls; the ``k``-th call of every rank meets in one slot, and the last rank to
  arrive moves the data for all). Messages from one sender with one tag arrive in the order
  sent (MPI's non-overtaking rule); a send is buffered (it completes at once, as MPI's eager
  protocol does for small messages).
* Reductions combine the ranks' buffers in rank order, ``((x0 op x1) op x2) ...``, with NumPy
  in the MPI datatype's dtype (user operations from ``Op.Create`` too). Integer, bitwise,
  logical and MIN/MAX results are the same bits in any order; a floating-point sum of values
  that do not add exactly may differ in the last bits from a real MPI's, whose order is its own
  (MPICH's depends on the number of ranks and the message size).
* Errors: a receive buffer smaller than the message raises ``Exception`` of class
  ``ERR_TRUNCATE`` (the part that fits is written, as MPICH does); collectives whose buffers do
  not fit raise ``ERR_TRUNCATE`` on every rank. A receive not yet matched can be cancelled.
* Faults (:meth:`ThreadWorld.fail`): once a rank failed, every pending and later call of every
  rank raises :class:`RankFailedError` naming it, at once.

``Request.Test`` waits for the request's world to change for at most ``TEST_WAIT_S`` before
answering ``False``: the MPI backend polls it, and a poll that spins holding the GIL would keep
the rank threads that must make progress from running.
"""

from __future__ import annotations

import builtins
import itertools
import pickle
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["TEST_WAIT_S", "Comm", "RankFailedError", "ThreadMPI", "ThreadRank", "ThreadWorld"]

TEST_WAIT_S = 2e-4
_TAG_UB = 536870911  # MPICH's
ANY_SOURCE = -2
ANY_TAG = -1
UNDEFINED = -32766
ERR_TRUNCATE = 14
ERR_OTHER = 15


class RankFailedError(RuntimeError):
    """A call of a thread rank that cannot complete because another rank failed."""


# MPICH's strings of the error classes (its error strings start with them, then the stack).
_CLASS_TEXT = {ERR_TRUNCATE: "Message truncated", ERR_OTHER: "Other MPI error"}


class MPIException(builtins.Exception):
    """``MPI.Exception``: an error class and its string, as MPICH writes it.

    ``Get_error_string()`` is the class's text, then ``", error stack:"`` and ``detail``.
    """

    def __init__(self, error_class: int, detail: str) -> None:
        self._class = error_class
        self._text = f"{_CLASS_TEXT[error_class]}, error stack:\n{detail}"
        super().__init__(self._text)

    def Get_error_class(self) -> int:  # noqa: N802 - mpi4py's name
        """The MPI error class (``ERR_TRUNCATE``, ...)."""
        return self._class

    def Get_error_string(self) -> str:  # noqa: N802 - mpi4py's name
        """What went wrong."""
        return self._text


class Datatype:
    """An MPI datatype: the NumPy dtype its buffers hold."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)

    @staticmethod
    def fromcode(code: str) -> Datatype:
        """The datatype of a NumPy type code (``"f"``, ``"?"``, ...)."""
        return Datatype(code)

    def __repr__(self) -> str:
        return f"<thread MPI datatype {self.dtype}>"


class Op:
    """An MPI reduction: ``combine(incoming, inout)`` writes ``incoming op inout`` to ``inout``."""

    __slots__ = ("combine", "name")

    def __init__(self, name: str, combine: Callable[[np.ndarray, np.ndarray], None]) -> None:
        self.name = name
        self.combine = combine

    @staticmethod
    def Create(function: Callable[..., None], commute: bool = False) -> Op:  # noqa: N802
        """A user operation: ``function(incoming, inout, datatype)`` on the buffers' bytes."""
        del commute

        def combine(incoming: np.ndarray, inout: np.ndarray) -> None:
            function(incoming.view(np.uint8), inout.view(np.uint8), None)

        return Op("user", combine)

    def __repr__(self) -> str:
        return f"<thread MPI op {self.name}>"


def _builtin(name: str, ufunc: Any) -> Op:
    def combine(incoming: np.ndarray, inout: np.ndarray) -> None:
        ufunc(incoming, inout, out=inout)

    return Op(name, combine)


_OPS = {
    "SUM": np.add,
    "PROD": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "LAND": np.logical_and,
    "LOR": np.logical_or,
    "LXOR": np.logical_xor,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}


class Status:
    """``MPI.Status`` of a receive: its source, size in bytes, and whether it was cancelled."""

    __slots__ = ("cancelled", "nbytes", "source")

    def __init__(self) -> None:
        self.source = ANY_SOURCE
        self.nbytes = 0
        self.cancelled = False

    def Get_source(self) -> int:  # noqa: N802 - mpi4py's name
        """The group rank the message came from."""
        return self.source

    def Get_count(self, datatype: Datatype) -> int:  # noqa: N802 - mpi4py's name
        """How many items of ``datatype`` arrived."""
        return self.nbytes // datatype.dtype.itemsize

    def Is_cancelled(self) -> bool:  # noqa: N802 - mpi4py's name
        """Whether the receive was cancelled."""
        return self.cancelled


class Request:
    """A nonblocking operation of one rank; completed by whichever rank finishes it."""

    __slots__ = ("_world", "done", "error", "nbytes", "posted", "settled", "source", "value")

    def __init__(self, world: ThreadWorld) -> None:
        self._world = world
        self.done = False
        self.settled = False  # Test/Wait found it complete: mpi4py nulls the handle then
        self.error: BaseException | None = None
        self.source = ANY_SOURCE
        self.nbytes = 0
        self.value: Any = None
        self.posted: _Posted | None = None  # a receive not matched yet

    def __bool__(self) -> bool:
        """Whether the handle is live: false once ``Test``/``Wait`` found it complete (mpi4py)."""
        return not self.settled

    def _settle(self, status: Status | None) -> bool:
        self.settled = True
        if status is not None:
            status.source = self.source
            status.nbytes = self.nbytes
            status.cancelled = self.source == _CANCELLED
        if self.error is not None:
            raise self.error
        return True

    def Test(self, status: Status | None = None) -> bool:  # noqa: N802 - mpi4py's name
        """Whether it completed (raising its error); waits up to ``TEST_WAIT_S`` for news."""
        if self.done:
            return self._settle(status)
        world = self._world
        with world.changed:
            if not self.done:
                world.raise_failure()
                world.changed.wait(TEST_WAIT_S)
        return self._settle(status) if self.done else False

    def Wait(self, status: Status | None = None) -> bool:  # noqa: N802 - mpi4py's name
        """Block until it completed (or a rank failed)."""
        world = self._world
        with world.changed:
            while not self.done:
                world.raise_failure()
                world.changed.wait(0.05)
        return self._settle(status)

    def Cancel(self) -> None:  # noqa: N802 - mpi4py's name
        """Take back a receive that no message matched yet (nothing else can be)."""
        world = self._world
        with world.changed:
            posted = self.posted
            if posted is not None and not self.done:
                posted.box.posted.remove(posted)
                self.posted = None
                self.source = _CANCELLED
                self.done = True
                world.changed.notify_all()

    @staticmethod
    def Testall(requests: Sequence[Request]) -> bool:  # noqa: N802 - mpi4py's name
        """Whether every request completed."""
        return all([r.Test() for r in requests])  # noqa: C419 - test them all

    @staticmethod
    def Waitall(requests: Sequence[Request]) -> None:  # noqa: N802 - mpi4py's name
        """Block until every request completed."""
        for request in requests:
            request.Wait()


_CANCELLED = -10  # a cancelled receive's source


class Prequest:
    """``MPI.Prequest``: a persistent send or receive (``Send_init``/``Recv_init``).

    Each ``Start`` posts the operation again on the same buffer, tag and peer, as an
    ``Isend`` (the buffer's bytes as they are then) or an ``Irecv``; until then, and once a
    ``Test`` or ``Wait`` found it complete, it is inactive, and ``Test`` answers ``True``
    (MPI's empty status). Starting it while active is erroneous in MPI: an error here.
    """

    __slots__ = ("_active", "_comm", "_peer", "_post", "_spec", "_tag")

    def __init__(self, comm: Comm, spec: Any, peer: int, tag: int, *, receive: bool) -> None:
        self._comm = comm
        self._post = comm.Irecv if receive else comm.Isend
        self._spec, self._peer, self._tag = spec, peer, tag
        self._active: Request | None = None

    def Start(self) -> None:  # noqa: N802 - mpi4py's name
        """Post the operation again."""
        if self._active is not None:
            raise MPIException(ERR_OTHER, "a persistent request was started while active")
        self._active = self._post(self._spec, self._peer, self._tag)

    @staticmethod
    def Startall(requests: Sequence[Prequest]) -> None:  # noqa: N802 - mpi4py's name
        """Start each of ``requests``."""
        for request in requests:
            request.Start()

    def Test(self, status: Status | None = None) -> bool:  # noqa: N802 - mpi4py's name
        """Whether the started operation completed (raising its error); inactive: ``True``."""
        active = self._active
        if active is None:
            return True
        try:
            if not active.Test(status):
                return False
        except BaseException:  # completed with an error: inactive all the same
            self._active = None
            raise
        self._active = None
        return True

    def Wait(self, status: Status | None = None) -> bool:  # noqa: N802 - mpi4py's name
        """Block until the started operation completed; inactive: at once."""
        active = self._active
        if active is None:
            return True
        self._active = None
        return active.Wait(status)

    def Cancel(self) -> None:  # noqa: N802 - mpi4py's name
        """Take back a started receive that no message matched yet."""
        if self._active is not None:
            self._active.Cancel()

    def Free(self) -> None:  # noqa: N802 - mpi4py's name
        """Release the request (an operation still active completes on its own)."""
        self._active = None


class ThreadWorld:
    """What the thread ranks of one ``spawn`` share: a lock, the failure, who has left.

    ``changed`` (a condition on the one lock) is notified whenever a request completes or a rank
    fails.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.changed = threading.Condition(threading.Lock())
        self.failure: tuple[int, BaseException, str] | None = None
        self.departed: dict[int, float] = {}  # world rank -> when its function ended
        self.comm_ids = itertools.count()
        self.creations: dict[Any, _Slot] = {}  # Create_group calls waiting for their members
        self.world_comm = _Shared(self, tuple(range(size)))

    def fail(self, rank: int, error: BaseException, said: str) -> None:
        """Rank ``rank`` failed with ``error``: every pending and later call raises (first wins).

        ``rank`` -1: the run was ended from outside (``said`` says how).
        """
        with self.changed:
            if self.failure is None:
                self.failure = (rank, error, said)
            self.changed.notify_all()

    def raise_failure(self) -> None:
        """Raise :class:`RankFailedError` if a rank failed (call with ``changed`` held)."""
        failure = self.failure
        if failure is not None:
            rank, _, said = failure
            why = f"rank {rank} failed ({said})" if rank >= 0 else said
            raise RankFailedError(f"{why}, so this call cannot complete; the run is ending.")

    def leave(self, rank: int) -> None:
        """Rank ``rank``'s function ended: peers waiting for it fail after a grace period."""
        with self.changed:
            self.departed.setdefault(rank, time.monotonic())
            self.changed.notify_all()


class _Slot:
    """The ``k``-th collective of a communicator: each member's part, until all arrived."""

    __slots__ = ("parts",)

    def __init__(self, size: int) -> None:
        self.parts: list[tuple[str, Any, Request] | None] = [None] * size


class _Posted:
    """A receive waiting for a message."""

    __slots__ = ("box", "buffer", "request", "source", "tag")

    def __init__(self, box: _Mailbox, buffer: np.ndarray, source: int, tag: int, request: Request):
        self.box = box
        self.buffer = buffer
        self.source = source
        self.tag = tag
        self.request = request


class _Mailbox:
    """One rank's messages that arrived unmatched, and its receives not matched yet."""

    __slots__ = ("posted", "unexpected")

    def __init__(self) -> None:
        self.unexpected: list[tuple[int, int, bytes]] = []  # (source, tag, data)
        self.posted: list[_Posted] = []


class _Shared:
    """A communicator as all its members share it: collective slots and mailboxes."""

    def __init__(self, world: ThreadWorld, members: tuple[int, ...]) -> None:
        self.world = world
        self.id = next(world.comm_ids)
        self.members = members  # world ranks, by rank in this communicator
        self.slots: dict[int, _Slot] = {}
        self.boxes = [_Mailbox() for _ in members]


def _bytes(buffer: Any) -> np.ndarray:
    return np.asarray(buffer).reshape(-1).view(np.uint8)


def _array(spec: Any) -> Any:
    """The array of a buffer spec: ``[array, datatype]``, or the array itself (as mpi4py)."""
    return spec[0] if type(spec) is list or type(spec) is tuple else spec


def _typed(spec: Any) -> np.ndarray:
    """The items of a buffer spec: ``[array, datatype]`` viewed as the datatype's, or an array's."""
    if type(spec) is list or type(spec) is tuple:
        return np.asarray(spec[0]).reshape(-1).view(spec[-1].dtype)
    return np.asarray(spec).reshape(-1)


def _fit(target: np.ndarray, data: np.ndarray, what: str) -> None:
    """Copy ``data`` into ``target`` (bytes); a size mismatch is MPI's truncation error."""
    if data.nbytes != target.nbytes:
        raise MPIException(
            ERR_TRUNCATE,
            f"{what}: {data.nbytes} bytes sent, {target.nbytes} expected",
        )
    target[...] = data


class Comm:
    """One rank's handle of a communicator (``MPI.Comm``)."""

    def __init__(
        self, shared: _Shared | None, rank: int, members: tuple[int, ...] | None = None
    ) -> None:
        self._shared = shared
        self._rank = rank
        self._members = shared.members if shared is not None else members
        self._calls = 0  # collectives issued: the next one's slot
        self._creations: dict[Any, int] = {}

    @property
    def shared(self) -> _Shared:
        shared = self._shared
        if shared is None:
            raise MPIException(ERR_OTHER, "the communicator is not ready (Idup still pending)")
        return shared

    # ------------------------------------------------------------------------- queries

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        """This rank's rank in the communicator."""
        return self._rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        """The number of ranks in the communicator (known before an ``Idup`` completed)."""
        assert self._members is not None
        return len(self._members)

    def Get_attr(self, key: Any) -> int:  # noqa: N802 - mpi4py's name
        """``TAG_UB``: the largest tag."""
        del key
        return _TAG_UB

    def Free(self) -> None:  # noqa: N802 - mpi4py's name
        """Release this handle."""

    def Abort(self, code: int = 1) -> None:  # noqa: N802 - mpi4py's name
        """End the whole run: every rank's calls fail."""
        world = self.shared.world
        error = RuntimeError(f"MPI_Abort with code {code}")
        world.fail(self.shared.members[self._rank], error, f"it called MPI_Abort({code})")

    # ------------------------------------------------------------------------- collectives

    def _join(
        self, kind: str, part: Any, complete: Callable[[list[Any], list[Request]], None]
    ) -> Request:
        """Take this rank's part in the communicator's next collective; the last one runs it."""
        shared = self.shared
        world = shared.world
        request = Request(world)
        with world.changed:
            world.raise_failure()
            number = self._calls
            self._calls += 1
            slot = shared.slots.get(number)
            if slot is None:
                slot = shared.slots[number] = _Slot(len(shared.members))
            slot.parts[self._rank] = (kind, part, request)
            if all(p is not None for p in slot.parts):
                del shared.slots[number]
                _run(slot, complete)
                world.changed.notify_all()
        return request

    def _wait(self, request: Request) -> Any:
        request.Wait()
        return request.value

    def Ibarrier(self) -> Request:  # noqa: N802 - mpi4py's name
        """Complete once every rank arrived."""
        return self._join("barrier", None, _nothing)

    def Ibcast(self, buffer: Any, root: int) -> Request:  # noqa: N802 - mpi4py's name
        """The root's bytes into every rank's buffer."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            source = _bytes(_array(parts[root]))
            for r, part in enumerate(parts):
                if r != root:
                    _fit(_bytes(_array(part)), source, "broadcast")

        return self._join(f"bcast {root}", buffer, complete)

    def Iallreduce(self, send: Any, recv: Any, op: Op) -> Request:  # noqa: N802 - mpi4py's name
        """The reduction of every rank's buffer into every rank's."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            total = _reduce([_typed(r if s is IN_PLACE else s) for s, r in parts], op)
            for _, r in parts:
                _fit(_bytes(_array(r)), _bytes(total), "allreduce")

        return self._join("allreduce", (send, recv), complete)

    def Ireduce(self, send: Any, recv: Any, op: Op, root: int) -> Request:  # noqa: N802
        """The reduction of every rank's buffer into the root's."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            sources = [_typed(recv if s is IN_PLACE else s) for s, recv in parts]
            total = _reduce(sources, op)
            _fit(_bytes(_array(parts[root][1])), _bytes(total), "reduce")

        return self._join(f"reduce {root}", (send, recv), complete)

    def Iallgather(self, send: Any, recv: Any) -> Request:  # noqa: N802 - mpi4py's name
        """Every rank's bytes, in rank order, into every rank's buffer."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            every = np.concatenate([_bytes(_array(s)) for s, _ in parts])
            for _, r in parts:
                _fit(_bytes(_array(r)), every, "allgather")

        return self._join("allgather", (send, recv), complete)

    def Igather(self, send: Any, recv: Any, root: int) -> Request:  # noqa: N802
        """Every rank's bytes, in rank order, into the root's buffer."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            every = np.concatenate([_bytes(_array(s)) for s, _ in parts])
            _fit(_bytes(_array(parts[root][1])), every, "gather")

        return self._join(f"gather {root}", (send, recv), complete)

    def Iscatter(self, send: Any, recv: Any, root: int) -> Request:  # noqa: N802
        """Equal blocks of the root's bytes, one per rank."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            source = _bytes(_array(parts[root][0]))
            targets = [_bytes(_array(r)) for _, r in parts]
            block = targets[0].nbytes
            _fit(np.empty(block * len(targets), np.uint8), source, "scatter")
            for k, target in enumerate(targets):
                _fit(target, source[k * block : (k + 1) * block], "scatter")

        return self._join(f"scatter {root}", (send, recv), complete)

    def Ireduce_scatter_block(self, send: Any, recv: Any, op: Op) -> Request:  # noqa: N802
        """Block ``k`` of the reduction of every rank's buffer into rank ``k``'s."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            total = _reduce([_typed(s) for s, _ in parts], op)
            blocks = np.split(_bytes(total), len(parts))
            for k, (_, r) in enumerate(parts):
                _fit(_bytes(_array(r)), blocks[k], "reduce_scatter_block")

        return self._join("reduce_scatter_block", (send, recv), complete)

    def Ialltoallv(self, send: Any, recv: Any) -> Request:  # noqa: N802 - mpi4py's name
        """Block ``j`` of rank ``r``'s send buffer into block ``r`` of rank ``j``'s receive."""

        def complete(parts: list[Any], _: list[Request]) -> None:
            for j, (_, (r_buf, (r_counts, r_offsets), _t)) in enumerate(parts):
                target = _bytes(r_buf)
                for r, ((s_buf, (s_counts, s_offsets), _s), _) in enumerate(parts):
                    source = _bytes(s_buf)[s_offsets[j] : s_offsets[j] + s_counts[j]]
                    start = r_offsets[r]
                    _fit(target[start : start + r_counts[r]], source, "alltoallv")

        return self._join("alltoallv", (send, recv), complete)

    def allgather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (pickled), in rank order; blocking."""

        def complete(parts: list[Any], requests: list[Request]) -> None:
            for request in requests:
                request.value = [pickle.loads(p) for p in parts]  # noqa: S301 - our own bytes

        return self._wait(self._join("allgather_obj", pickle.dumps(value), complete))

    # ------------------------------------------------------------------------- new communicators

    def Idup(self) -> tuple[Comm, Request]:  # noqa: N802 - mpi4py's name
        """A duplicate (usable once the request completed) and the request."""
        handle = Comm(None, self._rank, self.shared.members)

        def complete(parts: list[Any], _: list[Request]) -> None:
            shared = _Shared(self.shared.world, self.shared.members)
            for part in parts:
                part._shared = shared

        return handle, self._join("dup", handle, complete)

    def Dup(self) -> Comm:  # noqa: N802 - mpi4py's name
        """A duplicate: the same ranks, its own traffic."""
        handle, request = self.Idup()
        request.Wait()
        return handle

    def Split(self, color: int, key: int) -> Comm | None:  # noqa: N802 - mpi4py's name
        """A communicator of the ranks of each color, ranked by ``key``; ``None`` for UNDEFINED."""

        def complete(parts: list[Any], requests: list[Request]) -> None:
            members = self.shared.members
            colors: dict[int, list[tuple[int, int]]] = {}
            for r, (c, k) in enumerate(parts):
                if c != UNDEFINED:
                    colors.setdefault(c, []).append((k, r))
            for group in colors.values():
                group.sort()
                shared = _Shared(self.shared.world, tuple(members[r] for _, r in group))
                for new_rank, (_, r) in enumerate(group):
                    requests[r].value = Comm(shared, new_rank)

        value: Comm | None = self._wait(self._join("split", (color, key), complete))
        return value

    def Split_type(self, kind: int, key: int = 0) -> Comm | None:  # noqa: N802 - mpi4py's name
        """Every rank shares this process's memory: one communicator of them all."""
        del kind
        return self.Split(0, key or self._rank)

    def Get_group(self) -> Group:  # noqa: N802 - mpi4py's name
        """The communicator's ranks, to take a subset of (``Incl``)."""
        return Group(self.shared, list(range(len(self.shared.members))))

    def Create_group(self, group: Group, tag: int = 0) -> Comm:  # noqa: N802 - mpi4py's name
        """A communicator of ``group``'s ranks; only they call it, with the same group and tag."""
        shared = self.shared
        world = shared.world
        ranks = tuple(group.ranks)
        seen = self._creations.get((ranks, tag), 0)
        self._creations[ranks, tag] = seen + 1
        key = (shared.id, ranks, tag, seen)
        request = Request(world)
        with world.changed:
            world.raise_failure()
            slot = world.creations.get(key)
            if slot is None:
                slot = world.creations[key] = _Slot(len(ranks))
            slot.parts[ranks.index(self._rank)] = ("create_group", None, request)
            if all(p is not None for p in slot.parts):
                del world.creations[key]
                made = _Shared(world, tuple(shared.members[r] for r in ranks))
                for new_rank, part in enumerate(slot.parts):
                    assert part is not None
                    part[2].value = Comm(made, new_rank)
                    part[2].done = True
                world.changed.notify_all()
        comm: Comm = self._wait(request)
        return comm

    # ------------------------------------------------------------------------- point to point

    def Isend(self, buffer: Any, dest: int, tag: int) -> Request:  # noqa: N802 - mpi4py's name
        """Send the buffer's bytes (copied: the send completes at once)."""
        shared = self.shared
        world = shared.world
        data = _bytes(_array(buffer)).tobytes()
        request = Request(world)
        with world.changed:
            world.raise_failure()
            box = shared.boxes[dest]
            for posted in box.posted:
                if posted.source in (ANY_SOURCE, self._rank) and posted.tag in (ANY_TAG, tag):
                    box.posted.remove(posted)
                    _deliver(posted.request, posted.buffer, self._rank, data)
                    break
            else:
                box.unexpected.append((self._rank, tag, data))
            request.done = True
            world.changed.notify_all()
        return request

    def Send_init(self, buffer: Any, dest: int, tag: int) -> Prequest:  # noqa: N802 - mpi4py's name
        """A persistent send of the buffer (:class:`Prequest`): each ``Start`` sends it anew."""
        return Prequest(self, buffer, dest, tag, receive=False)

    def Recv_init(self, buffer: Any, source: int, tag: int) -> Prequest:  # noqa: N802
        """A persistent receive into the buffer (:class:`Prequest`)."""
        return Prequest(self, buffer, source, tag, receive=True)

    def Irecv(self, buffer: Any, source: int, tag: int) -> Request:  # noqa: N802 - mpi4py's name
        """Receive into the buffer the first message that matches ``source`` and ``tag``."""
        shared = self.shared
        world = shared.world
        target = _bytes(_array(buffer))
        request = Request(world)
        with world.changed:
            world.raise_failure()
            box = shared.boxes[self._rank]
            for index, (sender, sent_tag, data) in enumerate(box.unexpected):
                if source in (ANY_SOURCE, sender) and tag in (ANY_TAG, sent_tag):
                    del box.unexpected[index]
                    _deliver(request, target, sender, data)
                    break
            else:
                request.posted = _Posted(box, target, source, tag, request)
                box.posted.append(request.posted)
        return request


class Group:
    """``MPI.Group``: ranks of a communicator."""

    def __init__(self, shared: _Shared, ranks: list[int]) -> None:
        self.shared = shared
        self.ranks = ranks

    def Incl(self, ranks: Sequence[int]) -> Group:  # noqa: N802 - mpi4py's name
        """The subgroup of these ranks, in this order."""
        return Group(self.shared, [self.ranks[r] for r in ranks])

    def Free(self) -> None:  # noqa: N802 - mpi4py's name
        """Release the group."""


def _deliver(request: Request, target: np.ndarray, sender: int, data: bytes) -> None:
    """Complete a receive with a message (truncated to the buffer, as MPICH does)."""
    received = np.frombuffer(data, np.uint8)
    fits = min(received.size, target.size)
    target[:fits] = received[:fits]
    request.source = sender
    request.nbytes = fits
    request.posted = None
    if received.size > target.size:
        request.error = MPIException(
            ERR_TRUNCATE,
            f"{received.size} bytes received but buffer size is {target.size}",
        )
    request.done = True


def _nothing(parts: list[Any], requests: list[Request]) -> None:
    del parts, requests


def _reduce(sources: list[np.ndarray], op: Op) -> np.ndarray:
    """``((x0 op x1) op x2) ...`` over the ranks' buffers, in rank order."""
    sizes = {x.nbytes for x in sources}
    if len(sizes) > 1:
        raise MPIException(ERR_TRUNCATE, f"the ranks' buffers differ in size ({sorted(sizes)})")
    total = sources[0].copy()
    with np.errstate(all="ignore"):  # MPI's C arithmetic wraps and overflows silently
        for x in sources[1:]:
            incoming = total.copy()
            total[...] = x
            op.combine(incoming, total)
    return total


def _run(slot: _Slot, complete: Callable[[list[Any], list[Request]], None]) -> None:
    """Move a collective's data (the last rank to arrive does); settle every rank's request.

    Ranks at different collectives (another kind or root) fail with ``ERR_OTHER``, as do
    buffers that do not fit (``ERR_TRUNCATE``); the MPI backend's comparisons beside every
    collective report such calls first, in its own words.
    """
    parts = [p for p in slot.parts if p is not None]
    requests = [p[2] for p in parts]
    kinds = {p[0] for p in parts}
    error: BaseException | None = None
    if len(kinds) > 1:
        error = MPIException(
            ERR_OTHER, f"collectives do not match: the ranks called {sorted(kinds)}"
        )
    else:
        try:
            complete([p[1] for p in parts], requests)
        except MPIException as failed:
            error = failed
        except (ValueError, TypeError, IndexError) as failed:
            error = MPIException(ERR_TRUNCATE, str(failed))
    for request in requests:
        request.error = error
        request.done = True


IN_PLACE: Any = type("InPlace", (), {"__repr__": lambda self: "MPI.IN_PLACE"})()


class ThreadMPI:
    """A thread rank's ``MPI`` module: mpi4py's names the MPI backend uses, over one world."""

    Exception = MPIException
    Datatype = Datatype
    Op = Op
    Request = Request
    Prequest = Prequest
    Status = Status
    IN_PLACE = IN_PLACE
    ANY_SOURCE = ANY_SOURCE
    ANY_TAG = ANY_TAG
    UNDEFINED = UNDEFINED
    TAG_UB = "TAG_UB"
    COMM_TYPE_SHARED = 1
    ERR_TRUNCATE = ERR_TRUNCATE
    ERR_OTHER = ERR_OTHER
    BYTE = Datatype(np.uint8)
    INT64_T = Datatype(np.int64)

    def __init__(self, world: ThreadWorld, rank: int, owner: ThreadRank) -> None:
        self.COMM_WORLD = Comm(world.world_comm, rank)
        self.thread_rank = owner  # whose MPI this is (mpi_job asks)

    @staticmethod
    def Is_finalized() -> bool:  # noqa: N802 - mpi4py's name
        """Never: the world lives as long as the run."""
        return False


for _name, _ufunc in _OPS.items():
    setattr(ThreadMPI, _name, _builtin(_name, _ufunc))


class ThreadRank:
    """One thread rank of a ``spawn``: its world, rank, ``MPI`` module and main thread.

    ``stuck`` collects the collectives that timed out (MPI would abort the job at exit);
    ``notes`` the one-time notices given on this rank.
    """

    def __init__(self, world: ThreadWorld, rank: int, thread: threading.Thread | None) -> None:
        self.world = world
        self.rank = rank
        self.mpi = ThreadMPI(world, rank, self)
        self.thread = thread
        self.stuck: list[str] = []
        self.notes: set[str] = set()
