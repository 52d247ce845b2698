"""The host memory pool: CuPy's best-fit/split/merge reuse, its byte counts, limit and GC safety.

The oracle for "which memory is in use" is a model kept beside the pool: the rounded sizes of the
arrays the test still holds. Arrays are filled with their own id and checked afterwards, so any
overlap between live blocks (a split or merge gone wrong) shows up as clobbered contents.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from cupy_parallel._src.memory import ALLOCATION_UNIT, POOL_THRESHOLD, HostMemoryPool

KIB = 1024


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


# --------------------------------------------------------------------------------------------
# the garbage collector freeing a pooled array inside the pool


def test_gc_freeing_a_pooled_array_while_the_pool_holds_its_lock_does_not_deadlock() -> None:
    # A cycle keeps a pooled array alive until the collector runs; with a tiny gen-0 threshold
    # the collector starts at some allocation the pool makes while holding its lock, and the
    # array's finalizer re-enters the pool. The old pool (a plain Lock taken in the finalizer)
    # hung there forever.
    pool = HostMemoryPool()

    def churn() -> None:
        for threshold in range(1, 20):
            gc.set_threshold(threshold, 1000, 1000)
            for i in range(20):
                cycle: list[Any] = [pool.empty((POOL_THRESHOLD + 4 * KIB * i,), np.uint8)]
                cycle.append(cycle)
                del cycle
                array = pool.empty((POOL_THRESHOLD + 4 * KIB * (i + 20 * threshold),), np.uint8)
                del array

    thresholds = gc.get_threshold()
    worker = threading.Thread(target=churn, daemon=True)
    try:
        worker.start()
        worker.join(timeout=60)
    finally:
        gc.set_threshold(*thresholds)
    assert not worker.is_alive(), "the pool deadlocked: a finalizer waited for the pool's lock"
    gc.collect()
    assert pool.used_bytes() == 0  # frees deferred while the lock was held were all folded in
    pool.free_all_blocks()
    assert pool.total_bytes() == 0


def test_frees_from_other_threads_are_all_accounted() -> None:
    pool = HostMemoryPool()
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                n = int(rng.integers(POOL_THRESHOLD, 4 * POOL_THRESHOLD))
                a = pool.empty((n,), np.uint8)
                a[:] = seed
                assert (a == seed).all()
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert pool.used_bytes() == 0
    pool.free_all_blocks()
    assert pool.total_bytes() == 0


# --------------------------------------------------------------------------------------------
# reuse across sizes (CuPy's rounding + best fit)


def test_400_training_steps_with_varying_batch_sizes_stay_bounded() -> None:
    # Each step allocates three activations whose size depends on a random batch size, then
    # drops them. Exact-size caching (the old pool) keeps one block per size ever seen and held
    # 88 MB after 400 steps for a 1.8 MB working set; best fit with splitting stays within a
    # small factor of the largest working set.
    pool = HostMemoryPool()
    rng = np.random.default_rng(0)
    peak_used = 0
    totals = []
    for _ in range(400):
        batch = int(rng.integers(33, 129))
        activations = [pool.empty((batch, width), np.float32) for width in (1000, 1500, 1000)]
        peak_used = max(peak_used, pool.used_bytes())
        del activations
        totals.append(pool.total_bytes())
    assert pool.used_bytes() == 0
    assert max(totals) <= 3 * peak_used, (max(totals), peak_used)
    assert totals[-1] == totals[199]  # no growth in the second half


def test_a_smaller_request_reuses_and_splits_a_cached_block() -> None:
    pool = HostMemoryPool()
    big = pool.empty((600 * KIB,), np.uint8)
    address = _address(big)
    del big
    small = pool.empty((200 * KIB + 1,), np.uint8)  # rounded up to 200 KiB + 512
    assert _address(small) == address
    rest = pool.empty((399 * KIB,), np.uint8)  # fits in the split-off tail
    assert _address(rest) == address + _rounded(200 * KIB + 1)
    assert pool.total_bytes() == 600 * KIB
    assert pool.used_bytes() == _rounded(200 * KIB + 1) + 399 * KIB
    assert pool.n_free_blocks() == 1  # the 512-byte tail of the split
    del small, rest
    again = pool.empty((600 * KIB,), np.uint8)  # the pieces merged back into one block
    assert _address(again) == address
    assert pool.total_bytes() == 600 * KIB


def test_best_fit_takes_the_smallest_block_that_is_large_enough() -> None:
    pool = HostMemoryPool()
    blocks = [pool.empty((n * KIB,), np.uint8) for n in (512, 256, 1024)]
    addresses = [_address(b) for b in blocks]
    del blocks
    assert _address(pool.empty((300 * KIB,), np.uint8)) == addresses[0]
    assert _address(pool.empty((200 * KIB,), np.uint8)) == addresses[1]


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(POOL_THRESHOLD, 5 * POOL_THRESHOLD), st.integers()),
        max_size=40,
    )
)
def test_live_blocks_never_overlap_and_the_counts_match_a_model(
    program: list[tuple[bool, int, int]],
) -> None:
    pool = HostMemoryPool()
    live: dict[int, np.ndarray] = {}
    for step, (allocate, nbytes, pick) in enumerate(program):
        if allocate or not live:
            live[step] = pool.empty((nbytes,), np.uint8)
            live[step][:] = step % 251
        else:
            del live[sorted(live)[pick % len(live)]]
        assert pool.used_bytes() == sum(_rounded(a.nbytes) for a in live.values())
        assert pool.free_bytes() == pool.total_bytes() - pool.used_bytes()
    clobbered = [step for step, array in live.items() if not (array == step % 251).all()]
    assert not clobbered, "a live block was overwritten"
    live.clear()
    assert pool.used_bytes() == 0
    pool.free_all_blocks()  # every split piece merged back: every segment is whole and dropped
    assert pool.total_bytes() == 0


def test_small_arrays_come_from_numpy_and_are_not_counted() -> None:
    pool = HostMemoryPool()
    small = pool.empty((POOL_THRESHOLD // 8 - 1,), np.float64)
    assert small.base is None
    assert pool.total_bytes() == 0


# --------------------------------------------------------------------------------------------
# free_all_blocks, limit


def test_free_all_blocks_keeps_blocks_that_arrays_still_use() -> None:
    pool = HostMemoryPool()
    whole = pool.empty((256 * KIB,), np.uint8)
    dropped = pool.empty((512 * KIB,), np.uint8)
    split = pool.empty((300 * KIB,), np.uint8)
    del dropped, split
    part = pool.empty((200 * KIB,), np.uint8)  # best fit: a piece of the 300 KiB block
    part[:] = 7
    pool.free_all_blocks()  # drops the 512 KiB block; keeps the used one and the split one
    assert pool.total_bytes() == 256 * KIB + 300 * KIB
    assert pool.free_bytes() == 100 * KIB
    assert (part == 7).all()
    del whole, part
    pool.free_all_blocks()
    assert (pool.total_bytes(), pool.used_bytes(), pool.free_bytes()) == (0, 0, 0)


def test_limit_refuses_an_allocation_past_it_with_a_clear_memory_error() -> None:
    pool = HostMemoryPool()
    pool.set_limit(size=1024 * KIB)
    assert pool.get_limit() == 1024 * KIB
    held = pool.empty((768 * KIB,), np.uint8)
    with pytest.raises(
        MemoryError,
        match=r"allocating 524,288 bytes would exceed the limit of 1,048,576 bytes set with "
        r"set_limit \(the pool holds 786,432 bytes, 786,432 of them in live arrays\)",
    ):
        pool.empty((512 * KIB,), np.uint8)
    assert pool.used_bytes() == 768 * KIB  # nothing changed
    del held
    pool.set_limit()  # no limit again (CuPy: size=None, fraction=None)
    assert pool.get_limit() == 0
    assert pool.empty((2048 * KIB,), np.uint8).nbytes == 2048 * KIB


def test_limit_drops_cached_blocks_and_collects_cycles_to_make_room() -> None:
    pool = HostMemoryPool()
    pool.set_limit(size=1024 * KIB)
    cached = pool.empty((600 * KIB,), np.uint8)
    del cached  # cached, but too small for the next request: dropped to make room
    cycle: list[Any] = [pool.empty((300 * KIB,), np.uint8)]
    cycle.append(cycle)
    del cycle  # only the garbage collector frees this one
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        array = pool.empty((1000 * KIB,), np.uint8)
    finally:
        if gc_was_enabled:
            gc.enable()
    assert array.nbytes == 1000 * KIB
    assert pool.total_bytes() <= 1024 * KIB


def test_limit_fraction_is_of_physical_memory() -> None:
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    pool = HostMemoryPool()
    pool.set_limit(fraction=0.5)
    assert pool.get_limit() == int(0.5 * physical)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"size": -1}, ValueError, r"size must be >= 0, got -1\."),
        ({"size": 1.5}, TypeError, r"size must be an int, got float 1\.5\."),
        ({"size": True}, TypeError, r"size must be an int, got bool True\."),
        ({"fraction": 1.5}, ValueError, r"fraction must be in \[0, 1\], got 1\.5\."),
        ({"fraction": "half"}, TypeError, r"fraction must be a number in \[0, 1\], got str"),
        ({"size": 1, "fraction": 0.5}, ValueError, r"size or fraction, not both"),
    ],
    ids=["negative-size", "float-size", "bool-size", "fraction>1", "str-fraction", "both"],
)
def test_set_limit_refuses_bad_arguments_and_keeps_the_old_limit(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    pool = HostMemoryPool()
    pool.set_limit(size=4096)
    with pytest.raises(error, match=match):
        pool.set_limit(**kwargs)
    assert pool.get_limit() == 4096


def test_400_scatter_gather_steps_through_the_library_stay_bounded() -> None:
    # The same property end to end: comm.scatter / comm.gather of batches of random sizes
    # allocate from the process-wide pool behind "host:k" and "cpu" arrays. Blocks of different
    # segments never merge, so the plateau is a few times the working set (3.5 here); the old
    # pool kept one block per size and grew with every new batch size.
    from cupy_parallel import comm, get_host_memory_pool

    pool = get_host_memory_pool()
    gc.collect()  # so that no other test's garbage is freed while this one counts
    pool.free_all_blocks()
    start_total, start_used = pool.total_bytes(), pool.used_bytes()
    rng = np.random.default_rng(1)
    peak = 0
    totals = []
    for _ in range(400):
        batch = np.ones((int(rng.integers(65, 257)), 1000), np.float32)
        parts = comm.scatter(batch, ["host:0", "host:1"])
        back = comm.gather(parts, destination="cpu")
        peak = max(peak, pool.used_bytes() - start_used)
        assert back.shape == batch.shape
        del parts, back
        totals.append(pool.total_bytes() - start_total)
    assert pool.used_bytes() == start_used
    assert max(totals) <= 4 * peak, (max(totals), peak)
    assert totals[-1] == totals[199]  # no growth in the second half


def test_counts_are_python_ints_whatever_the_shape_is_made_of() -> None:
    pool = HostMemoryPool()
    array = pool.empty((np.int64(POOL_THRESHOLD),), np.uint8)
    counts = [pool.used_bytes(), pool.total_bytes(), pool.free_bytes(), pool.n_free_blocks()]
    assert [type(c) for c in counts] == [int] * 4
    assert array.shape == (POOL_THRESHOLD,)
