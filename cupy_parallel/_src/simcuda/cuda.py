"""Simulated ``cupy.cuda``: devices, streams, events, memory and the runtime.

``nccl`` is the simulated ``cupy.cuda.nccl`` from :mod:`cupy_parallel._src.simcuda.sim_nccl` when
that module exists (looked up lazily); without it, ``cupy.cuda.nccl`` raises ``AttributeError``,
which callers read as "NCCL is not available".
"""

from __future__ import annotations

import importlib
from typing import Any

from cupy_parallel._src.simcuda import clock, runtime
from cupy_parallel._src.simcuda.pointers import (
    Memory,
    MemoryPointer,
    PinnedMemoryPointer,
    alloc,
    alloc_pinned_memory,
    set_pinned_memory_allocator,
)
from cupy_parallel._src.simcuda.streams import (
    Device,
    Event,
    ExternalStream,
    Stream,
    current_device,
    get_current_stream,
)

__all__ = [
    "Device",
    "Event",
    "ExternalStream",
    "Memory",
    "MemoryPointer",
    "PinnedMemoryPointer",
    "Stream",
    "alloc",
    "alloc_pinned_memory",
    "get_current_stream",
    "get_device_id",
    "is_available",
    "runtime",
    "set_pinned_memory_allocator",
]


def is_available() -> bool:
    """Whether a simulation is running (the simulated CUDA then has GPUs)."""
    try:
        return clock.state().n_devices > 0
    except clock.SimulationError:
        return False


def get_device_id() -> int:
    """The calling thread's current GPU."""
    return current_device()


def __getattr__(name: str) -> Any:
    if name == "nccl":
        try:
            return importlib.import_module("cupy_parallel._src.simcuda.sim_nccl")
        except ModuleNotFoundError as error:
            raise AttributeError("The simulated CUDA has no NCCL (simcuda/sim_nccl.py).") from error
    raise AttributeError(f"module 'cupy.cuda' (simulated) has no attribute {name!r}")
