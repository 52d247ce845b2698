"""Run by ``mpiexec -n N python edges_worker.py MODE``: faults that must give clear errors.

Every rank prints ``CAUGHT <type>: <message>`` for each error it expects and ``OK <what>`` for
each result it checked; the test reads them. Modes:

- ``edges``: ``Work.wait(timeout=1)`` expiring and the group staying usable; a tag above
  ``TAG_UB``; a receive buffer smaller, then larger, than the message; a receive cancelled at
  the group's timeout; MIN/MAX of NaN and +-0 giving the same bits on every rank;
- ``bcast-mismatch``: ranks broadcast arrays of different sizes;
- ``new-group-timeout``: the last rank sleeps past the timeout where the others call
  ``new_group``;
- ``new-group-barrier``: the last rank calls ``barrier`` where the others call ``new_group``;
- ``disagree``: the last rank names another root (``src``/``dst``) than the others, in each
  rooted collective, synchronous and with ``async_op=True``; then it expects more from rank 0
  than rank 0 sends in ``all_to_all`` and ``all_to_all_single``; then, all naming root 0, it
  passes another size, dtype or shape to each rooted collective, and another dtype of the same
  size to ``all_to_all``; last, it calls ``all_to_all_single`` where the others call
  ``all_reduce``; last, it calls ``barrier`` where the others call ``all_reduce``, then every
  rank an ``all_reduce``. Each on a group of its own (a mismatch leaves its group unusable); a
  collective on the world group shows it unharmed.
- ``late-wait``: the last rank expects more from rank 0 than rank 0 sends in an
  ``all_to_all_single`` that rank 0 starts with ``async_op=True`` and waits on only after an
  ``all_reduce`` of the same group, which the others, waiting on the ``all_to_all_single``,
  never reach.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from common import caught, each_on_its_group  # this directory: the worker runs as a script

from cupy_parallel import distributed as dist
from cupy_parallel.distributed import ReduceOp


def edges(rank: int, size: int) -> None:
    # Work.wait(timeout=1) expires; the operation completes later and the group stays usable.
    x = np.full(3, float(rank))
    if rank == size - 1:
        time.sleep(2.5)
    work = dist.all_reduce(x, async_op=True)
    assert work is not None
    if rank == 0:
        try:
            work.wait(timeout=1)
        except TimeoutError as error:
            caught(error)
    work.wait()
    expected = float(sum(range(size)))
    assert x.tolist() == [expected] * 3, x
    y = np.ones(2)
    dist.all_reduce(y)
    assert y.tolist() == [size, size]
    print("OK usable after wait(timeout=1)", flush=True)

    from cupy_parallel._src.distributed.mpi_job import load_mpi

    mpi = load_mpi()  # mpi4py's MPI; a thread rank's in-process MPI under spawn
    tag_ub = mpi.COMM_WORLD.Get_attr(mpi.TAG_UB)
    try:
        dist.send(np.zeros(1), dst=(rank + 1) % size, tag=tag_ub + 1)
    except ValueError as error:
        caught(error)

    # A receive buffer smaller than the message.
    if rank == 0:
        dist.send(np.arange(8.0), dst=1, tag=3)
    elif rank == 1:
        try:
            dist.recv(np.zeros(4), src=0, tag=3)
        except ValueError as error:
            caught(error)
    dist.barrier()

    # A message shorter than the receive buffer (from one rank, then from any rank): MPI would
    # leave the rest of the buffer as it was, unnoticed.
    if rank == 0:
        dist.send(np.arange(2.0), dst=1, tag=4)
        dist.send(np.arange(2.0), dst=1, tag=5)
    elif rank == 1:
        for src in (0, None):
            short = np.full(3, -1.0)
            try:
                dist.recv(short, src=src, tag=4 if src == 0 else 5)
            except ValueError as error:
                caught(error)
            assert short.tolist() == [0.0, 1.0, -1.0], short
    dist.barrier()
    print("OK usable after a short message", flush=True)

    # A receive nobody answers: cancelled at the group's timeout (3 s); the group stays usable.
    if rank == 1:
        try:
            dist.recv(np.zeros(2), src=0, tag=7)
        except TimeoutError as error:
            caught(error)
    else:
        time.sleep(2)  # so that this barrier does not time out while rank 1 waits
    dist.barrier()
    z = np.ones(1)
    dist.all_reduce(z)
    assert z.tolist() == [size]
    print("OK usable after a cancelled recv", flush=True)

    # MIN/MAX with NaN and +-0: the same bits everywhere (NaN wins, -0 < +0).
    values = [[1.0, 0.0, np.nan, -0.0, 5.0], [np.nan, -0.0, 2.0, 0.0, 5.0]]
    for dtype in (np.float16, np.float32, np.float64):
        for op, want in (
            (ReduceOp.MIN, [np.nan, -0.0, np.nan, -0.0, 5.0]),
            (ReduceOp.MAX, [np.nan, 0.0, np.nan, 0.0, 5.0]),
        ):
            mine = np.array(values[rank % 2], dtype)
            dist.all_reduce(mine, op=op)
            bits = mine.view(np.uint8).copy()
            everyone = [np.zeros_like(bits) for _ in range(size)]
            dist.all_gather(everyone, bits)
            same = all(np.array_equal(b, bits) for b in everyone)
            expected_bits = np.array(want, dtype).view(np.uint8)
            if same and np.array_equal(bits, expected_bits):
                print(f"OK {op.name} {np.dtype(dtype).name}", flush=True)
            else:
                print(f"BAD {op.name} {np.dtype(dtype).name}: {mine}", flush=True)


def disagree(rank: int, size: int) -> None:
    root = 1 if rank == size - 1 else 0
    others = list(range(size))
    calls = {
        "broadcast": lambda g: dist.broadcast(np.full(4, float(rank)), root, group=g),
        "reduce": lambda g: dist.reduce(np.ones(4), root, group=g),
        "gather": lambda g: dist.gather(
            np.ones(2), [np.zeros(2) for _ in others] if rank == root else None, root, group=g
        ),
        "scatter": lambda g: dist.scatter(
            np.zeros(2), [np.ones(2) for _ in others] if rank == root else None, root, group=g
        ),
        "async broadcast": lambda g: dist.broadcast(
            np.ones(3), root, group=g, async_op=True
        ).wait(),
        # the last rank expects 3 elements from rank 0, which sends it 2
        "all_to_all": lambda g: dist.all_to_all(
            [np.zeros(3 if rank == size - 1 and j == 0 else 2) for j in others],
            [np.ones(2) for _ in others],
            group=g,
        ),
        "all_to_all_single": lambda g: dist.all_to_all_single(
            np.zeros(size + 1 if rank == size - 1 else size),
            np.ones(size),
            [2 if rank == size - 1 and j == 0 else 1 for j in others],
            [1] * size,
            group=g,
        ),
    }
    last = rank == size - 1
    calls |= {  # every rank names root 0; the last rank's array differs
        "broadcast, size": lambda g: dist.broadcast(np.zeros(2 if last else 4), 0, group=g),
        "reduce, dtype of the same size": lambda g: dist.reduce(
            np.ones(4, np.int32 if last else np.float32), 0, group=g
        ),
        "gather, size": lambda g: dist.gather(
            np.ones(3 if last else 2),
            [np.zeros(2) for _ in others] if rank == 0 else None,
            0,
            group=g,
        ),
        "scatter, shape of the same size": lambda g: dist.scatter(
            np.zeros((1, 2) if last else (2, 1)),
            [np.ones((2, 1)) for _ in others] if rank == 0 else None,
            0,
            group=g,
        ),
    }
    kind = np.float32 if last else np.int32  # the same size: only the dtype differs
    calls["all_to_all, dtype"] = lambda g: dist.all_to_all(
        [np.zeros(2, kind) for _ in others], [np.ones(2, kind) for _ in others], group=g
    )
    # another collective: the ranks' comparisons have one size whatever the collective
    calls["operation"] = lambda g: (
        dist.all_to_all_single(np.zeros(size), np.ones(size), group=g)
        if last
        else dist.all_reduce(np.ones(size), group=g)
    )
    # a barrier where the others call all_reduce, then an all_reduce everywhere: a barrier that
    # compared nothing shifted the comparisons, so that the all_reduce of the others met the
    # last rank's next one in the comparison (MPICH, 2 ranks: rank 0 returned its own array)
    calls["barrier"] = lambda g: (
        dist.barrier(group=g) if last else dist.all_reduce(np.ones(size), group=g),
        dist.all_reduce(np.ones(size), group=g),
    )
    each_on_its_group(calls, others)


def late_wait(rank: int, size: int) -> None:
    # The last rank expects 2 elements from rank 0, which sends it 1: the ranks' rows say that
    # the sizes differ, and every rank asks the others for theirs, rank 0 only once it waits.
    # On a group of its own, so that the world's barrier keeps every rank until all reported.
    group = dist.new_group(list(range(size)))
    out_splits = [2] + [1] * (size - 1) if rank == size - 1 else [1] * size
    out = np.zeros(sum(out_splits))
    send = np.ones(size)
    try:
        if rank == 0:
            work = dist.all_to_all_single(
                out, send, out_splits, [1] * size, group=group, async_op=True
            )
            assert work is not None
            try:
                dist.all_reduce(np.ones(2), group=group)
            except TimeoutError as error:  # the others never reach it
                caught(error)
            work.wait()
        else:
            dist.all_to_all_single(out, send, out_splits, [1] * size, group=group)
        print("NO ERROR", flush=True)
    except ValueError as error:
        caught(error)
    dist.barrier()


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(_: int, argv: list[str]) -> int:
    """One rank's program (``spawn`` runs it on thread ranks, the world made already)."""
    mode = argv[0]
    if not dist.is_initialized():
        dist.init_process_group("mpi", timeout=3)
    rank, size = dist.get_rank(), dist.get_world_size()
    if mode == "edges":
        edges(rank, size)
    elif mode == "bcast-mismatch":
        try:
            dist.broadcast(np.zeros(8 if rank == 0 else 4), src=0)
            print("NO ERROR", flush=True)
        except ValueError as error:
            caught(error)
        return 0
    elif mode == "disagree":
        disagree(rank, size)
    elif mode == "late-wait":
        late_wait(rank, size)
        return 0
    elif mode == "new-group-timeout":
        try:
            if rank == size - 1:  # late: the others' new_group gives up first
                time.sleep(3)
            else:
                dist.new_group(list(range(size)), timeout=2)
        except TimeoutError as error:
            caught(error)
        return 0
    elif mode == "new-group-barrier":
        try:
            if rank == size - 1:  # a barrier where the others make a group
                dist.barrier()
            else:
                dist.new_group(list(range(size)), timeout=2)
            print("NO ERROR", flush=True)
        except ValueError as error:
            caught(error)
        return 0
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
