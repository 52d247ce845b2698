"""The simulated ``cupy.ElementwiseKernel``: C's arithmetic on straight-line bodies, or a refusal.

The oracle is the C semantics spelled out per case (types of declared variables and outputs,
integer literals adapting, double literals promoting, ``?:``, NaN in ``max``), computed with
NumPy on the same values; every construct outside the simulated subset raises
``NotImplementedError`` rather than compute something else.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel.testing import simulated_cuda


def _on(device: int, values: np.ndarray) -> object:
    return cp.to_device(values, f"cuda:{device}")


def test_types_follow_c() -> None:
    x = np.array([1.0, 2.0, 3.0], np.float32)
    with simulated_cuda(1) as cupy:
        kernel = cupy.ElementwiseKernel(
            "T x, T a",
            "T y, float64 z, int32 n",
            "T half = x / 3; y = a * half + 2; z = 0.1 * x; n = x * 2.6f; y += 1;",
            "types",
        )
        y, z, n = cupy.empty(3, np.float32), cupy.empty(3, np.float64), cupy.empty(3, np.int32)
        kernel(_on(0, x), 0.7, y, z, n)
        half = (x / np.float32(3)).astype(np.float32)
        want_y = np.float32(0.7) * half + np.float32(2) + np.float32(1)
        np.testing.assert_array_equal(y.get(), want_y)  # float arithmetic stays float
        np.testing.assert_array_equal(z.get(), 0.1 * x.astype(np.float64))  # 0.1 is a double
        np.testing.assert_array_equal(n.get(), (x * np.float32(2.6)).astype(np.int32))


def test_ternary_logic_and_functions() -> None:
    v = np.array([1.0, np.nan, 3.0, -4.0])
    m = np.array([2.0, 1.0, np.nan, -5.0])
    with simulated_cuda(1) as cupy:
        kernel = cupy.ElementwiseKernel(
            "T v",
            "T m, T r, bool b",
            "r = (isnan(v) || v > m) ? v : m; m = max(m, v); b = !(v < 0) && isfinite(v);"
            "r = r - -sqrt(fabs(v)) * (1 + 2) / 3;",
            "logic",
        )
        mm, r, b = _on(0, m.copy()), cupy.empty(4), cupy.empty(4, np.bool_)
        kernel(_on(0, v), mm, r, b)
        chosen = np.where(np.isnan(v) | (v > m), v, m)
        np.testing.assert_array_equal(r.get(), chosen - -np.sqrt(np.abs(v)) * 3 / 3)
        np.testing.assert_array_equal(mm.get(), np.fmax(m, v))  # CUDA's max skips a NaN
        np.testing.assert_array_equal(b.get(), ~(v < 0) & np.isfinite(v))


def test_in_place_outputs_read_their_values_and_the_kernel_runs_on_the_current_device() -> None:
    with simulated_cuda(2) as cupy:
        axpy = cupy.ElementwiseKernel("T x, T a", "T y", "y = y + a * x;", "axpy")
        x, y = _on(1, np.arange(4.0)), _on(1, np.ones(4))
        with pytest.raises(ValueError, match="different from the current device"):
            axpy(x, 2.0, y)  # cuda:0 is current
        with cupy.cuda.Device(1):
            assert axpy(x, 2.0, y) is y
        np.testing.assert_array_equal(y.get(), 1 + 2 * np.arange(4.0))
        silent = cupy.ElementwiseKernel("T x", "T y", "y = x;", "copy", no_return=True)
        assert silent(cupy.ones(2), cupy.zeros(2)) is None
        as_tuple = cupy.ElementwiseKernel("T x", "T y", "y = x;", "copy", return_tuple=True)
        out = cupy.zeros(2)
        assert as_tuple(cupy.ones(2), out) == (out,)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("if (x > 0) y = x;", "control flow"),
        ("y = x; { y = 2; }", "control flow"),
        ("y = x[0];", "cannot read"),
        ("y = tanh(x);", "no function 'tanh'"),
        ("x = 1;", "'x' is an input param"),
        ("w = x;", "'w' is assigned but neither a param nor declared"),
        ("y = x +;", "expected more in 'x \\+'"),
        ("y = x + );", "expected an operand"),
        ("y = q;", "'q' is neither a param nor a variable"),
        ("y x;", "is not 'TYPE name = expr'"),
    ],
)
def test_unsupported_bodies_are_refused(body: str, match: str) -> None:
    def build_and_run(cupy: object) -> None:
        kernel = cupy.ElementwiseKernel("T x", "T y", body, "bad")  # type: ignore[attr-defined]
        kernel(cupy.ones(2), cupy.ones(2))  # type: ignore[attr-defined]

    with simulated_cuda(1) as cupy, pytest.raises(NotImplementedError, match=match):
        build_and_run(cupy)


def test_bad_calls_are_refused() -> None:
    with simulated_cuda(1) as cupy:
        kernel = cupy.ElementwiseKernel("T x", "T y", "y = x;", "copy")
        with pytest.raises(NotImplementedError, match="raw params are not simulated"):
            cupy.ElementwiseKernel("raw T x", "T y", "y = x[0];", "raw")
        with pytest.raises(NotImplementedError, match="pass every in and out param"):
            kernel(cupy.ones(2))
        with pytest.raises(TypeError, match="Type is mismatched"):
            kernel(cupy.ones(2), cupy.ones(2, np.float32))
        with pytest.raises(TypeError, match="a NumPy array"):
            kernel(np.ones(2), cupy.ones(2))
        with pytest.raises(ValueError, match="must be an array of the broadcast shape"):
            kernel(cupy.ones(3), cupy.ones(1))
