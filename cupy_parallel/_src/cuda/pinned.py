"""Page-locked (pinned) staging buffers for asynchronous host-to-GPU copies.

A copy from pageable NumPy memory cannot overlap with other work; staging it through pinned
memory makes ``cudaMemcpyAsync`` truly asynchronous. Buffers come from CuPy's pinned memory pool
(:func:`cupy.cuda.alloc_pinned_memory`) and must outlive the copies that read them: after queuing
a copy, :func:`release_after` keeps the buffer alive until the copy completes, then drops it back
into the pool.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from cupy_parallel._src.devices import require_cupy

__all__ = ["forget_in_flight", "in_flight", "release_after", "staging_array"]

_lock = threading.Lock()
_in_flight: dict[object, Any] = {}  # token -> pinned memory still read by queued copies


def staging_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, Any]:
    """A C-contiguous pinned NumPy array and the CuPy pinned allocation that backs it."""
    cupy = require_cupy()  # only reachable with a CUDA array in hand, which needs CuPy
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    array = np.frombuffer(memory, dtype, count).reshape(shape)
    return array, memory


def release_after(stream: Any, memory: Any) -> None:
    """Keep ``memory`` alive until the copies queued on ``stream`` so far complete, then drop it.

    The reference is dropped by a host function queued on ``stream`` (``launch_host_func``), so
    a buffer goes back to the pool as soon as its copies finish, not at the next upload.
    Dropping it only returns it to CuPy's pinned pool (a host-side list operation; CUDA forbids
    CUDA calls in host functions, and the pool makes none). With the pool disabled
    (``cupy.cuda.set_pinned_memory_allocator(None)``) the drop would call ``cudaFreeHost``; that
    setting is not supported by the staging path.
    """
    token = object()
    with _lock:
        _in_flight[token] = memory
    stream.launch_host_func(_release, token)


def _release(token: object) -> None:
    with _lock:
        memory = _in_flight.pop(token, None)
    del memory  # outside the lock: the pool's own lock is taken when the buffer goes back


def in_flight() -> int:
    """How many staging buffers still wait for their copies (for tests and diagnostics).

    Example:
        >>> in_flight() >= 0
        True
    """
    with _lock:
        return len(_in_flight)


def forget_in_flight() -> None:
    """Drop every buffer still waiting (when the CUDA behind ``cupy_module()`` goes away).

    Example:
        >>> forget_in_flight()
        >>> in_flight()
        0
    """
    with _lock:
        _in_flight.clear()
