"""``ReduceOp.AVG`` with the dtype's own arithmetic: floats divide, integers average exactly.

Every backend's ``AVG`` (``"mpi"``, thread ranks, ``"nccl"``, the DDP buckets) is one of two
things: the sum divided by the number of participants (:func:`average_in_place`; integers round
toward zero, as NCCL's ``ncclAvg`` and C's division do), or, for integers, an exact mean from a
sum that cannot wrap: :func:`integer_average` says what to sum, :func:`encode_average` writes a
value's contribution and :func:`decode_average` turns the total into the mean. NumPy or CuPy
arrays alike (``xp`` is the module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["average_in_place", "decode_average", "encode_average", "integer_average"]


def average_in_place(x: Any, count: int, xp: ModuleType, /) -> None:
    """``x /= count`` in place with NumPy or CuPy: floats divide, integers round toward zero.

    A complex ``x`` divides its real and imaginary parts by ``count`` (as NCCL's average of
    the float pairs torch reduces complex tensors as): the mean of ``inf+0j`` and ``inf+0j`` is
    ``inf+0j``, where dividing by a complex ``count`` (NumPy's ``x / 2``) gives ``inf+nanj``.

    Integers round toward zero, as NCCL's ``ncclAvg`` and C's division do: ``x - fmod(x, count)``
    is an exact multiple of ``count`` (``fmod`` keeps the sign of ``x``), so the floor division
    after it is exact. ``x`` holds a sum: for ``ReduceOp.AVG`` of integers the sum must not have
    wrapped, which :func:`integer_average` arranges.

    Example:
        >>> import numpy as np
        >>> x = np.array([-7, 7, 6], dtype=np.int32)
        >>> average_in_place(x, 2, np)
        >>> x
        array([-3,  3,  3], dtype=int32)
    """
    if x.dtype.kind == "c":  # each part by a real count (see above)
        n = x.real.dtype.type(count)
        xp.divide(x.real, n, out=x.real)
        xp.divide(x.imag, n, out=x.imag)
        return
    n = x.dtype.type(count)
    if x.dtype.kind in "iu":
        xp.subtract(x, xp.fmod(x, n), out=x)
        xp.floor_divide(x, n, out=x)
    else:
        xp.divide(x, n, out=x)


# ---------------------------------------------------------------------------------------------
# ReduceOp.AVG of integers, exactly
#
# The mean of in-range integers is in range, but their sum need not be (two int8 100s sum to
# 200, which wraps to -56). So no backend sums integers in their own dtype for AVG:
#
# * up to 32 bits: every value is sent as an int64 (one "part"). n contributions of magnitude
#   <= 2**32 sum to at most n * 2**32 < 2**63 for n < 2**31 (group size times local arrays; MPI
#   and NCCL count ranks in a C int), so no partial sum wraps, in any order of summation; the
#   sum is divided rounding toward zero (average_in_place) and the result, a mean, fits.
# * 64 bits: each value x is sent as two parts of its own dtype, q = trunc(x / n) and
#   r = x - n * q (C's quotient and remainder: |r| < n, r has x's sign), which sum separately.
#   |q| <= |x| / n, so any partial sum of at most n quotients lies within
#   [-n * 2**63 / n, n * (2**63 - 1) / n] = [INT64_MIN, INT64_MAX] (uint64: [0, UINT64_MAX]),
#   whatever the order or tree of the summation; the remainders sum to |R| < n**2 < 2**62.
#   With Q = sum(q), the sum is n * Q + R and the mean m = Q + R / n, so
#   floor(m) = Q + floor(R / n): two in-range numbers whose exact sum, floor(m), is in range
#   (m is a mean of in-range values; INT64_MIN is an integer), so the addition cannot wrap.
#   Rounding toward zero adds 1 where m is negative and not an integer, i.e. where
#   R mod n != 0 (then floor(m) < m < floor(m) + 1, so m < 0 exactly when floor(m) < 0);
#   floor(m) + 1 <= 0 cannot wrap. Unsigned values need no correction (m >= 0).

_INT64 = np.dtype(np.int64)


def integer_average(dtype: np.dtype[Any], /) -> tuple[np.dtype[Any], int] | None:
    """How ``ReduceOp.AVG`` sums ``dtype`` exactly: ``(dtype summed, parts per value)``.

    ``None`` for non-integer dtypes (which are summed as themselves and divided). See the
    comment above for why the sums cannot wrap.

    Example:
        >>> import numpy as np
        >>> integer_average(np.dtype(np.int8)), integer_average(np.dtype(np.uint64))
        ((dtype('int64'), 1), (dtype('uint64'), 2))
    """
    if dtype.kind not in "iu":
        return None
    if dtype.itemsize < 8:
        return _INT64, 1
    return dtype, 2


def encode_average(x: Any, count: int, out: Any, xp: ModuleType, /) -> None:
    """Write ``x``'s contribution to an exact integer ``AVG`` over ``count`` values into ``out``.

    ``out`` has shape ``(parts, *x.shape)`` and the dtype :func:`integer_average` gives; adding
    contributions element-wise (locally, then with the backend's ``SUM``) never wraps, and
    :func:`decode_average` turns the total into the mean.

    Example:
        >>> import numpy as np
        >>> out = np.zeros((2, 2), np.int64)
        >>> encode_average(np.array([-7, 7]), 2, out, np)
        >>> out.tolist()  # quotients (toward zero), remainders
        [[-3, 3], [-1, 1]]
    """
    if out.shape[0] == 1:
        out[0, ...] = x
        return
    n = out.dtype.type(count)
    quotient, remainder = out[0, ...], out[1, ...]
    xp.fmod(x, n, out=remainder)
    xp.subtract(x, remainder, out=quotient)  # an exact multiple of n, between 0 and x
    xp.floor_divide(quotient, n, out=quotient)


def decode_average(total: Any, count: int, xp: ModuleType, /) -> Any:
    """The mean, rounded toward zero, from the sum of :func:`encode_average`'s contributions.

    ``total`` has shape ``(parts, *shape)``; the result has shape ``shape`` and ``total``'s
    dtype (a view of ``total`` for one part), to be cast to the arrays' dtype.

    Example:
        >>> import numpy as np
        >>> big = np.iinfo(np.int64).max
        >>> parts = [np.zeros((2, 1), np.int64) for _ in range(3)]
        >>> for x, out in zip([big, big, -1], parts):
        ...     encode_average(np.array([x]), 3, out, np)
        >>> decode_average(sum(parts), 3, np) == (2 * big - 1) // 3
        array([ True])
    """
    if total.shape[0] == 1:
        mean = total[0, ...]
        average_in_place(mean, count, xp)
        return mean
    n = total.dtype.type(count)
    quotients, remainders = total[0, ...], total[1, ...]
    mean = xp.asarray(xp.floor_divide(remainders, n))  # (NumPy's of 0-d arrays: a scalar)
    xp.add(mean, quotients, out=mean)  # floor(mean): cannot wrap (see above)
    if total.dtype.kind == "i":
        toward_zero = (xp.remainder(remainders, n) != 0) & (mean < 0)
        xp.add(mean, toward_zero, out=mean, casting="unsafe")
    return mean
