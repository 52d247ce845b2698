"""torch's FSDP2 (``fully_shard``) over gloo on 2 CPU processes: ``tests/test_fsdp.py``'s oracle.

``python torch_fsdp_oracle.py``: trains a float64 MLP (weights from ``weights()``, the
same NumPy seed the test uses) for ``STEPS`` Adam steps, each rank on its half of the batch,
every ``Linear`` and the root sharded with ``fully_shard``, and prints ``RESULT`` and the full
parameters after each step as JSON (rank 0). Needs torch; not a dependency of the library.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile

import numpy as np

STEPS = 3
LR = 0.05
SIZES = (5, 7, 3)
N = 8


def weights() -> list[tuple[np.ndarray, np.ndarray]]:
    """(w, b) per layer, ``w`` shaped (in, out) as ``x @ w``."""
    rng = np.random.default_rng(11)
    return [(rng.normal(size=(a, b)), rng.normal(size=b)) for a, b in itertools.pairwise(SIZES)]


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(12)
    return rng.normal(size=(N, SIZES[0])), rng.normal(size=(N, SIZES[-1]))


def _rank(rank: int, world: int, store: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", f"file://{store}", rank=rank, world_size=world)
    layers = []
    for w, b in weights():
        linear = torch.nn.Linear(*w.shape).double()
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
        layers += [linear, torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data()
    rows = slice(rank * N // world, (rank + 1) * N // world)
    xs, ys = torch.from_numpy(x[rows]), torch.from_numpy(y[rows])
    history = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((model(xs) - ys) ** 2).mean()
        loss.backward()
        optimizer.step()
        full = [p.full_tensor().detach().numpy().tolist() for p in model.parameters()]
        history.append(full)
    if rank == 0:
        print("RESULT " + json.dumps(history), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous: no port to race for
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store")), nprocs=2)
