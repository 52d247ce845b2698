"""Run by ``mpiexec -n N`` (or ``cupy-parallel launch --backend mpi``): the last rank fails.

``python fault_worker.py MODE PIDDIR``: every rank records its pid in ``PIDDIR``, joins a world
with a 3 s timeout and does one ``all_reduce`` and a ``barrier``; then the last rank fails in
``MODE`` while the others start another ``all_reduce``:

- ``raise``: an uncaught exception (exit code 1);
- ``exit3``: ``sys.exit(3)``; ``quit4``: the ``quit(4)`` builtin;
- ``sigkill``/``sigint``: the rank sends itself the signal;
- ``skip``: it skips the ``all_reduce`` and exits 0 (the others time out: exit code 1);
- ``stall``: it sleeps (the others time out: exit code 1);
- ``raise-systemexit``: ``raise SystemExit(3)`` (not seen by the hooks; the others learn that
  it left and fail: exit code 1).

``python fault_worker.py MODE PIDDIR SECONDS`` sets the group timeout (default 3).

``rank_main(rank, argv)`` is one rank's program; ``cupy_parallel.distributed.spawn`` runs it on
thread ranks (tests/test_spawn.py), where ``sys.exit``/``quit`` end the rank, ``SIGINT`` is
Ctrl-C in the caller of spawn, and a rank that sleeps does so in short steps so that spawn can
end it once the run failed.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from cupy_parallel import distributed as dist


def nap(seconds: float) -> None:
    """Sleep ``seconds`` in short steps (a thread rank can be ended between two)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    rank_main(0, sys.argv[1:])


def rank_main(_: int, argv: list[str]) -> None:
    mode, piddir = argv[0], argv[1]
    if not dist.is_initialized():  # spawn made the world already
        dist.init_process_group("mpi", timeout=float(argv[2]) if len(argv) > 2 else 3)
    rank, size = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(piddir, f"{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(piddir, f"{rank}.tmp"), os.path.join(piddir, str(rank)))
    x = np.ones(4)
    dist.all_reduce(x)
    assert x.tolist() == [size] * 4
    dist.barrier()
    if rank == size - 1:
        if mode == "raise":
            raise RuntimeError(f"rank {rank} fails on purpose")
        if mode == "exit3":
            sys.exit(3)
        if mode == "quit4":
            quit(4)
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            nap(60)
        if mode == "skip":
            return
        if mode == "raise-systemexit":
            raise SystemExit(3)  # not through sys.exit: only the goodbye tells the others
        if mode == "stall":
            nap(600)
    dist.all_reduce(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
