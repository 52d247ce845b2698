"""Page-locked (pinned) staging buffers for asynchronous host-to-GPU copies.

A copy from pageable NumPy memory cannot overlap with other work; staging it through pinned
memory makes ``cudaMemcpyAsync`` truly asynchronous. Buffers come from
:func:`cupy.cuda.alloc_pinned_memory` (CuPy's pinned pool, or ``cudaHostAlloc`` when the pool is
disabled) and must outlive the copies that read them: after queuing a copy,
:func:`release_after` keeps the buffer alive until the copy completes; the next staging buffer
taken on a host thread then drops it (back into the pool, or ``cudaFreeHost``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from cupy_parallel._src.devices import require_cupy

__all__ = ["forget_in_flight", "in_flight", "release_after", "staging_array"]

_lock = threading.Lock()
_in_flight: dict[object, Any] = {}  # token -> pinned memory still read by queued copies
_finished: list[Any] = []  # pinned memory whose copies are done, dropped on a host thread


def staging_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> tuple[np.ndarray, Any]:
    """A C-contiguous pinned NumPy array and the CuPy pinned allocation that backs it."""
    cupy = require_cupy()  # only reachable with a CUDA array in hand, which needs CuPy
    _drop_finished()
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    array = np.frombuffer(memory, dtype, count).reshape(shape)
    return array, memory


def release_after(stream: Any, memory: Any) -> None:
    """Keep ``memory`` alive until the copies queued on ``stream`` so far complete, then drop it.

    A host function queued on ``stream`` (``launch_host_func``) marks the buffer finished when
    its copies are done; the buffer is dropped later on a host thread, by the next
    :func:`staging_array` (which is when the pool can reuse it) or :func:`in_flight`. The host
    function itself only moves a reference between two lists: CUDA forbids CUDA calls in host
    functions, and dropping the last reference is one (``cudaFreeHost``) when the pinned pool is
    disabled (``cupy.cuda.set_pinned_memory_allocator(None)``).
    """
    token = object()
    with _lock:
        _in_flight[token] = memory
    stream.launch_host_func(_finish, token)


def _finish(token: object) -> None:
    """The host function: the copies reading the buffer are done (no CUDA call here)."""
    with _lock:
        memory = _in_flight.pop(token, None)
        if memory is not None:
            _finished.append(memory)


def _drop_finished() -> None:
    """Drop the buffers whose copies are done, on the calling (host) thread."""
    with _lock:
        finished = _finished[:]
        _finished.clear()
    del finished  # outside the lock: the pool's own lock (or cudaFreeHost) comes next


def in_flight() -> int:
    """How many staging buffers still wait for their copies (for tests and diagnostics).

    Example:
        >>> in_flight() >= 0
        True
    """
    _drop_finished()
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
        _finished.clear()
