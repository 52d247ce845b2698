"""The per-operation overhead of a host array over plain NumPy, on 1-element arrays.

A :class:`~cupy_parallel.HostArray` checks every operand's device and wraps every result, which
costs a constant per operation; 1-element float64 arrays make that constant the whole cost.
Each row times a loop of the same operation on host arrays and on plain NumPy arrays, in the same
run, alternating the two and keeping the fastest repeat (the usual estimate for microbenchmarks
on a shared machine); results are checked equal. The target is at most 4x NumPy (issue 9; the
ndarray-subclass HostArray took 12x).

Run ``python benchmarks/bench_hostarray.py [--quick] [--json PATH]``; ``run(quick)`` returns the
rows for ``cupy-parallel bench``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.benchmarking import result, script_main

if TYPE_CHECKING:
    from collections.abc import Callable

LOOP = 2000
TARGET = 4.0

OPERATIONS: dict[str, Callable[[Any, Any], Any]] = {
    "x * y (Python operator)": lambda x, y: x * y,
    "np.multiply(x, y) (ufunc call)": np.multiply,
    "x + 1.5 (scalar operand)": lambda x, y: x + 1.5,
    "np.exp(x) (unary ufunc)": lambda x, y: np.exp(x),
    "x.sum() (reduction method)": lambda x, y: x.sum(),
}


def _loop(operation: Callable[[Any, Any], Any], x: Any, y: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    for _ in range(LOOP):
        z = operation(x, y)
    return time.perf_counter() - start, z


def run(quick: bool) -> list[dict[str, Any]]:
    """One row per operation: seconds per operation on host arrays vs plain NumPy."""
    repeats = 5 if quick else 25
    x, y = np.array([1.25]), np.array([0.5])
    hx, hy = to_device(x, "host:0"), to_device(y, "host:0")
    rows = []
    for name, operation in OPERATIONS.items():
        best_host = best_numpy = np.inf
        for _ in range(repeats + 1):  # the first round warms up
            seconds, host_result = _loop(operation, hx, hy)
            best_host = min(best_host, seconds)
            seconds, numpy_result = _loop(operation, x, y)
            best_numpy = min(best_numpy, seconds)
        got = to_device(host_result, "cpu")
        if got.tobytes() != np.asarray(numpy_result).tobytes():
            raise AssertionError(f"{name}: host array gave {got}, NumPy {numpy_result}")
        rows.append(
            result(
                f"host array per-op overhead: {name}, 1 float64 element, vs NumPy",
                best_host / LOOP,
                best_numpy / LOOP,
                TARGET,
            )
        )
    return rows


def main() -> None:
    script_main(run, "bench_hostarray", __doc__.splitlines()[0], quick_help="fewer repeats")


if __name__ == "__main__":
    main()
