"""TCPStore: the client every process holds, and the master that also hosts the server."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import TYPE_CHECKING

from cupy_parallel._src.arguments import read_bool, read_int
from cupy_parallel._src.distributed.store.interface import (
    DEFAULT_TIMEOUT_S,
    DistNetworkError,
    DistStoreError,
    Missing,
    Store,
    format_seconds,
    key_bytes,
)
from cupy_parallel._src.distributed.store.server import Server
from cupy_parallel._src.distributed.store.wire import (
    HEADER,
    I64,
    MAX_FRAME_BYTES,
    U32,
    Op,
    ProtocolError,
    Reader,
    Status,
    blob,
    blobs,
    millis,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta

__all__ = ["SECRET_ENV", "TCPStore", "listen"]

SECRET_ENV = "CUPY_PARALLEL_STORE_SECRET"  # noqa: S105 - a variable name, not a secret
"""Environment variable holding the optional shared secret of every TCPStore of a job."""
_REPLY_GRACE_S = 5.0  # how much longer than a parked request's own wait a client waits at most
_RECV_BYTES = 1 << 16
# Sets sent whose answers are not read yet; at this many the next set reads them (a few KiB of
# answers: far below what makes the server stop reading from this client).
_MAX_UNCONFIRMED = 1024
_TIMEOUT_SLACK_S = 0.01  # a read may outlast its call's deadline by this much (saves a syscall)
_TIMEVAL = struct.Struct("@ll")  # struct timeval, as SO_RCVTIMEO takes it (Linux, macOS)
_MAX_TIMER_S = 2**31 - 1
_STATUSES = {int(status): status for status in Status}


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to exactly what ``host`` resolves to (its first address).

    ``"0.0.0.0"`` or ``"::"`` listen on every interface; a name or address listens on that
    address only (a name that resolves to loopback stays on loopback).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DistNetworkError(
            f"TCPStore master could not resolve host_name {host!r} ({exc}); pass an address of "
            "this machine, e.g. its IP on the network the other processes use."
        ) from exc
    family, _, _, _, sockaddr = infos[0]
    try:
        return socket.create_server((sockaddr[0], port), family=family, backlog=1024)
    except OSError as exc:
        raise DistNetworkError(
            f"TCPStore master could not listen on {host}:{port} ({exc.strerror or exc}); the "
            "port may be in use (pick another, or port=0 to let the system choose), or "
            f"{host!r} is not an address of this machine."
        ) from exc


def _adopt(fd: int) -> socket.socket:
    """A listening socket made of a bound socket's file descriptor."""
    try:
        sock = socket.socket(fileno=fd)
        sock.listen(1024)
    except OSError as exc:
        raise DistNetworkError(
            f"master_listen_fd={fd} is not a bound TCP socket this process can listen on ({exc})."
        ) from exc
    return sock


def _secret() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


class _Client:
    """One connection to the server; requests are serialized by a lock.

    :meth:`call` sends a request and reads its answer. :meth:`post` sends a ``SET`` and returns
    (torch's ``set``); the server answers every request in order, so the answers of posted sets
    are read before the next call's (:meth:`_confirm`), at most ``_MAX_UNCONFIRMED`` sets later,
    and when the connection closes. A set the server did not confirm is never forgotten: the
    call that finds out raises, naming its key.
    """

    def __init__(
        self, host: str, port: int, timeout_s: float, server: Server | None = None
    ) -> None:
        self._host, self._port = host, port
        self._where = f"{host}:{port}"
        self._lock = threading.Lock()
        self._server = server
        self._secret = _secret()
        self._closed = False
        self._small = bytearray(_RECV_BYTES)
        self._small_view = memoryview(self._small)
        self.timeout_s = timeout_s
        self._unconfirmed: list[str] = []  # keys of posted sets whose answers are unread
        self._sock: socket.socket | None = self._connect(retry=True)

    def _connect(self, *, retry: bool) -> socket.socket:
        """Connect (retrying until the timeout when ``retry``), then authenticate."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection(
                    (self._host, self._port), timeout=max(0.05, min(remaining, 5))
                )
                break
            except OSError as exc:
                if not retry or remaining <= 0:
                    raise DistNetworkError(
                        f"could not connect to the TCPStore at {self._where} within "
                        f"{format_seconds(self.timeout_s)} s (last error: {exc}); is the master "
                        "(rank 0) running, and are host and port right?"
                    ) from exc
                time.sleep(min(delay, max(remaining, 0)))
                delay = min(delay * 2, 1.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # blocking; reads are bounded by the kernel's receive timer
        self._rbuf = bytearray()
        self._timer = 0.0  # the receive timer last set on the socket (0: none yet)
        if self._secret is not None:
            try:
                deadline = time.monotonic() + 5.0
                frame = HEADER.pack(1 + 4 + len(self._secret), Op.AUTH) + blob(self._secret)
                self._send(sock, frame, deadline)
                self._read_reply(sock, deadline)
            except (OSError, ProtocolError) as exc:
                sock.close()
                raise DistNetworkError(
                    f"the TCPStore at {self._where} refused this client's {SECRET_ENV}; every "
                    "process of the job must set the same secret."
                ) from exc
        return sock

    def close(self) -> None:
        """Read the answers of posted sets, then close, waking a thread blocked on the socket.

        Raises:
            DistStoreError, DistNetworkError: a posted set was not confirmed (the connection
                is closed all the same).
        """
        unconfirmed: Exception | None = None
        if self._unconfirmed and not self._closed and self._lock.acquire(timeout=5.0):
            try:
                sock = self._sock
                # None only if another thread's call settled the sets and then dropped the
                # connection while this one waited for the lock: nothing is pending then
                if sock is not None:
                    deadline = time.monotonic() + min(self.timeout_s, _REPLY_GRACE_S)
                    self._settle(sock, deadline, "close")
            except (DistStoreError, DistNetworkError, ValueError) as exc:
                unconfirmed = exc
            finally:
                self._lock.release()
        self._closed = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        # A thread parked in call() holds the lock until the shutdown above wakes it; never
        # wait for it forever (this also runs at interpreter exit).
        if self._lock.acquire(timeout=5.0):
            try:
                self._drop()
            finally:
                self._lock.release()
        if unconfirmed is not None:
            raise unconfirmed

    def _dead_server(self) -> DistNetworkError | None:
        server = self._server
        if server is None or (server.alive and server.error is None):
            return None
        return DistNetworkError(
            f"the TCPStore server of this process ({self._where}) stopped serving "
            f"({server.error!r}); every client of the job fails now. Start the job again."
        )

    def call(self, op: Op, body: bytes, *, wait: float | None = None) -> tuple[Status, Reader]:
        """Send one request and read its answer; ``wait`` is how long the server may park it.

        The answer is awaited for the store's timeout, or ``wait`` plus a grace of at most
        5 s for a parked request. A server that does not answer in time raises
        :class:`DistStoreError` and the connection is dropped (the next call reconnects; the
        store is not closed). A lost connection raises :class:`DistNetworkError`.
        """
        limit = self.timeout_s if wait is None else wait + min(self.timeout_s, _REPLY_GRACE_S)
        with self._lock:
            sock = self._ready()
            deadline = time.monotonic() + limit
            if self._unconfirmed:
                self._settle(sock, deadline, op.name)
            try:
                self._send(sock, HEADER.pack(1 + len(body), op) + body, deadline)
                status, payload = self._read_reply(sock, deadline)
            except TimeoutError as exc:
                self._drop()
                raise DistStoreError(
                    f"the TCPStore server at {self._where} did not answer {op.name} within "
                    f"{format_seconds(limit)} s (timeout); the request was abandoned and the "
                    "next call reconnects."
                ) from exc
            except (OSError, ProtocolError) as exc:
                raise self._lost(exc, op.name) from exc
        if status is Status.ERROR:
            raise ValueError(payload.decode(errors="replace"))
        return status, Reader(payload)

    def post(self, key: str, body: bytes) -> None:
        """Send a ``SET`` of ``key`` without waiting for its answer (read by a later call)."""
        with self._lock:
            sock = self._ready()
            deadline = time.monotonic() + self.timeout_s
            try:
                self._send(sock, HEADER.pack(1 + len(body), Op.SET) + body, deadline)
            except TimeoutError as exc:
                forgotten = self._forget()
                raise DistStoreError(
                    f"the TCPStore server at {self._where} did not take SET {key!r} within "
                    f"{format_seconds(self.timeout_s)} s (timeout); the next call "
                    f"reconnects.{forgotten}"
                ) from exc
            except OSError as exc:
                raise self._lost(exc, "SET") from exc
            self._unconfirmed.append(key)
            if len(self._unconfirmed) >= _MAX_UNCONFIRMED:
                self._settle(sock, deadline, "SET")

    def _ready(self) -> socket.socket:
        """The connected socket (reconnecting after a dropped one); refuses a closed store."""
        if self._closed:
            raise ValueError(f"TCPStore({self._where}) is closed; create a new TCPStore.")
        if self._server is not None:
            dead = self._dead_server()
            if dead is not None:
                raise dead
        sock = self._sock
        if sock is None:
            sock = self._sock = self._connect(retry=False)
        return sock

    def _settle(self, sock: socket.socket, deadline: float, during: str) -> None:
        """Read the answers of the posted sets on ``sock`` (the server sends them in order)."""
        keys, self._unconfirmed = self._unconfirmed, []
        refused: list[str] = []
        said = ""
        for index, key in enumerate(keys):
            try:
                status, payload = self._read_reply(sock, deadline)
            except TimeoutError as exc:
                self._drop()
                raise DistStoreError(
                    f"the TCPStore server at {self._where} did not confirm "
                    f"{_sets(keys[index:])} by {during} (timeout); their values may be lost."
                ) from exc
            except (OSError, ProtocolError) as exc:
                self._unconfirmed = keys[index:]
                raise self._lost(exc, during) from exc
            if status is not Status.OK:
                refused.append(key)
                said = said or payload.decode(errors="replace")
        if refused:
            raise ValueError(
                f"{_sets(refused)} failed on the TCPStore server at {self._where}: {said}"
            )

    def _lost(self, exc: BaseException, during: str) -> Exception:
        """The error of a connection that failed during ``during``; drops it."""
        forgotten = self._forget()
        if self._closed:
            return ValueError(
                f"TCPStore({self._where}) was closed while a call waited on it.{forgotten}"
            )
        return self._dead_server() or DistNetworkError(
            f"lost the connection to the TCPStore server at {self._where} during {during} "
            f"({exc}); the master process may have exited, or the server reset this "
            f"connection.{forgotten}"
        )

    def _forget(self) -> str:
        """Drop the connection and the sets awaiting its answers; say which those were."""
        lost, self._unconfirmed = self._unconfirmed, []
        self._drop()
        return f" {_sets(lost)} sent before were not confirmed and may be lost." if lost else ""

    @staticmethod
    def _send(sock: socket.socket, frame: bytes, deadline: float) -> None:
        """Send ``frame`` by ``deadline`` (``TimeoutError`` otherwise).

        The socket is blocking and has no Python timeout, which would cost a ``poll`` before
        every send and read. A request almost always fits the socket's send buffer, so one
        non-blocking send does; the rest waits for the socket with ``select.poll`` up to the
        deadline.
        """
        try:
            sent = sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent == len(frame):
            return
        rest = memoryview(frame)[sent:]
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        while rest:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000 + 1):
                raise TimeoutError("the server does not take the request")
            with contextlib.suppress(BlockingIOError, InterruptedError):
                rest = rest[sock.send(rest, socket.MSG_DONTWAIT) :]

    def _set_timer(self, sock: socket.socket, seconds: float) -> None:
        """Make a blocking read on ``sock`` fail (``BlockingIOError``) after ``seconds``."""
        micros = round(min(max(seconds, 1e-6), _MAX_TIMER_S) * 1e6)  # 0 would mean never
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(*divmod(micros, 10**6))
        )
        self._timer = seconds

    def _read_reply(self, sock: socket.socket, deadline: float) -> tuple[Status, bytes]:
        """The next answer frame on ``sock`` (bytes after it stay buffered).

        Reads are bounded by the socket's receive timer (``SO_RCVTIMEO``), set only when it
        would outlast ``deadline`` by more than ``_TIMEOUT_SLACK_S`` (a syscall saved on most
        calls); a timer that runs out before the deadline is set again to what remains.
        """
        buf = self._rbuf
        expired = False
        while True:
            want = _RECV_BYTES
            if len(buf) >= HEADER.size:
                length, status = HEADER.unpack_from(buf)
                if not 1 <= length <= MAX_FRAME_BYTES or status not in _STATUSES:
                    raise ProtocolError(f"malformed reply header ({length}, {status})")
                end = U32.size + length
                if len(buf) >= end:
                    with memoryview(buf) as view:
                        payload = bytes(view[HEADER.size : end])
                    del buf[:end]
                    return _STATUSES[status], payload
                want = max(end - len(buf), want)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer in time")
            if expired or remaining < self._timer - _TIMEOUT_SLACK_S or not self._timer:
                self._set_timer(sock, remaining)
            expired = False
            if want > _RECV_BYTES:  # the rest of a large answer, in one allocation
                try:
                    chunk = sock.recv(want)
                except BlockingIOError:  # the receive timer ran out
                    expired = True
                    continue
                n = len(chunk)
                buf += chunk
            else:  # small answers go through one reused buffer: no allocation per read
                try:
                    n = sock.recv_into(self._small)
                except BlockingIOError:
                    expired = True
                    continue
                if not buf and n >= HEADER.size:  # the usual case: one whole small answer
                    length, status = HEADER.unpack_from(self._small)
                    if n == U32.size + length and status in _STATUSES:
                        return _STATUSES[status], bytes(self._small_view[HEADER.size : n])
                buf += self._small_view[:n]
            if not n:
                raise ConnectionError("the server closed the connection")

    def _drop(self) -> None:
        self._rbuf = bytearray()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _sets(keys: Sequence[str]) -> str:
    """``set('a')``, or ``3 set() calls (keys 'a', 'b', 'c')``, for error messages."""
    if len(keys) == 1:
        return f"set({keys[0]!r})"
    shown = ", ".join(repr(key) for key in keys[:5]) + (", ..." if len(keys) > 5 else "")
    return f"{len(keys)} set() calls (keys {shown})"


_TENANTS: dict[tuple[str, int], list[Server | int]] = {}
_TENANTS_LOCK = threading.Lock()


def _start_server(host: str, port: int, multi_tenant: bool) -> Server:
    """A new server, or (``multi_tenant``) the one this process already runs on host:port."""
    with _TENANTS_LOCK:
        entry = _TENANTS.get((host, port)) if multi_tenant and port else None
        if entry is not None and entry[0].alive:  # type: ignore[union-attr]
            entry[1] += 1  # type: ignore[operator]
            return entry[0]  # type: ignore[return-value]
        server = Server(listen(host, port), _secret())
        if multi_tenant:
            _TENANTS[(host, port if port else server.port)] = [server, 1]
        return server


def _release_server(server: Server) -> None:
    with _TENANTS_LOCK:
        for where, entry in list(_TENANTS.items()):
            if entry[0] is server:
                entry[1] -= 1  # type: ignore[operator]
                if entry[1] > 0:  # type: ignore[operator]
                    return
                del _TENANTS[where]
    server.stop()


def _shutdown(client: _Client | None, server: Server | None) -> None:
    try:
        if client is not None:
            client.close()  # raises if a set was not confirmed; the server stops all the same
    finally:
        if server is not None:
            _release_server(server)


class TCPStore(Store):
    r"""A store served over TCP by the master process; every process connects as a client.

    The master (``is_master=True``) runs the server (``store.server``) in a daemon thread, so
    it never keeps the process alive; the server stops when the store is closed or
    garbage-collected, or the process exits. Clients retry connecting until ``timeout``. With
    ``world_size`` set, every store registers as a worker and the master's constructor waits
    (when ``wait_for_workers``) until ``world_size`` stores have registered, as in PyTorch.

    **Binding.** The server listens on exactly the address ``host_name`` resolves to (its
    first address): ``"127.0.0.1"``/``"localhost"`` stay on loopback, a specific IP listens
    on that interface only, ``"0.0.0.0"``/``"::"`` on every interface. (PyTorch listens on
    every interface whatever the name.) For a multi-node job, ``MASTER_ADDR`` must therefore
    be an address of the master node that the other nodes can reach, such as its IP on the
    cluster network; a host name that resolves to loopback on the master (``127.0.1.1`` in
    many ``/etc/hosts``) keeps the store unreachable from other nodes.

    **No authentication by default.** As in PyTorch, anyone who can reach the port can read
    and write the store: run it on trusted networks. When the environment variable
    ``CUPY_PARALLEL_STORE_SECRET`` is set (to the same value in every process of the job),
    the server refuses clients that do not present it, and clients present it.

    **set() waits for the server's answer** by default (torch's returns once the request is
    sent, about 10x sooner): when ``set`` returns, every other process sees the value, so a
    ``set`` followed by any other synchronisation (an MPI barrier, say) never lets another
    rank read the old value. ``confirm_sets=False`` gives torch's behaviour: ``set`` returns
    once the request is sent; the server applies one connection's requests in order, so this
    store's own later calls see the value, and another process is guaranteed to see it once
    any later call of this store has returned (``check([key])`` is the cheapest); until then
    a process reading an overwritten key may get the old value, as with torch. Nothing is
    lost silently: the server's answers to those sets are read by the next call (and by
    ``close``), at the latest 1,024 sets later, and a set it did not confirm makes that call
    raise, naming the key.

    **Limits.** The server survives any client (see ``store.server``): it stops reading from a
    client that does not read its answers, and resets the connection holding the most bytes
    once 256 MiB of requests and answers are buffered over all connections (so a handful of
    concurrent 64 MiB ``set`` calls is the most it takes at once).

    **Threads.** Calls from several threads on one ``TCPStore`` object share its connection
    and run one at a time; threads that wait independently should each use :meth:`clone`.

    Args:
        host_name: where the master listens and clients connect.
        port: the port; ``0`` on the master picks a free one (read it back from :attr:`port`).
        world_size: how many stores (processes) will connect, or ``None`` (not tracked).
        is_master: whether this process hosts the server.
        timeout: how long to wait for the server, for workers, for answers and in
            ``get``/``wait`` (``timedelta`` or seconds).
        wait_for_workers: whether the master waits for ``world_size`` workers on creation.
        multi_tenant: share one server among the masters this process creates on the same
            host and port (torch's ``multi_tenant``).
        master_listen_fd: a bound socket's file descriptor for the master to listen on (and
            own from then on) instead of binding ``host_name:port`` itself.
        confirm_sets: whether ``set`` waits for the server's answer (default; see above).

    Raises:
        DistNetworkError: no server answered within ``timeout``, or the master cannot listen.
        DistStoreError: not all workers registered within ``timeout``.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel.distributed import TCPStore
        >>> master = TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
        ...                   wait_for_workers=False)
        >>> worker = TCPStore("127.0.0.1", master.port, world_size=2)
        >>> worker.set("id", b"\x01\x02")
        >>> master.get("id"), master.add("n", 1), worker.add("n", 1)
        (b'\x01\x02', 1, 2)
        >>> worker.queue_push("q", "job"); master.queue_pop("q")
        b'job'
        >>> worker.close(); master.close()
    """

    def __init__(  # noqa: PLR0917 - torch's positional signature
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | float = DEFAULT_TIMEOUT_S,
        wait_for_workers: bool = True,
        *,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        confirm_sets: bool = True,
    ) -> None:
        super().__init__(timeout)
        self._confirm_sets = read_bool(confirm_sets, "confirm_sets")
        if not isinstance(host_name, str) or not host_name:
            raise TypeError(f"host_name must be a non-empty str, got {host_name!r}.")
        port = read_int(port, "port", minimum=0)
        if port > 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}.")
        is_master = read_bool(is_master, "is_master")
        wait_for_workers = read_bool(wait_for_workers, "wait_for_workers")
        multi_tenant = read_bool(multi_tenant, "multi_tenant")
        if world_size is not None:
            world_size = read_int(world_size, "world_size", minimum=1)
        if port == 0 and not is_master:
            raise ValueError(
                "port=0 lets the master pick a port; a client needs the real port "
                "(the master's TCPStore.port)."
            )
        if master_listen_fd is not None:
            master_listen_fd = read_int(master_listen_fd, "master_listen_fd", minimum=0)
            if not is_master:
                raise ValueError("master_listen_fd is for the master; pass is_master=True.")
        self._host = host_name
        self._is_master = is_master
        self._server: Server | None = None
        if master_listen_fd is not None:
            self._server = Server(_adopt(master_listen_fd), _secret())
        elif is_master:
            self._server = _start_server(host_name, port, multi_tenant)
        self._port = self._server.port if self._server is not None else port
        self._client: _Client | None = None
        try:
            self._client = _Client(host_name, self._port, self._timeout_s, self._server)
            if world_size is not None:
                self._client.call(Op.JOIN, b"")
                if is_master and wait_for_workers:
                    self._wait_for_workers(world_size)
        except BaseException:
            _shutdown(self._client, self._server)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._client, self._server)

    def _wait_for_workers(self, world_size: int) -> None:
        seconds = self._timeout_s
        status, reader = self._call(
            Op.WAIT_JOINED, I64.pack(world_size) + millis(seconds), wait=seconds
        )
        if status is Status.TIMEOUT:
            raise DistStoreError(
                f"TCPStore master: timeout after {format_seconds(seconds)} s waiting for "
                f"workers: {reader.i64()} of {world_size} joined."
            )

    @property
    def host(self) -> str:
        """The host name given at creation."""
        return self._host

    @property
    def port(self) -> int:
        """The port the server listens on (the chosen one when created with ``port=0``)."""
        return self._port

    @property
    def is_master(self) -> bool:
        """Whether this object hosts the server."""
        return self._is_master

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the default timeout (also how long a request's answer is awaited)."""
        super().set_timeout(timeout)
        if self._client is not None:
            self._client.timeout_s = self._timeout_s

    def clone(self) -> TCPStore:
        """A new client connection to the same server (for use from another thread)."""
        return TCPStore(
            self._host, self._port, timeout=self._timeout_s, confirm_sets=self._confirm_sets
        )

    def has_extended_api(self) -> bool:
        """True: every method is implemented."""
        return True

    def close(self) -> None:
        """Close the connection and, on the master, stop the server (other clients then fail)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"TCPStore({self._host!r}, {self._port}, is_master={self._is_master})"

    def _call(self, op: Op, body: bytes, *, wait: float | None = None) -> tuple[Status, Reader]:
        client = self._client
        if client is None:  # only while __init__ runs
            raise ValueError("TCPStore is not connected yet.")
        return client.call(op, body, wait=wait)

    def _parked(self, op: Op, body: bytes, seconds: float) -> Reader:
        """A request the server may hold up to ``seconds``; Missing on its timeout."""
        status, reader = self._call(op, body + millis(seconds), wait=seconds)
        if status is Status.TIMEOUT:
            raise Missing([key.decode(errors="replace") for key in reader.key_list()])
        return reader

    def _set(self, key: str, value: bytes) -> None:
        body = blob(key_bytes(key)) + blob(value)
        client = self._client
        if self._confirm_sets or client is None:
            self._call(Op.SET, body)
        else:
            client.post(key, body)

    def _get(self, key: str, seconds: float) -> bytes:
        return self._parked(Op.GET, blob(key_bytes(key)), seconds).rest()

    def _add(self, key: str, amount: int) -> int:
        _, reader = self._call(Op.ADD, blob(key_bytes(key)) + I64.pack(amount))
        return reader.i64()

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        _, reader = self._call(
            Op.COMPARE_SET, blob(key_bytes(key)) + blob(expected) + blob(desired)
        )
        return reader.rest()

    def _append(self, key: str, value: bytes) -> None:
        self._call(Op.APPEND, blob(key_bytes(key)) + blob(value))

    def _multi_get(self, keys: list[str], seconds: float) -> list[bytes]:
        reader = self._parked(Op.MULTI_GET, blobs([key_bytes(key) for key in keys]), seconds)
        return reader.value_list()

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._call(Op.MULTI_SET, blobs([key_bytes(key) for key in keys]) + blobs(values))

    def _wait(self, keys: list[str], seconds: float) -> None:
        self._parked(Op.WAIT, blobs([key_bytes(key) for key in keys]), seconds)

    def _check(self, keys: Sequence[str]) -> bool:
        _, reader = self._call(Op.CHECK, blobs([key_bytes(key) for key in keys]))
        return bool(reader.i64())

    def _delete(self, key: str) -> bool:
        _, reader = self._call(Op.DELETE, blob(key_bytes(key)))
        return bool(reader.i64())

    def _num_keys(self) -> int:
        _, reader = self._call(Op.NUM_KEYS, b"")
        return reader.i64()

    def _queue_push(self, key: str, value: bytes) -> None:
        self._call(Op.QUEUE_PUSH, blob(key_bytes(key)) + blob(value))

    def _queue_pop(self, key: str, seconds: float | None) -> bytes:
        body = blob(key_bytes(key)) + bytes([seconds is not None])
        return self._parked(Op.QUEUE_POP, body, seconds or 0.0).rest()

    def _queue_len(self, key: str) -> int:
        _, reader = self._call(Op.QUEUE_LEN, blob(key_bytes(key)))
        return reader.i64()
