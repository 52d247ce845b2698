"""CuPy arrays for the MPI backend: handed to a CUDA-aware MPI, or staged through host memory.

A primitive written for host arrays takes CuPy arrays through :func:`staged`.

* When MPI is CUDA-aware (``MPIX_Query_cuda_support()`` of the loaded MPI library, or
  ``CUPY_PARALLEL_MPI_CUDA_AWARE=1``) the arrays are handed to MPI directly. Such an MPI accesses
  device memory on its own, ordered with no stream of the caller's, so the group's communicator
  is wrapped (:class:`_SynchronizingComm`): each nonblocking call first synchronizes the current
  stream of every GPU holding a buffer it is handed, *after* the primitive queued its work on
  those buffers (zero-filled receive buffers, local reductions, packing; every such operation
  runs on the current stream of the array's GPU) and before MPI may read or write them. Work
  after completion (unpacking, ``AVG``) is queued once MPI reported it done.
* Otherwise they are staged through host memory (copied out before on the current stream of
  each array's GPU, back after), with a one-time ``RuntimeWarning``.
* A CUDA-aware MPI does not take device memory in every call, and the backend posts only
  non-blocking ones: per MPI library (:func:`mpi_library`, from ``MPI_Get_library_version``),
  :data:`ON_DEVICE` names the primitives whose device arrays go to MPI; the others are staged
  (silently: it is how that library works), as is any reduction with the MIN/MAX user operation
  (a host function reading its buffers with ``np.frombuffer``). From the libraries'
  documentation: Open MPI takes device pointers in sends, receives and blocking collectives,
  never in non-blocking collectives (its CUDA FAQ; with UCX no non-blocking reduction either);
  MPICH's GPU support matrix (ch4:ucx) has point-to-point and data-movement collectives well
  supported and reductions through extra copies (with predefined operations: on device here);
  MVAPICH2-GDR's documentation found confirms point-to-point and blocking collectives
  only. An unknown library is treated as the strictest (point-to-point only).

Under ``simulated_cuda`` both branches run: ``CUPY_PARALLEL_MPI_CUDA_AWARE=1`` makes the
simulator play a CUDA-aware MPI (:class:`~cupy_parallel._src.simcuda.sim_mpi.CudaAwareComm`:
the stand-in's arrays go to MPI as the host memory behind them, and every device access not
ordered before MPI's own, or after its completion, is a ``RaceError``); otherwise (``0`` or
unset: the installed MPI is probed, and a CPU-only MPI is not CUDA-aware) they are staged.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.cuda.streams import current_stream
from cupy_parallel._src.devices import cupy_arrays_may_exist, cupy_module, is_cupy_array
from cupy_parallel._src.distributed.mpi_job import first_time, load_mpi, thread_rank
from cupy_parallel._src.dtypes import is_bfloat16
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.hostarray import HostArray

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.distributed.work import Work

__all__ = ["ON_DEVICE", "mpi_is_cuda_aware", "mpi_library", "staged"]

_POINT_TO_POINT = frozenset({"send", "recv"})
_REDUCTIONS = frozenset({"all_reduce", "reduce", "reduce_scatter", "all_reduce_coalesced"})
#: The backend's primitives whose CuPy arrays a CUDA-aware MPI library gets as device memory
#: (its non-blocking calls that take them; see the module docstring). The rest is staged.
ON_DEVICE: dict[str, frozenset[str]] = {
    "openmpi": _POINT_TO_POINT,
    "mpich": _POINT_TO_POINT
    | {"broadcast", "all_gather", "gather", "scatter", "all_to_all", "all_gather_coalesced"}
    | _REDUCTIONS,
    "mvapich": _POINT_TO_POINT,
    "unknown": _POINT_TO_POINT,
}


def mpi_library() -> str:
    """The MPI library in use: ``"openmpi"``, ``"mpich"``, ``"mvapich"`` or ``"unknown"``.

    Read from ``MPI_Get_library_version``; under ``simulated_cuda`` the library the simulated
    CUDA-aware MPI emulates.

    Example:
        >>> mpi_library() in ON_DEVICE
        True
    """
    if getattr(cupy_module(), "__name__", "cupy") != "cupy":
        from cupy_parallel._src.simcuda.sim_mpi import emulated

        return emulated()
    return _process_mpi_library()


@functools.cache
def _process_mpi_library() -> str:
    version = str(load_mpi().Get_library_version())
    for marker, name in (("MVAPICH", "mvapich"), ("Open MPI", "openmpi"), ("MPICH", "mpich")):
        if marker in version:
            return name
    return "unknown"


def _on_device(primitive: str, args: Sequence[Any]) -> bool:
    """Whether a CUDA-aware MPI takes ``primitive``'s device arrays (else they are staged).

    A reduction with the MIN/MAX user operation (float and bfloat16 arrays) never does.
    """
    if primitive not in ON_DEVICE[mpi_library()]:
        return False
    if primitive in _REDUCTIONS:
        op = next((arg for arg in args if isinstance(arg, ReduceOp)), None)
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            dtype = _first_device_array(args).dtype
            return not (dtype.kind == "f" or is_bfloat16(dtype))
    return True


def _first_device_array(args: Sequence[Any]) -> Any:
    for arg in args:
        if type(arg) is list or type(arg) is tuple:
            found = _first_device_array(arg)
            if found is not None:
                return found
        elif type(arg) not in _NOT_DEVICE and is_cupy_array(arg):
            return arg
    return None


def mpi_is_cuda_aware() -> bool:
    """Whether the loaded MPI library reads CUDA device memory (``MPIX_Query_cuda_support``).

    ``CUPY_PARALLEL_MPI_CUDA_AWARE=0|1`` overrides the probe. Thread ranks' in-process MPI
    reads host memory only: ``False``, except for the stand-in arrays of ``simulated_cuda``
    (host memory behind them) with ``CUPY_PARALLEL_MPI_CUDA_AWARE=1``, where the simulator
    plays a CUDA-aware MPI over it as over a real one.

    Example:
        >>> isinstance(mpi_is_cuda_aware(), bool)
        True
    """
    if thread_rank() is not None:
        forced = os.environ.get("CUPY_PARALLEL_MPI_CUDA_AWARE", "").strip() == "1"
        return forced and getattr(cupy_module(), "__name__", "cupy") != "cupy"
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

    The arrays at argument positions ``outputs`` receive data and are copied back on completion
    (when staged). A CUDA-aware MPI gets the device arrays themselves, through the backend's
    communicator wrapped once in a :class:`_SynchronizingComm`.
    """

    def decorate(primitive: Callable[..., Work]) -> Callable[..., Work]:
        @functools.wraps(primitive)
        def run(self: Any, *args: Any) -> Work:
            if not (cupy_arrays_may_exist() and _has_device_array(args)):
                return primitive(self, *args)
            cupy: Any = cupy_module()
            simulated = cupy.__name__ != "cupy"
            if mpi_is_cuda_aware():
                if _on_device(primitive.__name__, args):
                    if type(self._comm) is not _SynchronizingComm:
                        self._comm = _SynchronizingComm(self._comm)
                    return primitive(self, *args)
            else:
                _warn_staging(
                    "CUDA is simulated (simulated_cuda)"
                    if simulated
                    else "this MPI is not CUDA-aware"
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


class _SynchronizingComm:
    """The group's communicator for a CUDA-aware MPI: device work on a buffer ends before MPI's.

    Every attribute is the communicator's. A nonblocking call handed CuPy arrays first
    synchronizes the current stream of each GPU they are on (where the user's earlier work on
    them and the primitive's own work ran, the latter queued just before this call), as a
    CUDA-aware MPI synchronizes no stream of the caller's. Calls with host buffers only pass
    straight through. The stand-in's arrays (``simulated_cuda``) go to the simulator's
    CUDA-aware MPI over the same communicator
    (:class:`~cupy_parallel._src.simcuda.sim_mpi.CudaAwareComm`).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._simulated: Any = None  # the simulator's CUDA-aware MPI over comm, once needed

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.comm, name)
        if not name.startswith("I") or not callable(method):
            return method
        return functools.partial(self._post, name, method)

    def _post(self, name: str, method: Any, *args: Any) -> Any:
        devices = {
            buffer.device.id
            for arg in args
            for buffer in (arg[:1] if type(arg) is list or type(arg) is tuple else (arg,))
            if type(buffer) not in _NOT_DEVICE and is_cupy_array(buffer)
        }
        if not devices:
            return method(*args)
        cupy: Any = cupy_module()
        for device in sorted(devices):
            with cupy.cuda.Device(device):  # a null or per-thread stream is the current GPU's
                current_stream(device).synchronize()
        if cupy.__name__ != "cupy":
            if self._simulated is None:
                from cupy_parallel._src.simcuda.sim_mpi import CudaAwareComm

                self._simulated = CudaAwareComm(self.comm)
            method = getattr(self._simulated, name)
        return method(*args)


def _to_host(arg: Any, pairs: list[tuple[Any, np.ndarray]] | None) -> Any:
    if type(arg) is list or type(arg) is tuple:
        return [_to_host(a, pairs) for a in arg]
    if not is_cupy_array(arg):
        return arg
    with arg.device:  # on the current stream of the array's GPU (get's default stream)
        host = arg.get()
    if pairs is not None:
        pairs.append((arg, host))
    return host


def _copy_back(pairs: list[tuple[Any, np.ndarray]]) -> None:
    for device_array, host in pairs:
        with device_array.device:
            device_array.set(host)
