"""Run by ``mpiexec -n N python agreement_worker.py MODE``: ranks that disagree on a collective.

Modes:

- ``threads``: two threads of every rank issue ``all_reduce`` on the world group at once, each
  with values that say which thread, call and rank they come from, so that every result shows
  whether it summed one thread's calls (``rank r, thread t, call i`` contributes
  ``1000 * t + i + 10**6 * r``). Each thread stops at its first error.
  Every rank prints ``rank r: RESULTS right=R wrong=W`` and ``rank r: ERROR ...`` with the
  first error of each thread. They run on a group of their own; the world group stays usable.
- ``threads-one-name``: ``threads`` with both threads named ``summer``.
- ``mismatch``: each non-rooted collective, on a group of its own, with the last rank passing
  another dtype (of another or of the same item size) or another size; every rank prints what
  it caught (``CAUGHT ...``) or ``NO ERROR name: result``; then a collective on the world group
  shows it unharmed.
- ``debug-race`` (2 ranks, the debug mode on): what two threads racing on one group did about
  one run in six (2 of 4,000 results mixed, no error), made to happen every time. Each rank
  prints ``rank r: SCENARIO CALL: right``, ``WRONG ...`` or ``ERROR Type: ...``. ``async``:
  thread ``a`` starts calls ``a0`` and ``a1`` (``async_op=True``) and ``b`` one call, ``b``
  first on rank 1: ``a0``'s digest meets ``b0``'s (an error on both ranks), then ``a1`` on
  rank 0 met ``a0`` on rank 1, whose comparisons agreed (the same thread and arrays):
  both returned the other's sum. ``held``: the debug mode compares a call's digest before its
  collective starts, so another thread's call can come between them: rank 1's thread ``a`` is
  held there, while rank 0's ``a0`` started its collective; rank 1's ``b9`` then meets it
  (an error on both ranks, but data started on rank 0 only), and ``b0`` on both ranks compared
  alike while MPI summed rank 1's ``b0`` with rank 0's ``a0``.
- ``async-race`` (2 ranks): ``debug-race``'s ``async`` without the debug mode (``a0`` meets
  ``b0``'s collective; ``a1`` on rank 0 met ``a0`` on rank 1 as there).
- ``pairs`` (2 processes): the rows of a group of two travel through persistent pairs where a
  rank has one free, else through an ``Isend``/``Irecv``; here rank 0 has none (its pool held),
  rank 1 its pool: 600 calls, synchronous and ``async_op=True`` ones held six at a time, sum
  right (``rank r: PAIRS right=R wrong=W``); then ``mismatch``'s all_reduce cases on 2 ranks,
  each on a group of its own.
"""

from __future__ import annotations

import contextvars
import gc
import os
import sys
import threading
import time
import warnings
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
from common import each_on_its_group  # this directory: the worker runs as a script

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.distributed import dispatch
from cupy_parallel.distributed import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable

CALLS = 2000


def threads(rank: int, size: int, names: tuple[str, str] = ("summer-0", "summer-1")) -> None:
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
        threading.Thread(target=contextvars.copy_context().run, args=(work, t), name=names[t])
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


class Race:
    """Calls of named threads on a group of ranks 0 and 1, each all_reduce of values saying
    which rank, thread and call they come from (``"b0"``: thread ``b``, its call 0); every rank
    prints ``rank r: SCENARIO CALL: right``, ``WRONG ...`` or ``ERROR Type: message``."""

    def __init__(self, rank: int, scenario: str) -> None:
        self.rank, self.scenario = rank, scenario
        self.group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
        self.arrays: dict[str, np.ndarray] = {}
        self.works: dict[str, dist.Work] = {}

    def value(self, name: str, rank: int) -> float:
        return 1.0 + rank + 10 * (ord(name[0]) - ord("a")) + 100 * int(name[1:])

    def call(self, *names: str, async_op: bool = False) -> threading.Thread:
        """Start thread ``names[0][0]`` (named as on the peer) making the calls ``names``."""

        def body() -> None:
            for name in names:
                x = self.arrays[name] = np.full(4, self.value(name, self.rank))
                try:
                    if async_op:  # started here, waited on in wait()
                        self.works[name] = dist.all_reduce(x, group=self.group, async_op=True)
                        continue
                    dist.all_reduce(x, group=self.group)
                except (ValueError, RuntimeError, TimeoutError) as error:
                    self.said(name, f"ERROR {type(error).__name__}: {error}")
                    continue
                self.said(name, self.checked(name))

        # in this rank's context (a thread rank's own, under spawn)
        runner = contextvars.copy_context().run
        thread = threading.Thread(target=runner, args=(body,), name=names[0][0])
        thread.start()
        return thread

    def checked(self, name: str) -> str:
        x, expected = self.arrays[name], self.value(name, 0) + self.value(name, 1)
        return "right" if (x == expected).all() else f"WRONG {x[0]} (want {expected})"

    def said(self, name: str, outcome: str) -> None:
        print(f"rank {self.rank}: {self.scenario} {name}: {outcome}", flush=True)

    def wait(self, *names: str) -> None:
        """Wait on the calls ``names`` that started (the others raised, and said so)."""
        for name in names:
            if name in self.works:
                try:
                    self.works[name].wait()
                except (ValueError, RuntimeError, TimeoutError) as error:
                    self.said(name, f"ERROR {type(error).__name__}: {error}")
                    continue
                self.said(name, self.checked(name))


def async_race(rank: int) -> None:
    """Thread a's two calls, b's one, in other orders on the ranks: a1 on rank 0 met a0."""
    race = Race(rank, "async")
    if rank == 0:
        race.call("a0", "a1", async_op=True).join()  # a0 meets b0: an error on both ranks
        race.call("b0", async_op=True).join()
    else:
        race.call("b0", async_op=True).join()
        race.call("a0", "a1", async_op=True).join()
    race.wait("a1", "a0", "b0")


def debug_race(rank: int) -> None:
    assert os.environ.get("CUPY_PARALLEL_DISTRIBUTED_DEBUG") == "DETAIL"
    async_race(rank)  # here a0's digest meets b0's

    # Rank 1's thread a held between its digest and its collective, which started on rank 0.
    race = Race(rank, "held")
    if rank == 0:
        race.call("a0", async_op=True).join()  # its digest, then its collective: started
        race.call("b0").join()  # before: its collective met no other call of thread b
        race.wait("a0")
        return
    compared, go = threading.Event(), threading.Event()
    unpatched = dispatch._compare

    def compare_then_hold(*args: Any) -> None:
        unpatched(*args)
        if dist.get_rank() == 1 and threading.current_thread().name == "a":
            compared.set()
            go.wait()

    dispatch._compare = compare_then_hold
    try:
        held = race.call("a0")
        compared.wait()
        race.call("b9").join()  # its digest meets a0's collective on rank 0
        race.call("b0").join()
    finally:
        dispatch._compare = unpatched
        go.set()
    held.join()  # a0 started on rank 1 only now: no call of rank 0 meets its comparison


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


def pairs(rank: int, size: int) -> None:
    _, backend = dispatch.backend_of(None, "pairs")  # type: ignore[misc]
    if rank == 0 and backend._pairs is not None:  # every pair held: Isend/Irecv only
        backend._pairs_made, backend._pairs[:] = 10**9, []
    right = wrong = 0
    held: list[tuple[np.ndarray, float, dist.Work]] = []
    for i in range(600):
        x = np.full(4, 10.0 * i + rank, np.float32)
        expected = sum(10.0 * i + r for r in range(size))
        if i % 2:
            held.append((x, expected, dist.all_reduce(x, async_op=True)))
        else:
            dist.all_reduce(x)
            right, wrong = (right + 1, wrong) if (x == expected).all() else (right, wrong + 1)
        if len(held) > 6 or i == 599:
            for y, want, work in held:
                work.wait()
                right, wrong = (right + 1, wrong) if (y == want).all() else (right, wrong + 1)
            held.clear()
    print(f"rank {rank}: PAIRS right={right} wrong={wrong}", flush=True)
    last = rank == size - 1
    calls = {
        "all_reduce, dtype": lambda g: dist.all_reduce(
            np.ones(4, np.float64 if last else np.float32), group=g
        ),
        "all_reduce, size": lambda g: dist.all_reduce(np.ones(6 if last else 4), group=g),
        "all_reduce, op": lambda g: dist.all_reduce(
            np.ones(4), op=ReduceOp.MAX if last else ReduceOp.SUM, group=g
        ),
        "all_reduce, shape after agreeing calls": lambda g: shape_after_agreeing(g, last),
    }
    each_on_its_group(calls, list(range(size)))


_DTYPES = (
    "bool",
    "int8",
    "uint16",
    "int32",
    "int64",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


def _values(dtype: np.dtype[Any], shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Rank ``rank``'s array of a ``carried`` case: every rank can make every rank's."""
    rng = np.random.default_rng(1000 + rank)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 100, shape).astype(dtype)
    values = rng.standard_normal(shape) * 10
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(shape)
    return values.astype(dtype)


def carried(rank: int, size: int) -> None:
    """Issue 35's all_reduce of a group of two that sends its array with the row (processes).

    Every dtype, op and shape, up to 16 KiB and one element over, against NumPy (the ranks'
    arrays reduced in rank order) and against MPI's own reduction of the same arrays (an
    ``async_op=True`` call, which takes the Iallreduce), bit for bit; floating-point errors
    left quiet, as MPI leaves them; NaN payloads and zeros' signs the same on both ranks; a
    rank taking the other way (async, a strided array) meeting it; then the mismatches.
    """
    wrong: list[str] = []
    checked = refused = 0
    for name in _DTYPES:
        dtype = np.dtype(name)
        edge = 16384 // dtype.itemsize
        for shape in [(), (5,), (3, 4), (edge,), (edge + 1,)]:
            for op in ReduceOp:
                mine = _values(dtype, shape, rank)
                fast, oracle = mine.copy(), mine.copy()
                try:  # the general way first: a TypeError of the carried call is not a refusal
                    work = dist.all_reduce(oracle, op=op, async_op=True)
                except TypeError:  # the dtype has no such reduction: refused before any message
                    refused += 1
                    continue
                work.wait()
                dist.all_reduce(fast, op=op)
                x0, x1 = (_values(dtype, shape, r) for r in range(2))
                if op is ReduceOp.AVG:
                    expected = ((x0 + x1) / 2).astype(dtype) if dtype.kind in "fc" else None
                elif op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "b":
                    expected = (np.logical_and if op is ReduceOp.MIN else np.logical_or)(x0, x1)
                else:
                    ufunc = {
                        ReduceOp.SUM: np.logical_or if dtype.kind == "b" else np.add,
                        ReduceOp.PRODUCT: np.logical_and if dtype.kind == "b" else np.multiply,
                        ReduceOp.MIN: np.minimum,
                        ReduceOp.MAX: np.maximum,
                        ReduceOp.BAND: np.bitwise_and,
                        ReduceOp.BOR: np.bitwise_or,
                        ReduceOp.BXOR: np.bitwise_xor,
                    }[op]
                    expected = ufunc(x0, x1)
                checked += 1
                if fast.tobytes() != oracle.tobytes() or (
                    expected is not None and not np.array_equal(fast, expected)
                ):
                    wrong.append(f"{name} {shape} {op.name}")
    print(f"rank {rank}: CARRIED checked={checked} refused={refused} wrong={wrong}", flush=True)

    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        big = np.full(3, 3e38, np.float32)
        dist.all_reduce(big)  # overflows to inf: no warning, no FloatingPointError
        opposite = np.array([np.inf if rank == 0 else -np.inf])
        dist.all_reduce(opposite)
    print(f"rank {rank}: QUIET {big.tolist()} {np.isnan(opposite).tolist()}", flush=True)

    payloads = np.array([0x7FF8000000000001 + rank, 0, 0x3FF0000000000000], np.uint64)
    special = payloads.view(np.float64).copy()
    special[1] = -0.0 if rank == 0 else 0.0
    sums, lows = special.copy(), special.copy()
    dist.all_reduce(sums)
    dist.all_reduce(lows, op=ReduceOp.MIN)
    seen: list[Any] = [None, None]
    dist.all_gather_object(seen, (sums.tobytes(), lows.tobytes()))
    print(f"rank {rank}: SAME BITS {seen[0] == seen[1]} {np.signbit(lows[1])}", flush=True)

    right = 0
    _, backend = dispatch.backend_of(None, "carried")  # type: ignore[misc]
    for i in range(40):  # one rank the general way (async, or no pair free), the other carried
        other = (i % 2) == rank
        x = np.full(8, float(i + rank))
        if other and i % 4 < 2:
            dist.all_reduce(x, async_op=True).wait()
        elif other:  # every pair held: the row alone, beside an Iallreduce
            kept, made = list(backend._pairs), backend._pairs_made
            backend._pairs[:], backend._pairs_made = [], 10**9
            dist.all_reduce(x)
            backend._pairs[:], backend._pairs_made = kept, made
        else:
            dist.all_reduce(x)
        right += int((x == 2 * i + 1).all())
    print(f"rank {rank}: MIXED right={right} of 40", flush=True)

    calls = {
        "all_reduce against a broadcast": lambda g: (
            dist.all_reduce(np.ones(4), group=g)
            if rank == 0
            else dist.broadcast(np.ones(4), 0, group=g)
        ),
        "all_reduce against a larger all_reduce": lambda g: dist.all_reduce(
            np.ones(4 if rank == 0 else 5000), group=g
        ),
        "all_reduce against a barrier": lambda g: (
            dist.all_reduce(np.ones(4), group=g) if rank == 0 else dist.barrier(group=g)
        ),
    }
    each_on_its_group(calls, [0, 1])


def carried_thread_between(rank: int) -> None:
    """A carried all_reduce whose peer goes the general way, another thread issuing meanwhile.

    Rank 1's thread ``T`` sends its array with the row and waits for rank 0's; 0.5 s later
    rank 1's main thread starts another all_reduce on the group (``async_op=True``, 7
    elements); at 1.5 s rank 0's thread ``T`` starts the same call as ``T``'s as an
    Iallreduce (``async_op=True``), its row alone; then rank 0's main thread the other. Rank
    1's ``T`` must start its own Iallreduce before its main thread's collective (else MPI
    pairs rank 0's with that one, and rank 0, whose rows agree, returns the other call's
    data): every call sums its own arrays (``T``'s ``1 + 1``, main's ``2 + 2``).
    """
    group = dist.new_group([0, 1])
    outcome: list[str] = []

    def call() -> None:
        x = np.ones(4)
        if rank == 0:
            time.sleep(1.5)
            dist.all_reduce(x, group=group, async_op=True).wait()
        else:
            dist.all_reduce(x, group=group)
        outcome.append(f"T {x.tolist()}")

    # in this rank's context (a thread rank's own, under spawn)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(call,), name="T")
    thread.start()
    other = np.full(7, 2.0)
    if rank == 1:
        time.sleep(0.5)  # T has sent its row and waits for rank 0's
        work = dist.all_reduce(other, group=group, async_op=True)
    thread.join()
    if rank == 0:
        work = dist.all_reduce(other, group=group, async_op=True)
    work.wait()
    print(f"rank {rank}: THREAD BETWEEN {outcome[0]} main {other.tolist()}", flush=True)


def carried_edges(rank: int) -> None:
    """Edge cases of the ``carried`` all_reduce that went wrong (2 processes).

    ``0-d``: a 0-d float array's ``MIN``/``MAX`` with a NaN or zeros of both signs (the total
    order's special cases) must give what the Iallreduce gives (an ``async_op=True`` call), bit
    for bit, on both ranks, and leave the group's persistent pairs as they were.
    """
    _, backend = dispatch.backend_of(None, "carried_edges")  # type: ignore[misc]
    wrong: list[str] = []
    made = backend._pairs_made
    for name in ("float32", "float64", "longdouble"):
        for op in (ReduceOp.MIN, ReduceOp.MAX):
            for pair in ((np.nan, 1.0), (1.0, np.nan), (-0.0, 0.0), (0.0, -0.0), (2.0, 2.0)):
                fast = np.array(pair[rank], name)
                oracle = fast.copy()
                try:
                    dist.all_reduce(fast, op=op)
                except Exception as error:  # noqa: BLE001 (the case is reported)
                    wrong.append(f"{name} {op.name} {pair}: {type(error).__name__}")
                    continue
                dist.all_reduce(oracle, op=op, async_op=True).wait()
                if fast.tobytes()[:10] != oracle.tobytes()[:10]:  # (long double: 10 bytes)
                    wrong.append(f"{name} {op.name} {pair}: {fast!r} != {oracle!r}")
    pairs = f"{backend._pairs_made - made} made, {len(backend._pairs)} free"
    print(f"rank {rank}: 0-D wrong={wrong} pairs {pairs}", flush=True)

    wrong, checked = [], 0
    for name in ("uint8", "int16", "uint32", "uint64", "longdouble", "clongdouble"):
        dtype = np.dtype(name)
        for shape in [(), (3,), (16384 // dtype.itemsize,)]:
            for op in ReduceOp:
                oracle = _special(dtype, shape, rank)
                fast = oracle.copy()
                try:  # first: a TypeError of the carried call itself must not pass for this
                    work = dist.all_reduce(oracle, op=op, async_op=True)
                except TypeError:  # no such reduction for the dtype (refused before any message)
                    continue
                work.wait()
                dist.all_reduce(fast, op=op)
                checked += 1
                if _significant(fast) != _significant(oracle):
                    wrong.append(f"{name} {shape} {op.name}")
    print(f"rank {rank}: SPECIAL checked={checked} wrong={wrong}", flush=True)

    kept: list[bool] = []

    def taped() -> None:  # a thread's first carried call made while a tape records
        w = np.ones(1000)
        with cupy_parallel.Tape() as tape:
            tape.watch(w)
            ops.multiply(w, w)
            dist.all_reduce(np.ones(4))
        ref = weakref.ref(tape)
        del tape
        gc.collect()
        kept.append(ref() is not None)  # asked while the thread (and what it keeps) lives

    # in this rank's context (a thread rank's own, under spawn)
    thread = threading.Thread(target=contextvars.copy_context().run, args=(taped,), name="taped")
    thread.start()
    thread.join()
    print(f"rank {rank}: TAPE KEPT {kept}", flush=True)


def _special(dtype: np.dtype[Any], shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Rank ``rank``'s array of extremes: integers' limits, infinities, zeros of both signs, NaN."""
    rng = np.random.default_rng(2000 + rank)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        pool = np.array([info.min, info.max, 0, 1, info.max // 2 + 1], dtype)
        return pool[rng.integers(0, pool.size, shape)]
    real = np.empty(0, dtype).real.dtype
    pool = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, np.finfo(real).tiny / 4, 1.5], real)
    values = np.zeros(shape, dtype)
    values.real = pool[rng.integers(0, pool.size, shape)]
    if dtype.kind == "c":
        values.imag = pool[rng.integers(0, pool.size, shape)]
    return values


def _significant(x: np.ndarray) -> bytes:
    """``x``'s bytes without a long double's padding (6 of its 16 bytes, left as they were)."""
    real = np.empty(0, x.dtype).real.dtype
    if real.itemsize == 16 and np.finfo(real).nmant == 63:  # x86's 80-bit long double
        return np.ascontiguousarray(x).view(np.uint8).reshape(-1, 16)[:, :10].tobytes()
    return x.tobytes()


def shape_after_agreeing(group: object, last: bool) -> None:
    """Calls that agree (the backend keeps what their signature needs), then one that does not.

    The last rank's array has the same dtype and size but another shape: what the backend made
    ready for the agreeing calls must not be taken for it.
    """
    for _ in range(3):
        dist.all_reduce(np.ones((2, 3), np.float32), group=group)
    dist.all_reduce(np.ones((3, 2) if last else (2, 3), np.float32), group=group)


# Each mode's program, called with the rank and the world size.
MODES: dict[str, Callable[[int, int], None]] = {
    "threads": threads,
    "threads-one-name": lambda rank, size: threads(rank, size, ("summer", "summer")),
    "mismatch": mismatch,
    "debug-race": lambda rank, _: debug_race(rank),
    "async-race": lambda rank, _: async_race(rank),
    "pairs": pairs,
    "carried": carried,
    "carried-thread-between": lambda rank, _: carried_thread_between(rank),
    "carried-edges": lambda rank, _: carried_edges(rank),
}


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(_: int, argv: list[str]) -> int:
    """One rank's program (``spawn`` runs it on thread ranks, the world made already)."""
    mode = argv[0]
    if not dist.is_initialized():
        dist.init_process_group("mpi", timeout=timedelta(seconds=20))
    MODES[mode](dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
