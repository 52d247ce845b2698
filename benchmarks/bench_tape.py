"""The tape's per-operation overhead, and a data-parallel train step, against their baselines.

Part (a): a chain of 5,000 ops (``multiply`` and ``add`` alternating) on 1-element float64 NumPy
arrays, recorded on a :class:`~cupy_parallel.Tape` and differentiated with ``gradient``. Per op,
against the same loop on plain NumPy without a tape and, when ``import torch`` works, against
PyTorch CPU autograd (the same chain on 1-element float64 tensors, ``torch.autograd.grad``)
timed in the same run. The target is at most 1.5x PyTorch's forward+backward. Every
configuration is run alternately and the fastest repeat is kept (the usual estimate for
microbenchmarks on a shared machine); the gradients are checked against the closed form.

Part (b): one SGD step of a two-layer MLP with :func:`cupy_parallel.data_parallel` on 4 devices
vs the same step on one device (``bench_data_parallel.train_step_benchmark``), gradients checked
equal.

Run ``python benchmarks/bench_tape.py [--quick] [--json PATH]``; ``run(quick)`` returns the rows
for ``cupy-parallel bench``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import ops
from cupy_parallel._src.tape import Tape

if TYPE_CHECKING:
    from collections.abc import Callable

STEPS = 5000
FACTOR, OFFSET = 1.0001, 0.001


def _numpy_chain(x: Any, factor: Any, offset: Any) -> Any:
    y = x
    for i in range(STEPS):
        y = y * factor if i % 2 == 0 else y + offset
    return y


def _tape_chain(x: Any, factor: Any, offset: Any) -> tuple[float, float, Any]:
    start = time.perf_counter()
    with Tape() as tape:
        tape.watch(x)
        y = x
        for i in range(STEPS):
            y = ops.multiply(y, factor) if i % 2 == 0 else ops.add(y, offset)
    middle = time.perf_counter()
    grad = tape.gradient(y, x)
    return middle - start, time.perf_counter() - middle, grad


def _torch_chain(torch: Any) -> Callable[[], tuple[float, float, Any]]:
    x = torch.full((1,), 1.5, dtype=torch.float64, requires_grad=True)
    factor = torch.full((1,), FACTOR, dtype=torch.float64)
    offset = torch.full((1,), OFFSET, dtype=torch.float64)

    def chain() -> tuple[float, float, Any]:
        start = time.perf_counter()
        y = x
        for i in range(STEPS):
            y = y * factor if i % 2 == 0 else y + offset
        middle = time.perf_counter()
        (grad,) = torch.autograd.grad(y, x)
        return middle - start, time.perf_counter() - middle, grad.numpy()

    return chain


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


def _row(name: str, seconds: float, baseline: float, target: float | None) -> dict[str, Any]:
    return {
        "name": name,
        "seconds": seconds,
        "baseline_seconds": baseline,
        "ratio": seconds / baseline,
        "target": target,
    }


def chain_rows(quick: bool) -> list[dict[str, Any]]:
    """Part (a): per-op seconds of the recorded chain vs NumPy alone and vs PyTorch."""
    repeats = 5 if quick else 15
    x = np.array([1.5])
    factor, offset = np.array([FACTOR]), np.array([OFFSET])
    torch = _import_torch()
    torch_chain = _torch_chain(torch) if torch is not None else None
    best = {"numpy": np.inf, "fwd": np.inf, "bwd": np.inf, "torch_fwd": np.inf, "torch_bwd": np.inf}
    best_total = {"tape": np.inf, "torch": np.inf}
    expected = FACTOR ** (STEPS // 2 + STEPS % 2)
    for _ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        _numpy_chain(x, factor, offset)
        best["numpy"] = min(best["numpy"], time.perf_counter() - start)
        fwd, bwd, grad = _tape_chain(x, factor, offset)
        np.testing.assert_allclose(grad, [expected], rtol=1e-12)
        best["fwd"], best["bwd"] = min(best["fwd"], fwd), min(best["bwd"], bwd)
        best_total["tape"] = min(best_total["tape"], fwd + bwd)
        if torch_chain is not None:
            fwd, bwd, grad = torch_chain()
            np.testing.assert_allclose(grad, [expected], rtol=1e-12)
            best["torch_fwd"], best["torch_bwd"] = (
                min(best["torch_fwd"], fwd),
                min(best["torch_bwd"], bwd),
            )
            best_total["torch"] = min(best_total["torch"], fwd + bwd)
    per_op = {k: v / STEPS for k, v in best.items()}
    tape_total = best_total["tape"] / STEPS
    rows = [
        _row(
            "tape chain: forward + gradient per op vs NumPy alone (no tape)",
            tape_total,
            per_op["numpy"],
            None,
        )
    ]
    if torch is not None:
        rows += [
            _row(
                f"tape chain: forward + gradient per op vs PyTorch {torch.__version__} autograd",
                tape_total,
                best_total["torch"] / STEPS,
                1.5,
            ),
            _row(
                "tape chain: recording forward per op vs PyTorch",
                per_op["fwd"],
                per_op["torch_fwd"],
                None,
            ),
            _row(
                "tape chain: gradient per op vs PyTorch backward",
                per_op["bwd"],
                per_op["torch_bwd"],
                None,
            ),
        ]
    return rows


def data_parallel_rows(quick: bool) -> list[dict[str, Any]]:
    """Part (b): a data-parallel MLP train step on 4 devices vs the same step on one."""
    from bench_data_parallel import train_step_benchmark

    result = train_step_benchmark(quick)
    if not result["max_grad_diff"] < 1e-10:
        raise AssertionError(
            f"data-parallel gradients differ from one device's by {result['max_grad_diff']}"
        )
    batch, (features, hidden, outputs) = result["batch"], result["sizes"]
    row = _row(
        f"data_parallel MLP train step ({batch}x{features}->{hidden}->{outputs}) on "
        f"{len(result['devices'])} {result['platform']} devices vs one device",
        result["data_parallel_s"],
        result["one_device_s"],
        2.0,
    )
    row["max_grad_diff"] = result["max_grad_diff"]
    return [row]


def run(quick: bool) -> list[dict[str, Any]]:
    """Rows for ``cupy-parallel bench``: part (a) then part (b)."""
    return chain_rows(quick) + data_parallel_rows(quick)


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'benchmark':<78} {'ours':>10} {'baseline':>10} {'ratio':>6} {'target':>6}"]
    for r in rows:
        scale, unit = (1e6, "us") if r["seconds"] < 1e-3 else (1e3, "ms")
        target = "-" if r["target"] is None else f"{r['target']:.2f}"
        lines.append(
            f"{r['name']:<78} {r['seconds'] * scale:>8.2f}{unit} "
            f"{r['baseline_seconds'] * scale:>8.2f}{unit} {r['ratio']:>6.2f} {target:>6}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a smaller MLP")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run(args.quick)
    print(_table(rows))
    print(json.dumps(rows, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
