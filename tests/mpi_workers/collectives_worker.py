"""Run by ``mpiexec -n N python collectives_worker.py MODE``: checks every collective against NumPy.

Every rank builds every rank's inputs from a seed, so each can compute the expected result with
NumPy alone. Mismatches are collected and reported on stderr; the exit status is 1 if any.

Modes: ``all`` (the full matrix), ``timeout`` (rank 1 never joins a collective), ``die`` (rank 1
exits abruptly before a collective), ``init-timeout`` (rank 1 never calls init_process_group),
``reinit DIRECTORY PORT`` (init -> destroy -> init through the store-based rendezvous),
``cupy`` (CuPy arrays; needs a GPU), ``simulated-cupy`` (the same under ``simulated_cuda``),
``exact-average`` (``ReduceOp.AVG`` of integers at their extremes, against Python integers),
``bfloat16`` (``ml_dtypes.bfloat16`` reductions against float32 rounded to nearest even).

``rank_main(rank, argv)`` is the program of one rank: ``main`` under ``mpiexec``, and
``cupy_parallel.distributed.spawn(rank_main, n, (argv,))`` on thread ranks (tests/test_spawn.py),
where the world is already initialised and each rank keeps its own tally of checks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
from common import tally  # this directory: the worker runs as a script

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel.distributed import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]
OPS = list(ReduceOp)
SHAPES = [(), (0,), (5,), (3, 4)]

# Around warnings.catch_warnings, which swaps process-wide state: thread ranks take turns.
WARNINGS_LOCK = threading.Lock()


def data(seed: int, rank: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Small integer-valued data: sums and products are exact in every dtype and every order."""
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(dt)
    low = 0 if dt.kind in "ub" else -3
    values = rng.integers(low, 4, shape)
    if dt.kind == "c":
        values = values + 1j * rng.integers(-3, 4, shape)
    return np.asarray(values).astype(dt)


BITWISE = {
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
ARITHMETIC = {  # AVG: the sum, divided afterwards
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def valid(dtype: type, op: ReduceOp) -> bool:
    kind = np.dtype(dtype).kind
    if op in BITWISE:
        return kind in "biu"
    # complex: MIN/MAX have no order, and PRODUCT is refused as torch refuses it
    return not (kind == "b" and op is ReduceOp.AVG) and not (
        kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
    )


def oracle(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The reduction computed with NumPy, by the documented rules (float16 in float32)."""
    dtype = arrays[0].dtype
    work = [a.astype(np.float32) if dtype == np.float16 else a for a in arrays]
    if op in BITWISE:
        ufunc = BITWISE[op]
    elif dtype.kind == "b":
        ufunc = np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and
    else:
        ufunc = ARITHMETIC[op]
    result = functools.reduce(lambda a, b: ufunc(a, b, dtype=a.dtype), work)
    result = np.array(result, dtype=work[0].dtype)
    if op is ReduceOp.AVG:
        count = len(arrays)
        if result.dtype.kind == "c":  # each part by the count (ReduceOp.AVG's rule)
            mean = np.empty_like(result)
            mean.real, mean.imag = result.real / count, result.imag / count
            result = mean
        elif result.dtype.kind == "f":
            result = result / result.dtype.type(count)
        else:
            result = np.fix(result.astype(np.float64) / count).astype(result.dtype)
            # exact for these small values
    with np.errstate(over="ignore"):  # a float16 sum past its range is inf, as MPI's
        return result.astype(dtype)


def host(x: object) -> np.ndarray:
    """A NumPy copy of an array on any device (device arrays refuse np.asarray, as CuPy's do)."""
    return np.asarray(cupy_parallel.to_device(x, "cpu") if cupy_parallel.is_array(x) else x)


def check(name: str, actual: object, expected: object) -> None:
    tally().checks += 1
    a, e = host(actual), host(expected)
    if a.dtype != e.dtype or a.shape != e.shape or not np.array_equal(a, e):
        tally().failures.append(f"{name}: got {a!r}, expected {e!r}")


def run_all() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    seed = 0

    def next_seed() -> int:
        nonlocal seed
        seed += 1
        return seed

    # broadcast: every root, dtype and shape; HostArray in place
    for root in range(n):
        for dtype in DTYPES:
            for shape in SHAPES:
                s = next_seed()
                x = data(s, rank, shape, dtype)
                dist.broadcast(x, src=root)
                check(
                    f"broadcast root={root} {np.dtype(dtype)} {shape}",
                    x,
                    data(s, root, shape, dtype),
                )
    # all_reduce / reduce: every dtype, op and root
    for dtype in DTYPES:
        for op in OPS:
            if not valid(dtype, op):
                continue
            s = next_seed()
            every = [data(s, r, (3, 2), dtype) for r in range(n)]
            x = every[rank].copy()
            dist.all_reduce(x, op=op)
            check(f"all_reduce {op} {np.dtype(dtype)}", x, oracle(every, op))
            for root in range(n):
                x = every[rank].copy()
                work = dist.reduce(x, dst=root, op=op, async_op=True)
                work.wait()
                check(
                    f"reduce {op} {np.dtype(dtype)} root={root}",
                    x,
                    oracle(every, op) if rank == root else every[rank],
                )
            outs = np.zeros((3,), dtype)
            ins = [data(s + 1000, rank * n + k, (3,), dtype) for k in range(n)]
            dist.reduce_scatter(outs, ins, op=op)
            expected = oracle([data(s + 1000, r * n + rank, (3,), dtype) for r in range(n)], op)
            check(f"reduce_scatter {op} {np.dtype(dtype)}", outs, expected)
    # all_gather / gather / scatter: every dtype, every root
    for dtype in DTYPES:
        s = next_seed()
        every = [data(s, r, (2, 3), dtype) for r in range(n)]
        outs = [np.zeros((2, 3), dtype) for _ in range(n)]
        dist.all_gather(outs, every[rank])
        for r in range(n):
            check(f"all_gather {np.dtype(dtype)} [{r}]", outs[r], every[r])
        for root in range(n):
            gathered = [np.zeros((2, 3), dtype) for _ in range(n)] if rank == root else None
            dist.gather(every[rank], gathered, dst=root)
            if gathered is not None:
                for r in range(n):
                    check(f"gather {np.dtype(dtype)} root={root} [{r}]", gathered[r], every[r])
            out = np.zeros((2, 3), dtype)
            pieces = [data(s + 7, root * n + r, (2, 3), dtype) for r in range(n)]
            dist.scatter(out, pieces if rank == root else None, src=root)
            check(
                f"scatter {np.dtype(dtype)} root={root}",
                out,
                data(s + 7, root * n + rank, (2, 3), dtype),
            )
    # all_to_all with sizes differing per pair
    for dtype in (np.int64, np.float16, np.complex128, np.bool_):
        s = next_seed()
        ins = [data(s, rank * n + q, (rank + q + 1,), dtype) for q in range(n)]
        outs = [np.zeros((r + rank + 1,), dtype) for r in range(n)]
        dist.all_to_all(outs, ins)
        for r in range(n):
            check(
                f"all_to_all {np.dtype(dtype)} from {r}",
                outs[r],
                data(s, r * n + rank, (r + rank + 1,), dtype),
            )
    # barrier: nobody leaves before rank 0 has slept
    start = np.array([time.time()])
    dist.broadcast(start, src=0)
    if rank == 0:
        time.sleep(0.2)
    dist.barrier()
    check("barrier waited for rank 0", bool(time.time() >= start[0] + 0.2), True)
    # point to point: a ring of isend/irecv, then any-source receives at rank 0
    s = next_seed()
    right, left = (rank + 1) % n, (rank - 1) % n
    inbox = np.zeros(4, np.float64)
    recv_work = dist.irecv(inbox, src=left, tag=5)
    send_work = dist.isend(data(s, rank, (4,), np.float64), dst=right, tag=5)
    send_work.wait()
    recv_work.wait()
    check("ring irecv", inbox, data(s, left, (4,), np.float64))
    check("ring source_rank", recv_work.source_rank(), left)
    if rank == 0:
        seen = []
        for _ in range(n - 1):
            box = np.zeros(2, np.int32)
            sender = dist.recv(box, tag=9)
            seen.append(sender)
            check(f"recv any source from {sender}", box, np.array([sender, 10 * sender], np.int32))
        check("recv any source saw every rank", sorted(seen), list(range(1, n)))
    else:
        dist.send(np.array([rank, 10 * rank], np.int32), dst=0, tag=9)
    # coalesced forms with mixed dtypes and shapes
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
        s = next_seed()
        specs = [
            ((3,), np.float32),
            ((2, 2), np.int64),
            ((), np.float64),
            ((4,), np.float32),
            ((0,), np.int8),
        ]
        mine = [data(s + k, rank, shape, dt) for k, (shape, dt) in enumerate(specs)]
        dist.all_reduce_coalesced(mine, op=op)
        for k, (shape, dt) in enumerate(specs):
            expected = oracle([data(s + k, r, shape, dt) for r in range(n)], op)
            check(f"all_reduce_coalesced {op} [{k}]", mine[k], expected)
    s = next_seed()
    specs = [((3,), np.float16), ((2, 2), np.int64), ((), np.bool_), ((1,), np.complex64)]
    mine = [data(s + k, rank, shape, dt) for k, (shape, dt) in enumerate(specs)]
    outs = [[np.zeros(shape, dt) for shape, dt in specs] for _ in range(n)]
    dist.all_gather_coalesced(outs, mine)
    for r in range(n):
        for k, (shape, dt) in enumerate(specs):
            check(f"all_gather_coalesced [{r}][{k}]", outs[r][k], data(s + k, r, shape, dt))
    # np.longlong on some ranks, np.int64 on others (equal dtypes, NumPy's two C types of one
    # size: "q" and "l"), and the unsigned pair: the same calls, summed, gathered, scattered
    s = next_seed()
    for signed, other in ((np.int64, np.longlong), (np.uint64, np.ulonglong)):
        alias = signed if rank % 2 else other
        mine_sum = data(s, rank, (5,), signed).astype(alias)
        dist.all_reduce(mine_sum)
        want = oracle([data(s, r, (5,), signed) for r in range(n)], ReduceOp.SUM)
        check(f"all_reduce {np.dtype(alias).char} among {np.dtype(signed).char}", mine_sum, want)
        gathered = np.zeros(3 * n, signed)
        dist.all_gather_into_tensor(gathered, data(s + 1, rank, (3,), signed).astype(alias))
        want = np.concatenate([data(s + 1, r, (3,), signed) for r in range(n)])
        check(f"all_gather_into_tensor {np.dtype(alias).char}", gathered, want)
        chunk = np.zeros(2, alias)
        dist.reduce_scatter_tensor(chunk, data(s + 2, rank, (2 * n,), signed))
        total = oracle([data(s + 2, r, (2 * n,), signed) for r in range(n)], ReduceOp.SUM)
        check(
            f"reduce_scatter_tensor {np.dtype(alias).char}", chunk, total[2 * rank : 2 * rank + 2]
        )
    # inputs of OWN_MESSAGE_BYTES (64 KiB) and more travel alone: into separate outputs, into
    # outputs lying end to end in one buffer (received in place), into a buffer whose own slot
    # is the input; the small ones beside them packed
    s = next_seed()
    specs = [((128, 129), np.float32), ((3,), np.int16), ((9000,), np.float64), ((), np.bool_)]
    mine = [data(s + k, rank, shape, dt) for k, (shape, dt) in enumerate(specs)]
    for layout in ("separate", "end to end", "own slot"):
        outs = [[np.zeros(shape, dt) for shape, dt in specs] for _ in range(n)]
        inputs = mine
        if layout != "separate":
            for k in (0, 2):
                shape, dt = specs[k]
                whole = np.zeros((n, *shape), dt)
                for r in range(n):
                    outs[r][k] = whole[r]
            if layout == "own slot":
                inputs = list(mine)
                for k in (0, 2):
                    outs[rank][k][...] = mine[k]
                    inputs[k] = outs[rank][k]
        dist.all_gather_coalesced(outs, inputs)
        for r in range(n):
            for k, (shape, dt) in enumerate(specs):
                got, want = outs[r][k], data(s + k, r, shape, dt)
                check(f"all_gather_coalesced {layout} [{r}][{k}]", got, want)
    # async overlap: several operations in flight, waited in reverse order
    s = next_seed()
    every = [[data(s + k, r, (64,), np.float64) for r in range(n)] for k in range(4)]
    xs = [every[k][rank].copy() for k in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    bcast = data(s + 99, rank, (8,), np.int32)
    works.append(dist.broadcast(bcast, src=n - 1, async_op=True))
    for work in reversed(works):
        check("async wait", work.wait(), True)
    for k in range(4):
        check(f"async all_reduce [{k}]", xs[k], oracle(every[k], ReduceOp.SUM))
        check(f"async is_completed [{k}]", works[k].is_completed(), True)
        check(f"async exception [{k}]", works[k].exception() is None, True)
    check("async broadcast", bcast, data(s + 99, n - 1, (8,), np.int32))
    # HostArrays communicate in place and stay where they were
    cupy_parallel.set_host_device_count(2)
    h = cupy_parallel.to_device(np.full(3, rank + 1.0), "host:1")
    dist.all_reduce(h)
    check("HostArray all_reduce", h, np.full(3, n * (n + 1) / 2))
    check("HostArray device", str(h.device), "host:1")
    run_multigpu(rank, n, next_seed)
    run_groups(rank, n)


def run_multigpu(rank: int, n: int, next_seed) -> None:
    local = 3
    cupy_parallel.set_host_device_count(local)
    devs = [f"host:{k}" for k in range(local)]

    def put(arrays):
        return [cupy_parallel.to_device(a, d) for a, d in zip(arrays, devs, strict=True)]

    for dtype in (np.float64, np.int32, np.float16, np.bool_):
        for op in OPS:
            if not valid(dtype, op):
                continue
            s = next_seed()
            every = [
                [data(s, r * local + j, (2, 3), dtype) for j in range(local)] for r in range(n)
            ]
            flat = [a for row in every for a in row]
            xs = put([a.copy() for a in every[rank]])
            dist.all_reduce_multigpu(xs, op=op)
            for j in range(local):
                check(
                    f"all_reduce_multigpu {op} {np.dtype(dtype)} [{j}]",
                    xs[j],
                    oracle(flat, op),
                )
                check("all_reduce_multigpu placement", str(xs[j].device), devs[j])
            for root in range(n):
                xs = put([a.copy() for a in every[rank]])
                dist.reduce_multigpu(xs, dst=root, op=op, dst_tensor=local - 1)
                for j in range(local):
                    expected = (
                        oracle(flat, op) if (rank == root and j == local - 1) else every[rank][j]
                    )
                    check(
                        f"reduce_multigpu {op} {np.dtype(dtype)} root={root} [{j}]",
                        xs[j],
                        expected,
                    )
            # reduce_scatter_multigpu: input_tensor_lists[i][r * L + j] of every rank and local i
            ins = [
                [
                    cupy_parallel.to_device(
                        data(s + 500, (rank * local + i) * 100 + c, (2,), dtype), devs[i]
                    )
                    for c in range(n * local)
                ]
                for i in range(local)
            ]
            outs = [cupy_parallel.to_device(np.zeros(2, dtype), d) for d in devs]
            dist.reduce_scatter_multigpu(outs, ins, op=op)
            for j in range(local):
                c = rank * local + j
                contributions = [
                    data(s + 500, (r * local + i) * 100 + c, (2,), dtype)
                    for r in range(n)
                    for i in range(local)
                ]
                check(
                    f"reduce_scatter_multigpu {op} {np.dtype(dtype)} [{j}]",
                    outs[j],
                    oracle(contributions, op),
                )
        s = next_seed()
        for root in range(n):
            for src_tensor in range(local):
                xs = put([data(s, rank * local + j, (4,), dtype) for j in range(local)])
                dist.broadcast_multigpu(xs, src=root, src_tensor=src_tensor)
                for j in range(local):
                    check(
                        f"broadcast_multigpu {np.dtype(dtype)} root={root}/{src_tensor} [{j}]",
                        xs[j],
                        data(s, root * local + src_tensor, (4,), dtype),
                    )
        xs = put([data(s + 1, rank * local + j, (2,), dtype) for j in range(local)])
        outs = [
            [cupy_parallel.to_device(np.zeros(2, dtype), devs[i]) for _ in range(n * local)]
            for i in range(local)
        ]
        dist.all_gather_multigpu(outs, xs)
        for i in range(local):
            for r in range(n):
                for j in range(local):
                    check(
                        f"all_gather_multigpu {np.dtype(dtype)} [{i}][{r}*L+{j}]",
                        outs[i][r * local + j],
                        data(s + 1, r * local + j, (2,), dtype),
                    )
                    check(
                        "all_gather_multigpu placement", str(outs[i][r * local + j].device), devs[i]
                    )


INTEGERS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def extremes(dtype: type, contributor: int, count: int) -> np.ndarray:
    """One contributor's values for ``AVG``: the dtype's ends, mixed signs, then random values.

    Column ``k`` of every contributor is one case: all at the minimum, all at the maximum,
    minimum and maximum alternating, just below the maximum, just above the minimum, ``-1``
    beside the maximum, a lone maximum among minima; the rest uniform over the whole range.
    """
    info = np.iinfo(dtype)
    lo, hi = int(info.min), int(info.max)
    c = contributor
    cases = [
        lo,
        hi,
        lo if c % 2 else hi,
        hi - c % 64,
        lo + c % 64,
        (-1 if lo else 1) if c % 2 else hi,
        hi if c == count - 1 else lo,
    ]
    rng = np.random.default_rng([np.dtype(dtype).num, c])
    rest = rng.integers(lo, hi, size=9, dtype=dtype, endpoint=True)
    return np.array([*cases, *(int(v) for v in rest)], dtype=dtype).reshape(2, 8)


def exact_mean(arrays: list[np.ndarray]) -> np.ndarray:
    """The mean of the contributions rounded toward zero, in Python integers (no wrapping)."""
    dtype = arrays[0].dtype
    rows = [a.reshape(-1).tolist() for a in arrays]
    means = []
    for column in zip(*rows, strict=True):
        total, count = sum(column), len(column)
        means.append(abs(total) // count * (1 if total >= 0 else -1))
    return np.array(means, dtype=dtype).reshape(arrays[0].shape)


def run_exact_average(rank: int, n: int) -> None:
    """``ReduceOp.AVG`` of integers whose sum overflows their dtype: the exact mean, every call."""
    avg = ReduceOp.AVG
    for dtype in INTEGERS:
        name = np.dtype(dtype).name
        every = [extremes(dtype, r, n) for r in range(n)]
        expected = exact_mean(every)
        x = every[rank].copy()
        dist.all_reduce(x, op=avg)
        check(f"all_reduce AVG {name}", x, expected)
        for root in range(n):
            x = every[rank].copy()
            dist.reduce(x, dst=root, op=avg)
            check(f"reduce AVG {name} root={root}", x, expected if rank == root else every[rank])
        # reduce_scatter: chunk q of contributor r is extremes(r * n + q), for a case per chunk
        chunks = [[extremes(dtype, r * n + q, n) for q in range(n)] for r in range(n)]
        want = exact_mean([chunks[r][rank] for r in range(n)])
        out = np.zeros((2, 8), dtype)
        dist.reduce_scatter(out, [c.copy() for c in chunks[rank]], op=avg)
        check(f"reduce_scatter AVG {name}", out, want)
        out = np.zeros((2, 8), dtype)
        dist.reduce_scatter_tensor(out, np.concatenate(chunks[rank]), op=avg)
        check(f"reduce_scatter_tensor AVG {name}", out, want)
    # all dtypes in one coalesced call (one collective per dtype)
    mine = [extremes(dtype, rank, n) for dtype in INTEGERS]
    dist.all_reduce_coalesced(mine, op=avg)
    for dtype, got in zip(INTEGERS, mine, strict=True):
        expected = exact_mean([extremes(dtype, r, n) for r in range(n)])
        check(f"all_reduce_coalesced AVG {np.dtype(dtype).name}", got, expected)
    # several local arrays: n * local contributions
    local = 3
    cupy_parallel.set_host_device_count(local)
    devs = [f"host:{k}" for k in range(local)]
    count = n * local
    for dtype in INTEGERS:
        name = np.dtype(dtype).name
        every = [extremes(dtype, c, count) for c in range(count)]
        expected = exact_mean(every)
        mine = every[rank * local : (rank + 1) * local]
        xs = [cupy_parallel.to_device(a, d) for a, d in zip(mine, devs, strict=True)]
        dist.all_reduce_multigpu(xs, op=avg)
        for j in range(local):
            check(f"all_reduce_multigpu AVG {name} [{j}]", xs[j], expected)
        for root in range(n):
            xs = [cupy_parallel.to_device(a, d) for a, d in zip(mine, devs, strict=True)]
            dist.reduce_multigpu(xs, dst=root, op=avg, dst_tensor=local - 1)
            got = xs[local - 1]
            want = expected if rank == root else mine[local - 1]
            check(f"reduce_multigpu AVG {name} root={root}", got, want)
        # input_tensor_lists[i][c] of rank r is contribution r * L + i to output c
        ins = [
            [
                cupy_parallel.to_device(extremes(dtype, (rank * local + i) * 7 + c, count), devs[i])
                for c in range(count)
            ]
            for i in range(local)
        ]
        outs = [cupy_parallel.to_device(np.zeros((2, 8), dtype), d) for d in devs]
        dist.reduce_scatter_multigpu(outs, ins, op=avg)
        for j in range(local):
            c = rank * local + j
            want = exact_mean([extremes(dtype, p * 7 + c, count) for p in range(count)])
            check(f"reduce_scatter_multigpu AVG {name} [{j}]", outs[j], want)


def widen(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as the float32 values they stand for (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def narrow(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 bit patterns, to nearest even (finite and inf)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_inputs(contributor: int, count: int, op: ReduceOp) -> np.ndarray:
    """A contributor's bfloat16 bit patterns for ``op`` whose float32 reduction is exact.

    Sums: 8-bit mantissas within 2**-4..2**4 (any order of summation is exact in float32);
    products: +-{0.5, 0.75, 1, 1.5, 2}. Column 0 for SUM/AVG is a tie between two bfloat16
    values (1 + 2**-7 on contributor 0, 2**-8 on contributor 1): to nearest even rounds it
    up, truncation would not; the last columns hold -0.0/+0.0 and inf (MIN/MAX: a NaN).
    """
    rng = np.random.default_rng([7, contributor, list(ReduceOp).index(op)])
    if op is ReduceOp.PRODUCT:
        values = rng.choice([0.5, 0.75, 1.0, 1.5, 2.0], 12) * rng.choice([-1.0, 1.0], 12)
        bits = narrow(values.astype(np.float32))
    else:
        mantissa = rng.integers(128, 256, 12)
        exponent = rng.integers(-4, 5, 12)
        sign = rng.choice([-1.0, 1.0], 12)
        bits = narrow((sign * mantissa * 2.0 ** (exponent - 7)).astype(np.float32))
        tie = [1 + 2**-7, 2**-8][contributor] if contributor < 2 else 0.0
        bits[0] = narrow(np.array([tie], np.float32))[0]
    bits[10] = narrow(np.array([-0.0 if contributor % 2 else 0.0], np.float32))[0]
    special = np.nan if op in (ReduceOp.MIN, ReduceOp.MAX) and contributor == count - 1 else 1.0
    bits[11] = narrow(np.array([np.inf if contributor == 0 else special], np.float32))[0]
    return bits.reshape(3, 4)


def bf16_oracle(contributions: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The reduction of bfloat16 bit patterns in float32, rounded once to nearest even."""
    values = [widen(c) for c in contributions]
    ufunc = ARITHMETIC[op]
    total = functools.reduce(ufunc, values)
    if op is ReduceOp.AVG:
        total = total / np.float32(len(values))
    if op in (ReduceOp.MIN, ReduceOp.MAX):  # -0.0 < +0.0 (ReduceOp's documented order)
        stack = np.stack(values)
        positive = ((stack == 0) & ~np.signbit(stack)).any(axis=0)
        negative = ((stack == 0) & np.signbit(stack)).any(axis=0)
        plus = positive if op is ReduceOp.MAX else ~negative
        total = np.where(total == 0, np.where(plus, np.float32(0.0), np.float32(-0.0)), total)
    result = narrow(total)
    result[np.isnan(total)] = 0x7FC0  # the canonical NaN
    return result


def run_bfloat16(rank: int, n: int) -> None:
    """bfloat16 (ml_dtypes) reductions: float32 sums rounded to nearest even, every call."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)

    def as_bf16(bits: np.ndarray) -> np.ndarray:
        return bits.view(bf16).copy()

    def same(name: str, got: object, bits: np.ndarray) -> None:
        check(name, host(got).view(np.uint16), bits)

    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG):
        every = [bf16_inputs(r, n, op) for r in range(n)]
        expected = bf16_oracle(every, op)
        x = as_bf16(every[rank])
        dist.all_reduce(x, op=op)
        same(f"all_reduce bfloat16 {op}", x, expected)
        for root in range(n):
            x = as_bf16(every[rank])
            dist.reduce(x, dst=root, op=op)
            same(f"reduce bfloat16 {op} root={root}", x, expected if rank == root else every[rank])
        chunks = [[bf16_inputs(r * n + q, n * n, op) for q in range(n)] for r in range(n)]
        want = bf16_oracle([chunks[r][rank] for r in range(n)], op)
        out = np.zeros((3, 4), bf16)
        dist.reduce_scatter(out, [as_bf16(c) for c in chunks[rank]], op=op)
        same(f"reduce_scatter bfloat16 {op}", out, want)
        out = np.zeros((3, 4), bf16)
        dist.reduce_scatter_tensor(out, as_bf16(np.concatenate(chunks[rank])), op=op)
        same(f"reduce_scatter_tensor bfloat16 {op}", out, want)
        pair = [as_bf16(every[rank]), np.full(2, rank + 1.0, np.float32)]
        dist.all_reduce_coalesced(pair, op=op)
        same(f"all_reduce_coalesced bfloat16 {op}", pair[0], expected)
        # three host devices per rank: n * 3 contributions
        local = 3
        cupy_parallel.set_host_device_count(local)
        flat = [bf16_inputs(c, n * local, op) for c in range(n * local)]
        xs = [
            cupy_parallel.to_device(as_bf16(flat[rank * local + j]), f"host:{j}")
            for j in range(local)
        ]
        dist.all_reduce_multigpu(xs, op=op)
        for j in range(local):
            same(f"all_reduce_multigpu bfloat16 {op} [{j}]", xs[j], bf16_oracle(flat, op))
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):  # refused, as for floats
        x = as_bf16(bf16_inputs(rank, n, ReduceOp.SUM))
        before = x.copy()
        try:
            dist.all_reduce(x, op=op)
        except TypeError as error:
            check(f"{op} bfloat16 refused", "bitwise reduction" in str(error), True)
            check(f"{op} bfloat16 message names the dtype", "bfloat16" in str(error), True)
        else:
            check(f"{op} bfloat16 refused", "no error", "TypeError")
        same(f"{op} bfloat16 left the array alone", x, before.view(np.uint16))
    x = as_bf16(bf16_inputs(rank, n, ReduceOp.SUM))  # the group is still usable
    dist.all_reduce(x)
    same(
        "all_reduce bfloat16 after the refusals",
        x,
        bf16_oracle([bf16_inputs(r, n, ReduceOp.SUM) for r in range(n)], ReduceOp.SUM),
    )


def run_groups(rank: int, n: int) -> None:
    if n < 3:
        everyone = dist.new_group()
        x = np.array([rank + 1.0])
        dist.all_reduce(x, group=everyone)
        check("new_group() all_reduce", x, np.array([n * (n + 1) / 2]))
        dist.destroy_process_group(everyone)
        return
    members = [n - 1, 0]  # given unsorted: group ranks follow sorted order
    sub = dist.new_group(members)
    odd = dist.new_group([r for r in range(n) if r % 2 == 1])
    if rank in members:
        check("subgroup rank", dist.get_rank(sub), sorted(members).index(rank))
        check("subgroup size", dist.get_world_size(sub), 2)
        check("subgroup backend", dist.get_backend(sub), "mpi")
        x = np.array([float(rank)])
        dist.all_reduce(x, group=sub)
        check("subgroup all_reduce", x, np.array([float(n - 1)]))
        y = np.array([rank])
        dist.broadcast(y, src=n - 1, group=sub)
        check("subgroup broadcast from world rank", y, np.array([n - 1]))
        outs = [np.zeros(1, np.int64) for _ in range(2)]
        dist.all_gather(outs, np.array([rank]), group=sub)
        check("subgroup all_gather", [int(o[0]) for o in outs], [0, n - 1])
        if rank == 0:
            box = np.zeros(1, np.int64)
            check("subgroup recv returns world rank", dist.recv(box, group=sub), n - 1)
            check("subgroup recv data", box, np.array([n - 1]))
        else:
            dist.send(np.array([rank], np.int64), dst=0, group=sub)
        try:
            dist.broadcast(np.zeros(1), src=1, group=sub)
        except ValueError as error:
            check(
                "subgroup non-member src",
                "src=1 is not a member of process group" in str(error),
                True,
            )
        else:
            tally().failures.append("broadcast with a non-member src did not raise")
    else:
        check("non-member gets NON_GROUP_MEMBER", sub is dist.GroupMember.NON_GROUP_MEMBER, True)
        check("non-member rank", dist.get_rank(sub), -1)
        check("non-member size", dist.get_world_size(sub), -1)
        x = np.array([5.0])
        with WARNINGS_LOCK, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check("non-member all_reduce returns None", dist.all_reduce(x, group=sub), None)
            check("non-member all_reduce leaves data", x, np.array([5.0]))
            check("non-member recv", dist.recv(np.zeros(1), group=sub), -1)
        check(
            "non-member calls warn as torch's",
            [str(w.message).split(" which")[0] for w in caught],
            [f"Running {op} on global rank {rank}" for op in ("all_reduce", "recv")],
        )
    if rank % 2 == 1:
        x = np.array([rank])
        dist.all_reduce(x, group=odd)
        check("odd group all_reduce", x, np.array([sum(r for r in range(n) if r % 2 == 1)]))
    else:
        check("odd group non-member", odd is dist.GroupMember.NON_GROUP_MEMBER, True)
    dist.barrier()
    dist.destroy_process_group(sub)
    # the world still works after destroying a subgroup
    x = np.array([1])
    dist.all_reduce(x)
    check("world after destroying a subgroup", x, np.array([n]))


def run_cupy(rank: int, n: int, cupy: ModuleType) -> None:
    """CuPy arrays through the MPI backend (staged through host memory unless MPI is CUDA-aware).

    Every primitive that takes arrays, each against NumPy. ``cupy`` is CuPy or, without a GPU,
    the simulated CUDA's stand-in (which also raises on any access not ordered by the streams).
    """
    import warnings

    from cupy_parallel._src.distributed.mpi_staging import mpi_is_cuda_aware

    def same(name: str, got: object, expected: np.ndarray) -> None:
        check(name, cupy.asnumpy(got), expected)

    # Thread ranks share the process's warnings: the test counts the notes for them all.
    threads = on_thread_rank()
    recording = contextlib.nullcontext([]) if threads else warnings.catch_warnings(record=True)
    with recording as caught:
        if not threads:
            warnings.simplefilter("always")
        every = [data(1, r, (5,), np.float32) for r in range(n)]
        x = cupy.asarray(every[rank])
        dist.all_reduce(x)
        same("cupy all_reduce", x, oracle(every, ReduceOp.SUM))
        x = cupy.asarray(every[rank])
        dist.all_reduce(x, op=ReduceOp.AVG)
        same("cupy all_reduce AVG", x, oracle(every, ReduceOp.AVG))
        halves = [data(7, r, (6,), np.float16) for r in range(n)]
        x = cupy.asarray(halves[rank])  # float16 reduces in float32: buffers the backend fills
        dist.all_reduce(x, op=ReduceOp.AVG)
        same("cupy all_reduce float16 AVG", x, oracle(halves, ReduceOp.AVG))
        for dtype in (np.int8, np.int64, np.uint64):  # AVG of integers: exact, at the extremes
            name = np.dtype(dtype).name
            ints = [extremes(dtype, r, n) for r in range(n)]
            x = cupy.asarray(ints[rank])
            dist.all_reduce(x, op=ReduceOp.AVG)
            same(f"cupy all_reduce AVG {name}", x, exact_mean(ints))
            chunks = [cupy.asarray(extremes(dtype, rank * n + q, n)) for q in range(n)]
            z = cupy.zeros((2, 8), dtype)
            dist.reduce_scatter(z, chunks, op=ReduceOp.AVG)
            want = exact_mean([extremes(dtype, r * n + rank, n) for r in range(n)])
            same(f"cupy reduce_scatter AVG {name}", z, want)
            pair = [cupy.asarray(ints[rank]), cupy.asarray(ints[rank][0])]
            dist.all_reduce_coalesced(pair, op=ReduceOp.AVG)
            same(f"cupy all_reduce_coalesced AVG {name} [0]", pair[0], exact_mean(ints))
            same(f"cupy all_reduce_coalesced AVG {name} [1]", pair[1], exact_mean(ints)[0])
        y = cupy.asarray(data(2, rank, (3,), np.int64))
        dist.broadcast(y, src=n - 1)
        same("cupy broadcast", y, data(2, n - 1, (3,), np.int64))
        x = cupy.asarray(every[rank])
        dist.reduce(x, dst=0, op=ReduceOp.MAX)
        same("cupy reduce", x, oracle(every, ReduceOp.MAX) if rank == 0 else every[rank])
        outs = [cupy.zeros(5, np.float32) for _ in range(n)]
        dist.all_gather(outs, cupy.asarray(every[rank]), async_op=True).wait()
        for r in range(n):
            same(f"cupy all_gather [{r}]", outs[r], every[r])
        outs = [cupy.zeros(5, np.float32) for _ in range(n)] if rank == 1 else None
        dist.gather(cupy.asarray(every[rank]), outs, dst=1)
        for r in range(n if outs is not None else 0):
            same(f"cupy gather [{r}]", outs[r], every[r])
        pieces = [cupy.asarray(data(3, r, (2,), np.int32)) for r in range(n)] if rank == 0 else None
        z = cupy.zeros(2, np.int32)
        dist.scatter(z, pieces, src=0)
        same("cupy scatter", z, data(3, rank, (2,), np.int32))
        blocks = [[data(4, 10 * r + j, (2,), np.float64) for j in range(n)] for r in range(n)]
        z = cupy.zeros(2, np.float64)
        dist.reduce_scatter(z, [cupy.asarray(b) for b in blocks[rank]])
        same("cupy reduce_scatter", z, oracle([blocks[r][rank] for r in range(n)], ReduceOp.SUM))
        outs = [cupy.zeros(2, np.float64) for _ in range(n)]
        dist.all_to_all(outs, [cupy.asarray(b) for b in blocks[rank]])
        for r in range(n):
            same(f"cupy all_to_all [{r}]", outs[r], blocks[r][rank])
        if rank < 2:
            message = cupy.asarray(data(5, 0, (4,), np.uint8))
            if rank == 0:
                dist.send(message, dst=1)
            else:
                got = cupy.zeros(4, np.uint8)
                check("cupy recv source", dist.recv(got), 0)
                same("cupy recv", got, data(5, 0, (4,), np.uint8))
        pair = [cupy.asarray(data(6, rank, (3,), np.int16)), cupy.asarray(every[rank])]
        dist.all_reduce_coalesced(pair)
        same(
            "cupy all_reduce_coalesced [0]",
            pair[0],
            oracle([data(6, r, (3,), np.int16) for r in range(n)], ReduceOp.SUM),
        )
        same("cupy all_reduce_coalesced [1]", pair[1], oracle(every, ReduceOp.SUM))
        lists = [[cupy.zeros(5, np.float32)] for _ in range(n)]
        dist.all_gather_coalesced(lists, [cupy.asarray(every[rank])])
        for r in range(n):
            same(f"cupy all_gather_coalesced [{r}]", lists[r][0], every[r])
        if cupy.cuda.runtime.getDeviceCount() >= 2:
            run_cupy_multigpu(rank, n, cupy, same)
    staged = not mpi_is_cuda_aware()  # a stand-in goes through the simulated CUDA-aware MPI
    notes = [w for w in caught if "copied through host memory" in str(w.message)]
    if not threads:
        check("cupy staging note appears once", len(notes), 1 if staged else 0)


def run_cupy_multigpu(rank: int, n: int, cupy: ModuleType, same) -> None:
    """The ``*_multigpu`` forms with one CuPy array on each of two GPUs (current: GPU 0)."""

    def on(host: np.ndarray, device: int):
        with cupy.cuda.Device(device):
            return cupy.asarray(host)

    def same_on(name: str, got, expected: np.ndarray) -> None:
        with got.device:  # read on its own GPU's current stream
            same(name, got, expected)

    for dtype in (np.float32, np.float16):
        every = [[data(8, 2 * r + j, (2, 3), dtype) for j in range(2)] for r in range(n)]
        flat = [a for row in every for a in row]
        xs = [on(every[rank][j], j) for j in range(2)]
        dist.all_reduce_multigpu(xs, op=ReduceOp.AVG)
        for j in range(2):
            same_on(
                f"cupy all_reduce_multigpu {np.dtype(dtype)} [{j}]",
                xs[j],
                oracle(flat, ReduceOp.AVG),
            )
        xs = [on(every[rank][j], j) for j in range(2)]
        dist.broadcast_multigpu(xs, src=n - 1, src_tensor=1)
        for j in range(2):
            same_on(f"cupy broadcast_multigpu {np.dtype(dtype)} [{j}]", xs[j], every[n - 1][1])
        outs = [[on(np.zeros((2, 3), dtype), i) for _ in range(2 * n)] for i in range(2)]
        dist.all_gather_multigpu(outs, [on(every[rank][j], j) for j in range(2)])
        for i in range(2):
            for k in range(2 * n):
                same_on(
                    f"cupy all_gather_multigpu {np.dtype(dtype)} [{i}][{k}]", outs[i][k], flat[k]
                )
        ins = [
            [on(data(9, 100 * (2 * rank + i) + c, (2,), dtype), i) for c in range(2 * n)]
            for i in range(2)
        ]
        outs1 = [on(np.zeros(2, dtype), i) for i in range(2)]
        dist.reduce_scatter_multigpu(outs1, ins)
        for j in range(2):
            c = 2 * rank + j
            parts = [
                data(9, 100 * (2 * r + i) + c, (2,), dtype) for r in range(n) for i in range(2)
            ]
            same_on(
                f"cupy reduce_scatter_multigpu {np.dtype(dtype)} [{j}]",
                outs1[j],
                oracle(parts, ReduceOp.SUM),
            )

    for dtype in (np.int32, np.int64):  # AVG of integers over two GPUs per rank, exactly
        count = 2 * n
        flat = [extremes(dtype, c, count) for c in range(count)]
        xs = [on(flat[2 * rank + j], j) for j in range(2)]
        dist.all_reduce_multigpu(xs, op=ReduceOp.AVG)
        for j in range(2):
            same_on(
                f"cupy all_reduce_multigpu AVG {np.dtype(dtype)} [{j}]", xs[j], exact_mean(flat)
            )


def run_reinit(directory: str, port: int) -> None:
    """Initialise, destroy and initialise again through init_process_group's store path.

    That path (rendezvous, init_key, wait_for_world) serves the NCCL backend, which needs GPUs;
    here the table entry of ``"nccl"`` points at the MPI backend class, so the real store path
    runs and the world then communicates through MPI.
    """
    from mpi4py import MPI

    from cupy_parallel._src.distributed import groups
    from cupy_parallel._src.distributed.mpi import MPIBackend
    from cupy_parallel._src.distributed.store import FileStore

    class StoreMPIBackend(MPIBackend):
        needs_store = True  # take the store path, as NCCL does

    groups._BACKENDS[dist.Backend.NCCL] = (__name__, "StoreMPIBackend")
    globals()["StoreMPIBackend"] = StoreMPIBackend
    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    limit = timedelta(seconds=60)

    def one_world(
        what: str, generation: int, gone: Callable[[], bool] | None, **how: object
    ) -> None:
        dist.init_process_group("nccl", rank=rank, world_size=n, timeout=limit, **how)
        # held here, so that only destroy_process_group (not garbage collection) can close it
        opened = groups.state().owned_store
        check(f"{what}: world {generation} owns a store", opened is not None, gone is not None)
        x = np.array([rank + 10 * generation])
        dist.all_reduce(x)
        total = sum(range(n)) + 10 * n * generation
        check(f"{what}: all_reduce in world {generation}", x, np.array([total]))
        dist.destroy_process_group()
        MPI.COMM_WORLD.Barrier()  # every rank destroyed its world
        if gone is not None:
            check(f"{what} world {generation}: store closed", gone(), True)
            try:
                opened.num_keys()  # type: ignore[union-attr]
            except ValueError as error:
                check(f"{what} world {generation}: closed", "is closed" in str(error), True)
            else:
                tally().failures.append(
                    f"{what} world {generation}: the store it opened is still open"
                )
        MPI.COMM_WORLD.Barrier()  # every rank looked before the next world opens a store

    # a store the user passed in: three worlds on it, and it stays open
    user = FileStore(os.path.join(directory, "user"), n)
    for generation in range(3):
        one_world("user store", generation, None, store=user)
    third = f"cupy_parallel/init/0/{n}/2/complete"
    check("user store: the third world's key", user.check([third]), True)
    user.set(f"after/{rank}", "open")
    check("user store stays open", user.get(f"after/{rank}"), b"open")

    # stores init_process_group opened from init_method: destroy closes them
    def refused() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) != 0

    file_path = os.path.join(directory, "opened")
    for generation in range(2):
        url = f"file://{file_path}"
        one_world("file://", generation, lambda: not os.path.exists(file_path), init_method=url)
    for generation in range(2):
        one_world("tcp://", generation, refused, init_method=f"tcp://127.0.0.1:{port}")
    MPI.COMM_WORLD.Barrier()
    user.close()


def on_thread_rank() -> bool:
    """Whether this rank is a thread of ``spawn`` (not a process of ``mpiexec``)."""
    from cupy_parallel._src.distributed.mpi_job import thread_rank

    return thread_rank() is not None


def never_join(seconds: float) -> None:
    """Stay away from the collectives for ``seconds`` (in steps a thread rank can be ended in)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    return rank_main(int(os.environ.get("PMI_RANK", "0")), sys.argv[1:])


def rank_main(rank_env: int, argv: list[str]) -> int:
    """One rank's program; ``rank_env`` is its rank before the world exists."""
    mode = argv[0]
    if mode == "reinit":
        try:
            run_reinit(argv[1], int(argv[2]))
        except Exception:  # noqa: BLE001 - report any error, then fail the job
            tally().failures.append(traceback.format_exc())
        return report(rank_env)
    if mode == "init-timeout":
        if rank_env == 1:
            from mpi4py import MPI  # MPI starts, but this rank never joins the process group

            MPI.COMM_WORLD.Get_rank()
            time.sleep(60)
            return 0
        try:
            dist.init_process_group("mpi", timeout=timedelta(seconds=2))
        except TimeoutError as error:
            print(f"CAUGHT TimeoutError: {error}", file=sys.stderr, flush=True)
        return 0
    if not dist.is_initialized():  # spawn made the world already
        dist.init_process_group("mpi", timeout=timedelta(seconds=3 if mode == "timeout" else 120))
    rank = dist.get_rank()
    if mode == "timeout":
        if rank == 1:
            never_join(60)
            return 0
        try:
            dist.all_reduce(np.ones(4))
        except TimeoutError as error:
            print(f"CAUGHT TimeoutError: {error}", file=sys.stderr, flush=True)
        try:
            dist.barrier()
        except RuntimeError as error:
            print(f"CAUGHT RuntimeError: {error}", file=sys.stderr, flush=True)
        return 0
    if mode in ("cupy", "simulated-cupy"):
        if mode == "cupy":
            import cupy

            run_cupy(rank, dist.get_world_size(), cupy)
        elif on_thread_rank():  # the test entered simulated_cuda for all the ranks
            from cupy_parallel._src.devices import cupy_module

            run_cupy(rank, dist.get_world_size(), cupy_module())
        else:
            from cupy_parallel.testing import simulated_cuda

            with simulated_cuda(2) as stand_in:
                run_cupy(rank, dist.get_world_size(), stand_in)
        dist.destroy_process_group()
        return report(rank)
    if mode in ("exact-average", "bfloat16"):
        run = run_exact_average if mode == "exact-average" else run_bfloat16
        try:
            run(rank, dist.get_world_size())
        except Exception:  # noqa: BLE001 - report any error, then fail the job
            tally().failures.append(traceback.format_exc())
        dist.destroy_process_group()
        return report(rank)
    if mode == "die":
        if rank == 1:
            if on_thread_rank():
                sys.exit(3)  # a thread cannot end its process: it ends its rank
            os._exit(3)
        dist.all_reduce(np.ones(4))
        return 0
    try:
        run_all()
    except Exception:  # noqa: BLE001 - report any error, then fail the job
        tally().failures.append(traceback.format_exc())
    dist.destroy_process_group()
    return report(rank)


def report(rank: int) -> int:
    """Print the failures (exit status 1) or how many checks passed (0)."""
    failures, checks = tally().failures, tally().checks
    if failures:
        print(f"rank {rank}: {len(failures)} of {checks} checks failed:", file=sys.stderr)
        for failure in failures[:30]:
            print("  " + failure, file=sys.stderr)
        return 1
    print(f"rank {rank}: {checks} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
