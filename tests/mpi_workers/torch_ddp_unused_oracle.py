"""torch's DDP with ``find_unused_parameters=True`` on gloo processes: who gets ``.grad is None``.

``python torch_ddp_unused_oracle.py WORLD out.npz``: every rank holds three float64 parameters
``a``, ``b``, ``c`` (ones, shape (3,)) and runs ``STEPS`` backward passes of :func:`uses`'
pattern on ``x = arange(3) + rank + step`` (``loss = sum(a x) [+ sum(b x**2)] [+ sum(c x**3)]``),
``.grad`` set to ``None`` before each. Rank 0 writes ``{name}_{step}_{rank}`` for every
gradient that is not ``None`` (a missing key: ``None``). The oracle of
``tests/test_edges_fourth_pass.py``; needs torch, not a dependency of the library.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

STEPS = 2


def uses(name: str, rank: int, step: int) -> bool:
    """Whether rank ``rank`` uses parameter ``name`` in step ``step``.

    ``a`` always; ``b`` on the even ranks (some ranks); ``c`` nowhere in step 0 and on rank 1
    only in step 1 (so its usage changes between passes).
    """
    if name == "a":
        return True
    if name == "b":
        return rank % 2 == 0
    return step == 1 and rank == 1


def _rank(rank: int, world: int, out: str, store: str) -> None:
    import torch
    import torch.distributed as tdist

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in "abc":
                self.register_parameter(
                    name, torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
                )

        def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
            loss = torch.zeros((), dtype=torch.float64)
            for power, name in enumerate("abc", start=1):
                if uses(name, rank, step):
                    loss = loss + (getattr(self, name) * x**power).sum()
            return loss

    tdist.init_process_group("gloo", f"file://{store}", rank=rank, world_size=world)
    model = Model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    found: dict[str, np.ndarray] = {}
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        x = torch.arange(3, dtype=torch.float64) + rank + step
        ddp(x, step).backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                found[f"{name}_{step}_{rank}"] = p.grad.numpy().copy()
    gathered: list[object] = [None] * world
    tdist.all_gather_object(gathered, found)
    if rank == 0:
        np.savez(out, **{k: v for entry in gathered for k, v in entry.items()})  # type: ignore[attr-defined]
    tdist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    world, out = int(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous: no port to race for
        mp.spawn(_rank, args=(world, out, os.path.join(tmp, "store")), nprocs=world)


if __name__ == "__main__":
    main()
