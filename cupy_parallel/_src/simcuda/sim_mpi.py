"""A CUDA-aware MPI over the simulated CUDA: MPI itself reads and writes the arrays' memory.

A CUDA-aware MPI takes device pointers and accesses the memory on its own (copy engines, its
own streams, GPUDirect), ordered with nothing the caller queued: every device operation that
touches a buffer must be finished (the host synchronised with it) before the buffer is handed to
MPI, and none may be queued on it until MPI reports the request complete. As a host access to
device memory, it is ordered by host synchronisation only.

:class:`CudaAwareComm` wraps an mpi4py communicator. Each nonblocking call whose buffer
arguments hold simulated device arrays is one operation on a timeline of its own (the MPI
library's progress), stamped after what the host has synchronised with, reading the buffers MPI
reads (send buffers, a broadcast's root buffer) and writing those it writes (receive buffers):
the race checker checks these accesses against every device access before them, so a kernel,
zero-fill or copy still pending on a buffer handed to MPI raises :class:`.clock.RaceError` at
posting, and so does a device operation queued on it before completion (checked when it is
queued). The arrays are then handed to the real MPI as the host memory that backs them (device
memory is host memory here), so the data really travels. When the caller finds the request
complete (``Test``/``Testall``/``Wait``: mpi4py then nulls the request's handle), the host is
ordered after the operation (:meth:`.clock.Simulation.external`).

The library's MPI backend uses it under ``simulated_cuda`` when ``CUPY_PARALLEL_MPI_CUDA_AWARE=1``
(see :mod:`cupy_parallel._src.distributed.mpi_staging`).

Which calls take device memory depends on the MPI library; the simulator emulates one
(:func:`emulate`, default Open MPI) and refuses (:class:`.clock.SimulationError`) a device
buffer in a call that library does not support on device memory, after its documentation
(:data:`DEVICE_CALLS`):

* Open MPI (its CUDA FAQ, v4 and the v5 docs): device pointers in every send and receive and in
  the *blocking* collectives; no non-blocking collective (``MPI_Iallreduce``, ``MPI_Ibcast``,
  ``MPI_Iallgather``, ``MPI_Ialltoallv``, ...) takes them, and with UCX no non-blocking
  reduction does. The backend posts only non-blocking calls: point-to-point only.
* MPICH (its GPU support matrix, ch4:ucx): point-to-point and data-movement collectives well
  supported, reductions with predefined operations supported through extra copies; a
  user-defined operation is a host function (ours reads its buffers with ``np.frombuffer``), so
  a reduction with one never takes device memory.
* MVAPICH2-GDR: its documentation available here confirms point-to-point and blocking
  collectives on device memory only; emulated as strictly as Open MPI.
"""

from __future__ import annotations

import functools
from typing import Any

from cupy_parallel._src.simcuda.clock import SimulationError, state
from cupy_parallel._src.simcuda.ndarray import ndarray

__all__ = ["DEVICE_CALLS", "CudaAwareComm", "emulate", "emulated"]

_POINT_TO_POINT = frozenset({"Isend", "Issend", "Irecv"})
_MOVEMENT = frozenset(
    {
        "Ibcast",
        "Iallgather",
        "Iallgatherv",
        "Igather",
        "Igatherv",
        "Iscatter",
        "Iscatterv",
        "Ialltoall",
        "Ialltoallv",
    }
)
_REDUCTIONS = frozenset(
    {"Iallreduce", "Ireduce", "Ireduce_scatter", "Ireduce_scatter_block", "Iscan", "Iexscan"}
)
#: The non-blocking calls each emulated MPI library takes device buffers in (reductions: with
#: predefined operations only; see the module docstring for the sources).
DEVICE_CALLS: dict[str, frozenset[str]] = {
    "openmpi": _POINT_TO_POINT,
    "mpich": _POINT_TO_POINT | _MOVEMENT | _REDUCTIONS,
    "mvapich": _POINT_TO_POINT,
}
_emulated = ["openmpi"]


def emulated() -> str:
    """The MPI library the simulated CUDA-aware MPI behaves as (``"openmpi"`` by default).

    Example:
        >>> emulated() in DEVICE_CALLS
        True
    """
    return _emulated[0]


def emulate(library: str) -> str:
    """Make the simulated CUDA-aware MPI behave as ``library``; returns the previous one.

    Example:
        >>> previous = emulate("mpich")
        >>> emulate(previous)
        'mpich'
    """
    if library not in DEVICE_CALLS:
        raise ValueError(f"library must be one of {sorted(DEVICE_CALLS)}, got {library!r}.")
    previous, _emulated[0] = _emulated[0], library
    return previous


#: Nonblocking calls taking buffers: (argument positions MPI reads, positions MPI writes).
#: ``MPI.IN_PLACE`` as the send buffer makes the receive buffer read and written (a write).
_ROLES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    **dict.fromkeys(
        (
            "Iallreduce",
            "Ireduce",
            "Iallgather",
            "Iallgatherv",
            "Igather",
            "Igatherv",
            "Iscatter",
            "Iscatterv",
            "Ireduce_scatter",
            "Ireduce_scatter_block",
            "Ialltoall",
            "Ialltoallv",
            "Iscan",
            "Iexscan",
        ),
        ((0,), (1,)),
    ),
    "Isend": ((0,), ()),
    "Issend": ((0,), ()),
    "Irecv": ((), (0,)),
    "Ibcast": ((), ()),  # the root reads, the others write: see CudaAwareComm._post
}


class CudaAwareComm:
    """An mpi4py communicator as seen through a CUDA-aware MPI (see the module docstring).

    Every attribute is the communicator's; the nonblocking calls that take buffers accept
    simulated device arrays (alone or first in a ``[buffer, ...]`` specification).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.comm, name)
        if name not in _ROLES:
            return method
        return functools.partial(self._post, name, method)

    def _post(self, name: str, method: Any, *args: Any) -> Any:
        found = [_device_array(arg) for arg in args]
        if not any(x is not None for x in found):
            return method(*args)
        library = emulated()
        if name not in DEVICE_CALLS[library]:
            raise SimulationError(
                f"MPI_{name} was handed device memory, which the emulated MPI library "
                f"({library}) does not take in that call: stage it through host memory."
            )
        if name in _REDUCTIONS and _user_defined(args[2] if len(args) > 2 else None):
            raise SimulationError(
                f"MPI_{name} with a user-defined operation was handed device memory: the "
                "operation is a host function reading its buffers, so stage it."
            )
        reads, writes = _ROLES[name]
        if name == "Ibcast":
            root_side = self.comm.Get_rank() == args[1]
            reads, writes = ((0,), ()) if root_side else ((), (0,))
        in_place = len(args) > 1 and args[0] is _in_place()
        simulation = state()
        with simulation.lock:
            rank = self.comm.Get_rank()
            timeline = simulation.new_timeline(f"a CUDA-aware MPI (rank {rank})", "mpi", -1)
            op = simulation.enqueue(timeline, f"MPI_{name}")
            for position, x in enumerate(found):
                if x is not None and (position in reads or position in writes):
                    written = position in writes or (in_place and position == 1)
                    x._access(op, write=written)
            host_args = [
                arg if x is None else _host_spec(arg, x) for arg, x in zip(args, found, strict=True)
            ]
            request = method(*host_args)
            simulation.external(op, functools.partial(_finished, request))
        return request


def _user_defined(op: Any) -> bool:
    """Whether ``op`` is a user-defined MPI operation (mpi4py's, or thread ranks' ``Op``)."""
    return getattr(op, "is_predefined", True) is False or getattr(op, "name", None) == "user"


def _device_array(arg: Any) -> ndarray | None:
    """The simulated array of a buffer argument (the array, or first in a list), or ``None``."""
    if isinstance(arg, ndarray):
        return arg
    if isinstance(arg, list | tuple) and arg and isinstance(arg[0], ndarray):
        return arg[0]
    return None


def _host_spec(arg: Any, x: ndarray) -> Any:
    """The buffer argument with the array replaced by the host memory that backs it."""
    host = x._layout_probe()
    return host if arg is x else [host, *arg[1:]]


def _finished(request: Any) -> bool:
    return not request  # mpi4py nulls a request's handle once it is found complete


@functools.cache
def _in_place() -> Any:
    from mpi4py import MPI

    return MPI.IN_PLACE
