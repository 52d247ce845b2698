"""The HostArray dispatch guard: raw NumPy on a recorded host array would drop its gradient path.

While a tape is entered (in any thread), a HostArray dispatch guard refuses raw NumPy (a ufunc, a
``numpy`` function, an operator, a computing method) on arrays an active tape tracks: the tape
could not record it. Operations whose result carries no gradient (comparisons, ``argmax``, ...)
pass, and so does everything while recording is paused. The tape's own arithmetic and the ops
compute on the host buffers, so the guard never sees them.

The error names the ``cupy_parallel.ops`` equivalent of the refused operation: the ops module
registers its names here (:func:`register_ops`), so that this module never imports it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from cupy_parallel._src import tree
from cupy_parallel._src.hostarray import HostArray, set_dispatch_guard
from cupy_parallel._src.recording import active_tapes, in_backward

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["count_entered", "register_ops"]

_OPS: set[str] = set()
"""The names of the ``cupy_parallel.ops`` functions (:func:`register_ops` fills it)."""


def register_ops(names: Iterable[str], /) -> None:
    """Let the guard's errors name these ``cupy_parallel.ops`` functions (ops calls it)."""
    _OPS.update(names)


_NON_DIFFERENTIABLE = frozenset(
    {
        *("==", "!=", "<", "<=", ">", ">="),
        *("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"),
        *("isnan", "isinf", "isfinite", "isclose", "allclose", "array_equal", "signbit"),
        *("argmax", "argmin", "argsort", "argpartition", "nonzero", "flatnonzero"),
        *("count_nonzero", "searchsorted", "all", "any"),
        *("logical_and", "logical_or", "logical_not", "logical_xor"),
        *("shape", "ndim", "size", "result_type"),
    }
)
"""Operations whose results carry no gradient: raw NumPy may compute them on recorded arrays."""

_OPS_NAMES = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide", "true_divide": "divide"}
_OPS_NAMES |= {"@": "matmul", "**": "power", "absolute": "abs", "amax": "max", "amin": "min"}
"""Operator and NumPy names whose ``cupy_parallel.ops`` function has another name."""

_IN_PLACE = frozenset({"fill", "set", "sort", "partition", "put", "[]=", "copyto"})


def _refuse_raw_numpy(operation: str, operands: tuple[Any, ...]) -> None:
    """The dispatch guard: raise if ``operation`` touches a host array an active tape tracks."""
    tapes = active_tapes()
    if not tapes:
        return
    for x in tree.leaves(operands):
        if type(x) is HostArray and any(t.tracks(x) for t in tapes):
            name = operation.rpartition(" " if operation.startswith("operator") else ".")[2]
            if name not in _NON_DIFFERENTIABLE:
                raise TypeError(_raw_numpy_message(operation, name, len(operands)))
            return


def _raw_numpy_message(operation: str, name: str, count: int) -> str:
    if name in _IN_PLACE or (operation.startswith("operator") and name.endswith("=")):
        return (
            f"{operation} writes in place into an array a tape is recording, which would "
            "change the values its gradient is computed from. Write into a copy, compute a new "
            "array with cupy_parallel.ops, or write outside the `with tape:` block before the "
            "array is used."
        )
    if in_backward():
        return (
            f"{operation} is raw NumPy on an array an outer tape is recording, inside a "
            "gradient computation: a vector-Jacobian product (of an op, or the backward of a "
            "Function with differentiable_backward = True) is not written with recorded "
            "operations, so this gradient cannot be differentiated again (higher order). Write "
            "it with cupy_parallel.ops, or leave differentiable_backward False."
        )
    op = "negative" if name == "-" and count == 1 else _OPS_NAMES.get(name, name)
    use = f"cupy_parallel.ops.{op}" if op in _OPS else "a cupy_parallel.ops function"
    return (
        f"{operation} is raw NumPy on an array a tape is recording: the tape cannot see it, so "
        "the gradient would silently miss this path (on a GPU nothing could catch it). Use "
        f"{use} (or a cupy_parallel.Function), or cupy_parallel.stop_gradient(x) to use the "
        "values as a constant."
    )


_entered = 0  # tapes inside their `with` block, in all threads: the guard is installed while > 0
_entered_lock = threading.Lock()


def count_entered(change: int, /) -> None:
    """Count a tape entering (1) or leaving (-1) its block: the guard is on while any is in."""
    global _entered  # one process-wide guard, as hostarray has one hook
    with _entered_lock:
        _entered += change
        if _entered == change == 1:
            set_dispatch_guard(_refuse_raw_numpy)
        elif _entered == 0:
            set_dispatch_guard(None)
