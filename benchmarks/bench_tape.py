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

Part (a''): one operation, as a user's step records it: a new tape, ``watch``, the op, and
``gradient`` with a given output gradient, for the element-wise ops, ``matmul`` and the
reductions on 4x4 float64 arrays, and a chain of 50 ops (``multiply`` and ``tanh`` alternating,
then ``sum``), against PyTorch doing the same (``requires_grad`` leaves, the op,
``torch.autograd.grad``), on NumPy and on host-device arrays. The garbage collector stays on
(as users run); each row is :func:`~cupy_parallel._tools.benchmarking.compare`'s median of
per-round ratios, the two alternating. Target: at most 1.0x PyTorch.

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
from cupy_parallel._tools.benchmarking import compare, result, script_main

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


SIZE = (4, 4)
ONE_OP_CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], bool]] = {
    # name: (our op, PyTorch's, whether both arguments are differentiated)
    "add": (ops.add, lambda x, y: x + y, True),
    "multiply": (ops.multiply, lambda x, y: x * y, True),
    "tanh": (lambda x, y: ops.tanh(x), lambda x, y: x.tanh(), False),
    "exp": (lambda x, y: ops.exp(x), lambda x, y: x.exp(), False),
    "matmul": (ops.matmul, lambda x, y: x @ y, True),
    "sum": (lambda x, y: ops.sum(x), lambda x, y: x.sum(), False),
    "mean over an axis": (lambda x, y: ops.mean(x, axis=0), lambda x, y: x.mean(0), False),
}
CHAIN = 50


def _one_op(op: Callable[..., Any], x: Any, y: Any, both: bool, seed: Any) -> Any:
    with Tape() as tape:
        tape.watch((x, y) if both else x)
        z = op(x, y)
    return tape.gradient(z, (x, y) if both else x, output_gradients=seed)


def _torch_one_op(torch: Any, op: Callable[..., Any], xy: Any, both: bool, seed: Any) -> Any:
    return torch.autograd.grad(op(*xy), xy if both else xy[:1], seed)


def _short_chain(x: Any) -> Any:
    with Tape() as tape:
        tape.watch(x)
        y = x
        for i in range(CHAIN):
            y = ops.multiply(y, x) if i % 2 == 0 else ops.tanh(y)
        total = ops.sum(y)
    return tape.gradient(total, x)


def _torch_short_chain(torch: Any, x: Any) -> Any:
    y = x
    for i in range(CHAIN):
        y = y * x if i % 2 == 0 else y.tanh()
    return torch.autograd.grad(y.sum(), (x,))


def one_op_rows(quick: bool) -> list[dict[str, Any]]:
    """Part (a''): one recorded op (or a 50-op chain), forward + gradient, vs PyTorch."""
    torch = _import_torch()
    if torch is None:
        return []  # chain_rows said so
    if Device("host", 1) not in devices():
        set_host_device_count(2)
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.1, 0.9, SIZE), rng.uniform(0.1, 0.9, SIZE)
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (a, b))
    rounds, number = (7, 100) if quick else (21, 300)
    rows = []
    for kind, device in (("NumPy", "cpu"), ("host:1", "host:1")):
        x, y = to_device(a, device), to_device(b, device)
        for name, (op, torch_op, both) in ONE_OP_CASES.items():
            shape = op(a, b).shape
            seed, torch_seed = (
                to_device(np.ones(shape), device),
                torch.ones(shape, dtype=torch.float64),
            )
            grads = _one_op(op, x, y, both, seed)
            expected = _torch_one_op(torch, torch_op, (ta, tb), both, torch_seed)
            for ours, theirs in zip(grads if both else (grads,), expected, strict=True):
                np.testing.assert_allclose(to_device(ours, "cpu"), theirs.numpy(), rtol=1e-12)
            timing = compare(
                lambda op=op, x=x, y=y, both=both, seed=seed: _one_op(op, x, y, both, seed),
                lambda op=torch_op, both=both, seed=torch_seed: _torch_one_op(
                    torch, op, (ta, tb), both, seed
                ),
                rounds=rounds,
                number=number,
            )
            rows.append(timing.row(f"one op on {kind}: {name}, forward + gradient vs PyTorch", 1.0))
        np.testing.assert_allclose(
            to_device(_short_chain(x), "cpu"), _torch_short_chain(torch, ta)[0].numpy(), rtol=1e-12
        )
        timing = compare(
            lambda x=x: _short_chain(x),
            lambda: _torch_short_chain(torch, ta),
            rounds=rounds,
            number=max(number // CHAIN, 3),
        )
        rows.append(timing.row(f"{CHAIN}-op chain on {kind}: forward + gradient vs PyTorch", 1.0))
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
    """Rows for ``cupy-parallel bench``: parts (a), (a') and (a''), then part (b)."""
    return chain_rows(quick) + one_op_rows(quick) + data_parallel_rows(quick)


def main() -> None:
    script_main(
        run, "bench_tape", __doc__.splitlines()[0], quick_help="fewer repeats, a smaller MLP"
    )


if __name__ == "__main__":
    main()
