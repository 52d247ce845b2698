"""The dtypes and scalars device arrays take: those CuPy has (``cupy/_core/_dtype.pyx``).

Bool, integers, float16/32/64, complex64/128 and (with the ``ml_dtypes`` package, as CuPy 14
has it) bfloat16, in native byte order; :func:`check_device_dtype` is the one check, for CUDA
arrays and host arrays alike (a host device refuses what a GPU refuses). Nothing here imports
CuPy or ``ml_dtypes`` (a bfloat16 dtype exists only where ``ml_dtypes`` was imported).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "DEVICE_DTYPE_CHARS",
    "SCALAR_TYPES",
    "canonical_dtype",
    "check_device_dtype",
    "is_bfloat16",
]


DEVICE_DTYPE_CHARS = frozenset("?bBhHiIlLqQefdFD")
SCALAR_TYPES = frozenset(
    {int, float, bool, complex} | {np.dtype(c).type for c in DEVICE_DTYPE_CHARS}
)
"""Operands CuPy's kernels take as scalars (``cupy/_core/_scalar.pyx``, ``scalar_type_set``)."""


def is_bfloat16(dtype: np.dtype[Any], /) -> bool:
    """Whether ``dtype`` is ``ml_dtypes.bfloat16`` (a NumPy extension dtype CuPy 14 holds).

    Example:
        >>> is_bfloat16(np.dtype(np.float16))
        False
    """
    return dtype.kind == "V" and dtype.name == "bfloat16" and dtype.itemsize == 2


def canonical_dtype(dtype: np.dtype[Any], /) -> np.dtype[Any]:
    """``dtype``, an integer one as the C type NumPy picks for its size and byte order.

    NumPy has two C types for some integer sizes (64-bit: C's ``long`` and ``long long``,
    ``"l"`` and ``"q"`` on Linux; 32-bit ``int`` and ``long`` on Windows): the two dtypes are
    equal and hold the same bytes, but differ in ``num`` and ``char``, which is what MPI's
    datatypes and the ranks' comparisons of their calls go by. Both become one here, so that
    an ``np.longlong`` array on one rank and an ``np.int64`` array on another (equal to NumPy,
    as to torch, which has one ``int64``) make the same call.

    Example:
        >>> canonical_dtype(np.dtype(np.longlong)).num == np.dtype(np.int64).num
        True
    """
    return np.dtype(dtype.str) if dtype.kind in "iu" else dtype


def check_device_dtype(dtype: Any, name: str, /) -> np.dtype[Any]:
    """``numpy.dtype(dtype)`` if CuPy has it, else ``TypeError`` naming ``name``.

    CuPy computes on bool, integer, float16/32/64 and complex64/128 arrays in native byte order
    (``cupy/_core/_dtype.pyx``, ``check_supported_dtype``), and CuPy 14 on ``ml_dtypes.bfloat16``
    arrays (``pip install cupy-parallel[bfloat16]`` brings ``ml_dtypes``); object, string, datetime,
    timedelta, ``longdouble`` and ``StringDType`` arrays exist only on the cpu, and CuPy refuses
    big-endian dtypes. Structured and void dtypes are refused too: CuPy's main branch can hold
    their bytes but computes nothing on them, so a host device refuses them at the boundary.
    The error is a ``TypeError`` (CuPy raises ``ValueError('Unsupported dtype ...')``), the same
    at every size.

    Example:
        >>> check_device_dtype("float32", "dtype")
        dtype('float32')
    """
    read = np.dtype(dtype)
    if (read.char not in DEVICE_DTYPE_CHARS and not is_bfloat16(read)) or not read.isnative:
        raise TypeError(
            f"{name} is {read}, a dtype device arrays cannot hold (CuPy has bool, integer, "
            "float16/32/64, complex64/128 and ml_dtypes' bfloat16 arrays only, in native byte "
            "order); keep such data on the cpu as a NumPy array."
        )
    return read
