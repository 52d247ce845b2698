"""Version counters: how many in-place writes have hit a NumPy buffer's memory.

torch's version counter, for host arrays: views of one buffer share one counter (it is kept for
the ndarray owning the memory), made at the first write and dropped with the memory. The host
array counts every in-place write through its API (:func:`cupy_parallel._src.hostarray.version`
reads it); the tape compares counts to catch a write into an array it saved.
:func:`own_counter` gives a part of a buffer a counter of its own, as torch gives each output of
``comm.broadcast_coalesced`` / ``reduce_add_coalesced`` a new counter although the outputs of a
bucket are views of one flat buffer.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "announce_write",
    "count_write",
    "listen_to_writes",
    "own_counter",
    "read_before_writes",
    "root_buffer",
    "unread_versions",
    "writes",
]

_versions: dict[int, list[Any]] = {}
"""``id(root buffer) -> [writes, weakref to root]``: a buffer's counter, made at its first write."""


def root_buffer(data: np.ndarray, /) -> np.ndarray:
    """The ndarray owning ``data``'s memory (NumPy collapses base chains to it).

    The chain also goes through the ``DummyArray`` that ``sliding_window_view`` and
    ``as_strided`` put between a view and the array it views (an object exposing
    ``__array_interface__`` whose ``base`` is that array): a window of ``x`` is ``x``'s memory,
    as ``x[1:]`` is. (:func:`own_counter`'s arrays stop the chain: their base is a memoryview.)

    Example:
        >>> import numpy as np
        >>> data = np.zeros(4)
        >>> root_buffer(data[1:][::2]) is data
        True
        >>> root_buffer(np.lib.stride_tricks.sliding_window_view(data, 2)) is data
        True
    """
    base: Any = data.base
    while base is not None:  # None ends most chains: tested first (hasattr(None, ...) costs 0.1 us)
        if isinstance(base, np.ndarray):
            data, base = base, base.base
        elif isinstance(getattr(base, "base", None), np.ndarray) and hasattr(
            base, "__array_interface__"
        ):  # as_strided's DummyArray: a view of its own base's memory (its base tested first:
            # the host pool's blocks compute their interface, a dict, when asked for it)
            base = base.base
        else:
            break
    return data


_reader: Callable[[], None] | None = None
"""Who reads the versions it was told to read later, before any count moves (the tapes)."""

_unread = False
"""Whether :func:`unread_versions` was called since the reader last ran."""


def read_before_writes(reader: Callable[[], None], /) -> None:
    """Have ``reader()`` called before the next write counts, once :func:`unread_versions` asks.

    The tapes note the version of each host array a recorded operation touches. They defer the
    reading: an array no write has hit since it was recorded still has the version it had then,
    and most arrays of a training step are never written while a tape holds them. So a tape
    lists what it has not read and calls :func:`unread_versions`; the first :func:`count_write`
    after that calls ``reader()`` (which reads them all) before it counts. One reader (the
    recording module registers itself when imported).
    """
    global _reader
    _reader = reader


def unread_versions() -> None:
    """Say that versions wait to be read: the next :func:`count_write` calls the reader first.

    Example:
        >>> unread_versions()  # the reader (the tapes') runs before the next write counts
    """
    global _unread
    _unread = True


def _read_now() -> None:
    global _unread
    _unread = False  # before reading: a later unread_versions() must call the reader again
    if _reader is not None:
        _reader()


def count_write(data: np.ndarray, /) -> None:
    """Count one in-place write into ``data``'s memory.

    Example:
        >>> import numpy as np
        >>> data = np.zeros(3)
        >>> count_write(data[1:])
        >>> writes(data)
        1
    """
    if _unread:
        _read_now()
    root = root_buffer(data)
    key = id(root)
    entry = _versions.get(key)
    if entry is not None and entry[1]() is root:
        entry[0] += 1
    else:
        _versions[key] = [1, weakref.ref(root, functools.partial(_forget, key))]


def _forget(key: int, _: object) -> None:
    _versions.pop(key, None)


def writes(data: np.ndarray, /) -> int:
    """How many in-place writes have hit ``data``'s memory (through any view of it).

    Example:
        >>> import numpy as np
        >>> writes(np.zeros(1))
        0
    """
    root = root_buffer(data)
    entry = _versions.get(id(root))
    return entry[0] if entry is not None and entry[1]() is root else 0


def own_counter(data: np.ndarray, /) -> np.ndarray:
    """A C-contiguous ``data`` as an array heading a version counter of its own.

    The result is ``data``'s memory (no copy; it keeps ``data`` alive), but writes through it
    and its views count for it alone, not for the buffer ``data`` is a view of, and writes
    through that buffer's other views do not count for it. A 0-size ``data`` (no memory to
    share) gives a new empty array.

    Example:
        >>> import numpy as np
        >>> flat = np.zeros(4)
        >>> first, second = own_counter(flat[:2]), own_counter(flat[2:])
        >>> count_write(first[1:])
        >>> writes(first), writes(second), writes(flat)
        (1, 0, 0)
        >>> np.shares_memory(first, flat)
        True
    """
    if data.size == 0:
        return np.empty(data.shape, data.dtype)
    # An array over a memoryview of ``data``'s bytes: NumPy stops collapsing a view's base chain
    # at an array whose base is not an ndarray, so this array roots its views. (The bytes, as a
    # buffer cannot carry an extension dtype such as ml_dtypes' bfloat16.)
    raw = np.frombuffer(data.reshape(-1).view(np.uint8).data, dtype=data.dtype)
    return raw.reshape(data.shape)


_listeners: list[Callable[[Sequence[Any], str], None]] = []
"""Who hears of the library's own in-place writes (the tapes' ``note_overwritten``)."""


def listen_to_writes(listener: Callable[[Sequence[Any], str], None], /) -> None:
    """Have ``listener(arrays, operation)`` hear of every :func:`announce_write`.

    The tapes register here (``recording`` does, when imported), so that the layers below them
    (``comm``'s ``out=`` forms) can announce their writes without importing them.
    """
    if listener not in _listeners:
        _listeners.append(listener)


def announce_write(arrays: Sequence[Any], operation: str, /) -> None:
    """Tell the listeners that the library's ``operation`` wrote ``arrays`` in place.

    Example:
        >>> import numpy as np
        >>> announce_write([np.zeros(2)], "an example")  # no tape recorded it: nothing to do
    """
    for listener in _listeners:
        listener(arrays, operation)
