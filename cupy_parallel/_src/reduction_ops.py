"""The ops that reduce over axes: matmul, mean, var, logsumexp, and the softmax family.

``softmax``, ``log_softmax`` and the loss built on them, ``softmax_cross_entropy``, take the
class axis last (``axis=-1``), as jax/optax do. ``var`` and ``softmax_cross_entropy`` are built
from the other ops (no vjp of their own). ``sum`` lives with the shape ops: every vjp's ``fit``
is built from it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arguments import read_axis, read_int
from cupy_parallel._src.arrays import is_array
from cupy_parallel._src.compute import named_kernel, run_kernel, run_on
from cupy_parallel._src.elementwise import (
    conj_if_complex,
    divide,
    exp,
    multiply,
    negative,
    real,
    square,
    subtract,
    where,
)
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer
from cupy_parallel._src.recording import active_tapes, record_binary, record_unary
from cupy_parallel._src.shape_ops import (
    fit,
    read_axes,
    refuse_complex,
    require_array,
    reshape,
    spread,
    sum,
    transpose,
)

if TYPE_CHECKING:
    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.shape_ops import Args, Grads, Needs

__all__ = [
    "log_softmax",
    "logsumexp",
    "matmul",
    "mean",
    "softmax",
    "softmax_cross_entropy",
    "var",
]


# --------------------------------------------------------------------------------------------
# Linear algebra, reductions


_matmul_kernel = named_kernel("matmul")


def matmul(a: Array, b: Array, /) -> Array:
    """``a @ b`` with NumPy's rules (1-d operands, batch broadcasting), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.matmul(np.eye(2), np.array([1.0, 2.0]))
        array([1., 2.])
    """
    if type(a) is np.ndarray and type(b) is np.ndarray:
        z = np.matmul(a, b)
        z = z if type(z) is np.ndarray else np.asarray(z)
    elif type(a) is HostArray and type(b) is HostArray and (device := a.device) is b.device:
        # what run_kernel does, without its checks: one device object (devices are interned;
        # another equal one takes run_kernel's path), as Device's == is a Python call (0.15 us)
        z = np.matmul(host_buffer(a), host_buffer(b))
        z = host_array(z if type(z) is np.ndarray else np.asarray(z), device)
    else:
        require_array(a, "matmul")
        require_array(b, "matmul")
        if type(a) is np.ndarray:  # with a host array: NumPy's dispatch refuses it, as CuPy does
            z = np.matmul(a, b)
            z = z if type(z) is np.ndarray else np.asarray(z)
        else:
            z = run_kernel(_matmul_kernel, a, a, b)
    if active_tapes():
        record_binary(_matmul_vjp, a, b, z, None)
    return z


def _swap_last(x: Any) -> Any:
    n = x.ndim
    return transpose(x) if n == 2 else transpose(x, (*range(n - 2), n - 1, n - 2))


def _matmul_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    if a.ndim == 2 and b.ndim == 2:  # matrices (the common case): no reshape, no batch axes
        return (
            fit(matmul(g, transpose(conj_if_complex(b))), a) if needs[0] else None,
            fit(matmul(transpose(conj_if_complex(a)), g), b) if needs[1] else None,
        )
    # A 1-d ``a`` is a row matrix and a 1-d ``b`` a column matrix, as in matmul itself.
    a2 = reshape(a, (1, a.shape[0])) if a.ndim == 1 else a
    b2 = reshape(b, (b.shape[0], 1)) if b.ndim == 1 else b
    g2 = g
    if a.ndim == 1 or b.ndim == 1:
        g2 = reshape(g, (*g.shape[: g.ndim - (b.ndim > 1)], 1) if b.ndim == 1 else g.shape)
        if a.ndim == 1:
            g2 = reshape(g2, (*g2.shape[:-1], 1, g2.shape[-1]))
    ga = gb = None
    if needs[0]:
        ga = matmul(g2, _swap_last(conj_if_complex(b2)))  # g b^H: conj for complex (torch)
        if a.ndim == 1:
            ga = reshape(ga, (*ga.shape[:-2], ga.shape[-1]))
        ga = fit(ga, a)
    if needs[1]:
        gb = matmul(_swap_last(conj_if_complex(a2)), g2)
        if b.ndim == 1:
            gb = reshape(gb, gb.shape[:-1])
        gb = fit(gb, b)
    return ga, gb


def _mean_kernel(xp: Any, x: Any, axis: Any, keepdims: bool) -> Any:
    return x.mean(axis, keepdims=keepdims)  # the method: numpy.mean is a Python wrapper


_mean_kernel.__name__ = "mean"


def mean(
    x: Array, /, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False
) -> Array:
    """Mean over ``axis`` (all axes by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.mean(np.array([[1.0, 2.0], [3.0, 6.0]]), axis=1, keepdims=True)
        array([[1.5],
               [4.5]])
    """
    require_array(x, "mean")
    axes = read_axes(x, axis)
    count = math.prod(x.shape[i] for i in axes)
    if count == 0:
        raise ValueError(
            f"ops.mean over axis {axis} of an array of shape {x.shape} averages no elements."
        )
    # positional: no keyword dicts (0.2 us); axes: read_axes' tuple of ints
    if type(keepdims) is bool:
        z = run_on(_mean_kernel, x, axes, keepdims)
    else:
        z = run_kernel(_mean_kernel, x, x, axes, keepdims)
    if active_tapes():
        record_unary(_mean_vjp, x, z, (axes, keepdims, count))
    return z


def _mean_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, ...]) -> Grads:
    axes, keepdims, count = aux
    return (spread(divide(gs[0], count), xs[0], axes, keepdims),)


def var(
    x: Array,
    /,
    axis: int | tuple[int, ...] | None = None,
    *,
    ddof: int = 0,
    keepdims: bool = False,
) -> Array:
    """Variance over ``axis`` with ``ddof`` delta degrees of freedom (NumPy's default 0).

    PyTorch's ``var`` defaults to the unbiased estimate (``correction=1``); pass ``ddof=1`` for
    it. A complex ``x`` has a real variance, the mean of ``|x - mean(x)| ** 2`` (NumPy's and
    PyTorch's). Built from differentiable ops, so differentiable to any order.

    Raises:
        ValueError: ``ddof`` leaves no degrees of freedom (``count - ddof <= 0``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.var(np.array([1.0, 2.0, 3.0, 4.0])), ops.var(np.array([1.0, 3.0]), ddof=1)
        (array(1.25), array(2.))
    """
    require_array(x, "var")
    ddof = read_int(ddof, "ddof", minimum=0)
    axes = read_axes(x, axis)
    count = math.prod(x.shape[i] for i in axes)
    if count - ddof <= 0:
        raise ValueError(
            f"ops.var over axis {axis} of an array of shape {x.shape} has {count} elements, "
            f"which leaves no degrees of freedom with ddof={ddof}."
        )
    deviation = subtract(x, mean(x, axes, keepdims=True))
    if deviation.dtype.kind == "c":
        squared = real(multiply(deviation, conj_if_complex(deviation)))
    else:
        squared = square(deviation)
    return divide(sum(squared, axes, keepdims=keepdims), count - ddof)


def _max_kernel(xp: Any, x: Any, axes: tuple[int, ...]) -> Any:
    m = x.max(axis=axes, keepdims=True)
    return xp.where(xp.isfinite(m), m, 0)


def _logsumexp_kernel(xp: Any, x: Any, axes: tuple[int, ...], keepdims: bool) -> Any:
    m = _max_kernel(xp, x, axes)
    z = xp.log(xp.exp(x - m).sum(axis=axes, keepdims=True)) + m
    return z if keepdims else z.reshape([n for i, n in enumerate(z.shape) if i not in axes])


def logsumexp(
    x: Array, /, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False
) -> Array:
    """``log(sum(exp(x)))`` over ``axis`` (all by default), computed stably, differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.logsumexp(np.array([1000.0, 1000.0]))
        array(1000.69314718)
    """
    require_array(x, "logsumexp")
    axes = read_axes(x, axis)
    if any(x.shape[i] == 0 for i in axes):
        raise ValueError(f"ops.logsumexp over axis {axis} of shape {x.shape} has no elements.")
    z = run_kernel(_logsumexp_kernel, x, x, axes, keepdims)
    if active_tapes():
        refuse_complex("logsumexp", z, (x,))
        record_unary(_logsumexp_vjp, x, z, (axes, keepdims))
    return z


def _logsumexp_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, bool]) -> Grads:
    (g,), (x,), (z,) = gs, xs, zs
    axes, keepdims = aux
    if not keepdims:
        kept = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        g, z = reshape(g, kept), reshape(z, kept)
    return (fit(multiply(g, exp(subtract(x, z))), x),)


def _softmax_kernel(xp: Any, x: Any, axis: int) -> Any:
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax_kernel(xp: Any, x: Any, axis: int) -> Any:
    s = x - x.max(axis=axis, keepdims=True)
    return s - xp.log(xp.exp(s).sum(axis=axis, keepdims=True))


def _class_axis(x: Any, axis: Any, op: str) -> int:
    require_array(x, op)
    if x.ndim == 0:
        raise ValueError(f"ops.{op} needs an array with at least one axis, got a 0-d array.")
    return read_axis(axis, x.ndim)


def softmax(x: Array, /, axis: int = -1) -> Array:
    """``exp(x) / sum(exp(x))`` along ``axis`` (the last by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.softmax(np.array([0.0, np.log(3.0)]))
        array([0.25, 0.75])
    """
    axis = _class_axis(x, axis, "softmax")
    z = run_kernel(_softmax_kernel, x, x, axis)
    if active_tapes():
        refuse_complex("softmax", z, (x,))
        record_unary(_softmax_vjp, x, z, axis)
    return z


def _softmax_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    (g,), (z,) = gs, zs
    return (fit(multiply(z, subtract(g, sum(multiply(g, z), axis, keepdims=True))), xs[0]),)


def log_softmax(x: Array, /, axis: int = -1) -> Array:
    """``x - logsumexp(x)`` along ``axis`` (the last by default), computed stably.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> np.exp(ops.log_softmax(np.array([0.0, np.log(3.0)])))
        array([0.25, 0.75])
    """
    axis = _class_axis(x, axis, "log_softmax")
    z = run_kernel(_log_softmax_kernel, x, x, axis)
    if active_tapes():
        refuse_complex("log_softmax", z, (x,))
        record_unary(_log_softmax_vjp, x, z, axis)
    return z


def _log_softmax_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    (g,), (z,) = gs, zs
    return (fit(subtract(g, multiply(exp(z), sum(g, axis, keepdims=True))), xs[0]),)


def _one_hot_kernel(xp: Any, labels: Any, classes: int) -> Any:
    return labels[..., None] == xp.arange(classes)


def _label_range_kernel(xp: Any, labels: Any) -> list[Any]:
    return [labels.min(), labels.max()]


_REDUCTIONS = ("mean", "sum", "none")


def softmax_cross_entropy(logits: Array, labels: Array, /, *, reduction: str = "mean") -> Array:
    """Cross-entropy of ``softmax(logits)`` against integer class ``labels``, differentiable.

    ``logits`` has classes on its last axis, shape ``(..., C)``; ``labels`` has shape ``(...)``
    and integer values in ``[0, C)`` on the same device. ``reduction`` is ``"mean"`` (default,
    as PyTorch's ``cross_entropy``), ``"sum"`` or ``"none"`` (one loss per label).

    Masked classes (logit ``-inf``, e.g. padding tokens) are allowed, as in PyTorch: a label's
    loss reads only its own class's log-probability, so it stays finite, and the masked
    classes get a zero gradient. A label whose own logit is ``-inf`` has probability 0 and
    loss ``inf`` (PyTorch's value too; its gradient stays finite); a row whose logits are all
    ``-inf`` has no distribution, and its loss and gradient are NaN, again as in PyTorch.

    Raises:
        TypeError: ``labels`` is not an integer array.
        ValueError: shapes disagree, a label is out of range, or ``reduction`` is unknown.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> logits = np.log(np.array([[1.0, 3.0], [1.0, 1.0]]))
        >>> ops.softmax_cross_entropy(logits, np.array([1, 0]))  # -(log(3/4) + log(1/2)) / 2
        array(0.49041463)
    """
    require_array(logits, "softmax_cross_entropy")
    if logits.ndim == 0 or logits.dtype.kind != "f":
        raise ValueError(
            "ops.softmax_cross_entropy needs floating-point logits with a class axis, got "
            f"shape {logits.shape} and dtype {logits.dtype}."
        )
    if not is_array(labels) or labels.dtype.kind not in "iu":
        kind = f"dtype {labels.dtype}" if is_array(labels) else type(labels).__name__
        raise TypeError(
            f"ops.softmax_cross_entropy needs integer class labels, got {kind}. "
            "Convert them with labels.astype(int)."
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"ops.softmax_cross_entropy needs labels of shape {logits.shape[:-1]} for logits of "
            f"shape {logits.shape} (classes on the last axis), got {labels.shape}."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    classes = logits.shape[-1]
    if labels.size:
        low, high = (int(v) for v in run_kernel(_label_range_kernel, labels, labels))
        if low < 0 or high >= classes:
            raise ValueError(
                f"ops.softmax_cross_entropy got a label {low if low < 0 else high} outside "
                f"[0, {classes}) for {classes} classes."
            )
    # The target's log-probability is picked with ``where``, not a product with a one-hot: a
    # masked class (logit -inf) has log-probability -inf, and -inf * 0 is NaN.
    target = run_kernel(_one_hot_kernel, logits, labels, classes)
    losses = negative(sum(where(target, log_softmax(logits), 0.0), -1))
    if reduction == "none":
        return losses
    return mean(losses) if reduction == "mean" else sum(losses)
