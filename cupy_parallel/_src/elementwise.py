"""The elementwise ops: two rule tables, one factory each, and ``relu``, ``where``, ``clip``.

A rule is the NumPy ufunc, its vjp and the op's docstring (HIPS autograd's ``defvjp``):
:func:`_unary_op` and :func:`_binary_op` make every op of :data:`_UNARY_RULES` and
:data:`_BINARY_RULES` from its rule (why generated ops are as fast as hand-written ones:
:mod:`cupy_parallel._src.ops`). Binary ops broadcast as NumPy does; their vjps ``fit`` each
gradient back to its input's shape.

Complex numbers follow PyTorch: the gradient of a real loss ``L`` with respect to a complex
``z`` is ``dL/dRe(z) + i dL/dIm(z)``, so the vjp of a holomorphic ``f`` is ``g * conj(f'(z))``
(:func:`conj_if_complex` in every product rule), ``abs``'s is ``g * z / |z|``, and ``real``,
``imag`` and ``conj`` pass ``g``, ``i g`` and ``conj(g)``. The ops whose gradient holds for
reals only (an order: ``maximum``, ``minimum``, ``relu``, ``clip``; ``power``) refuse complex
values when a tape records them (:data:`_REAL_ONLY`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import is_array
from cupy_parallel._src.compute import SCALARS, host_operand, named_kernel, run_kernel
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer, host_ufunc, host_unary
from cupy_parallel._src.recording import active_tapes, record, record_binary, record_unary
from cupy_parallel._src.shape_ops import fit, refuse_complex, require_array

if TYPE_CHECKING:
    from collections.abc import Callable

    from cupy_parallel._src.arrays import Array, Operand
    from cupy_parallel._src.shape_ops import Args, Grads, Needs

__all__ = [
    "abs",
    "add",
    "clip",
    "conj",
    "conj_if_complex",
    "divide",
    "exp",
    "imag",
    "log",
    "maximum",
    "minimum",
    "multiply",
    "negative",
    "power",
    "real",
    "relu",
    "sqrt",
    "square",
    "subtract",
    "tanh",
    "where",
]


_ndarray = np.ndarray
"""``np.ndarray`` as a module global: the generated ops test ``type(x) is _ndarray`` on every
call, inside vjps too, and one global lookup is cheaper than ``np.ndarray``'s two (measured
~60 ns a call, a few percent of a first-order gradient on small arrays)."""


# --------------------------------------------------------------------------------------------
# Elementwise ops from a rule table: name -> (ufunc, vjp, doc). A vjp gets the output gradients
# ``gs``, the inputs, which of them need a gradient, the outputs and the op's auxiliary data.


def conj_if_complex(x: Any) -> Any:
    """``conj(x)``, recorded, for a complex ``x``; ``x`` itself when it is real (no copy).

    The factor of every product rule: the vjp of a holomorphic op is ``g * conj(f'(z))``.
    """
    if type(x) is not _ndarray and type(x) is not HostArray and isinstance(x, SCALARS):
        return x.conjugate()  # (isinstance against SCALARS costs an array 70 ns: tested last)
    return conj(x) if x.dtype.kind == "c" else x


def _negative_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(negative(gs[0]), xs[0]),)


def _square_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(multiply(gs[0], multiply(conj_if_complex(xs[0]), 2.0)), xs[0]),)


def _exp_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(multiply(gs[0], conj_if_complex(zs[0])), xs[0]),)


def _log_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(divide(gs[0], conj_if_complex(xs[0])), xs[0]),)


def _tanh_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(multiply(gs[0], conj_if_complex(subtract(1.0, square(zs[0])))), xs[0]),)


def _sqrt_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(divide(gs[0], conj_if_complex(multiply(zs[0], 2.0))), xs[0]),)


def _positive_kernel(xp: Any, x: Any) -> Any:
    return x > 0


def _relu_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(multiply(gs[0], run_kernel(_positive_kernel, xs[0], xs[0])), xs[0]),)


_sign = named_kernel("sign")


def _nonzero_kernel(xp: Any, x: Any) -> Any:
    return x != 0


def _abs_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (x,), (z,) = gs, xs, zs
    if x.dtype.kind != "c":
        return (fit(multiply(g, run_kernel(_sign, x, x)), x),)
    # x / |x|, 0 at 0 (as torch's sgn): recorded, since the phase of x is no constant
    nonzero = run_kernel(_nonzero_kernel, z, z)
    return (fit(multiply(g, divide(x, where(nonzero, z, 1.0))), x),)


def _conj_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(conj_if_complex(gs[0]), xs[0]),)


def _add_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (fit(g, a) if needs[0] else None, fit(g, b) if needs[1] else None)


def _subtract_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (fit(g, a) if needs[0] else None, fit(negative(g), b) if needs[1] else None)


def _multiply_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (
        fit(multiply(g, b), a) if needs[0] else None,
        fit(multiply(g, a), b) if needs[1] else None,
    )


def _multiply_complex_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (
        fit(multiply(g, conj_if_complex(b)), a) if needs[0] else None,
        fit(multiply(g, conj_if_complex(a)), b) if needs[1] else None,
    )


def _divide_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b), (z,) = gs, xs, zs
    return (
        fit(divide(g, b), a) if needs[0] else None,
        fit(negative(divide(multiply(g, z), b)), b) if needs[1] else None,
    )


def _divide_complex_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b), (z,) = gs, xs, zs
    cz, cb = conj_if_complex(z), conj_if_complex(b)
    return (
        fit(divide(g, cb), a) if needs[0] else None,
        fit(negative(divide(multiply(g, cz), cb)), b) if needs[1] else None,
    )


def _power_grad_base_kernel(xp: Any, b: Any) -> Any:
    return b != 0


def _zero_base_kernel(xp: Any, a: Any, b: Any) -> Any:
    """Where ``d(a ** b)/db`` is 0 although ``log(a)`` is not finite: ``a == 0``, ``b >= 0``."""
    return (a == 0) & (b >= 0)


def _power_exponent_vjp(g: Any, a: Any, b: Any, z: Any) -> Any:
    """``g * a ** b * log(a)``, and 0 where ``a == 0 <= b``: PyTorch's formula, as it is.

    So -inf where ``a == 0 > b`` (``inf * log(0)``) and NaN at a negative base, whose logarithm
    is NaN; the second derivatives through it are NaN there too, and at ``a == 0 <= b``, where
    the masked branch passes ``0 * log(0)`` back (the true limits are infinite for ``b <= 1``
    and 0 above: NaN says "undefined" rather than guessing). NumPy's warnings about these
    values are silenced here, as PyTorch gives none.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        if isinstance(a, SCALARS):  # a constant base: its logarithm is a number
            if a > 0:  # type: ignore[operator]  # 2 ** x, the common case
                return multiply(g, multiply(z, math.log(a)))  # type: ignore[arg-type]
            log_a: Any = -math.inf if a == 0 else math.nan
        else:
            log_a = log(a)
        masked = run_kernel(_zero_base_kernel, z, a, b)
        return multiply(g, where(masked, 0.0, multiply(z, log_a)))


def _power_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b), (z,) = gs, xs, zs
    ga = gb = None
    if needs[0]:
        b_minus_1 = b - 1 if isinstance(b, SCALARS) else subtract(b, 1)  # type: ignore[operator]
        if isinstance(b, SCALARS) and b == 0:
            ga = multiply(g, 0.0)  # torch: 0 where the exponent is 0 (even at a == 0)
        else:
            ga = multiply(g, multiply(b, power(a, b_minus_1)))
            if not isinstance(b, SCALARS):
                ga = where(run_kernel(_power_grad_base_kernel, b, b), ga, 0.0)
        ga = fit(ga, a)
    if needs[1]:
        gb = fit(_power_exponent_vjp(g, a, b, z), b)
    return ga, gb


def _tie_weights_kernel(xp: Any, a: Any, b: Any, dtype: Any) -> list[Any]:
    """Gradient weights of ``maximum(a, b)``: 1 for the larger, 1/2 each on ties (torch).

    With ``a`` and ``b`` swapped they are the weights of ``minimum(a, b)``, in order.
    """
    half = xp.where(a == b, 0.5, 1.0).astype(dtype)
    return [half * ~(a < b), half * ~(b < a)]


def _extremum_vjp(g: Any, a: Any, b: Any, needs: Needs, larger_first: bool) -> Grads:
    x = b if isinstance(a, SCALARS) else a
    pair = (a, b) if larger_first else (b, a)
    wa, wb = run_kernel(_tie_weights_kernel, x, *pair, g.dtype)
    return (
        fit(multiply(g, wa), a) if needs[0] else None,
        fit(multiply(g, wb), b) if needs[1] else None,
    )


def _maximum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return _extremum_vjp(gs[0], xs[0], xs[1], needs, larger_first=True)


def _minimum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return _extremum_vjp(gs[0], xs[0], xs[1], needs, larger_first=False)


_REAL_ONLY = frozenset({"power", "maximum", "minimum"})
"""The table's ops whose gradient holds for real numbers only: refused on complex values."""

_COMPLEX_VJPS = {"multiply": _multiply_complex_vjp, "divide": _divide_complex_vjp}
"""The product rules with conjugated factors, recorded when the result is complex.

Chosen when the op is recorded, so that a real product's vjp pays nothing for complex numbers
(testing the dtype in the vjp made the tape chain's gradient pass 5 % slower).
"""


def _unary_op(name: str, ufunc: Any, vjp: Any, doc: str) -> Callable[[Operand], Array]:
    slow = named_kernel(name)

    def op(x: Any, /) -> Any:
        if type(x) is _ndarray:
            z = ufunc(x)
            if type(z) is not _ndarray:
                z = np.asarray(z)  # NumPy's 0-d result
        elif type(x) is HostArray:  # before isinstance(x, SCALARS): 70 ns on an array
            z = host_unary(ufunc, x)
        elif isinstance(x, SCALARS):
            z = np.asarray(ufunc(x))
        else:
            z = run_kernel(slow, x, x)
        if active_tapes():
            record_unary(vjp, x, z, None)
        return z

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


def _host_binary(ufunc: Any, name: str, a: Any, b: Any) -> Any:
    """``ufunc(a, b)`` on host buffers; ``a`` (or ``b``, when ``a`` is a scalar) is a host array."""
    ra: Any
    rb: Any
    if type(a) is HostArray:
        device = a.device
        ra = host_buffer(a)
        if type(b) is HostArray and b.device is device:
            rb = host_buffer(b)
        else:
            rb = b if isinstance(b, SCALARS) else host_operand(b, device, name)
    else:
        device = b.device
        ra, rb = a, host_buffer(b)
    z = ufunc(ra, rb)
    return host_array(z if type(z) is np.ndarray else np.asarray(z), device)


def _binary_op(name: str, ufunc: Any, vjp: Any, doc: str) -> Callable[[Operand, Operand], Array]:
    slow = named_kernel(name)
    real_only = name in _REAL_ONLY
    complex_vjp = _COMPLEX_VJPS.get(name)
    complex_matters = real_only or complex_vjp is not None

    def op(a: Any, b: Any, /) -> Any:
        if type(a) is _ndarray:  # the hot path: NumPy refuses a host array as b itself
            z = ufunc(a, b)
            if type(z) is not _ndarray:
                z = np.asarray(z)  # NumPy's 0-d result
        elif (type(a) is HostArray or type(b) is HostArray) and (
            host := host_ufunc(ufunc, a, b)  # one device object, or a scalar (else None)
        ) is not None:
            z = host
        else:
            x = b if isinstance(a, SCALARS) else a
            if type(x) is HostArray:
                z = _host_binary(ufunc, name, a, b)
            elif type(x) is np.ndarray or isinstance(x, SCALARS):
                z = ufunc(a, b)
                z = z if type(z) is np.ndarray else np.asarray(z)
            else:
                z = run_kernel(slow, x, a, b)
        if active_tapes():
            rule = vjp
            if complex_matters and z.dtype.kind == "c":
                if real_only:
                    refuse_complex(name, z, (a, b))
                else:
                    rule = complex_vjp
            record_binary(rule, a, b, z, None)
        return z

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


def _doc(summary: str, call: str, result: str) -> str:
    return f"""{summary}, differentiable to any order.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> {call}
        {result}
    """


_UNARY_RULES: dict[str, tuple[Any, Any, str]] = {
    "negative": (
        np.negative,
        _negative_vjp,
        _doc("``-x``", "ops.negative(np.array([1.0, -2.0]))", "array([-1.,  2.])"),
    ),
    "square": (
        np.square,
        _square_vjp,
        _doc("``x ** 2``", "ops.square(np.array([1.0, -3.0]))", "array([1., 9.])"),
    ),
    "exp": (
        np.exp,
        _exp_vjp,
        _doc("``e ** x``", "ops.exp(np.array([0.0, 1.0]))", "array([1.        , 2.71828183])"),
    ),
    "log": (
        np.log,
        _log_vjp,
        _doc("Natural logarithm", "ops.log(np.array([1.0, np.e]))", "array([0., 1.])"),
    ),
    "tanh": (
        np.tanh,
        _tanh_vjp,
        _doc("Hyperbolic tangent", "ops.tanh(np.array([0.0]))", "array([0.])"),
    ),
    "sqrt": (
        np.sqrt,
        _sqrt_vjp,
        _doc("Square root", "ops.sqrt(np.array([4.0, 9.0]))", "array([2., 3.])"),
    ),
    "abs": (
        np.absolute,
        _abs_vjp,
        _doc(
            "``|x|`` (real for a complex ``x``); the gradient at 0 is 0, as in PyTorch",
            "ops.abs(np.array([-1.5, 2.0]))",
            "array([1.5, 2. ])",
        ),
    ),
    "conj": (
        np.conjugate,
        _conj_vjp,
        _doc(
            "Complex conjugate (a copy of a real ``x``)",
            "ops.conj(np.array([1 + 2j, 3.0]))",
            "array([1.-2.j, 3.-0.j])",
        ),
    ),
}
"""The elementwise unary ops: name -> (NumPy ufunc, vjp, docstring). CuPy runs ``cupy.<name>``."""

_BINARY_RULES: dict[str, tuple[Any, Any, str]] = {
    "add": (
        np.add,
        _add_vjp,
        _doc("``a + b``", "ops.add(np.array([1.0, 2.0]), 1.0)", "array([2., 3.])"),
    ),
    "subtract": (
        np.subtract,
        _subtract_vjp,
        _doc(
            "``a - b``",
            "ops.subtract(np.array([1.0, 2.0]), np.array([0.5, 0.5]))",
            "array([0.5, 1.5])",
        ),
    ),
    "multiply": (
        np.multiply,
        _multiply_vjp,
        _doc("``a * b`` elementwise", "ops.multiply(np.array([1.0, 2.0]), 3.0)", "array([3., 6.])"),
    ),
    "divide": (
        np.divide,
        _divide_vjp,
        _doc(
            "``a / b`` (true division)",
            "ops.divide(np.array([1.0, 2.0]), 4.0)",
            "array([0.25, 0.5 ])",
        ),
    ),
    "power": (
        np.power,
        _power_vjp,
        _doc(
            "``a ** b`` elementwise; differentiable in both",
            "ops.power(np.array([2.0, 3.0]), 2.0)",
            "array([4., 9.])",
        ),
    ),
    "maximum": (
        np.maximum,
        _maximum_vjp,
        _doc(
            "Elementwise maximum; equal operands share the gradient evenly, as in PyTorch",
            "ops.maximum(np.array([1.0, 5.0]), 2.0)",
            "array([2., 5.])",
        ),
    ),
    "minimum": (
        np.minimum,
        _minimum_vjp,
        _doc(
            "Elementwise minimum; equal operands share the gradient evenly, as in PyTorch",
            "ops.minimum(np.array([1.0, 5.0]), 2.0)",
            "array([1., 2.])",
        ),
    ),
}
"""The elementwise binary ops (NumPy broadcasting): name -> (NumPy ufunc, vjp, docstring)."""

_UNARY_OPS = {name: _unary_op(name, *rule) for name, rule in _UNARY_RULES.items()}
_BINARY_OPS = {name: _binary_op(name, *rule) for name, rule in _BINARY_RULES.items()}

# The tables make the ops; these lines give each its public name, typed for checkers.
negative: Callable[[Operand], Array] = _UNARY_OPS["negative"]
square: Callable[[Operand], Array] = _UNARY_OPS["square"]
exp: Callable[[Operand], Array] = _UNARY_OPS["exp"]
log: Callable[[Operand], Array] = _UNARY_OPS["log"]
tanh: Callable[[Operand], Array] = _UNARY_OPS["tanh"]
sqrt: Callable[[Operand], Array] = _UNARY_OPS["sqrt"]
abs: Callable[[Operand], Array] = _UNARY_OPS["abs"]
conj: Callable[[Operand], Array] = _UNARY_OPS["conj"]
add: Callable[[Operand, Operand], Array] = _BINARY_OPS["add"]
subtract: Callable[[Operand, Operand], Array] = _BINARY_OPS["subtract"]
multiply: Callable[[Operand, Operand], Array] = _BINARY_OPS["multiply"]
divide: Callable[[Operand, Operand], Array] = _BINARY_OPS["divide"]
power: Callable[[Operand, Operand], Array] = _BINARY_OPS["power"]
maximum: Callable[[Operand, Operand], Array] = _BINARY_OPS["maximum"]
minimum: Callable[[Operand, Operand], Array] = _BINARY_OPS["minimum"]

_maximum_kernel = named_kernel("maximum")


def relu(x: Operand, /) -> Array:
    """``max(x, 0)``, differentiable; the gradient at 0 is 0, as in PyTorch.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.relu(np.array([-1.0, 2.0]))
        array([0., 2.])
    """
    if type(x) is np.ndarray:
        z = np.maximum(x, 0)
        z = z if type(z) is np.ndarray else np.asarray(z)
    else:
        z = run_kernel(_maximum_kernel, x, x, 0)
    if active_tapes():
        if z.dtype.kind == "c":
            refuse_complex("relu", z, (x,))
        record_unary(_relu_vjp, x, z, None)
    return z


def _real_kernel(xp: Any, x: Any) -> Any:
    return xp.array(xp.real(x))  # a new array: NumPy's and CuPy's real is a view


def _imag_kernel(xp: Any, x: Any) -> Any:
    return xp.array(xp.imag(x))


def real(x: Array, /) -> Array:
    """The real part of ``x`` (a copy of a real ``x``), differentiable.

    Its gradient passes the (real) output gradient to the real part: the way from complex
    intermediate results to a real loss, as ``torch.real``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.real(np.array([1 + 2j, 3 - 1j]))
        array([1., 3.])
    """
    require_array(x, "real")
    z = run_kernel(_real_kernel, x, x)
    if active_tapes():
        record_unary(_real_vjp, x, z, None)
    return z


def _real_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(gs[0], xs[0]),)


def imag(x: Array, /) -> Array:
    """The imaginary part of ``x`` (zeros for a real ``x``), differentiable.

    Its gradient is ``i g`` for a complex ``x``, 0 for a real one.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.imag(np.array([1 + 2j, 3 - 1j]))
        array([ 2., -1.])
    """
    require_array(x, "imag")
    z = run_kernel(_imag_kernel, x, x)
    if active_tapes():
        record_unary(_imag_vjp, x, z, None)
    return z


def _imag_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(multiply(gs[0], 1j), xs[0]),)


def _where_kernel(xp: Any, cond: Any, x: Any, y: Any) -> Any:
    return xp.where(cond, x, y)


def where(condition: Array, x: Operand, y: Operand, /) -> Array:
    """``x`` where ``condition`` holds, else ``y`` (broadcast), differentiable in ``x`` and ``y``.

    ``condition`` is a constant (a boolean array); ``x`` and ``y`` may be scalars.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.where(np.array([True, False]), np.array([1.0, 2.0]), 0.0)
        array([1., 0.])
    """
    place = x if is_array(x) else y if is_array(y) else condition
    z = run_kernel(_where_kernel, place, condition, x, y)
    if active_tapes():
        record(_where_vjp, (condition, x, y), (z,), None)
    return z


def _where_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (cond, x, y) = gs, xs
    return (
        None,
        fit(where(cond, g, 0), x) if needs[1] else None,
        fit(where(cond, 0, g), y) if needs[2] else None,
    )


def _clip_kernel(xp: Any, x: Any, lo: Any, hi: Any) -> Any:
    return xp.clip(x, lo, hi)


def _clip_masks_kernel(xp: Any, x: Any, lo: Any, hi: Any) -> list[Any]:
    """Where the gradient of ``clip(x, lo, hi)`` flows to ``x``, to ``lo`` and to ``hi`` (torch).

    Where the bounds cross (``lo > hi``) the value is ``hi`` whatever ``x`` and ``lo`` are, so
    the gradient goes to ``hi`` alone; where they meet (``lo == hi``), to ``x`` if it equals
    them, else to ``hi`` only where ``x > hi``.
    """
    inside = xp.ones(x.shape, bool) if lo is None else x >= lo
    if hi is not None:
        inside = inside & (x <= hi)
    below = None if lo is None else x < lo
    above = None if hi is None else x > hi
    if lo is not None and hi is not None:
        below = below & (lo < hi)
        above = above | (hi < lo)
    return [inside, below, above]


def clip(x: Operand, lo: Operand | None = None, hi: Operand | None = None, /) -> Array:
    """``x`` limited to ``[lo, hi]`` (either bound may be ``None``), differentiable.

    The gradient flows to ``x`` where ``lo <= x <= hi``, to an array ``lo`` where ``x < lo`` and
    to an array ``hi`` where ``x > hi`` (PyTorch's ``clamp``). Where the bounds cross
    (``lo > hi``) the value is ``hi``, as in NumPy and PyTorch, and so is the gradient: all of
    it goes to ``hi``, none to ``x`` or ``lo``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.clip(np.array([-2.0, 0.5, 3.0]), -1.0, 1.0)
        array([-1. ,  0.5,  1. ])
    """
    require_array(x, "clip")
    if lo is None and hi is None:
        raise ValueError("ops.clip needs lo or hi (or both), got neither.")
    z = run_kernel(_clip_kernel, x, x, lo, hi)
    if active_tapes():
        refuse_complex("clip", z, (x, lo, hi))
        record(_clip_vjp, (x, lo, hi), (z,), None)
    return z


def _clip_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (x, lo, hi) = gs, xs
    inside, below, above = run_kernel(_clip_masks_kernel, x, x, lo, hi)
    return (
        fit(multiply(g, inside), x) if needs[0] else None,
        fit(multiply(g, below), lo) if needs[1] else None,
        fit(multiply(g, above), hi) if needs[2] else None,
    )
