"""Run by ``mpiexec -n N python api_worker.py MODE``: PyTorch 2's API against NumPy.

Every rank builds every rank's data from its rank number, so each can compute the expected
result with NumPy alone; mismatches are printed as ``BAD ...`` and the exit status is 1.

Modes: ``api`` (every PyTorch 2 function, NumPy integers for ranks/tags/dims), ``debug`` (run
with ``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL``: matching calls pass, each kind of mismatch
raises on every rank naming the differing rank), ``monitored`` (the last rank never arrives),
``late`` (the last rank comes late to one ``monitored_barrier``, then the next one).

``rank_main(rank, argv)`` is one rank's program: ``main`` under ``mpiexec``, and the function
that ``cupy_parallel.distributed.spawn`` runs on thread ranks (each keeps its own tally).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
from common import tally  # this directory: the worker runs as a script

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel.distributed import ReduceOp


def check(name: str, actual: Any, expected: Any) -> None:
    tally().checks += 1
    a, e = np.asarray(actual), np.asarray(expected)
    if a.dtype != e.dtype or a.shape != e.shape or not np.array_equal(a, e):
        tally().failures.append(f"{name}: got {a!r}, expected {e!r}")


def same(name: str, actual: Any, expected: Any) -> None:
    tally().checks += 1
    if actual != expected:
        tally().failures.append(f"{name}: got {actual!r}, expected {expected!r}")


def row(r: int, n: int = 3, dtype: Any = np.float64) -> np.ndarray:
    return (np.arange(n) + 10 * r).astype(dtype)


def api(rank: int, size: int) -> None:
    ranks = range(size)
    # all_gather_into_tensor, concatenated and stacked
    for shape in ((size * 3,), (size, 3)):
        out = np.zeros(shape)
        dist.all_gather_into_tensor(out, row(rank))
        check(
            f"all_gather_into_tensor {shape}", out, np.stack([row(r) for r in ranks]).reshape(shape)
        )
    # reduce_scatter_tensor with every op that applies to int32
    for op, ufunc in (
        (ReduceOp.SUM, np.add),
        (ReduceOp.MAX, np.maximum),
        (ReduceOp.BXOR, np.bitwise_xor),
    ):
        data = [np.arange(size * 2, dtype=np.int32) * (r + 1) + r for r in ranks]
        out = np.zeros(2, np.int32)
        dist.reduce_scatter_tensor(out, data[rank], op=op)
        expected = ufunc.reduce(np.stack(data), axis=0, dtype=np.int32)[2 * rank : 2 * rank + 2]
        check(f"reduce_scatter_tensor {op.name}", out, expected)
    # the chunks an MPI rank receives into or sends from in place (one array, end to end), and
    # the forms it must copy for: the input inside the output (or the output inside the input),
    # a pooled host array
    every = np.stack([row(r) for r in ranks]).reshape(-1)
    out = np.zeros(size * 3)
    out[3 * rank : 3 * rank + 3] = row(rank)
    dist.all_gather_into_tensor(out, out[3 * rank : 3 * rank + 3])
    check("all_gather_into_tensor, input inside output", out, every)
    pooled = cupy_parallel.empty((size, 3), np.float64, "cpu")
    dist.all_gather_into_tensor(pooled, row(rank)[::-1].copy())
    flipped = np.stack([row(r)[::-1] for r in ranks])
    check("all_gather_into_tensor, pooled output", np.asarray(pooled), flipped)
    data = [np.arange(size * 2, dtype=np.float64) * (r + 1) + 0.5 for r in ranks]
    total = np.sum(np.stack(data), axis=0)
    mine = data[rank].copy()
    dist.reduce_scatter_tensor(mine[2 * rank : 2 * rank + 2], mine)
    check(
        "reduce_scatter_tensor, output inside input",
        mine[2 * rank : 2 * rank + 2],
        total[2 * rank : 2 * rank + 2],
    )
    source = cupy_parallel.empty((size * 2,), np.float64, "cpu")
    source[...] = data[rank]
    out = np.zeros(2)
    dist.reduce_scatter_tensor(out, source, op=ReduceOp.AVG)
    check("reduce_scatter_tensor AVG, pooled input", out, total[2 * rank : 2 * rank + 2] / size)
    # BAND/BOR/BXOR on all_reduce, ints and bools
    for op, ufunc in (
        (ReduceOp.BAND, np.bitwise_and),
        (ReduceOp.BOR, np.bitwise_or),
        (ReduceOp.BXOR, np.bitwise_xor),
    ):
        for dtype in (np.uint8, np.int64, np.bool_):
            data = [((np.arange(6) * 37 + 11 * r) % 256).astype(dtype) for r in ranks]
            x = data[rank].copy()
            dist.all_reduce(x, op=op)
            check(
                f"all_reduce {op.name} {np.dtype(dtype)}", x, ufunc.reduce(np.stack(data), axis=0)
            )
    try:
        dist.all_reduce(np.zeros(2), op=ReduceOp.BAND)
        tally().failures.append("BAND on float64 was accepted")
    except TypeError as error:
        same("BAND on float refused", "bitwise reduction" in str(error), True)
    # all_to_all_single with split sizes: rank r sends q + 1 rows to rank q
    send_sizes = [q + 1 for q in ranks]
    recv_sizes = [rank + 1] * size
    source = np.concatenate([np.full((q + 1, 2), 100 * rank + q) for q in ranks]).astype(np.int64)
    out = np.zeros((sum(recv_sizes), 2), np.int64)
    dist.all_to_all_single(out, source, recv_sizes, [np.int64(n) for n in send_sizes])
    expected = np.concatenate([np.full((rank + 1, 2), 100 * r + rank) for r in ranks])
    check("all_to_all_single splits", out, expected)
    even = np.zeros(size)
    dist.all_to_all_single(even, np.arange(size, dtype=float) + 10 * rank)
    check("all_to_all_single even", even, np.array([10.0 * r + rank for r in ranks]))
    overlapping_outputs(rank, size)
    torch_work_api(rank, size)
    # objects
    objects = [{"from": rank}, f"text {rank}", (rank, [rank] * 2)] if rank == 1 else [None] * 3
    dist.broadcast_object_list(objects, src=np.int64(1))
    same("broadcast_object_list", objects, [{"from": 1}, "text 1", (1, [1, 1])])
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, {"rank": rank, "pad": "x" * rank * 50})
    same("all_gather_object", gathered, [{"rank": r, "pad": "x" * r * 50} for r in ranks])
    dst = size - 1
    box = [None] * size if rank == dst else None
    dist.gather_object(("obj", rank), box, dst=dst)
    if rank == dst:
        same("gather_object", box, [("obj", r) for r in ranks])
    landed: list[Any] = [None]
    inputs = [f"for {r}" * (r + 1) for r in ranks] if rank == 0 else None
    dist.scatter_object_list(landed, inputs, src=0)
    same("scatter_object_list", landed, [f"for {rank}" * (rank + 1)])
    # batch_isend_irecv around a ring, NumPy integer peers and tags
    right, left = (rank + 1) % size, (rank - 1) % size
    received = np.zeros(3)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, row(rank), np.int32(right), tag=np.int64(5)),
            dist.P2POp(dist.irecv, received, np.int32(left), tag=np.int64(5)),
        ]
    )
    for work in works:
        work.wait()
    check("batch_isend_irecv ring", received, row(left))
    # groups: ranks from NumPy, queries
    evens = dist.new_group(np.arange(0, size, 2))
    if rank % 2 == 0:
        same(
            "get_process_group_ranks", dist.get_process_group_ranks(evens), list(range(0, size, 2))
        )
        same(
            "get_global_rank",
            dist.get_global_rank(evens, np.int64(len(range(0, size, 2)) - 1)),
            list(range(0, size, 2))[-1],
        )
        same("get_group_rank", dist.get_group_rank(evens, np.int16(rank)), rank // 2)
        x = np.full(2, float(rank))
        dist.all_reduce(x, group=evens)
        check("all_reduce on new_group(np.arange)", x, np.full(2, float(sum(range(0, size, 2)))))
    else:
        same("non-member", evens, dist.GroupMember.NON_GROUP_MEMBER)
    same("get_process_group_ranks world", dist.get_process_group_ranks(None), list(ranks))
    same("is_initialized", dist.is_initialized(), True)
    same("get_backend", dist.get_backend(), "mpi")
    # Work.get_future
    x = np.full(2, float(rank))
    work = dist.all_reduce(x, async_op=True)
    result = work.get_future().result(timeout=30)
    same("get_future result is the output", result[0] is x, True)
    check("get_future value", x, np.full(2, float(sum(ranks))))
    # monitored_barrier with everybody present
    dist.monitored_barrier(timeout=20)
    same("monitored_barrier passed", True, True)
    # src/dst/tag/dim as NumPy integers everywhere
    y = row(rank)
    dist.broadcast(y, src=np.uint8(0))
    check("broadcast src=np.uint8", y, row(0))
    if rank == 0:
        dist.send(row(7), dst=np.int64(1), tag=np.int32(9))
    elif rank == 1:
        z = np.zeros(3)
        dist.recv(z, src=np.int64(0), tag=np.int32(9))
        check("send/recv with NumPy ints", z, row(7))


def refused(name: str, call: Any, message: str) -> None:
    """``call()`` must raise ``ValueError`` whose message holds ``message``."""
    tally().checks += 1
    try:
        call()
    except ValueError as error:
        if message not in str(error):
            tally().failures.append(f"{name}: ValueError without {message!r}: {error}")
    else:
        tally().failures.append(f"{name}: accepted")


def overlapping_outputs(rank: int, size: int) -> None:
    """Output lists whose entries share memory are refused on every rank, nothing sent.

    Before, ``[buf] * size`` was accepted and every entry (one array) held the last rank's data.
    """
    buf = np.full(3, -1.0)
    one = "tensor_list[0] and tensor_list[1] share memory"
    refused("all_gather [buf] * n", lambda: dist.all_gather([buf] * size, row(rank)), one)
    base = np.zeros(size + 2)
    views = [base[r : r + 3] for r in range(size)]  # neighbours overlap in two elements
    refused("all_gather overlapping views", lambda: dist.all_gather(views, row(rank)), one)
    inputs = [row(rank) for _ in range(size)]
    refused(
        "all_to_all [buf] * n",
        lambda: dist.all_to_all([buf] * size, inputs),
        "output_tensor_list[0] and output_tensor_list[1] share memory",
    )
    refused(
        "all_gather_coalesced [[buf]] * n",
        lambda: dist.all_gather_coalesced([[buf]] * size, [row(rank)]),
        "output_tensor_lists[0][0] and output_tensor_lists[1][0] share memory",
    )
    check(
        "refused outputs untouched",
        np.concatenate([buf, base]),
        np.r_[[-1.0] * 3, [0.0] * (size + 2)],
    )
    if rank == 0:  # only the root holds a gather_list: it refuses, then gathers for the others
        refused(
            "gather [buf] * n",
            lambda: dist.gather(row(rank), [buf] * size, dst=0),
            "gather_list[0] and gather_list[1] share memory",
        )
        gathered = [np.zeros(3) for _ in range(size)]
        dist.gather(row(rank), gathered, dst=0)
        check(
            "gather after the refusal", np.stack(gathered), np.stack([row(r) for r in range(size)])
        )
    else:
        dist.gather(row(rank), None, dst=0)


def torch_work_api(rank: int, size: int) -> None:
    """barrier(timeout=) with a late rank; Work.result() of isend/irecv; futures' then/wait."""
    late = size - 1
    if rank == late:
        time.sleep(2.5)
    start = time.monotonic()
    try:
        dist.barrier(timeout=1)
        same("barrier(timeout=1) waits for the late rank", rank == late, True)
    except TimeoutError as error:
        same("barrier(timeout=1) times out on the punctual ranks", rank != late, True)
        same(
            "barrier timeout names barrier", str(error).startswith("barrier on process group"), True
        )
        same("barrier timeout after about 1 s", 0.9 < time.monotonic() - start < 2.4, True)
    x = np.ones(1)
    dist.all_reduce(x)  # the group stays usable: the barrier completed in the background
    check("all_reduce after a barrier timeout", x, np.array([float(size)]))
    right, left = (rank + 1) % size, (rank - 1) % size
    sent = row(rank)
    received = np.zeros(3)
    receiving = dist.irecv(received, src=left, tag=11)
    sending = dist.isend(sent, dst=right, tag=11)
    assert receiving is not None
    assert sending is not None
    arrays = receiving.result()
    same("irecv result() is [the receive buffer]", len(arrays) == 1 and arrays[0] is received, True)
    check("irecv result() data", arrays[0], row(left))
    same("isend result() is [the array sent]", sending.result()[0] is sent, True)
    everyone = dist.new_group(list(range(size)))
    z = np.full(2, float(rank + 1))
    pg_work = everyone.allreduce([z], ReduceOp.SUM)
    check(
        "pg.allreduce([z]).result()",
        pg_work.result()[0],
        np.full(2, float(sum(range(1, size + 1)))),
    )
    everyone.monitored_barrier(timedelta(seconds=20))
    same("pg.barrier().wait()", everyone.barrier().wait(), True)
    dist.destroy_process_group(everyone)
    y = np.full(2, float(rank))
    chained = dist.all_reduce(y, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    check("future.then(...).wait()", chained.wait(), np.full(2, 2.0 * sum(range(size))))


def debug(rank: int, size: int) -> None:
    x = np.ones(4)
    dist.all_reduce(x)
    check("debug: matching all_reduce", x, np.full(4, float(size)))
    last = size - 1
    cases = {
        "shape": lambda: dist.all_reduce(np.ones(5 if rank == last else 4)),
        "dtype": lambda: dist.all_reduce(np.ones(4, np.float32 if rank == last else np.float64)),
        "op": lambda: dist.all_reduce(
            np.ones(4), op=ReduceOp.MAX if rank == last else ReduceOp.SUM
        ),
        "root": lambda: dist.broadcast(np.ones(4), src=1 if rank == last else 0),
        "operation": lambda: dist.barrier() if rank == last else dist.all_reduce(np.ones(4)),
    }
    for what, call in cases.items():
        try:
            call()
            tally().failures.append(f"debug: {what} mismatch not detected")
        except ValueError as error:  # noqa: PERF203 - one try per case is the point
            message = str(error)
            if f"ranks [{last}] differ from the rest of process group" not in message:
                tally().failures.append(f"debug: {what}: {message}")
            print(f"CAUGHT {what}: {message}", flush=True)
    y = np.ones(2)
    dist.all_reduce(y)
    check("debug: usable after mismatches", y, np.full(2, float(size)))


def monitored(rank: int, size: int) -> None:
    if rank == size - 1:
        time.sleep(4)
        return
    try:
        dist.monitored_barrier(timeout=1.5, wait_all_ranks=True)
        tally().failures.append("monitored_barrier passed without the last rank")
    except RuntimeError as error:
        print(f"CAUGHT rank {rank}: {error}", flush=True)


def late(rank: int, size: int) -> None:
    """The last rank comes late to one monitored_barrier; the next one must wait for everybody.

    Before, the late rank's arrival at the first call stayed queued, rank 0's second call took
    it for its own and returned before the late rank had entered it, and the late rank's first
    call returned (released by that second call) although rank 0's had raised.
    """
    last = size - 1
    if rank == last:
        time.sleep(1.0)
    try:
        dist.monitored_barrier(timeout=0.4)
        tally().failures.append(f"rank {rank}: the first monitored_barrier passed")
    except RuntimeError as error:
        expected = "did not arrive" if rank == 0 else "did not release"
        same(f"rank {rank}'s first monitored_barrier raised", expected in str(error), True)
    if rank == last:
        time.sleep(1.0)
    entered = time.time()
    dist.monitored_barrier(timeout=20)
    times = [None] * size
    dist.all_gather_object(times, (entered, time.time()))
    same(
        "nobody left the second monitored_barrier before everybody entered it",
        max(e for e, _ in times) <= min(left for _, left in times),
        True,
    )


def local(rank: int, size: int) -> None:
    """use_local_synchronization: pairs make their own groups; nobody else calls new_group."""
    pair = [rank - rank % 2, rank - rank % 2 + 1] if rank - rank % 2 + 1 < size else [rank]
    made = [dist.new_group(pair, use_local_synchronization=True) for _ in range(2)]
    for k, group in enumerate(made):
        check(f"local group {k} size", dist.get_world_size(group), len(pair))
        check(f"local group {k} rank", dist.get_rank(group), pair.index(rank))
        x = np.array([float(rank + k)])
        dist.all_reduce(x, group=group)
        check(f"local group {k} all_reduce", x, np.array([float(sum(pair) + k * len(pair))]))
    others = [r for r in range(size) if r not in pair]
    if others:
        outsider = dist.new_group(others, use_local_synchronization=True)
        check(
            "a non-member calling gets NON_GROUP_MEMBER",
            outsider is dist.GroupMember.NON_GROUP_MEMBER,
            True,
        )
    for group in made:
        dist.destroy_process_group(group)


def tape(rank: int, size: int) -> None:
    """Writes by receives and by a broadcast's non-roots make a recorded array's gradient raise;
    the root, which only sends, keeps its gradient (1 - tanh^2)."""
    import cupy_parallel as cp
    from cupy_parallel import ops

    def gradient_after(write: Any) -> str:
        w = np.array([0.3, -1.2])
        with cp.Tape() as t:
            t.watch(w)
            h = ops.tanh(w)
            write(h)
            loss = ops.sum(h)
        try:
            g = t.gradient(loss, w)
        except RuntimeError as error:
            return "raised" if "written by dist." in str(error) else f"other error: {error}"
        return "tanh's" if np.allclose(g, 1 - np.tanh(w) ** 2, rtol=1e-14) else f"wrong: {g}"

    expected = "tanh's" if rank == 0 else "raised"
    check("broadcast", gradient_after(lambda h: dist.broadcast(h, src=0)), expected)
    if rank == 0:
        for r in range(1, size):
            dist.send(np.full(2, float(r)), dst=r)
            dist.send(np.full(2, float(r)), dst=r)
    else:
        check("recv", gradient_after(lambda h: dist.recv(h, src=0)), "raised")
        check("irecv", gradient_after(lambda h: dist.irecv(h, src=0).wait()), "raised")


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(_: int, argv: list[str]) -> int:
    mode = argv[0]
    if not dist.is_initialized():  # spawn made the world already
        dist.init_process_group("mpi", timeout=30 if mode != "monitored" else 3)
    rank, size = dist.get_rank(), dist.get_world_size()
    modes = {
        "api": api,
        "debug": debug,
        "monitored": monitored,
        "late": late,
        "local": local,
        "tape": tape,
    }
    modes[mode](rank, size)
    if mode == "monitored" and rank == size - 1:
        time.sleep(1)
    dist.barrier() if mode != "monitored" else None
    dist.destroy_process_group()
    bad, checks = tally().failures, tally().checks
    if bad:
        print(f"rank {rank}: {len(bad)} of {checks} checks failed:", file=sys.stderr)
        for line in bad:
            print("  BAD " + line, file=sys.stderr)
        return 1
    print(f"rank {rank}: {checks} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
