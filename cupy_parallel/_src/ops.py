"""Differentiable array operations: enough to write and train real models, to any order.

Each op computes with its input's namespace (NumPy, or CuPy on the array's own GPU; a host
array's own buffer) and, when an active :class:`~cupy_parallel.Tape` tracks an input, records its
vector-Jacobian product (``_<op>_vjp``), which maps the output gradient to input gradients.
Python and NumPy scalars are accepted as constants. Results are always arrays (NumPy's 0-d
results come back as 0-d arrays, not NumPy scalars, as in CuPy).

Decisions:

- Every vjp is written with these ops, never with raw NumPy on its arguments, so a gradient
  computed under an outer tape is itself recorded there: nested tapes give second (and higher)
  derivatives. Quantities with a zero derivative (masks such as ``x > 0``, signs, tie weights)
  are computed raw, as constants.
- The elementwise ops come from one rule table (:data:`_UNARY_RULES`, :data:`_BINARY_RULES`,
  HIPS autograd's ``defvjp``): a rule is the NumPy ufunc and its vjp. The wrappers the table
  generates are as fast as hand-written ones (measured: within noise): recording is the hot path
  of a training step, so an op checks ``active_tapes()`` once and records through
  ``record_unary``/``record_binary``. Ops with arguments (axes, shapes, indices) are written
  out, each with its checks.
- Gradients at kinks and ties follow PyTorch: ``relu'(0) = abs'(0) = 0``, ``maximum``/``minimum``
  split the gradient evenly between equal operands, ``clip`` passes it where
  ``lo <= x <= hi``, ``power``'s gradient is 0 where the exponent is 0 and, for the exponent,
  0 where the base is 0 and the exponent non-negative (NaN for a negative base).
- ``softmax``, ``log_softmax`` and ``softmax_cross_entropy`` take the class axis last
  (``axis=-1``), as jax/optax do (PyTorch's ``cross_entropy`` takes classes on axis 1).
- Host arrays compute on their buffers (``host_buffer``) and wrap the result on their device
  (``host_array``): ops never go through the HostArray's NumPy dispatch, so the tape's guard
  against raw NumPy on recorded host arrays never fires for them, and they stay fast. Operands
  on another device, or plain NumPy arrays mixed with host arrays, are refused as CuPy refuses
  them. Constants such as masks and labels must live on the data's device too.
- ``getitem``'s adjoint adds the gradient into zeros at the index: by assignment for basic
  indices and masks (no element repeats), by ``add.at`` (``ufunc.at``, in NumPy and CuPy) for
  integer-array indices, so repeated elements sum their gradients. ``var`` and
  ``softmax_cross_entropy`` are built from the other ops (no vjp of their own).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
from numpy.lib.array_utils import normalize_axis_index, normalize_axis_tuple

from cupy_parallel._src.arguments import read_int
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.compute import cuda_device
from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.guard import register_ops
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer
from cupy_parallel._src.recording import active_tapes, record, record_binary, record_unary

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.arraytypes import Array, Operand

__all__ = [
    "abs",
    "add",
    "clip",
    "concatenate",
    "divide",
    "exp",
    "getitem",
    "log",
    "log_softmax",
    "logsumexp",
    "matmul",
    "maximum",
    "mean",
    "minimum",
    "multiply",
    "negative",
    "power",
    "relu",
    "reshape",
    "softmax",
    "softmax_cross_entropy",
    "split",
    "sqrt",
    "square",
    "stack",
    "subtract",
    "sum",
    "tanh",
    "transpose",
    "var",
    "where",
]

# --------------------------------------------------------------------------------------------
# Where ops compute

_SCALARS = (int, float, complex, np.generic)

_ndarray = np.ndarray
"""``np.ndarray`` as a module global: the generated ops test ``type(x) is _ndarray`` on every
call, inside vjps too, and one global lookup is cheaper than ``np.ndarray``'s two (measured
~60 ns a call, a few percent of a first-order gradient on small arrays)."""

Args: TypeAlias = tuple[Any, ...]
Needs: TypeAlias = tuple[bool, ...]
Grads: TypeAlias = tuple[Any, ...]


def _result(z: Any) -> Any:
    return z if type(z) is np.ndarray else np.asarray(z)


def _host_operand(a: Any, device: Any, name: str) -> Any:
    """The buffer of a host-array operand on ``device``; refuse arrays elsewhere."""
    if isinstance(a, HostArray):
        if a.device is not device and a.device != device:
            raise ValueError(
                f"ops.{name} got arrays on different devices, {device} and {a.device}. "
                "Move them to one device with cupy_parallel.to_device(array, device)."
            )
        return host_buffer(a)
    if isinstance(a, list):  # the arrays of concatenate/stack (an index tuple stays as is)
        return [_host_operand(b, device, name) for b in a]
    if is_array(a):
        kind = (
            "a plain numpy.ndarray (on cpu)"
            if isinstance(a, np.ndarray)
            else (f"a {type(a).__module__.split('.')[0]}.ndarray on {device_of(a)}")
        )
        raise TypeError(
            f"ops.{name} mixes an array on {device} with {kind}, which CuPy would refuse too. "
            f"Move it with cupy_parallel.to_device(array, '{device}')."
        )
    return a


def _host_result(z: Any, device: Any) -> Any:
    if isinstance(z, list):
        return [host_array(np.asarray(y), device) for y in z]
    return host_array(np.asarray(z), device)


def _on_device(kernel: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """``kernel(xp, *args, **kwargs)`` in the namespace ``xp`` of ``x``, on its device.

    ``x`` is the placing operand. Host arrays compute on their buffers (so the tape's guard on
    raw NumPy never sees them) and get their device back; CuPy enters the array's GPU.
    """
    if type(x) is np.ndarray or isinstance(x, _SCALARS):
        z = kernel(np, *args, **kwargs)
        return z if isinstance(z, list) else _result(z)
    if isinstance(x, HostArray):
        device = x.device
        name = kernel.__name__
        raw = [_host_operand(a, device, name) for a in args]
        return _host_result(kernel(np, *raw, **kwargs), device)
    device = cuda_device(x)
    if device is None:
        raise TypeError(
            f"ops.{kernel.__name__} takes arrays (NumPy, HostArray, CuPy) or Python/NumPy "
            f"scalars, got {type(x).__name__}."
        )
    with device:
        return kernel(cupy_module(), *args, **kwargs)


def _named(name: str) -> Callable[..., Any]:
    """The kernel calling ``xp.<name>``."""

    def kernel(xp: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(xp, name)(*args, **kwargs)

    kernel.__name__ = name
    return kernel


def _require_array(x: Any, op: str) -> None:
    if not is_array(x):
        raise TypeError(f"ops.{op} takes an array, got {type(x).__name__}.")


# --------------------------------------------------------------------------------------------
# Gradient plumbing, written with ops so that it is recorded under an outer tape


def _fit(g: Any, x: Any) -> Any:
    """Reduce a broadcast gradient ``g`` to the shape and dtype of the input ``x``.

    Every vjp calls it once per input gradient, mostly with ``g`` already fitting: the
    reduction lives in :func:`_unbroadcast` so that this common case creates no closure cells
    (its generator expression would, on every call).
    """
    if g.shape != x.shape:
        g = _unbroadcast(g, x)
    return g if g.dtype == x.dtype else _astype(g, x.dtype)


def _unbroadcast(g: Any, x: Any) -> Any:
    """Sum the broadcast gradient ``g`` over the axes broadcasting added to ``x``'s shape."""
    lead = g.ndim - x.ndim
    axes = (
        *range(lead),
        *(lead + i for i, n in enumerate(x.shape) if n == 1 and g.shape[lead + i] != 1),
    )
    return reshape(sum(g, axes, keepdims=True), x.shape)


def _astype_kernel(xp: Any, x: Any, dtype: Any) -> Any:
    return x.astype(dtype)


def _astype(x: Any, dtype: Any, /) -> Any:
    z = _on_device(_astype_kernel, x, x, dtype)
    if active_tapes():
        record_unary(_astype_vjp, x, z, None)
    return z


def _astype_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_astype(gs[0], xs[0].dtype),)


def _broadcast_to_kernel(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    return xp.broadcast_to(x, shape).copy()  # a writable array, never a stride-0 view


def _broadcast_to(x: Any, shape: tuple[int, ...], /) -> Any:
    z = _on_device(_broadcast_to_kernel, x, x, shape)
    if active_tapes():
        record_unary(_broadcast_to_vjp, x, z, None)
    return z


def _broadcast_to_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(gs[0], xs[0]),)


def _spread(g: Any, x: Any, axes: tuple[int, ...], keepdims: bool) -> Any:
    """The gradient of a reduction over ``axes``: ``g`` copied along them to ``x``'s shape."""
    if not keepdims:
        g = reshape(g, tuple(1 if i in axes else n for i, n in enumerate(x.shape)))
    return g if g.shape == x.shape else _broadcast_to(g, x.shape)


# --------------------------------------------------------------------------------------------
# Elementwise ops from a rule table: name -> (ufunc, vjp). A vjp gets the output gradients
# ``gs``, the inputs, which of them need a gradient, the outputs and the op's auxiliary data.


def _negative_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(negative(gs[0]), xs[0]),)


def _square_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(multiply(gs[0], multiply(xs[0], 2.0)), xs[0]),)


def _exp_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(multiply(gs[0], zs[0]), xs[0]),)


def _log_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(divide(gs[0], xs[0]), xs[0]),)


def _tanh_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(multiply(gs[0], subtract(1.0, square(zs[0]))), xs[0]),)


def _sqrt_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(divide(gs[0], multiply(zs[0], 2.0)), xs[0]),)


def _positive_kernel(xp: Any, x: Any) -> Any:
    return x > 0


def _relu_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(multiply(gs[0], _on_device(_positive_kernel, xs[0], xs[0])), xs[0]),)


_sign = _named("sign")


def _abs_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (_fit(multiply(gs[0], _on_device(_sign, xs[0], xs[0])), xs[0]),)


def _add_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (_fit(g, a) if needs[0] else None, _fit(g, b) if needs[1] else None)


def _subtract_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (_fit(g, a) if needs[0] else None, _fit(negative(g), b) if needs[1] else None)


def _multiply_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
    return (
        _fit(multiply(g, b), a) if needs[0] else None,
        _fit(multiply(g, a), b) if needs[1] else None,
    )


def _divide_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b), (z,) = gs, xs, zs
    return (
        _fit(divide(g, b), a) if needs[0] else None,
        _fit(negative(divide(multiply(g, z), b)), b) if needs[1] else None,
    )


def _power_grad_base_kernel(xp: Any, b: Any) -> Any:
    return b != 0


def _power_exponent_fill_kernel(xp: Any, a: Any, b: Any, dtype: Any) -> Any:
    """Where the base is not positive: 0 if it is 0 and the exponent >= 0, else NaN (torch)."""
    return xp.where((a == 0) & (b >= 0), 0.0, xp.nan).astype(dtype)


def _power_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b), (z,) = gs, xs, zs
    ga = gb = None
    if needs[0]:
        b_minus_1 = b - 1 if isinstance(b, _SCALARS) else subtract(b, 1)  # type: ignore[operator]
        if isinstance(b, _SCALARS) and b == 0:
            ga = multiply(g, 0.0)  # torch: 0 where the exponent is 0 (even at a == 0)
        else:
            ga = multiply(g, multiply(b, power(a, b_minus_1)))
            if not isinstance(b, _SCALARS):
                ga = where(_on_device(_power_grad_base_kernel, b, b), ga, 0.0)
        ga = _fit(ga, a)
    if needs[1]:
        gz = multiply(g, z)
        fill = _on_device(_power_exponent_fill_kernel, b, a, b, z.dtype)
        if isinstance(a, _SCALARS):  # a constant base: keep every array on b's device
            gb = multiply(gz, math.log(a)) if a > 0 else add(multiply(gz, 0.0), fill)  # type: ignore[operator, arg-type]
        else:
            positive = _on_device(_positive_kernel, a, a)
            gb = where(positive, multiply(gz, log(where(positive, a, 1.0))), fill)
        gb = _fit(gb, b)
    return ga, gb


def _tie_weights_kernel(xp: Any, a: Any, b: Any, dtype: Any) -> list[Any]:
    """Gradient weights of ``maximum(a, b)``: 1 for the larger, 1/2 each on ties (torch).

    With ``a`` and ``b`` swapped they are the weights of ``minimum(a, b)``, in order.
    """
    half = xp.where(a == b, 0.5, 1.0).astype(dtype)
    return [half * ~(a < b), half * ~(b < a)]


def _extremum_vjp(g: Any, a: Any, b: Any, needs: Needs, larger_first: bool) -> Grads:
    x = b if isinstance(a, _SCALARS) else a
    pair = (a, b) if larger_first else (b, a)
    wa, wb = _on_device(_tie_weights_kernel, x, *pair, g.dtype)
    return (
        _fit(multiply(g, wa), a) if needs[0] else None,
        _fit(multiply(g, wb), b) if needs[1] else None,
    )


def _maximum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return _extremum_vjp(gs[0], xs[0], xs[1], needs, larger_first=True)


def _minimum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return _extremum_vjp(gs[0], xs[0], xs[1], needs, larger_first=False)


def _unary_op(name: str, ufunc: Any, vjp: Any, doc: str) -> Callable[[Operand], Array]:
    slow = _named(name)

    def op(x: Any, /) -> Any:
        if type(x) is _ndarray or isinstance(x, _SCALARS):
            z = ufunc(x)
            if type(z) is not _ndarray:
                z = np.asarray(z)  # NumPy's 0-d result
        elif type(x) is HostArray:
            z = ufunc(host_buffer(x))
            z = host_array(z if type(z) is np.ndarray else np.asarray(z), x.device)
        else:
            z = _on_device(slow, x, x)
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
            rb = b if isinstance(b, _SCALARS) else _host_operand(b, device, name)
    else:
        device = b.device
        ra, rb = a, host_buffer(b)
    z = ufunc(ra, rb)
    return host_array(z if type(z) is np.ndarray else np.asarray(z), device)


def _binary_op(name: str, ufunc: Any, vjp: Any, doc: str) -> Callable[[Operand, Operand], Array]:
    slow = _named(name)

    def op(a: Any, b: Any, /) -> Any:
        if type(a) is _ndarray:  # the hot path: NumPy refuses a host array as b itself
            z = ufunc(a, b)
            if type(z) is not _ndarray:
                z = np.asarray(z)  # NumPy's 0-d result
        else:
            x = b if isinstance(a, _SCALARS) else a
            if type(x) is HostArray:
                z = _host_binary(ufunc, name, a, b)
            elif type(x) is np.ndarray or isinstance(x, _SCALARS):
                z = ufunc(a, b)
                z = z if type(z) is np.ndarray else np.asarray(z)
            else:
                z = _on_device(slow, x, a, b)
        if active_tapes():
            record_binary(vjp, a, b, z, None)
        return z

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


_UNARY_RULES: dict[str, tuple[Any, Any]] = {
    "negative": (np.negative, _negative_vjp),
    "square": (np.square, _square_vjp),
    "exp": (np.exp, _exp_vjp),
    "log": (np.log, _log_vjp),
    "tanh": (np.tanh, _tanh_vjp),
    "sqrt": (np.sqrt, _sqrt_vjp),
    "abs": (np.absolute, _abs_vjp),
}
"""The elementwise unary ops: name -> (NumPy ufunc, vjp). CuPy runs ``cupy.<name>``."""

_BINARY_RULES: dict[str, tuple[Any, Any]] = {
    "add": (np.add, _add_vjp),
    "subtract": (np.subtract, _subtract_vjp),
    "multiply": (np.multiply, _multiply_vjp),
    "divide": (np.divide, _divide_vjp),
    "power": (np.power, _power_vjp),
    "maximum": (np.maximum, _maximum_vjp),
    "minimum": (np.minimum, _minimum_vjp),
}
"""The elementwise binary ops (NumPy broadcasting): name -> (NumPy ufunc, vjp)."""


def _doc(summary: str, call: str, result: str) -> str:
    return f"""{summary}, differentiable to any order.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> {call}
        {result}
    """


negative = _unary_op(
    "negative",
    *_UNARY_RULES["negative"],
    _doc("``-x``", "ops.negative(np.array([1.0, -2.0]))", "array([-1.,  2.])"),
)
square = _unary_op(
    "square",
    *_UNARY_RULES["square"],
    _doc("``x ** 2``", "ops.square(np.array([1.0, -3.0]))", "array([1., 9.])"),
)
exp = _unary_op(
    "exp",
    *_UNARY_RULES["exp"],
    _doc("``e ** x``", "ops.exp(np.array([0.0, 1.0]))", "array([1.        , 2.71828183])"),
)
log = _unary_op(
    "log",
    *_UNARY_RULES["log"],
    _doc("Natural logarithm", "ops.log(np.array([1.0, np.e]))", "array([0., 1.])"),
)
tanh = _unary_op(
    "tanh",
    *_UNARY_RULES["tanh"],
    _doc("Hyperbolic tangent", "ops.tanh(np.array([0.0]))", "array([0.])"),
)
sqrt = _unary_op(
    "sqrt",
    *_UNARY_RULES["sqrt"],
    _doc("Square root", "ops.sqrt(np.array([4.0, 9.0]))", "array([2., 3.])"),
)
abs = _unary_op(
    "abs",
    *_UNARY_RULES["abs"],
    _doc(
        "``|x|``; the gradient at 0 is 0, as in PyTorch",
        "ops.abs(np.array([-1.5, 2.0]))",
        "array([1.5, 2. ])",
    ),
)
add = _binary_op(
    "add",
    *_BINARY_RULES["add"],
    _doc("``a + b``", "ops.add(np.array([1.0, 2.0]), 1.0)", "array([2., 3.])"),
)
subtract = _binary_op(
    "subtract",
    *_BINARY_RULES["subtract"],
    _doc(
        "``a - b``", "ops.subtract(np.array([1.0, 2.0]), np.array([0.5, 0.5]))", "array([0.5, 1.5])"
    ),
)
multiply = _binary_op(
    "multiply",
    *_BINARY_RULES["multiply"],
    _doc("``a * b`` elementwise", "ops.multiply(np.array([1.0, 2.0]), 3.0)", "array([3., 6.])"),
)
divide = _binary_op(
    "divide",
    *_BINARY_RULES["divide"],
    _doc(
        "``a / b`` (true division)", "ops.divide(np.array([1.0, 2.0]), 4.0)", "array([0.25, 0.5 ])"
    ),
)
power = _binary_op(
    "power",
    *_BINARY_RULES["power"],
    _doc(
        "``a ** b`` elementwise; differentiable in both",
        "ops.power(np.array([2.0, 3.0]), 2.0)",
        "array([4., 9.])",
    ),
)
maximum = _binary_op(
    "maximum",
    *_BINARY_RULES["maximum"],
    _doc(
        "Elementwise maximum; equal operands share the gradient evenly, as in PyTorch",
        "ops.maximum(np.array([1.0, 5.0]), 2.0)",
        "array([2., 5.])",
    ),
)
minimum = _binary_op(
    "minimum",
    *_BINARY_RULES["minimum"],
    _doc(
        "Elementwise minimum; equal operands share the gradient evenly, as in PyTorch",
        "ops.minimum(np.array([1.0, 5.0]), 2.0)",
        "array([1., 2.])",
    ),
)

_maximum_kernel = _named("maximum")


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
        z = _on_device(_maximum_kernel, x, x, 0)
    if active_tapes():
        record_unary(_relu_vjp, x, z, None)
    return z


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
    z = _on_device(_where_kernel, place, condition, x, y)
    if active_tapes():
        record(_where_vjp, (condition, x, y), (z,), None)
    return z


def _where_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (cond, x, y) = gs, xs
    return (
        None,
        _fit(where(cond, g, 0), x) if needs[1] else None,
        _fit(where(cond, 0, g), y) if needs[2] else None,
    )


def _clip_kernel(xp: Any, x: Any, lo: Any, hi: Any) -> Any:
    return xp.clip(x, lo, hi)


def _clip_masks_kernel(xp: Any, x: Any, lo: Any, hi: Any) -> list[Any]:
    inside = xp.ones(x.shape, bool) if lo is None else x >= lo
    if hi is not None:
        inside = inside & (x <= hi)
    below = None if lo is None else x < lo
    above = None if hi is None else x > hi
    return [inside, below, above]


def clip(x: Operand, lo: Operand | None = None, hi: Operand | None = None, /) -> Array:
    """``x`` limited to ``[lo, hi]`` (either bound may be ``None``), differentiable.

    The gradient flows to ``x`` where ``lo <= x <= hi``, to an array ``lo`` where ``x < lo`` and
    to an array ``hi`` where ``x > hi`` (PyTorch's ``clamp``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.clip(np.array([-2.0, 0.5, 3.0]), -1.0, 1.0)
        array([-1. ,  0.5,  1. ])
    """
    _require_array(x, "clip")
    if lo is None and hi is None:
        raise ValueError("ops.clip needs lo or hi (or both), got neither.")
    z = _on_device(_clip_kernel, x, x, lo, hi)
    if active_tapes():
        record(_clip_vjp, (x, lo, hi), (z,), None)
    return z


def _clip_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (x, lo, hi) = gs, xs
    inside, below, above = _on_device(_clip_masks_kernel, x, x, lo, hi)
    return (
        _fit(multiply(g, inside), x) if needs[0] else None,
        _fit(multiply(g, below), lo) if needs[1] else None,
        _fit(multiply(g, above), hi) if needs[2] else None,
    )


# --------------------------------------------------------------------------------------------
# Linear algebra, reductions


_matmul_kernel = _named("matmul")


def matmul(a: Array, b: Array, /) -> Array:
    """``a @ b`` with NumPy's rules (1-d operands, batch broadcasting), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.matmul(np.eye(2), np.array([1.0, 2.0]))
        array([1., 2.])
    """
    _require_array(a, "matmul")
    _require_array(b, "matmul")
    if type(a) is np.ndarray:
        z = np.matmul(a, b)
        z = z if type(z) is np.ndarray else np.asarray(z)
    else:
        z = _on_device(_matmul_kernel, a, a, b)
    if active_tapes():
        record_binary(_matmul_vjp, a, b, z, None)
    return z


def _swap_last(x: Any) -> Any:
    n = x.ndim
    return transpose(x, (*range(n - 2), n - 1, n - 2))


def _matmul_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    (g,), (a, b) = gs, xs
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
        ga = matmul(g2, _swap_last(b2))
        if a.ndim == 1:
            ga = reshape(ga, (*ga.shape[:-2], ga.shape[-1]))
        ga = _fit(ga, a)
    if needs[1]:
        gb = matmul(_swap_last(a2), g2)
        if b.ndim == 1:
            gb = reshape(gb, gb.shape[:-1])
        gb = _fit(gb, b)
    return ga, gb


def _axes(x: Any, axis: int | tuple[int, ...] | None) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    return tuple(normalize_axis_tuple(axis, x.ndim, "axis"))


_sum_kernel = _named("sum")
_mean_kernel = _named("mean")


def sum(x: Array, /, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Array:
    """Sum over ``axis`` (all axes by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.sum(np.ones((2, 3)), axis=0)
        array([2., 2., 2.])
    """
    _require_array(x, "sum")
    axes = _axes(x, axis)
    z = _on_device(_sum_kernel, x, x, axis=axes, keepdims=keepdims)
    if active_tapes():
        record_unary(_sum_vjp, x, z, (axes, keepdims))
    return z


def _sum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, bool]) -> Grads:
    return (_spread(gs[0], xs[0], *aux),)


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
    _require_array(x, "mean")
    axes = _axes(x, axis)
    count = math.prod(x.shape[i] for i in axes)
    if count == 0:
        raise ValueError(
            f"ops.mean over axis {axis} of an array of shape {x.shape} averages no elements."
        )
    z = _on_device(_mean_kernel, x, x, axis=axes, keepdims=keepdims)
    if active_tapes():
        record_unary(_mean_vjp, x, z, (axes, keepdims, count))
    return z


def _mean_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, ...]) -> Grads:
    axes, keepdims, count = aux
    return (_spread(divide(gs[0], count), xs[0], axes, keepdims),)


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
    it. Built from differentiable ops, so differentiable to any order.

    Raises:
        ValueError: ``ddof`` leaves no degrees of freedom (``count - ddof <= 0``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.var(np.array([1.0, 2.0, 3.0, 4.0])), ops.var(np.array([1.0, 3.0]), ddof=1)
        (array(1.25), array(2.))
    """
    _require_array(x, "var")
    ddof = read_int(ddof, "ddof", minimum=0)
    axes = _axes(x, axis)
    count = math.prod(x.shape[i] for i in axes)
    if count - ddof <= 0:
        raise ValueError(
            f"ops.var over axis {axis} of an array of shape {x.shape} has {count} elements, "
            f"which leaves no degrees of freedom with ddof={ddof}."
        )
    deviation = subtract(x, mean(x, axes, keepdims=True))
    return divide(sum(square(deviation), axes, keepdims=keepdims), count - ddof)


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
    _require_array(x, "logsumexp")
    axes = _axes(x, axis)
    if any(x.shape[i] == 0 for i in axes):
        raise ValueError(f"ops.logsumexp over axis {axis} of shape {x.shape} has no elements.")
    z = _on_device(_logsumexp_kernel, x, x, axes, keepdims)
    if active_tapes():
        record_unary(_logsumexp_vjp, x, z, (axes, keepdims))
    return z


def _logsumexp_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, bool]) -> Grads:
    (g,), (x,), (z,) = gs, xs, zs
    axes, keepdims = aux
    if not keepdims:
        kept = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        g, z = reshape(g, kept), reshape(z, kept)
    return (_fit(multiply(g, exp(subtract(x, z))), x),)


def _softmax_kernel(xp: Any, x: Any, axis: int) -> Any:
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _log_softmax_kernel(xp: Any, x: Any, axis: int) -> Any:
    s = x - x.max(axis=axis, keepdims=True)
    return s - xp.log(xp.exp(s).sum(axis=axis, keepdims=True))


def _class_axis(x: Any, axis: Any, op: str) -> int:
    _require_array(x, op)
    if x.ndim == 0:
        raise ValueError(f"ops.{op} needs an array with at least one axis, got a 0-d array.")
    return int(normalize_axis_index(read_int(axis, "axis"), x.ndim))


def softmax(x: Array, /, axis: int = -1) -> Array:
    """``exp(x) / sum(exp(x))`` along ``axis`` (the last by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.softmax(np.array([0.0, np.log(3.0)]))
        array([0.25, 0.75])
    """
    axis = _class_axis(x, axis, "softmax")
    z = _on_device(_softmax_kernel, x, x, axis)
    if active_tapes():
        record_unary(_softmax_vjp, x, z, axis)
    return z


def _softmax_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    (g,), (z,) = gs, zs
    return (_fit(multiply(z, subtract(g, sum(multiply(g, z), axis, keepdims=True))), xs[0]),)


def log_softmax(x: Array, /, axis: int = -1) -> Array:
    """``x - logsumexp(x)`` along ``axis`` (the last by default), computed stably.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> np.exp(ops.log_softmax(np.array([0.0, np.log(3.0)])))
        array([0.25, 0.75])
    """
    axis = _class_axis(x, axis, "log_softmax")
    z = _on_device(_log_softmax_kernel, x, x, axis)
    if active_tapes():
        record_unary(_log_softmax_vjp, x, z, axis)
    return z


def _log_softmax_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    (g,), (z,) = gs, zs
    return (_fit(subtract(g, multiply(exp(z), sum(g, axis, keepdims=True))), xs[0]),)


def _one_hot_kernel(xp: Any, labels: Any, classes: int, dtype: Any) -> Any:
    return (labels[..., None] == xp.arange(classes)).astype(dtype)


def _label_range_kernel(xp: Any, labels: Any) -> list[Any]:
    return [labels.min(), labels.max()]


_REDUCTIONS = ("mean", "sum", "none")


def softmax_cross_entropy(logits: Array, labels: Array, /, *, reduction: str = "mean") -> Array:
    """Cross-entropy of ``softmax(logits)`` against integer class ``labels``, differentiable.

    ``logits`` has classes on its last axis, shape ``(..., C)``; ``labels`` has shape ``(...)``
    and integer values in ``[0, C)`` on the same device. ``reduction`` is ``"mean"`` (default,
    as PyTorch's ``cross_entropy``), ``"sum"`` or ``"none"`` (one loss per label).

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
    _require_array(logits, "softmax_cross_entropy")
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
        low, high = (int(v) for v in _on_device(_label_range_kernel, labels, labels))
        if low < 0 or high >= classes:
            raise ValueError(
                f"ops.softmax_cross_entropy got a label {low if low < 0 else high} outside "
                f"[0, {classes}) for {classes} classes."
            )
    one_hot = _on_device(_one_hot_kernel, logits, labels, classes, logits.dtype)
    losses = negative(sum(multiply(log_softmax(logits), one_hot), -1))
    if reduction == "none":
        return losses
    return mean(losses) if reduction == "mean" else sum(losses)


# --------------------------------------------------------------------------------------------
# Shapes, indexing, joining


_reshape_kernel = _named("reshape")
_transpose_kernel = _named("transpose")


def reshape(x: Array, /, shape: int | tuple[int, ...]) -> Array:
    """``x`` with a new shape (one entry may be -1), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.reshape(np.arange(4.0), (2, 2))
        array([[0., 1.],
               [2., 3.]])
    """
    _require_array(x, "reshape")
    z = _on_device(_reshape_kernel, x, x, shape)
    if active_tapes():
        record_unary(_reshape_vjp, x, z, None)
    return z


def _reshape_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (reshape(gs[0], xs[0].shape),)


def transpose(x: Array, /, axes: tuple[int, ...] | None = None) -> Array:
    """``x`` with its axes permuted (reversed by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.transpose(np.zeros((2, 3, 4)), (2, 0, 1)).shape
        (4, 2, 3)
    """
    _require_array(x, "transpose")
    z = _on_device(_transpose_kernel, x, x, axes)
    if active_tapes():
        inverse = (
            None if axes is None else tuple(int(i) for i in np.argsort([i % z.ndim for i in axes]))
        )
        record_unary(_transpose_vjp, x, z, inverse)
    return z


def _transpose_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, inverse: Any) -> Grads:
    return (transpose(gs[0], inverse),)


def _read_key(x: Any, index: Any) -> tuple[tuple[Any, ...], bool]:
    """``index`` as a tuple of raw components, and whether it repeats elements (int arrays)."""
    key = index if isinstance(index, tuple) else (index,)
    raw = []
    repeats = False
    for c in key:
        if isinstance(c, HostArray):
            if not isinstance(x, HostArray):
                raise TypeError(
                    f"ops.getitem indexes an array on {device_of(x)} with an index array on "
                    f"{c.device}. Move the index with cupy_parallel.to_device(index, "
                    f"'{device_of(x)}')."
                )
            c = _host_operand(c, x.device, "getitem")  # noqa: PLW2901 - an index is a constant
        elif isinstance(c, list | tuple):
            c = np.asarray(c)  # noqa: PLW2901
        elif is_array(c) and c.dtype.kind == "f":
            raise IndexError(
                f"ops.getitem indexes with ints, slices, None, ..., integer or boolean arrays, "
                f"got a {c.dtype} array."
            )
        if is_array(c) and c.dtype.kind in "iu":
            repeats = True
        raw.append(c)
    return tuple(raw), repeats


def _getitem_kernel(xp: Any, x: Any, key: tuple[Any, ...]) -> Any:
    if xp is not np:
        key = tuple(xp.asarray(c) if isinstance(c, np.ndarray) else c for c in key)
    return x[key]


def getitem(x: Array, index: Any, /) -> Array:
    """``x[index]`` with NumPy's rules, differentiable.

    ``index`` may hold ints, slices, ``None``, ``...``, integer arrays (repeated elements get
    their gradients summed) and boolean masks. The result is a new array (a view of ``x`` for
    basic indexing, as in NumPy).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> x = np.arange(6.0).reshape(2, 3)
        >>> ops.getitem(x, (1, slice(0, 2))), ops.getitem(x, x > 3.5)
        (array([3., 4.]), array([4., 5.]))
    """
    _require_array(x, "getitem")
    key, repeats = _read_key(x, index)
    z = _on_device(_getitem_kernel, x, x, key)
    if active_tapes():
        record_unary(_getitem_vjp, x, z, (key, repeats))
    return z


def _getitem_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: Any) -> Grads:
    key, repeats = aux
    return (_index_add(_fit(gs[0], zs[0]), key, xs[0].shape, repeats),)


def _index_add_kernel(
    xp: Any, g: Any, key: tuple[Any, ...], shape: tuple[int, ...], repeats: bool
) -> Any:
    out = xp.zeros(shape, g.dtype)
    if xp is not np:
        key = tuple(xp.asarray(c) if isinstance(c, np.ndarray) else c for c in key)
    if repeats:
        xp.add.at(out, key, g)
    else:
        out[key] = g
    return out


def _index_add(g: Any, key: tuple[Any, ...], shape: tuple[int, ...], repeats: bool) -> Any:
    """Zeros of ``shape`` with ``g`` added at ``key`` (the adjoint of ``getitem``)."""
    z = _on_device(_index_add_kernel, g, g, key, shape, repeats)
    if active_tapes():
        record_unary(_index_add_vjp, g, z, key)
    return z


def _index_add_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, key: Any) -> Grads:
    return (getitem(gs[0], key),)


def _arrays(arrays: Any, op: str) -> tuple[Any, ...]:
    if is_array(arrays) or not isinstance(arrays, list | tuple):
        raise TypeError(f"ops.{op} takes a list or tuple of arrays, got {type(arrays).__name__}.")
    if not arrays:
        raise ValueError(f"ops.{op} needs at least one array, got an empty sequence.")
    for i, a in enumerate(arrays):
        if not is_array(a):
            raise TypeError(f"ops.{op} takes arrays, but item {i} is a {type(a).__name__}.")
    return tuple(arrays)


def _concatenate_kernel(xp: Any, arrays: Sequence[Any], axis: int) -> Any:
    return xp.concatenate(arrays, axis=axis)


def concatenate(arrays: Sequence[Array], /, axis: int = 0) -> Array:
    """Join ``arrays`` along an existing ``axis``, differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.concatenate([np.zeros(2), np.ones(1)])
        array([0., 0., 1.])
    """
    xs = _arrays(arrays, "concatenate")
    z = _on_device(_concatenate_kernel, xs[0], list(xs), read_int(axis, "axis"))
    if active_tapes():
        axis = int(normalize_axis_index(axis, z.ndim))
        offsets = np.cumsum([x.shape[axis] for x in xs[:-1]]).tolist()
        record(_concatenate_vjp, xs, (z,), (axis, offsets))
    return z


def _concatenate_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: Any) -> Grads:
    axis, offsets = aux
    parts = split(gs[0], offsets, axis)
    return tuple(_fit(p, x) if need else None for p, x, need in zip(parts, xs, needs, strict=True))


def _stack_kernel(xp: Any, arrays: Sequence[Any], axis: int) -> Any:
    return xp.stack(arrays, axis=axis)


def stack(arrays: Sequence[Array], /, axis: int = 0) -> Array:
    """Join ``arrays`` of one shape along a new ``axis``, differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.stack([np.zeros(2), np.ones(2)], axis=1)
        array([[0., 1.],
               [0., 1.]])
    """
    xs = _arrays(arrays, "stack")
    z = _on_device(_stack_kernel, xs[0], list(xs), read_int(axis, "axis"))
    if active_tapes():
        record(_stack_vjp, xs, (z,), int(normalize_axis_index(axis, z.ndim)))
    return z


def _stack_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    lead = (slice(None),) * axis
    return tuple(
        _fit(getitem(gs[0], (*lead, i)), x) if need else None
        for i, (x, need) in enumerate(zip(xs, needs, strict=True))
    )


def _split_kernel(xp: Any, x: Any, sections: Any, axis: int) -> list[Any]:
    return list(xp.split(x, sections, axis=axis))


def split(x: Array, indices_or_sections: int | Sequence[int], /, axis: int = 0) -> list[Array]:
    """Split ``x`` along ``axis`` into equal sections or at indices (``numpy.split``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.split(np.arange(5.0), [2])
        [array([0., 1.]), array([2., 3., 4.])]
    """
    _require_array(x, "split")
    axis = int(normalize_axis_index(read_int(axis, "axis"), x.ndim))
    sections = indices_or_sections
    if not isinstance(sections, list | tuple):
        sections = read_int(sections, "indices_or_sections", minimum=1)
        if x.shape[axis] % sections:
            raise ValueError(
                f"ops.split cannot cut axis {axis} of length {x.shape[axis]} into {sections} "
                "equal sections; pass the split indices instead."
            )
    zs = _on_device(_split_kernel, x, x, sections, axis)
    if active_tapes():
        record(_split_vjp, (x,), tuple(zs), axis)
    return zs


def _zeros_like_kernel(xp: Any, x: Any) -> Any:
    return xp.zeros_like(x)


def _split_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    parts = [
        _on_device(_zeros_like_kernel, z, z) if g is None else g
        for g, z in zip(gs, zs, strict=True)
    ]
    return (_fit(concatenate(parts, axis), xs[0]),)


register_ops(__all__)  # the guard names these ops in its errors (tape never imports ops)
