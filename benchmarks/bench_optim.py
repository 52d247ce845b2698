"""An optimizer step on 4 M parameters: ours on host arrays against torch's ``foreach`` Adam.

The parameters are a pytree of float32 arrays (a few large matrices and their small biases, 4 M
entries in all, as a small transformer block's); one step of :class:`cupy_parallel.optim.Adam`
on host arrays (``"host:1"``, the target row) and on NumPy arrays is timed against
``torch.optim.Adam(foreach=True)`` on the same values, in the same run, rounds alternating
(:func:`~cupy_parallel._tools.benchmarking.compare`); torch runs on one thread, as NumPy does.
Before timing, 3 steps of each are checked equal to torch's to 1e-5. SGD with momentum against
``torch.optim.SGD(foreach=True)`` is reported too. Target (issue 32): at most 1.0x torch's Adam.

Run ``python benchmarks/bench_optim.py [--quick] [--json PATH]``; ``run(quick)`` returns the
rows for ``cupy-parallel bench``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.devices import host_device_count, set_host_device_count
from cupy_parallel._src.optim.adam import Adam
from cupy_parallel._src.optim.sgd import SGD
from cupy_parallel._src.tree import leaves
from cupy_parallel._tools.benchmarking import compare, result, script_main

TARGET = 1.0


def _shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    width = 512 if quick else 1024  # 4 M parameters (and 6 K of biases) at full size, 1 M quick
    return {
        "attention.qkv.w": (width, 2 * width),
        "attention.qkv.b": (2 * width,),
        "attention.out.w": (width, width),
        "attention.out.b": (width,),
        "mlp.up.w": (width, width),
        "mlp.up.b": (width,),
        "mlp.down.b": (width,),
        "norm.scale": (width,),
    }


def _values(quick: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in _shapes(quick).items()}


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


def _ours(make: Any, params: dict[str, Any], grads: dict[str, Any]) -> Any:
    opt = make(params)
    return lambda: opt.step(grads)


def _theirs(torch: Any, make: Any, values: dict[str, np.ndarray], grads: dict[str, Any]) -> Any:
    tensors = [torch.from_numpy(v.copy()) for v in leaves(values)]
    for t, g in zip(tensors, leaves(grads), strict=True):
        t.grad = torch.from_numpy(g)
    opt = make(tensors)
    return opt.step, tensors


def _check(torch: Any, quick: bool) -> None:
    """Three steps of ours (host arrays) and torch's agree to 1e-5 (the float32 tolerance)."""
    values, grads = _values(quick, 0), _values(quick, 1)
    params = {k: to_device(v, "host:1") for k, v in values.items()}
    host_grads = {k: to_device(g, "host:1") for k, g in grads.items()}
    ours = _ours(lambda p: Adam(p, lr=1e-3, weight_decay=0.01), params, host_grads)
    theirs, tensors = _theirs(
        torch,
        lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01, foreach=True),
        values,
        grads,
    )
    for _ in range(3):
        ours()
        theirs()
    for mine, t in zip(leaves(params), tensors, strict=True):
        np.testing.assert_allclose(to_device(mine, "cpu"), t.numpy(), rtol=1e-5, atol=1e-6)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Time the steps and return the rows."""
    torch = _torch()
    if torch is None:
        raise RuntimeError("bench_optim compares against torch.optim: pip install torch (CPU).")
    if host_device_count() < 2:
        set_host_device_count(2)
    _check(torch, quick)
    values, grads = _values(quick, 0), _values(quick, 1)
    count = sum(v.size for v in values.values())
    rounds = 5 if quick else 15
    rows = []
    cases = [
        (
            "Adam step, host arrays vs torch Adam(foreach=True)",
            "host:1",
            lambda p: Adam(p, lr=1e-3),
            lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
            TARGET,
        ),
        (
            "Adam step, NumPy arrays vs torch Adam(foreach=True)",
            "cpu",
            lambda p: Adam(p, lr=1e-3),
            lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
            None,
        ),
        (
            "AdamW amsgrad step, host arrays vs torch AdamW(foreach=True)",
            "host:1",
            lambda p: Adam(p, lr=1e-3, amsgrad=True, decoupled_weight_decay=True),
            lambda p: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, foreach=True),
            None,
        ),
        (
            "SGD momentum step, host arrays vs torch SGD(foreach=True)",
            "host:1",
            lambda p: SGD(p, lr=1e-3, momentum=0.9),
            lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True),
            None,
        ),
    ]
    for name, device, ours_make, theirs_make, target in cases:
        params = {k: to_device(v, device) for k, v in values.items()}
        placed_grads = {k: to_device(g, device) for k, g in grads.items()}
        ours = _ours(ours_make, params, placed_grads)
        theirs, _ = _theirs(torch, theirs_make, values, grads)
        timing = compare(ours, theirs, rounds=rounds, warmup=2)
        rows.append(
            {
                **result(name, timing.seconds, timing.baseline_seconds, target),
                "goal": "<= 1.0x torch's foreach Adam" if target else "reported",
                "spread": timing.spread,
                "paired_median_ratio": timing.ratio,
                "parameters": count,
                "bytes": 4 * count,
            }
        )
    return rows


if __name__ == "__main__":
    script_main(run, "bench_optim", __doc__.splitlines()[0])
