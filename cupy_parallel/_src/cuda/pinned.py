"""Page-locked (pinned) staging buffers for asynchronous host-to-GPU copies.

A copy from pageable NumPy memory cannot overlap with other work; staging it through pinned
memory makes ``cudaMemcpyAsync`` truly asynchronous. Buffers come from CuPy's pinned memory pool
(:func:`cupy.cuda.alloc_pinned_memory`) and must outlive the copies that read them: after queuing
a copy, :func:`release_after` keeps the buffer alive until an event recorded behind the copy
completes, then drops it back into the pool.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from cupy_parallel._src.devices import require_cupy

__all__ = ["in_flight", "release_after", "staging_array"]

_lock = threading.Lock()
_in_flight: list[tuple[Any, Any]] = []


def staging_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, Any]:
    """A C-contiguous pinned NumPy array and the CuPy pinned allocation that backs it."""
    cupy = require_cupy()  # only reachable with a CUDA array in hand, which needs CuPy
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    array = np.frombuffer(memory, dtype, count).reshape(shape)
    return array, memory


def release_after(event: Any, memory: Any) -> None:
    """Keep ``memory`` alive until ``event`` (recorded after the copies reading it) completes."""
    with _lock:
        _in_flight.append((event, memory))
        _in_flight[:] = [(e, m) for e, m in _in_flight if not e.done]


def in_flight() -> int:
    """How many staging buffers still wait for their copies (for tests and diagnostics).

    Example:
        >>> in_flight() >= 0
        True
    """
    with _lock:
        _in_flight[:] = [(e, m) for e, m in _in_flight if not e.done]
        return len(_in_flight)
