"""The four CUDA copies (upload, download, same-GPU, peer), each ordered against current streams.

Each copy is ordered against CuPy's *current* streams of the devices involved, so its result is
ready for whatever the caller queues next on those streams, and the memory it reads or writes is
not reused by the pool before the copy is done (see :mod:`.streams`). Uploads run on a
background stream per GPU (or the caller's stream) from pinned memory; downloads run on the
source GPU's current stream (or the caller's stream) and return when the host buffer is filled.
GPU-to-GPU copies follow torch's two-way rule: the copy waits for the source's stream, and the
source's stream waits for the copy, so the source's memory is not reused before it was read.

These functions take CuPy arrays and GPU indices and depend only on :mod:`.streams`,
:mod:`.pinned` and CuPy: :func:`cupy_parallel._src.arrays.copy_into`, the one raw move between
devices (behind ``to_device`` and ``comm``), picks one of them.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from cupy_parallel._src.cuda.pinned import release_after, staging_array
from cupy_parallel._src.cuda.streams import background_stream, current_stream, wait_stream
from cupy_parallel._src.devices import require_cupy

__all__ = ["download", "local", "peer", "upload", "upload_staged"]


def upload(dst: Any, device: int, host: np.ndarray, stream: Any = None) -> None:
    """Copy host array ``host`` into CuPy array ``dst`` on GPU ``device`` via pinned staging.

    ``stream`` (a stream of ``device``) carries the copy; by default the GPU's background
    stream. The current stream waits for the copy.
    """
    if host.size == 0:
        return
    staged, memory = staging_array(host.shape, host.dtype)
    np.copyto(staged, host, casting="no")
    upload_staged(dst, device, staged, memory, stream)


def upload_staged(dst: Any, device: int, staged: np.ndarray, memory: Any, stream: Any) -> None:
    """Copy pinned ``staged`` (held by ``memory``) into ``dst``; see :func:`upload`."""
    cupy = require_cupy()
    main = current_stream(device)
    copier = background_stream(device) if stream is None else stream
    with cupy.cuda.Device(device):
        wait_stream(copier, device, main, device)  # dst's block may still be in use on main
        target = dst if dst.flags.c_contiguous else cupy.empty(dst.shape, dst.dtype)
        source = ctypes.c_void_p(staged.ctypes.data)
        target.data.copy_from_host_async(source, staged.nbytes, stream=copier)
        release_after(copier, memory)  # the pinned buffer returns to the pool after the copy
        wait_stream(main, device, copier, device)
        if target is not dst:
            dst[...] = target


def download(dst: np.ndarray, src: Any, device: int, stream: Any) -> None:
    """Copy CuPy array ``src`` of GPU ``device`` into host array ``dst``; returns when done."""
    cupy = require_cupy()
    with cupy.cuda.Device(device):
        main = current_stream(device)
        copier = main if stream is None else stream
        wait_stream(copier, device, main, device)
        if dst.flags.c_contiguous:
            src.get(stream=copier, out=dst)  # blocking: dst is filled on return
        else:
            np.copyto(dst, src.get(stream=copier), casting="no")


def local(dst: Any, src: Any, device: int, stream: Any) -> None:
    """Copy ``src`` into ``dst``, both on GPU ``device`` (on ``stream`` if given)."""
    cupy = require_cupy()
    with cupy.cuda.Device(device):
        if stream is None:
            dst[...] = src
            return
        main = current_stream(device)
        wait_stream(stream, device, main, device)
        with stream:
            dst[...] = src
        wait_stream(main, device, stream, device)


def peer(dst: Any, dst_device: int, src: Any, src_device: int, stream: Any) -> None:
    """Copy ``src`` (GPU ``src_device``) into ``dst`` (GPU ``dst_device``), ordered both ways."""
    cupy = require_cupy()
    src_main = current_stream(src_device)
    dst_main = current_stream(dst_device)
    copier = dst_main if stream is None else stream
    with cupy.cuda.Device(src_device):
        contiguous = cupy.ascontiguousarray(src)
    with cupy.cuda.Device(dst_device):
        target = dst if dst.flags.c_contiguous else cupy.empty(dst.shape, dst.dtype)
    wait_stream(copier, dst_device, src_main, src_device)  # the source is ready
    wait_stream(copier, dst_device, dst_main, dst_device)  # the target block is free
    with cupy.cuda.Device(dst_device):
        target.data.copy_from_device_async(contiguous.data, contiguous.nbytes, stream=copier)
    wait_stream(src_main, src_device, copier, dst_device)  # the source is read before reuse
    wait_stream(dst_main, dst_device, copier, dst_device)
    if target is not dst:
        with cupy.cuda.Device(dst_device):
            dst[...] = target
