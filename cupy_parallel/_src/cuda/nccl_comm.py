"""``comm``'s NCCL collectives: broadcast and reduce across the GPUs of this process.

torch's ``comm`` uses NCCL for ``broadcast`` and ``reduce_add`` whenever every tensor is a dense,
contiguous CUDA tensor on a distinct GPU; otherwise it falls back to peer copies. This module
does the same: :func:`broadcast_into` and :func:`reduce` run one grouped collective
(``groupStart``/``groupEnd``) on each GPU's current stream and report through their eligibility
checks when the caller must fall back. The arrays are CuPy arrays, read with CuPy alone
(``x.device.id``, ``cupy.empty`` under ``cupy.cuda.Device``); NCCL itself comes from
:mod:`.nccl_runtime`.

Decisions:

- Serialised like torch's ``AutoNcclGroup``: one process-wide lock is held from ``groupStart``
  to ``groupEnd`` (and while ``initAll`` makes communicators), so two threads never interleave
  their calls on the cached communicators (NCCL requires every member to issue its calls in the
  same order; interleaved groups deadlock or mix data). The communicators are one
  :class:`.nccl_runtime.Communicators` keyed by the GPUs of a call (rank = position).
- Reductions are NCCL's typed kernels on the array's own dtype (:func:`.nccl_tables.reduction`
  with ``SUM``): ``float16`` is summed *in float16* by NCCL, not widened; ``bool`` is a logical
  or; complex numbers are summed as pairs of reals. dtypes NCCL cannot sum (int16, uint16, ...)
  fall back to peer copies and a sum on the target GPU, which is exact the same way.
"""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.cuda.nccl_runtime import (
    Communicators,
    device_ids,
    nccl_module,
    nccl_version,
    require_nccl,
)
from cupy_parallel._src.cuda.nccl_tables import reduction
from cupy_parallel._src.cuda.streams import current_stream
from cupy_parallel._src.devices import is_cupy_array
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.cuda.nccl_tables import Reduction
    from cupy_parallel._src.devices import Device

__all__ = ["broadcast_into", "can_reduce", "destroy_communicators", "reduce"]

_lock = threading.RLock()  # re-entrant: initAll, made under it, runs its own NCCL group
_communicators = Communicators(
    launch_lock=_lock,  # held from groupStart to groupEnd (torch's AutoNcclGroup)
    setup_lock=_lock,
)


def destroy_communicators() -> int:
    """Destroy the cached communicators (``ncclCommDestroy``); returns how many there were.

    Run at interpreter exit (``atexit``), so that NCCL's resources are released while CUDA is
    still up, and when a simulated CUDA ends (its communicators must not serve the next one).
    Every communicator is destroyed even if one raises; the first error is then raised.
    """
    comms = _communicators.take_all()
    errors = []
    for comm in comms:
        try:
            comm.destroy()
        except Exception as error:  # noqa: BLE001, PERF203 - destroy the others, then report
            errors.append(error)
    if errors:
        raise errors[0]
    return len(comms)


atexit.register(destroy_communicators)


def _initialise(device_ids: tuple[int, ...]) -> list[Any]:
    """One ``NcclCommunicator`` per GPU of ``device_ids`` (rank = position)."""
    nccl, _ = require_nccl()
    comms: list[Any] = nccl.NcclCommunicator.initAll(list(device_ids))
    return comms


def _eligible(arrays: Sequence[Any]) -> bool:
    """NCCL applies: at least two C-contiguous CUDA arrays on distinct GPUs, and NCCL loads."""
    if len(arrays) < 2 or not all(is_cupy_array(x) for x in arrays):
        return False
    ids = device_ids(arrays)
    if len(set(ids)) != len(ids):
        return False
    return all(x.flags.c_contiguous for x in arrays) and nccl_module() is not None


def broadcast_into(source: Any, outs: Sequence[Any]) -> bool:
    """Broadcast ``source`` into ``outs`` with NCCL; ``False`` (nothing done) when NCCL can't.

    The bytes are broadcast as ``uint8``, so every dtype travels bit for bit.
    """
    buffers = [source, *outs]
    if not outs or not _eligible(buffers):
        return False
    if source.nbytes == 0:
        return True
    nccl, cupy = require_nccl()
    ids = device_ids(buffers)
    comms = _communicators.get_or_make(ids, _initialise)
    with _communicators.group(nccl):
        for comm, buffer, device in zip(comms, buffers, ids, strict=True):
            with cupy.cuda.Device(device):
                stream = current_stream(device)
                comm.bcast(buffer.data.ptr, buffer.nbytes, nccl.NCCL_UINT8, 0, stream.ptr)
    return True


def _sum_plan(dtype: Any) -> Reduction | None:
    """How NCCL sums ``dtype`` (:mod:`.nccl_tables`), or ``None`` when it cannot."""
    nccl = nccl_module()
    if nccl is None:
        return None
    try:
        return reduction(dtype, ReduceOp.SUM, nccl_version(nccl))
    except (TypeError, NotImplementedError):  # int16, bfloat16 on an old NCCL: peer copies
        return None


def can_reduce(inputs: Sequence[Any], target: Device) -> bool:
    """Whether :func:`reduce` applies: NCCL-eligible inputs of an NCCL-summable dtype on target."""
    return (
        _eligible(inputs)
        and _sum_plan(inputs[0].dtype) is not None
        and target.kind == "cuda"
        and target.index in device_ids(inputs)
    )


def reduce(inputs: Sequence[Any], target: Device) -> Any:
    """The elementwise sum of ``inputs`` on ``target`` (one of their GPUs), by one NCCL reduce."""
    nccl, cupy = require_nccl()
    first = inputs[0]
    with cupy.cuda.Device(target.index):
        out: Any = cupy.empty(first.shape, first.dtype)
    if first.size == 0:
        return out
    plan = _sum_plan(first.dtype)
    if plan is None:
        raise TypeError(f"NCCL cannot sum {first.dtype} arrays; check can_reduce() first.")
    count = first.size * plan.lanes
    ids = device_ids(inputs)
    root = ids.index(target.index)
    comms = _communicators.get_or_make(ids, _initialise)
    with _communicators.group(nccl):
        for rank, (comm, x, device) in enumerate(zip(comms, inputs, ids, strict=True)):
            with cupy.cuda.Device(device):
                stream = current_stream(device)
                receive = out.data.ptr if rank == root else x.data.ptr
                comm.reduce(
                    x.data.ptr, receive, count, int(plan.datatype), int(plan.op), root, stream.ptr
                )
    return out
