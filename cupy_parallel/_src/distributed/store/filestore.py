"""FileStore: a store kept in an append-only log file that processes share through ``flock``.

The file is ``MAGIC`` then records; a record is a ``u32`` body length, the ``u32`` CRC-32 of
the body, then the body: a kind byte and fields in the wire format of :mod:`.wire`. Every
process replays the records into a :class:`~.table.Table` (its cache) and reads only what was
appended since. Writers hold an exclusive ``flock``, readers a shared one.

- **A writer killed mid-write** leaves a torn last record (short, or failing its CRC). No live
  writer can be writing while a lock is held, so a torn tail seen under the lock is always
  dead: readers ignore it and the next writer truncates it away before appending (repair).
  A bad record that is *not* the last one is corruption: every call raises ``ValueError``.
- **Compaction.** When the log grows past twice its live content plus 1 MiB, the writer
  holding the lock writes the live state to a new file and renames it over the path; other
  processes notice (the path's inode changed) when they next take the lock, and reopen. A
  copy left by a compactor that was killed is removed by the next compaction.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import glob
import os
import threading
import weakref
import zlib
from typing import TYPE_CHECKING

from cupy_parallel._src.arguments import read_int
from cupy_parallel._src.distributed.store.interface import (
    DEFAULT_TIMEOUT_S,
    Missing,
    Store,
    key_bytes,
    poll,
)
from cupy_parallel._src.distributed.store.table import Table
from cupy_parallel._src.distributed.store.wire import I64, U32, ProtocolError, Reader, blob, blobs

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from datetime import timedelta

__all__ = ["COMPACT_MIN_BYTES", "FileStore"]

MAGIC = b"cupy_parallel FileStore v2\n"
COMPACT_MIN_BYTES = 1 << 20
"""Dead bytes a log may carry before it is compacted."""
_FRAME = 2 * U32.size  # length, crc


class _Kind(enum.IntEnum):
    SET = 1
    DELETE = 2
    APPEND = 3
    MULTI_SET = 4
    PUSH = 5
    POP = 6
    COUNTER = 7  # bookkeeping counters (users, finished), outside the key space


def _record(kind: _Kind, *fields: bytes) -> bytes:
    body = bytes([kind]) + b"".join(fields)
    return U32.pack(len(body)) + U32.pack(zlib.crc32(body)) + body


class _Log:
    """The shared log file and this process's replay of it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = self._open()
        self.lock = threading.Lock()
        self._reset()

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)

    def _reset(self) -> None:
        self.offset = 0
        self.table = Table()
        self.counters: dict[bytes, int] = {}
        self._compact_at = 2 * COMPACT_MIN_BYTES

    @contextlib.contextmanager
    def locked(self, *, exclusive: bool) -> Iterator[Table]:
        """Hold the file lock with the cache up to date; yields the cache."""
        with self.lock:
            if self.fd < 0:
                raise ValueError(f"FileStore({self.path!r}) is closed; open a new FileStore.")
            self._lock_current(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._refresh(exclusive=exclusive)
                yield self.table
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _lock_current(self, mode: int) -> None:
        """Lock the file the path names now (following compactions, which replace it)."""
        while True:
            fcntl.flock(self.fd, mode)
            try:
                named = os.stat(self.path)
            except FileNotFoundError:
                return  # removed by its last user; keep using the open file
            mine = os.fstat(self.fd)
            if (named.st_ino, named.st_dev) == (mine.st_ino, mine.st_dev):
                return
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = self._open()
            self._reset()

    def _refresh(self, *, exclusive: bool) -> None:
        size = os.fstat(self.fd).st_size
        if size == self.offset:
            return
        if size < self.offset:
            raise ValueError(
                f"FileStore file {self.path!r} shrank from {self.offset} to {size} bytes: "
                "something other than FileStore modified it."
            )
        chunk = os.pread(self.fd, size - self.offset, self.offset)
        pos = 0
        if self.offset == 0:
            if not chunk.startswith(MAGIC):
                if MAGIC.startswith(chunk) and exclusive:  # a creator died writing the magic
                    os.ftruncate(self.fd, 0)
                    return
                raise ValueError(
                    f"{self.path!r} is not a FileStore file (it does not start with {MAGIC!r}); "
                    "point file_name at a new or FileStore-owned path."
                )
            pos = len(MAGIC)
        while pos < len(chunk):
            end = pos + _FRAME
            if end <= len(chunk):
                length, crc = U32.unpack_from(chunk, pos)[0], U32.unpack_from(chunk, pos + 4)[0]
                end += length
            if end > len(chunk) or zlib.crc32(chunk[pos + _FRAME : end]) != crc:
                if end < len(chunk):
                    raise ValueError(
                        f"FileStore file {self.path!r} is corrupt at byte {self.offset + pos} "
                        "(a record fails its checksum and is not the last one); start the job "
                        "from a new file."
                    )
                if exclusive:  # a writer died mid-record: cut the torn tail off
                    os.ftruncate(self.fd, self.offset + pos)
                break
            self._apply(chunk[pos + _FRAME : end])
            pos = end
        self.offset += pos

    def _apply(self, body: bytes) -> None:
        reader = Reader(body)
        try:
            kind = _Kind(reader.u8())
        except ValueError:
            raise ValueError(f"FileStore file {self.path!r} holds an unknown record.") from None
        table = self.table
        try:
            if kind is _Kind.SET:
                table.set(reader.key(), reader.value())
            elif kind is _Kind.DELETE:
                table.delete(reader.key())
            elif kind is _Kind.APPEND:
                key = reader.key()
                value = reader.value()
                table.data[key] = table.data.get(key, b"") + value
            elif kind is _Kind.MULTI_SET:
                table.multi_set(reader.key_list(), reader.value_list())
            elif kind is _Kind.PUSH:
                table.queue_push(reader.key(), reader.value())
            elif kind is _Kind.POP:
                table.queue_pop(reader.key())
            else:
                name = reader.key()
                self.counters[name] = reader.i64()
            reader.end()
        except ProtocolError as exc:
            raise ValueError(f"FileStore file {self.path!r} holds a malformed record.") from exc

    def write(self, *records: bytes) -> None:
        """Append records whose effect the caller already applied to the cache (lock held)."""
        data = b"".join(records)
        if self.offset == 0:
            data = MAGIC + data
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except BaseException:
            self._reset()  # the file is the truth: replay it on the next call
            raise
        self.offset += len(data)
        if self.offset >= self._compact_at:
            self._compact()

    def bump(self, name: bytes, amount: int) -> int:
        """Change a bookkeeping counter (exclusive lock held)."""
        value = self.counters.get(name, 0) + amount
        self.counters[name] = value
        self.write(_record(_Kind.COUNTER, blob(name), I64.pack(value)))
        return value

    def _live(self) -> list[bytes]:
        table = self.table
        records = [_record(_Kind.SET, blob(k), blob(v)) for k, v in table.data.items()]
        records += [
            _record(_Kind.PUSH, blob(k), blob(v))
            for k, queue in table.queues.items()
            for v in queue
        ]
        records += [_record(_Kind.COUNTER, blob(k), I64.pack(v)) for k, v in self.counters.items()]
        return records

    def _compact(self) -> None:
        """Replace the file by one holding only the live state (exclusive lock held)."""
        records = self._live()
        live = len(MAGIC) + sum(len(record) for record in records)
        self._compact_at = 2 * live + COMPACT_MIN_BYTES
        if self.offset < self._compact_at:
            return
        # Under the lock no other compaction runs: any copy left beside the file is from a
        # compactor that was killed; remove it.
        for stale in glob.glob(glob.escape(self.path) + ".compact-*"):
            with contextlib.suppress(OSError):
                os.unlink(stale)
        temporary = f"{self.path}.compact-{os.getpid()}-{threading.get_ident()}"
        fd = -1
        try:
            fd = os.open(
                temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(MAGIC + b"".join(records))
            while view:
                view = view[os.write(fd, view) :]
            os.rename(temporary, self.path)
        except OSError:  # no room for the copy, say: keep the long log
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            return
        old, self.fd = self.fd, fd
        os.close(old)  # also releases the old file's lock: waiters see the rename and reopen
        self.offset = live

    def leave(self, world_size: int, registered: bool) -> None:
        """Unregister one user; the last of ``world_size`` users removes the file."""
        with self.lock:
            if self.fd < 0:
                return
            try:
                if registered:
                    self._lock_current(fcntl.LOCK_EX)
                    self._refresh(exclusive=True)
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

    See the module docstring for the file format, torn-write repair and compaction. ``get``
    and ``wait`` poll the file. As in PyTorch, when ``world_size`` is positive the file is
    deleted once ``world_size`` ``FileStore`` objects have been closed and none is open; with
    ``-1`` it is kept. The file is created with mode ``0o600`` (only its owner may use it).
    Start a job from a path no earlier job left behind.

    Args:
        file_name: path of the file (created if missing; its directory must exist).
        world_size: how many processes use the file, or ``-1`` (unknown: never delete it).
        timeout: default timeout of ``get``/``wait`` (keyword-only; ``timedelta`` or seconds).

    Example:
        >>> import cupy_parallel
        >>> import os, tempfile
        >>> from cupy_parallel.distributed import FileStore
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> with FileStore(path, 1) as a, FileStore(path, 1) as b:
        ...     a.set("x", "1")
        ...     b.add("x", 41), a.get("x")
        (42, b'42')
        >>> os.path.exists(path)
        False
    """

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int = -1,
        *,
        timeout: timedelta | float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(timeout)
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"file_name must be a str path, got {type(file_name).__name__}.")
        path = os.fspath(file_name)
        if not isinstance(path, str) or not path:
            raise ValueError(f"file_name must be a non-empty str path, got {file_name!r}.")
        world_size = read_int(world_size, "world_size")
        if world_size == 0 or world_size < -1:
            raise ValueError(f"world_size must be -1 (unknown) or >= 1, got {world_size}.")
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(
                f"file_name {path!r}: directory {directory!r} does not exist; create it first."
            )
        self._open(path, world_size, registered=True)

    def _open(self, path: str, world_size: int, *, registered: bool) -> None:
        self._path = path
        self._world_size = world_size
        self._log = _Log(path)
        if registered:
            try:
                with self._log.locked(exclusive=True):
                    self._log.bump(b"users", 1)
            except BaseException:
                os.close(self._log.fd)
                raise
        self._finalizer = weakref.finalize(self, self._log.leave, world_size, registered)

    @property
    def path(self) -> str:
        """The file the store lives in."""
        return self._path

    def clone(self) -> FileStore:
        """Another handle on the same file; it does not count as one of ``world_size`` users."""
        twin = FileStore.__new__(FileStore)
        Store.__init__(twin, self._timeout_s)
        twin._open(self._path, self._world_size, registered=False)
        return twin

    def has_extended_api(self) -> bool:
        """True: every method is implemented."""
        return True

    def close(self) -> None:
        """Unregister from the file (deleting it if this was the last of ``world_size`` users)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"

    def _poll(self, probe: Callable[[Table], bool], seconds: float) -> bool:
        def locked_probe() -> bool:
            with self._log.locked(exclusive=False) as table:
                return probe(table)

        return poll(locked_probe, seconds)

    def _set(self, key: str, value: bytes) -> None:
        name = key_bytes(key)
        with self._log.locked(exclusive=True) as table:
            table.set(name, value)
            self._log.write(_record(_Kind.SET, blob(name), blob(value)))

    def _get(self, key: str, seconds: float) -> bytes:
        name = key_bytes(key)
        found: list[bytes] = []

        def probe(table: Table) -> bool:
            value = table.data.get(name)
            if value is not None:
                found.append(value)
            return value is not None

        if not self._poll(probe, seconds):
            raise Missing([key])
        return found[0]

    def _add(self, key: str, amount: int) -> int:
        name = key_bytes(key)
        with self._log.locked(exclusive=True) as table:
            value = table.add(name, amount)
            self._log.write(_record(_Kind.SET, blob(name), blob(value)))
        return int(value)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        name = key_bytes(key)
        with self._log.locked(exclusive=True) as table:
            before = table.data.get(name)
            result = table.compare_set(name, expected, desired)
            after = table.data.get(name)
            if after is not before and after is not None:
                self._log.write(_record(_Kind.SET, blob(name), blob(after)))
        return result

    def _append(self, key: str, value: bytes) -> None:
        name = key_bytes(key)
        with self._log.locked(exclusive=True) as table:
            table.append(name, value)
            self._log.write(_record(_Kind.APPEND, blob(name), blob(value)))

    def _multi_get(self, keys: list[str], seconds: float) -> list[bytes]:
        names = [key_bytes(key) for key in keys]
        found: list[bytes] = []
        missing: list[bytes] = names

        def probe(table: Table) -> bool:
            nonlocal missing
            missing = table.unset(names)
            if not missing:
                found.extend(table.data[name] for name in names)
            return not missing

        if not self._poll(probe, seconds):
            raise Missing([name.decode() for name in missing])
        return found

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        names = [key_bytes(key) for key in keys]
        with self._log.locked(exclusive=True) as table:
            table.multi_set(names, values)
            self._log.write(_record(_Kind.MULTI_SET, blobs(names), blobs(values)))

    def _wait(self, keys: list[str], seconds: float) -> None:
        names = [key_bytes(key) for key in keys]
        missing = names

        def probe(table: Table) -> bool:
            nonlocal missing
            missing = table.missing(missing)
            return not missing

        if not self._poll(probe, seconds):
            raise Missing([name.decode() for name in missing])

    def _check(self, keys: list[str]) -> bool:
        names = [key_bytes(key) for key in keys]
        with self._log.locked(exclusive=False) as table:
            return not table.missing(names)

    def _delete(self, key: str) -> bool:
        name = key_bytes(key)
        with self._log.locked(exclusive=True) as table:
            if not table.delete(name):
                return False
            self._log.write(_record(_Kind.DELETE, blob(name)))
        return True

    def _num_keys(self) -> int:
        with self._log.locked(exclusive=False) as table:
            return len(table.data)

    def _queue_push(self, key: str, value: bytes) -> None:
        name = key_bytes(key)
        with self._log.locked(exclusive=True) as table:
            table.queue_push(name, value)
            self._log.write(_record(_Kind.PUSH, blob(name), blob(value)))

    def _try_pop(self, name: bytes) -> bytes | None:
        with self._log.locked(exclusive=True) as table:
            value = table.queue_pop(name)
            if value is not None:
                self._log.write(_record(_Kind.POP, blob(name)))
        return value

    def _queue_pop(self, key: str, seconds: float | None) -> bytes:
        name = key_bytes(key)
        found: list[bytes] = []

        def probe(table: Table) -> bool:
            return table.queue_len(name) > 0

        def pop() -> bool:
            if not self._poll(probe, 0.0):
                return False
            value = self._try_pop(name)  # another process may have popped it first
            if value is not None:
                found.append(value)
            return value is not None

        if not poll(pop, seconds or 0.0):
            raise Missing([key])
        return found[0]

    def _queue_len(self, key: str) -> int:
        name = key_bytes(key)
        with self._log.locked(exclusive=False) as table:
            return table.queue_len(name)
