"""Which samples each rank takes: :func:`shard_indices`, torch's ``DistributedSampler`` rules.

Every rank of a data-parallel job must see a disjoint part of the data set and the same number
of samples (else the ranks' collectives fall out of step). torch's ``DistributedSampler`` does it
with one permutation shared by all ranks (seeded by ``seed + epoch``), padded by repeating its
start up to a multiple of the world size (or cut down with ``drop_last``), then taken every
``world_size``-th element from ``rank``. :func:`shard_indices` applies the same rules to a NumPy
permutation: without shuffling the shards are torch's, element for element; with shuffling the
permutation is NumPy's (``numpy.random.default_rng(seed + epoch)``), not torch's, so the
samples differ from torch's while every rank still agrees on them. A negative ``seed + epoch``
is taken as torch's ``Generator.manual_seed`` takes it, as its 64-bit two's complement
(``-1`` is ``2**64 - 1``).
"""

from __future__ import annotations

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_int

__all__ = ["shard_indices"]

_SEED_MODULUS = 2**64


def shard_indices(
    n: int,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> np.ndarray:
    """The indices of ``n`` samples that ``rank`` of ``world_size`` ranks takes (int64).

    Args:
        n: The number of samples in the data set.
        rank: This rank; default: the rank in the default process group.
        world_size: How many ranks share the data; default: the default group's size.
        shuffle: Permute the samples (the same permutation on every rank for ``seed`` and
            ``epoch``); otherwise take them in order.
        seed: The permutation's seed; every rank must pass the same. Negative seeds are
            accepted, as torch's: ``seed + epoch`` below 0 counts from ``2**64``.
        epoch: Added to ``seed``: pass the epoch number for a new permutation each epoch (what
            ``DistributedSampler.set_epoch`` does).
        drop_last: Drop the tail that does not divide evenly; otherwise repeat the first samples
            to fill the last round, so that every rank gets ``ceil(n / world_size)`` indices.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: ``rank`` outside ``[0, world_size)``, a negative ``n`` or ``epoch``.
        RuntimeError: ``rank`` or ``world_size`` left out while no process group is
            initialised.

    Example:
        >>> [shard_indices(10, rank=r, world_size=3, shuffle=False).tolist() for r in range(3)]
        [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
        >>> shard_indices(10, rank=2, world_size=3, shuffle=False, drop_last=True).tolist()
        [2, 5, 8]
    """
    count = read_int(n, "n", minimum=0)
    if rank is None or world_size is None:
        from cupy_parallel._src.distributed.groups import get_rank, get_world_size, is_initialized

        if not is_initialized():
            raise RuntimeError(
                "shard_indices needs rank= and world_size=, or an initialised default process "
                "group to take them from (init_process_group)."
            )
        rank = get_rank() if rank is None else rank
        world_size = get_world_size() if world_size is None else world_size
    size = read_int(world_size, "world_size", minimum=1)
    me = read_int(rank, "rank", minimum=0)
    if me >= size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {size}), got {me}.")
    shuffled = read_bool(shuffle, "shuffle")
    start = read_int(seed, "seed") + read_int(epoch, "epoch", minimum=0)
    if start < 0:  # torch's manual_seed: a negative seed is its 64-bit two's complement
        start %= _SEED_MODULUS
    cut = read_bool(drop_last, "drop_last")
    per_rank = count // size if cut else -(-count // size)  # torch's num_samples
    total = per_rank * size
    order = (
        np.random.default_rng(start).permutation(count) if shuffled else np.arange(count)
    ).astype(np.int64)
    if cut:
        order = order[:total]
    elif total > count and count:
        order = np.resize(order, total)  # repeats from the start, as torch pads
    return order[me:total:size]
