"""What the MPI workers share: a rank's tally of checks, and calls expected to be refused.

Under ``mpiexec`` a rank is a process; on thread ranks (``cupy_parallel.distributed.spawn``,
tests/thread_ranks.py) the ranks are threads of one process, so each thread keeps its own tally.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel import distributed as dist

if TYPE_CHECKING:
    from collections.abc import Callable


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
