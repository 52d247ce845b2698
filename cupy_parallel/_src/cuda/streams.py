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

__all__ = ["background_stream", "current_stream", "is_stream", "stream_device", "wait_stream"]

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


def current_stream(device: int) -> Any:
    """CuPy's current stream on GPU ``device`` for the calling thread."""
    return require_cupy().cuda.get_current_stream(device)


def wait_stream(waiter: Any, waiter_device: int, waitee: Any, waitee_device: int) -> None:
    """Make future work on ``waiter`` wait for the work queued on ``waitee`` so far.

    Each stream is addressed on its own device (a null stream means the null stream of the
    current device, and an event must be recorded on its own device).
    """
    if waiter_device == waitee_device and waiter == waitee:
        return
    cupy = require_cupy()
    with cupy.cuda.Device(waitee_device):
        event = cupy.cuda.Event(disable_timing=True)
        event.record(waitee)
    with cupy.cuda.Device(waiter_device):
        waiter.wait_event(event)
