"""The host array's errors, in the caller's words: what CuPy refuses and how to do it instead.

Each builder returns the exception a device array raises where a ``cupy.ndarray`` on a GPU
refuses the same thing (the messages name CuPy's own words and the explicit move that fixes the
call); :mod:`cupy_parallel._src.hostarray` and :mod:`cupy_parallel._src.hostdispatch` raise them.

Example:
    >>> from cupy_parallel._src.devices import Device
    >>> print(cross_device("operator +", Device("host", 0), Device("host", 1)))
    operator + got arrays on different devices, host:0 and host:1. Move them to one device with
    cupy_parallel.to_device(array, device).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.devices import is_cupy_array

if TYPE_CHECKING:
    from cupy_parallel._src.devices import Device

__all__ = ["EXITS", "cross_device", "foreign", "implicit_conversion", "out_error"]


EXITS = "use `.get()` or cupy_parallel.to_device(array, 'cpu') to make a NumPy array explicitly"
"""The explicit ways off a device, named wherever an implicit one is refused."""


def implicit_conversion(what: str = "a NumPy array") -> TypeError:
    """The error for converting a device array implicitly (``numpy.asarray(h)``, ``memoryview``)."""
    return TypeError(
        f"Implicit conversion of a device array to {what} is not allowed (as for cupy.ndarray); "
        f"{EXITS}."
    )


def cross_device(operation: str, device: Device, other: Device) -> ValueError:
    """The error for mixing arrays of two devices (CuPy's peer-access error)."""
    return ValueError(
        f"{operation} got arrays on different devices, {device} and {other}. "
        "Move them to one device with cupy_parallel.to_device(array, device)."
    )


def foreign(operation: str, device: Device, x: Any) -> TypeError:
    """The error for an operand CuPy's kernels refuse (``_kernel.pyx``, ``_preprocess_arg``)."""
    move = f"cupy_parallel.to_device(array, '{device}')"
    if isinstance(x, np.ndarray):
        return TypeError(
            f"{operation} mixes an array on {device} with a plain numpy.ndarray (on cpu), "
            f"which CuPy would refuse too. Move it with {move}."
        )
    if is_cupy_array(x):
        return TypeError(
            f"{operation} mixes an array on {device} with a cupy.ndarray on cuda:"
            f"{x.device.id}. Move it with {move}."
        )
    if isinstance(x, list | tuple):
        return TypeError(
            f"{operation} got a {type(x).__name__} operand; device arrays take arrays of their "
            "own device and Python/NumPy scalars only (CuPy refuses sequences too: "
            f"'Unsupported type'). Make an array with {move}."
        )
    return TypeError(
        f"{operation} got an operand of unsupported type {type(x).__name__} (CuPy: "
        "'Unsupported type'); device arrays take arrays of their own device and Python/NumPy "
        "scalars."
    )


def out_error(operation: str, device: Device, out: Any) -> TypeError:
    """The error for an ``out=`` argument that is not an array on ``device``."""
    return TypeError(
        f"{operation}: out= must be an array on {device} (CuPy: 'Output arguments must be "
        f"cupy.ndarray'), got {type(out).__name__}."
    )
