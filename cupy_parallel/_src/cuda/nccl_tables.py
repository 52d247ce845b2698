"""What NCCL can do with which dtype: its type and operation constants, and the tables onto them.

Pure Python, importable without CuPy or NCCL, so that the tables can be checked anywhere. All
NCCL code of the library (``comm`` through :mod:`.nccl_comm`, and the ``"nccl"`` process-group
backend) asks :func:`reduction` how to reduce an array and :func:`transfer` how to move one;
everything NCCL refuses is refused here, once, in the caller's words.

Decisions (where torch's ProcessGroupNCCL is the model):

- Moving data (broadcast, gather, scatter, all_gather, all_to_all, send/recv) copies bytes: any
  dtype CuPy holds travels as ``count * itemsize`` values of ``NCCL_UINT8``, bit-exactly (bool,
  int16, complex, ...).
- Reductions use NCCL's typed kernels: int8, uint8, int32, uint32, int64, uint64, float16,
  float32, float64 and bfloat16 (CuPy >= 14 with ``ml_dtypes``; NCCL >= 2.10) as themselves.
  So ``float16`` (and bfloat16) is reduced *in float16*: NCCL adds the partial results in the
  array's own precision, and the rounding error grows with the number of participants (the
  ``"mpi"`` backend instead reduces float16 in float32 and rounds once). Reduce a float32 copy
  when that matters.
  NCCL has no 16-bit integer type: int16/uint16 are refused (cast to int32).
- ``bool`` is reduced as uint8 0/1: ``SUM`` and ``MAX`` become NCCL's ``MAX`` (logical or),
  ``PRODUCT`` and ``MIN`` its ``MIN`` (logical and); ``AVG`` is refused (as in torch).
- ``complex64``/``complex128`` are reduced as pairs of float32/float64: ``SUM`` and ``AVG`` act
  on the real and imaginary parts separately, which is exact; ``PRODUCT``, ``MIN`` and ``MAX``
  would not be (and complex numbers have no order), so they are refused.
- ``AVG`` uses ``ncclAvg`` from NCCL 2.10 on; before, it is ``SUM`` followed by a division by the
  number of participants. ``AVG`` of integers is exact instead, rounded toward zero: ``ncclAvg``
  sums integers in their own dtype, which wraps (two int8 100s average to -28), so each value
  is first *encoded* in a buffer of its own (``int64`` for integers of up to 32 bits, a quotient
  and a remainder of the dtype for 64-bit ones: ``averages.encode_average``), the
  buffers are reduced with ``SUM`` (which cannot wrap) and the mean is decoded from the sum.

Example:
    >>> import numpy as np
    >>> import cupy_parallel
    >>> from cupy_parallel._src.enums import ReduceOp
    >>> plan = reduction(np.dtype("complex64"), ReduceOp.SUM, version_code(2, 18, 5))
    >>> plan.datatype, plan.lanes, plan.op
    (<NcclDataType.FLOAT32: 7>, 2, <NcclRedOp.SUM: 0>)
    >>> reduction(np.dtype("int64"), ReduceOp.AVG, version_code(2, 18, 5)).encoded
    True
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from cupy_parallel._src.averages import integer_average

# The one enum of reductions lives in the bottom layer (enums.py imports nothing).
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "AVG_VERSION",
    "P2P_VERSION",
    "NcclDataType",
    "NcclRedOp",
    "Reduction",
    "reduction",
    "transfer",
    "version_code",
    "version_string",
]


class NcclDataType(enum.IntEnum):
    """NCCL's ``ncclDataType_t`` values used here; ``NCCL_<name>`` in :mod:`cupy.cuda.nccl`.

    Example:
        >>> NcclDataType.FLOAT32.value
        7
    """

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9


class NcclRedOp(enum.IntEnum):
    """NCCL's ``ncclRedOp_t`` values; ``NCCL_<name>`` in :mod:`cupy.cuda.nccl`.

    Example:
        >>> NcclRedOp.AVG.value
        4
    """

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


def version_code(major: int, minor: int, patch: int, /) -> int:
    """NCCL's integer version code (its ``NCCL_VERSION`` macro), as ``nccl.get_version()`` returns.

    Example:
        >>> version_code(2, 7, 8), version_code(2, 18, 5)
        (2708, 21805)
    """
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def version_string(code: int, /) -> str:
    """The dotted form of a version code (``0``: a NCCL too old to report its version).

    Example:
        >>> version_string(2708), version_string(21805), version_string(0)
        ('2.7.8', '2.18.5', 'older than 2.3.4')
    """
    if code == 0:
        return "older than 2.3.4"
    if code < 10000:
        major, rest = divmod(code, 1000)
    else:
        major, rest = divmod(code, 10000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


AVG_VERSION = version_code(2, 10, 0)
"""First NCCL with ``ncclAvg`` and ``ncclBfloat16``."""
P2P_VERSION = version_code(2, 7, 0)
"""First NCCL with ``ncclSend``/``ncclRecv`` (send/recv, gather, scatter, all_to_all)."""


class _Family(enum.Enum):
    LOGICAL = "logical"
    INTEGER = "integer"
    FLOATING = "floating"
    COMPLEX = "complex"


@dataclass(frozen=True)
class _Wire:
    datatype: NcclDataType
    lanes: int  # NCCL values per array element
    family: _Family


# dtype name -> how NCCL reduces it. Names, not dtype objects: one key for 'l' and 'q' alike.
_WIRE: dict[str, _Wire] = {
    "bool": _Wire(NcclDataType.UINT8, 1, _Family.LOGICAL),
    "int8": _Wire(NcclDataType.INT8, 1, _Family.INTEGER),
    "uint8": _Wire(NcclDataType.UINT8, 1, _Family.INTEGER),
    "int32": _Wire(NcclDataType.INT32, 1, _Family.INTEGER),
    "uint32": _Wire(NcclDataType.UINT32, 1, _Family.INTEGER),
    "int64": _Wire(NcclDataType.INT64, 1, _Family.INTEGER),
    "uint64": _Wire(NcclDataType.UINT64, 1, _Family.INTEGER),
    "float16": _Wire(NcclDataType.FLOAT16, 1, _Family.FLOATING),
    "float32": _Wire(NcclDataType.FLOAT32, 1, _Family.FLOATING),
    "float64": _Wire(NcclDataType.FLOAT64, 1, _Family.FLOATING),
    "bfloat16": _Wire(NcclDataType.BFLOAT16, 1, _Family.FLOATING),
    "complex64": _Wire(NcclDataType.FLOAT32, 2, _Family.COMPLEX),
    "complex128": _Wire(NcclDataType.FLOAT64, 2, _Family.COMPLEX),
}

# The one table from ReduceOp to NCCL's operation.
_NCCL_OPS: dict[ReduceOp, NcclRedOp] = {
    ReduceOp.SUM: NcclRedOp.SUM,
    ReduceOp.PRODUCT: NcclRedOp.PROD,
    ReduceOp.MIN: NcclRedOp.MIN,
    ReduceOp.MAX: NcclRedOp.MAX,
    ReduceOp.AVG: NcclRedOp.AVG,
}

# On bool (0/1 bytes), sum and product are computed as their logical meaning.
_LOGICAL: dict[ReduceOp, ReduceOp] = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN}

# Combinations NCCL cannot reduce, with what to do instead.
_REFUSED: dict[tuple[_Family, ReduceOp], str] = {
    (_Family.LOGICAL, ReduceOp.AVG): (
        "the mean of booleans is not a boolean; cast to a floating dtype first"
    ),
    (_Family.COMPLEX, ReduceOp.PRODUCT): (
        "NCCL reduces complex arrays as pairs of floats, which multiplies parts separately; "
        "reduce the real and imaginary parts (or use the 'mpi' backend)"
    ),
    (_Family.COMPLEX, ReduceOp.MIN): "complex numbers have no order; reduce abs() or the parts",
    (_Family.COMPLEX, ReduceOp.MAX): "complex numbers have no order; reduce abs() or the parts",
}


@dataclass(frozen=True)
class Reduction:
    """How NCCL reduces one array: ``lanes * array.size`` values of ``datatype`` with ``op``.

    ``divide`` asks the caller to divide the result by the number of participants (``AVG`` on a
    NCCL without ``ncclAvg``). ``encoded`` (``AVG`` of integers): NCCL reduces a buffer of
    ``lanes`` values of ``datatype`` per element that the caller fills with
    ``encode_average`` and decodes with ``decode_average`` (see the module).

    Example:
        >>> Reduction(NcclDataType.UINT8, 1, NcclRedOp.MAX, divide=False).lanes
        1
    """

    datatype: NcclDataType
    lanes: int
    op: NcclRedOp
    divide: bool
    encoded: bool = False


def _reducible() -> str:
    return ", ".join(_WIRE)


def reduction(dtype: np.dtype[Any], op: ReduceOp, version: int, /) -> Reduction:
    """How NCCL ``version`` (a :func:`version_code`) reduces arrays of ``dtype`` with ``op``.

    Raises:
        TypeError: NCCL cannot reduce ``dtype`` with ``op`` (the message says what to do).
        NotImplementedError: ``op`` is a ``ReduceOp`` this backend does not know, or ``dtype`` is
            bfloat16 and NCCL is older than 2.10.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel._src.enums import ReduceOp
        >>> reduction(np.dtype(bool), ReduceOp.SUM, version_code(2, 18, 5)).op
        <NcclRedOp.MAX: 2>
        >>> reduction(np.dtype("int16"), ReduceOp.SUM, version_code(2, 18, 5))
        Traceback (most recent call last):
        ...
        TypeError: NCCL cannot reduce int16 arrays (ReduceOp.SUM): it reduces bool, int8, ...
    """
    wire = _WIRE.get(dtype.name)
    if wire is None:
        raise TypeError(
            f"NCCL cannot reduce {dtype} arrays (ReduceOp.{op.name}): it reduces {_reducible()}; "
            "cast the array to one of them (int16 -> int32, ...) or use the 'mpi' backend."
        )
    if wire.datatype is NcclDataType.BFLOAT16 and version < AVG_VERSION:
        raise NotImplementedError(
            f"NCCL {version_string(version)} cannot reduce bfloat16 arrays (NCCL >= 2.10 can); "
            "upgrade NCCL or reduce a float32 copy."
        )
    refused = _REFUSED.get((wire.family, op))
    if refused is not None:
        raise TypeError(f"NCCL cannot reduce {dtype} arrays with ReduceOp.{op.name}: {refused}.")
    if wire.family is _Family.INTEGER and op is ReduceOp.AVG:
        summed, parts = cast("tuple[np.dtype[Any], int]", integer_average(dtype))
        datatype = _WIRE[summed.name].datatype
        return Reduction(datatype, parts, NcclRedOp.SUM, divide=False, encoded=True)
    if wire.family is _Family.LOGICAL:
        op = _LOGICAL.get(op, op)
    nccl_op = _NCCL_OPS.get(op)
    if nccl_op is None:
        raise NotImplementedError(
            f"ReduceOp.{op.name} has no NCCL counterpart; use one of "
            f"{', '.join(o.name for o in _NCCL_OPS)}."
        )
    divide = nccl_op is NcclRedOp.AVG and version < AVG_VERSION
    if divide:
        nccl_op = NcclRedOp.SUM
    return Reduction(wire.datatype, wire.lanes, nccl_op, divide)


def transfer(dtype: np.dtype[Any], /) -> int:
    """Bytes per element of ``dtype`` when NCCL moves it as ``NCCL_UINT8``.

    Raises:
        TypeError: ``dtype`` holds Python objects, which have no bytes to move.

    Example:
        >>> import numpy as np
        >>> transfer(np.dtype("complex128")), transfer(np.dtype(bool))
        (16, 1)
    """
    if dtype.hasobject or dtype.itemsize == 0:
        raise TypeError(
            f"NCCL moves arrays as bytes, and {dtype} arrays have no fixed-size bytes; use a "
            "numeric dtype."
        )
    return dtype.itemsize
