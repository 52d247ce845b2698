"""gradcheck: low-precision inputs warn (PyTorch's rule), tolerances are validated."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupy_parallel
from cupy_parallel import GradcheckError, gradcheck, ops, to_device


class HalfSquare(cupy_parallel.Function):
    """``x**2`` whose backward is right in float64 but rounds through float16."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (x,) = ctx.saved_arrays
        return (2 * x * g).astype(np.float16).astype(x.dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_low_precision_inputs_warn_and_are_checked_in_float64(dtype: Any) -> None:
    x = np.array([0.3, -1.7], dtype)
    with pytest.warns(UserWarning, match=f"input 0 has dtype {np.dtype(dtype)}; finite"):
        assert gradcheck(lambda x: ops.tanh(ops.square(x)), [x])
    assert x.dtype == dtype  # the caller's array is not touched


def test_float32_input_still_catches_a_wrong_gradient() -> None:
    x = np.array([0.1234567, 1.7654321], np.float32)
    with (
        pytest.warns(UserWarning, match="float32"),
        pytest.raises(GradcheckError, match="with respect to input 0"),
    ):
        gradcheck(HalfSquare.apply, [x], atol=1e-7, rtol=1e-7)


def test_float32_host_array_warns_and_stays_on_its_device() -> None:
    x = to_device(np.array([0.5, 2.0], np.float32), "host:2")
    seen = []

    def fn(x: Any) -> Any:
        seen.append(cupy_parallel.device_of(x))
        return ops.exp(x)

    with pytest.warns(UserWarning, match="float32"):
        assert gradcheck(fn, [x])
    assert set(seen) == {cupy_parallel.as_device("host:2")}


def test_float64_inputs_do_not_warn() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gradcheck(ops.sqrt, [np.array([1.0, 4.0])])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"eps": 0.0}, ValueError, "eps must be a finite positive number, got 0.0"),
        ({"eps": -1e-6}, ValueError, "eps must be a finite positive number"),
        ({"eps": float("nan")}, ValueError, "eps must be a finite positive number, got nan"),
        ({"atol": -1e-5}, ValueError, "atol must be a finite non-negative number, got -1e-05"),
        ({"rtol": float("inf")}, ValueError, "rtol must be a finite non-negative number, got inf"),
        ({"atol": "1e-5"}, TypeError, "atol must be a real number, got str"),
        ({"rtol": True}, TypeError, "rtol must be a real number, got bool"),
        ({"eps": None}, TypeError, "eps must be a real number, got NoneType"),
    ],
    ids=[
        "eps-zero",
        "eps-negative",
        "eps-nan",
        "atol-negative",
        "rtol-inf",
        "atol-str",
        "rtol-bool",
        "eps-none",
    ],
)
def test_tolerances_are_validated(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        gradcheck(ops.exp, [np.ones(2)], **kwargs)


def test_zero_tolerances_and_integer_values_are_accepted() -> None:
    x = np.array([1.0, 2.0])
    assert gradcheck(lambda x: ops.multiply(x, 3.0), [x], atol=0, rtol=1e-6)
    with pytest.raises(GradcheckError, match=r"atol=0\.0, rtol=0\.0"):
        gradcheck(ops.exp, [x], atol=0, rtol=0)


def test_gradcheck_uses_no_underscored_tape_names() -> None:
    """gradcheck reads the tape through its internal, non-underscored interface."""
    import ast
    import inspect

    from cupy_parallel._src import gradcheck as module

    tree = ast.parse(inspect.getsource(module))
    imported = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cupy_parallel")
        for alias in node.names
    ]
    assert imported
    assert not [name for name in imported if name.startswith("_")]
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "_pullback" not in attributes
