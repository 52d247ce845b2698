"""The NCCL backend: CuPy arrays communicated with ``cupy.cuda.nccl`` (torch's ProcessGroupNCCL).

* Communicators: made on first use for each tuple of local devices a call uses (one device for
  the plain functions, several for ``*_multigpu``), as torch does, since only the arrays say which
  GPU a process drives. Group rank 0 creates the NCCL unique id and shares it through the store
  as raw bytes, under a key numbered by a per-group counter (every rank makes its communicators in
  the same order); the last rank to read it deletes it. With ``L`` local devices the communicator
  has ``size * L`` members; local device ``j`` of group rank ``r`` is member ``r * L + j``, and
  its ``L`` communicators are created inside one ``groupStart``/``groupEnd``. Subgroups get their
  own id the same way (``ncclCommSplit`` would need every world rank to own an initialised world
  communicator at ``new_group`` time, which lazy creation does not guarantee).
* Streams: every call runs on an internal non-blocking stream per device. That stream first waits
  on an event recorded on the caller's current stream (so kernels the caller queued before the
  call are seen by it); an event recorded after the call marks completion. Arrays (and temporary
  buffers) an operation touches are kept alive until its event has fired, even if the ``Work``
  is dropped.
* Waiting, as torch's ProcessGroupNCCL: ``Work.wait()`` (and so every call with
  ``async_op=False``) makes the caller's current stream on each device wait on the completion
  event and returns ``True`` without blocking the host. ``Work.wait(timeout=t)`` also blocks the
  host, polling the event, until it fired or ``t`` passed; then it aborts the communicators and
  raises ``TimeoutError`` (torch's blocking-wait mode). ``Work.wait_stream(stream)`` orders a
  given stream. ``Work.is_completed()`` asks the event.
* Watchdog: one daemon thread per group, started by the first call and stopped by ``shutdown``,
  polls the unfinished works: it releases finished ones, and when one is older than the group's
  timeout (or NCCL reports an asynchronous error, e.g. a dead peer) it aborts the group's
  communicators (``ncclCommAbort``: kernels stuck in them exit, so a host synchronising on their
  data returns), records a ``TimeoutError`` naming the operation, group and timeout on the work
  and sets ``failure``: the next call on the group raises, and so does any later ``wait()``.
  Works are watched from before their ``groupEnd`` (NCCL connects peers lazily inside the first
  one, which blocks while a peer that joined the communicator stalls), so that hang times out too.
* Partial data: a stream that already waits on an aborted collective (every synchronous call
  orders one) runs on once the aborted kernels exit, reading partial results, and no host call
  can stop it. So such an abort ends the process with the reason on stderr, as torch's default
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` does; ``CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING=2`` keeps
  the process running with the group unusable instead (:func:`tears_down_on_abort`). On a
  thread rank of ``spawn`` the process is the caller's: the abort is recorded on the rank and
  spawn ends the run instead (it raises, whatever the rank's function returns). An abort
  no stream waits on (async work not yet waited, a blocking ``wait(timeout=...)``) only fails
  the group and its works.
* Threads: the calls of one group are issued under a lock from ``groupStart`` to ``groupEnd``, so
  two threads sharing a group never interleave their calls on its communicators; communicators
  are made under another lock, so two threads' first calls make one set. Both locks are the
  group's own :class:`~cupy_parallel._src.cuda.nccl_runtime.Communicators` (the mechanism
  ``comm`` uses too, with one process-wide instance). Lock order: the set-up lock, then the
  communicator cache's own (a leaf); the group's state lock (``_lock``: the works in flight and
  their states), then the cache's; the state lock is never held while a launch or set-up lock
  is taken, and an abort (state lock only) never waits for the launch lock, since it is what
  makes a ``groupEnd`` blocked under that lock return.
* Barrier: ``barrier().wait()`` blocks the host until every rank arrived (torch's); before any
  other call it runs on GPU ``global_rank % device_count`` (the world rank), as torch's does.
* Set-up: creating a communicator waits for every member; past the group's timeout it raises
  ``TimeoutError`` (a peer that never joins, or died) and the group is unusable.
* Data: moving data (broadcast, gather, scatter, all_gather, all_to_all, send/recv) copies bytes
  (every dtype, bit-exactly); reductions follow ``cuda.nccl_tables``. All collectives of one call
  are issued inside one NCCL group, so ``*_coalesced`` forms and p2p patterns launch together;
  so is a whole ``batch_isend_irecv`` list (:meth:`NCCLBackend.batch_p2p`), as torch's.
  Temporary buffers are filled on the caller's stream before the call and emptied on the internal
  stream after it, with ``cudaMemcpyAsync``.
* Debug mode (``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL``): the ranks compare each collective's
  arguments through the store before anything is issued on a stream (:meth:`NCCLBackend.agree`),
  as torch's ``DETAIL`` mode compares them over a side gloo group: the host-side exchange is what
  lets a mismatch raise on every rank before NCCL reads a byte.
* Not supported by NCCL: ``recv`` from any source (``src=None``) and message tags (messages
  between two ranks match in the order they were posted, as in torch).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, cast

from cupy_parallel._src.averages import (
    average_in_place,
    decode_average,
    encode_average,
    integer_average,
)
from cupy_parallel._src.cuda.nccl_runtime import (
    Communicators,
    device_ids,
    nccl_module,
    nccl_version,
    unavailable_reason,
)
from cupy_parallel._src.cuda.nccl_runtime import is_available as nccl_is_available
from cupy_parallel._src.cuda.nccl_tables import (
    P2P_VERSION,
    NcclDataType,
    NcclRedOp,
    Reduction,
    reduction,
    transfer,
    version_string,
)
from cupy_parallel._src.cuda.streams import current_stream, record_event, wait_stream
from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.distributed.backend import ProcessGroupBackend
from cupy_parallel._src.distributed.mpi_job import thread_rank
from cupy_parallel._src.distributed.store.interface import DistTimeoutError
from cupy_parallel._src.distributed.work import Work
from cupy_parallel._src.enums import Backend, ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import numpy as np

__all__ = ["ERROR_HANDLING_VARIABLE", "NCCLBackend", "tears_down_on_abort"]

#: The watchdog polls this often (seconds), or ten times per group timeout when that is shorter.
_WATCH_INTERVAL = 0.1
_UINT8 = int(NcclDataType.UINT8)
_SUM = int(NcclRedOp.SUM)

#: What an abort does when a CUDA stream already waits on an operation it cut short (torch's
#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` numbers): ``1`` (default) ends the process, ``2`` keeps it
#: running with the group unusable.
ERROR_HANDLING_VARIABLE = "CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING"


def tears_down_on_abort() -> bool:
    """Whether an abort ends the process when a stream waits on a cut-short operation.

    Read from ``CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING``: ``1`` (the default) tears the process
    down, as torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` does: the stream will run on with
    partial data and nothing on the host can stop it, so continuing would be silently wrong.
    ``2`` only cleans up (communicators aborted, every later call and ``wait()`` raises).

    Raises:
        ValueError: the variable holds another value.

    Example:
        >>> import os
        >>> tears_down_on_abort() is (os.environ.get(ERROR_HANDLING_VARIABLE, "1") == "1")
        True
    """
    value = os.environ.get(ERROR_HANDLING_VARIABLE, "1").strip()
    if value not in {"1", "2"}:
        raise ValueError(
            f"{ERROR_HANDLING_VARIABLE} must be 1 (end the process when an abort leaves CUDA "
            f"streams with partial data) or 2 (keep running, the group unusable), got {value!r}."
        )
    return value == "1"


def _tear_down(message: str) -> None:
    """End the process after an abort left streams with partial data (says why on stderr)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os.abort()


# ---------------------------------------------------------------------------------------------
# The unique id: raw bytes in the store, whatever CuPy's own spelling


def _unique_id_bytes(uid: bytes | Sequence[int], /) -> bytes:
    """The 128 bytes of an NCCL unique id (CuPy >= 14 gives bytes, older CuPy C ``char``s)."""
    if isinstance(uid, bytes):
        return uid
    return bytes(value & 0xFF for value in uid)


def _new_communicator(nccl: Any, nranks: int, uid: bytes, rank: int, /) -> Any:
    """``NcclCommunicator(nranks, uid, rank)`` in the id spelling the installed CuPy takes.

    CuPy >= 14 takes bytes; older CuPy a tuple of C ``char`` values, signed or not as the
    platform's ``char`` is. A wrong spelling fails while converting arguments, before NCCL runs.
    """
    try:
        return nccl.NcclCommunicator(nranks, uid, rank)
    except TypeError:
        pass
    signed = tuple(b - 256 if b > 127 else b for b in uid)
    try:
        return nccl.NcclCommunicator(nranks, signed, rank)
    except OverflowError:
        return nccl.NcclCommunicator(nranks, tuple(uid), rank)


def _share_unique_id(
    store: Any,
    key: str,
    /,
    *,
    create: Callable[[], bytes | Sequence[int]] | None,
    readers: int,
    timeout: float,
) -> bytes:
    """Publish (``create`` given: the leader) or fetch the unique id under ``key``.

    Every one of the ``readers`` processes calls this once; the last one deletes the key, so a
    group re-created under the same name never reads a stale id.
    """
    if create is not None:
        uid = _unique_id_bytes(create())
        store.set(key, uid)
    else:
        try:
            store.wait([key], timedelta(seconds=timeout))
        except TimeoutError as error:
            raise DistTimeoutError(
                f"NCCL set-up: rank 0 of the group did not publish the unique id {key!r} within "
                f"{timeout:g} s (it did not reach the same collective, or died)."
            ) from error
        uid = store.get(key)
    if store.add(f"{key}/read", 1) == readers:
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return uid


# ---------------------------------------------------------------------------------------------
# Work


class _NCCLWork(Work):
    """Work of one NCCL call: done when its completion events (one per device) have fired.

    The work exists (and the watchdog watches it) from before ``groupEnd``: until the call was
    issued it has no events (``None``) and is not done, so a ``groupEnd`` that waits forever on
    a stalled peer times out like any collective. ``wait()`` (no timeout) orders the caller's
    current streams after the events and returns; ``wait(timeout=t)`` blocks the host too; a
    barrier's ``wait()`` always blocks the host (torch's). State changes take the backend's
    lock, since the watchdog thread completes or fails works concurrently with the caller.
    """

    __slots__ = ("_backend", "_blocking", "_comms", "_events", "_ordered", "_started")

    def __init__(
        self,
        description: str,
        backend: NCCLBackend,
        comms: list[Any],
        keep: Any,
        *,
        blocking: bool = False,
    ) -> None:
        Work.__init__(self, description, backend.group_name, backend.timeout, keep)
        self._backend = backend
        self._comms = comms
        self._events: list[_Done] | None = None  # set once the call was issued
        self._blocking = blocking
        self._ordered = False  # whether some stream was made to wait on the events
        self._started = time.monotonic()

    def sibling(self, description: str, keep: Any) -> _NCCLWork:
        """A work of its own for one operation of this launch: done when the launch is.

        ``batch_isend_irecv`` hands out one per operation; the launch's work stays the one the
        watchdog watches, and a sibling fails with the group like it.
        """
        work = _NCCLWork(description, self._backend, self._comms, keep)
        with self._backend._lock:
            work._events = self._events
        return work

    def _events_done(self) -> bool:
        events = self._events
        return events is not None and all(event.done for event in events)

    def _test(self) -> bool:
        if self._events_done():
            return True
        backend = self._backend
        if backend.failure is not None:
            raise RuntimeError(f"{self.description} cannot complete: {backend.failure}")
        try:
            for comm in self._comms:
                comm.check_async_error()
        except backend._nccl.NcclError as error:
            backend._abort(f"{self.description} failed in NCCL ({error}).")
            raise
        return False

    def complete(self) -> None:
        with self._backend._lock:
            if self.done:
                return
            self._comms = []
            super().complete()

    def fail(self, error: BaseException) -> None:
        with self._backend._lock:
            if self.done:  # the watchdog (or an abort) settled it first
                return
            self._keep = None
            self._comms = []
            super().fail(error)

    def _block(self, deadline: float) -> bool:
        """Block the host until the events fired (``True``) or the deadline (``False``).

        A helper thread synchronises with the events (``cudaEventSynchronize``: a GPU that
        finishes is seen at once, and a simulated GPU, which finishes only when the host waits
        for it, finishes too) while this thread waits for it until the deadline. A failure of
        the group (a watchdog abort) ends the wait early. After a timeout the helper stays
        blocked until the aborted kernels exit; it is a daemon thread.
        """
        if self._test():
            return True
        synced = threading.Event()

        def synchronize() -> None:
            try:
                while self._events is None and not self.done and time.monotonic() < deadline:
                    time.sleep(0.001)  # another thread is still issuing it (inside groupEnd)
                for done in self._events or ():
                    done.synchronize()
            finally:
                synced.set()

        name = f"cupy_parallel NCCL wait ({self.description}, rank {self._backend.rank})"
        threading.Thread(target=synchronize, name=name, daemon=True).start()
        while not synced.wait(min(max(deadline - time.monotonic(), 0.0), _WATCH_INTERVAL)):
            if self._backend.failure is not None or time.monotonic() >= deadline:
                return self._test()
        return self._test()

    def _on_timeout(self) -> None:
        backend = self._backend
        backend._abort(
            f"{self.description} was abandoned by a blocking wait() on process group "
            f"{backend.group_name!r} (rank {backend.rank} of {backend.size}); its NCCL "
            "communicators were aborted.",
            culprit=self,
        )

    def _order_on_device(self) -> bool:
        if self._blocking:  # a barrier blocks the host, as torch's does
            return False
        if self.is_completed():  # finished or failed: let wait() report it
            return False
        self._order(None)
        return True

    def _order(self, stream: Any) -> None:
        cupy = self._backend._cupy
        self._ordered = True
        for event in self._events or ():
            if stream is None:
                with cupy.cuda.Device(event.device_id):
                    cupy.cuda.get_current_stream().wait_event(event.event)
            else:
                stream.wait_event(event.event)

    def wait_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: each device's current stream) wait for this operation.

        Returns at once; work queued on the stream afterwards sees the results. Raises the
        operation's error if it already failed.
        """
        if self.is_completed():
            if self._exception is not None:
                raise self._exception
            return
        self._order(stream)


class _Done:
    """A completion event and the device it was recorded on.

    Queried and waited for with that device current: the watchdog and the wait helper are
    threads of their own, and a thread's first CUDA call with no device set would bind GPU 0's
    context (memory on GPU 0 for every rank of a node).
    """

    __slots__ = ("device_id", "event")

    def __init__(self, event: Any, device_id: int) -> None:
        self.event = event
        self.device_id = device_id

    def _current(self) -> Any:
        # A new Device each time: CuPy's Device keeps the devices it replaced on the instance,
        # so one object must not be entered by two threads at once.
        return cupy_module().cuda.Device(self.device_id)  # type: ignore[union-attr]

    @property
    def done(self) -> bool:
        with self._current():
            return bool(self.event.done)

    def synchronize(self) -> None:
        with self._current():
            self.event.synchronize()


# ---------------------------------------------------------------------------------------------
# The backend


class NCCLBackend(ProcessGroupBackend):
    """A process group on NCCL communicators; communicates CuPy arrays.

    Which wait does what (torch's ProcessGroupNCCL semantics):

    * ``work.wait()``, and every synchronous call (``async_op=False``): the caller's current CUDA
      stream waits for the collective; the host does not. Returns ``True``.
    * ``work.wait(timeout=t)``: the same ordering, and the host blocks until the collective
      finished; past ``t`` the communicators are aborted and ``TimeoutError`` is raised.
    * ``work.wait_stream(stream)``: ``stream`` waits for the collective; the host does not.
    * ``barrier()`` (and its work's ``wait()``): the host blocks until every rank arrived.
    * The watchdog thread aborts the group when a collective is older than the group's timeout;
      the work then holds a ``TimeoutError`` and every later call on the group raises
      ``RuntimeError`` quoting it.

    Example:
        >>> isinstance(NCCLBackend.is_available(), bool), sorted(NCCLBackend.array_kinds)
        (True, ['cuda'])
    """

    backend: ClassVar[Backend] = Backend.NCCL
    array_kinds: ClassVar[frozenset[str]] = frozenset({"cuda"})

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        store: Any,
        timeout: float,
        group_name: str,
        global_rank: int | None = None,
    ) -> None:
        super().__init__(rank, size, timeout=timeout, group_name=group_name)
        #: This process's rank in the world (a subgroup's ``rank`` is its rank in the group).
        self.global_rank = rank if global_rank is None else global_rank
        nccl = nccl_module()
        if nccl is None:
            raise RuntimeError(f"The NCCL backend cannot start: {unavailable_reason()}")
        self._nccl: Any = nccl
        self._cupy: Any = cupy_module()
        self._store = store
        # Features are gated on the older of the NCCL CuPy was built with and the one loaded.
        self._version: int = nccl_version(nccl)
        # One set of communicators per tuple of local devices (see cuda.nccl_runtime), with its
        # own locks: a launch of this group never waits for another group's, nor for a set-up.
        self._comms = Communicators(
            launch_lock=threading.Lock(),  # held from groupStart to groupEnd
            setup_lock=threading.Lock(),  # two threads of this rank make one set
        )
        self._streams: dict[int, Any] = {}
        self._made = 0  # communicators made so far: numbers the unique-id keys
        self._agreed = 0  # debug-mode comparisons so far: numbers their keys
        self._last_devices: tuple[int, ...] | None = None
        self._in_flight: list[_NCCLWork] = []  # unfinished works, pruned by the watchdog
        self._plans: dict[tuple[np.dtype[Any], ReduceOp], Reduction] = {}
        self._lock = threading.RLock()  # guards _in_flight and the works' states
        self._tear_down = tears_down_on_abort()
        # Read here, in the caller's context: the watchdog's thread, which aborts on a timeout,
        # runs outside it, and must end a thread rank's run there, not the caller's process.
        self._thread_rank = thread_rank()
        self._watchdog: _Watchdog | None = None
        self._closed = False

    # --------------------------------------------------------------------------- life cycle

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """What is missing for NCCL here (``cuda.nccl_runtime.unavailable_reason``), or ``None``."""
        return unavailable_reason()

    @classmethod
    def is_available(cls) -> bool:
        """Whether CuPy's NCCL library loads and a GPU is visible (``cuda.nccl_runtime``'s)."""
        return nccl_is_available()

    @classmethod
    def create_world(
        cls, *, rank: int, world_size: int, store: Any, timeout: float, group_name: str
    ) -> NCCLBackend:
        """The world group; communicators are made at the first call that uses a device."""
        return cls(rank, world_size, store=store, timeout=timeout, group_name=group_name)

    def new_subgroup(
        self, ranks: Sequence[int], *, timeout: float, group_name: str, local: bool = False
    ) -> NCCLBackend | None:
        """A group sharing the world's store; its communicators get their own unique ids.

        Making it needs no peer (its communicators meet through the store, under
        ``group_name``), so ``local`` changes nothing here.
        """
        if self.rank not in ranks:
            return None
        return NCCLBackend(
            list(ranks).index(self.rank),
            len(ranks),
            store=self._store,
            timeout=timeout,
            group_name=group_name,
            global_rank=self.global_rank,
        )

    def shutdown(self) -> None:
        """Stop the watchdog, wait for operations in flight, then destroy the communicators.

        The wait blocks the host, up to the timeout each; after an abort nothing is left to do.
        """
        self._closed = True
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()
        with self._lock:
            in_flight, self._in_flight = self._in_flight, []
        for work in in_flight:
            if self.failure is None:
                # A timeout or an NCCL error aborts the communicators and sets self.failure.
                with contextlib.suppress(TimeoutError, RuntimeError):
                    work.wait(self.timeout)
        for comm in self._comms.take_all():
            comm.destroy()

    def _refuse_if_failed(self) -> None:
        """Raise the group's failure (an abort) before anything is issued."""
        if self.failure is not None:
            raise RuntimeError(f"process group {self.group_name!r} is unusable: {self.failure}")

    def _abort(self, reason: str, *, culprit: _NCCLWork | None = None) -> None:
        """Mark the group unusable and abort its communicators (kernels stuck in them return).

        Every unfinished work fails: ``culprit`` (the one that timed out) with ``TimeoutError``
        saying ``reason``, the others with ``RuntimeError``; works whose events had fired
        complete normally.
        """
        with self._lock:
            if self.failure is None:
                self.failure = reason
            in_flight, self._in_flight = self._in_flight, []
            if culprit is not None and culprit not in in_flight:
                in_flight.append(culprit)
            for work in in_flight:
                if work.done:
                    continue
                if work._events_done():
                    work.complete()
                elif work is culprit:
                    work.fail(DistTimeoutError(reason))
                else:
                    work.fail(RuntimeError(f"{work.description} cannot complete: {reason}"))
            comms = self._comms.take_all()
            # Streams already made to wait on an unfinished work run on once the aborted kernels
            # exit, reading partial results; nothing can stop a CUDA stream from the host.
            waited = [w.description for w in in_flight if w._ordered and not w._events_done()]
        for comm in comms:
            comm.abort()
        if not waited:
            return
        said = (
            f"cupy_parallel: process group {self.group_name!r} (rank {self.rank} of "
            f"{self.size}) was aborted: {reason} CUDA streams already wait on "
            f"{', '.join(waited)}, whose results are partial;"
        )
        on_thread = self._thread_rank
        if on_thread is not None:  # spawn's process is every rank's and the caller's: the run
            on_thread.stuck.append(f"{said} spawn ends the run.")  # ends, not the process
        elif self._tear_down:
            _tear_down(
                f"{said} the process is ended so that they are not used silently (set "
                f"{ERROR_HANDLING_VARIABLE}=2 to keep running with the group unusable instead)."
            )

    def _watch(self) -> None:
        """One round of the watchdog: retire finished works, abort on an error or a timeout."""
        with self._lock:
            if self.failure is not None:
                self._in_flight.clear()
                return
            pending = [w for w in self._in_flight if not w.done and not w._events_done()]
            done = [w for w in self._in_flight if not w.done and w not in pending]
            self._in_flight = pending
        for work in done:
            work.complete()  # releases the arrays it kept alive
        now = time.monotonic()
        checked: set[int] = set()
        for work in pending:
            try:
                for comm in work._comms:
                    if id(comm) not in checked:
                        checked.add(id(comm))
                        comm.check_async_error()
            except self._nccl.NcclError as error:
                self._abort(
                    f"{work.description} failed in NCCL ({error}) on process group "
                    f"{self.group_name!r}; its NCCL communicators were aborted."
                )
                return
            if now - work._started > self.timeout:
                self._abort(
                    f"{work.description} timed out after {self.timeout:g} s on process group "
                    f"{self.group_name!r} (rank {self.rank} of {self.size}); the watchdog "
                    "aborted its NCCL communicators.",
                    culprit=work,
                )
                return

    def check_dtype(self, dtype: np.dtype[Any], op: ReduceOp | None, /) -> None:
        """Refuse what NCCL cannot move (object arrays) or reduce (see ``cuda.nccl_tables``)."""
        if op is None:
            transfer(dtype)
        elif (dtype, op) not in self._plans:
            self._plans[dtype, op] = reduction(dtype, op, self._version)

    def _plan(self, dtype: np.dtype[Any], op: ReduceOp) -> Reduction:
        plan = self._plans.get((dtype, op))
        if plan is None:
            plan = self._plans[dtype, op] = reduction(dtype, op, self._version)
        return plan

    def _require_p2p(self, operation: str) -> None:
        if self._version < P2P_VERSION:
            raise NotImplementedError(
                f"{operation} needs NCCL >= 2.7 (send/recv), but CuPy uses NCCL "
                f"{version_string(self._version)}; upgrade NCCL or use the 'mpi' backend."
            )

    # --------------------------------------------------------------------------- machinery

    def _stream(self, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            cupy = self._cupy
            with cupy.cuda.Device(device):
                stream = self._streams[device] = cupy.cuda.Stream(non_blocking=True)
        return stream

    def _make_communicators(self, devices: tuple[int, ...]) -> list[Any]:
        """The group's communicators on ``devices`` (``self._comms`` stores them, once)."""
        nccl, cupy = self._nccl, self._cupy
        local = len(devices)
        key = f"cupy_parallel/nccl/{self.group_name}/{self._made}"
        self._made += 1
        uid = _share_unique_id(
            self._store,
            key,
            create=nccl.get_unique_id if self.rank == 0 else None,
            readers=self.size,
            timeout=self.timeout,
        )
        made: list[Any] = []
        errors: list[BaseException] = []

        def make() -> None:
            # ncclCommInitRank blocks until every member joined: run it where a peer that
            # never comes cannot hang the caller past the timeout.
            try:
                nccl.groupStart()
                try:
                    for j, device in enumerate(devices):
                        with cupy.cuda.Device(device):
                            made.append(
                                _new_communicator(
                                    nccl, self.size * local, uid, self.rank * local + j
                                )
                            )
                finally:
                    nccl.groupEnd()
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(error)

        maker = threading.Thread(
            target=make, name=f"cupy_parallel NCCL set-up (group {self.group_name})", daemon=True
        )
        maker.start()
        maker.join(self.timeout)
        if maker.is_alive():
            reason = (
                f"NCCL set-up on process group {self.group_name!r} (rank {self.rank} of "
                f"{self.size}): not every rank joined the communicator within "
                f"{self.timeout:g} s (a peer did not reach the same collective, or died)."
            )
            if self.failure is None:
                self.failure = reason
            raise DistTimeoutError(reason)
        if errors:
            raise errors[0]
        return made

    def _launch(
        self,
        description: str,
        devices: tuple[int, ...],
        issue: Callable[[int, Any, int], object],
        *,
        after: Callable[[int], object] | None = None,
        keep: Any = None,
        blocking: bool = False,
    ) -> _NCCLWork:
        """Run one NCCL call on ``devices`` (one entry per local participant ``j``).

        Everything queued on the caller's current streams so far comes first. ``issue(j, comm,
        stream_ptr)`` makes participant ``j``'s NCCL calls (inside one NCCL group);
        ``after(j)`` then queues participant ``j``'s follow-up work on the internal stream.
        ``blocking``: the work's ``wait()`` blocks the host (barriers).
        """
        if self._closed:
            raise RuntimeError(f"process group {self.group_name!r} was shut down.")
        self._refuse_if_failed()
        comms = self._comms.get_or_make(devices, self._make_communicators)
        if self.failure is not None:
            # Aborted while this thread made the set (an abort takes only the sets made by then):
            # abort it too, or its communicators would outlive the group unaborted.
            for comm in self._comms.take_all():
                comm.abort()
            self._refuse_if_failed()
        cupy, nccl = self._cupy, self._nccl
        streams = [self._stream(device) for device in devices]
        for device, stream in zip(devices, streams, strict=True):
            wait_stream(stream, device, current_stream(device), device)
        # Watched from before groupEnd: NCCL connects peers lazily inside the first groupEnd of
        # a communicator, which blocks until they issue the same call. A peer that joined but
        # stalls is then a timed-out work the watchdog aborts (which makes groupEnd return).
        work = _NCCLWork(description, self, comms, keep, blocking=blocking)
        with self._lock:
            self._in_flight.append(work)
            if self._watchdog is None:
                self._watchdog = _Watchdog(self)
        try:
            with self._comms.group(nccl):  # threads never interleave their calls
                for j, device in enumerate(devices):
                    with cupy.cuda.Device(device):
                        issue(j, comms[j], streams[j].ptr)
        except Exception as error:
            if not work.done:  # NCCL refused the call: the peers' calls cannot match it
                self._abort(
                    f"{description} failed while being issued to NCCL ({error!r}) on process "
                    f"group {self.group_name!r}; its NCCL communicators were aborted."
                )
            raise work.exception() or error from error
        events = []
        for j, device in enumerate(devices):
            stream = streams[j]
            if after is not None and not work.done:
                with cupy.cuda.Device(device), stream:
                    after(j)
            events.append(_Done(record_event(stream, device), device))
        with self._lock:
            work._events = events
        self._last_devices = devices
        return work

    def _copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cudaMemcpyAsync`` of ``nbytes`` between device pointers (nothing for 0 bytes)."""
        if nbytes:
            runtime = self._cupy.cuda.runtime
            runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, stream)

    def _pack(self, arrays: Sequence[Any]) -> Any:
        """The bytes of ``arrays`` one after the other, in a new buffer (on the current stream)."""
        packed = self._buffer(arrays[0], sum(x.nbytes for x in arrays))
        with arrays[0].device:
            self._unpack(packed, arrays, into_packed=True)
        return packed

    def _unpack(
        self, packed: Any, arrays: Sequence[Any], offset: int = 0, *, into_packed: bool = False
    ) -> None:
        """Copy ``packed`` from byte ``offset`` on into ``arrays`` (``into_packed``: the reverse).

        The copies run on the current stream of the current device.
        """
        stream = self._cupy.cuda.get_current_stream().ptr
        base = packed.data.ptr
        for x in arrays:
            if into_packed:
                self._copy(base + offset, x.data.ptr, x.nbytes, stream)
            else:
                self._copy(x.data.ptr, base + offset, x.nbytes, stream)
            offset += x.nbytes

    def _divide(self, arrays: Sequence[Any], count: int) -> None:
        """``AVG`` of floats without ``ncclAvg``: divide in place."""
        for x in arrays:
            average_in_place(x, count, self._cupy)

    def _wide(self, like: Any) -> Any:
        """A zeroed buffer for ``like``'s integers encoded for ``AVG`` (its device, stream)."""
        summed, parts = cast("tuple[np.dtype[Any], int]", integer_average(like.dtype))
        with like.device:
            return self._cupy.zeros((parts, *like.shape), summed)

    def _encode(self, arrays: Sequence[Any], plan: Reduction, count: int) -> list[Any]:
        """What NCCL reduces: ``arrays``, or (``plan.encoded``) their encodings for ``AVG``.

        Encoded on each array's device and current stream (which the launch waits for).
        """
        if not plan.encoded:
            return list(arrays)
        buffers = [self._wide(x) for x in arrays]
        for x, buffer in zip(arrays, buffers, strict=True):
            with x.device:
                encode_average(x, count, buffer, self._cupy)
        return buffers

    def _finisher(
        self, outputs: Sequence[Any], reduced: Sequence[Any], plan: Reduction, count: int
    ) -> Callable[[int], object] | None:
        """``after(j)`` for ``AVG``: decode ``reduced[j]`` into ``outputs[j]``, or divide them."""
        if plan.encoded:
            cupy = self._cupy

            def decode(j: int) -> None:
                outputs[j][...] = decode_average(reduced[j], count, cupy).astype(outputs[j].dtype)

            return decode
        if plan.divide:
            return lambda j: self._divide([outputs[j]], count)
        return None

    # --------------------------------------------------------------------------- collectives

    def broadcast(self, arrays: Sequence[Any], root: int, root_index: int, /) -> Work:
        """``ncclBroadcast`` in place; the root member is ``root * L + root_index``."""
        source = root * len(arrays) + root_index
        nbytes = arrays[0].nbytes

        def issue(j: int, comm: Any, stream: int) -> None:
            if nbytes:
                ptr = arrays[j].data.ptr
                comm.broadcast(ptr, ptr, nbytes, _UINT8, source, stream)

        return self._launch("broadcast", device_ids(arrays), issue, keep=arrays)

    def all_reduce(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """``ncclAllReduce`` in place."""
        plan = self._plan(arrays[0].dtype, op)
        count = arrays[0].size * plan.lanes
        participants = self.size * len(arrays)
        buffers = self._encode(arrays, plan, participants)

        def issue(j: int, comm: Any, stream: int) -> None:
            if count:
                ptr = buffers[j].data.ptr
                comm.allReduce(ptr, ptr, count, plan.datatype, plan.op, stream)

        after = self._finisher(arrays, buffers, plan, participants)
        keep = (arrays, buffers)
        return self._launch("all_reduce", device_ids(arrays), issue, after=after, keep=keep)

    def reduce(self, arrays: Sequence[Any], root: int, root_index: int, op: ReduceOp, /) -> Work:
        """``ncclReduce`` in place; only the root member's array changes."""
        plan = self._plan(arrays[0].dtype, op)
        count = arrays[0].size * plan.lanes
        local = len(arrays)
        target = root * local + root_index
        participants = self.size * local
        buffers = self._encode(arrays, plan, participants)

        def issue(j: int, comm: Any, stream: int) -> None:
            if count:
                ptr = buffers[j].data.ptr
                comm.reduce(ptr, ptr, count, plan.datatype, plan.op, target, stream)

        finish = self._finisher(arrays, buffers, plan, participants)

        def after(j: int) -> None:
            if j == root_index and finish is not None:
                finish(j)

        at_root = self.rank == root
        keep = (arrays, buffers)
        return self._launch(
            "reduce", device_ids(arrays), issue, after=after if at_root else None, keep=keep
        )

    def all_gather(self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], /) -> Work:
        """``ncclAllGather`` into one buffer per device, then copied into ``outputs``."""
        nbytes = inputs[0].nbytes
        received = [self._buffer(x, len(outputs[0]) * nbytes) for x in inputs]

        def issue(j: int, comm: Any, stream: int) -> None:
            if nbytes:
                comm.allGather(inputs[j].data.ptr, received[j].data.ptr, nbytes, _UINT8, stream)

        def after(j: int) -> None:
            self._unpack(received[j], outputs[j])

        keep = (inputs, outputs, received)
        return self._launch("all_gather", device_ids(inputs), issue, after=after, keep=keep)

    def gather(self, outputs: Sequence[Any] | None, input: Any, root: int, /) -> Work:
        """Sends to the root, which receives each rank's bytes straight into ``outputs``."""
        return self._rooted("gather", input, outputs, root, to_root=True)

    def scatter(self, output: Any, inputs: Sequence[Any] | None, root: int, /) -> Work:
        """The root sends each rank its array; the others receive into ``output``."""
        return self._rooted("scatter", output, inputs, root, to_root=False)

    def _rooted(
        self, name: str, mine: Any, per_rank: Sequence[Any] | None, root: int, /, *, to_root: bool
    ) -> Work:
        """Gather (``to_root``) or scatter as point-to-point calls between the root and the rest.

        ``mine`` is this rank's array; ``per_rank`` the root's list of one array per rank
        (``None`` elsewhere). The root's own array is copied locally after the exchange.
        """
        self._require_p2p(name)
        nbytes = mine.nbytes

        def issue(_: int, comm: Any, stream: int) -> None:
            if not nbytes:
                return
            if per_rank is None:
                (comm.send if to_root else comm.recv)(mine.data.ptr, nbytes, _UINT8, root, stream)
                return
            move = comm.recv if to_root else comm.send
            for r, x in enumerate(per_rank):
                if r != self.rank:
                    move(x.data.ptr, nbytes, _UINT8, r, stream)

        def after(_: int) -> None:
            if per_rank is not None:
                own = per_rank[self.rank]
                source, target = (mine, own) if to_root else (own, mine)
                self._unpack(source, [target])

        keep = (mine, per_rank)
        return self._launch(name, device_ids([mine]), issue, after=after, keep=keep)

    def reduce_scatter(
        self, outputs: Sequence[Any], inputs: Sequence[Sequence[Any]], op: ReduceOp, /
    ) -> Work:
        """``ncclReduceScatter`` of each device's inputs packed into one buffer."""
        plan = self._plan(outputs[0].dtype, op)
        count = outputs[0].size * plan.lanes
        participants = self.size * len(outputs)
        packed = [self._pack(self._encode(row, plan, participants)) for row in inputs]
        received = [self._wide(x) for x in outputs] if plan.encoded else outputs

        def issue(j: int, comm: Any, stream: int) -> None:
            if count:
                send, recv = packed[j].data.ptr, received[j].data.ptr
                comm.reduceScatter(send, recv, count, plan.datatype, plan.op, stream)

        after = self._finisher(outputs, received, plan, participants)
        keep = (outputs, packed, received)
        return self._launch("reduce_scatter", device_ids(outputs), issue, after=after, keep=keep)

    def all_to_all(self, outputs: Sequence[Any], inputs: Sequence[Any], /) -> Work:
        """A send and a receive per peer in one NCCL group; the own slot is copied locally."""
        self._require_p2p("all_to_all")
        me = self.rank

        def issue(_: int, comm: Any, stream: int) -> None:
            for r in range(self.size):
                if r == me:
                    continue
                if inputs[r].nbytes:
                    comm.send(inputs[r].data.ptr, inputs[r].nbytes, _UINT8, r, stream)
                if outputs[r].nbytes:
                    comm.recv(outputs[r].data.ptr, outputs[r].nbytes, _UINT8, r, stream)

        def after(_: int) -> None:
            self._unpack(inputs[me], [outputs[me]])

        keep = (outputs, inputs)
        return self._launch("all_to_all", device_ids(inputs[:1]), issue, after=after, keep=keep)

    def agree(self, record: bytes, /) -> list[bytes]:
        """Every rank's ``record`` through the store (the debug mode's comparison).

        Each rank sets its record under a key numbered by a per-group counter (every rank
        compares its collectives in the same order), waits up to the group's timeout for all of
        them and reads them in one ``multi_get``; the last rank to read deletes the keys, so a
        group re-created under the same name never reads a stale record. The store is the side
        channel: the comparison needs no GPU work, and a rank that skipped the collective is
        named instead of hanging NCCL.

        Raises:
            TimeoutError: some rank did not reach the comparison within the timeout (it skipped
                this collective or died); names those group ranks. The group is unusable after.
        """
        with self._lock:
            number, self._agreed = self._agreed, self._agreed + 1
        prefix = f"cupy_parallel/nccl/{self.group_name}/debug/{number}"
        keys = [f"{prefix}/{r}" for r in range(self.size)]
        store = self._store
        store.set(keys[self.rank], record)
        try:
            store.wait(keys, timedelta(seconds=self.timeout))
        except TimeoutError:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            reason = (
                f"the debug mode's comparison of collective #{number} on process group "
                f"{self.group_name!r} (rank {self.rank} of {self.size}): group ranks {missing} "
                f"did not reach it within {self.timeout:g} s (they skipped a collective, or died)."
            )
            if self.failure is None:
                self.failure = reason
            raise DistTimeoutError(reason) from None
        records: list[bytes] = store.multi_get(keys)
        if store.add(f"{prefix}/read", 1) == self.size:
            for key in [*keys, f"{prefix}/read"]:
                store.delete_key(key)
        return records

    def barrier(self) -> Work:
        """An all-reduce of one byte; its ``wait()`` blocks the host until every rank arrived.

        As torch's: on the devices of the last call, or before any call on GPU
        ``global_rank % device_count`` (one GPU per rank of a node, whichever device is current;
        the world rank, also in a subgroup, where the group rank would put two ranks on a GPU).
        """
        cupy = self._cupy
        devices = self._last_devices or (self.global_rank % cupy.cuda.runtime.getDeviceCount(),)
        flags = []
        for device in devices:
            with cupy.cuda.Device(device):
                flags.append(cupy.zeros(1, cupy.uint8))

        def issue(j: int, comm: Any, stream: int) -> None:
            ptr = flags[j].data.ptr
            comm.allReduce(
                ptr, ptr, 1, _UINT8, int(self._plan(flags[j].dtype, ReduceOp.MAX).op), stream
            )

        return self._launch("barrier", devices, issue, keep=flags, blocking=True)

    def send(self, array: Any, dst: int, tag: int, /) -> Work:
        """``ncclSend`` of the array's bytes (``tag`` is not used: NCCL has no tags)."""
        del tag
        self._require_p2p("send")
        nbytes = array.nbytes

        def issue(_: int, comm: Any, stream: int) -> None:
            if nbytes:
                comm.send(array.data.ptr, nbytes, _UINT8, dst, stream)

        return self._launch(f"send to group rank {dst}", device_ids([array]), issue, keep=array)

    def recv(self, array: Any, src: int | None, tag: int, /) -> Work:
        """``ncclRecv`` of the array's bytes (``tag`` is not used: NCCL has no tags)."""
        del tag
        if src is None:
            raise NotImplementedError(
                "recv(src=None) receives from any rank, which NCCL cannot do (a receive names "
                "its peer); pass src, or use the 'mpi' backend, which supports any-source "
                "receives."
            )
        self._require_p2p("recv")
        nbytes = array.nbytes

        def issue(_: int, comm: Any, stream: int) -> None:
            if nbytes:
                comm.recv(array.data.ptr, nbytes, _UINT8, src, stream)

        work = self._launch(f"recv from group rank {src}", device_ids([array]), issue, keep=array)
        work.set_source(src)
        return work

    def batch_p2p(self, ops: Sequence[tuple[bool, Any, int | None, int, str]], /) -> list[Work]:
        """Every send and receive of the batch inside one NCCL group (torch's coalescing).

        NCCL completes a send only together with its receive, so sends and receives that must
        progress together (a pairwise exchange, a ring) deadlock when each has a group of its
        own. One work per operation, all completed by the one launch's events. The arrays must
        share a GPU (one communicator set issues the group, as in torch).
        """
        self._require_p2p("batch_isend_irecv")
        first = ops[0][1]
        for receive, array, peer, _, name in ops:
            if receive and peer is None:
                self.recv(array, None, 0)  # raises: NCCL cannot receive from any source
            if int(array.device.id) != int(first.device.id):
                raise ValueError(
                    f"batch_isend_irecv over NCCL issues its operations in one NCCL group on one "
                    f"GPU: {name}.tensor is on GPU {int(array.device.id)}, "
                    f"{ops[0][4]}.tensor on GPU {int(first.device.id)}."
                )

        def issue(_: int, comm: Any, stream: int) -> None:
            for receive, array, peer, _tag, _name in ops:
                if array.nbytes:
                    move = comm.recv if receive else comm.send
                    move(array.data.ptr, array.nbytes, _UINT8, peer, stream)

        arrays = [array for _, array, _, _, _ in ops]
        batch = self._launch(
            f"batch_isend_irecv of {len(ops)} operations", device_ids([first]), issue, keep=arrays
        )
        works: list[Work] = []
        for receive, array, peer, _, _ in ops:
            what = f"recv from group rank {peer}" if receive else f"send to group rank {peer}"
            work = batch.sibling(f"{what} (batch_isend_irecv)", array)
            if receive:
                work.set_source(cast("int", peer))
            works.append(work)
        return works

    def all_reduce_coalesced(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """One ``ncclAllReduce`` per array, in place, all in one NCCL group (one launch)."""
        plans = [self._plan(x.dtype, op) for x in arrays]
        buffers = [
            self._encode([x], plan, self.size)[0] for x, plan in zip(arrays, plans, strict=True)
        ]
        finishers = [
            self._finisher([x], [b], plan, self.size)
            for x, b, plan in zip(arrays, buffers, plans, strict=True)
        ]

        def issue(_: int, comm: Any, stream: int) -> None:
            for x, buffer, plan in zip(arrays, buffers, plans, strict=True):
                if x.size:
                    ptr = buffer.data.ptr
                    comm.allReduce(ptr, ptr, x.size * plan.lanes, plan.datatype, plan.op, stream)

        def after(_: int) -> None:
            for finish in finishers:
                if finish is not None:
                    finish(0)

        averaged = any(finish is not None for finish in finishers)
        keep = (arrays, buffers)
        return self._launch(
            "all_reduce_coalesced",
            device_ids(arrays[:1]),
            issue,
            after=after if averaged else None,
            keep=keep,
        )

    def all_gather_coalesced(
        self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], /
    ) -> Work:
        """``ncclAllGather`` of the inputs packed into one byte buffer, then unpacked.

        A single input is sent as it is (FSDP's unit of one parameter: no copy in).
        """
        send = inputs[0] if len(inputs) == 1 else self._pack(inputs)
        total = send.nbytes
        received = self._buffer(send, self.size * total)

        def issue(_: int, comm: Any, stream: int) -> None:
            if total:
                comm.allGather(send.data.ptr, received.data.ptr, total, _UINT8, stream)

        def after(_: int) -> None:
            for r, row in enumerate(outputs):
                self._unpack(received, row, r * total)

        keep = (outputs, send, received)
        return self._launch(
            "all_gather_coalesced", device_ids(inputs[:1]), issue, after=after, keep=keep
        )

    def _buffer(self, like: Any, nbytes: int) -> Any:
        """A byte buffer on ``like``'s device, allocated on the caller's stream."""
        with like.device:
            return self._cupy.empty(nbytes, self._cupy.uint8)


class _Watchdog:
    """One daemon thread per backend polling its works (torch's NCCL watchdog).

    Every ``interval`` seconds it calls :meth:`NCCLBackend._watch`: finished works release their
    arrays; an asynchronous NCCL error, or a work older than the group's timeout, aborts the
    group's communicators. It holds the backend weakly and ends with it, or on :meth:`stop`.
    """

    def __init__(self, backend: NCCLBackend) -> None:
        self.interval = min(_WATCH_INTERVAL, backend.timeout / 10)
        self._backend = weakref.ref(backend)
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run,
            name=f"cupy_parallel NCCL watchdog (group {backend.group_name}, rank {backend.rank})",
        )
        self.thread.daemon = True  # never keeps the process alive
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            backend = self._backend()
            if backend is None:
                return
            try:
                backend._watch()
            except Exception as error:  # noqa: BLE001 - a CUDA error while polling events
                backend._abort(
                    f"the NCCL watchdog of process group {backend.group_name!r} failed while "
                    f"polling: {error!r}; its NCCL communicators were aborted."
                )
            if backend.failure is not None:
                return
            del backend

    def stop(self) -> None:
        """End the thread (and wait for it, unless called from it)."""
        self._stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join()
