"""PrefixStore: a view of another store in which every key carries a prefix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cupy_parallel._src.arguments import ArgumentError
from cupy_parallel._src.distributed.store.interface import (
    Store,
    check_key,
    check_keys,
    check_value,
    check_values,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """A view of ``store`` in which every key is stored as ``f"{prefix}/{key}"``.

    Process groups use it to share one store without their keys colliding. Every call goes to
    the underlying store's public method with the prefixed keys, so a user-written
    :class:`Store` subclass works underneath, as in torch. The timeout is the underlying
    store's (reading or setting it here reads or sets that one); ``num_keys`` counts all keys
    of the underlying store, as in PyTorch; ``close`` leaves the underlying store open.

    Args:
        prefix: prepended, with a ``/``, to every key.
        store: the store that holds the keys (:attr:`underlying_store`).

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.distributed import HashStore, PrefixStore
        >>> base = HashStore()
        >>> group = PrefixStore("group1", base)
        >>> group.set("x", "1")
        >>> base.get("group1/x"), base.check(["x"]), group.underlying_store is base
        (b'1', False, True)
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__} {prefix!r}.")
        if not isinstance(store, Store):
            raise ArgumentError(  # torch's ValueError too
                "store must be a cupy_parallel Store (TCPStore, FileStore, HashStore, "
                f"PrefixStore or a subclass of Store), got {type(store).__name__}."
            )
        self._prefix = prefix
        self._store = store

    @property
    def prefix(self) -> str:
        """The prefix of this view."""
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store that holds the keys."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The underlying store's timeout."""
        return self._store.timeout

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the underlying store's timeout."""
        self._store.set_timeout(timeout)

    def clone(self) -> PrefixStore:
        """The same view over a clone of the underlying store."""
        return PrefixStore(self._prefix, self._store.clone())

    def has_extended_api(self) -> bool:
        """The underlying store's answer."""
        return self._store.has_extended_api()

    def close(self) -> None:
        """Do nothing: the underlying store stays open (close it directly)."""

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"

    def _full(self, key: str) -> str:
        return f"{self._prefix}/{check_key(key)}"

    def _fulls(self, keys: Sequence[str]) -> list[str]:
        return [f"{self._prefix}/{key}" for key in check_keys(keys)]

    # The public API forwards to the underlying store's public API, values as bytes both ways:
    # a Python subclass underneath receives bytes and may return str (torch's PrefixStore, in
    # C++, converts through its trampoline the same way).

    def set(self, key: str, value: bytes | str) -> None:
        self._store.set(self._full(key), check_value(value))

    def get(self, key: str) -> bytes:
        return _held(self._store.get(self._full(key)), self._store, "get")

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._full(key), amount)

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        full = self._full(key)
        expected = check_value(expected_value, "expected_value")
        desired = check_value(desired_value, "desired_value")
        return _held(self._store.compare_set(full, expected, desired), self._store, "compare_set")

    def append(self, key: str, value: bytes | str) -> None:
        self._store.append(self._full(key), check_value(value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = self._store.multi_get(self._fulls(keys))
        return [_held(value, self._store, "multi_get") for value in values]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        fulls = self._fulls(keys)
        self._store.multi_set(fulls, check_values(values, len(fulls)))

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        self._store.wait(self._fulls(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check(self._fulls(keys))

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._full(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def queue_push(self, key: str, value: bytes | str) -> None:
        self._store.queue_push(self._full(key), check_value(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return _held(self._store.queue_pop(self._full(key), block), self._store, "queue_pop")

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(self._full(key))


def _held(value: object, store: Store, method: str) -> bytes:
    """A value the underlying store returned, as bytes (a Python subclass may return str)."""
    return check_value(value, f"{type(store).__name__}.{method}'s result")
