"""The :class:`Store` interface, the errors stores raise, and the argument checks they share.

Exception policy (so that code ported from ``torch.distributed`` catches the same failures):

- :class:`DistStoreError` is raised when a store operation times out (``get``, ``wait``,
  ``multi_get``, a blocking ``queue_pop``, a server that does not answer in time). It derives
  from both ``RuntimeError`` (what torch's ``DistStoreError`` derives from) and ``TimeoutError``
  (what Python code expects of a timeout).
- :class:`DistNetworkError` is raised when the connection to a TCP store cannot be made or is
  lost, or the server thread died; it derives from ``RuntimeError`` and ``ConnectionError``.
- :class:`QueueEmptyError` (a :class:`DistStoreError`) is raised by ``queue_pop(key,
  block=False)`` on an empty queue, as in torch.
- Bad arguments raise ``TypeError``/``ValueError`` before anything is sent or written; a
  method a user subclass did not implement raises ``NotImplementedError`` (a ``RuntimeError``,
  whose message says "Not implemented.", as torch's).
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arguments import (
    ArgumentError,
    read_bool,
    read_int,
    read_sequence,
    read_timeout,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import TracebackType

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_WAIT_KEYS",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "Missing",
    "QueueEmptyError",
    "Store",
    "check_key",
    "check_keys",
    "check_value",
    "check_values",
    "format_seconds",
    "key_bytes",
    "next_counter",
    "poll",
]

MAX_KEY_BYTES = 4096
"""Longest key, in bytes of its UTF-8 encoding."""
MAX_VALUE_BYTES = 64 * 2**20
"""Longest value, in bytes (64 MiB); also the most bytes one ``multi_set``/``multi_get`` moves."""
MAX_WAIT_KEYS = 1024
"""Most keys one ``wait``, ``check``, ``multi_get`` or ``multi_set`` call may name."""

DEFAULT_TIMEOUT_S = 300.0
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
_COUNTER = re.compile(rb"[+-]?[0-9]{1,19}")


class DistError(RuntimeError):
    """Base of the errors stores raise (``torch.distributed.DistError``).

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.distributed import DistError, DistNetworkError, DistStoreError
        >>> issubclass(DistStoreError, DistError), issubclass(DistNetworkError, RuntimeError)
        (True, True)
    """


class DistStoreError(DistError, TimeoutError):
    """A store operation timed out (``torch.distributed.DistStoreError``; also a TimeoutError).

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.distributed import DistStoreError, HashStore
        >>> try:
        ...     HashStore(timeout=0.01).get("missing")
        ... except TimeoutError as error:  # or RuntimeError, as torch code catches it
        ...     print(type(error).__name__)
        DistStoreError
    """


class DistNetworkError(DistError, ConnectionError):
    """A TCP store could not be reached, lost its connection, or its server thread died.

    Example:
        >>> import cupy_parallel
        >>> import socket
        >>> from cupy_parallel.distributed import DistNetworkError, TCPStore
        >>> with socket.socket() as probe:  # a port nobody listens on
        ...     probe.bind(("127.0.0.1", 0))
        ...     port = probe.getsockname()[1]
        >>> try:
        ...     TCPStore("127.0.0.1", port, timeout=0.1)
        ... except ConnectionError as error:  # or RuntimeError, as torch code catches it
        ...     print(type(error).__name__)
        DistNetworkError
    """


class DistBackendError(DistError):
    """An error of a process group's backend (``torch.distributed.DistBackendError``).

    torch raises it where a collective or a ``wait()`` timed out in its backend; here
    :class:`DistTimeoutError` is one, so that ``except RuntimeError`` (torch users' catch) and
    ``except TimeoutError`` (this library's before) both take a timed-out call.

    Example:
        >>> from cupy_parallel.distributed import DistBackendError, DistTimeoutError
        >>> issubclass(DistTimeoutError, DistBackendError)
        True
        >>> issubclass(DistBackendError, RuntimeError)
        True
    """


class DistTimeoutError(DistBackendError, TimeoutError):
    """A collective, a point-to-point operation or a ``wait()`` that timed out.

    A ``TimeoutError`` and torch's ``DistBackendError`` (so a ``RuntimeError``).

    Example:
        >>> from cupy_parallel.distributed import DistTimeoutError
        >>> issubclass(DistTimeoutError, TimeoutError), issubclass(DistTimeoutError, RuntimeError)
        (True, True)
    """


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty (torch's ``QueueEmptyError``).

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.distributed import HashStore
        >>> HashStore().queue_pop("jobs", block=False)
        Traceback (most recent call last):
        cupy_parallel.distributed.QueueEmptyError: HashStore.queue_pop(...
    """


class Missing(Exception):  # noqa: N818 - an internal signal, never seen by users
    """Raised by a store's primitives when keys are still missing after the wait."""

    def __init__(self, keys: Sequence[str]) -> None:
        super().__init__(list(keys))
        self.keys = list(keys)


def format_seconds(seconds: float) -> str:
    """Format a timeout for messages: ``2.0``, ``0.5``, ``1800.0``."""
    return str(float(seconds))


def check_key(key: object, name: str = "key") -> str:
    """``key`` if it is a ``str``, else ``TypeError`` naming the argument."""
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__} {key!r}.")
    return key


def check_keys(keys: object, name: str = "keys") -> list[str]:
    """A list of at most :data:`MAX_WAIT_KEYS` str keys."""
    listed = read_sequence(
        keys,
        name,
        expected="a list of str",
        hint=f"wrap a single key in a list: [{keys!r}]",
        lists_only=True,
    )
    if len(listed) > MAX_WAIT_KEYS:
        raise ValueError(
            f"{name} may name at most {MAX_WAIT_KEYS} keys, got {len(listed)}; split the call."
        )
    return [check_key(key, f"{name}[{i}]") for i, key in enumerate(listed)]


def check_value(value: object, name: str = "value") -> bytes:
    """``value`` as bytes (``str`` is encoded as UTF-8), at most :data:`MAX_VALUE_BYTES` long."""
    if isinstance(value, str):
        data = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise TypeError(f"{name} must be bytes or str, got {type(value).__name__} {value!r}.")
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(
            f"{name} is {len(data)} bytes long; store values are limited to {MAX_VALUE_BYTES} "
            "bytes. Split it over several keys."
        )
    return data


def check_values(values: object, count: int) -> list[bytes]:
    """``count`` values for ``multi_set``, together at most :data:`MAX_VALUE_BYTES` long."""
    listed = read_sequence(values, "values", expected="a list of bytes or str", lists_only=True)
    if len(listed) != count:
        raise ValueError(f"multi_set needs one value per key: {count} keys, {len(listed)} values.")
    data = [check_value(value, f"values[{i}]") for i, value in enumerate(listed)]
    total = sum(len(item) for item in data)
    if total > MAX_VALUE_BYTES:
        raise ValueError(
            f"multi_set values total {total} bytes; one call moves at most {MAX_VALUE_BYTES} "
            "bytes. Split the call."
        )
    return data


def check_amount(amount: object) -> int:
    """An ``add`` amount: an int (not bool) in the signed 64-bit range.

    Out of range: ``ArgumentError``, a ``ValueError`` that ``except TypeError`` catches
    too (torch's binding raises ``TypeError`` there: the int does not convert to ``int64``).
    """
    value = read_int(amount, "amount")
    if not I64_MIN <= value <= I64_MAX:
        raise ArgumentError(f"amount must fit in a signed 64-bit integer, got {value}.")
    return value


def key_bytes(key: str) -> bytes:
    """Encode a key for a backend; the length check runs before anything is sent or written."""
    data = key.encode()
    if len(data) > MAX_KEY_BYTES:
        raise ValueError(
            f"key {key[:40]!r}... is {len(data)} bytes long in UTF-8; keys are limited to "
            f"{MAX_KEY_BYTES} bytes. Use a shorter key."
        )
    return data


def next_counter(old: bytes | None, amount: int, key: bytes) -> int:
    """The value ``add`` leaves behind, or ``ValueError`` when ``old`` is not a counter."""
    if not old:  # missing or empty counts as 0, as in torch
        new = amount
    elif _COUNTER.fullmatch(old) is None:
        raise ValueError(
            f"add({key.decode(errors='replace')!r}, ...): the key holds {old[:40]!r}, which is "
            "not an integer counter; use add() only on keys that add() created or that hold a "
            "decimal integer."
        )
    else:
        new = int(old) + amount
    if not I64_MIN <= new <= I64_MAX:
        raise ValueError(
            f"add({key.decode(errors='replace')!r}, {amount}): the counter would leave the "
            "int64 range."
        )
    return new


def poll(probe: Callable[[], bool], seconds: float) -> bool:
    """Call ``probe`` with growing pauses until it returns True or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    delay = 0.0005
    while True:
        if probe():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.02)


def _not_implemented(store: Store, method: str) -> NotImplementedError:
    return NotImplementedError(
        f"{type(store).__name__}.{method}: Not implemented. Override {method} in your Store "
        "subclass."
    )


class Store:
    """A key/value store shared by the processes of a job (``torch.distributed.Store``).

    Keys are ``str``; values come back as ``bytes`` (``str`` values are stored as UTF-8).
    Public methods check their arguments, then call a primitive (``_set``, ``_get``, ...) that
    the built-in stores implement. A user subclass may instead override the public methods
    themselves, as in torch (``set``, ``get``, ``add``, ...): methods it leaves out raise
    ``NotImplementedError`` ("Not implemented."), and :meth:`has_extended_api` stays False
    unless it says otherwise. Stores are context managers; ``close()`` releases what they hold.

    Args:
        timeout: default timeout of ``get``, ``wait``, ``multi_get`` and ``queue_pop``, as a
            ``datetime.timedelta`` or seconds.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.distributed import HashStore
        >>> store = HashStore()
        >>> store.set("greeting", "hello")
        >>> store.get("greeting"), store.add("n", 2), store.add("n", 3)
        (b'hello', 2, 5)
        >>> store.compare_set("greeting", "hello", "bye"), store.check(["greeting", "x"])
        (b'bye', False)
        >>> store.multi_set(["a", "b"], ["1", b"2"]); store.multi_get(["a", "b"])
        [b'1', b'2']
        >>> store.append("a", "+"); store.get("a")
        b'1+'
        >>> store.queue_push("jobs", "j1"); store.queue_len("jobs"), store.queue_pop("jobs")
        (1, b'j1')
        >>> store.delete_key("a"), store.num_keys()
        (True, 3)
    """

    _timeout_s = DEFAULT_TIMEOUT_S  # for subclasses that skip Store.__init__

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT_S) -> None:
        self._timeout_s = read_timeout(timeout, "timeout")

    # -- timeout ------------------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """How long ``get``, ``wait`` and ``multi_get`` (without their own timeout) wait."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the default timeout (a ``timedelta`` or seconds)."""
        self._timeout_s = read_timeout(timeout, "timeout")

    # -- the API ------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``, replacing any earlier value."""
        self._set(check_key(key), check_value(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to :attr:`timeout` for some process to set it.

        Raises:
            DistStoreError: the key was not set within the timeout (the message names it).
        """
        key = check_key(key)
        seconds = self._timeout_s
        try:
            return self._get(key, seconds)
        except Missing:
            raise DistStoreError(
                f"{type(self).__name__}.get({key!r}): timeout after {format_seconds(seconds)} s: "
                "no process set the key."
            ) from None

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (created at 0) atomically; return the new value.

        The counter is stored as its ASCII decimal (``get`` returns ``b"5"``); adding to a key
        that holds anything else raises ``ValueError``. (torch reads a leading integer and
        ignores the rest: ``b"12abc"`` counts as 12, ``b"1e3"`` as 1.)
        """
        return self._add(check_key(key), check_amount(amount))

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return what it holds.

        A missing key counts as holding ``b""``; when the key is missing and ``expected_value``
        is not empty, nothing changes and ``expected_value`` comes back (torch's rule).
        """
        return self._compare_set(
            check_key(key),
            check_value(expected_value, "expected_value"),
            check_value(desired_value, "desired_value"),
        )

    def append(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the value of ``key`` (creating it when missing)."""
        self._append(check_key(key), check_value(value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to :attr:`timeout` for all of them.

        Raises:
            DistStoreError: some keys were still missing after the timeout (the message lists
                them).
        """
        names = check_keys(keys)
        seconds = self._timeout_s
        try:
            return self._multi_get(names, seconds)
        except Missing as missing:
            raise self._wait_error("multi_get", seconds, missing.keys) from None

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set every ``keys[i]`` to ``values[i]`` in one atomic step."""
        names = check_keys(keys)
        self._multi_set(names, check_values(values, len(names)))

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Wait until every key in ``keys`` is set (``timeout`` defaults to :attr:`timeout`).

        Raises:
            DistStoreError: some keys were still missing after the timeout (the message lists
                them).
        """
        names = check_keys(keys)
        seconds = self._timeout_s if timeout is None else read_timeout(timeout, positive=False)
        try:
            self._wait(names, seconds)
        except Missing as missing:
            raise self._wait_error("wait", seconds, missing.keys) from None

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        return self._check(check_keys(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        return self._delete(check_key(key))

    def num_keys(self) -> int:
        """How many keys are set (queues and internal bookkeeping are not counted)."""
        return self._num_keys()

    def queue_push(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the FIFO queue ``key`` (``check``/``wait`` see it if non-empty)."""
        self._queue_push(check_key(key), check_value(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest value of queue ``key``.

        Raises:
            QueueEmptyError: ``block=False`` and the queue is empty.
            DistStoreError: ``block=True`` and nothing arrived within :attr:`timeout`.
        """
        key = check_key(key)
        blocking = read_bool(block, "block")
        seconds = self._timeout_s if blocking else None
        try:
            return self._queue_pop(key, seconds)
        except Missing:
            if not blocking:
                raise QueueEmptyError(
                    f"{type(self).__name__}.queue_pop({key!r}, block=False): the queue is empty."
                ) from None
            raise DistStoreError(
                f"{type(self).__name__}.queue_pop({key!r}): timeout after "
                f"{format_seconds(self._timeout_s)} s: the queue stayed empty."
            ) from None

    def queue_len(self, key: str) -> int:
        """How many values queue ``key`` holds (0 for a queue never pushed to)."""
        return self._queue_len(check_key(key))

    def clone(self) -> Store:
        """A new handle on the same store, safe to use from another thread."""
        raise _not_implemented(self, "clone")

    def has_extended_api(self) -> bool:
        """Whether ``append``, ``multi_get`` and ``multi_set`` are native.

        Otherwise they fall back on ``compare_set``/``get``/``set`` (raising "Not implemented."
        when those are missing too).
        """
        return False

    def close(self) -> None:
        """Release what this store holds (a connection, a server, a file); idempotent."""

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _wait_error(self, method: str, seconds: float, missing: list[str]) -> DistStoreError:
        return DistStoreError(
            f"{type(self).__name__}.{method}: timeout after {format_seconds(seconds)} s: "
            f"keys not set: {missing}."
        )

    # -- primitives (built-in stores implement them; user subclasses override the API) --------

    def _set(self, key: str, value: bytes) -> None:
        raise _not_implemented(self, "set")

    def _get(self, key: str, seconds: float) -> bytes:
        """The value; raises :class:`Missing` when the key is still missing after ``seconds``."""
        raise _not_implemented(self, "get")

    def _add(self, key: str, amount: int) -> int:
        raise _not_implemented(self, "add")

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise _not_implemented(self, "compare_set")

    # append, multi_get and multi_set fall back on the public compare_set, get and set, so a
    # subclass that overrides those gets them too (torch's defaults; not atomic for multi_*).

    def _append(self, key: str, value: bytes) -> None:
        # A Python subclass may hold and return str (set("k", "po") stores what it is given):
        # it is compared as returned and extended as its UTF-8 bytes, so str round-trips
        # (torch's trampoline converts the subclass's values to bytes the same way).
        result = f"{type(self).__name__}.compare_set's result"
        expected: bytes | str = b""  # get() might wait forever on a missing key
        desired = value
        current = self.compare_set(key, expected, desired)
        while (held := check_value(current, result)) != desired:
            expected, desired = current, held + value
            current = self.compare_set(key, expected, desired)

    def _multi_get(self, keys: list[str], seconds: float) -> list[bytes]:
        return [check_value(self.get(key), f"{type(self).__name__}.get's result") for key in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def _wait(self, keys: list[str], seconds: float) -> None:
        """Return when all keys are set; raise :class:`Missing` (the missing keys) on timeout."""
        raise _not_implemented(self, "wait")

    def _check(self, keys: list[str]) -> bool:
        raise _not_implemented(self, "check")

    def _delete(self, key: str) -> bool:
        raise _not_implemented(self, "delete_key")

    def _num_keys(self) -> int:
        raise _not_implemented(self, "num_keys")

    def _queue_push(self, key: str, value: bytes) -> None:
        raise _not_implemented(self, "queue_push")

    def _queue_pop(self, key: str, seconds: float | None) -> bytes:
        """Pop; ``seconds=None`` does not wait; raises :class:`Missing` when nothing came."""
        raise _not_implemented(self, "queue_pop")

    def _queue_len(self, key: str) -> int:
        raise _not_implemented(self, "queue_len")
