"""The tape's per-operation overhead, and a data-parallel train step, against their baselines.

Part (a): a chain of 5,000 ops (``multiply`` and ``add`` alternating) on 1-element float64
arrays, recorded on a :class:`~cupy_parallel.Tape` and differentiated with ``gradient``. Per op,
against the same loop on plain NumPy without a tape and, when ``import torch`` works, against
PyTorch CPU autograd (the same chain on 1-element float64 tensors, ``torch.autograd.grad``)
timed in the same run. Targets: at most 1.0x PyTorch's forward+backward on NumPy arrays, 1.5x on
host-device arrays (``"host:1"``). Every configuration is run alternately and the fastest repeat
is kept (the usual estimate for microbenchmarks on a shared machine), timed in the process's CPU
time (:data:`_clock`); the gradients are checked against the closed form.

Part (a'): the price of higher order. The ops' vjps are written with ops, so that a gradient
taken under an outer tape is recorded there; on a first-order gradient (no outer tape) that must
cost at most 10% over vjps in raw NumPy. The baseline records the same chain with raw-NumPy
vjps (what the ops had before) and times ``gradient`` alone.

Part (b): one SGD step of a two-layer MLP with :func:`cupy_parallel.data_parallel` on 4 devices
vs the same step on one device (``bench_data_parallel.train_step_benchmark``), gradients checked
equal.

Run ``python benchmarks/bench_tape.py [--quick] [--json PATH]``; ``run(quick)`` returns the rows
for ``cupy-parallel bench``.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import ops
from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.devices import Device, devices, set_host_device_count
from cupy_parallel._src.recording import active_tapes, record_binary
from cupy_parallel._src.tape import Tape
from cupy_parallel._tools.benchmarking import result, script_main

if TYPE_CHECKING:
    from collections.abc import Callable

_clock = time.process_time
"""The chains are timed in CPU time of this process: on a shared machine, wall time also counts
the slices other processes run in (minima of wall times swung by 20-40% on 2 busy cores)."""

STEPS = 5000
FACTOR, OFFSET = 1.0001, 0.001


def _numpy_chain(x: Any, factor: Any, offset: Any) -> Any:
    y = x
    for i in range(STEPS):
        y = y * factor if i % 2 == 0 else y + offset
    return y


def _tape_chain(x: Any, factor: Any, offset: Any) -> tuple[float, float, Any]:
    start = _clock()
    with Tape() as tape:
        tape.watch(x)
        y = x
        for i in range(STEPS):
            y = ops.multiply(y, factor) if i % 2 == 0 else ops.add(y, offset)
    middle = _clock()
    grad = tape.gradient(y, x)
    return middle - start, _clock() - middle, grad


def _raw_multiply_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: None) -> Any:
    (g,), (a, b) = gs, xs
    return (_raw_fit(g * b, a) if needs[0] else None, _raw_fit(g * a, b) if needs[1] else None)


def _raw_add_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: None) -> Any:
    (g,), (a, b) = gs, xs
    return (_raw_fit(g, a) if needs[0] else None, _raw_fit(g, b) if needs[1] else None)


def _raw_fit(g: Any, x: Any) -> Any:
    """The checks the first-order-only vjps made (shape and dtype), in raw NumPy."""
    if g.shape != x.shape:
        g = g.sum(axis=tuple(range(g.ndim - x.ndim))).reshape(x.shape)
    return g if g.dtype == x.dtype else g.astype(x.dtype)


def _raw_op(ufunc: Any, vjp: Any, a: Any, b: Any) -> Any:
    z = ufunc(a, b)
    if active_tapes():
        record_binary(vjp, a, b, z, None)
    return z


def _raw_vjp_chain(x: Any, factor: Any, offset: Any) -> tuple[float, float, Any]:
    """The chain recorded with raw-NumPy vjps: first order only (the baseline of part a')."""
    start = _clock()
    with Tape() as tape:
        tape.watch(x)
        y = x
        for i in range(STEPS):
            y = (
                _raw_op(np.multiply, _raw_multiply_vjp, y, factor)
                if i % 2 == 0
                else _raw_op(np.add, _raw_add_vjp, y, offset)
            )
    middle = _clock()
    grad = tape.gradient(y, x)
    return middle - start, _clock() - middle, grad


def _torch_chain(torch: Any) -> Callable[[], tuple[float, float, Any]]:
    x = torch.full((1,), 1.5, dtype=torch.float64, requires_grad=True)
    factor = torch.full((1,), FACTOR, dtype=torch.float64)
    offset = torch.full((1,), OFFSET, dtype=torch.float64)

    def chain() -> tuple[float, float, Any]:
        start = _clock()
        y = x
        for i in range(STEPS):
            y = y * factor if i % 2 == 0 else y + offset
        middle = _clock()
        (grad,) = torch.autograd.grad(y, x)
        return middle - start, _clock() - middle, grad.numpy()

    return chain


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


def _best(
    chain: Callable[[Any, Any, Any], tuple[float, float, Any]], arrays: tuple[Any, ...], best: Any
) -> None:
    # As timeit does, the cyclic garbage collector is off while a chain runs: a collection
    # scans every object of the process, so its cost depends on what ran before (other suites,
    # an imported torch) and made identical runs differ by 50 %.
    gc.collect()
    gc.disable()
    try:
        fwd, bwd, grad = chain(*arrays)
    finally:
        gc.enable()
    np.testing.assert_allclose(to_device(grad, "cpu"), [EXPECTED], rtol=1e-12)
    best[0], best[1], best[2] = min(best[0], fwd), min(best[1], bwd), min(best[2], fwd + bwd)


EXPECTED = FACTOR ** (STEPS // 2 + STEPS % 2)


def chain_rows(quick: bool) -> list[dict[str, Any]]:
    """Part (a): per-op seconds of the recorded chain vs NumPy alone and vs PyTorch."""
    repeats = 5 if quick else 15
    numpy_arrays = (np.array([1.5]), np.array([FACTOR]), np.array([OFFSET]))
    if Device("host", 1) not in devices():
        set_host_device_count(2)
    host_arrays = tuple(to_device(a, "host:1") for a in numpy_arrays)
    torch = _import_torch()
    torch_chain = _torch_chain(torch) if torch is not None else None
    # [forward, gradient, total] of each configuration, fastest repeat
    best = {k: [np.inf] * 3 for k in ("numpy", "tape", "host", "raw_vjps", "torch")}
    for _ in range(repeats + 1):  # the first round warms up
        start = _clock()
        _numpy_chain(*numpy_arrays)
        best["numpy"][2] = min(best["numpy"][2], _clock() - start)
        _best(_tape_chain, numpy_arrays, best["tape"])
        _best(_raw_vjp_chain, numpy_arrays, best["raw_vjps"])
        _best(_tape_chain, host_arrays, best["host"])
        if torch_chain is not None:
            _best(lambda *_: torch_chain(), (), best["torch"])
    per_op = {k: [v / STEPS for v in values] for k, values in best.items()}
    rows = [
        result(
            "tape chain: forward + gradient per op vs NumPy alone (no tape)",
            per_op["tape"][2],
            per_op["numpy"][2],
            None,
        ),
        result(
            "tape chain: gradient per op, vjps written with ops (higher order) vs raw NumPy vjps",
            per_op["tape"][1],
            per_op["raw_vjps"][1],
            1.1,
        ),
    ]
    if torch is None:
        print(
            "bench_tape: PyTorch is not installed; the rows against PyTorch autograd are left "
            "out (pip install torch).",
            file=sys.stderr,
        )
    else:
        version = torch.__version__
        rows += [
            result(
                f"tape chain: forward + gradient per op vs PyTorch {version} autograd",
                per_op["tape"][2],
                per_op["torch"][2],
                1.0,
            ),
            result(
                f"tape chain on host:1 arrays: forward + gradient per op vs PyTorch {version}",
                per_op["host"][2],
                per_op["torch"][2],
                1.5,
            ),
            result(
                "tape chain: recording forward per op vs PyTorch",
                per_op["tape"][0],
                per_op["torch"][0],
                None,
            ),
            result(
                "tape chain: gradient per op vs PyTorch backward",
                per_op["tape"][1],
                per_op["torch"][1],
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
