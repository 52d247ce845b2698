"""Key/value stores that processes use to find each other: TCP, file, and prefixed views.

A store maps ``str`` keys to ``bytes`` values. Every process of a job opens the same store (one
process hosts a :class:`TCPStore` server, or all share a :class:`FileStore` file) and uses it to
exchange small pieces of set-up data: who has arrived, the NCCL unique id, group membership.
The API is ``torch.distributed``'s: ``set``, ``get`` (waits for the key), ``add`` (an atomic
counter), ``wait``, ``check``, ``delete_key``, ``num_keys``.

Decisions where PyTorch is silent or differs:

- ``num_keys`` counts only keys written through ``set``/``add`` (PyTorch's TCPStore adds one for
  its own bookkeeping key; here worker registration lives outside the key space).
- ``add`` keeps the counter as the ASCII decimal of its value, as PyTorch does, so
  ``get`` after ``add(key, 5)`` returns ``b"5"``. Adding to a key that holds anything else raises
  ``ValueError``. Counters are signed 64-bit integers.
- Keys are at most :data:`MAX_KEY_BYTES` bytes in UTF-8, values at most :data:`MAX_VALUE_BYTES`
  bytes, and ``wait``/``check`` take at most :data:`MAX_WAIT_KEYS` keys (PyTorch has no bounds;
  the TCP server needs them to refuse hostile input).
- ``Store`` objects are context managers; ``close()`` releases the connection, the server or the
  file. Closing a ``PrefixStore`` leaves its underlying store open.

TCPStore wire protocol (no pickle; only byte strings and integers, all big-endian). Every
message, in either direction, is a frame: a ``u32`` body length, then the body. A request body
is an ``u8`` opcode then its fields; byte strings are a ``u32`` length then the bytes; counts are
``u32``; integers ``i64``; timeouts ``u64`` milliseconds. A response body is an ``u8`` status
(OK, VALUE, INT, TIMEOUT, ERROR) then its payload. A frame longer than ``MAX_VALUE_BYTES`` plus
a small header allowance, a key or value over its bound, an unknown opcode, a short or
over-long body, or more than ``MAX_WAIT_KEYS`` keys closes that connection; the server goes on
serving the others. Blocking requests (``get``, ``wait``) are parked on the server, which
answers them when the keys arrive or their timeout passes, so one waiting client never holds
up another.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import fcntl
import ipaddress
import operator
import os
import re
import selectors
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from types import TracebackType

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_WAIT_KEYS",
    "FileStore",
    "PrefixStore",
    "Store",
    "TCPStore",
]

MAX_KEY_BYTES = 4096
"""Longest key, in bytes of its UTF-8 encoding."""
MAX_VALUE_BYTES = 64 * 2**20
"""Longest value, in bytes (64 MiB)."""
MAX_WAIT_KEYS = 1024
"""Most keys one ``wait`` or ``check`` call may name."""

_DEFAULT_TIMEOUT = timedelta(seconds=300)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_MAX_TIMEOUT_MS = 2**40  # ~35 years; anything longer is "forever"
# The largest legal request is SET: opcode, two length prefixes, a maximal key and value.
_MAX_FRAME_BYTES = 1 + 4 + MAX_KEY_BYTES + 4 + MAX_VALUE_BYTES
_COUNTER = re.compile(rb"[+-]?[0-9]{1,19}")
_IO_SLACK_S = 30.0  # how much longer than a request's own timeout a client waits for the answer


def _seconds(timeout: timedelta) -> str:
    """Format a timeout for messages: ``2.0``, ``0.5``, ``1800.0``."""
    return str(timeout.total_seconds())


def _check_timeout(timeout: object, name: str, *, allow_zero: bool = False) -> timedelta:
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"{name} must be a datetime.timedelta, got {type(timeout).__name__} {timeout!r}; "
            "pass e.g. timedelta(seconds=30)."
        )
    if timeout < timedelta(0) or (timeout == timedelta(0) and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {timeout!r}.")
    return timeout


def _check_key(key: object, name: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__} {key!r}.")
    return key


def _check_keys(keys: object) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
        raise TypeError(
            f"keys must be a list of str, got {type(keys).__name__} {keys!r}; "
            f"wrap a single key in a list: [{keys!r}]."
        )
    if len(keys) > MAX_WAIT_KEYS:
        raise ValueError(
            f"keys may name at most {MAX_WAIT_KEYS} keys, got {len(keys)}; split the call."
        )
    return [_check_key(key, f"keys[{i}]") for i, key in enumerate(keys)]


def _check_value(value: object) -> bytes:
    if isinstance(value, str):
        data = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise TypeError(f"value must be bytes or str, got {type(value).__name__} {value!r}.")
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(
            f"value is {len(data)} bytes long; store values are limited to {MAX_VALUE_BYTES} "
            "bytes. Split it over several keys."
        )
    return data


def _check_amount(amount: object) -> int:
    if isinstance(amount, bool):
        raise TypeError(f"amount must be an int, got bool {amount!r}.")
    try:
        value = operator.index(amount)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"amount must be an int, got {type(amount).__name__} {amount!r}.") from None
    if not _I64_MIN <= value <= _I64_MAX:
        raise ValueError(f"amount must fit in a signed 64-bit integer, got {value}.")
    return value


def _key_bytes(key: str) -> bytes:
    """Encode a key for a backend; the check runs before anything is sent or written."""
    data = key.encode()
    if len(data) > MAX_KEY_BYTES:
        raise ValueError(
            f"key {key[:40]!r}... is {len(data)} bytes long in UTF-8; keys are limited to "
            f"{MAX_KEY_BYTES} bytes. Use a shorter key."
        )
    return data


def _next_counter(old: bytes | None, amount: int, key: str) -> int:
    """The value ``add`` leaves behind, or ``ValueError`` when ``old`` is not a counter."""
    if old is None:
        old = b"0"
    if _COUNTER.fullmatch(old) is None:
        raise ValueError(
            f"add({key!r}, ...): the key holds {old[:40]!r}, which is not an integer counter; "
            "use add() only on keys that add() created or that hold a decimal integer."
        )
    new = int(old) + amount
    if not _I64_MIN <= new <= _I64_MAX:
        raise ValueError(f"add({key!r}, {amount}): the counter would leave the int64 range.")
    return new


def _poll(probe: Callable[[], bool], seconds: float) -> bool:
    """Call ``probe`` with growing pauses until it returns True or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    delay = 0.001
    while True:
        if probe():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.05)


# --------------------------------------------------------------------------------------------
# The interface


class Store(abc.ABC):
    """A key/value store shared by the processes of a job (``torch.distributed.Store``).

    Public methods check their arguments and turn timeouts into ``TimeoutError``; subclasses
    supply the primitives. Values come back as ``bytes``; ``str`` values are stored as UTF-8.

    Example:
        >>> from cupy_parallel._src.distributed.store import TCPStore
        >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
        ...     store.set("greeting", "hello")
        ...     store.get("greeting")
        b'hello'
    """

    def __init__(self, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
        self._timeout = _check_timeout(timeout, "timeout")

    # -- public API ---------------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        """How long ``get`` and ``wait`` (without their own timeout) wait for keys."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default timeout of ``get`` and ``wait``.

        Example:
            >>> from datetime import timedelta
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.set_timeout(timedelta(seconds=10))
            ...     store.timeout
            datetime.timedelta(seconds=10)
        """
        self._timeout = _check_timeout(timeout, "timeout")

    def set(self, key: str, value: bytes | str) -> None:
        r"""Store ``value`` under ``key``, replacing any earlier value.

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.set("k", b"\x00\x01")
            ...     store.get("k")
            b'\x00\x01'
        """
        self._set(_check_key(key), _check_value(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to :attr:`timeout` for some process to set it.

        Raises:
            TimeoutError: the key was not set within the timeout (the message names it).

        Example:
            >>> from datetime import timedelta
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True,
            ...               timeout=timedelta(seconds=0.1)) as store:
            ...     store.get("never")
            Traceback (most recent call last):
            TimeoutError: TCPStore.get('never') timed out after 0.1 s: no process set the key.
        """
        key = _check_key(key)
        timeout = self.timeout
        value = self._get(key, timeout.total_seconds())
        if value is None:
            raise TimeoutError(
                f"{type(self).__name__}.get({key!r}) timed out after {_seconds(timeout)} s: "
                "no process set the key."
            )
        return value

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (created at 0) atomically; return the new value.

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.add("n", 2), store.add("n", -5), store.get("n")
            (2, -3, b'-3')
        """
        return self._add(_check_key(key), _check_amount(amount))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set (``timeout`` defaults to :attr:`timeout`).

        Raises:
            TimeoutError: some keys were still missing after the timeout (the message lists them).

        Example:
            >>> from datetime import timedelta
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.set("a", "1")
            ...     store.wait(["a"])
            ...     store.wait(["a", "b"], timedelta(seconds=0.1))
            Traceback (most recent call last):
            TimeoutError: TCPStore.wait timed out after 0.1 s: keys not set: ['b'].
        """
        names = _check_keys(keys)
        limit = (
            self.timeout if timeout is None else _check_timeout(timeout, "timeout", allow_zero=True)
        )
        missing = self._wait(names, limit.total_seconds())
        if missing:
            raise TimeoutError(
                f"{type(self).__name__}.wait timed out after {_seconds(limit)} s: "
                f"keys not set: {missing}."
            )

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` is set, without waiting.

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.set("a", "1")
            ...     store.check(["a"]), store.check(["a", "b"])
            (True, False)
        """
        return self._check(_check_keys(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; return whether it existed.

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.set("a", "1")
            ...     store.delete_key("a"), store.delete_key("a")
            (True, False)
        """
        return self._delete(_check_key(key))

    def num_keys(self) -> int:
        """How many keys are set (written by ``set`` or ``add`` and not deleted).

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.set("a", "1")
            ...     _ = store.add("b", 1)
            ...     store.num_keys()
            2
        """
        return self._num_keys()

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this store holds (a connection, a server, a file); idempotent.

        Using a closed store raises ``ValueError``.

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> store = TCPStore("127.0.0.1", 0, is_master=True)
            >>> store.close()
            >>> store.close()
        """

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- primitives ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str, seconds: float) -> bytes | None:
        """The value, or None when the key is still missing after ``seconds``."""

    @abc.abstractmethod
    def _add(self, key: str, amount: int) -> int: ...

    @abc.abstractmethod
    def _wait(self, keys: list[str], seconds: float) -> list[str]:
        """The keys still missing after ``seconds`` (empty when all arrived)."""

    @abc.abstractmethod
    def _check(self, keys: list[str]) -> bool: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _num_keys(self) -> int: ...


# --------------------------------------------------------------------------------------------
# PrefixStore


class PrefixStore(Store):
    """A view of ``store`` in which every key is stored as ``f"{prefix}/{key}"``.

    Process groups use it to share one store without their keys colliding. The timeout is the
    underlying store's (reading or setting it here reads or sets that one); ``num_keys`` counts
    all keys of the underlying store, as in PyTorch; ``close`` leaves the underlying store open.

    Args:
        prefix: prepended, with a ``/``, to every key.
        store: the store that holds the keys.

    Example:
        >>> from cupy_parallel._src.distributed.store import PrefixStore, TCPStore
        >>> with TCPStore("127.0.0.1", 0, is_master=True) as base:
        ...     group = PrefixStore("group1", base)
        ...     group.set("x", "1")
        ...     base.get("group1/x"), base.check(["x"])
        (b'1', False)
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__} {prefix!r}.")
        if not isinstance(store, Store):
            raise TypeError(
                f"store must be a cupy_parallel Store (TCPStore, FileStore, PrefixStore), "
                f"got {type(store).__name__}."
            )
        self._prefix = prefix
        self._store = store

    @property
    def prefix(self) -> str:
        """The prefix of this view.

        Example:
            >>> from cupy_parallel._src.distributed.store import PrefixStore, TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as base:
            ...     PrefixStore("p", base).prefix
            'p'
        """
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store that holds the keys.

        Example:
            >>> from cupy_parallel._src.distributed.store import PrefixStore, TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as base:
            ...     PrefixStore("p", base).underlying_store is base
            True
        """
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The underlying store's timeout."""
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the underlying store's timeout.

        Example:
            >>> from datetime import timedelta
            >>> from cupy_parallel._src.distributed.store import PrefixStore, TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as base:
            ...     PrefixStore("p", base).set_timeout(timedelta(seconds=7))
            ...     base.timeout
            datetime.timedelta(seconds=7)
        """
        self._store.set_timeout(timeout)

    def close(self) -> None:
        """Do nothing: the underlying store stays open (close it directly).

        Example:
            >>> from cupy_parallel._src.distributed.store import PrefixStore, TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as base:
            ...     PrefixStore("p", base).close()
            ...     base.set("still", "open")
        """

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"

    def _full(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._full(key), value)

    def _get(self, key: str, seconds: float) -> bytes | None:
        return self._store._get(self._full(key), seconds)

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._full(key), amount)

    def _wait(self, keys: list[str], seconds: float) -> list[str]:
        missing = self._store._wait([self._full(key) for key in keys], seconds)
        start = len(self._prefix) + 1
        return [key[start:] for key in missing]

    def _check(self, keys: list[str]) -> bool:
        return self._store._check([self._full(key) for key in keys])

    def _delete(self, key: str) -> bool:
        return self._store._delete(self._full(key))

    def _num_keys(self) -> int:
        return self._store._num_keys()


# --------------------------------------------------------------------------------------------
# FileStore

_FILE_MAGIC = b"cupy_parallel FileStore v1\n"
_RECORD = struct.Struct(">cII")  # kind, key length, value length; then key, value


class _Record(bytes, enum.Enum):
    SET = b"S"
    DELETE = b"D"
    COUNTER = b"C"  # bookkeeping counters (users, finished), outside the key space


class _LogFile:
    """An append-only record log shared through ``flock``; keeps a parsed cache of it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.lock = threading.Lock()
        self.offset = 0
        self.data: dict[bytes, bytes] = {}
        self.counters: dict[bytes, int] = {}

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool) -> Iterator[None]:
        with self.lock:
            if self.fd < 0:
                raise ValueError(f"FileStore({self.path!r}) is closed; open a new FileStore.")
            fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._refresh()
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _refresh(self) -> None:
        size = os.fstat(self.fd).st_size
        if size <= self.offset:
            return
        chunk = os.pread(self.fd, size - self.offset, self.offset)
        pos = 0
        if self.offset == 0:
            if not chunk.startswith(_FILE_MAGIC):
                raise ValueError(
                    f"{self.path!r} is not a FileStore file (it does not start with "
                    f"{_FILE_MAGIC!r}); point file_name at a new or FileStore-owned path."
                )
            pos = len(_FILE_MAGIC)
        while pos + _RECORD.size <= len(chunk):
            kind, key_len, value_len = _RECORD.unpack_from(chunk, pos)
            end = pos + _RECORD.size + key_len + value_len
            if end > len(chunk):
                break  # a record still being written by a writer that died; never completed
            key = chunk[pos + _RECORD.size : pos + _RECORD.size + key_len]
            value = chunk[pos + _RECORD.size + key_len : end]
            if kind == _Record.SET.value:
                self.data[key] = value
            elif kind == _Record.DELETE.value:
                self.data.pop(key, None)
            elif kind == _Record.COUNTER.value:
                self.counters[key] = int(value)
            else:
                raise ValueError(f"{self.path!r} holds a corrupt FileStore record at byte {pos}.")
            pos = end
        self.offset += pos

    def append(self, kind: _Record, key: bytes, value: bytes = b"") -> None:
        """Append one record; call with the exclusive lock held."""
        if os.fstat(self.fd).st_size == 0:
            self._write(_FILE_MAGIC)
        self._write(_RECORD.pack(kind.value, len(key), len(value)) + key + value)
        self._refresh()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def bump(self, name: bytes, amount: int) -> int:
        """Change a bookkeeping counter; call with the exclusive lock held."""
        value = self.counters.get(name, 0) + amount
        self.append(_Record.COUNTER, name, str(value).encode())
        return value

    def leave(self, world_size: int) -> None:
        """Unregister one user; the last of ``world_size`` users removes the file."""
        with self.lock:
            if self.fd < 0:
                return
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                self._refresh()
                finished = self.bump(b"finished", 1)
                users = self.bump(b"users", -1)
                if users <= 0 and world_size > 0 and finished >= world_size:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
            finally:
                os.close(self.fd)  # closing also releases the lock
                self.fd = -1


class FileStore(Store):
    """A store kept in a file that all processes on a machine (or a shared file system) open.

    The file is an append-only log of records written under an exclusive ``flock`` and read
    under a shared one; values are raw bytes (no pickle). ``get`` and ``wait`` poll the file.
    As in PyTorch, when ``world_size`` is positive the file is deleted once ``world_size``
    ``FileStore`` objects have been closed and none is open; with ``-1`` it is kept. The file is
    created with mode ``0o600`` (only its owner may use it). Start a job from a path no earlier
    job left behind.

    Args:
        file_name: path of the file (created if missing; its directory must exist).
        world_size: how many processes use the file, or ``-1`` (unknown: never delete it).
        timeout: default timeout of ``get``/``wait`` (keyword-only; PyTorch sets it later
            through ``set_timeout``).

    Example:
        >>> import os, tempfile
        >>> from cupy_parallel._src.distributed.store import FileStore
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> with FileStore(path, 1) as a, FileStore(path, 1) as b:
        ...     a.set("x", "1")
        ...     b.add("x", 41)
        42
        >>> os.path.exists(path)
        False
    """

    def __init__(
        self, file_name: str, world_size: int = -1, *, timeout: timedelta = _DEFAULT_TIMEOUT
    ) -> None:
        super().__init__(timeout)
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"file_name must be a str path, got {type(file_name).__name__}.")
        path = os.fspath(file_name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"file_name must be a non-empty str path, got {file_name!r}.")
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}.")
        if world_size == 0 or world_size < -1:
            raise ValueError(f"world_size must be -1 (unknown) or >= 1, got {world_size}.")
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(
                f"file_name {path!r}: directory {directory!r} does not exist; create it first."
            )
        self._path = path
        self._world_size = world_size
        self._log = _LogFile(path)
        try:
            with self._log.locked(exclusive=True):
                self._log.bump(b"users", 1)
        except BaseException:
            os.close(self._log.fd)
            raise
        self._finalizer = weakref.finalize(self, self._log.leave, world_size)

    @property
    def path(self) -> str:
        """The file the store lives in.

        Example:
            >>> import os, tempfile
            >>> from cupy_parallel._src.distributed.store import FileStore
            >>> path = os.path.join(tempfile.mkdtemp(), "s")
            >>> with FileStore(path, 1) as store:
            ...     store.path == path
            True
        """
        return self._path

    def close(self) -> None:
        """Unregister from the file (deleting it if this was the last of ``world_size`` users).

        Example:
            >>> import os, tempfile
            >>> from cupy_parallel._src.distributed.store import FileStore
            >>> store = FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
            >>> store.close()
            >>> store.num_keys()
            Traceback (most recent call last):
            ValueError: FileStore('...') is closed; open a new FileStore.
        """
        self._finalizer()

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"

    def _set(self, key: str, value: bytes) -> None:
        name = _key_bytes(key)
        with self._log.locked(exclusive=True):
            self._log.append(_Record.SET, name, value)

    def _get(self, key: str, seconds: float) -> bytes | None:
        name = _key_bytes(key)
        found: list[bytes] = []

        def probe() -> bool:
            with self._log.locked(exclusive=False):
                value = self._log.data.get(name)
            if value is not None:
                found.append(value)
            return value is not None

        return found[0] if _poll(probe, seconds) else None

    def _add(self, key: str, amount: int) -> int:
        name = _key_bytes(key)
        with self._log.locked(exclusive=True):
            new = _next_counter(self._log.data.get(name), amount, key)
            self._log.append(_Record.SET, name, str(new).encode())
        return new

    def _missing(self, keys: list[str]) -> list[str]:
        names = [_key_bytes(key) for key in keys]
        with self._log.locked(exclusive=False):
            return [
                key for key, name in zip(keys, names, strict=True) if name not in self._log.data
            ]

    def _wait(self, keys: list[str], seconds: float) -> list[str]:
        missing = keys

        def probe() -> bool:
            nonlocal missing
            missing = self._missing(missing)
            return not missing

        _poll(probe, seconds)
        return missing

    def _check(self, keys: list[str]) -> bool:
        return not self._missing(keys)

    def _delete(self, key: str) -> bool:
        name = _key_bytes(key)
        with self._log.locked(exclusive=True):
            if name not in self._log.data:
                return False
            self._log.append(_Record.DELETE, name)
        return True

    def _num_keys(self) -> int:
        with self._log.locked(exclusive=False):
            return len(self._log.data)


# --------------------------------------------------------------------------------------------
# TCPStore: wire format


class _Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    DELETE = 6
    NUM_KEYS = 7
    JOIN = 8
    WAIT_JOINED = 9


class _Status(enum.IntEnum):
    OK = 0
    VALUE = 1
    INT = 2
    TIMEOUT = 3
    ERROR = 4


class _ProtocolError(Exception):
    """A peer sent bytes that are not a well-formed message."""


_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")
_HEADER = struct.Struct(">IB")  # frame length, then the opcode or status byte


def _blob(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def _blobs(items: Sequence[bytes]) -> bytes:
    return _U32.pack(len(items)) + b"".join(_blob(item) for item in items)


def _millis(seconds: float) -> bytes:
    return _U64.pack(min(max(0, round(seconds * 1000)), _MAX_TIMEOUT_MS))


class _Reader:
    """Reads the fields of one message body, raising ``_ProtocolError`` on any malformation."""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self._pos = 0

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._body):
            raise _ProtocolError("message ends early")
        data = self._body[self._pos : end]
        self._pos = end
        return data

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self._take(8))[0])

    def seconds(self) -> float:
        millis = int(_U64.unpack(self._take(8))[0])
        return min(millis, _MAX_TIMEOUT_MS) / 1000

    def blob(self, limit: int) -> bytes:
        n = self.u32()
        if n > limit:
            raise _ProtocolError(f"field of {n} bytes exceeds {limit}")
        return self._take(n)

    def key_list(self) -> tuple[bytes, ...]:
        count = self.u32()
        if count > MAX_WAIT_KEYS:
            raise _ProtocolError(f"{count} keys exceed {MAX_WAIT_KEYS}")
        return tuple(self.blob(MAX_KEY_BYTES) for _ in range(count))

    def rest(self) -> bytes:
        return self._take(len(self._body) - self._pos)

    def end(self) -> None:
        if self._pos != len(self._body):
            raise _ProtocolError("trailing bytes after the message")


# --------------------------------------------------------------------------------------------
# TCPStore: server


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    events: int = selectors.EVENT_READ
    waiter: _Waiter | None = None
    closed: bool = False


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    op: _Op
    keys: tuple[bytes, ...]
    target: int
    deadline: float
    done: bool = False


class _Tag(enum.Enum):
    LISTENER = enum.auto()
    WAKE = enum.auto()


def _listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """Where the server listens: the loopback address itself, or every interface (as PyTorch)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: clients may reach it through any interface
        loopback = False
    if loopback:
        return family, (str(sockaddr[0]), port)
    return family, ("::" if family == socket.AF_INET6 else "0.0.0.0", port)  # noqa: S104


class _Server:
    """The store's state and a selector loop serving it from a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        try:
            family, address = _listen_address(host, port)
            self._listener = socket.create_server(address, family=family, backlog=512)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"TCPStore master could not listen on {host}:{port} ({exc.strerror or exc}); "
                "pick a free port or pass port=0 to let the system choose.",
            ) from exc
        self._listener.settimeout(0.0)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.settimeout(0.0)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, _Tag.LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _Tag.WAKE)
        self._data: dict[bytes, bytes] = {}
        self._joined = 0
        self._waiters: list[_Waiter] = []
        self._stopping = False
        self._handlers: dict[_Op, Callable[[_Conn, _Reader], None]] = {
            _Op.SET: self._op_set,
            _Op.GET: self._op_get,
            _Op.ADD: self._op_add,
            _Op.WAIT: self._op_wait,
            _Op.CHECK: self._op_check,
            _Op.DELETE: self._op_delete,
            _Op.NUM_KEYS: self._op_num_keys,
            _Op.JOIN: self._op_join,
            _Op.WAIT_JOINED: self._op_wait_joined,
        }
        self._thread = threading.Thread(
            target=self._serve, name=f"cupy_parallel-TCPStore-{self.port}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    # -- loop ---------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._sel.select(self._select_timeout()):
                    if key.data is _Tag.LISTENER:
                        self._accept()
                    elif key.data is _Tag.WAKE:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._on_event(key.data, mask)
                self._expire(time.monotonic())
        finally:
            for key in list(self._sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._wake_w.close()
            self._sel.close()

    def _select_timeout(self) -> float | None:
        if not self._waiters:
            return None
        # Capped: selectors reject huge timeouts; the loop simply looks again after a minute.
        nearest = min(w.deadline for w in self._waiters) - time.monotonic()
        return min(max(0.0, nearest), 60.0)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. the peer reset before we accepted; keep listening
                return
            sock.settimeout(0.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if conn.closed:
            return
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if conn.closed or not mask & selectors.EVENT_READ:
            return
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not chunk:
            self._close(conn)
            return
        conn.inbuf += chunk
        if len(conn.inbuf) > _U32.size + _MAX_FRAME_BYTES:
            self._close(conn)  # more unanswered bytes than any legal request
            return
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle the complete requests buffered on ``conn``, one at a time, in order."""
        while conn.waiter is None and not conn.closed and len(conn.inbuf) >= _U32.size:
            (length,) = _U32.unpack_from(conn.inbuf)
            if length == 0 or length > _MAX_FRAME_BYTES:
                self._close(conn)
                return
            if len(conn.inbuf) < _U32.size + length:
                return
            body = bytes(conn.inbuf[_U32.size : _U32.size + length])
            del conn.inbuf[: _U32.size + length]
            reader = _Reader(body)
            try:
                op = _Op(reader.u8())
            except ValueError:
                self._close(conn)
                return
            try:
                self._handlers[op](conn, reader)
            except _ProtocolError:
                self._close(conn)
                return

    def _reply(self, conn: _Conn, status: _Status, payload: bytes = b"") -> None:
        conn.outbuf += _HEADER.pack(1 + len(payload), status) + payload
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.outbuf[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.waiter is not None:
            conn.waiter.done = True
            self._waiters.remove(conn.waiter)
            conn.waiter = None
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    # -- waiting ------------------------------------------------------------------------------

    def _park(
        self, conn: _Conn, op: _Op, keys: tuple[bytes, ...], target: int, secs: float
    ) -> None:
        waiter = _Waiter(conn, op, keys, target, time.monotonic() + secs)
        conn.waiter = waiter
        self._waiters.append(waiter)

    def _ready(self, waiter: _Waiter) -> bool:
        if waiter.op is _Op.WAIT_JOINED:
            return self._joined >= waiter.target
        return all(key in self._data for key in waiter.keys)

    def _answer(self, waiter: _Waiter, status: _Status, payload: bytes) -> None:
        waiter.done = True
        self._waiters.remove(waiter)
        conn = waiter.conn
        conn.waiter = None
        self._reply(conn, status, payload)
        self._process(conn)  # requests that arrived while this one waited

    def _notify(self, key: bytes | None) -> None:
        """Answer the waiters that ``key`` (or a new worker, when None) completes."""
        for waiter in list(self._waiters):
            if waiter.done:
                continue
            relevant = waiter.op is _Op.WAIT_JOINED if key is None else key in waiter.keys
            if relevant and self._ready(waiter):
                if waiter.op is _Op.GET:
                    self._answer(waiter, _Status.VALUE, self._data[waiter.keys[0]])
                else:
                    self._answer(waiter, _Status.OK, b"")

    def _expire(self, now: float) -> None:
        for waiter in list(self._waiters):
            if waiter.done or waiter.deadline > now:
                continue
            if waiter.op is _Op.WAIT:
                payload = _blobs([key for key in waiter.keys if key not in self._data])
            elif waiter.op is _Op.WAIT_JOINED:
                payload = _I64.pack(self._joined)
            else:
                payload = b""
            self._answer(waiter, _Status.TIMEOUT, payload)

    # -- requests -----------------------------------------------------------------------------

    def _op_set(self, conn: _Conn, reader: _Reader) -> None:
        key = reader.blob(MAX_KEY_BYTES)
        value = reader.blob(MAX_VALUE_BYTES)
        reader.end()
        self._data[key] = value
        self._reply(conn, _Status.OK)
        self._notify(key)

    def _op_get(self, conn: _Conn, reader: _Reader) -> None:
        key = reader.blob(MAX_KEY_BYTES)
        seconds = reader.seconds()
        reader.end()
        if key in self._data:
            self._reply(conn, _Status.VALUE, self._data[key])
        else:
            self._park(conn, _Op.GET, (key,), 0, seconds)

    def _op_add(self, conn: _Conn, reader: _Reader) -> None:
        key = reader.blob(MAX_KEY_BYTES)
        amount = reader.i64()
        reader.end()
        try:
            new = _next_counter(self._data.get(key), amount, key.decode(errors="replace"))
        except ValueError as exc:
            self._reply(conn, _Status.ERROR, str(exc).encode())
            return
        self._data[key] = str(new).encode()
        self._reply(conn, _Status.INT, _I64.pack(new))
        self._notify(key)

    def _op_wait(self, conn: _Conn, reader: _Reader) -> None:
        keys = reader.key_list()
        seconds = reader.seconds()
        reader.end()
        if all(key in self._data for key in keys):
            self._reply(conn, _Status.OK)
        else:
            self._park(conn, _Op.WAIT, keys, 0, seconds)

    def _op_check(self, conn: _Conn, reader: _Reader) -> None:
        keys = reader.key_list()
        reader.end()
        self._reply(conn, _Status.INT, _I64.pack(all(key in self._data for key in keys)))

    def _op_delete(self, conn: _Conn, reader: _Reader) -> None:
        key = reader.blob(MAX_KEY_BYTES)
        reader.end()
        self._reply(conn, _Status.INT, _I64.pack(self._data.pop(key, None) is not None))

    def _op_num_keys(self, conn: _Conn, reader: _Reader) -> None:
        reader.end()
        self._reply(conn, _Status.INT, _I64.pack(len(self._data)))

    def _op_join(self, conn: _Conn, reader: _Reader) -> None:
        reader.end()
        self._joined += 1
        self._reply(conn, _Status.INT, _I64.pack(self._joined))
        self._notify(None)

    def _op_wait_joined(self, conn: _Conn, reader: _Reader) -> None:
        target = reader.i64()
        seconds = reader.seconds()
        reader.end()
        if self._joined >= target:
            self._reply(conn, _Status.OK)
        else:
            self._park(conn, _Op.WAIT_JOINED, (), target, seconds)


# --------------------------------------------------------------------------------------------
# TCPStore: client


class _Client:
    """One connection to the server; requests are serialized by a lock."""

    def __init__(self, host: str, port: int, timeout: timedelta) -> None:
        self._where = f"{host}:{port}"
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(0.05, min(remaining, 5)))
                break
            except OSError as exc:
                if remaining <= 0:
                    raise TimeoutError(
                        f"could not connect to the TCPStore at {self._where} within "
                        f"{_seconds(timeout)} s (last error: {exc}); is the master (rank 0) "
                        "running, and are host and port right?"
                    ) from exc
                time.sleep(min(delay, max(remaining, 0)))
                delay = min(delay * 2, 1.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock: socket.socket | None = sock

    def close(self) -> None:
        """Close the connection, waking a thread blocked on it (it then raises)."""
        sock = self._sock
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        # A thread parked in call() holds the lock until the shutdown above wakes it; never
        # wait for it forever (this also runs at interpreter exit).
        if self._lock.acquire(timeout=5.0):
            try:
                self._drop()
            finally:
                self._lock.release()

    def call(self, op: _Op, body: bytes, *, wait: float = 0.0) -> tuple[_Status, _Reader]:
        """Send one request and read its answer; ``wait`` is how long the server may park it."""
        frame = _HEADER.pack(1 + len(body), op) + body
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ValueError(f"TCPStore({self._where}) is closed; create a new TCPStore.")
            sock.settimeout(wait + _IO_SLACK_S)
            try:
                sock.sendall(frame)
                length, status = _HEADER.unpack(self._recv(sock, _HEADER.size))
                if not 1 <= length <= _MAX_FRAME_BYTES or status not in _Status._value2member_map_:
                    raise _ProtocolError(f"bad reply header ({length}, {status})")
                payload = self._recv(sock, length - 1)
            except TimeoutError as exc:
                self._drop()
                raise TimeoutError(
                    f"the TCPStore server at {self._where} did not answer within "
                    f"{wait + _IO_SLACK_S} s."
                ) from exc
            except (OSError, _ProtocolError) as exc:
                self._drop()
                raise ConnectionError(
                    f"lost the connection to the TCPStore server at {self._where} ({exc}); "
                    "the master process may have exited."
                ) from exc
        reply = _Status(status)
        if reply is _Status.ERROR:
            raise ValueError(payload.decode(errors="replace"))
        return reply, _Reader(payload)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @staticmethod
    def _recv(sock: socket.socket, n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = sock.recv(min(n - len(chunks), 1 << 20))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            chunks += chunk
        return bytes(chunks)


def _shutdown(client: _Client | None, server: _Server | None) -> None:
    if client is not None:
        client.close()
    if server is not None:
        server.stop()


class TCPStore(Store):
    r"""A store served over TCP by the master process; every process connects as a client.

    The master (``is_master=True``) runs the server in a daemon thread, so it never keeps the
    process alive; the server stops when the store is closed or garbage-collected, or the
    process exits. Clients retry connecting until ``timeout``. With ``world_size`` set, every
    store registers as a worker and the master's constructor waits (when ``wait_for_workers``)
    until ``world_size`` stores have registered, as in PyTorch.

    The server listens on the loopback address when ``host_name`` is one (``127.0.0.1``,
    ``::1``, ``localhost``) and on every interface otherwise, as PyTorch does. The store has no
    authentication: run it on trusted networks only. Calls from several threads on one
    ``TCPStore`` object share its connection and run one at a time (a thread blocked in ``get``
    holds up the others); threads that wait independently should each open their own client.

    Args:
        host_name: where the master listens and clients connect.
        port: the port; ``0`` on the master picks a free one (read it back from :attr:`port`).
        world_size: how many stores (processes) will connect, or ``None`` (not tracked).
        is_master: whether this process hosts the server.
        timeout: how long to wait for the server, for workers, and in ``get``/``wait``.
        wait_for_workers: whether the master waits for ``world_size`` workers on creation.

    Raises:
        TimeoutError: no server answered within ``timeout``, or not all workers registered.

    Example:
        >>> from cupy_parallel._src.distributed.store import TCPStore
        >>> master = TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
        ...                   wait_for_workers=False)
        >>> worker = TCPStore("127.0.0.1", master.port, world_size=2)
        >>> worker.set("id", b"\x01\x02")
        >>> master.get("id")
        b'\x01\x02'
        >>> worker.close(); master.close()
    """

    def __init__(  # noqa: PLR0917 - torch's positional signature
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = _DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
    ) -> None:
        super().__init__(timeout)
        if not isinstance(host_name, str) or not host_name:
            raise TypeError(f"host_name must be a non-empty str, got {host_name!r}.")
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int, got {type(port).__name__} {port!r}.")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}.")
        if port == 0 and not is_master:
            raise ValueError(
                "port=0 lets the master pick a port; a client needs the real port "
                "(the master's TCPStore.port)."
            )
        if world_size is not None:
            if isinstance(world_size, bool) or not isinstance(world_size, int):
                raise TypeError(f"world_size must be an int or None, got {world_size!r}.")
            if world_size < 1:
                raise ValueError(f"world_size must be >= 1 or None, got {world_size}.")
        self._host = host_name
        self._is_master = bool(is_master)
        self._server = _Server(host_name, port) if is_master else None
        self._port = self._server.port if self._server is not None else port
        self._client: _Client | None = None
        try:
            self._client = _Client(host_name, self._port, self._timeout)
            if world_size is not None:
                self._client.call(_Op.JOIN, b"")
                if is_master and wait_for_workers:
                    self._wait_for_workers(world_size)
        except BaseException:
            _shutdown(self._client, self._server)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._client, self._server)

    def _wait_for_workers(self, world_size: int) -> None:
        assert self._client is not None
        seconds = self._timeout.total_seconds()
        status, reader = self._client.call(
            _Op.WAIT_JOINED, _I64.pack(world_size) + _millis(seconds), wait=seconds
        )
        if status is _Status.TIMEOUT:
            raise TimeoutError(
                f"TCPStore master timed out after {_seconds(self._timeout)} s waiting for "
                f"workers: {reader.i64()} of {world_size} joined."
            )

    @property
    def host(self) -> str:
        """The host name given at creation.

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     store.host
            '127.0.0.1'
        """
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on (the chosen one when created with ``port=0``).

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
            ...     0 < store.port < 65536
            True
        """
        return self._port

    @property
    def is_master(self) -> bool:
        """Whether this object hosts the server."""
        return self._is_master

    def close(self) -> None:
        """Close the connection and, on the master, stop the server (other clients then fail).

        Example:
            >>> from cupy_parallel._src.distributed.store import TCPStore
            >>> store = TCPStore("127.0.0.1", 0, is_master=True)
            >>> store.close()
            >>> store.set("k", "v")
            Traceback (most recent call last):
            ValueError: TCPStore(127.0.0.1:...) is closed; create a new TCPStore.
        """
        self._finalizer()

    def __repr__(self) -> str:
        return f"TCPStore({self._host!r}, {self._port}, is_master={self._is_master})"

    def _call(self, op: _Op, body: bytes, *, wait: float = 0.0) -> tuple[_Status, _Reader]:
        assert self._client is not None
        return self._client.call(op, body, wait=wait)

    def _set(self, key: str, value: bytes) -> None:
        self._call(_Op.SET, _blob(_key_bytes(key)) + _blob(value))

    def _get(self, key: str, seconds: float) -> bytes | None:
        status, reader = self._call(
            _Op.GET, _blob(_key_bytes(key)) + _millis(seconds), wait=seconds
        )
        return None if status is _Status.TIMEOUT else reader.rest()

    def _add(self, key: str, amount: int) -> int:
        _, reader = self._call(_Op.ADD, _blob(_key_bytes(key)) + _I64.pack(amount))
        return reader.i64()

    def _wait(self, keys: list[str], seconds: float) -> list[str]:
        names = [_key_bytes(key) for key in keys]
        status, reader = self._call(_Op.WAIT, _blobs(names) + _millis(seconds), wait=seconds)
        if status is _Status.OK:
            return []
        return [key.decode(errors="replace") for key in reader.key_list()]

    def _check(self, keys: list[str]) -> bool:
        _, reader = self._call(_Op.CHECK, _blobs([_key_bytes(key) for key in keys]))
        return bool(reader.i64())

    def _delete(self, key: str) -> bool:
        _, reader = self._call(_Op.DELETE, _blob(_key_bytes(key)))
        return bool(reader.i64())

    def _num_keys(self) -> int:
        _, reader = self._call(_Op.NUM_KEYS, b"")
        return reader.i64()
