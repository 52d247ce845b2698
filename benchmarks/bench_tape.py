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

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import ops
from cupy_parallel._src.tape import Tape
from cupy_parallel._tools.benchmarking import result, script_main

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
        result(
            "tape chain: forward + gradient per op vs NumPy alone (no tape)",
            tape_total,
            per_op["numpy"],
            None,
        )
    ]
    if torch is not None:
        rows += [
            result(
                f"tape chain: forward + gradient per op vs PyTorch {torch.__version__} autograd",
                tape_total,
                best_total["torch"] / STEPS,
                1.5,
            ),
            result(
                "tape chain: recording forward per op vs PyTorch",
                per_op["fwd"],
                per_op["torch_fwd"],
                None,
            ),
            result(
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

    measured = train_step_benchmark(quick)
    if not measured["max_grad_diff"] < 1e-10:
        raise AssertionError(
            f"data-parallel gradients differ from one device's by {measured['max_grad_diff']}"
        )
    batch, (features, hidden, outputs) = measured["batch"], measured["sizes"]
    return [
        measured["timing"].row(
            f"data_parallel MLP train step ({batch}x{features}->{hidden}->{outputs}) on "
            f"{len(measured['devices'])} {measured['platform']} devices vs one device",
            2.0,
            max_grad_diff=measured["max_grad_diff"],
        )
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    """Rows for ``cupy-parallel bench``: part (a) then part (b)."""
    return chain_rows(quick) + data_parallel_rows(quick)


def main() -> None:
    script_main(
        run, "bench_tape", __doc__.splitlines()[0], quick_help="fewer repeats, a smaller MLP"
    )


if __name__ == "__main__":
    main()
