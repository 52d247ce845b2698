"""The MPI backend: mpi4py's nonblocking collectives behind every primitive.

* Communicators: the world group duplicates ``MPI.COMM_WORLD`` (so user traffic on COMM_WORLD never
  matches ours); a subgroup is a ``Split`` of the world communicator, preceded by a nonblocking
  barrier so that a rank that never arrives ends in ``TimeoutError`` rather than a hang.
* Every primitive starts an ``MPI_I*`` call and returns an :class:`_MPIWork`, which polls
  ``Request.Test`` (spin, then sleep with backoff) until done or the group's deadline. Polling is
  also the fast path: a spinning ``Test`` loop answers sooner than a blocking MPI call does.
  A synchronous ``all_reduce`` of a host array (:meth:`MPIBackend.all_reduce_now`) polls its
  requests itself for one stretch and builds the :class:`_MPIWork` only for what is left; in a
  group of two, an array of up to 16 KiB travels with the comparison's row, one message, and
  each rank reduces the two arrays itself (:meth:`MPIBackend._all_reduce_carried`).
* Buffers: NumPy and HostArray arrays are passed in place as plain ndarray views. Data movement
  uses ``MPI.BYTE`` (every dtype, float16 included, travels bit-exactly); reductions use the dtype's
  MPI datatype (``float16`` in ``float32``, ``MIN``/``MAX`` of floats in a total order: see
  :mod:`~cupy_parallel._src.distributed.mpi_reductions`).
* CuPy arrays: passed to a CUDA-aware MPI directly, otherwise staged through host memory (see
  :mod:`~cupy_parallel._src.distributed.mpi_staging`).
* Timeouts: MPI cannot cancel a collective, so a collective that outlives the group's timeout
  marks the group unusable and the job is aborted with ``MPI_Abort(COMM_WORLD, 1)`` when this
  process exits (after the ``TimeoutError`` has been reported), which also ends the peers stuck in
  it. A receive that outlives it is cancelled instead (the group stays usable). ``wait(timeout=t)``
  with a shorter ``t`` only stops waiting: the operation keeps running.
* A failing rank ends the job: once a world of more than one process exists, the backend has
  :func:`~cupy_parallel._src.distributed.mpi_job.guard_job` end the whole MPI job when a rank
  dies with an uncaught exception or ``sys.exit(n != 0)``, and a rank waiting with a rank whose
  program ended fails after a grace period (see that module).
* Errors MPI reports (a message larger than the receiving array, arrays of different sizes on
  different ranks) become ``ValueError`` naming the operation; tags above the MPI's ``TAG_UB``
  are refused before anything is sent. A message shorter than the receiving array, which MPI
  accepts, is a ``ValueError`` too (torch's ``recv`` fills the whole tensor); the group stays
  usable.
* Buffers the backend allocates (packing, receiving) are zero-filled: a peer that sends less
  than expected never exposes another call's bytes.
* Every collective (``barrier`` too) has the ranks compare their arguments, always: the
  thread that issued it, the operation, the root, the reduction, the arrays' number, dtype and
  shape (for ``all_to_all`` the byte counts); ranks that disagree raise ``ValueError`` on every
  rank, naming them. See :mod:`~cupy_parallel._src.distributed.mpi_checks`.
* Thread ranks (:func:`~cupy_parallel.distributed.spawn`): this backend, unchanged, over an
  in-process MPI (:mod:`~cupy_parallel._src.distributed.thread_mpi`); a backend keeps the MPI
  module it was made with (``mpi``), so that any thread may call it.
* Threads: MPI pairs a group's collectives in the order each rank issues them, so two threads
  issuing on one group at once would pair one thread's call with another thread's on another
  rank (the results mixed, silently). There is no order to restore (each rank's threads race
  on their own), so such a pairing is an error instead: the ranks compare the name of the
  issuing thread, and the first mixed pair raises
  ``ValueError`` on every rank naming both threads (the group is unusable after). A thread's
  collective and its comparison are issued under one lock, and the comparison carries what
  the rank issued on the group before it (how many collectives, and a digest of the threads
  and operations of its earlier comparisons), which the ranks compare too: a call whose ranks'
  rows agree is the same call of the same thread on every rank, and the ``k``-th collective of
  every rank, so MPI pairs its data with itself, even after an earlier call met another (its
  thread's next ``async_op=True`` call, or a debug-mode comparison, exchanged before its
  collective starts, that met another thread's collective: data started on one rank only).
  Every call whose data met another call's raises on every rank that made it: no result is
  mixed silently. Issue a group's collectives from one thread at a time (in the same order on
  every rank), or give each thread a group of its own. Threads of one process that issue on one
  group must have different names (Python's default names are): two live threads of one name
  issuing on one group are refused, every call of either raising on every rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.util
import itertools
import math
import os
import struct
import threading
import time
import weakref
import zlib
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

import numpy as np

from cupy_parallel._src.averages import average_in_place, decode_average, encode_average
from cupy_parallel._src.cuda import copies
from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.distributed.backend import ProcessGroupBackend
from cupy_parallel._src.distributed.mpi_checks import (
    ROW_BYTES,
    Caller,
    caller_fields,
    compare_barrier,
    compare_call,
    compare_counts,
    compare_digest,
    compare_new_group,
    followed,
    history_token,
    stamp,
)
from cupy_parallel._src.distributed.mpi_job import (
    DEPARTURE_GRACE_S,
    abort_at_exit,
    departed_ranks,
    guard_job,
    load_mpi,
    thread_name,
    thread_rank,
)
from cupy_parallel._src.distributed.mpi_reductions import Plan, make_plan
from cupy_parallel._src.distributed.mpi_staging import staged
from cupy_parallel._src.distributed.store.interface import DistTimeoutError
from cupy_parallel._src.distributed.work import Work, spun
from cupy_parallel._src.enums import Backend, ReduceOp
from cupy_parallel._src.hostarray import plain_buffer
from cupy_parallel._src.versions import root_buffer

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.distributed.mpi_checks import Comparison, Verify

    # An exchange of a few integers that runs beside an operation (see _MPIWork._check): what
    # tests whether it finished (MPIBackend._rows), this rank's row (MPI reads it until the
    # exchange completes), every rank's rows (in rank order), what they are when all alike
    # (this rank's row, size times), what says what the ranks disagree on, and the persistent
    # pair it runs on (given back once settled), if any.
    _SideCheck = tuple[Callable[[], bool], bytes, bytearray, bytes, Verify, "_RowsPair | None"]

__all__ = ["MPIBackend"]

_R = TypeVar("_R")

_ABANDONED: list[Any] = []
"""The requests and buffers of operations abandoned while MPI may still run them (see
:meth:`_MPIWork._abandon`): never freed, as the job ends at this process's exit."""

_TOKENS_KEPT = 1024  # history tokens a group keeps, by row (cleared when full)

# ---------------------------------------------------------------------------------------------
# Buffers


def _bytes(x: Any) -> Any:
    """``x`` as a flat byte array (a view)."""
    return x.reshape(-1).view(np.uint8)


def _temp(shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
    """A zero-filled buffer beside ``like`` (never another call's bytes, even if a peer errs)."""
    if isinstance(like, np.ndarray):
        return np.zeros(shape, dtype)
    cupy: Any = cupy_module()
    with like.device:
        return cupy.zeros(shape, dtype)


def _span(chunks: Sequence[Any], nbytes: int, *, receive: bool) -> Any:
    """The bytes of host ``chunks`` as one flat view if they lie end to end in one array.

    They do for the chunks of a ``*_tensor`` collective (``x.reshape(count, ...)[r]``); else
    ``None``. A collective then receives into (or sends from) that memory itself rather than
    a temporary buffer copied chunk by chunk (FSDP's all-gathers and reduce-scatters, every
    step).
    ``nbytes``: what each chunk must hold; ``receive``: the view is written (so it must be).
    """
    first = chunks[0]
    if not isinstance(first, np.ndarray) or not nbytes:
        return None
    root = root_buffer(first)
    if not root.flags.c_contiguous or (receive and not root.flags.writeable):
        return None
    start = first.__array_interface__["data"][0]
    for r, chunk in enumerate(chunks):
        if not (
            isinstance(chunk, np.ndarray)
            and chunk.nbytes == nbytes
            and chunk.flags.c_contiguous
            and chunk.__array_interface__["data"][0] == start + r * nbytes
            and root_buffer(chunk) is root
        ):
            return None
    offset = start - root.__array_interface__["data"][0]
    return _bytes(root)[offset : offset + nbytes * len(chunks)]


def _on(x: Any) -> Any:
    """The context that makes ``x``'s GPU current (none for a host array).

    CuPy launches on the current device's current stream: the backend's own work on an array
    runs on its GPU, on that GPU's current stream (which a CUDA-aware MPI call synchronizes).
    """
    return contextlib.nullcontext() if isinstance(x, np.ndarray) else x.device


def _copy(dst: Any, src: Any) -> None:
    """Copy the bytes of ``src`` into ``dst`` (same number of bytes; any devices)."""
    if isinstance(dst, np.ndarray):
        _bytes(dst)[...] = _bytes(src)
    elif dst.device == src.device:
        with dst.device:
            _bytes(dst)[...] = _bytes(src)
    else:  # on dst's current stream, after src's, which then waits for the copy
        with src.device:
            source = _bytes(src)
        with dst.device:
            target = _bytes(dst)
        copies.peer(target, dst.device.id, source, src.device.id, None)


_CALLER_NAMES_KEPT = 64
"""How many thread names a group keeps before it drops those whose threads all ended."""


def _alive(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()


def _copy_each(targets: Sequence[Any], src: Any) -> None:
    for dst in targets:
        _copy(dst, src)


def _cast_into(dst: Any, src: Any) -> None:
    """Copy the values of ``src`` into ``dst`` converting to ``dst``'s dtype."""
    if src.dtype == dst.dtype:
        _copy(dst, src)
    else:  # a float16 sum reduced in float32 may overflow its dtype: inf, quietly, as MPI's
        with _on(src):
            converted = _quietly(src.astype, dst.dtype)
        _copy(dst, converted)


def _mean(total: Any, plan: Plan, count: int) -> Any:
    """``AVG``'s last step: the mean of ``count`` contributions from their reduced ``total``.

    One part per value: ``total`` divided in place (integers were summed in ``int64``). Two
    (64-bit integers): a new array from :func:`decode_average`. Either is then cast into the
    outputs.
    """
    with _on(total):
        if plan.parts > 1:
            return decode_average(total, count, np)
        average_in_place(total, count, np)
    return total


_quiet = threading.local()  # per thread: the context _quietly runs NumPy's arithmetic in


def _quietly(function: Callable[..., _R], /, *args: Any, **kwargs: Any) -> _R:
    """``function(*args, **kwargs)`` with NumPy's floating-point errors ignored, as MPI's are.

    Arithmetic the backend computes itself (a reduction, the cast of a float16 sum reduced in
    float32 back to float16) must behave as MPI's own: no ``RuntimeWarning`` (nor, under
    ``np.seterr(all="raise")``, ``FloatingPointError``) for a sum that overflows to ``inf`` or
    meets ``inf - inf``. NumPy keeps its error state in a context variable (NumPy 2), so the
    call runs in a context made once per thread that holds ``np.seterr(all="ignore")`` and
    nothing else: the cost of ``Context.run``, where entering ``errstate`` per call costs about
    1 us. ``function`` reads nothing else of the context. (Not a copy of the thread's: that
    would keep every value of it alive as long as the thread, the tapes recording at the first
    call among them.)
    """
    context = getattr(_quiet, "context", None)
    if context is None:
        context = _quiet.context = contextvars.Context()  # empty
        context.run(np.seterr, all="ignore")
    return context.run(function, *args, **kwargs)


def _accumulate(arrays: Sequence[Any], plan: Plan, count: int) -> Any:
    """A new buffer holding the local reduction of ``arrays`` in the plan's working form.

    ``count``: the number of contributions in the whole group (``AVG`` of integers needs it).
    """
    first = arrays[0]
    dtype = plan.work_dtype or first.dtype
    shape = first.shape if plan.parts == 1 else (plan.parts, *first.shape)
    acc = _temp(shape, dtype, first)
    _stage(acc, first, plan, count)
    for x in arrays[1:]:
        operand = _beside(x, acc)
        if plan.parts > 1:
            encoded = _temp(shape, dtype, acc)
            _stage(encoded, operand, plan, count)
            operand = encoded
        with _on(acc):
            plan.ufunc(acc, operand, out=acc, casting="unsafe")
    return acc


def _stage(out: Any, x: Any, plan: Plan, count: int) -> None:
    """Write ``x`` into ``out`` in the plan's working form: cast, or (two parts) encoded."""
    if plan.parts == 1:
        _cast_into(out, x)
    else:
        with _on(out):
            encode_average(x, count, out, np)


def _beside(x: Any, acc: Any) -> Any:
    """``x``, or a copy of it on ``acc``'s device."""
    if isinstance(x, np.ndarray) or x.device == acc.device:
        return x
    operand = _temp(x.shape, x.dtype, acc)
    _copy(operand, x)
    return operand


# ---------------------------------------------------------------------------------------------
# Work


class _MPIWork(Work):
    """Work tracking one MPI request (or several), polled with ``Test``/``Testall``.

    ``wait(timeout=t)`` that expires leaves the request running (a later ``wait`` completes it);
    past the group's timeout a receive is cancelled and any other operation poisons the group.
    """

    __slots__ = ("_backend", "_receives", "_request", "_side", "_status")

    _abandon_on_wait_timeout: ClassVar[bool] = False

    def __init__(
        self,
        description: str,
        backend: MPIBackend,
        request: Any,
        *,
        keep: Any = None,
        status: Any = None,
        receives: bool = False,
        timeout: float | None = None,
    ) -> None:
        Work.__init__(
            self,
            description,
            backend.group_name,
            backend.timeout if timeout is None else timeout,
            keep,
        )
        self._backend = backend
        self._request = request
        self._status = status
        self._receives = receives  # a point-to-point receive: cancellable, errors are its own
        self._side: _SideCheck | None = None

    def _test(self) -> bool:
        side = self._side
        if side is not None:
            try:
                if not side[0]():
                    return False
            except self._backend.mpi.Exception as error:
                raise self._mpi_error(error) from None
            self._settle(side)
        request = self._request
        try:
            if type(request) is list:
                return bool(self._backend.mpi.Request.Testall(request))
            if self._status is None:
                return bool(request.Test())
            if request.Test(self._status):
                self._received(self._status)
                return True
        except self._backend.mpi.Exception as error:
            raise self._mpi_error(error) from None
        return False

    def _received(self, status: Any) -> None:
        """Record a finished receive's sender; refuse a message shorter than the array.

        MPI accepts a shorter message and leaves the rest of the buffer as it was, which would
        hand the caller old bytes as if received. The message is consumed all the same, so the
        group stays usable.
        """
        self.set_source(status.Get_source())
        got = status.Get_count(self._backend._byte)
        if got != self._keep.nbytes:
            raise ValueError(
                f"{self.description}: the message is smaller than tensor ({got} bytes "
                f"received, tensor has {self._keep.nbytes}); pass a tensor of the size sent. "
                "The rest of tensor was left as it was."
            )

    def _block(self, deadline: float) -> bool:
        """Poll the requests' own ``Test`` or ``Testall`` (no status: every collective's case)."""
        side = self._side
        request = self._request
        try:  # the requests' own Test polled (see Work._poll): the rows first, then the operation
            if side is not None:
                test = side[0]
                if not (test() or self._poll(test, deadline)):
                    return False
                self._settle(side)
            if self._status is not None:
                return super()._block(deadline)
            if type(request) is list:  # (the rows of a group of two, waited alone: a pair)
                test = functools.partial(self._backend.mpi.Request.Testall, request)
            else:
                test = request.Test
            # often done by the time the ranks' rows arrived: one Test, no poll set up
            return bool(test()) or self._poll(test, deadline)
        except self._backend.mpi.Exception as error:
            raise self._mpi_error(error) from None

    def _check(self, mine: bytes, verify: Verify) -> _MPIWork:
        """Complete only once every rank's ``mine`` is known and ``verify`` of them passes.

        Some arguments make MPI's result undefined when the ranks disagree on them, silently:
        the root and the array of a rooted operation (one rank's array overwrites the root's, a
        reduction reads another dtype's bytes, or both wait forever), the byte counts and dtype
        of ``all_to_all`` (a receiver expecting more gets zeros).
        The ranks exchange them (``mine``: a row of ``int64``, of one size for every
        comparison, stamped with what this rank issued on the group before; sent on the
        group's control communicator, overlapping the operation: :meth:`MPIBackend._rows`).
        ``verify`` gets every rank's row and says what they disagree on; then every rank
        raises ``ValueError`` with that message, and the group is unusable (the operation may
        have written the arrays already, and the job is aborted at exit in case it never
        finishes).
        """
        backend = self._backend
        mine = backend._stamp(mine, len(self._request) if type(self._request) is list else 1)
        test, _, every, pair = backend._rows(mine)
        self._side = (test, mine, every, mine * backend.size, verify, pair)
        return self

    def _settle(self, side: _SideCheck) -> None:
        """The side check finished: go on if the ranks agree, else fail every rank's call."""
        self._side = None
        _, _, every, alike, verify, pair = side
        if every == alike:  # the common case
            self._backend._give_back(pair)
            return
        problem = self._disagreement(every, verify)
        self._backend._give_back(pair)  # the rows read
        if problem is not None:  # (None: rows may differ yet agree, as all_to_all's sizes)
            self._refuse(problem)

    def _refuse(self, problem: str) -> NoReturn:
        """Fail the call on ``problem``, what the ranks disagree on: the group is unusable."""
        message = (
            f"{self.description} on process group {self._backend.group_name!r}: {problem} "
            "The arrays' contents are undefined now, and this process group is unusable."
        )
        self._abandon(message)
        raise ValueError(message)

    def _disagreement(self, every: bytearray, verify: Verify) -> str | None:
        """What ``verify`` says every rank's rows (``every``: their bytes, by rank) disagree on."""
        rows = np.frombuffer(every, np.int64).reshape(self._backend.size, -1)
        return verify(rows, self._exchange)

    def _exchange(self, mine: np.ndarray) -> np.ndarray:
        """Every rank's ``mine`` (``int64``, one length on every rank), by group rank.

        For a verification that needs more than the rows: every rank settles the same rows,
        so every rank asks, though not at the same point of its other traffic on the control
        communicator; hence messages tagged ``max_tag``, which no collective and no other
        message of the control communicator matches (``new_group``'s greetings are tagged
        below it). A rank may settle the rows much later than its peers, or never (an
        ``async_op=True`` call it waits on only after issuing another collective of the group,
        which the peers, waiting here, never join): after the group's timeout the receives
        still pending are cancelled and the rows of those ranks are ``-1`` (unknown), so that
        the ranks that asked still say what they disagree on.
        """
        backend = self._backend
        control, int64, tag = backend._control, backend._int64, backend.max_tag
        every = np.zeros((backend.size, mine.size), np.int64)
        every[backend.rank] = mine
        peers = [r for r in range(backend.size) if r != backend.rank]
        sends = [control.Isend([mine, int64], peer, tag) for peer in peers]
        receives = [control.Irecv([every[peer], int64], peer, tag) for peer in peers]
        description = f"{self.description}: the ranks telling each other what they disagree on"
        work = _MPIWork(description, backend, sends + receives, keep=(mine, every))
        try:
            work.wait(timeout=backend.timeout)  # explicit: on expiry the receives are ours
        except TimeoutError:
            status = backend.mpi.Status()
            for peer, receive in zip(peers, receives, strict=True):
                receive.Cancel()
                receive.Wait(status)
                if status.Is_cancelled():
                    every[peer] = -1
        return every

    def _check_call(
        self, arrays: Sequence[Any], *, root: int = -1, op: ReduceOp | None = None
    ) -> _MPIWork:
        """Have the ranks compare the call: its thread, operation, root, reduction and arrays.

        See :func:`~cupy_parallel._src.distributed.mpi_checks.compare_call`.
        """
        backend = self._backend
        return self._check(
            *compare_call(
                self.description, backend.caller(), arrays, backend.world_ranks, root=root, op=op
            )
        )

    def _check_counts(
        self, sends: Sequence[int], receives: Sequence[int], dtype: np.dtype[Any]
    ) -> _MPIWork:
        """Have the ranks compare the bytes each sends to and expects from each other.

        See :func:`~cupy_parallel._src.distributed.mpi_checks.compare_counts`.
        """
        backend = self._backend
        return self._check(
            *compare_counts(
                backend.caller(), sends, receives, dtype, backend.world_ranks, rank=backend.rank
            )
        )

    def _mpi_error(self, error: Any) -> Exception:
        """A clear error for what MPI reported; a failed collective poisons the group."""
        backend = self._backend
        said = error.Get_error_string().split(", error stack")[0].strip()
        if self._receives:
            if error.Get_error_class() == self._backend.mpi.ERR_TRUNCATE:
                return ValueError(
                    f"{self.description}: the message is larger than tensor "
                    f"({self._keep.nbytes} bytes); pass a tensor as large as the array sent "
                    f"(MPI: {said})."
                )
            return RuntimeError(f"{self.description} failed (MPI: {said}).")
        message = (
            f"{self.description} failed on process group {backend.group_name!r}: the ranks' "
            "arrays differ in size (every rank must pass arrays of the same shape and dtype; "
            "set CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL to have the ranks compare them and name "
            f"the one that differs). MPI said: {said}"
        )
        if backend.failure is None:
            backend.failure = message
        return ValueError(message)

    def _cancel(self) -> bool:
        if not self._receives or type(self._request) is list:
            return False
        mpi = self._backend.mpi
        status = mpi.Status()
        self._request.Cancel()
        self._request.Wait(status)
        if status.Is_cancelled():
            self.fail(DistTimeoutError(f"{self.description} was cancelled."))
            return True
        try:
            self._received(status)
        except ValueError as error:
            self.fail(error)
            return True
        self.complete()  # the message arrived meanwhile
        return True

    def _on_timeout(self) -> None:
        backend = self._backend
        self._abandon(
            f"{self.description} timed out after {self._timeout:g} s on process group "
            f"{backend.group_name!r} (rank {backend.rank} of {backend.size})."
        )

    def _abandon(self, message: str) -> None:
        """Poison the group with ``message``; the job is aborted when this process exits.

        The operation may still be running (a refused call raises once the ranks' rows
        disagree, whether or not MPI finished): what it reads and writes is kept until the
        process ends, or MPI would write into memory freed and reused meanwhile (seen: a
        segmentation fault in a later collective's progress, after a refused
        ``all_gather_coalesced`` whose buffers were collected).
        """
        backend = self._backend
        if backend.failure is None:
            backend.failure = message
        _ABANDONED.append((self._request, self._keep))
        abort_at_exit(message, backend.mpi)

    def _idle(self) -> None:
        """While waiting long: fail if a member's program ended (after a grace period)."""
        departed = departed_ranks(self._backend.mpi)
        if not departed:
            return
        backend = self._backend
        if self._receives and self._source >= 0:  # a receive from one rank: that rank
            watched: tuple[int, ...] = (backend.world_ranks[self._source],)
        elif self._receives:  # from any rank: only if every other member left
            others = [r for i, r in enumerate(backend.world_ranks) if i != backend.rank]
            watched = tuple(others) if all(r in departed for r in others) else ()
        else:
            watched = backend.world_ranks
        gone = sorted(r for r in watched if r in departed)
        if not gone or time.monotonic() - max(departed[r] for r in gone) < DEPARTURE_GRACE_S:
            return
        message = (
            f"{self.description} on process group {backend.group_name!r} cannot complete: "
            f"world rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} left the job "
            "(its program ended) while this rank waited for it."
        )
        if self._receives and self._cancel():
            if self._exception is None:  # the message arrived after all
                return
            raise RuntimeError(message + " The receive was cancelled.")
        self._abandon(message)
        raise RuntimeError(message + " This process group is unusable now.")


def _finished() -> bool:
    return True


_PAIRS_KEPT = 64  # persistent pairs a group of two makes at most (see MPIBackend._rows)
OWN_MESSAGE_BYTES = 64 * 1024
"""``all_gather_coalesced``: an input of at least this many bytes travels in its own message (at
about 10 GB/s, the copy into and out of a packed buffer costs more than another message from
here on)."""

# The largest host array a synchronous all_reduce of a group of two sends in its row's message
# (MPIBackend._all_reduce_carried); a row's every receive in such a group has room for it.
_CARRIED_BYTES = 16384
_CARRIED = struct.Struct("=q")  # after the row in such a message: how many data bytes follow
_HEAD = ROW_BYTES + _CARRIED.size  # where the data of such a message starts
_NONE_CARRIED = _CARRIED.pack(0)
_SIZES_KEPT = 8  # persistent sends of a row with data a pair keeps, one per data size


class _RowsPair:
    """A persistent send and receive of rows between the two ranks of a group (see ``_rows``).

    ``Send_init``/``Recv_init`` on the control communicator, tagged as every row of the group:
    MPI pairs a started persistent request with the peer's messages in the order posted, as
    any other, so a comparison may run on a pair or on an ``Isend``/``Irecv`` (all the pairs
    taken) without the ranks agreeing on which. Started once per comparison, it saves what
    building an ``Isend`` and an ``Irecv`` costs (issue 35). ``every``: both rows by rank, this
    rank's sent from where it lies, the peer's copied there from :attr:`inbox` once received
    (the receive has room for a row with an all_reduce's data behind it: the peer may have
    sent one, see :meth:`MPIBackend._all_reduce_carried`).
    """

    __slots__ = (
        "_backend",
        "_carrying",
        "every",
        "head",
        "inbox",
        "outbox",
        "own",
        "requests",
        "startall",
        "test",
        "theirs",
    )

    def __init__(self, backend: MPIBackend) -> None:
        size = ROW_BYTES
        rank, peer, tag = backend.rank, 1 - backend.rank, backend._rows_tag
        self._backend = backend
        self.every = bytearray(2 * size)
        view = memoryview(self.every)
        self.own = view[rank * size : (rank + 1) * size]
        self.theirs = theirs = view[peer * size : (peer + 1) * size]
        self.inbox = bytearray(_HEAD + _CARRIED_BYTES)
        self.head = head = memoryview(self.inbox)[:size]
        self.outbox = memoryview(bytearray(_HEAD + _CARRIED_BYTES))  # a row with data behind it
        self._carrying: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        control, byte = backend._control, backend._byte
        self.requests = [
            control.Recv_init([self.inbox, byte], peer, tag),
            control.Send_init([self.own, byte], peer, tag),
        ]
        self.startall = backend.mpi.Prequest.Startall
        received, sent = self.requests[0].Test, self.requests[1].Test

        def test() -> bool:  # Testall's answer, in half its time (a finished request: True)
            if received() and sent():
                theirs[:] = head
                return True
            return False

        self.test = test

    def start(self, mine: bytes) -> Callable[[], bool]:
        """Send ``mine`` and receive the peer's row into :attr:`every`; what tests the pair."""
        self.own[:] = mine
        self.startall(self.requests)
        return self.test

    def carrying(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[Any, ...]:
        """How to send a row with an array of ``dtype`` and ``shape`` behind it, made once.

        The requests to start (the receive and a persistent send of the row, the data's size
        and the data from :attr:`outbox`), what tests them (the receive first), where the data
        to send goes and where the peer's arrives (arrays of that dtype and shape, in
        :attr:`outbox` and :attr:`inbox`), and the size sent after the row (see
        :meth:`MPIBackend._all_reduce_carried`).
        """
        key = (dtype, shape)
        made = self._carrying.get(key)
        if made is None:
            if len(self._carrying) >= _SIZES_KEPT:
                self.free_carrying()
            count = math.prod(shape)
            nbytes = count * dtype.itemsize
            backend = self._backend
            send = backend._control.Send_init(
                [self.outbox[: _HEAD + nbytes], backend._byte], 1 - backend.rank, backend._rows_tag
            )
            received, sent = self.requests[0].Test, send.Test

            def test() -> bool:
                return received() and sent()

            made = self._carrying[key] = (
                [self.requests[0], send],
                test,
                np.frombuffer(self.outbox, dtype, count, _HEAD).reshape(shape),
                np.frombuffer(self.inbox, dtype, count, _HEAD).reshape(shape),
                _CARRIED.pack(nbytes),
            )
        return made

    def free_carrying(self) -> None:
        """Free the persistent sends of rows with data (none is active: the pair is free)."""
        for made in self._carrying.values():
            made[0][1].Free()
        self._carrying.clear()


# ---------------------------------------------------------------------------------------------
# The backend


def _in_issue_order(primitive: Callable[..., Work]) -> Callable[..., Work]:
    """Start the collective and its comparison with no other thread's between them.

    The comparison carries what this rank issued on the group before it
    (:func:`~cupy_parallel._src.distributed.mpi_checks.stamp`), read and advanced here, so that
    rows that agree say that MPI pairs this call with itself on every rank, whichever threads
    issue them (see :func:`~cupy_parallel._src.distributed.mpi_checks.caller_fields`).
    """

    @functools.wraps(primitive)
    def issue(self: MPIBackend, /, *args: Any) -> Work:
        with self._issuing:
            return primitive(self, *args)

    return issue


class MPIBackend(ProcessGroupBackend):
    """A process group on an MPI communicator (mpi4py).

    Example:
        >>> MPIBackend.is_available(), sorted(MPIBackend.array_kinds)
        (True, ['cpu', 'cuda', 'host'])
    """

    backend: ClassVar[Backend] = Backend.MPI
    array_kinds: ClassVar[frozenset[str]] = frozenset({"cpu", "host", "cuda"})
    needs_store: ClassVar[bool] = False
    reduce_ops: ClassVar[tuple[ReduceOp, ...]] = tuple(ReduceOp)

    def __init__(self, comm: Any, control: Any, *, timeout: float, group_name: str) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout=timeout, group_name=group_name)
        self._comm = comm
        # Our own handshakes (new_group, the debug mode's comparisons) travel on a communicator
        # of their own, so that they never match a collective of the user's.
        self._control = control
        self._splits = 0
        self.world_ranks: tuple[int, ...] = tuple(range(self.size))  # subgroups: set by the split
        self._plans: dict[tuple[np.dtype[Any], ReduceOp | None], Plan | None] = {}
        # The MPI this group runs on (mpi4py's, or a thread rank's: see thread_mpi), kept so
        # that any thread may call it, a thread rank's own threads included.
        self.mpi = mpi = load_mpi()
        self._in_place = mpi.IN_PLACE
        self._byte = mpi.BYTE
        self._int64 = mpi.INT64_T
        self.max_tag = int(comm.Get_attr(mpi.TAG_UB)) - 1  # TAG_UB: monitored_barrier's
        self._issuing = threading.Lock()  # see _in_issue_order
        # What every row carries (see _stamp): the collectives started on _comm so far (MPI_I*
        # calls, Split too) and the history of the rows sent.
        self._posted = 0
        self._history = 0
        self._tokens: dict[bytes, int] = {}  # history_token by row (rows are made once, kept)
        self._thread = threading.local()  # per thread: its Caller
        # the threads that issued on the group, by the name the ranks compare (see caller)
        self._callers: dict[str, list[tuple[weakref.ref[threading.Thread], Caller]]] = {}
        self._naming = threading.Lock()
        # The rows of a group of two travel point to point (see _rows), tagged below
        # _exchange's max_tag (new_group's greetings are tagged below this one), through the
        # persistent pairs no comparison holds (None: not point to point).
        self._rows_tag = self.max_tag - 1
        self._pairs: list[_RowsPair] | None = None
        self._pairs_made = 0
        self._polls = range(_MPIWork._polls_per_yield)  # all_reduce_now's tests between yields
        if self.size == 2:  # one ready: a synchronous all_reduce carries its data from the first
            self._pairs, self._pairs_made = [_RowsPair(self)], 1

    # --------------------------------------------------------------------------- life cycle

    @classmethod
    def is_available(cls) -> bool:
        """Whether mpi4py is installed."""
        return importlib.util.find_spec("mpi4py") is not None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend cannot be used here, or ``None``."""
        if cls.is_available():
            return None
        return "mpi4py cannot be loaded; install it with `pip install cupy-parallel[mpi]`."

    @classmethod
    def create_world(
        cls, *, rank: int, world_size: int, store: Any, timeout: float, group_name: str
    ) -> MPIBackend:
        """Duplicate ``MPI.COMM_WORLD`` (nonblocking, within ``timeout``).

        ``RANK``/``WORLD_SIZE`` in the environment (set by ``cupy-parallel launch``) must agree
        with ``MPI.COMM_WORLD``: processes started without ``mpiexec`` are each a world of one.
        """
        del store
        world = load_mpi().COMM_WORLD
        actual = (world.Get_rank(), world.Get_size())
        if world_size not in (-1, actual[1]) or rank not in (-1, actual[0]):
            raise ValueError(
                f"The MPI backend takes rank and world size from MPI.COMM_WORLD (rank "
                f"{actual[0]} of {actual[1]}), got rank={rank}, world_size={world_size}; leave "
                "them at -1 or start the processes with `mpiexec -n WORLD_SIZE`."
            )
        _check_environment(*actual)
        comm, request = world.Idup()
        control, control_request = world.Idup()
        backend = cls(comm, control, timeout=timeout, group_name=group_name)
        _MPIWork(
            "init_process_group (duplicating MPI.COMM_WORLD)",
            backend,
            [request, control_request],
        ).wait()
        # More ranks on this node than cores: yield the core every few tests while polling, so the
        # peers that share it can progress. Measured on 4 ranks over 2 cores (4 KiB all_reduce):
        # 1 test per yield +13 us over a blocking Allreduce, 4 tests +3..8 us, 16 tests +24 us.
        # (Thread ranks' requests wait for news in Test instead: see thread_mpi.)
        if thread_rank() is None:
            node = comm.Split_type(backend.mpi.COMM_TYPE_SHARED)
            _MPIWork._polls_per_yield = 4 if node.Get_size() > (os.cpu_count() or 1) else 64
            backend._polls = range(_MPIWork._polls_per_yield)
            node.Free()
        if backend.size > 1:
            guard_job(world)
        return backend

    def new_subgroup(
        self, ranks: Sequence[int], *, timeout: float, group_name: str, local: bool = False
    ) -> MPIBackend | None:
        """Split the world communicator; every world rank calls it, within ``timeout``.

        The ranks first exchange (on the control communicator) which call this is and the
        member list they were given, so that the blocking ``MPI_Comm_split`` starts only once
        every rank is known to be in it, with the same members. ``local=True``: only the members
        call it (:meth:`_new_local_subgroup`).
        """
        if local:
            return self._new_local_subgroup(ranks, timeout=timeout, group_name=group_name)
        self._splits += 1
        crc = zlib.crc32(np.asarray(ranks, np.int64).tobytes())
        self._compare_alone(
            f"new_group({list(ranks)})",
            "waiting for every world rank",
            functools.partial(compare_new_group, split=self._splits, members=crc),
            timeout,
        )
        member = self.rank in ranks
        mpi = self.mpi
        color = 0 if member else mpi.UNDEFINED
        key = list(ranks).index(self.rank) if member else 0
        with self._issuing:  # a collective on _comm: counted as the comparisons count them
            self._posted += 1
            comm = self._comm.Split(color, key)
        if not member:
            return None
        sub = MPIBackend(comm, comm.Dup(), timeout=timeout, group_name=group_name)
        sub.world_ranks = tuple(ranks)
        return sub

    def _new_local_subgroup(
        self, ranks: Sequence[int], *, timeout: float, group_name: str
    ) -> MPIBackend | None:
        """``MPI_Comm_create_group`` over the members only (``use_local_synchronization``).

        The members first greet each other with point-to-point messages on the control
        communicator, tagged by the group's name, each carrying the member list (a checksum):
        the blocking ``MPI_Comm_create_group`` starts only once every member is known to be at
        the same call with the same members, and a member that never comes is a
        ``TimeoutError`` after ``timeout`` instead of a hang. A non-member has nothing to do.
        """
        if self.rank not in ranks:
            return None
        mpi = self.mpi
        tag = zlib.crc32(group_name.encode()) % max(self._rows_tag, 1)  # below the rows' tag
        mine = np.array([zlib.crc32(np.asarray(ranks, np.int64).tobytes())], np.int64)
        peers = [r for r in ranks if r != self.rank]
        theirs = np.zeros(len(peers), np.int64)
        requests = [self._control.Isend([mine, mpi.INT64_T], peer, tag) for peer in peers]
        requests += [
            self._control.Irecv([theirs[i : i + 1], mpi.INT64_T], peer, tag)
            for i, peer in enumerate(peers)
        ]
        description = f"new_group({list(ranks)}, use_local_synchronization=True)"
        _MPIWork(description, self, requests, keep=(mine, theirs), timeout=timeout).wait()
        differ = [peer for peer, crc in zip(peers, theirs, strict=True) if crc != mine[0]]
        if differ:
            raise ValueError(
                f"new_group(use_local_synchronization=True): world ranks {differ} passed other "
                f"ranks than this rank ({list(ranks)}) for the same group; every member must "
                "pass the same ranks."
            )
        members = self._comm.Get_group().Incl(list(ranks))
        try:
            comm = self._comm.Create_group(members, tag)
        finally:
            members.Free()
        sub = MPIBackend(comm, comm.Dup(), timeout=timeout, group_name=group_name)
        sub.world_ranks = tuple(ranks)
        return sub

    def caller(self) -> Caller:
        """The calling thread as the ranks compare it.

        See :class:`~cupy_parallel._src.distributed.mpi_checks.Caller`.
        """
        thread = self._thread
        caller = getattr(thread, "caller", None)
        if caller is None:
            caller = thread.caller = self._new_caller()
        return caller

    def _new_caller(self) -> Caller:
        """The calling thread's :class:`Caller`, made at its first call on the group.

        The ranks tell threads apart by name, so two live threads of one name issuing on one
        group would pair each other's calls with no error. Both are marked instead: their rows
        carry a name that holds this rank, which no other rank's row matches, so each of their
        calls raises on every rank (naming the clash). Checked against the threads that issued
        on the group before and are alive and, in a process of its own, every live thread of
        the process: two threads started together are refused from their first call. (A
        thread rank cannot tell its threads from the other ranks': there, a clash is found
        at the second thread's first call, and the calls before it are not covered.)
        """
        name = thread_name()
        current = threading.current_thread()
        caller = Caller(name)
        with self._naming:
            known = [(ref, c) for ref, c in self._callers.get(name, ()) if _alive(ref())]
            clash = [c for _, c in known]
            if thread_rank() is None and any(
                t is not current and t.name == name for t in threading.enumerate()
            ):
                clash.append(caller)
            if clash:
                marked = caller_fields(f"2 threads named {name!r}, rank {self.rank}")
                for each in {id(c): c for c in [*clash, caller]}.values():
                    each.fields = marked
                    each.rows.clear()
                    each.ready.clear()
            if len(self._callers) >= _CALLER_NAMES_KEPT:  # a thread per task: drop the ended
                self._callers = {
                    key: live
                    for key, entries in self._callers.items()
                    if (live := [(ref, c) for ref, c in entries if _alive(ref())])
                }
            self._callers[name] = [*known, (weakref.ref(current), caller)]
        return caller

    def _stamp(self, row: bytes, collectives: int, token: int | None = None) -> bytes:
        """``row`` stamped with what this rank issued on the group before it; then count it.

        See :func:`~cupy_parallel._src.distributed.mpi_checks.stamp`. ``collectives``: how
        many this row's operation starts on the group's communicator; ``token``: the row's
        :func:`history_token`, if known. Call under ``_issuing``, with the operation and the
        row's exchange started under the same hold.
        """
        posted, history = self._posted, self._history
        if token is None:
            token = self._tokens.get(row)
        if token is None:  # a row met first (a bytes object hashes once)
            if len(self._tokens) >= _TOKENS_KEPT:
                self._tokens.clear()
            token = self._tokens[row] = history_token(row)
        self._posted = posted + collectives
        self._history = followed(history, token)
        return stamp(row, posted, history)

    def _rows(self, mine: bytes) -> tuple[Callable[[], bool], Any, bytearray, _RowsPair | None]:
        """Start exchanging this rank's row for every rank's; call under ``_issuing``.

        Returns what tests whether the exchange finished, its request (or list of them), the
        bytes of every rank's row, by rank, once it did, and the persistent pair it runs on,
        if any, which the caller gives back (``_pairs``) once it read the rows. On the control
        communicator, in the order the rows are made (under the lock): each rank's ``k``-th
        row meets every other rank's ``k``-th. A group of more than two ranks gathers them
        (``Iallgather``). A group of two sends them point to point, tagged ``_rows_tag``,
        which MPI pairs in the order they are posted, as it pairs the collectives, through a
        persistent pair (:class:`_RowsPair`) that no other comparison holds, else an
        ``Isend`` and an ``Irecv``: what starts faster from Python than a collective (issue
        35). A group of one has nothing to send.
        """
        if self.size == 1:
            return _finished, [], bytearray(mine), None
        pairs = self._pairs
        if pairs is not None and (pairs or self._pairs_made < _PAIRS_KEPT):
            if pairs:
                pair = pairs.pop()
            else:
                pair = _RowsPair(self)
                self._pairs_made += 1
            return pair.start(mine), pair.requests, pair.every, pair
        every = bytearray(len(mine) * self.size)
        if pairs is None:  # more than two ranks (or two thread ranks, whose MPI has no pairs)
            request = self._control.Iallgather([mine, self._int64], [every, self._int64])
            return request.Test, request, every, None
        size, peer, tag = len(mine), 1 - self.rank, self._rows_tag
        view = memoryview(every)
        view[self.rank * size : (self.rank + 1) * size] = mine
        inbox = bytearray(_HEAD + _CARRIED_BYTES)  # as a pair's: the peer's row may carry data
        requests = [
            self._control.Irecv([inbox, self._byte], peer, tag),
            self._control.Isend([mine, self._byte], peer, tag),
        ]
        testall = self.mpi.Request.Testall

        def test() -> bool:
            if testall(requests):
                view[peer * size : (peer + 1) * size] = inbox[:size]
                return True
            return False

        return test, requests, every, None

    def _give_back(self, pair: _RowsPair | None) -> None:
        """``pair``'s exchange finished and its rows were read: another comparison may take it."""
        pairs = self._pairs
        if pair is not None and pairs is not None:  # (None: the group was shut down)
            pairs.append(pair)

    def shutdown(self) -> None:
        """Free the communicators (left alone when a timed-out operation may still use them)."""
        if self.failure is None:
            for pair in self._pairs or ():  # those no comparison holds
                pair.free_carrying()
                for request in pair.requests:
                    request.Free()
            self._pairs = None
            self._comm.Free()
            self._control.Free()

    def check_dtype(self, dtype: np.dtype[Any], op: ReduceOp | None, /) -> None:
        """Refuse object arrays; for reductions, dtypes and ops MPI cannot combine."""
        if (dtype, op) not in self._plans:
            self._plans[dtype, op] = make_plan(dtype, op, self.mpi)

    def _plan(self, dtype: np.dtype[Any], op: ReduceOp) -> Plan:
        plan = self._plans.get((dtype, op))
        if plan is None:
            plan = make_plan(dtype, op, self.mpi)
            self._plans[dtype, op] = plan
        assert plan is not None  # only data movement (op None) has no plan
        return plan

    # --------------------------------------------------------------------------- primitives

    @staged(0)
    @_in_issue_order
    def broadcast(self, arrays: Sequence[Any], root: int, root_index: int, /) -> Work:
        """Ibcast of one array, then local copies to the other local arrays."""
        arrays = [plain_buffer(x) for x in arrays]
        source = arrays[root_index] if self.rank == root else arrays[0]
        request = self._comm.Ibcast([source, self._byte], root)
        work = _MPIWork("broadcast", self, request, keep=source)._check_call(arrays, root=root)
        if len(arrays) > 1:
            others = [x for x in arrays if x is not source]
            work.add_finalizer(functools.partial(_copy_each, others, source))
        return work

    @staged(0)
    def all_reduce(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """Iallreduce in place (one array) or of the local reduction (several).

        One array reduced in its own dtype, the common case, is issued with the least Python
        before MPI starts (:meth:`_all_reduce_one`).
        """
        first = arrays[0]
        plan = self._plans.get((first.dtype, op)) or self._plan(first.dtype, op)
        if len(arrays) != 1 or plan.work_dtype is not None:
            with self._issuing:
                return self._all_reduce_local(arrays, op)
        buffer = plain_buffer(first)
        request, side = self._all_reduce_one(buffer, op, plan)
        work = _MPIWork("all_reduce", self, request, keep=buffer)
        work._side = side
        if plan.average:
            work.add_finalizer(functools.partial(_mean, buffer, plan, self.size))
        return work

    def all_reduce_now(self, x: Any, op: ReduceOp, /) -> None:
        """``all_reduce([x], op)`` waited on, without a :class:`Work` while it goes well.

        The synchronous call of one host array (the public layer checked it), from what the
        calling thread keeps for the call's signature (:meth:`_ready`: the row, its
        verification and history token, the reduction's plan). A group of two sends an array
        of up to 16 KiB with its row, one message (:meth:`_all_reduce_carried`). Else it starts
        as :meth:`all_reduce` starts it (a group of two sends the row through a persistent
        pair, :meth:`_rows`); then the rows' exchange and the operation are tested here, one
        stretch of spinning each (:func:`~.work.spun`), and ``AVG``'s mean taken. Anything
        else (not finished within that stretch, rows that differ, an error MPI reports, a
        reduction in a working dtype) is handed to the :class:`_MPIWork` that :meth:`all_reduce`
        would have returned, in the state reached: the group's timeout, a departed peer, the
        disagreement's ``ValueError`` on every rank, as on the general path. Measured: see
        ``mpi_checks``' issue 35 note.
        """
        buffer = x if type(x) is np.ndarray else plain_buffer(x)
        caller = getattr(self._thread, "caller", None) or self.caller()
        ready = caller.ready.get((buffer.dtype, buffer.shape, op)) or self._ready(
            caller, buffer, op
        )
        if ready is None:  # reduced in a working dtype
            self.all_reduce([buffer], op).wait()
            return
        row, verify, token, plan = ready
        pairs = self._pairs
        if (
            pairs
            and 0 < buffer.nbytes <= _CARRIED_BYTES
            and self._all_reduce_carried(buffer, ready)
        ):
            return
        pair: _RowsPair | None
        test: Callable[[], bool]
        with self._issuing:
            request = self._comm.Iallreduce(self._in_place, [buffer, plan.mpi_type], plan.mpi_op)
            mine = self._stamp(row, 1, token)  # per call: what this rank issued before it
            if pairs:  # _rows' common case, inline
                pair = pairs.pop()
                pair.own[:] = mine
                pair.startall(pair.requests)
                test, every = pair.test, pair.every
            else:
                test, _, every, pair = self._rows(mine)
        alike = mine * self.size
        try:
            settled = spun(test, self._polls)
            done = (
                settled and every == alike and (request.Test() or spun(request.Test, self._polls))
            )
        except self.mpi.Exception as error:
            raise _MPIWork("all_reduce", self, request, keep=buffer)._mpi_error(error) from None
        if done:
            if pair is not None:
                pairs.append(pair)  # type: ignore[union-attr]
        else:
            work = _MPIWork("all_reduce", self, request, keep=buffer)
            side = (test, mine, every, alike, verify, pair)
            if settled:
                work._settle(side)  # rows that differ: ValueError on every rank
            else:
                work._side = side
            work.wait()
        if plan.average:
            _mean(buffer, plan, self.size)

    def _all_reduce_carried(self, buffer: Any, ready: tuple[Any, ...]) -> bool:
        """:meth:`all_reduce_now` of a group of two, the array sent with the row.

        ``False``: no persistent pair was free (nothing started).

        Each rank sends the peer its row with the array behind it, one message through a
        persistent pair (where the rows alone need a message beside the collective: one MPI
        call started and one waited on instead of two, issue 35), compares the rows and
        reduces the two arrays itself, in rank order (``op(x0, x1)`` on both ranks, so both
        get the same bits, which are MPI's: its reduction of two ranks is the same
        elementwise operation). The rows are stamped as any collective's (the message stands
        for the call's collective), so that the ranks compare them as every call's.
        A peer that issued the same call another way (``async_op=True``, or no pair free)
        sent its row alone and started an ``Iallreduce``: this rank then starts its own, which
        MPI pairs with it. So the ``_issuing`` lock is held from the stamp until then: no other
        thread of this rank may start a collective on the group in between, which MPI would
        pair with the peer's ``Iallreduce`` (the peer, its rows alike, would return that
        call's sum). Such a thread waits for the exchange; a program that issues a group's
        collectives from one thread at a time never does. Every receive of a row in a group of
        two has room for a row with data behind it; the size that follows the row says
        whether the peer sent data (it is cleared before each receive). Rows that differ raise
        on every rank, as any call's; the group's timeout and a departed peer as on the
        general path.
        """
        row, verify, token, plan = ready
        pairs = self._pairs
        with self._issuing:  # to the end of the exchange (see the docstring)
            if not pairs:  # (another thread took the last one)
                return False
            pair = pairs.pop()
            requests, test, slot, theirs, size = pair.carrying(buffer.dtype, buffer.shape)
            sent = self._stamp(row, 1, token) + size
            pair.outbox[:_HEAD] = sent
            slot[...] = buffer
            pair.inbox[ROW_BYTES:_HEAD] = _NONE_CARRIED
            pair.startall(requests)
            try:
                done = spun(test, self._polls)
            except self.mpi.Exception as error:
                work = _MPIWork("all_reduce", self, requests, keep=buffer)
                raise work._mpi_error(error) from None
            if not done:  # the group's timeout, a departed peer
                _MPIWork("all_reduce", self, requests, keep=buffer).wait()
            if pair.inbox[:_HEAD] == sent:  # the rows alike, and the peer sent its array
                request = None
            else:
                self._carried_disagreement(pair, sent[:ROW_BYTES], verify, buffer)
                request = (  # the peer's Iallreduce waits for this rank's
                    None
                    if pair.inbox[ROW_BYTES:_HEAD] == size
                    else self._comm.Iallreduce(self._in_place, [buffer, plan.mpi_type], plan.mpi_op)
                )
        if request is None:  # reduced here, in rank order
            first, second = (theirs, buffer) if self.rank else (buffer, theirs)
            try:
                _quietly(plan.ufunc, first, second, out=buffer)
            finally:  # the peer's array read (or the reduction failed): another call may take it
                self._give_back(pair)
        else:
            self._give_back(pair)
            _MPIWork("all_reduce", self, request, keep=buffer).wait()
        if plan.average:
            _mean(buffer, plan, self.size)
        return True

    def _carried_disagreement(
        self, pair: _RowsPair, mine: bytes, verify: Verify, buffer: Any
    ) -> None:
        """Raise on rows that differ (the peer's in ``pair``), as :meth:`_MPIWork._settle` does."""
        if pair.head == mine:
            return
        pair.own[:] = mine
        pair.theirs[:] = pair.head
        work = _MPIWork("all_reduce", self, pair.requests, keep=buffer)
        problem = work._disagreement(pair.every, verify)
        if problem is not None:
            self._give_back(pair)
            work._refuse(problem)

    def _ready(self, caller: Caller, buffer: Any, op: ReduceOp) -> tuple[Any, ...] | None:
        """What :meth:`all_reduce_now` needs for a call's signature, kept by its thread.

        The row and its verification (:func:`compare_call`), the row's history token and the
        reduction's plan; ``None`` for a reduction in a working dtype (not kept:
        :meth:`all_reduce`'s general path).
        """
        plan = self._plan(buffer.dtype, op)
        if plan.work_dtype is not None:
            return None
        row, verify = compare_call("all_reduce", caller, (buffer,), self.world_ranks, op=op)
        ready = (row, verify, history_token(row), plan)
        if len(caller.ready) >= _TOKENS_KEPT:
            caller.ready.clear()
        caller.ready[buffer.dtype, buffer.shape, op] = ready
        return ready

    def _all_reduce_one(self, buffer: Any, op: ReduceOp, plan: Plan) -> tuple[Any, _SideCheck]:
        """Start the ``Iallreduce`` of one host array in place, and its comparison's exchange.

        The comparison's row is made once per thread and call signature (:func:`compare_call`),
        and stamped while the ``Iallreduce`` is under way, ``_issuing`` held so that the row's
        exchange follows it with no other thread's collective between them (as
        :func:`_in_issue_order` holds it for the other collectives). Returns the operation's
        request and the side check (:meth:`_MPIWork._check`'s).
        """
        row, verify = compare_call("all_reduce", self.caller(), (buffer,), self.world_ranks, op=op)
        with self._issuing:
            request = self._comm.Iallreduce(self._in_place, [buffer, plan.mpi_type], plan.mpi_op)
            mine = self._stamp(row, 1)  # per call: what this rank issued before it
            test, _, every, pair = self._rows(mine)
        return request, (test, mine, every, mine * self.size, verify, pair)

    def _all_reduce_local(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """``all_reduce`` of the local reduction of ``arrays``, in the plan's working form."""
        first = arrays[0]
        plan = self._plan(first.dtype, op)
        outputs = [plain_buffer(x) for x in arrays]
        count = self.size * len(arrays)
        acc = _accumulate(outputs, plan, count)
        request = self._comm.Iallreduce(self._in_place, [acc, plan.mpi_type], plan.mpi_op)

        def finish() -> None:
            result = _mean(acc, plan, count) if plan.average else acc
            for x in outputs:
                _cast_into(x, result)

        work = _MPIWork("all_reduce", self, request, keep=acc)._check_call(outputs, op=op)
        return work.add_finalizer(finish)

    @staged(0)
    @_in_issue_order
    def reduce(self, arrays: Sequence[Any], root: int, root_index: int, op: ReduceOp, /) -> Work:
        """Ireduce in place (one array) or of the local reduction (several)."""
        outputs = [plain_buffer(x) for x in arrays]
        plan = self._plan(outputs[0].dtype, op)
        at_root = self.rank == root
        count = self.size * len(outputs)
        direct = len(outputs) == 1 and plan.work_dtype is None
        acc = outputs[0] if direct else _accumulate(outputs, plan, count)
        message = [acc, plan.mpi_type]
        if at_root:
            request = self._comm.Ireduce(self._in_place, message, plan.mpi_op, root)
        else:
            request = self._comm.Ireduce(message, None, plan.mpi_op, root)
        work = _MPIWork("reduce", self, request, keep=acc)._check_call(outputs, root=root, op=op)
        if at_root:
            target = outputs[root_index]

            def finish() -> None:
                result = _mean(acc, plan, count) if plan.average else acc
                if result is not target:
                    _cast_into(target, result)

            work.add_finalizer(finish)
        return work

    @staged(0)
    @_in_issue_order
    def all_gather(self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], /) -> Work:
        """Iallgather of the packed local inputs into one buffer, unpacked on completion."""
        local = len(inputs)
        first = plain_buffer(inputs[0])
        if local == 1 and len(outputs) == 1:  # all_gather_into_tensor: its output's chunks
            span = _span([plain_buffer(x) for x in outputs[0]], first.nbytes, receive=True)
            if span is not None and not np.may_share_memory(span, first):
                request = self._comm.Iallgather([first, self._byte], [span, self._byte])
                work = _MPIWork("all_gather", self, request, keep=(first, span))
                return work._check_call(inputs)
        send = first if local == 1 else _pack(inputs)
        received = _temp((self.size * local * first.nbytes,), np.uint8, first)
        request = self._comm.Iallgather([send, self._byte], [received, self._byte])

        def finish() -> None:
            for row in outputs:
                _unpack(received, row)

        work = _MPIWork("all_gather", self, request, keep=(send, received))
        return work._check_call(inputs).add_finalizer(finish)

    @staged(0)
    @_in_issue_order
    def gather(self, outputs: Sequence[Any] | None, input: Any, root: int, /) -> Work:
        """Igather into one buffer at the root, unpacked on completion."""
        source = plain_buffer(input)
        if outputs is None:
            request = self._comm.Igather([source, self._byte], None, root)
            return _MPIWork("gather", self, request, keep=source)._check_call([source], root=root)
        received = _temp((self.size * source.nbytes,), np.uint8, source)
        request = self._comm.Igather([source, self._byte], [received, self._byte], root)
        work = _MPIWork("gather", self, request, keep=(source, received))
        work._check_call([source], root=root)
        return work.add_finalizer(functools.partial(_unpack, received, outputs))

    @staged(0)
    @_in_issue_order
    def scatter(self, output: Any, inputs: Sequence[Any] | None, root: int, /) -> Work:
        """Iscatter from the root's packed inputs straight into ``output``."""
        target = plain_buffer(output)
        send = None if inputs is None else [_pack(inputs), self._byte]
        request = self._comm.Iscatter(send, [target, self._byte], root)
        work = _MPIWork("scatter", self, request, keep=(send, target))
        return work._check_call([target], root=root)

    @staged(0)
    @_in_issue_order
    def reduce_scatter(
        self, outputs: Sequence[Any], inputs: Sequence[Sequence[Any]], op: ReduceOp, /
    ) -> Work:
        """Ireduce_scatter_block of the local reduction of the inputs."""
        outputs = [plain_buffer(x) for x in outputs]
        local = len(outputs)
        first = outputs[0]
        plan = self._plan(first.dtype, op)
        dtype = plan.work_dtype or first.dtype
        chunks = len(inputs[0])
        count = self.size * local
        shape = first.shape if plan.parts == 1 else (plan.parts, *first.shape)
        direct = local == 1 and plan.work_dtype is None
        span = None
        if direct and plan.parts == 1 and len(inputs) == 1 and inputs[0][0].dtype == dtype:
            # reduce_scatter_tensor: its input's chunks, sent as they are (nothing to convert)
            span = _span([plain_buffer(x) for x in inputs[0]], first.nbytes, receive=False)
        if span is not None and not np.may_share_memory(span, first):
            acc = span.view(dtype)
        else:
            acc = _temp((chunks, *shape), dtype, first)
            for k in range(chunks):
                column = [plain_buffer(row[k]) for row in inputs]
                _copy(acc[k, ...], _accumulate(column, plan, count))
        received = first if direct else _temp((local, *shape), dtype, first)
        request = self._comm.Ireduce_scatter_block(
            [acc, plan.mpi_type], [received, plan.mpi_type], plan.mpi_op
        )

        def finish() -> None:
            if direct:
                if plan.average:
                    _mean(received, plan, count)
                return
            for j, x in enumerate(outputs):
                result = received[j, ...]
                _cast_into(x, _mean(result, plan, count) if plan.average else result)

        work = _MPIWork("reduce_scatter", self, request, keep=(acc, received))
        return work._check_call(outputs, op=op).add_finalizer(finish)

    @staged(0)
    @_in_issue_order
    def all_to_all(self, outputs: Sequence[Any], inputs: Sequence[Any], /) -> Work:
        """Ialltoallv of byte counts, packed and unpacked locally."""
        first = plain_buffer(inputs[0])
        send_counts = [x.nbytes for x in inputs]
        recv_counts = [x.nbytes for x in outputs]
        send = _pack(inputs)
        received = _temp((sum(recv_counts),), np.uint8, first)
        request = self._comm.Ialltoallv(
            [send, (send_counts, _offsets(send_counts)), self._byte],
            [received, (recv_counts, _offsets(recv_counts)), self._byte],
        )
        work = _MPIWork("all_to_all", self, request, keep=(send, received))
        work._check_counts(send_counts, recv_counts, first.dtype)
        return work.add_finalizer(functools.partial(_unpack, received, outputs))

    def agree(self, record: bytes, /) -> list[bytes]:
        """Digests on the control communicator; the records themselves only if they differ.

        A digest travels in a row as a collective's comparison does (see
        :func:`~cupy_parallel._src.distributed.mpi_checks.compare_digest`), so that a rank here
        where another makes a group (or compares without the debug mode) is told so.
        """
        digest = hashlib.blake2b(record, digest_size=16).digest()
        make = functools.partial(compare_digest, digest=digest)
        if self._compare_alone("the debug mode's comparison", "", make, self.timeout):
            return [record] * self.size
        records: list[bytes] = self._control.allgather(record)  # every rank is here
        return records

    def _compare_alone(
        self,
        description: str,
        waiting: str,
        make: Callable[..., Comparison],
        timeout: float,
    ) -> bool:
        """Exchange a comparison's rows on their own (beside no operation); ``True`` if alike.

        ``make(caller, world)`` makes this rank's row and its verification; the rows travel as
        a collective's (under ``_issuing``, on the control communicator). Rows that differ in
        what the verification names raise ``ValueError`` on every rank; rows that differ only
        in what it leaves to the caller return ``False``.
        """
        with self._issuing:
            mine, verify = make(self.caller(), self.world_ranks)
            mine = self._stamp(mine, 0)  # beside no collective on _comm
            test, request, every, pair = self._rows(mine)
        waited = f"{description} {waiting}" if waiting else description
        work = _MPIWork(waited, self, request, keep=(mine, every), timeout=timeout)
        work.wait()
        test()  # finished: a group of two copies the peer's row into every here
        alike = every == mine * self.size
        problem = None if alike else work._disagreement(every, verify)
        self._give_back(pair)
        if alike:
            return True
        if problem is not None:
            raise ValueError(f"{description}: {problem}")
        return False

    @_in_issue_order
    def barrier(self) -> Work:
        """Ibarrier, compared as every collective is (a barrier must meet a barrier)."""
        work = _MPIWork("barrier", self, self._comm.Ibarrier())
        return work._check(*compare_barrier(self.caller(), self.world_ranks))

    @staged()
    def send(self, array: Any, dst: int, tag: int, /) -> Work:
        """Isend of the array's bytes."""
        source = plain_buffer(array)
        request = self._comm.Isend([source, self._byte], dst, tag)
        return _MPIWork(f"send to group rank {dst}", self, request, keep=source)

    @staged(0)
    def recv(self, array: Any, src: int | None, tag: int, /) -> Work:
        """Irecv of the array's bytes (``ANY_SOURCE`` when ``src`` is ``None``)."""
        mpi = self.mpi
        target = plain_buffer(array)
        status = mpi.Status()  # how many bytes came (and, from ANY_SOURCE, from whom)
        peer = mpi.ANY_SOURCE if src is None else src
        request = self._comm.Irecv([target, self._byte], peer, tag)
        description = "recv from any rank" if src is None else f"recv from group rank {src}"
        work = _MPIWork(description, self, request, keep=target, status=status, receives=True)
        work.set_source(-1 if src is None else src)  # known before completion (_idle watches it)
        return work

    @staged(0)
    @_in_issue_order
    def all_reduce_coalesced(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """One Iallreduce per dtype over the arrays flattened into one buffer."""
        outputs = [plain_buffer(x) for x in arrays]
        by_dtype: dict[np.dtype[Any], list[Any]] = {}
        for x in outputs:
            by_dtype.setdefault(x.dtype, []).append(x)
        requests, buffers, finishers = [], [], []
        for dtype, group in by_dtype.items():
            plan = self._plan(dtype, op)
            work_dtype = plan.work_dtype or dtype
            total = sum(x.size for x in group)
            shape = (total,) if plan.parts == 1 else (plan.parts, total)
            flat = _temp(shape, work_dtype, group[0])
            offset = 0
            for x in group:
                _stage(flat[..., offset : offset + x.size], x.reshape(-1), plan, self.size)
                offset += x.size
            requests.append(
                self._comm.Iallreduce(self._in_place, [flat, plan.mpi_type], plan.mpi_op)
            )
            buffers.append(flat)
            finishers.append(functools.partial(_unflatten, flat, group, plan, self.size))
        work = _MPIWork("all_reduce_coalesced", self, requests, keep=buffers)
        work._check_call(outputs, op=op)
        for finish in finishers:
            work.add_finalizer(finish)
        return work

    @staged(0)
    @_in_issue_order
    def all_gather_coalesced(
        self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], /
    ) -> Work:
        """An Iallgather of each input of :data:`OWN_MESSAGE_BYTES` or more, the rest packed.

        Messages: each large input alone, then the smaller ones packed into one (an input
        alone in its message is sent as it is). Which inputs share a message depends only on
        their sizes, which every rank's call shares (the ranks compare them), so every rank
        issues the same messages in the same order. A message of one input whose outputs lie
        end to end in rank order (views of one buffer: FSDP's gathered parameters) and hold
        no input sent as it is (its own or another message's, still being read) is received
        straight into them, nothing copied; else into a buffer, unpacked on completion (when
        every message has been sent).
        """
        sources = [plain_buffer(x) for x in inputs]
        small = [k for k, x in enumerate(sources) if x.nbytes < OWN_MESSAGE_BYTES]
        messages = [[k] for k, x in enumerate(sources) if x.nbytes >= OWN_MESSAGE_BYTES]
        if small or not messages:
            messages.append(small)
        sends = [
            sources[ks[0]] if len(ks) == 1 else _pack([sources[k] for k in ks]) for ks in messages
        ]
        requests, keep, finishers = [], [], []
        for ks, send in zip(messages, sends, strict=True):
            rows = [[plain_buffer(row[k]) for k in ks] for row in outputs]
            target = None
            if len(ks) == 1:
                target = _span([row[0] for row in rows], send.nbytes, receive=True)
            # not in place where it would write an input still to be read, as it is sent:
            # its own (a rank's own slot) or another message's, in flight beside it
            if target is None or any(np.may_share_memory(target, x) for x in sends):
                target = _temp((self.size * send.nbytes,), np.uint8, send)
                finishers.append(functools.partial(_unpack_rows, target, rows))
            requests.append(self._comm.Iallgather([send, self._byte], [target, self._byte]))
            keep.append((send, target))
        work = _MPIWork("all_gather_coalesced", self, requests, keep=keep)
        work._check_call(inputs)
        for finish in finishers:
            work.add_finalizer(finish)
        return work


def _check_environment(rank: int, size: int) -> None:
    """Refuse a ``RANK``/``WORLD_SIZE`` environment that disagrees with ``MPI.COMM_WORLD``."""
    env_rank, env_size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is None or env_size is None:
        return
    if (env_rank.strip(), env_size.strip()) != (str(rank), str(size)):
        raise RuntimeError(
            f"The environment says RANK={env_rank}, WORLD_SIZE={env_size}, but MPI.COMM_WORLD is "
            f"rank {rank} of {size}: these processes were not started by mpiexec together (each "
            "is a world of its own, as under `cupy-parallel launch` without `--backend mpi`). "
            "Start them with `cupy-parallel launch --backend mpi` or `mpiexec -n WORLD_SIZE`, or "
            "unset RANK/WORLD_SIZE."
        )


# ---------------------------------------------------------------------------------------------
# Packing


def _offsets(counts: Sequence[int]) -> list[int]:
    """Where each count's block starts (MPI's displacements)."""
    return list(itertools.accumulate(counts[:-1], initial=0))


def _pack(arrays: Sequence[Any]) -> Any:
    """The bytes of ``arrays`` one after the other, in a new buffer."""
    plain = [plain_buffer(x) for x in arrays]
    packed = _temp((sum(x.nbytes for x in plain),), np.uint8, plain[0])
    offset = 0
    for x in plain:
        _copy(packed[offset : offset + x.nbytes], x)
        offset += x.nbytes
    return packed


def _unpack(packed: Any, arrays: Sequence[Any]) -> None:
    """Fill ``arrays`` with consecutive bytes of ``packed``."""
    offset = 0
    for x in arrays:
        target = plain_buffer(x)
        _copy(target, packed[offset : offset + target.nbytes])
        offset += target.nbytes


def _unpack_rows(received: Any, rows: Sequence[Sequence[Any]]) -> None:
    """Rank ``r``'s equal share of ``received`` into the arrays ``rows[r]``, one after another."""
    share = received.nbytes // len(rows)
    for r, row in enumerate(rows):
        _unpack(received[r * share : (r + 1) * share], row)


def _unflatten(flat: Any, arrays: Sequence[Any], plan: Plan, size: int) -> None:
    if plan.average:
        flat = _mean(flat, plan, size)
    offset = 0
    for x in arrays:
        _cast_into(x.reshape(-1), flat[offset : offset + x.size])
        offset += x.size
