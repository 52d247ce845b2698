"""Simulated ``cupy.cuda.runtime``: device queries and the raw copies the library uses.

Simulated GPUs have no peer access (``deviceCanAccessPeer`` is 0): copies between GPUs work (as
``cudaMemcpyPeer`` does without it), kernels cannot touch another GPU's memory. Stream arguments
are raw handles (``Stream.ptr``); ``0``, ``streamLegacy`` and ``streamPerThread`` mean the
current device's legacy / the calling thread's per-thread default stream.
"""

from __future__ import annotations

from typing import Any

from cupy_parallel._src.simcuda import pointers
from cupy_parallel._src.simcuda.cargs import as_c_int
from cupy_parallel._src.simcuda.clock import state
from cupy_parallel._src.simcuda.streams import (
    Device,
    Stream,
    current_device,
    from_handle,
    set_device,
)

__all__ = [
    "CUDARuntimeError",
    "deviceCanAccessPeer",
    "deviceSynchronize",
    "driverGetVersion",
    "getDevice",
    "getDeviceCount",
    "getDeviceProperties",
    "memcpy",
    "memcpyAsync",
    "memcpyPeer",
    "memcpyPeerAsync",
    "runtimeGetVersion",
    "setDevice",
    "streamSynchronize",
]

streamLegacy = 1  # noqa: N816 - CUDA's names
streamPerThread = 2  # noqa: N816
memcpyHostToHost = 0  # noqa: N816
memcpyHostToDevice = 1  # noqa: N816
memcpyDeviceToHost = 2  # noqa: N816
memcpyDeviceToDevice = 3  # noqa: N816
memcpyDefault = 4  # noqa: N816

_SIDES = {
    memcpyHostToHost: ("host", "host"),
    memcpyHostToDevice: ("device", "host"),
    memcpyDeviceToHost: ("host", "device"),
    memcpyDeviceToDevice: ("device", "device"),
    memcpyDefault: (None, None),
}


class CUDARuntimeError(RuntimeError):
    """A CUDA runtime error (as ``cupy_backends.cuda.api.runtime.CUDARuntimeError``)."""


def getDeviceCount() -> int:  # noqa: N802
    """How many GPUs the simulation has."""
    return state().n_devices


def getDevice() -> int:  # noqa: N802
    """The calling thread's current GPU."""
    return current_device()


def setDevice(device: int) -> None:  # noqa: N802
    """Make ``device`` current for the calling thread."""
    set_device(as_c_int(device, "device"))


def deviceCanAccessPeer(device: int, peerDevice: int) -> int:  # noqa: N802, N803 - CUDA's names
    """Always 0: the simulated GPUs have no peer access."""
    simulation = state()
    simulation.check_device(as_c_int(device, "device"))
    simulation.check_device(as_c_int(peerDevice, "peerDevice"))
    return 0


def deviceSynchronize() -> None:  # noqa: N802
    """The host waits for all work on the current GPU."""
    Device().synchronize()


def runtimeGetVersion() -> int:  # noqa: N802
    return 12080


def driverGetVersion() -> int:  # noqa: N802
    return 12080


def getDeviceProperties(device: int) -> dict[str, Any]:  # noqa: N802
    """A few properties of a simulated GPU."""
    state().check_device(as_c_int(device, "device"))
    return {"name": b"Simulated GPU", "totalGlobalMem": 1 << 34, "major": 9, "minor": 0}


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:  # noqa: N802
    """``cudaMemcpyAsync`` on the stream with handle ``stream``."""
    dst, src = as_c_int(dst, "dst", "intptr_t"), as_c_int(src, "src", "intptr_t")
    size, kind = as_c_int(size, "size", "size_t"), as_c_int(kind, "kind")
    into, out_of = _sides(kind)
    stream_ = from_handle(as_c_int(stream, "stream", "intptr_t"))
    pointers.copy(dst, src, size, stream_, "memcpyAsync", into=into, out_of=out_of)


def memcpy(dst: int, src: int, size: int, kind: int) -> None:
    """``cudaMemcpy`` on the default stream; the host waits as CUDA documents for the kind.

    (Device to host or host to host: for the copy; pinned host to device: for the copy;
    pageable host to device: for the stream's earlier work; device to device: not at all.)
    """
    dst, src = as_c_int(dst, "dst", "intptr_t"), as_c_int(src, "src", "intptr_t")
    size, kind = as_c_int(size, "size", "size_t"), as_c_int(kind, "kind")
    into, out_of = _sides(kind)
    pointers.copy(dst, src, size, Stream.null, "memcpy", into=into, out_of=out_of, blocking=True)


def memcpyPeerAsync(  # noqa: N802, PLR0917 - CUDA's name and signature
    dst: int,
    dstDevice: int,  # noqa: N803
    src: int,
    srcDevice: int,  # noqa: N803
    size: int,
    stream: int,
) -> None:
    """``cudaMemcpyPeerAsync`` between two GPUs' memory."""
    dst, src, size = _peer_arguments(dst, dstDevice, src, srcDevice, size)
    stream_ = from_handle(as_c_int(stream, "stream", "intptr_t"))
    pointers.copy(dst, src, size, stream_, "memcpyPeerAsync", into="device", out_of="device")


def memcpyPeer(dst: int, dstDevice: int, src: int, srcDevice: int, size: int) -> None:  # noqa: N802, N803
    """``cudaMemcpyPeer``: the host does not wait; the copy is serialised with devices' work.

    As CUDA documents it: asynchronous with respect to the host, but serialised with all pending
    and future work on the current device, ``srcDevice`` and ``dstDevice``.
    """
    dst, src, size = _peer_arguments(dst, dstDevice, src, srcDevice, size)
    devices = tuple(sorted({current_device(), int(srcDevice), int(dstDevice)}))
    pointers.copy(
        dst,
        src,
        size,
        Stream.null,
        "memcpyPeer",
        into="device",
        out_of="device",
        blocking=True,
        serialize_devices=devices,
    )


def streamSynchronize(stream: int) -> None:  # noqa: N802
    """The host waits for the stream with handle ``stream``."""
    from_handle(as_c_int(stream, "stream", "intptr_t")).synchronize()


def _sides(kind: int) -> tuple[str | None, str | None]:
    """Which memory (``"device"``, ``"host"``, ``None``: either) ``kind`` copies into, out of."""
    if kind not in _SIDES:
        raise CUDARuntimeError(f"cudaErrorInvalidMemcpyDirection: invalid copy kind {kind}")
    return _SIDES[kind]


def _peer_arguments(
    dst: Any, dst_device: Any, src: Any, src_device: Any, size: Any
) -> tuple[int, int, int]:
    """The C values of ``memcpyPeer``'s arguments (the device ids are checked, not used)."""
    as_c_int(dst_device, "dstDevice")
    as_c_int(src_device, "srcDevice")
    return (
        as_c_int(dst, "dst", "intptr_t"),
        as_c_int(src, "src", "intptr_t"),
        as_c_int(size, "size", "size_t"),
    )
