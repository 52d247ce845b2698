"""NCCL collectives across the GPUs of one process: communicators cached per device tuple.

torch's ``comm`` uses NCCL for ``broadcast`` and ``reduce_add`` whenever every tensor is a dense,
contiguous CUDA tensor on a distinct GPU; otherwise it falls back to peer copies. This module
does the same with ``cupy.cuda.nccl``: :func:`broadcast_into` and :func:`reduce` run one grouped
collective (``groupStart``/``groupEnd``) on each GPU's current stream and report through their
eligibility checks when the caller must fall back. ``cupy.cuda.nccl`` warns when libnccl is
missing, so it is imported lazily with that warning silenced.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import device_of, empty
from cupy_parallel._src.cuda.streams import current_stream
from cupy_parallel._src.devices import cupy_module

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from cupy_parallel._src.devices import Device

__all__ = ["broadcast_into", "can_reduce", "communicators", "is_available", "reduce"]

# dtype -> (NCCL datatype, element type NCCL sees, NCCL reduction). Complex numbers are summed as
# pairs of reals; booleans as bytes under MAX, which is logical or (NumPy's bool addition).
# int16/uint16 have no NCCL type and fall back to peer copies.
_REDUCE_TYPES: dict[np.dtype[Any], tuple[str, np.dtype[Any], str]] = {
    np.dtype(np.bool_): ("NCCL_UINT8", np.dtype(np.uint8), "NCCL_MAX"),
    np.dtype(np.int8): ("NCCL_INT8", np.dtype(np.int8), "NCCL_SUM"),
    np.dtype(np.uint8): ("NCCL_UINT8", np.dtype(np.uint8), "NCCL_SUM"),
    np.dtype(np.int32): ("NCCL_INT32", np.dtype(np.int32), "NCCL_SUM"),
    np.dtype(np.uint32): ("NCCL_UINT32", np.dtype(np.uint32), "NCCL_SUM"),
    np.dtype(np.int64): ("NCCL_INT64", np.dtype(np.int64), "NCCL_SUM"),
    np.dtype(np.uint64): ("NCCL_UINT64", np.dtype(np.uint64), "NCCL_SUM"),
    np.dtype(np.float16): ("NCCL_FLOAT16", np.dtype(np.float16), "NCCL_SUM"),
    np.dtype(np.float32): ("NCCL_FLOAT32", np.dtype(np.float32), "NCCL_SUM"),
    np.dtype(np.float64): ("NCCL_FLOAT64", np.dtype(np.float64), "NCCL_SUM"),
    np.dtype(np.complex64): ("NCCL_FLOAT32", np.dtype(np.float32), "NCCL_SUM"),
    np.dtype(np.complex128): ("NCCL_FLOAT64", np.dtype(np.float64), "NCCL_SUM"),
}

_lock = threading.Lock()
_communicators: dict[tuple[int, ...], list[Any]] = {}


@functools.cache
def _nccl() -> ModuleType | None:
    if cupy_module() is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl
        except ImportError:
            return None
    return nccl if getattr(nccl, "available", False) else None


def is_available() -> bool:
    """Whether CuPy can load libnccl.

    Example:
        >>> is_available() in (True, False)
        True
    """
    return _nccl() is not None


def _modules() -> tuple[ModuleType, ModuleType]:
    nccl, cupy = _nccl(), cupy_module()
    if nccl is None or cupy is None:
        raise RuntimeError("NCCL is not available (CuPy cannot load libnccl).")
    return nccl, cupy


def communicators(device_ids: tuple[int, ...]) -> list[Any]:
    """One ``NcclCommunicator`` per GPU of ``device_ids`` (rank = position), created once."""
    nccl, _ = _modules()
    with _lock:
        comms = _communicators.get(device_ids)
        if comms is None:
            comms = _communicators[device_ids] = nccl.NcclCommunicator.initAll(list(device_ids))
    return comms


def _eligible(arrays: Sequence[Any]) -> bool:
    """NCCL applies: at least two C-contiguous CUDA arrays on distinct GPUs, and libnccl loads."""
    if len(arrays) < 2:
        return False
    places = [device_of(x) for x in arrays]
    if any(p.kind != "cuda" for p in places) or len(set(places)) != len(places):
        return False
    return all(x.flags.c_contiguous for x in arrays) and is_available()


def broadcast_into(source: Any, outs: Sequence[Any]) -> bool:
    """Broadcast ``source`` into ``outs`` with NCCL; ``False`` (nothing done) when NCCL can't.

    The bytes are broadcast as ``uint8``, so every dtype travels bit for bit.
    """
    buffers = [source, *outs]
    if not outs or device_of(source).kind != "cuda" or not _eligible(buffers):
        return False
    if source.nbytes == 0:
        return True
    nccl, cupy = _modules()
    ids = tuple(device_of(b).index for b in buffers)
    comms = communicators(ids)
    nccl.groupStart()
    try:
        for comm, buffer, device in zip(comms, buffers, ids, strict=True):
            with cupy.cuda.Device(device):
                stream = current_stream(device)
                comm.bcast(buffer.data.ptr, buffer.nbytes, nccl.NCCL_UINT8, 0, stream.ptr)
    finally:
        nccl.groupEnd()
    return True


def can_reduce(inputs: Sequence[Any], target: Device) -> bool:
    """Whether :func:`reduce` applies: NCCL-eligible inputs of an NCCL-summable dtype on target."""
    return (
        _eligible(inputs)
        and inputs[0].dtype in _REDUCE_TYPES
        and any(device_of(x) == target for x in inputs)
    )


def reduce(inputs: Sequence[Any], target: Device) -> Any:
    """The elementwise sum of ``inputs`` on ``target`` (one of their GPUs), by one NCCL reduce."""
    nccl, cupy = _modules()
    first = inputs[0]
    out = empty(first.shape, first.dtype, target)
    if first.size == 0:
        return out
    type_name, element, op_name = _REDUCE_TYPES[first.dtype]
    count = first.nbytes // element.itemsize
    datatype, op = getattr(nccl, type_name), getattr(nccl, op_name)
    ids = tuple(device_of(x).index for x in inputs)
    root = ids.index(target.index)
    comms = communicators(ids)
    nccl.groupStart()
    try:
        for rank, (comm, x, device) in enumerate(zip(comms, inputs, ids, strict=True)):
            with cupy.cuda.Device(device):
                stream = current_stream(device)
                receive = out.data.ptr if rank == root else x.data.ptr
                comm.reduce(x.data.ptr, receive, count, datatype, op, root, stream.ptr)
    finally:
        nccl.groupEnd()
    return out
