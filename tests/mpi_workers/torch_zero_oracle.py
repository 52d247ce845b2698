"""torch's ZeroRedundancyOptimizer on gloo (CPU processes): the oracle of tests/test_zero.py.

``python torch_zero_oracle.py case.npz out.npz``: ``case.npz`` holds ``world``, ``steps``, the
initial parameters ``p0..`` (float64), the group of each (``group``), and per step and parameter
an additive term ``noise_{step}_{i}``; the gradient of parameter ``i`` at a step is
``scale[i] * p + noise`` (elementwise: the same IEEE operations in NumPy). Every rank runs
``ZeroRedundancyOptimizer(groups, AdamW, lr=.., amsgrad=True)`` with weight decay on group 0
only; rank 0 writes the final parameters, each rank's local parameters (indices, in its local
optimizer's order) and the consolidated state dict into ``out.npz``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported when the oracle runs (the suite collects this file)
    import torch

LR = 0.01


def _where(params: list[torch.Tensor], p: torch.Tensor) -> int:
    return next(i for i, q in enumerate(params) if q is p)  # by identity (== compares values)


def _rank(rank: int, world: int, case: dict[str, np.ndarray], out: str, store: str) -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    tdist.init_process_group("gloo", f"file://{store}", rank=rank, world_size=world)
    count = int(case["count"])
    params = [torch.nn.Parameter(torch.from_numpy(case[f"p{i}"].copy())) for i in range(count)]
    group = case["group"].tolist()
    groups = [
        {"params": [p for p, g in zip(params, group, strict=True) if g == 0], "weight_decay": 0.1},
        {"params": [p for p, g in zip(params, group, strict=True) if g == 1], "weight_decay": 0.0},
    ]
    zero = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=LR, amsgrad=True)
    for step in range(int(case["steps"])):
        for i, p in enumerate(params):
            noise = torch.from_numpy(case[f"noise_{step}_{i}"])
            p.grad = p.detach() * float(case["scale"][i]) + noise
        zero.step()
    local = [[_where(params, p) for p in g["params"]] for g in zero.optim.param_groups]
    owned: list[object] = [None] * world
    tdist.all_gather_object(owned, local)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        sd = zero.state_dict()
        # the global order of the state dict: group 0's parameters, then group 1's
        order = [_where(params, p) for g in groups for p in g["params"]]
        saved = {f"final{i}": p.detach().numpy() for i, p in enumerate(params)}
        for index, entry in sd["state"].items():
            for key, value in entry.items():
                saved[f"state_{order[index]}_{key}"] = np.asarray(value)
        for r, groups_of_rank in enumerate(owned):
            for g, indices in enumerate(groups_of_rank):  # type: ignore[attr-defined]
                saved[f"owned_{r}_{g}"] = np.asarray(indices, dtype=np.int64)
        np.savez(out, **saved)
    tdist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    case = dict(np.load(sys.argv[1]))
    world = int(case["world"])
    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous: no port to race for
        store = os.path.join(tmp, "store")
        mp.spawn(_rank, args=(world, case, sys.argv[2], store), nprocs=world)


if __name__ == "__main__":
    main()
