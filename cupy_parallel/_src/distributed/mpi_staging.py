"""CuPy arrays for the MPI backend: handed to a CUDA-aware MPI, or staged through host memory.

A primitive written for host arrays takes CuPy arrays through :func:`staged`: they are passed
to MPI directly when MPI is CUDA-aware (``MPIX_Query_cuda_support()`` of the loaded MPI library,
or ``CUPY_PARALLEL_MPI_CUDA_AWARE=1``), after synchronizing the current stream; otherwise staged
through host memory (copied out before, back after), with a one-time ``RuntimeWarning``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.devices import cupy_arrays_may_exist, cupy_module, is_cupy_array
from cupy_parallel._src.distributed.mpi_job import first_time, load_mpi, thread_rank
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.hostarray import HostArray

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.distributed.work import Work

__all__ = ["mpi_is_cuda_aware", "staged"]


def mpi_is_cuda_aware() -> bool:
    """Whether the loaded MPI library reads CUDA device memory (``MPIX_Query_cuda_support``).

    ``CUPY_PARALLEL_MPI_CUDA_AWARE=0|1`` overrides the probe. Thread ranks' in-process MPI
    reads host memory only (``False``).

    Example:
        >>> isinstance(mpi_is_cuda_aware(), bool)
        True
    """
    if thread_rank() is not None:
        return False
    return _process_mpi_is_cuda_aware()


@functools.cache
def _process_mpi_is_cuda_aware() -> bool:
    forced = os.environ.get("CUPY_PARALLEL_MPI_CUDA_AWARE", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    load_mpi()  # loads the MPI library
    for path in _loaded_mpi_libraries():
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


def _loaded_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi"))


# Argument types that are never CuPy arrays: skipped without asking for their module.
_NOT_DEVICE: frozenset[type] = frozenset({np.ndarray, HostArray, int, ReduceOp, type(None)})


def _has_device_array(args: Sequence[Any]) -> bool:
    """Whether an argument, or an element of a list argument (at any depth), is a CuPy array.

    CuPy's or, inside ``simulated_cuda``, the stand-in's (:func:`is_cupy_array`).
    """
    for arg in args:
        kind = type(arg)
        if kind is list or kind is tuple:
            for item in arg:  # host arrays, the common case, cost one set lookup each
                if type(item) not in _NOT_DEVICE and _has_device_array((item,)):
                    return True
        elif kind not in _NOT_DEVICE and is_cupy_array(arg):
            return True
    return False


def staged(*outputs: int) -> Callable[[Callable[..., Work]], Callable[..., Work]]:
    """Let a primitive written for host arrays take CuPy arrays.

    The arrays at argument positions ``outputs`` receive data and are copied back on completion.
    A CUDA-aware MPI gets the device arrays themselves, except under ``simulated_cuda``: the
    stand-in's memory is not CUDA memory that MPI could read, so its arrays are always staged.
    """

    def decorate(primitive: Callable[..., Work]) -> Callable[..., Work]:
        @functools.wraps(primitive)
        def run(self: Any, *args: Any) -> Work:
            if not (cupy_arrays_may_exist() and _has_device_array(args)):
                return primitive(self, *args)
            cupy: Any = cupy_module()
            cupy.cuda.get_current_stream().synchronize()
            simulated = cupy.__name__ != "cupy"
            if mpi_is_cuda_aware() and not simulated:
                return primitive(self, *args)
            _warn_staging(
                "CUDA is simulated (simulated_cuda)" if simulated else "this MPI is not CUDA-aware"
            )
            pairs: list[tuple[Any, np.ndarray]] = []
            host_args = [
                _to_host(arg, pairs if index in outputs else None) for index, arg in enumerate(args)
            ]
            work = primitive(self, *host_args)
            if pairs:
                work.add_finalizer(functools.partial(_copy_back, pairs))
            return work

        return run

    return decorate


def _warn_staging(reason: str) -> None:
    if first_time("mpi staging"):
        warnings.warn(
            f"cupy_parallel MPI backend: {reason}, so CuPy arrays are copied through host memory "
            "for each call (set CUPY_PARALLEL_MPI_CUDA_AWARE=1 if this MPI is CUDA-aware, or "
            "use the 'nccl' backend).",
            RuntimeWarning,
            stacklevel=4,
        )


def _to_host(arg: Any, pairs: list[tuple[Any, np.ndarray]] | None) -> Any:
    if type(arg) is list or type(arg) is tuple:
        return [_to_host(a, pairs) for a in arg]
    if not is_cupy_array(arg):
        return arg
    host = arg.get()
    if pairs is not None:
        pairs.append((arg, host))
    return host


def _copy_back(pairs: list[tuple[Any, np.ndarray]]) -> None:
    for device_array, host in pairs:
        with device_array.device:
            device_array.set(host)
