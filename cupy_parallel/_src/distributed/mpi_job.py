"""The MPI job as a whole: ending it when one rank fails or a collective is stuck.

A failing rank ends the job (what ``python -m mpi4py`` does for its script): once
:func:`guard_job` ran (the MPI backend calls it when it makes a world of more than one process),
an uncaught exception (``KeyboardInterrupt`` from Ctrl-C included) or a ``sys.exit(n)`` with
``n != 0`` that reaches the top of the program calls ``MPI_Abort(COMM_WORLD, code)`` with the
code Python would have exited with (1, 130 for Ctrl-C, ``n``), so that ``mpiexec`` stops every
rank at once and exits with that code. Without it, the failing rank would wait in
``MPI_Finalize`` for peers that wait in a collective for it. ``sys.exit`` (and the
``exit``/``quit`` builtins) are wrapped for this: their ``SystemExit`` is a subclass that notices
when it reaches the top. A ``raise SystemExit(n)`` written out is not seen by these hooks; for it
(and for a rank that skipped a collective and ended normally) every guarded rank tells the others
when its program ends, and a rank waiting with a rank that left fails with ``RuntimeError`` after
a grace period of 2 s (plus the 1 s its wait spends spinning before it checks), instead of at the
group's timeout; the exit code is then that rank's (1). A rank killed by a signal is handled by
``mpiexec``, which tears the job down.

A collective that outlives its group's timeout cannot be cancelled (MPI has no way to): the
backend marks the group unusable and :func:`abort_at_exit` aborts the job with
``MPI_Abort(COMM_WORLD, 1)`` when this process exits, which also ends the peers stuck in it.

mpi4py is loaded on first use (:func:`load_mpi`): the package imports without it.

On a thread rank of :func:`~cupy_parallel.distributed.spawn` (:func:`enter_thread_rank` made
the calling context one), :func:`load_mpi` returns the rank's in-process MPI
(:mod:`~cupy_parallel._src.distributed.thread_mpi`) and the job is the spawn's: no hook is
installed (the process is not the job), a timed-out collective is recorded on the rank (spawn
ends the run when the rank's function returns, as MPI aborts the job at exit), and the ranks
whose function ended are the departed ones.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import contextvars
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from cupy_parallel._src.distributed.env import report_failure

if TYPE_CHECKING:
    from cupy_parallel._src.distributed.thread_mpi import ThreadRank

__all__ = [
    "DEPARTURE_GRACE_S",
    "abort_at_exit",
    "departed_ranks",
    "enter_thread_rank",
    "first_time",
    "guard_job",
    "load_mpi",
    "thread_name",
    "thread_rank",
]

_THREAD_RANK: contextvars.ContextVar[ThreadRank | None] = contextvars.ContextVar(
    "cupy_parallel_thread_rank", default=None
)


def load_mpi() -> Any:
    """mpi4py's ``MPI`` module (imported here, on first use, since mpi4py is optional).

    On a thread rank, the rank's in-process MPI instead.
    """
    rank = _THREAD_RANK.get()
    if rank is not None:
        return rank.mpi
    from mpi4py import MPI

    return MPI


def enter_thread_rank(rank: ThreadRank, /) -> None:
    """Make the current context thread rank ``rank`` (spawn does, in each rank's context)."""
    _THREAD_RANK.set(rank)


def thread_rank() -> ThreadRank | None:
    """The thread rank of the current context, or ``None`` in a process of its own.

    Example:
        >>> thread_rank() is None
        True
    """
    return _THREAD_RANK.get()


def thread_name() -> str:
    """The calling thread's name as the ranks compare it (see ``mpi_checks.caller_fields``).

    A thread rank's own thread is ``"MainThread"``, as a process's main thread is: the ranks'
    threads have names of their own (``"rank 0"``, ...) that would differ.

    Example:
        >>> thread_name()
        'MainThread'
    """
    current = threading.current_thread()
    rank = _THREAD_RANK.get()
    if rank is not None and current is rank.thread:
        return "MainThread"
    return current.name


def first_time(note: str, /) -> bool:
    """Whether ``note`` is new to this process, or on a thread rank to this rank (then noted).

    For one-time notices (a warning given once per process is given once per thread rank).
    """
    rank = _THREAD_RANK.get()
    notes = _notes if rank is None else rank.notes
    if note in notes:
        return False
    notes.add(note)
    return True


_notes: set[str] = set()


# ---------------------------------------------------------------------------------------------
# After a timeout

_stuck: list[str] = []
_ABORT_GRACE_S = 0.5


def abort_at_exit(message: str, mpi: Any = None) -> None:
    """Abort the MPI job when this process exits: a collective that cannot be cancelled is stuck.

    ``message`` says which (the first one is reported before aborting). On a thread rank (the
    context's, or that of ``mpi``, the group's MPI module): spawn ends the run when the rank's
    function returns.
    """
    rank = _rank_of(mpi)
    if rank is not None:
        rank.stuck.append(message)
        return
    if not _stuck:
        atexit.register(_abort_if_stuck)
    _stuck.append(message)


def _abort_if_stuck() -> None:
    if _stuck:
        sys.stderr.write(
            f"cupy_parallel: aborting the MPI job: {_stuck[0]} MPI cannot cancel a started "
            "collective, so the peers would wait forever.\n"
        )
        sys.stderr.flush()
        # mpiexec (MPICH's hydra) tears the job down on MPI_Abort without draining the ranks'
        # forwarded output: give it a moment, or the messages explaining the abort can be lost.
        time.sleep(_ABORT_GRACE_S)
        load_mpi().COMM_WORLD.Abort(1)


# ---------------------------------------------------------------------------------------------
# When a rank fails


def _end_job(code: int, why: str) -> None:
    """Abort the MPI job with exit ``code`` because this rank is failing (``why``)."""
    mpi = load_mpi()
    if mpi.Is_finalized():
        return
    rank = mpi.COMM_WORLD.Get_rank()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write(
        f"cupy_parallel: rank {rank} failed ({why}); aborting the MPI job with exit code {code} "
        "so that no peer waits for it.\n"
    )
    sys.stderr.flush()
    report_failure(rank, code)
    time.sleep(_ABORT_GRACE_S)  # see _abort_if_stuck
    mpi.COMM_WORLD.Abort(code)


class _RankExit(SystemExit):
    """What ``sys.exit`` raises in a guarded rank: ends the job when it reaches the top.

    Python frees the exception of a ``SystemExit`` that ended the program from C, with no Python
    frame left on the stack, just before it exits; one caught by the program is freed inside it.
    """

    def __del__(self) -> None:
        try:
            sys._getframe(1)
        except ValueError:  # nothing above: the program is exiting with this code
            code = _exit_status(self.code)
            if code != 0:
                _end_job(code, f"sys.exit({self.code!r})")


def _exit_status(code: object) -> int:
    """The status Python exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


_guarded = False

# Departures: every guarded rank tells the others when its program ends (at exit, before MPI's
# finalisation), on a communicator of its own. A rank waiting in an operation with a rank that
# left fails after a grace period instead of waiting for the group's timeout: this catches what
# the hooks cannot see (``raise SystemExit(n)`` written out, a rank that skipped a collective and
# ended normally).
_GOODBYE_TAG = 1
DEPARTURE_GRACE_S = 2.0
_departures: Any = None  # the communicator, once guarded
_departed: dict[int, float] = {}  # world rank -> when this rank learnt that it left


def _say_goodbye() -> None:
    """At exit: tell every other rank that this rank's program ended."""
    mpi = load_mpi()
    if _departures is None or mpi.Is_finalized():
        return
    me, size = _departures.Get_rank(), _departures.Get_size()
    note = np.array([me], np.int64)
    requests = [
        _departures.Isend([note, mpi.INT64_T], peer, _GOODBYE_TAG)
        for peer in range(size)
        if peer != me
    ]
    mpi.Request.Waitall(requests)  # small messages: they complete at once


def _rank_of(mpi: Any) -> ThreadRank | None:
    """The thread rank whose MPI ``mpi`` is (else the context's, if any)."""
    found: ThreadRank | None = getattr(mpi, "thread_rank", None)
    return found if found is not None else _THREAD_RANK.get()


def departed_ranks(mpi: Any = None) -> dict[int, float]:
    """The world ranks whose program ended, each with when this rank learnt it (``monotonic``).

    Records the goodbyes that have arrived first; empty before :func:`guard_job`. On a thread
    rank (see :func:`abort_at_exit`): the ranks whose function ended.
    """
    rank = _rank_of(mpi)
    if rank is not None:
        return rank.world.departed
    _listen()
    return _departed


def _listen() -> None:
    """Record the goodbyes that have arrived."""
    if _departures is None:
        return
    mpi = load_mpi()
    status = mpi.Status()
    while _departures.Iprobe(mpi.ANY_SOURCE, _GOODBYE_TAG, status):
        source = status.Get_source()
        _departures.Recv([np.zeros(1, np.int64), mpi.INT64_T], source, _GOODBYE_TAG)
        _departed.setdefault(source, time.monotonic())


def guard_job(world: Any) -> None:
    """Install the hooks that end the job when this rank fails (once per process).

    ``world`` is the ``MPI.COMM_WORLD`` of a job of more than one process, as every rank has
    just made it: the code that starts the job calls this on every rank. Nothing on a thread
    rank: spawn ends the run when a rank fails.
    """
    global _guarded, _departures
    if _guarded or _THREAD_RANK.get() is not None:
        return
    _guarded = True
    _departures = world.Dup()  # every rank is here: its world was just made
    atexit.register(_say_goodbye)
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous_hook(kind, value, tb)
        code = 130 if issubclass(kind, KeyboardInterrupt) else 1
        _end_job(code, f"uncaught {kind.__name__}")

    def guarded_exit(status: object = None, /) -> NoReturn:
        raise _RankExit(status)

    sys.excepthook = excepthook
    sys.exit = guarded_exit
    for name in ("exit", "quit"):  # the interactive helpers site installs raise SystemExit too
        helper = getattr(builtins, name, None)
        if helper is not None and type(helper).__name__ == "Quitter":
            setattr(builtins, name, _Quitter(repr(helper)))


class _Quitter:
    """``exit``/``quit`` as ``site`` defines them, raising :class:`_RankExit`."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text

    def __call__(self, code: object = None) -> NoReturn:
        raise _RankExit(code)
