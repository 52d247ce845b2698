"""``spawn``: a distributed program whose ranks are threads of this process.

Each rank runs in a ``contextvars`` context of its own, holding its own group state
(:func:`~cupy_parallel._src.distributed.groups.use_state`) and, for ``backend="threads"``, its
:class:`~cupy_parallel._src.distributed.thread_mpi.ThreadRank` (whose in-process MPI the MPI
backend runs on: :func:`~cupy_parallel._src.distributed.mpi_job.enter_thread_rank`). The caller
waits for the ranks; a rank that fails ends the run (:meth:`ThreadWorld.fail`), and so does
Ctrl-C in the caller.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arguments import read_bool, read_callable, read_int, read_timeout
from cupy_parallel._src.arrays import is_array
from cupy_parallel._src.compute import on_device_of
from cupy_parallel._src.devices import cuda_device_count, cupy_module
from cupy_parallel._src.distributed import groups
from cupy_parallel._src.distributed.barriers import barrier
from cupy_parallel._src.distributed.mpi_job import enter_thread_rank
from cupy_parallel._src.distributed.thread_mpi import RankFailedError, ThreadRank, ThreadWorld
from cupy_parallel._src.tree import tree_map

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["spawn"]

_DEFAULT_TIMEOUT = timedelta(seconds=60)
_BACKENDS = ("threads", "nccl")
# After a rank failed: how long the others get to end by themselves before an exception is
# raised in them (their calls fail at once; this is for ranks busy in code of their own).
_END_GRACE_S = 0.5
_KILL_GRACE_S = 2.0


class _RankAborted(BaseException):
    """Raised inside a rank still running after the run ended (spawn's last resort)."""


class _Run:
    """One spawn: what the ranks run, their results, and the first failure."""

    def __init__(
        self,
        size: int,
        /,
        *,
        fn: Callable[..., Any],
        args: list[tuple[Any, ...]],
        backend: str,
        timeout: float,
        store: Any,
    ) -> None:
        self.fn = fn
        self.args = args  # each rank's own copy
        self.backend = backend
        self.timeout = timeout
        self.store = store
        self.world = ThreadWorld(size)
        self.results: list[Any] = [None] * size
        self.failure: tuple[int, BaseException, str] | None = None
        self.ended = threading.Event()  # a rank failed (or the caller was interrupted)
        # Each rank's end. Waited for instead of joining the threads: a KeyboardInterrupt inside
        # Thread.join can leave a running thread marked as stopped (CPython's bpo-45274 fix
        # releases the lock the running thread holds).
        self.finished = [threading.Event() for _ in range(size)]
        self.threads: list[threading.Thread] = []
        self.states: list[groups.GroupState] = []

    def fail(self, rank: int, error: BaseException, said: str) -> None:
        """Record rank ``rank``'s failure (the first one is spawn's error) and end the run."""
        with self.world.changed:
            if self.failure is None:
                self.failure = (rank, error, said)
        self.world.fail(rank, error, said)
        self._abort_device_groups(said, rank)
        self.ended.set()

    def _abort_device_groups(self, said: str, rank: int) -> None:
        """NCCL ranks blocked in a collective wait for their communicators' abort.

        Without ending the process (which a rank process does when an abort leaves streams
        waiting on partial results): here the process is every rank's, the caller's too.
        """
        reason = f"rank {rank} of the spawn failed ({said})." if rank >= 0 else said
        for state in self.states:
            for pg in [state.world, *state.subgroups]:
                backend = None if pg is None else pg._backend
                abort = getattr(backend, "_abort", None)
                if abort is not None:
                    backend._tear_down = False  # type: ignore[union-attr]
                    with contextlib.suppress(Exception):
                        abort(reason)


def _said(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"it exited with code {error.code!r}"
    return f"{type(error).__name__}: {error}"


def _exit_is_success(error: BaseException) -> bool:
    return isinstance(error, SystemExit) and error.code in (None, 0)


def _rank_body(run: _Run, rank: int) -> None:
    """What rank ``rank``'s thread runs, in the rank's own context."""
    state = groups.GroupState()
    state.spawned = True  # init_process_group in fn: "spawn already initialised the group"
    groups.use_state(state)
    run.states[rank] = state
    thread_rank = ThreadRank(run.world, rank, threading.current_thread())
    try:
        try:
            # NCCL ranks too: what the rank's groups cannot take back is recorded on it (and
            # ends the run, never the process, which is the caller's)
            enter_thread_rank(thread_rank)
            if run.backend == "threads":
                groups.init_process_group("mpi", timeout=run.timeout)
            else:
                cupy: Any = cupy_module()
                cupy.cuda.Device(rank).use()
                groups.init_process_group(
                    "nccl",
                    store=run.store,
                    rank=rank,
                    world_size=run.world.size,
                    timeout=run.timeout,
                )
                # Make the world's communicator now, while every rank is here: one that a
                # failed rank never joins could not be aborted (its set-up waits for the
                # timeout), a made one can.
                barrier()
            run.results[rank] = run.fn(rank, *run.args[rank])
        except BaseException as error:
            if not _exit_is_success(error):
                raise
        if thread_rank.stuck:  # MPI would abort the job as this rank's program exits
            stuck = RuntimeError(
                f"{thread_rank.stuck[0]} A started collective cannot be cancelled, so the run "
                "ends (as an MPI job is aborted)."
            )
            run.fail(rank, stuck, f"RuntimeError: {stuck}")
    except _RankAborted:
        pass
    except BaseException as error:  # noqa: BLE001 - handed to spawn, which raises it
        if run.failure is None or not isinstance(error, RankFailedError):
            run.fail(rank, error, _said(error))
    finally:
        try:
            with contextlib.suppress(Exception):  # releases the groups (NCCL: the watchdogs)
                if groups.is_initialized():
                    groups.destroy_process_group()
            run.world.leave(rank)
        finally:
            run.finished[rank].set()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "threads",
    timeout: timedelta | float = _DEFAULT_TIMEOUT,
    join: bool = True,
    daemon: bool = False,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks that are threads of this process.

    Each rank runs in a context of its own, with its own default process group already
    initialised (``get_rank()`` is ``rank``, ``get_world_size()`` is ``nprocs``): every
    function of :mod:`cupy_parallel.distributed` behaves as in a process of its own, and nothing
    leaks between ranks or into the caller. For notebooks and tests: a distributed program
    runs, unchanged, without ``mpiexec``; production stays on MPI and NCCL.

    ``backend="threads"`` runs the MPI backend itself over an in-process MPI
    (:mod:`~cupy_parallel._src.distributed.thread_mpi`), so every call gives the same results
    and the same errors as under ``mpiexec``: the argument checks, the ranks' comparisons of
    every collective, the debug mode and the timeouts. ``get_backend()`` says ``"mpi"``, since
    it is that backend (code that chooses by backend takes its MPI path). Integer, bitwise,
    MIN/MAX and exact sums are MPI's bits; a floating-point sum that does not add exactly is
    reduced in rank order, which may differ in the last bits from a real MPI's own order. A
    send completes at once (buffered), where MPI's may wait for a large message's receiver.
    ``backend="nccl"`` (inside ``simulated_cuda(n)``, or on a machine with ``nprocs`` GPUs)
    runs NCCL ranks, rank ``r`` on GPU ``r``, meeting through a shared ``HashStore``.

    Faults end the run, never hang it: a rank that raises (or calls ``sys.exit`` with a
    non-zero code) makes every other rank's pending and later calls fail at once, and spawn
    raises ``RuntimeError`` naming that rank, chained to its exception (``from``). A collective
    a rank never joins times out after ``timeout`` (``TimeoutError`` in the ranks that wait);
    a timed-out collective cannot be taken back, so the run ends when that rank's function
    returns (as MPI aborts the job); so does an NCCL group aborted while a stream waits on a
    cut-short collective (a rank process would end itself; here the process is the caller's).
    A rank whose function returned is gone: a peer that waits
    for it fails after 2 s, as under ``mpiexec``. Ctrl-C while spawn waits ends the run: the
    ranks' calls fail, their threads are joined, and ``KeyboardInterrupt`` propagates.

    Each rank gets its own copy of ``args``, as a process would (``torch.multiprocessing.spawn``
    pickles them): every array (a leaf of the pytrees in ``args``: NumPy, host and CuPy arrays)
    is copied on its device, and the containers holding them (lists, tuples, dicts, the
    pytree nodes registered with :mod:`cupy_parallel._src.tree`) are rebuilt, so that a rank
    that writes its arrays in place (``x += rank``, a training step's update) changes neither
    the caller's nor another rank's. Other objects (a queue, a lock, a model object that is no
    pytree node) are passed as they are, shared by the ranks: return results instead of
    writing them there.

    Threads a rank starts that call the collectives must run in the rank's context
    (``threading.Thread(target=contextvars.copy_context().run, args=(f,))``): a plain
    ``threading.Thread`` started while spawn runs belongs to no rank, and its first call of
    :mod:`cupy_parallel.distributed` raises ``RuntimeError`` saying so (it would otherwise see
    the caller's own process group, another world); and, if two of
    them issue on one group, have names that are the same on every rank (``name=...``): the
    ranks compare the issuing thread's name, as MPI processes do (a rank's own thread compares
    as ``"MainThread"``).

    Args:
        fn: Called as ``fn(rank, *args)`` on every rank.
        nprocs: The number of ranks (at least 1).
        args: The further arguments of ``fn``.
        backend: ``"threads"`` (the default) or ``"nccl"``.
        timeout: The process groups' timeout (a ``timedelta`` or seconds); default 60 s, shorter
            than ``init_process_group``'s 30 minutes, since a stuck notebook cell should end.
        join: torch's ``join``: only ``True``, what spawn always does (it waits for every rank
            and returns their results); ``join=False``, torch's way to get a process context
            to join later, is refused (run spawn in a thread of your own instead).
        daemon: torch's ``daemon``, accepted and without effect: thread ranks never outlive
            spawn, daemonic or not.
        start_method: torch's multiprocessing start method: refused when given, since the
            ranks are threads of this process, started by none (``cupy-parallel launch``
            starts processes).

    Returns:
        ``fn``'s return values, in rank order.

    Raises:
        TypeError, ValueError: A bad argument (before any rank starts).
        RuntimeError: A rank failed (the message names it; ``__cause__`` is its exception).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> def total(rank):
        ...     x = np.full(2, rank + 1.0)
        ...     dist.all_reduce(x)
        ...     return x.tolist()
        >>> spawn(total, 3)
        [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0]]
    """
    function = read_callable(fn, "fn", call="fn(rank, *args)")
    _read_torch_options(join, daemon, start_method)
    if isinstance(nprocs, tuple | list):  # torch.multiprocessing.spawn(fn, args, nprocs)'s order
        raise TypeError(
            f"nprocs must be an int, got {type(nprocs).__name__} {nprocs!r}: the order is "
            "spawn(fn, nprocs, args), where torch.multiprocessing.spawn's is (fn, args, nprocs)."
        )
    size = read_int(nprocs, "nprocs", minimum=1)
    if isinstance(args, str | bytes) or not isinstance(args, tuple | list):
        raise TypeError(
            f"args must be a tuple of fn's further arguments, got {type(args).__name__}."
        )
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str ('threads' or 'nccl'), got {type(backend).__name__}."
        )
    if backend.lower() not in _BACKENDS:
        raise ValueError(f"backend must be 'threads' or 'nccl', got {backend!r}.")
    backend = backend.lower()
    limit = read_timeout(timeout)
    store = None
    if backend == "nccl":
        from cupy_parallel._src.distributed.store import HashStore

        if not groups.is_nccl_available():
            raise RuntimeError(
                "spawn(backend='nccl') needs NCCL and a GPU per rank: run it inside "
                "cupy_parallel.testing.simulated_cuda(nprocs), or use backend='threads'."
            )
        gpus = cuda_device_count()
        if size > gpus:
            raise ValueError(
                f"spawn(backend='nccl') runs rank r on GPU r: nprocs must be at most the number "
                f"of GPUs ({gpus}), got nprocs={size}."
            )
        store = HashStore()
    copies = [_copied(tuple(args)) for _ in range(size)]
    run = _Run(size, fn=function, args=copies, backend=backend, timeout=limit, store=store)
    run.states = [groups.GroupState() for _ in range(size)]
    for rank in range(size):
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run,
            args=(_rank_body, run, rank),
            name=f"rank {rank}",
            daemon=True,
        )
        run.threads.append(thread)
    with groups.spawn_running(run):  # threads started meanwhile belong to no rank
        for thread in run.threads:
            thread.start()
        try:
            _wait(run)
        except KeyboardInterrupt as interrupt:
            run.fail(-1, interrupt, "spawn was interrupted (KeyboardInterrupt)")
            _end(run)
            raise
        _end(run)
    if run.failure is not None:
        if run.backend == "nccl":
            _settle_devices(size)
        rank, error, said = run.failure
        raise RuntimeError(
            f"spawn: rank {rank} failed ({said}); the other ranks were stopped."
        ) from error
    return run.results


def _read_torch_options(join: object, daemon: object, start_method: object) -> None:
    """Check ``torch.multiprocessing.spawn``'s keywords: those that mean nothing here refuse."""
    join = read_bool(join, "join")
    read_bool(daemon, "daemon")
    if not join:
        raise ValueError(
            "spawn(join=False) is not supported: spawn always waits for its ranks and returns "
            "their results (torch's join=False returns a process context to join later; thread "
            "ranks have none). To go on meanwhile, call spawn in a thread of your own."
        )
    if start_method is not None:
        raise ValueError(
            f"spawn(start_method={start_method!r}) has no meaning here: the ranks are threads "
            "of this process, started by no multiprocessing method; leave it out (to start "
            "processes, use cupy-parallel launch)."
        )


def _copied(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every array copied on its device and every container rebuilt.

    A rank must not share the caller's arrays (nor another rank's), as a process would not:
    ``torch.multiprocessing.spawn`` pickles its ``args`` into each process.
    """
    return tree_map(lambda leaf: on_device_of(leaf, leaf.copy) if is_array(leaf) else leaf, args)


def _settle_devices(size: int) -> None:
    """After a failed NCCL run: wait for every GPU of the run, so that nothing is left pending.

    The failed ranks' last operations (a collective that ran on a group's internal stream,
    which no rank waited for) may still write their buffers when the next run allocates the
    same memory; the communicators are aborted, so their kernels have exited or will.
    """
    cupy: Any = cupy_module()
    for device in range(size):
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()


def _wait(run: _Run) -> None:
    """Until every rank ended, or one failed (short waits: Ctrl-C gets through)."""
    for finished in run.finished:
        while not finished.wait(0.05):
            if run.ended.is_set():
                return


def _end(run: _Run) -> None:
    """Let the ranks end; those still running after a grace period get an exception raised."""
    _wait_finished(run, _END_GRACE_S)
    late = [r for r, finished in enumerate(run.finished) if not finished.is_set()]
    for rank in late:
        _raise_in(run.threads[rank])
    _wait_finished(run, _KILL_GRACE_S)
    for rank, thread in enumerate(run.threads):
        if run.finished[rank].is_set():
            thread.join(_KILL_GRACE_S)  # a moment: it has nothing left to run


def _wait_finished(run: _Run, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for finished in run.finished:
        finished.wait(max(deadline - time.monotonic(), 0))


def _raise_in(thread: threading.Thread) -> None:
    """Raise :class:`_RankAborted` in ``thread`` at its next Python instruction."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_RankAborted)
        )
