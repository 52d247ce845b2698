"""The multi-device buffer moves behind :mod:`cupy_parallel._src.comm`: broadcast and reduce.

:func:`broadcast_from_host` stages a host array through pinned memory once for many targets;
:func:`broadcast_flat` and :func:`reduce_flat` pack arrays into one flat buffer per GPU and
move it with one NCCL call when NCCL is available (peer copies and additions otherwise);
:func:`sum_into` adds terms on one GPU. Every single copy is
:func:`~cupy_parallel._src.arrays.copy_into`, the one raw move, ordered against CuPy's *current*
streams of the devices involved (see :mod:`cupy_parallel._src.cuda.copies`); ``comm`` still
reaches it and :func:`~cupy_parallel._src.arrays.move` as ``comm_transfer.copy_into`` and
``comm_transfer.move``, names this module imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import copy_into, device_of, empty, move
from cupy_parallel._src.cuda import nccl_comm as nccl
from cupy_parallel._src.cuda.copies import upload_staged
from cupy_parallel._src.cuda.pinned import staging_array
from cupy_parallel._src.devices import require_cupy
from cupy_parallel._src.hostarray import plain_buffer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.devices import Device

__all__ = [
    "broadcast_flat",
    "broadcast_from_host",
    "reduce_flat",
    "sum_into",
]


def broadcast_from_host(array: Any, outs: Sequence[Any]) -> None:
    """Copy a host array into ``outs`` (GPU or host), staging it through pinned memory once."""
    if array.size == 0:
        return
    source = plain_buffer(array)
    staged, memory = staging_array(array.shape, array.dtype)
    np.copyto(staged, source, casting="no")
    for out in outs:
        target = device_of(out)
        if target.kind == "cuda":
            upload_staged(out, target.index, staged, memory, None)
        else:
            np.copyto(plain_buffer(out), source, casting="no")


def _flatten(arrays: Sequence[Any]) -> Any:
    """The arrays (all on one GPU) raveled and joined into one new 1-d buffer on that GPU."""
    cupy = require_cupy()
    with cupy.cuda.Device(device_of(arrays[0]).index):
        return cupy.concatenate([cupy.ravel(x) for x in arrays])


def broadcast_flat(members: Sequence[Any], targets: Sequence[Device]) -> list[Any]:
    """``members`` (on GPU ``targets[0]``) packed into one flat buffer on each of ``targets[1:]``.

    One NCCL broadcast when NCCL is available and the GPUs are distinct, else peer copies.
    """
    flat = _flatten(members)
    outs = [empty(flat.shape, flat.dtype, device) for device in targets[1:]]
    if not nccl.broadcast_into(flat, outs):
        for out in outs:
            copy_into(out, flat)
    return outs


def sum_into(out: Any, terms: Sequence[Any]) -> None:
    """``out[...] = ((terms[0] + terms[1]) + ...)`` with every term already on ``out``'s GPU."""
    cupy = require_cupy()
    with cupy.cuda.Device(device_of(out).index):
        if len(terms) == 1:
            out[...] = terms[0]
            return
        cupy.add(terms[0], terms[1], out=out)
        for term in terms[2:]:
            cupy.add(out, term, out=out)


def reduce_flat(groups: Sequence[Sequence[Any]], target: Device) -> Any:
    """The elementwise sum over ``groups`` (one aligned list per GPU), packed flat on ``target``.

    Each group is flattened on its GPU; the flat buffers are summed with one NCCL reduce when
    NCCL is available and the GPUs are distinct, else copied to ``target`` and added there.
    """
    flats = [_flatten(group) for group in groups]
    if len(flats) > 1 and nccl.can_reduce(flats, target):
        return nccl.reduce(flats, target)
    out = empty(flats[0].shape, flats[0].dtype, target)
    sum_into(out, [move(f, target) for f in flats])
    return out
