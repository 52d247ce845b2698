"""Copies between devices: host to GPU through pinned staging, GPU to host, GPU to GPU.

Copies between host memories (``"cpu"`` and ``"host:k"``) are one ``numpy.copyto``.

Copies that touch a GPU go through :mod:`.copies`, which orders each against CuPy's *current*
streams of the devices involved (see there and :mod:`.streams`). Host-to-GPU copies run on a
background stream per GPU (or the stream the caller passes) from pinned memory, so the
host-side staging of the next chunk overlaps with the DMA of the previous one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import device_of, empty
from cupy_parallel._src.cuda import nccl_comm as nccl
from cupy_parallel._src.cuda.copies import download, local, peer, upload, upload_staged
from cupy_parallel._src.cuda.pinned import staging_array
from cupy_parallel._src.devices import require_cupy
from cupy_parallel._src.hostarray import plain_buffer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.devices import Device

__all__ = [
    "broadcast_flat",
    "broadcast_from_host",
    "copy_into",
    "move",
    "reduce_flat",
    "sum_into",
]


def copy_into(dst: Any, src: Any, *, stream: Any = None) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype), whatever devices they live on.

    ``stream`` (on ``dst``'s GPU for uploads and peer copies, on ``src``'s GPU for downloads)
    carries the copy instead of the default: a background stream for uploads, the current
    stream otherwise. Either way the current streams wait for the copy before returning.
    """
    source, target = device_of(src), device_of(dst)
    if source.kind != "cuda" and target.kind != "cuda":
        np.copyto(plain_buffer(dst), plain_buffer(src), casting="no")
    elif src.size == 0:
        return
    elif target.kind == "cuda" and source.kind != "cuda":
        upload(dst, target.index, plain_buffer(src), stream)
    elif source.kind == "cuda" and target.kind != "cuda":
        download(plain_buffer(dst), src, source.index, stream)
    elif source == target:
        local(dst, src, target.index, stream)
    else:
        peer(dst, target.index, src, source.index, stream)


def move(x: Any, device: Device) -> Any:
    """``x`` on ``device``: itself when already there, else a copy ordered as :func:`copy_into`."""
    if device_of(x) == device:
        return x
    out = empty(x.shape, x.dtype, device)
    copy_into(out, x)
    return out


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
