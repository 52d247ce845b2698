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
- The elementwise ops come from one rule table (:mod:`~cupy_parallel._src.elementwise`, HIPS
  autograd's ``defvjp``): a rule is the NumPy ufunc, its vjp and the op's docstring, and one
  factory per table makes the ops (each with its public name). The wrappers the table
  generates are as fast as hand-written ones (measured: within noise): recording is the hot path
  of a training step, so an op checks ``active_tapes()`` once and records through
  ``record_unary``/``record_binary``. Ops with arguments (axes, shapes, indices) are written
  out, each with its checks.
- Gradients at kinks and ties follow PyTorch: ``relu'(0) = abs'(0) = 0``, ``maximum``/``minimum``
  split the gradient evenly between equal operands, ``clip`` passes it where
  ``lo <= x <= hi`` (and to ``hi`` alone where the bounds cross, ``lo > hi``), ``power``'s
  gradient is 0 where the exponent is 0 and, for the exponent, ``a ** b * log(a)`` written out
  as PyTorch does: 0 where the base is 0 and the exponent non-negative, -inf where the base is
  0 and the exponent negative, NaN for a negative base (and NaN second derivatives there).
- Complex numbers follow PyTorch: the gradient of a real loss ``L`` with respect to a complex
  ``z`` is ``dL/dRe(z) + i dL/dIm(z)`` (a vjp multiplies by the *conjugate* derivative, and
  ``abs``'s is ``g * z / |z|``), and a real input of complex arithmetic gets the real part of
  its gradient, ``dL/dx``. ``real``, ``imag``, ``abs`` (or ``var``) take complex values to a
  real loss. The ops whose gradient holds for real numbers only (``maximum``, ``minimum``,
  ``relu``, ``clip``, ``power``, ``logsumexp``, ``softmax``, ``log_softmax``) raise
  ``TypeError`` when a tape records them on complex values (unrecorded, they compute as NumPy
  does).
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

The ops live by concern in :mod:`~cupy_parallel._src.shape_ops` (shapes, indexing, joining,
``sum``, and ``fit``, every vjp's last step), :mod:`~cupy_parallel._src.elementwise` and
:mod:`~cupy_parallel._src.reduction_ops`. This module is their namespace; it registers their names
with the raw-NumPy guard, so that the guard's errors name the op to use while the tape never
imports the ops.
"""

from __future__ import annotations

from cupy_parallel._src.elementwise import (
    abs,
    add,
    clip,
    conj,
    divide,
    exp,
    imag,
    log,
    maximum,
    minimum,
    multiply,
    negative,
    power,
    real,
    relu,
    sqrt,
    square,
    subtract,
    tanh,
    where,
)
from cupy_parallel._src.guard import register_ops
from cupy_parallel._src.reduction_ops import (
    log_softmax,
    logsumexp,
    matmul,
    mean,
    softmax,
    softmax_cross_entropy,
    var,
)
from cupy_parallel._src.shape_ops import (
    concatenate,
    getitem,
    reshape,
    split,
    stack,
    sum,
    transpose,
)

__all__ = [
    "abs",
    "add",
    "clip",
    "concatenate",
    "conj",
    "divide",
    "exp",
    "getitem",
    "imag",
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
    "real",
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

register_ops(__all__)
