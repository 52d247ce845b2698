"""gradcheck: low-precision inputs warn (PyTorch's rule), tolerances are validated, complex
numbers are checked as pairs of reals."""

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


# --------------------------------------------------------------------------------------------
# Complex numbers: each element is two reals, the real part and the imaginary part

C = np.array([0.5 - 0.25j, 2.0j, -1.0 + 0.5j])
Z = np.array([1.0 + 1.0j, -0.5 + 0.2j, 0.3 - 0.8j])
X = np.array([0.3, -0.7, 1.1])


class ForgetsTheConjugate(cupy_parallel.Function):
    """``z * C`` whose backward multiplies by ``C``, not by ``conj(C)`` (PyTorch's rule).

    Right wherever ``C`` is real; on complex ``C`` the gradient's imaginary part has the wrong sign.
    """

    @staticmethod
    def forward(ctx: Any, z: Any) -> Any:
        return z * C

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return g * C


class DropsTheImaginaryPart(cupy_parallel.Function):
    """``z * C`` whose backward keeps only the real part of the right gradient."""

    @staticmethod
    def forward(ctx: Any, z: Any) -> Any:
        return z * C

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return (g * np.conj(C)).real.astype(g.dtype)


COMPLEX_CASES = {
    "multiply": (lambda z: ops.multiply(z, C), [Z]),
    "real source, complex output": (lambda x: ops.multiply(x, C), [X]),
    "divide, two sources": (lambda z, x: ops.divide(z, ops.add(x, 2.0)), [Z, X]),
    "exp": (ops.exp, [Z]),
    "square": (ops.square, [Z]),
    "conj": (ops.conj, [Z]),
    "real part": (ops.real, [Z]),
    "imaginary part": (ops.imag, [Z]),
    "abs": (ops.abs, [Z]),
    "matmul": (lambda z: ops.matmul(ops.reshape(z, (1, 3)), ops.reshape(C, (3, 1))), [Z]),
}


@pytest.mark.parametrize("case", COMPLEX_CASES)
def test_complex_gradients_pass(case: str) -> None:
    fn, inputs = COMPLEX_CASES[case]
    assert gradcheck(fn, inputs)


@pytest.mark.parametrize("wrong", [ForgetsTheConjugate, DropsTheImaginaryPart])
def test_a_wrong_complex_gradient_is_caught_and_its_part_named(wrong: Any) -> None:
    with pytest.raises(GradcheckError, match=r"with respect to input 0 at \(\d,\) \((real|imag)"):
        gradcheck(wrong.apply, [Z])


def test_a_complex_input_beside_a_real_one_is_checked_too() -> None:
    """The case that passed before: the complex input was passed through, the output's
    imaginary part dropped with only NumPy's ComplexWarning, and gradcheck said True."""
    with pytest.raises(GradcheckError, match=r"with respect to input 1 at \(\d,\) \((real|imag)"):
        gradcheck(lambda x, z: ops.multiply(x, ForgetsTheConjugate.apply(z)), [X, Z])


def test_complex64_warns_and_is_checked_in_complex128_on_its_device() -> None:
    z = to_device(Z.astype(np.complex64), "host:1")
    seen = []

    def fn(z: Any) -> Any:
        seen.append((cupy_parallel.device_of(z), z.dtype))
        return ops.multiply(z, to_device(C, "host:1"))

    with pytest.warns(UserWarning, match="complex64.*complex128 copy"):
        assert gradcheck(fn, [z])
    assert set(seen) == {(cupy_parallel.as_device("host:1"), np.dtype(np.complex128))}
    with pytest.warns(UserWarning, match="complex64"), pytest.raises(GradcheckError):
        gradcheck(ForgetsTheConjugate.apply, [Z.astype(np.complex64)])


def test_torch_agrees_on_which_complex_gradients_are_right() -> None:
    """A second oracle: PyTorch's own gradcheck on the same functions (skipped without it)."""
    torch = pytest.importorskip("torch")

    def torch_gradcheck(backward: Any) -> bool:
        class Multiply(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, z: Any) -> Any:
                return z * torch.from_numpy(C)

            @staticmethod
            def backward(ctx: Any, g: Any) -> Any:
                return backward(g)

        z = torch.tensor(Z, requires_grad=True)
        return bool(torch.autograd.gradcheck(Multiply.apply, (z,), raise_exception=False))

    c = torch.from_numpy(C)
    assert torch_gradcheck(lambda g: g * c.conj())
    assert gradcheck(lambda z: ops.multiply(z, C), [Z])
    assert not torch_gradcheck(lambda g: g * c)
    with pytest.raises(GradcheckError):
        gradcheck(ForgetsTheConjugate.apply, [Z])
