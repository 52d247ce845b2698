"""How the MPI backend reduces: for each dtype and ``ReduceOp``, the MPI datatype and op.

A :class:`Plan` names the MPI datatype and op, the NumPy ufunc that reduces the local arrays
first, and the working dtype: ``float16`` and ``bfloat16`` (``ml_dtypes``) are reduced in
``float32`` and rounded once, to nearest even (portable: not every MPI reduces
``MPIX_C_FLOAT16``, none a bfloat16, and more accurate than pairwise 16-bit sums). ``bfloat16``
takes the reductions of floats: bitwise ones are refused.
``ReduceOp.AVG`` of integers is exact: integers of up to 32 bits are summed in ``int64``, 64-bit
integers as a quotient and a remainder (two parts per value), so that the sum never wraps (see
:func:`~cupy_parallel._src.averages.integer_average`).
``MIN``/``MAX`` of floating-point arrays order values totally so that every rank gets the same
bits: a NaN anywhere gives NaN (NumPy's ``minimum``/``maximum`` propagate NaN; the result is the
canonical NaN) and ``-0.0 < +0.0`` (IEEE 754-2019 ``minimum``/``maximum``). MPI's built-in
``MPI_MIN``/``MPI_MAX`` leave both to the order of evaluation.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from cupy_parallel._src.averages import integer_average
from cupy_parallel._src.distributed.mpi_job import load_mpi
from cupy_parallel._src.dtypes import canonical_dtype, is_bfloat16
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Plan", "make_plan"]

# ReduceOp -> (MPI op for numbers, MPI op for bool, NumPy ufunc for numbers, ufunc for bool).
# ``None`` marks a reduction the dtype family does not have.
_OPS: dict[ReduceOp, tuple[str, str | None, str, str | None]] = {
    ReduceOp.SUM: ("SUM", "LOR", "add", "logical_or"),
    ReduceOp.PRODUCT: ("PROD", "LAND", "multiply", "logical_and"),
    ReduceOp.MIN: ("MIN", "LAND", "minimum", "logical_and"),
    ReduceOp.MAX: ("MAX", "LOR", "maximum", "logical_or"),
    ReduceOp.AVG: ("SUM", None, "add", None),
    ReduceOp.BAND: ("BAND", "LAND", "bitwise_and", "logical_and"),
    ReduceOp.BOR: ("BOR", "LOR", "bitwise_or", "logical_or"),
    ReduceOp.BXOR: ("BXOR", "LXOR", "bitwise_xor", "logical_xor"),
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

_REDUCIBLE_KINDS = "biufc"
_FLOAT32 = np.dtype(np.float32)


class Plan(NamedTuple):
    """How to reduce one dtype with one op: MPI datatype/op, local ufunc, working dtype.

    ``parts`` is 2 for ``AVG`` of 64-bit integers: every value travels as a quotient and a
    remainder (:func:`~cupy_parallel._src.averages.encode_average`), so buffers
    have shape ``(2, *shape)``; else 1, and buffers have the arrays' shape.
    """

    mpi_type: Any
    mpi_op: Any
    ufunc: Callable[..., Any]  # (acc, operand, out=acc, casting="unsafe")
    # float16, bfloat16 -> float32; AVG of integers -> int64 (of 64-bit ones: their own, in
    # 2 parts); None: the arrays' dtype
    work_dtype: np.dtype[Any] | None
    average: bool
    parts: int = 1


# ---------------------------------------------------------------------------------------------
# MIN/MAX in a total order (every rank the same bits)


def _total_extremum(
    a: np.ndarray, b: np.ndarray, out: np.ndarray, *, largest: bool, casting: str = "same_kind"
) -> None:
    """``out = min(a, b)`` (``max`` if ``largest``) with NaN propagating and ``-0.0 < +0.0``."""
    del casting
    # (asarray: of 0-d arrays, NumPy's maximum is a scalar, which the fix-ups below write into)
    result = np.asarray(np.maximum(a, b) if largest else np.minimum(a, b))
    tie = a == b  # equal values differ in bits only for +-0.0
    if tie.any():
        negative = np.signbit(a)
        zeros = np.where(negative, b, a) if largest else np.where(negative, a, b)
        np.copyto(result, zeros, where=tie)
    nan = np.isnan(result)
    if nan.any():
        result[nan] = np.nan  # the canonical NaN, whatever payload a rank had
    out[...] = result


# By the MPI's Op class (mpi4py's, or thread ranks': see thread_mpi), dtype and which extremum.
_USER_OPS: dict[tuple[Any, np.dtype[Any], bool], Any] = {}


def _total_extremum_op(mpi: Any, dtype: np.dtype[Any], largest: bool) -> Any:
    """An MPI user operation computing :func:`_total_extremum` on buffers of ``dtype``."""
    op = _USER_OPS.get((mpi.Op, dtype, largest))
    if op is None:

        def combine(incoming: Any, inout: Any, _datatype: Any) -> None:
            a = np.frombuffer(incoming, dtype)
            b = np.frombuffer(inout, dtype)
            _total_extremum(a, b, b, largest=largest)

        op = mpi.Op.Create(combine, commute=True)
        _USER_OPS[mpi.Op, dtype, largest] = op
    return op


def make_plan(dtype: np.dtype[Any], op: ReduceOp | None, mpi: Any = None, /) -> Plan | None:
    """How to reduce ``dtype`` with ``op`` (``None``: data movement only, no plan).

    ``mpi``: the MPI module to take the datatypes and ops from (default: :func:`load_mpi`'s).

    Raises:
        TypeError: the dtype cannot be communicated, or not reduced with ``op``.

    Example:
        >>> import numpy as np
        >>> make_plan(np.dtype(np.float16), ReduceOp.SUM).work_dtype
        dtype('float32')
    """
    if dtype.hasobject:
        raise TypeError(
            f"arrays of dtype {dtype} hold Python objects, which cannot be communicated; "
            "convert them to a numeric dtype."
        )
    if op is None:
        return None
    bfloat16 = is_bfloat16(dtype)
    if dtype.kind not in _REDUCIBLE_KINDS and not bfloat16:
        raise TypeError(
            f"cannot reduce arrays of dtype {dtype}; reductions take bool, integer, float "
            "(float16/32/64, ml_dtypes' bfloat16) and complex arrays."
        )
    number_op, bool_op, number_ufunc, bool_ufunc = _OPS[op]
    if dtype.kind == "b":
        if bool_op is None or bool_ufunc is None:
            raise TypeError(
                f"ReduceOp.{op.name} is not defined for bool arrays; cast them to an "
                "integer or float dtype first."
            )
        number_op, number_ufunc = bool_op, bool_ufunc
    if op in _BITWISE and dtype.kind not in "biu":
        raise TypeError(
            f"ReduceOp.{op.name} is a bitwise reduction: it takes integer and bool arrays, "
            f"got dtype {dtype}."
        )
    if dtype.kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(
            f"ReduceOp.{op.name} is not defined for complex dtype {dtype} (complex numbers "
            "have no order); reduce the real and imaginary parts separately."
        )
    if not dtype.isnative:
        raise TypeError(
            f"cannot reduce arrays of non-native byte order ({dtype.str}); convert them with "
            "array.astype(array.dtype.newbyteorder('='))."
        )
    work_dtype = _FLOAT32 if dtype == np.float16 or bfloat16 else None
    parts = 1
    exact = integer_average(dtype) if op is ReduceOp.AVG else None
    if exact is not None:
        work_dtype, parts = exact
    if mpi is None:
        mpi = load_mpi()
    mpi_type = mpi.Datatype.fromcode(canonical_dtype(work_dtype or dtype).char)
    if (dtype.kind == "f" or bfloat16) and op in (ReduceOp.MIN, ReduceOp.MAX):
        largest = op is ReduceOp.MAX
        return Plan(
            mpi_type,
            _total_extremum_op(mpi, work_dtype or dtype, largest),
            functools.partial(_total_extremum, largest=largest),
            work_dtype,
            average=False,
        )
    return Plan(
        mpi_type,
        getattr(mpi, number_op),
        getattr(np, number_ufunc),
        work_dtype,
        op is ReduceOp.AVG,
        parts,
    )
