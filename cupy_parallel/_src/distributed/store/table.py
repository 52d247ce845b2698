"""The in-memory state of a store, and :class:`HashStore`, the store that is only that state.

:class:`Table` holds keys and queues and implements every operation that changes them, with
no locking and no waiting: the TCP server, :class:`HashStore` and the FileStore's log replay
all apply operations through it, so the three agree on the semantics by construction.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

from cupy_parallel._src.distributed.store.interface import (
    DEFAULT_TIMEOUT_S,
    MAX_VALUE_BYTES,
    Missing,
    Store,
    key_bytes,
    next_counter,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from datetime import timedelta

__all__ = ["HashStore", "Table"]


class Table:
    """Keys (``bytes`` → ``bytes``) and FIFO queues (``bytes`` → values), apart from each other."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}

    def set(self, key: bytes, value: bytes) -> None:
        self.data[key] = value

    def add(self, key: bytes, amount: int) -> bytes:
        """Add to a counter; returns the new value as stored (ASCII decimal)."""
        value = b"%d" % next_counter(self.data.get(key), amount, key)
        self.data[key] = value
        return value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self.data.get(key)
        if current is None:
            if expected:
                return expected
        elif current != expected:
            return current
        self.data[key] = desired
        return desired

    def append(self, key: bytes, value: bytes) -> None:
        old = self.data.get(key, b"")
        if len(old) + len(value) > MAX_VALUE_BYTES:
            raise ValueError(
                f"append({key.decode(errors='replace')!r}, ...): the value would grow to "
                f"{len(old) + len(value)} bytes; store values are limited to {MAX_VALUE_BYTES}."
            )
        self.data[key] = old + value

    def multi_set(self, keys: Iterable[bytes], values: Iterable[bytes]) -> None:
        self.data.update(zip(keys, values, strict=True))

    def delete(self, key: bytes) -> bool:
        return self.data.pop(key, None) is not None

    def missing(self, keys: Iterable[bytes]) -> list[bytes]:
        """Keys that are neither set nor a non-empty queue (what ``check``/``wait`` see)."""
        data, queues = self.data, self.queues
        return [key for key in keys if key not in data and key not in queues]

    def unset(self, keys: Iterable[bytes]) -> list[bytes]:
        """Keys without a value (what ``get``/``multi_get`` wait for)."""
        data = self.data
        return [key for key in keys if key not in data]

    def queue_push(self, key: bytes, value: bytes) -> None:
        self.queues.setdefault(key, deque()).append(value)

    def queue_pop(self, key: bytes) -> bytes | None:
        queue = self.queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return value

    def queue_len(self, key: bytes) -> int:
        return len(self.queues.get(key, ()))


class HashStore(Store):
    """A store kept in this process's memory, shared by threads (``torch.distributed.HashStore``).

    Handles made by :meth:`clone` share the same keys. Blocking calls wait on a condition
    variable, so a ``set`` from another thread wakes them at once.

    Args:
        timeout: default timeout of ``get``/``wait``/``multi_get``/``queue_pop``
            (``timedelta`` or seconds).

    Example:
        >>> import cupy_parallel
        >>> import threading
        >>> from cupy_parallel.distributed import HashStore
        >>> store = HashStore()
        >>> threading.Timer(0.05, store.set, ("ready", "yes")).start()
        >>> store.get("ready")  # waits for the other thread
        b'yes'
        >>> store.clone().get("ready")
        b'yes'
    """

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(timeout)
        self._table = Table()
        self._changed = threading.Condition()

    def clone(self) -> HashStore:
        """Another handle on the same keys (with its own timeout)."""
        twin = HashStore(self._timeout_s)
        twin._table, twin._changed = self._table, self._changed
        return twin

    def has_extended_api(self) -> bool:
        """True: every method is implemented."""
        return True

    def __repr__(self) -> str:
        return f"HashStore(timeout={self.timeout!r})"

    def _change(self, action: Callable[[Table], object]) -> object:
        with self._changed:
            result = action(self._table)
            self._changed.notify_all()
            return result

    def _await(self, ready: Callable[[], bytes | None], seconds: float, keys: list[str]) -> bytes:
        """Wait until ``ready()`` returns bytes (maybe empty); Missing(keys) on timeout."""
        found: list[bytes] = []

        def probe() -> bool:
            value = ready()
            if value is not None:
                found.append(value)
            return value is not None

        with self._changed:
            self._changed.wait_for(probe, seconds)
        if not found:
            raise Missing(keys)
        return found[0]

    def _set(self, key: str, value: bytes) -> None:
        self._change(lambda t: t.set(key_bytes(key), value))

    def _get(self, key: str, seconds: float) -> bytes:
        name = key_bytes(key)
        return self._await(lambda: self._table.data.get(name), seconds, [key])

    def _add(self, key: str, amount: int) -> int:
        return int(self._change(lambda t: t.add(key_bytes(key), amount)))  # type: ignore[call-overload]

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._change(lambda t: t.compare_set(key_bytes(key), expected, desired))  # type: ignore[return-value]

    def _append(self, key: str, value: bytes) -> None:
        self._change(lambda t: t.append(key_bytes(key), value))

    def _multi_get(self, keys: list[str], seconds: float) -> list[bytes]:
        names = [key_bytes(key) for key in keys]
        with self._changed:
            if not self._changed.wait_for(lambda: not self._table.unset(names), seconds):
                raise Missing([name.decode() for name in self._table.unset(names)])
            data = self._table.data
            return [data[name] for name in names]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._change(lambda t: t.multi_set([key_bytes(key) for key in keys], values))

    def _wait(self, keys: list[str], seconds: float) -> None:
        names = [key_bytes(key) for key in keys]
        with self._changed:
            done = self._changed.wait_for(lambda: not self._table.missing(names), seconds)
            if not done:
                missing = self._table.missing(names)
                raise Missing([name.decode() for name in missing])

    def _check(self, keys: list[str]) -> bool:
        with self._changed:
            return not self._table.missing([key_bytes(key) for key in keys])

    def _delete(self, key: str) -> bool:
        return bool(self._change(lambda t: t.delete(key_bytes(key))))

    def _num_keys(self) -> int:
        with self._changed:
            return len(self._table.data)

    def _queue_push(self, key: str, value: bytes) -> None:
        self._change(lambda t: t.queue_push(key_bytes(key), value))

    def _queue_pop(self, key: str, seconds: float | None) -> bytes:
        name = key_bytes(key)
        if seconds is None:
            with self._changed:
                value = self._table.queue_pop(name)
            if value is None:
                raise Missing([key])
            return value
        return self._await(lambda: self._table.queue_pop(name), seconds, [key])

    def _queue_len(self, key: str) -> int:
        with self._changed:
            return self._table.queue_len(key_bytes(key))
