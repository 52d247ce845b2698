"""Differentiable array operations: enough to write and train a multilayer perceptron.

Each op computes with its input's namespace (NumPy, or CuPy on the array's own GPU) and, when
the active :class:`~cupy_parallel.Tape` tracks an input, records its vector-Jacobian product
(``_<op>_vjp``, written right after the op), which maps the output gradient to input gradients.
Python and NumPy scalars are accepted as constants. Results are always arrays (NumPy's 0-d
results come back as 0-d arrays, not NumPy scalars, as in CuPy).

Recording is the hot path of a training step, so each op records itself directly
(``Tape._record_unary``/``_record_binary``) rather than through :class:`~cupy_parallel.Function`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
from numpy.lib.array_utils import normalize_axis_tuple

from cupy_parallel._src.arrays import array_namespace, is_array
from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.hostarray import HostArray
from cupy_parallel._src.tape import _ACTIVE, cuda_device

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "add",
    "divide",
    "exp",
    "log",
    "matmul",
    "mean",
    "multiply",
    "negative",
    "relu",
    "reshape",
    "square",
    "subtract",
    "sum",
    "tanh",
    "transpose",
]

_SCALARS = (int, float, complex, np.generic)
_ARRAYS = (np.ndarray, HostArray)  # computed by NumPy (HostArray through its dispatch)
_HOST = (*_ARRAYS, *_SCALARS)


def _compute(fn: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in the namespace of ``x`` (the placing operand), on its device."""
    if isinstance(x, _HOST):
        z = fn(*args, **kwargs)
        return z if isinstance(z, _ARRAYS) else np.asarray(z)
    device = cuda_device(x)
    if device is None:
        raise TypeError(
            f"ops.{fn.__name__} takes arrays (NumPy, HostArray, CuPy) or Python/NumPy scalars, "
            f"got {type(x).__name__}."
        )
    with device:
        return getattr(cupy_module(), fn.__name__)(*args, **kwargs)


def _binary(fn: Callable[..., Any], a: Any, b: Any) -> Any:
    x = b if isinstance(a, _SCALARS) else a
    if isinstance(x, _HOST):  # inlined fast path of _compute
        z = fn(a, b)
        return z if isinstance(z, _ARRAYS) else np.asarray(z)
    return _compute(fn, x, a, b)


def _require_array(x: Any, op: str) -> None:
    if not is_array(x):
        raise TypeError(f"ops.{op} takes an array, got {type(x).__name__}.")


def _fit(g: Any, x: Any) -> Any:
    """Reduce a broadcast gradient ``g`` to the shape and dtype of the input ``x``, as an array."""
    if g.shape != x.shape:
        lead = g.ndim - x.ndim
        axes = (*range(lead), *(lead + i for i, n in enumerate(x.shape) if n == 1))
        g = g.sum(axis=axes, keepdims=True).reshape(x.shape)
    elif not x.shape and isinstance(g, np.generic):  # NumPy gives scalars for 0-d results
        g = np.asarray(g)
    if g.dtype != x.dtype:
        g = g.astype(x.dtype)
    return g


def _spread(g: Any, x: Any, axes: tuple[int, ...]) -> Any:
    """The gradient of a reduction over ``axes``: ``g`` copied along them to ``x``'s shape."""
    kept = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    xp: Any = array_namespace(x)
    return _fit(xp.broadcast_to(g.reshape(kept), x.shape).copy(), x)


# --------------------------------------------------------------------------------------------
# Elementwise binary ops (NumPy broadcasting). A vjp gets the output gradients ``gs``, the
# inputs, which of them need a gradient, the outputs and the op's auxiliary data.

Args: TypeAlias = tuple[Any, ...]
Needs: TypeAlias = tuple[bool, ...]
Grads: TypeAlias = tuple[Any, ...]


def add(a: Any, b: Any, /) -> Any:
    """``a + b``, differentiable.

    Example:
        >>> cupy_parallel.ops.add(np.array([1.0, 2.0]), 1.0)
        array([2., 3.])
    """
    z = _binary(np.add, a, b)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_binary(_add_vjp, a, b, z, None)
    return z


def _add_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (_fit(g, a) if needs[0] else None, _fit(g, b) if needs[1] else None)


def subtract(a: Any, b: Any, /) -> Any:
    """``a - b``, differentiable.

    Example:
        >>> cupy_parallel.ops.subtract(np.array([1.0, 2.0]), np.array([0.5, 0.5]))
        array([0.5, 1.5])
    """
    z = _binary(np.subtract, a, b)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_binary(_subtract_vjp, a, b, z, None)
    return z


def _subtract_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (_fit(g, a) if needs[0] else None, _fit(-g, b) if needs[1] else None)


def multiply(a: Any, b: Any, /) -> Any:
    """``a * b`` elementwise, differentiable.

    Example:
        >>> cupy_parallel.ops.multiply(np.array([1.0, 2.0]), 3.0)
        array([3., 6.])
    """
    z = _binary(np.multiply, a, b)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_binary(_multiply_vjp, a, b, z, None)
    return z


def _multiply_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (_fit(g * b, a) if needs[0] else None, _fit(g * a, b) if needs[1] else None)


def divide(a: Any, b: Any, /) -> Any:
    """``a / b`` (true division), differentiable.

    Example:
        >>> cupy_parallel.ops.divide(np.array([1.0, 2.0]), 4.0)
        array([0.25, 0.5 ])
    """
    z = _binary(np.divide, a, b)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_binary(_divide_vjp, a, b, z, None)
    return z


def _divide_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b), (z,) = gs, xs, zs
    return (_fit(g / b, a) if needs[0] else None, _fit(-(g * z) / b, b) if needs[1] else None)


# --------------------------------------------------------------------------------------------
# Elementwise unary ops


def negative(x: Any, /) -> Any:
    """``-x``, differentiable.

    Example:
        >>> cupy_parallel.ops.negative(np.array([1.0, -2.0]))
        array([-1.,  2.])
    """
    z = _compute(np.negative, x, x)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_negative_vjp, x, z, None)
    return z


def _negative_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(-gs[0], xs[0]),)


def square(x: Any, /) -> Any:
    """``x ** 2``, differentiable.

    Example:
        >>> cupy_parallel.ops.square(np.array([1.0, -3.0]))
        array([1., 9.])
    """
    z = _compute(np.square, x, x)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_square_vjp, x, z, None)
    return z


def _square_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(gs[0] * (2 * xs[0]), xs[0]),)


def exp(x: Any, /) -> Any:
    """``e ** x``, differentiable.

    Example:
        >>> cupy_parallel.ops.exp(np.array([0.0, 1.0]))
        array([1.        , 2.71828183])
    """
    z = _compute(np.exp, x, x)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_exp_vjp, x, z, None)
    return z


def _exp_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(gs[0] * zs[0], xs[0]),)


def log(x: Any, /) -> Any:
    """Natural logarithm, differentiable.

    Example:
        >>> cupy_parallel.ops.log(np.array([1.0, np.e]))
        array([0., 1.])
    """
    z = _compute(np.log, x, x)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_log_vjp, x, z, None)
    return z


def _log_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(gs[0] / xs[0], xs[0]),)


def tanh(x: Any, /) -> Any:
    """Hyperbolic tangent, differentiable.

    Example:
        >>> cupy_parallel.ops.tanh(np.array([0.0]))
        array([0.])
    """
    z = _compute(np.tanh, x, x)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_tanh_vjp, x, z, None)
    return z


def _tanh_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    z = zs[0]
    return (_fit(gs[0] * (1 - z * z), xs[0]),)


def relu(x: Any, /) -> Any:
    """``max(x, 0)``, differentiable; the gradient at 0 is 0, as in PyTorch.

    Example:
        >>> cupy_parallel.ops.relu(np.array([-1.0, 2.0]))
        array([0., 2.])
    """
    z = _compute(np.maximum, x, x, 0)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_relu_vjp, x, z, None)
    return z


def _relu_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(gs[0] * (xs[0] > 0), xs[0]),)


# --------------------------------------------------------------------------------------------
# Linear algebra, reductions, shapes


def matmul(a: Any, b: Any, /) -> Any:
    """``a @ b`` with NumPy's rules (1-d operands, batch broadcasting), differentiable.

    Example:
        >>> cupy_parallel.ops.matmul(np.eye(2), np.array([1.0, 2.0]))
        array([1., 2.])
    """
    _require_array(a, "matmul")
    _require_array(b, "matmul")
    z = _compute(np.matmul, a, a, b)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_binary(_matmul_vjp, a, b, z, None)
    return z


def _matmul_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    # A 1-d ``a`` is a row matrix and a 1-d ``b`` a column matrix, as in matmul itself.
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g[..., None] if b.ndim == 1 else g
    g2 = g2[..., None, :] if a.ndim == 1 else g2
    ga = gb = None
    if needs[0]:
        ga = g2 @ b2.swapaxes(-1, -2)
        ga = _fit(ga[..., 0, :] if a.ndim == 1 else ga, a)
    if needs[1]:
        gb = a2.swapaxes(-1, -2) @ g2
        gb = _fit(gb[..., 0] if b.ndim == 1 else gb, b)
    return ga, gb


def _axes(x: Any, axis: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    return tuple(normalize_axis_tuple(axis, x.ndim, "axis"))


def sum(x: Any, /, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Any:
    """Sum over ``axis`` (all axes by default), differentiable.

    Example:
        >>> cupy_parallel.ops.sum(np.ones((2, 3)), axis=0)
        array([2., 2., 2.])
    """
    _require_array(x, "sum")
    axes = _axes(x, axis)
    z = _compute(np.sum, x, x, axis=axes, keepdims=keepdims)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_sum_vjp, x, z, axes)
    return z


def _sum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axes: tuple[int, ...]) -> Grads:
    return (_spread(gs[0], xs[0], axes),)


def mean(x: Any, /, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Any:
    """Mean over ``axis`` (all axes by default), differentiable.

    Example:
        >>> cupy_parallel.ops.mean(np.array([[1.0, 2.0], [3.0, 6.0]]), axis=1, keepdims=True)
        array([[1.5],
               [4.5]])
    """
    _require_array(x, "mean")
    axes = _axes(x, axis)
    count = math.prod(x.shape[i] for i in axes)
    if count == 0:
        raise ValueError(
            f"ops.mean over axis {axis} of an array of shape {x.shape} averages no elements."
        )
    z = _compute(np.mean, x, x, axis=axes, keepdims=keepdims)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_mean_vjp, x, z, (axes, count))
    return z


def _mean_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, int]) -> Grads:
    axes, count = aux
    return (_spread(gs[0] / count, xs[0], axes),)


def reshape(x: Any, /, shape: int | tuple[int, ...]) -> Any:
    """``x`` with a new shape (one entry may be -1), differentiable.

    Example:
        >>> cupy_parallel.ops.reshape(np.arange(4.0), (2, 2))
        array([[0., 1.],
               [2., 3.]])
    """
    _require_array(x, "reshape")
    z = _compute(np.reshape, x, x, shape)
    if (tape := _ACTIVE.get()) is not None:
        tape._record_unary(_reshape_vjp, x, z, None)
    return z


def _reshape_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (gs[0].reshape(xs[0].shape),)


def transpose(x: Any, /, axes: tuple[int, ...] | None = None) -> Any:
    """``x`` with its axes permuted (reversed by default), differentiable.

    Example:
        >>> cupy_parallel.ops.transpose(np.zeros((2, 3, 4)), (2, 0, 1)).shape
        (4, 2, 3)
    """
    _require_array(x, "transpose")
    z = _compute(np.transpose, x, x, axes)
    if (tape := _ACTIVE.get()) is not None:
        inverse = (
            None if axes is None else tuple(int(i) for i in np.argsort([i % z.ndim for i in axes]))
        )
        tape._record_unary(_transpose_vjp, x, z, inverse)
    return z


def _transpose_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, inverse: Any) -> Grads:
    return (gs[0].transpose(inverse),)
