"""Run by ``mpiexec -n 4 python checkpoint_worker.py DIR`` (or on 4 thread ranks): resharding.

A state with arrays sharded along dim 0 (``Shard``; uneven splits, a rank with no rows, a dtype
safetensors lacks), replicated arrays (a 0-d one) and Python values is saved by the 4 ranks and
loaded on groups of 2 and 3 ranks; then saved by 2 ranks and loaded by 4. Each load is compared
bit for bit with the NumPy arrays the state was cut from. Every rank prints ``rank r: OK case``
or ``rank r: BAD case: ...``.
"""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np

from cupy_parallel import distributed as dist
from cupy_parallel.distributed.checkpoint import Shard, load, save


def full_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((10, 3)),
        "emb": (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex128),
        "m": rng.standard_normal((7, 2)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
        "s": np.array(2.5),
    }


def rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """FSDP's even split: ceil(n / world) rows each, the last ranks short or empty."""
    per = -(-n // world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def state(rank: int, world: int, *, filled: bool) -> dict:
    full = full_arrays()

    def shard(name: str) -> Shard:
        start, stop = rows(full[name].shape[0], rank, world)
        local = full[name][start:stop].copy() if filled else np.zeros_like(full[name][start:stop])
        return Shard(local, start, full[name].shape)

    def plain(name: str) -> np.ndarray:
        return full[name].copy() if filled else np.zeros_like(full[name])

    return {
        "model": {"w": shard("w"), "emb": shard("emb"), "b": plain("b")},
        "optim": {
            "state": {0: {"step": 3.0 if filled else 0.0, "exp_avg": shard("m")}},
            "param_groups": [{"lr": 0.1 if filled else 0.0, "name": "adam" if filled else ""}],
        },
        "s": plain("s"),
    }


def same(loaded: dict, expected: dict) -> str | None:
    """Where two states differ (bits of every array, every value), or None."""
    for key in ("w", "emb"):
        a, b = loaded["model"][key], expected["model"][key]
        if (a.offset, a.local.dtype, a.local.tobytes()) != (
            b.offset,
            b.local.dtype,
            b.local.tobytes(),
        ):
            return f"model.{key}"
    a, b = loaded["optim"]["state"][0]["exp_avg"], expected["optim"]["state"][0]["exp_avg"]
    if a.local.tobytes() != b.local.tobytes():
        return "exp_avg"
    if loaded["model"]["b"].tobytes() != expected["model"]["b"].tobytes():
        return "model.b"
    if loaded["s"].tobytes() != expected["s"].tobytes() or loaded["s"].shape != ():
        return "s"
    if loaded["optim"]["state"][0]["step"] != 3.0 or loaded["optim"]["param_groups"] != [
        {"lr": 0.1, "name": "adam"}
    ]:
        return "values"
    return None


def check(rank: int, case: str, group, world: int, path: str) -> None:
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    r = dist.get_rank(group)
    target = state(r, world, filled=False)
    try:
        load(target, path, process_group=group)
        where = same(target, state(r, world, filled=True))
    except Exception:  # noqa: BLE001 - reported
        where = traceback.format_exc()
    print(
        f"rank {rank}: OK {case}" if where is None else f"rank {rank}: BAD {case}: {where}",
        flush=True,
    )


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(rank: int, argv: list[str]) -> int:
    """One rank's program (the world says which rank); see the module."""
    if not dist.is_initialized():  # spawn made the world already
        dist.init_process_group("mpi")
    rank, size = dist.get_rank(), dist.get_world_size()
    assert size == 4, "run on 4 ranks"
    root = argv[0]
    four = os.path.join(root, "four")
    save(state(rank, 4, filled=True), four)
    check(rank, "4->4", None, 4, four)
    check(rank, "4->2", dist.new_group([0, 1]), 2, four)
    check(rank, "4->3", dist.new_group([1, 2, 3]), 3, four)
    pair = dist.new_group([2, 3])
    two = os.path.join(root, "two")
    if pair is not dist.GroupMember.NON_GROUP_MEMBER:
        save(state(dist.get_rank(pair), 2, filled=True), two, process_group=pair)
    dist.barrier()
    check(rank, "2->4", None, 4, two)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
