"""Where the autodiff layer computes: on an array's own device, in its namespace.

CuPy computes on its *current* device, so CUDA work enters the array's device. A HostArray
computes on its buffer and wraps the result on its device: the tape's arithmetic and the ops
never go through the HostArray's NumPy dispatch, so the tape's guard against raw NumPy on
recorded host arrays never fires for library code, and it stays fast.

Two calling conventions: :func:`on_device_of` and :func:`compute` call a function of the arrays
themselves (the tape's own arithmetic: zeros, sums of gradients, casts); :func:`run_kernel` calls
``kernel(xp, *args)`` with the array namespace first (the ops, whose kernels name NumPy or CuPy
functions through ``xp``), and :func:`run_on` is its fast path for an op of one array.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer, plain_buffer

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "SCALARS",
    "compute",
    "cuda_device",
    "host_operand",
    "named_kernel",
    "on_device_of",
    "ones_like",
    "run_kernel",
    "run_on",
    "zeros_like",
]

# --------------------------------------------------------------------------------------------
# The tape's own arithmetic: a function of the arrays, on their device


def cuda_device(x: Any, /) -> Any:
    """The ``cupy.cuda.Device`` of a CuPy array, ``None`` for host arrays and scalars."""
    if isinstance(x, np.ndarray) or type(x) is HostArray or not is_array(x):
        return None
    return x.device


def on_device_of(x: Any, fn: Callable[..., Any], /, *args: Any) -> Any:
    """``fn(*args)`` with CuPy's current device set to that of ``x`` (a plain call on the host)."""
    device = cuda_device(x)
    if device is None:
        return fn(*args)
    with device:
        return fn(*args)


def compute(fn: Callable[..., Any], x: Any, /, *args: Any) -> Any:
    """``fn(x, *args)`` on ``x``'s device; a HostArray through its buffer.

    For the tape's own arithmetic (zeros, sums of gradients, casts): the buffers skip the
    HostArray dispatch guard, which refuses raw NumPy on recorded arrays in *user* code.
    """
    if type(x) is HostArray:
        z = fn(host_buffer(x), *[plain_buffer(a) for a in args])
        return host_array(z if type(z) is np.ndarray else np.asarray(z), x.device)
    return on_device_of(x, fn, x, *args)


def _xp(x: Any) -> Any:
    return np if type(x) is np.ndarray or type(x) is HostArray else device_of(x).xp


def zeros_like(x: Any, /) -> Any:
    """Zeros shaped like ``x`` on ``x``'s device (a HostArray stays on its host device)."""
    return compute(_xp(x).zeros_like, x)


def ones_like(x: Any, /) -> Any:
    """Ones shaped like ``x`` on ``x``'s device."""
    return compute(_xp(x).ones_like, x)


# --------------------------------------------------------------------------------------------
# Where ops compute: ``kernel(xp, *args)`` in the namespace of the placing operand

SCALARS = (int, float, complex, np.generic)
"""What ops accept as a constant operand besides arrays: Python and NumPy scalars."""


def _result(z: Any) -> Any:
    return z if type(z) is np.ndarray else np.asarray(z)


def host_operand(a: Any, device: Any, name: str) -> Any:
    """The buffer of a host-array operand on ``device``; refuse arrays elsewhere."""
    if isinstance(a, HostArray):
        if a.device is not device and a.device != device:
            raise ValueError(
                f"ops.{name} got arrays on different devices, {device} and {a.device}. "
                "Move them to one device with cupy_parallel.to_device(array, device)."
            )
        return host_buffer(a)
    if isinstance(a, list):  # the arrays of concatenate/stack (an index tuple stays as is)
        return [host_operand(b, device, name) for b in a]
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


def run_kernel(kernel: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
    """``kernel(xp, *args, **kwargs)`` in the namespace ``xp`` of ``x``, on its device.

    ``x`` is the placing operand. Host arrays compute on their buffers (so the tape's guard on
    raw NumPy never sees them) and get their device back; CuPy enters the array's GPU.
    """
    if type(x) is np.ndarray or isinstance(x, SCALARS):
        z = kernel(np, *args, **kwargs)
        return z if isinstance(z, list) else _result(z)
    if isinstance(x, HostArray):
        device = x.device
        name = kernel.__name__
        raw = [host_operand(a, device, name) for a in args]
        return _host_result(kernel(np, *raw, **kwargs), device)
    device = cuda_device(x)
    if device is None:
        raise TypeError(
            f"ops.{kernel.__name__} takes arrays (NumPy, HostArray, CuPy) or Python/NumPy "
            f"scalars, got {type(x).__name__}."
        )
    with device:
        return kernel(cupy_module(), *args, **kwargs)


def run_on(kernel: Callable[..., Any], x: Any, /, *args: Any) -> Any:
    """``run_kernel(kernel, x, x, *args)`` for an ``args`` holding no array (axes, a shape, flags).

    The ops of one array (sums, shapes) call it: it skips ``run_kernel``'s look at every operand
    (on a host array 2 us of a 3.5 us ``sum``), so the caller must know that ``args`` holds no
    array (for what a user passes, a tuple or an int, whose items NumPy reads itself).
    """
    if type(x) is np.ndarray:
        z = kernel(np, x, *args)
        return z if type(z) is np.ndarray else np.asarray(z)  # NumPy's 0-d result
    if type(x) is HostArray:
        z = kernel(np, host_buffer(x), *args)
        return host_array(z if type(z) is np.ndarray else np.asarray(z), x.device)
    return run_kernel(kernel, x, x, *args)


def named_kernel(name: str) -> Callable[..., Any]:
    """The kernel calling ``xp.<name>``."""

    def kernel(xp: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(xp, name)(*args, **kwargs)

    kernel.__name__ = name
    return kernel
