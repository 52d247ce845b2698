"""Run by ``mpiexec -n N python agreement_worker.py MODE``: ranks that disagree on a collective.

Modes:

- ``threads``: two threads of every rank issue ``all_reduce`` on the world group at once, each
  with values that say which thread, call and rank they come from, so that every result shows
  whether it summed one thread's calls (``rank r, thread t, call i`` contributes
  ``1000 * t + i + 10**6 * r``). Each thread stops at its first error.
  Every rank prints ``rank r: RESULTS right=R wrong=W`` and ``rank r: ERROR ...`` with the
  first error of each thread. They run on a group of their own; the world group stays usable.
- ``mismatch``: each non-rooted collective, on a group of its own, with the last rank passing
  another dtype (of another or of the same item size) or another size; every rank prints what
  it caught (``CAUGHT ...``) or ``NO ERROR name: result``; then a collective on the world group
  shows it unharmed.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from datetime import timedelta

import numpy as np
from common import each_on_its_group  # this directory: the worker runs as a script

from cupy_parallel import distributed as dist
from cupy_parallel.distributed import ReduceOp

CALLS = 2000


def threads(rank: int, size: int) -> None:
    right = [0, 0]
    wrong = [0, 0]
    errors: list[str] = []
    start = threading.Barrier(2)
    # A group of their own (a short timeout): the world group stays usable for the end.
    group = dist.new_group(list(range(size)), timeout=timedelta(seconds=3))

    def work(t: int) -> None:
        start.wait()
        for i in range(CALLS):
            x = np.full(4, 1000.0 * t + i + 1e6 * rank)
            try:
                dist.all_reduce(x, group=group)
            except (ValueError, RuntimeError, TimeoutError) as error:
                errors.append(f"thread {t}: {type(error).__name__}: {error}")
                return
            expected = size * (1000.0 * t + i) + 1e6 * sum(range(size))
            if (x == expected).all():
                right[t] += 1
            else:
                wrong[t] += 1

    # Each in this rank's context (a thread rank's own, under spawn).
    workers = [
        threading.Thread(target=contextvars.copy_context().run, args=(work, t), name=f"summer-{t}")
        for t in (0, 1)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    lines = [f"rank {rank}: RESULTS right={sum(right)} wrong={sum(wrong)}"]
    lines += [f"rank {rank}: ERROR {error}" for error in errors]
    print("\n".join(lines), flush=True)
    dist.barrier()  # every rank has printed before any exits (and aborts the job)


def mismatch(rank: int, size: int) -> None:
    last = rank == size - 1
    others = list(range(size))
    wide = np.float64 if last else np.float32  # another item size
    same = np.int32 if last else np.float32  # the same item size
    n = 6 if last else 4  # another size
    calls = {
        "all_reduce, dtype": lambda g: dist.all_reduce(np.ones(4, wide), group=g),
        "all_reduce, dtype of the same size": lambda g: dist.all_reduce(np.ones(4, same), group=g),
        "all_reduce, size": lambda g: dist.all_reduce(np.ones(n, np.float32), group=g),
        "all_reduce, op": lambda g: dist.all_reduce(
            np.ones(4), op=ReduceOp.MAX if last else ReduceOp.SUM, group=g
        ),
        "all_gather, size": lambda g: dist.all_gather(
            [np.zeros(n) for _ in others], np.ones(n), group=g
        ),
        "all_gather_into_tensor, dtype": lambda g: dist.all_gather_into_tensor(
            np.zeros(4 * size, same), np.ones(4, same), group=g
        ),
        "reduce_scatter, size": lambda g: dist.reduce_scatter(
            np.zeros(n), [np.ones(n) for _ in others], group=g
        ),
        "reduce_scatter_tensor, dtype": lambda g: dist.reduce_scatter_tensor(
            np.zeros(4, wide), np.ones(4 * size, wide), group=g
        ),
        "all_reduce_coalesced, size": lambda g: dist.all_reduce_coalesced(
            [np.ones(2), np.ones(n)], group=g
        ),
        "all_gather_coalesced, dtype": lambda g: dist.all_gather_coalesced(
            [[np.zeros(4, same)] for _ in others], [np.ones(4, same)], group=g
        ),
        "async all_reduce, size": lambda g: dist.all_reduce(
            np.ones(n, np.float32), group=g, async_op=True
        ).wait(),
        "all_reduce, shape after agreeing calls": lambda g: shape_after_agreeing(g, last),
    }
    each_on_its_group(calls, others)


def shape_after_agreeing(group: object, last: bool) -> None:
    """Calls that agree (the backend keeps what their signature needs), then one that does not.

    The last rank's array has the same dtype and size but another shape: what the backend made
    ready for the agreeing calls must not be taken for it.
    """
    for _ in range(3):
        dist.all_reduce(np.ones((2, 3), np.float32), group=group)
    dist.all_reduce(np.ones((3, 2) if last else (2, 3), np.float32), group=group)


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(_: int, argv: list[str]) -> int:
    """One rank's program (``spawn`` runs it on thread ranks, the world made already)."""
    mode = argv[0]
    if not dist.is_initialized():
        dist.init_process_group("mpi", timeout=timedelta(seconds=20))
    rank, size = dist.get_rank(), dist.get_world_size()
    if mode == "threads":
        threads(rank, size)
    elif mode == "mismatch":
        mismatch(rank, size)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
