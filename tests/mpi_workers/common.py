"""What the MPI workers share: a rank's tally of checks, and calls expected to be refused.

Under ``mpiexec`` a rank is a process; on thread ranks (``cupy_parallel.distributed.spawn``,
tests/thread_ranks.py) the ranks are threads of one process, so each thread keeps its own tally.
"""

from __future__ import annotations

import threading
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel import distributed as dist

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


class Tally:
    """One rank's checks and failures."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.checks = 0


_tallies = threading.local()


def tally() -> Tally:
    """This rank's tally (this thread's)."""
    found = getattr(_tallies, "tally", None)
    if found is None:
        found = _tallies.tally = Tally()
    return found


def caught(error: BaseException) -> None:
    """Print an expected error as the tests read it (``CAUGHT Type: message``)."""
    print(f"CAUGHT {type(error).__name__}: {error}", flush=True)


def each_on_its_group(calls: dict[str, Callable[[Any], Any]], members: list[int]) -> None:
    """Run every call on a new group of ``members``: print ``NO ERROR name`` or the ValueError.

    The ranks disagree in each call, so each is expected to be refused on every rank (the
    group it ran on may be unusable after); the world must still work after all of them.
    """
    for name, call in calls.items():
        group = dist.new_group(members)
        try:
            call(group)
            print(f"NO ERROR {name}", flush=True)
        except ValueError as error:
            caught(error)
    x = np.ones(2)
    dist.all_reduce(x)
    print(f"OK world after: {x.tolist()}", flush=True)


def run_checks(
    checks: Callable[[], Sequence[tuple[Callable[..., object], tuple[Any, ...]]]],
) -> int:
    """Run a worker's checks on this rank (``check(*args)`` each), then leave the world.

    The world is MPI's, or the one ``spawn`` made already. A failing check prints its traceback
    and the others still run; the exit status is 1 then, else 0 after "N checks passed".
    """
    if not dist.is_initialized():
        dist.init_process_group("mpi")
    rank = dist.get_rank()
    todo = checks()
    failed = 0
    for check, args in todo:
        try:
            check(*args)
        except Exception:  # noqa: BLE001, PERF203 - each check reported, the exit status says so
            failed += 1
            print(
                f"rank {rank}: FAILED {check.__name__}{args}\n{traceback.format_exc()}", flush=True
            )
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        return 1
    print(f"rank {rank}: {len(todo)} checks passed", flush=True)
    return 0
