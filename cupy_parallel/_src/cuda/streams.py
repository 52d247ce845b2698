"""Per-device background copy streams and stream-to-stream ordering with events.

torch's ``Scatter`` copies host data on a background stream per GPU and makes the consumer's
current stream wait for it. CuPy has no ``record_stream``: its memory pool ties a block to the
stream that was current when it was allocated, and a freed block is reused on that stream at
once. So outputs are allocated on the consumer's *current* stream, and the background stream
first waits for the current stream (the block may still be in use by earlier work queued there)
and then the current stream waits for the copy. Freeing the output later is then ordered after
both, which is what ``record_stream`` achieves in torch.
"""

from __future__ import annotations

import threading
from typing import Any

from cupy_parallel._src.devices import cupy_module, require_cupy

__all__ = [
    "StreamHandoff",
    "background_stream",
    "current_stream",
    "forget_background_streams",
    "is_per_thread",
    "is_stream",
    "record_event",
    "stream_device",
    "wait_stream",
]

_lock = threading.Lock()
_background: dict[int, Any] = {}


def is_stream(obj: object) -> bool:
    """Whether ``obj`` is a CuPy stream (``cupy.cuda.Stream`` or ``cupy.cuda.ExternalStream``).

    Example:
        >>> is_stream(None)
        False
    """
    cupy = cupy_module()
    if cupy is None:
        return False
    return isinstance(obj, cupy.cuda.Stream | cupy.cuda.ExternalStream)


def stream_device(stream: Any) -> int:
    """The GPU a stream belongs to; ``-1`` for the null stream (whichever GPU is current)."""
    return int(stream.device_id)


def background_stream(device: int) -> Any:
    """The cached non-blocking copy stream of GPU ``device``, created on first use."""
    with _lock:
        stream = _background.get(device)
        if stream is None:
            cupy = require_cupy()
            with cupy.cuda.Device(device):
                stream = _background[device] = cupy.cuda.Stream(non_blocking=True)
    return stream


def forget_background_streams() -> None:
    """Drop the cached background streams (when the CUDA behind ``cupy_module()`` changes).

    Example:
        >>> forget_background_streams()
    """
    with _lock:
        _background.clear()


def current_stream(device: int) -> Any:
    """CuPy's current stream on GPU ``device`` for the calling thread."""
    return require_cupy().cuda.get_current_stream(device)


def record_event(stream: Any, device: int) -> Any:
    """A new event recorded on ``stream`` of GPU ``device`` (events belong to a device)."""
    cupy = require_cupy()
    with cupy.cuda.Device(device):
        event = cupy.cuda.Event(disable_timing=True)
        event.record(stream)
    return event


def wait_stream(waiter: Any, waiter_device: int, waitee: Any, waitee_device: int) -> Any:
    """Make future work on ``waiter`` wait for the work queued on ``waitee`` so far.

    The one "stream A waits for stream B" helper of the library. Each stream is addressed on
    its own device (a null or per-thread stream means that stream of the given device). Returns
    the event recorded on ``waitee`` (``None`` when both are the same stream: nothing to do).
    """
    if waiter_device == waitee_device and waiter == waitee:
        return None
    event = record_event(waitee, waitee_device)
    with require_cupy().cuda.Device(waiter_device):
        waiter.wait_event(event)
    return event


def is_per_thread(stream: Any) -> bool:
    """Whether ``stream`` is the per-thread default stream handle (another stream per thread)."""
    return bool(stream == require_cupy().cuda.Stream.ptds)


class StreamHandoff:
    """Run work in a worker thread as if the calling thread queued it on its current stream.

    Made in the calling thread for GPU ``device``; the worker enters it (with ``device``
    current) around the work, and the caller calls :meth:`finish` after joining the worker. A
    stream handle that means the same stream in every thread (a created stream, the legacy
    null stream) is simply made current in the worker. The per-thread default stream
    (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) means the *worker's own* stream there, so the
    worker's stream first waits for the caller's (inputs queued by the caller, e.g. scatter's
    copies), and :meth:`finish` makes the caller's stream wait for the worker's (outputs read
    by the caller, e.g. gather).
    """

    def __init__(self, device: int) -> None:
        self._device = device
        self._stream = current_stream(device)
        self._ready = record_event(self._stream, device) if is_per_thread(self._stream) else None
        self._done: Any = None

    def __enter__(self) -> StreamHandoff:
        if self._ready is None:
            self._stream.__enter__()
        else:
            current_stream(self._device).wait_event(self._ready)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._ready is None:
            self._stream.__exit__(*exc_info)
        else:
            self._done = record_event(current_stream(self._device), self._device)

    def finish(self) -> None:
        """In the calling thread, after the worker ended: order the caller after its work."""
        if self._done is not None:
            with require_cupy().cuda.Device(self._device):
                current_stream(self._device).wait_event(self._done)
