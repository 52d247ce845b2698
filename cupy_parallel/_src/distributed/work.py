"""``Work``: the handle of a communication that may still be running (torch's ``Work``).

A backend starts a collective, wraps whatever tracks it (MPI requests, a CUDA event) in a
:class:`Work` subclass implementing :meth:`Work._test`, and returns it. The public layer either
returns the handle (``async_op=True``) or waits on it. Everything about waiting (deadlines, backoff,
errors raised by the backend, finalizers that unpack or copy back results) lives here once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import os
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from cupy_parallel._src.arguments import read_timeout
from cupy_parallel._src.cuda.streams import (
    StreamHandoff,
    current_stream,
    is_per_thread,
    record_event,
)
from cupy_parallel._src.devices import cupy_arrays_may_exist, cupy_module, is_cupy_array
from cupy_parallel._src.distributed.store.interface import DistTimeoutError

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta

__all__ = ["CompletedWork", "Future", "Work", "spun"]

_T = TypeVar("_T")

# Polling, as MPI progress loops do: test repeatedly, yielding the core every few dozen tests
# (ranks may share cores, and MPI's nonblocking collectives progress only while a rank tests);
# only after a long wait (a late peer, not a busy network) sleep with backoff between tests.
_POLLS_PER_YIELD = 64
_YIELDS_PER_CLOCK = range(16)  # while spinning, yields between two reads of the clock
_YIELD_SECONDS = 1.0
_FIRST_SLEEP = 5e-5
_MAX_SLEEP = 2e-3


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def spun(test: Callable[[], object], polls: range, /) -> bool:
    """Whether ``test()`` came true within one stretch of spinning (no clock read).

    ``len(polls)`` tests between two yields of the core, ``len(_YIELDS_PER_CLOCK)`` yields: what
    :meth:`Work._poll` runs between two reads of the clock. A backend's synchronous quick path
    (one that waits without a :class:`Work`) spins this once, then hands what is left to a
    :class:`Work` and its deadline.
    """
    for _ in _YIELDS_PER_CLOCK:
        for _ in polls:
            if test():
                return True
        _yield()
    return False


class Future(concurrent.futures.Future[_T]):
    """A ``concurrent.futures.Future`` that also has ``torch.futures.Future``'s methods.

    :meth:`Work.get_future` returns one. Besides ``result``/``done``/``add_done_callback``
    (``concurrent.futures``), torch code calls :meth:`wait` (block, return the value or raise
    the error), :meth:`value` (the value of a future already done) and :meth:`then` (a new
    future of ``callback(self)``).

    Example:
        >>> future = Future()
        >>> doubled = future.then(lambda f: 2 * f.value())
        >>> future.set_result(21)
        >>> future.wait(), doubled.wait()
        (21, 42)
    """

    #: ``(device, event)`` pairs recorded where the value was produced (torch's CUDA future
    #: carries its devices' events): whoever takes the value makes its current streams wait.
    _ready: tuple[tuple[int, Any], ...] = ()

    def result(self, timeout: float | None = None) -> _T:
        """The value (blocking until done), after the current streams wait for it (torch's)."""
        value = super().result(timeout)
        self._order_current()
        return value

    def _order_current(self) -> None:
        """Make the calling thread's current stream of each device wait for the value."""
        for device, event in self._ready:
            with _device(device):
                current_stream(device).wait_event(event)

    def _record_ready(self, devices: tuple[int, ...]) -> None:
        """Record, on this thread's current streams of ``devices``, that the value is ready."""
        self._ready = tuple((d, record_event(current_stream(d), d)) for d in devices)

    def wait(self) -> _T:
        """Block until done; return the value, or raise the error (``torch.futures``)."""
        return self.result()

    def value(self) -> _T:
        """The value of a future that is done (or raise its error); ``RuntimeError`` before."""
        if not self.done():
            raise RuntimeError(
                "value() of a future that is not done yet; call wait() (it returns the value) "
                "or read it in a callback given to then()."
            )
        return self.result()

    def then(self, callback: Callable[[Future[_T]], Any], /) -> Future[Any]:
        """A future of ``callback(self)``, run once this one is done (at once if it is).

        The callback runs in the thread that completes this future; if it raises, the new
        future holds that error, as in torch. On GPUs (torch's CUDA future) the callback's
        current streams first wait for this future's value, and the new future's value is
        ready after what the callback queued on them.
        """
        child = self._dependent()

        def run(_: object) -> None:
            try:
                self._order_current()
                value = callback(self)
                if self._ready:
                    child._record_ready(tuple(device for device, _ in self._ready))
                child.set_result(value)
            except BaseException as error:  # noqa: BLE001 - handed to the future
                child.set_exception(error)

        self.add_done_callback(run)
        return child

    def _dependent(self) -> Future[Any]:
        """The new future :meth:`then` returns (a subclass may make it complete otherwise)."""
        return Future()


class Work:
    """Handle of an operation started with ``async_op=True`` (also ``isend``/``irecv``).

    ``wait`` blocks until the operation finished (re-raising any error it met) and returns ``True``;
    past the deadline it raises ``TimeoutError`` naming the operation and the process group.
    ``is_completed`` asks without blocking. Results are in the arrays only after ``wait`` returned
    (or ``is_completed`` returned ``True``).

    The NCCL backend waits as torch's ProcessGroupNCCL does: ``wait()`` without a timeout (and so
    every call with ``async_op=False``) makes the caller's *current CUDA stream* wait for the
    operation and returns ``True`` at once, without blocking the host; kernels queued on that
    stream afterwards see the results, and reading them on the host (``x.get()``) synchronises as
    usual. ``wait(timeout=t)`` additionally blocks the host until the operation finished or ``t``
    passed. A background watchdog enforces the group's timeout for NCCL operations nobody blocks
    on (see :class:`~cupy_parallel._src.distributed.nccl_backend.NCCLBackend`). The MPI backend
    always blocks the host.

    A collective that outlives the group's timeout cannot be cancelled (neither MPI nor NCCL can
    take back a collective other ranks may be inside), so it makes the process group unusable:
    the backend aborts the communicator (NCCL) or the MPI job (MPI, when this process exits). An
    MPI receive is cancelled instead and the group stays usable. A shorter ``wait(timeout=t)``
    that expires leaves an MPI operation running (wait again to complete it); NCCL aborts, as
    torch's ProcessGroupNCCL does. See :func:`cupy_parallel.distributed.init_process_group`.

    :meth:`get_future` returns a :class:`Future` of the output arrays (PyTorch 2): a
    ``concurrent.futures.Future`` with ``torch.futures.Future``'s ``wait``/``value``/``then``;
    :meth:`result` waits and returns those arrays (torch's ``Work.result()``).

    For the public layer: it sets ``outputs`` (the arrays the future holds) and
    ``world_ranks`` (what :meth:`source_rank` translates to) on the work it hands out, and
    :meth:`wait_or_cancel` waits for a receive with a deadline (``monitored_barrier``).

    For backend authors: subclass and implement ``_test`` (non-blocking: ``True`` once the
    operation finished; raise to report failure). Optionally override ``_block`` (block until
    done or a deadline; the default polls ``_test`` with backoff), ``_on_timeout`` (react to an
    abandoned operation), ``_cancel`` (take a pending operation back after the group's
    timeout; ``True`` if it was), the class attribute ``_abandon_on_wait_timeout``,
    ``_order_on_device`` (what ``wait()`` without a timeout does instead of blocking: device
    backends order the caller's stream) and :meth:`wait_stream`. A backend drives its works
    through :meth:`add_finalizer` (callbacks run once, in the waiting thread, right after
    completion: unpacking, dividing for ``AVG``, copying staged data back; a finalizer that raises
    makes the work fail with that error), :meth:`set_source` (where a receive's message came
    from), ``complete`` and ``fail`` (settle it from outside, e.g. a watchdog), and reads
    ``description`` (what the operation is, for messages) and ``done`` (settled).
    ``keep`` (the constructor's) holds what the operation reads or writes until it completed,
    then lets it go.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
        >>> work = dist.all_reduce(np.ones(2), async_op=True)
        >>> work.wait(), work.is_completed(), work.exception()
        (True, True, None)
        >>> dist.destroy_process_group()
    """

    __slots__ = (
        "_exception",
        "_finalizers",
        "_future",
        "_group",
        "_keep",
        "_source",
        "_timeout",
        "description",
        "done",
        "outputs",
        "world_ranks",
    )

    #: Tests between two yields of the core while polling; backends lower it when oversubscribed.
    _polls_per_yield: ClassVar[int] = _POLLS_PER_YIELD
    #: Whether a ``wait(timeout=t)`` that expires abandons the operation (``_on_timeout``) as the
    #: group's own timeout does. ``False``: the operation keeps running and a later ``wait`` can
    #: still complete it (the MPI backend); ``True``: torch's ProcessGroupNCCL (abort).
    _abandon_on_wait_timeout: ClassVar[bool] = True

    def __init__(
        self, description: str, group: str, timeout: float = 1800.0, keep: Any = None
    ) -> None:
        self.description = description
        self._group = group
        self._timeout = timeout
        self._keep = keep  # what the operation reads or writes: held until it completed
        self.done = False
        self._exception: BaseException | None = None
        self._finalizers: list[Callable[[], object]] | None = None
        self._source = -1
        #: The group's world ranks by group rank, for :meth:`source_rank` (``irecv`` sets them).
        self.world_ranks: tuple[int, ...] | None = None
        #: The arrays the operation writes, :meth:`get_future`'s result (the public layer sets
        #: them when it returns the work: ``async_op=True``).
        self.outputs: Any = None
        self._future: Future[Any] | None = None

    # ----------------------------------------------------------------------------- backend hooks

    def _test(self) -> bool:
        """Whether the backend operation finished; never blocks. Raise to report its failure."""
        raise NotImplementedError(f"{type(self).__name__} must implement Work._test.")

    def _block(self, deadline: float) -> bool:
        """Block until the operation finished (``True``) or ``time.monotonic() >= deadline``."""
        return self._poll(self._test, deadline)

    def _poll(self, test: Callable[[], object], deadline: float) -> bool:
        """Call ``test`` until it returns true (``True``) or the deadline passed (``False``).

        Spin, yielding the core every ``_polls_per_yield`` tests, for the first second; then
        sleep with backoff between tests, calling :meth:`_idle`. While spinning, the clock is
        read only every ``_YIELDS_PER_CLOCK`` yields (a read costs about what a test does), so a
        deadline already passed is noticed after that many yields. Backends whose ``_test``
        wraps a cheaper callable (an MPI request's own ``Test``) pass that one: on a core shared
        by several ranks every instruction between two tests delays the peers' progress too.
        """
        polls = range(self._polls_per_yield)
        spin_until = min(time.monotonic() + _YIELD_SECONDS, deadline)
        while True:
            if spun(test, polls):
                return True
            now = time.monotonic()
            if now >= spin_until:
                break
        pause = _FIRST_SLEEP
        while now < deadline:
            time.sleep(pause)
            if test():
                return True
            self._idle()
            pause = min(pause * 2.0, _MAX_SLEEP)
            now = time.monotonic()
        return False

    def _on_timeout(self) -> None:
        """Called once when :meth:`wait` gives up; backends abort or poison the group here."""

    def _idle(self) -> None:
        """Called between tests once a wait has lasted a while; may raise to fail the work."""

    def _cancel(self) -> bool:
        """Try to take the operation back after the group's timeout; ``True`` if it was.

        A cancelled operation leaves its group usable (MPI can cancel a pending receive, not a
        collective); the default cannot cancel anything. Returning ``True`` means the work is
        settled: failed with ``TimeoutError`` (cancelled), or completed, when the operation
        finished between the timeout and the cancel (then ``wait`` returns normally: the
        message is in the array and must not be reported as lost).
        """
        return False

    def _order_on_device(self) -> bool:
        """``wait()`` without a timeout: order later device work after this one, host unblocked.

        Return ``True`` when done so (``wait`` then returns ``True`` at once), ``False`` to block
        the host as with an explicit timeout (the default, and what a device backend returns
        once its operation finished, so that ``wait`` reports the outcome). Never blocks.
        """
        return False

    def add_finalizer(self, finalizer: Callable[[], object], /) -> Work:
        """Run ``finalizer()`` once after the operation finished (in registration order)."""
        if self.done:
            raise RuntimeError("cannot add a finalizer to a work that already completed.")
        if self._finalizers is None:
            self._finalizers = [finalizer]
        else:
            self._finalizers.append(finalizer)
        return self

    def set_source(self, source: int, /) -> None:
        """Record the group rank a receive got its message from."""
        self._source = source

    # ----------------------------------------------------------------------------- completion

    def complete(self) -> None:
        self.done = True
        self._keep = None
        finalizers, self._finalizers = self._finalizers, None
        if finalizers is not None:
            try:
                for finalizer in finalizers:
                    finalizer()
            except Exception as error:  # noqa: BLE001 - stored and re-raised by wait()
                self._exception = error

    def fail(self, error: BaseException) -> None:
        self.done = True
        self._finalizers = None
        self._exception = error

    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not); never blocks."""
        if not self.done:
            try:
                finished = self._test()
            except Exception as error:  # noqa: BLE001 - reported through wait()/exception()
                self.fail(error)
                return True
            if finished:
                self.complete()
        return self.done

    def is_success(self) -> bool:
        """Whether the operation finished without error; never blocks."""
        return self.is_completed() and self._exception is None

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or ``None`` (also while it is still running)."""
        self.is_completed()
        return self._exception

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until the operation finished and return ``True``; re-raise its error if it failed.

        For NCCL, ``timeout=None`` does not block the host: it makes the caller's current CUDA
        stream wait for the operation and returns ``True`` (torch's ProcessGroupNCCL semantics;
        the group's watchdog enforces the timeout). An explicit ``timeout`` always blocks the host.

        Args:
            timeout: Seconds or a ``timedelta``; ``None`` uses the process group's timeout.

        Raises:
            TimeoutError: The operation did not finish in time (the message names the seconds
                waited). Past the group's timeout the group is unusable afterwards, unless the
                backend could cancel the operation (an MPI receive). Past a ``timeout`` given
                here an MPI operation keeps running and the group stays usable (wait again);
                NCCL aborts its communicators, as torch's ProcessGroupNCCL does.
        """
        if not self.done:
            if timeout is None:
                if self._order_on_device():
                    return True
                limit = self._timeout
            else:
                limit = read_timeout(timeout)
            try:
                finished = self._block(time.monotonic() + limit)
            except Exception as error:  # noqa: BLE001 - re-raised below with the others
                self.fail(error)
                finished = True
            if not finished:
                expired = self._expired(limit, explicit=timeout is not None)
                if not (self.done and self._exception is None):  # not finished meanwhile
                    raise expired
            if not self.done:
                self.complete()
        if self._exception is not None:
            raise self._exception
        return True

    def _expired(self, limit: float, *, explicit: bool) -> TimeoutError:
        """The error of a wait that gave up after ``limit`` s, having dealt with the operation."""
        head = (
            f"{self.description} on process group {self._group!r} did not complete within "
            f"{limit:g} s"
        )
        if explicit and not self._abandon_on_wait_timeout:
            return DistTimeoutError(
                f"{head} (the timeout given to wait()). It is still running and the process "
                "group stays usable: wait() again to complete it."
            )
        if not explicit and self._cancel():  # settled: cancelled, or it finished meanwhile
            cancelled = DistTimeoutError(
                f"{head} (a peer did not join, died, or is far behind). It was cancelled; the "
                "process group stays usable."
            )
            if isinstance(self._exception, TimeoutError):  # a later wait() says the same
                self._exception = cancelled
            return cancelled
        self._on_timeout()
        return DistTimeoutError(
            f"{head} (a peer did not join, died, or is far behind). A started collective cannot "
            "be cancelled, so this process group is unusable now."
        )

    def wait_stream(self, stream: object = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for this operation.

        Host backends finish on the host, so this is :meth:`wait`; the NCCL backend orders the
        stream after the communication with an event instead and returns without blocking.
        """
        del stream
        self.wait()

    def result(self) -> list[Any]:
        """Wait, then return the arrays the operation wrote (torch's ``Work.result()``).

        The output arrays of the collective (for ``isend`` the array sent, for ``irecv`` the one
        received into); ``[]`` for ``barrier``.

        Example:
            >>> import numpy as np
            >>> from cupy_parallel import distributed as dist
            >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
            >>> dist.all_reduce(np.arange(2.0), async_op=True).result()
            [array([0., 1.])]
            >>> dist.destroy_process_group()
        """
        self.wait()
        return list(self.outputs) if self.outputs is not None else []

    def get_future(self) -> Future[Any]:
        """A :class:`Future` completed when the operation is (PyTorch 2).

        Its result is the list of arrays the operation wrote (as torch's future holds the output
        tensors), or its exception is the operation's error. It is a
        ``concurrent.futures.Future`` that also has ``torch.futures.Future``'s ``wait()``,
        ``value()`` and ``then()``. A helper thread waits on the work
        for it (so do not also ``wait`` on the work from another thread at the same time).

        With CuPy outputs it behaves as torch's CUDA future: the helper waits as if on the
        caller's current streams of the outputs' GPUs (where NCCL's ordering and the MPI
        backend's unpacking, casts and copies back are queued), and ``wait()``, ``value()``,
        ``result()`` and the callbacks of ``then()`` make the current streams of the thread
        taking the value wait for it, without blocking the host; a ``then()`` future's value
        is ready after what its callback queued.

        Example:
            >>> import numpy as np
            >>> from cupy_parallel import distributed as dist
            >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
            >>> x = np.arange(3.0)
            >>> future = dist.all_reduce(x, async_op=True).get_future()
            >>> future.result(timeout=5)
            [array([0., 1., 2.])]
            >>> future.then(lambda f: f.value()[0].sum()).wait()
            np.float64(3.0)
            >>> dist.destroy_process_group()
        """
        if self._future is None:
            future: Future[Any] = Future()
            self._future = future
            # The outputs' GPUs: the helper runs the wait (NCCL's stream ordering, MPI's
            # finalizers) as if on the caller's current streams there (StreamHandoff), records
            # events after it, and whoever takes the value makes its own current streams wait
            # (torch's CUDA future). So finalizers' temporaries, allocated on the caller's
            # stream, go back to its pool arena ordered after their last use. The first GPU
            # stays current for the callbacks of then() (a new thread's is GPU 0).
            # Under per-thread default streams the helper's stream is its own: what the
            # operation holds (temporaries from the caller's stream's arena, which the
            # finalizers read there) is kept until the helper's stream finished with it.
            devices = _gpus_of(self.outputs)
            handoffs = [StreamHandoff(device) for device in devices]
            per_thread = any(is_per_thread(current_stream(device)) for device in devices)

            def settle() -> None:
                held = (self._keep, self._finalizers) if per_thread else None
                with contextlib.ExitStack() as on_streams:
                    for device, handoff in reversed(list(zip(devices, handoffs, strict=True))):
                        on_streams.enter_context(_device(device))
                        on_streams.enter_context(handoff)
                    try:
                        self.wait()
                    except BaseException as error:  # noqa: BLE001 - handed to the future
                        future.set_exception(error)
                        return
                    finally:
                        if held is not None:
                            for device in devices:
                                with _device(device):
                                    current_stream(device).synchronize()
                            del held
                    if devices:
                        future._record_ready(devices)
                    future.set_result(self.outputs if self.outputs is not None else [])

            threading.Thread(  # in the caller's context: a thread rank's, under spawn
                target=contextvars.copy_context().run,
                args=(settle,),
                name=f"{self.description} future",
                daemon=True,
            ).start()
        return self._future

    def source_rank(self) -> int:
        """The global rank a finished receive got its message from (``-1`` for other operations)."""
        self.wait()
        if self.world_ranks is not None and self._source >= 0:
            return self.world_ranks[self._source]
        return self._source

    def wait_or_cancel(self, deadline: float) -> bool:
        """Wait for a receive until ``deadline`` (``time.monotonic()``); cancel it if not complete.

        ``True`` when it completed, ``False`` when it was cancelled (``monitored_barrier``'s
        wait for a late rank); re-raises the ``TimeoutError`` if it could not be cancelled.
        """
        try:
            self.wait(timeout=max(deadline - time.monotonic(), 1e-3))
        except TimeoutError:
            if not self._cancel():
                raise
            return self.is_success()
        return True

    def __repr__(self) -> str:
        state = "completed" if self.done else "pending"
        return f"<{type(self).__name__} {self.description} on group {self._group!r}: {state}>"


class CompletedWork(Work):
    """A :class:`Work` that finished when it was made (local or empty operations).

    Example:
        >>> CompletedWork("barrier", "0").is_completed()
        True
    """

    __slots__ = ()

    def __init__(self, description: str, group: str, timeout: float = 1800.0) -> None:
        super().__init__(description, group, timeout)

    def _test(self) -> bool:
        return True


def _device(device: int) -> Any:
    """``cupy.cuda.Device(device)`` (a new one per use: CuPy's Device is not re-entrant)."""
    return cupy_module().cuda.Device(device)  # type: ignore[union-attr]


def _gpus_of(arrays: Any) -> tuple[int, ...]:
    """The GPUs of the CuPy arrays of ``arrays``, the first array's first, no repeats."""
    if arrays is None or not cupy_arrays_may_exist():
        return ()
    found = [int(x.device.id) for x in arrays if is_cupy_array(x)]
    return tuple(dict.fromkeys(found))
