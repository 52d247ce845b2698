"""Arrays on devices: which arrays this library places, where they live, and the raw move.

Three kinds of arrays are placed: ``numpy.ndarray`` on the ``"cpu"``, :class:`HostArray` on a
simulated ``"host:k"`` device, ``cupy.ndarray`` on ``"cuda:k"``. :func:`to_device` here is the
raw, non-differentiable copy used by library internals; the public ``cupy_parallel.to_device``
is the same move recorded on the tape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.devices import (
    CPU,
    Device,
    as_device,
    check_exists,
    is_cupy_array,
    require_cupy,
)
from cupy_parallel._src.hostarray import HostArray, check_device_dtype, host_array, host_buffer
from cupy_parallel._src.memory import get_host_memory_pool

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["array_namespace", "device_of", "empty", "is_array", "to_device"]

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13


def is_array(x: object, /) -> bool:
    """Whether ``x`` is an array this library places: ``numpy.ndarray``, HostArray or CuPy.

    Example:
        >>> import numpy as np
        >>> is_array(np.zeros(2)), is_array(3.0)
        (True, False)
    """
    return type(x) is HostArray or isinstance(x, np.ndarray) or is_cupy_array(x)


def device_of(array: Any, /) -> Device:
    """The device an array lives on: ``cpu`` for NumPy, ``host:k`` for HostArray, ``cuda:k``.

    Example:
        >>> import numpy as np
        >>> device_of(np.zeros(2))
        Device('cpu')
    """
    if type(array) is HostArray:
        return array.device
    if isinstance(array, np.ndarray):
        return CPU
    if is_cupy_array(array):
        return Device("cuda", int(array.device.id))
    raise TypeError(
        f"array must be a numpy.ndarray, HostArray or cupy.ndarray, got {type(array).__name__}."
    )


def array_namespace(array: Any, /) -> ModuleType:
    """``numpy`` or ``cupy``: the module that computes on ``array``'s device.

    NumPy computes on host arrays through its dispatch protocols (the result stays on the
    array's device), so it is their namespace as it is the cpu's: the one way to pick NumPy or
    CuPy is ``device.xp``.

    Example:
        >>> import numpy as np
        >>> array_namespace(np.zeros(1)) is np
        True
    """
    return device_of(array).xp


def empty(shape: tuple[int, ...] | int, dtype: Any, device: Any, /) -> Any:
    """An uninitialised C-contiguous array on ``device``.

    Host and cpu arrays of 128 KiB or more come from the host memory pool (see
    :mod:`cupy_parallel._src.memory`), CUDA arrays from CuPy's pool. On an accelerator the
    dtype must be one CuPy has (``TypeError`` otherwise, at every size); on the cpu any NumPy
    dtype is accepted (arrays of references, object or ``StringDType``, are never pooled).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import set_host_device_count
        >>> set_host_device_count(2)
        >>> empty((2, 3), np.float32, "host:1").device
        Device('host:1')
    """
    device = as_device(device)
    shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    check_exists(device)
    dtype = np.dtype(dtype) if device.kind == "cpu" else check_device_dtype(dtype, "dtype")
    if device.kind == "cuda":
        cupy = device.xp
        with device:
            return cupy.empty(shape, dtype)
    if dtype.hasobject or dtype.kind == "T":  # references (object, StringDType): never pooled
        return np.empty(shape, dtype)
    array = get_host_memory_pool().empty(shape, dtype)
    return array if device.kind == "cpu" else host_array(array, device)


def _from_dlpack(array: Any) -> Any:
    """A producer of another library as a NumPy (cpu) or CuPy (GPU) array; ``None`` if none."""
    if not (hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__")):
        return None
    kind, _ = array.__dlpack_device__()
    if kind in (_KDL_CPU, _KDL_CUDA_HOST):
        return np.from_dlpack(array)
    if kind in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        return require_cupy().from_dlpack(array)
    raise TypeError(
        f"array is a {type(array).__name__} in DLPack device type {kind}, which is neither "
        "cpu nor CUDA memory; move it to the cpu in its own library first."
    )


def to_device(array: Any, device: Any, /, *, stream: Any = None) -> Any:
    """Copy ``array`` to ``device``; one already there is returned as it is (as torch's ``.to``).

    The copy is C-contiguous with the same dtype and bits. ``stream`` (a ``cupy.cuda.Stream``)
    orders CUDA copies; host copies are synchronous and ignore it. Any DLPack producer (a torch
    tensor, a JAX array) is accepted and copied: a producer is never "already there", since the
    result is ours. Dtypes CuPy lacks (object, strings, datetime, structured) cannot go to an
    accelerator (``TypeError``, at every size).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import set_host_device_count
        >>> set_host_device_count(2)
        >>> h = to_device(np.arange(4), "host:1")
        >>> h
        HostArray([0, 1, 2, 3], device='host:1')
        >>> to_device(h, "cpu")
        array([0, 1, 2, 3])
    """
    foreign = None if is_array(array) else _from_dlpack(array)
    if foreign is not None:
        source_array = foreign
    elif is_array(array):
        source_array = array
    else:
        raise TypeError(
            f"array must be a numpy.ndarray, HostArray, cupy.ndarray or a DLPack producer, got "
            f"{type(array).__name__}."
        )
    source = device_of(source_array)
    target = as_device(device)
    if source == target and foreign is None:
        return array
    check_exists(target)
    if target.kind != "cpu":
        check_device_dtype(source_array.dtype, "array's dtype")
    if target.kind == "cuda":
        cupy = target.xp
        with target:
            out = cupy.empty(source_array.shape, source_array.dtype)
            if source.kind == "cuda":
                src = cupy.ascontiguousarray(source_array)
                out.data.copy_from_device_async(src.data, src.nbytes, stream=stream)
            else:
                out.set(np.ascontiguousarray(_buffer(source_array)), stream=stream)
        return out
    out = empty(source_array.shape, source_array.dtype, target)
    if source.kind == "cuda":
        _buffer(out)[...] = source_array.get(stream=stream)
    else:
        np.copyto(_buffer(out), _buffer(source_array), casting="no")
    return out


def _buffer(x: Any) -> Any:
    return host_buffer(x) if type(x) is HostArray else x
