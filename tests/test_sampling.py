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


@pytest.mark.parametrize(("seed", "epoch"), [(-1, 0), (-5, 2), (-(2**63), 0), (-3, 3)])
def test_negative_seeds_are_taken_as_torch_takes_them(seed: int, epoch: int) -> None:
    # torch's DistributedSampler seeds torch.Generator.manual_seed(seed + epoch), which takes
    # a negative seed as its 64-bit two's complement (seed -1 is seed 2**64 - 1): so does
    # shard_indices, where NumPy's default_rng refused it without naming the argument.
    got = dist.shard_indices(10, rank=0, world_size=1, seed=seed, epoch=epoch)
    expected = np.random.default_rng((seed + epoch) % 2**64).permutation(10)
    np.testing.assert_array_equal(got, expected)
    again = dist.shard_indices(10, rank=0, world_size=1, seed=(seed + epoch) % 2**64)
    np.testing.assert_array_equal(got, again)


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
    dist.init_process_group("mpi", world_size=1)  # outside mpiexec: a world of one
    try:
        np.testing.assert_array_equal(dist.shard_indices(5, shuffle=False), np.arange(5))
    finally:
        dist.destroy_process_group()


def test_unshuffled_shards_equal_live_torchs_on_a_grid() -> None:
    """Every rank's shard of every data set of 0-40 samples over 1-5 ranks is torch's."""
    torch_data = pytest.importorskip("torch.utils.data")
    for n in range(41):
        for world in range(1, 6):
            for drop_last in (False, True):
                for rank in range(world):
                    sampler = torch_data.DistributedSampler(
                        range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last
                    )
                    sampler.set_epoch(3)  # no effect without shuffling, in both
                    got = dist.shard_indices(
                        n, rank=rank, world_size=world, shuffle=False, epoch=3, drop_last=drop_last
                    )
                    assert got.tolist() == list(sampler), (n, world, rank, drop_last)
                    assert len(got) == len(sampler)


def test_torch_takes_a_negative_seed_as_its_twos_complement() -> None:
    """The oracle of the negative-seed convention above: torch's sampler, seed -1 and 2**64 - 1."""
    torch_data = pytest.importorskip("torch.utils.data")

    def torchs(seed: int, epoch: int) -> list[int]:
        sampler = torch_data.DistributedSampler(range(10), num_replicas=1, rank=0, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert torchs(-1, 0) == torchs(2**64 - 1, 0)
    assert torchs(-5, 2) == torchs(2**64 - 3, 0)
