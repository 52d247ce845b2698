"""Store PyTorch's derivatives of the op cases and of seeded random op graphs.

Run ``python tests/make_torch_oracle.py`` (needs PyTorch) after changing ``tests/torch_oracle.py``;
it rewrites ``tests/data/torch_oracle.npz``, which ``tests/test_ops_torch.py`` compares against on
machines without PyTorch (CI installs only the project's test extra, and PyTorch's default wheel
pulls gigabytes of CUDA libraries).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import torch_oracle

ORACLE = Path(__file__).parent / "data" / "torch_oracle.npz"
GRAPH_SEEDS = range(150)
"""The seeds of the stored random graphs (``torch_oracle.seeded_graph``)."""


def main() -> None:
    """Evaluate every case and graph with PyTorch and write the oracle file."""
    import torch

    arrays: dict[str, np.ndarray] = {}
    for name, case in torch_oracle.CASES.items():
        xs = torch_oracle.case_inputs(name)
        result = torch_oracle.theirs(torch, case.theirs, xs, seed=0)
        arrays.update({f"case/{name}/{k}": v for k, v in result.arrays().items()})
    for seed in GRAPH_SEEDS:
        graph = torch_oracle.seeded_graph(seed)
        xs = torch_oracle.graph_inputs(graph, seed)
        result = torch_oracle.theirs(torch, torch_oracle.graph_functions(graph)[1], xs, seed)
        arrays.update({f"graph/{seed}/{k}": v for k, v in result.arrays().items()})
        arrays[f"graph/{seed}/key"] = np.array(graph.key())
    ORACLE.parent.mkdir(exist_ok=True)
    np.savez_compressed(ORACLE, **arrays)
    print(f"wrote {len(arrays)} arrays to {ORACLE}")


if __name__ == "__main__":
    main()
