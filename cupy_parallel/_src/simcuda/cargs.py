"""Python → C integer arguments, converted as CuPy's Cython functions convert them.

CuPy's runtime and NCCL functions are Cython functions with C-typed parameters
(``memcpyAsync(intptr_t dst, intptr_t src, size_t size, int kind, intptr_t stream)``); a value
of the wrong Python type raises ``TypeError`` ("an integer is required") before any CUDA call.
:func:`as_c_int` is that conversion for every simulated function, so that code passing a
``MemoryPointer`` where an ``intptr_t`` is due fails under the simulator as on a GPU.

Measured on CuPy 14 (Cython 3), not guessed (``tests/test_simcuda_conformance.py`` checks it):

- ``intptr_t`` takes Python ``int`` and its subclasses (``bool``, ``IntEnum``) only: NumPy
  integers, floats, ``MemoryPointer`` and objects with ``__index__`` are refused.
- ``int``, ``size_t`` and ``ptrdiff_t`` take ``int`` and anything whose type has ``__int__``
  (floats, truncated; NumPy scalars; CuPy's ``MemoryPointer`` and ``Device``), but not objects
  with only ``__index__``, strings or ``None``.
- Out-of-range values raise ``OverflowError`` with Cython's messages.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["CType", "as_c_int"]

CType = Literal["int", "size_t", "ptrdiff_t", "intptr_t"]

_LONG = 1 << 63


def as_c_int(value: Any, name: str, ctype: CType = "int") -> int:
    """``value`` as the C integer type ``ctype`` of parameter ``name``, or Cython's error.

    Example:
        >>> as_c_int(3.7, "count", "size_t"), as_c_int(True, "stream", "intptr_t")
        (3, 1)
        >>> import numpy as np
        >>> as_c_int(np.int64(4), "ptr", "intptr_t")
        Traceback (most recent call last):
        TypeError: an integer is required (parameter 'ptr' is intptr_t, got int64)
    """
    if isinstance(value, int):
        number = int(value)
    else:
        convert = None if ctype == "intptr_t" else getattr(type(value), "__int__", None)
        if convert is None:
            raise TypeError(
                f"an integer is required (parameter {name!r} is {ctype}, got "
                f"{type(value).__name__})"
            )
        number = convert(value)
        if not isinstance(number, int):
            raise TypeError(f"__int__ returned non-int (type {type(number).__name__})")
    return _in_range(int(number), ctype)


def _in_range(number: int, ctype: CType) -> int:
    if ctype == "size_t":
        if number < 0:
            raise OverflowError("can't convert negative value to size_t")
        if number >= 1 << 64:
            raise OverflowError("Python int too large to convert to C unsigned long")
        return number
    if not -_LONG <= number < _LONG:
        c_name = "ssize_t" if ctype == "intptr_t" else "long"
        raise OverflowError(f"Python int too large to convert to C {c_name}")
    if ctype == "int" and not -(1 << 31) <= number < 1 << 31:
        raise OverflowError("value too large to convert to int")
    return number
