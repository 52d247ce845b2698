"""Where the autodiff layer computes: on an array's own device, in its namespace.

CuPy computes on its *current* device, so CUDA work enters the array's device. A HostArray
computes on its buffer and wraps the result on its device: the tape's arithmetic never goes
through the HostArray's NumPy dispatch, so the tape's guard against raw NumPy on recorded host
arrays never fires for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer, plain_buffer

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["compute", "cuda_device", "on_device_of", "ones_like", "zeros_like"]

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
