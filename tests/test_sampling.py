"""shard_indices: torch DistributedSampler's shards, padding and drop_last, NumPy's permutation.

The expected shards without shuffling are torch 2.13's (``list(DistributedSampler(range(n),
num_replicas=w, rank=r, shuffle=False, drop_last=d))`` for every rank, run by hand with torch CPU;
torch is not a test dependency). With shuffling the permutation is NumPy's, so the test checks
torch's rules on it: one permutation for all ranks, disjoint covering shards, the padding.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel import distributed as dist

TORCH = {  # (n, world_size, drop_last) -> every rank's indices, from torch's DistributedSampler
    (10, 3, False): [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]],
    (10, 3, True): [[0, 3, 6], [1, 4, 7], [2, 5, 8]],
    (7, 4, False): [[0, 4], [1, 5], [2, 6], [3, 0]],
    (2, 5, False): [[0], [1], [0], [1], [0]],
    (9, 3, False): [[0, 3, 6], [1, 4, 7], [2, 5, 8]],
    (11, 4, True): [[0, 4], [1, 5], [2, 6], [3, 7]],
    (3, 4, True): [[], [], [], []],
}


@pytest.mark.parametrize(("n", "world", "drop_last"), list(TORCH), ids=str)
def test_unshuffled_shards_are_torchs(n: int, world: int, drop_last: bool) -> None:
    got = [
        dist.shard_indices(n, rank=r, world_size=world, shuffle=False, drop_last=drop_last)
        for r in range(world)
    ]
    assert [g.tolist() for g in got] == TORCH[(n, world, drop_last)]
    assert all(g.dtype == np.int64 for g in got)


@given(
    n=st.integers(0, 60),
    world=st.integers(1, 7),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
    drop_last=st.booleans(),
)
def test_shuffled_shards_follow_torchs_rules(
    n: int, world: int, seed: int, epoch: int, drop_last: bool
) -> None:
    shards = [
        dist.shard_indices(n, rank=r, world_size=world, seed=seed, epoch=epoch, drop_last=drop_last)
        for r in range(world)
    ]
    per_rank = n // world if drop_last else -(-n // world)
    assert {len(s) for s in shards} == {per_rank}  # every rank the same number: in step
    # Interleaving the shards gives back one permutation (padded by its start, or cut).
    order = np.random.default_rng(seed + epoch).permutation(n)
    total = per_rank * world
    expected = order[:total] if drop_last else np.resize(order, total) if n else order
    interleaved = np.empty(total, np.int64)
    for r, shard in enumerate(shards):
        interleaved[r::world] = shard
    np.testing.assert_array_equal(interleaved, expected)
    if not drop_last and n:
        assert set(interleaved.tolist()) == set(range(n))  # every sample is seen


def test_epochs_reshuffle_and_seeds_agree() -> None:
    a = dist.shard_indices(100, rank=0, world_size=2, seed=3, epoch=0)
    b = dist.shard_indices(100, rank=0, world_size=2, seed=3, epoch=1)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, dist.shard_indices(100, rank=0, world_size=2, seed=3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rank": 2, "world_size": 2}, ValueError, r"rank must be in \[0, world_size\)"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"rank": 0, "world_size": 2, "shuffle": 1}, TypeError, "shuffle must be a bool"),
        ({"rank": 0, "world_size": 2, "epoch": -1}, ValueError, "epoch must be >= 0"),
        ({"rank": 0}, RuntimeError, "needs rank= and world_size="),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        dist.shard_indices(10, **kwargs)


def test_the_default_group_gives_rank_and_world_size() -> None:
    dist.init_process_group("mpi")  # outside mpiexec: a world of one
    try:
        np.testing.assert_array_equal(dist.shard_indices(5, shuffle=False), np.arange(5))
    finally:
        dist.destroy_process_group()
