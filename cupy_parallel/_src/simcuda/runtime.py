"""Simulated ``cupy.cuda.runtime``: device queries and the raw copies the library uses.

Simulated GPUs have no peer access (``deviceCanAccessPeer`` is 0): copies between GPUs work (as
``cudaMemcpyPeer`` does without it), kernels cannot touch another GPU's memory. Stream arguments
are raw handles (``Stream.ptr``); ``0``, ``streamLegacy`` and ``streamPerThread`` mean the
current device's legacy / the calling thread's per-thread default stream.
"""

from __future__ import annotations

from typing import Any

from cupy_parallel._src.simcuda import pointers
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
    set_device(int(device))


def deviceCanAccessPeer(device: int, peer: int) -> int:  # noqa: N802
    """Always 0: the simulated GPUs have no peer access."""
    simulation = state()
    simulation.check_device(device)
    simulation.check_device(peer)
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
    state().check_device(device)
    return {"name": b"Simulated GPU", "totalGlobalMem": 1 << 34, "major": 9, "minor": 0}


def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:  # noqa: N802
    """``cudaMemcpyAsync`` on the stream with handle ``stream``."""
    into, out_of = _SIDES[kind]
    pointers.copy(dst, src, size, from_handle(stream), "memcpyAsync", into=into, out_of=out_of)


def memcpy(dst: int, src: int, size: int, kind: int) -> None:
    """``cudaMemcpy`` on the default stream; the host waits as CUDA documents for the kind.

    (Device to host or host to host: for the copy; pinned host to device: for the copy;
    pageable host to device: for the stream's earlier work; device to device: not at all.)
    """
    into, out_of = _SIDES[kind]
    pointers.copy(dst, src, size, Stream.null, "memcpy", into=into, out_of=out_of, blocking=True)


def memcpyPeerAsync(  # noqa: N802, PLR0917 - CUDA's name and signature
    dst: int, dst_device: int, src: int, src_device: int, size: int, stream: int
) -> None:
    """``cudaMemcpyPeerAsync`` between two GPUs' memory."""
    pointers.copy(
        dst, src, size, from_handle(stream), "memcpyPeerAsync", into="device", out_of="device"
    )


def memcpyPeer(dst: int, dst_device: int, src: int, src_device: int, size: int) -> None:  # noqa: N802
    """``cudaMemcpyPeer``: the host does not wait; the copy is serialised with devices' work.

    As CUDA documents it: asynchronous with respect to the host, but serialised with all pending
    and future work on the current device, ``src_device`` and ``dst_device``.
    """
    devices = tuple(sorted({current_device(), int(src_device), int(dst_device)}))
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
    from_handle(stream).synchronize()
