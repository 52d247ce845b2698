"""The simulated ``cupy`` namespace (what ``cupy_module()`` returns inside ``simulated_cuda``).

Array creation (``empty``, ``zeros``, ``ones``, ``full``, ``*_like``, ``asarray``/``array`` from
host data, ``ascontiguousarray``), ``asnumpy``, ``get_array_module``, the two default pools,
``cuda`` and ``ElementwiseKernel`` (straight-line bodies: :mod:`.kernels`). Every other NumPy
function name is available and runs as one kernel on the current stream (see
:func:`.ndarray.apply`); NumPy types and constants (``float32``, ``pi``) are NumPy's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.simcuda import cuda
from cupy_parallel._src.simcuda.clock import Simulation, state
from cupy_parallel._src.simcuda.kernels import ElementwiseKernel
from cupy_parallel._src.simcuda.ndarray import apply, launch, ndarray
from cupy_parallel._src.simcuda.pointers import device_pool, pinned_pool

if TYPE_CHECKING:
    import types

    from cupy_parallel._src.simcuda.memory import DevicePool, PinnedPool

__all__ = [
    "ElementwiseKernel",
    "array",
    "asarray",
    "ascontiguousarray",
    "asnumpy",
    "cuda",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "get_array_module",
    "get_default_memory_pool",
    "get_default_pinned_memory_pool",
    "ndarray",
    "ones",
    "ones_like",
    "shares_memory",
    "simulation",
    "ufunc",
    "zeros",
    "zeros_like",
]

__version__ = "14.0.0+simulated"


def simulation() -> Simulation:
    """The running simulation (its ``races`` list, ``n_devices``, clocks)."""
    return state()


def get_default_memory_pool() -> DevicePool:
    """The device memory pool of the simulation."""
    return device_pool()


def get_default_pinned_memory_pool() -> PinnedPool:
    """The pinned memory pool of the simulation."""
    return pinned_pool()


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """An uninitialised array on the current device."""
    return ndarray(shape, dtype, order=order)


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    """An array of ``fill_value`` on the current device (one kernel)."""
    dtype = np.asarray(fill_value).dtype if dtype is None else dtype
    out = ndarray(shape, dtype, order=order)
    launch("fill", [], [out], lambda: out._layout_probe().fill(fill_value))
    return out


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """An array of zeros on the current device."""
    return full(shape, 0, dtype, order)


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """An array of ones on the current device."""
    return full(shape, 1, dtype, order)


def _like_order(a: ndarray, order: str, subok: Any) -> str:
    """The layout of a ``*_like`` result: ``"K"``/``"A"`` keep an F-contiguous ``a``'s (CuPy)."""
    if subok is not None:
        raise TypeError("subok is not supported yet")
    if order in ("K", "A"):
        return "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    return order


def empty_like(
    prototype: ndarray, dtype: Any = None, order: str = "K", subok: Any = None, shape: Any = None
) -> ndarray:
    """An uninitialised array like ``prototype`` (its data is not read)."""
    order = _like_order(prototype, order, subok)
    dtype = prototype.dtype if dtype is None else dtype
    return empty(prototype.shape if shape is None else shape, dtype, order)


def zeros_like(
    a: ndarray, dtype: Any = None, order: str = "K", subok: Any = None, shape: Any = None
) -> ndarray:
    """Zeros like ``a`` (its data is not read)."""
    order = _like_order(a, order, subok)
    return zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype, order)


def ones_like(
    a: ndarray, dtype: Any = None, order: str = "K", subok: Any = None, shape: Any = None
) -> ndarray:
    """Ones like ``a`` (its data is not read)."""
    order = _like_order(a, order, subok)
    return ones(a.shape if shape is None else shape, a.dtype if dtype is None else dtype, order)


def full_like(  # noqa: PLR0917 - CuPy's signature
    a: ndarray,
    fill_value: Any,
    dtype: Any = None,
    order: str = "K",
    subok: Any = None,
    shape: Any = None,
) -> ndarray:
    """``fill_value`` like ``a`` (its data is not read)."""
    order = _like_order(a, order, subok)
    return full(
        a.shape if shape is None else shape, fill_value, a.dtype if dtype is None else dtype, order
    )


def array(  # noqa: PLR0917 - CuPy's signature
    obj: Any,
    dtype: Any = None,
    copy: bool = True,
    order: str = "K",
    subok: bool = False,
    ndmin: int = 0,
    *,
    blocking: bool = False,
) -> ndarray:
    """A new device array from host data (copied on the current stream) or a device array.

    ``order`` and ``subok`` are accepted and not used (results are C-contiguous); ``blocking``
    is not needed (the simulated upload has finished reading the host data when it returns).
    """
    if isinstance(obj, ndarray):
        out = obj.astype(obj.dtype if dtype is None else dtype, copy=True)
        return out.reshape((1,) * (ndmin - out.ndim) + out.shape) if ndmin > out.ndim else out
    host = np.ascontiguousarray(np.asarray(obj, dtype=dtype))
    if obj is not None and np.ndim(obj) == 0:
        host = host.reshape(())
    if ndmin > host.ndim:
        host = host.reshape((1,) * (ndmin - host.ndim) + host.shape)
    out = ndarray(host.shape, host.dtype)
    out.set(host)
    return out


def asarray(
    a: Any,
    dtype: Any = None,
    order: Any = None,
    *,
    copy: bool | None = None,
    blocking: bool = False,
) -> ndarray:
    """``a`` itself when a device array of ``dtype``, else a device copy (``copy``: NumPy's)."""
    reusable = isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype)
    if copy is False and not reusable:
        raise ValueError("Unable to avoid copy while creating an array as requested.")
    if copy:
        return array(a, dtype)
    if isinstance(a, ndarray):
        return a if reusable else a.astype(dtype)
    return array(a, dtype)


def ascontiguousarray(a: ndarray, dtype: Any = None) -> ndarray:
    """``a`` itself when C-contiguous (and of ``dtype``), else a contiguous copy."""
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    if dtype is not None and np.dtype(dtype) != a.dtype:
        a = a.astype(dtype)
    return a if a.flags.c_contiguous else a.copy()


def asnumpy(
    a: Any, stream: Any = None, order: str = "C", out: Any = None, *, blocking: bool = True
) -> np.ndarray:
    """A host copy of a device array (NumPy input is returned as an array)."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return np.asarray(a, order=order)  # type: ignore[call-overload]


def shares_memory(a: ndarray, b: ndarray, max_work: Any = None) -> bool:
    """Whether ``a`` and ``b`` share memory, computed as CuPy computes it: on the device.

    CuPy launches kernels on the *current* device that read both arrays (so both must live
    there, without peer access) and copies the answer to the host; ``MAY_SHARE_BOUNDS`` compares
    the bounds on the host, and ``a is b`` answers at once.
    """
    if a is b and a.size != 0:
        return True
    if max_work == "MAY_SHARE_BOUNDS":
        return bool(np.may_share_memory(a._layout_probe(), b._layout_probe()))
    if max_work not in (None, "MAY_SHARE_EXACT"):
        raise NotImplementedError("Not supported for integer `max_work`.")
    answer = apply(
        lambda x, y: np.asarray(np.shares_memory(x, y)), (a, b), {}, name="shares_memory"
    )
    return bool(answer)  # a blocking copy to the host


def get_array_module(*args: Any) -> types.ModuleType:
    """This module if any argument is a simulated device array, else NumPy."""
    import sys

    if any(isinstance(a, ndarray) for a in args):
        return sys.modules[__name__]
    return np


class ufunc:  # noqa: N801 - CuPy's name
    """A simulated ``cupy.ufunc``: NumPy's ufunc as kernels, with ``at``, ``reduce``, ``outer``...

    Every call and method runs as one kernel that reads its array operands and writes its
    outputs (``out=``, outputs given by position, and ``at``'s first argument).
    """

    def __init__(self, numpy_ufunc: np.ufunc) -> None:
        self._ufunc = numpy_ufunc
        self.__name__ = numpy_ufunc.__name__
        self.nin, self.nout, self.nargs = numpy_ufunc.nin, numpy_ufunc.nout, numpy_ufunc.nargs

    def __repr__(self) -> str:
        return f"<ufunc '{self.__name__}'>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return apply(self._ufunc, args, kwargs, name=f"cupy.{self.__name__}")

    def __getattr__(self, method: str) -> Any:
        if method not in ("at", "reduce", "accumulate", "reduceat", "outer"):
            raise AttributeError(f"'cupy.ufunc' object has no attribute {method!r}")
        fn = getattr(self._ufunc, method)

        def bound(*args: Any, **kwargs: Any) -> Any:
            return apply(fn, args, kwargs, name=f"cupy.{self.__name__}.{method}")

        bound.__name__ = method
        return bound


def __getattr__(name: str) -> Any:
    target = getattr(np, name, None)
    if target is None or name.startswith("_"):
        raise AttributeError(f"module 'cupy' (simulated) has no attribute {name!r}")
    if isinstance(target, np.ufunc):
        return ufunc(target)
    if isinstance(target, type) or not callable(target):
        return target

    def function(*args: Any, **kwargs: Any) -> Any:
        return apply(target, args, kwargs, name=f"cupy.{name}")

    function.__name__ = name
    return function
