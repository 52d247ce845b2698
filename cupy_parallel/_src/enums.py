"""The enumerations of the process-group API, :class:`Backend` and :class:`ReduceOp`.

Both the process groups and the CUDA layer below them (the NCCL tables) read them, so they import
only ``arguments`` (the bottom layer) from the package.
"""

from __future__ import annotations

import enum

from cupy_parallel._src.arguments import ArgumentError

__all__ = ["Backend", "ReduceOp"]

# Backends torch knows that this library does not implement, with the one to use instead.
_REPLACEMENTS = {
    "gloo": "Use Backend.MPI ('mpi') for NumPy/HostArray arrays on the CPU.",
    "tcp": "Use Backend.MPI ('mpi') for NumPy/HostArray arrays on the CPU.",
    "ucc": "Use Backend.NCCL ('nccl') for CuPy arrays or Backend.MPI ('mpi') for host arrays.",
}


class Backend(str, enum.Enum):
    """A communication backend: ``Backend.NCCL`` (CuPy arrays) or ``Backend.MPI`` (any host array).

    Members are strings, so ``Backend.MPI == "mpi"`` as in torch, and calling the class parses a
    name case-insensitively. ``"gloo"`` is not implemented here; the error names ``"mpi"``, which
    serves the same CPU use. A name that is not a string (``Backend(None)``) raises a
    ``TypeError`` that is also torch's ``ValueError`` (``ArgumentError``).

    Example:
        >>> Backend("MPI")
        <Backend.MPI: 'mpi'>
        >>> Backend.NCCL == "nccl"
        True
    """

    NCCL = "nccl"
    MPI = "mpi"

    @classmethod
    def _missing_(cls, value: object) -> Backend:
        if not isinstance(value, str):
            raise ArgumentError(
                f"backend must be a str or Backend ('nccl' or 'mpi'), got {type(value).__name__} "
                f"{value!r}."
            )
        name = value.strip().lower()
        for member in cls:
            if member.value == name:
                return member
        hint = _REPLACEMENTS.get(name, "Pass 'nccl' for CuPy arrays or 'mpi' for host arrays.")
        raise ValueError(f"backend must be 'nccl' or 'mpi', got {value!r}. {hint}")

    def __str__(self) -> str:
        return self.value


class ReduceOp(enum.Enum):
    """The element-wise reduction of ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    ``AVG`` divides the sum by the number of contributions. On integer dtypes the mean is exact,
    rounded toward zero (C's integer division), even where the sum overflows the dtype (both
    backends sum integers where they cannot wrap; torch's ``ncclAvg`` wraps); on ``bool`` it is
    refused. For ``bool`` arrays ``SUM`` and ``MAX`` are a logical or, ``PRODUCT`` and ``MIN`` a
    logical and (what summing and casting back to ``bool`` gives). ``MIN``/``MAX`` are refused on
    complex dtypes, which have no order; on floating-point dtypes they follow NumPy's
    ``minimum``/``maximum`` (a NaN anywhere gives NaN) and order ``-0.0 < +0.0``, so that every
    rank gets the same bits whatever order the backend combines values in.

    ``BAND``/``BOR``/``BXOR`` (PyTorch 2) are the bitwise and/or/xor of integer arrays and the
    logical ones of ``bool`` arrays; floating-point and complex arrays are refused. The MPI
    backend has them; NCCL has no bitwise reduction and refuses them.

    Example:
        >>> ReduceOp.SUM, ReduceOp["AVG"]
        (<ReduceOp.SUM: 'sum'>, <ReduceOp.AVG: 'avg'>)
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons, so identity is equality: hash them as objects, not by name in
    # Python (enum's default), since every reduction looks its plan up per call.
    __hash__ = object.__hash__
