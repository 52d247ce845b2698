"""One rank's count of checks and its failures, for the MPI workers.

Under ``mpiexec`` a rank is a process; on thread ranks (``cupy_parallel.distributed.spawn``,
tests/thread_ranks.py) the ranks are threads of one process, so each thread keeps its own.
"""

from __future__ import annotations

import threading


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
