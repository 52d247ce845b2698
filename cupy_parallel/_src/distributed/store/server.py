"""The TCPStore server: one selector loop in a daemon thread, hardened against its clients.

Design rules, each answering a way a client could take a server down:

- **No recursion.** Answering a parked request never handles the next request of that
  connection inline: the connection goes on a run queue that the loop drains iteratively, so a
  chain of parked GETs released by pipelined SETs (any length) costs no stack.
- **Nothing a client does kills the loop.** An exception while serving one connection closes
  that connection; the loop goes on. Should the loop itself ever fail, :attr:`Server.error`
  records why and every socket is closed, so every client call fails at once
  (``DistNetworkError``) instead of waiting.
- **Bounded memory.** A connection whose replies are not being read (more than
  :data:`OUTPUT_HIGH_WATER` bytes queued) is not read from and its requests are not handled
  until it drains: TCP pushes back on the client. Requests and replies buffered over all
  connections are capped at :data:`MAX_BUFFERED_BYTES`; past that the connection holding the
  most is reset. Replies that carry a stored value reference it, they do not copy it.
- **Out of file descriptors.** When ``accept`` fails with ``EMFILE``/``ENFILE`` (or out of
  buffers/memory), the listener is taken out of the selector and tried again after a backoff
  (10 ms doubling to 1 s); existing clients are served meanwhile.
- **Optional shared secret.** When created with a secret, a connection's first request must be
  ``AUTH`` with that secret (compared in constant time); anything else closes it.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import hmac
import itertools
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cupy_parallel._src.distributed.store.interface import MAX_VALUE_BYTES
from cupy_parallel._src.distributed.store.table import Table
from cupy_parallel._src.distributed.store.wire import (
    HEADER,
    I64,
    MAX_FRAME_BYTES,
    U32,
    Op,
    ProtocolError,
    Reader,
    Status,
    blobs,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MAX_BUFFERED_BYTES", "OUTPUT_HIGH_WATER", "Server"]

OUTPUT_HIGH_WATER = 1 << 20
"""Replies queued on one connection (bytes) past which the server stops reading from it."""
MAX_BUFFERED_BYTES = 256 << 20
"""Requests and replies buffered over all connections (bytes) past which the largest is reset."""
_INLINE_REPLY = 1 << 14  # replies up to this size are copied into one buffer with their header
_RECV_BYTES = 1 << 18
_SEND_BUFFERS = 64  # buffers handed to one sendmsg
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_BACKOFF_S = (0.01, 1.0)
_MAX_SELECT_S = 60.0  # selectors reject huge timeouts; the loop simply looks again


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    authed: bool
    inbuf: bytearray = field(default_factory=bytearray)
    out: deque[bytes | memoryview] = field(default_factory=deque)
    out_bytes: int = 0
    events: int = selectors.EVENT_READ
    waiter: _Waiter | None = None
    closed: bool = False
    corked: bool = False  # replies are queued, not sent, while a batch of requests is served


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    op: Op
    keys: tuple[bytes, ...]
    target: int
    deadline: float
    done: bool = False
    position: int = 0  # keys[:position] were seen set


class _Tag:
    LISTENER = object()
    WAKE = object()


class Server:
    """The store's state and a selector loop serving it from a daemon thread.

    Args:
        listener: a bound, listening socket (the server owns it from now on).
        secret: the shared secret clients must present first, or None.
    """

    def __init__(self, listener: socket.socket, secret: bytes | None = None) -> None:
        self._listener = listener
        self._listener.settimeout(0.0)
        self.port: int = listener.getsockname()[1]
        self._secret = secret
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.settimeout(0.0)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, _Tag.LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _Tag.WAKE)
        self._table = Table()
        self._joined = 0
        self._conns: set[_Conn] = set()
        self._watch: dict[bytes, list[_Waiter]] = {}
        self._queue_watch: dict[bytes, deque[_Waiter]] = {}
        self._join_watch: list[_Waiter] = []
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._sequence = itertools.count()
        self._runnable: deque[_Conn] = deque()
        self._buffered = 0
        self._recv_buffer = bytearray(_RECV_BYTES)
        self._recv_view = memoryview(self._recv_buffer)
        self._parked = 0
        self._backoff = _BACKOFF_S[0]
        self._accept_paused_until: float | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self._handlers: dict[int, Callable[[_Conn, Reader], None]] = {
            Op.SET: self._op_set,
            Op.GET: self._op_get,
            Op.ADD: self._op_add,
            Op.WAIT: self._op_wait,
            Op.CHECK: self._op_check,
            Op.DELETE: self._op_delete,
            Op.NUM_KEYS: self._op_num_keys,
            Op.JOIN: self._op_join,
            Op.WAIT_JOINED: self._op_wait_joined,
            Op.COMPARE_SET: self._op_compare_set,
            Op.APPEND: self._op_append,
            Op.MULTI_GET: self._op_multi_get,
            Op.MULTI_SET: self._op_multi_set,
            Op.QUEUE_PUSH: self._op_queue_push,
            Op.QUEUE_POP: self._op_queue_pop,
            Op.QUEUE_LEN: self._op_queue_len,
            Op.AUTH: self._op_auth,
        }
        self._thread = threading.Thread(
            target=self._serve, name=f"cupy_parallel-TCPStore-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the serving thread runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop serving and close every connection (idempotent)."""
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
                        self._guarded(key.data, mask)
                    self._run()
                now = time.monotonic()
                self._expire(now)
                self._run()
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    self._sel.register(self._listener, selectors.EVENT_READ, _Tag.LISTENER)
        except BaseException as exc:  # noqa: BLE001 - the loop failed: tell every client
            self.error = exc
        finally:
            for key in list(self._sel.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                self._listener.close()
            self._wake_w.close()
            self._sel.close()

    def _guarded(self, conn: _Conn, mask: int) -> None:
        """Serve one connection; any failure closes that connection, never the server."""
        try:
            self._on_event(conn, mask)
        except Exception:  # noqa: BLE001 - one bad connection must not stop the others
            self._close(conn)

    def _run(self) -> None:
        """Handle the buffered requests of connections whose parked request was answered."""
        while self._runnable:
            conn = self._runnable.popleft()
            try:
                self._process(conn)
                self._interest(conn)
            except Exception:  # noqa: BLE001
                self._close(conn)

    def _select_timeout(self) -> float | None:
        timeout = None
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            timeout = self._deadlines[0][0] - time.monotonic()
        if self._accept_paused_until is not None:
            pause = self._accept_paused_until - time.monotonic()
            timeout = pause if timeout is None else min(timeout, pause)
        return None if timeout is None else min(max(0.0, timeout), _MAX_SELECT_S)

    def _accept(self) -> None:
        for _ in range(64):  # bounded: other events get their turn
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, _BACKOFF_S[1])
                return  # e.g. the peer reset before we accepted; keep listening
            self._backoff = _BACKOFF_S[0]
            sock.settimeout(0.0)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, authed=self._secret is None)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if conn.closed:
            return
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
            if conn.inbuf and not conn.closed:
                self._process(conn)  # requests held back while the replies drained
        if not conn.closed and mask & selectors.EVENT_READ:
            self._receive(conn)
        if not conn.closed:
            self._interest(conn)

    def _receive(self, conn: _Conn) -> None:
        try:
            n = conn.sock.recv_into(self._recv_buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not n:
            self._close(conn)
            return
        if not conn.inbuf and n > U32.size and conn.waiter is None:
            (length,) = U32.unpack_from(self._recv_buffer)
            if n == U32.size + length and conn.out_bytes < OUTPUT_HIGH_WATER:
                # the usual case: exactly one whole request, handled without buffering it
                self._handle(conn, bytes(self._recv_view[:n]))
                return
        conn.inbuf += self._recv_view[:n]  # one reused buffer: no allocation per read
        self._buffered += n
        if len(conn.inbuf) > U32.size + MAX_FRAME_BYTES:
            self._close(conn)  # more unanswered bytes than any legal request
            return
        if self._buffered > MAX_BUFFERED_BYTES:
            self._close(max(self._conns, key=lambda c: len(c.inbuf) + c.out_bytes))
            if conn.closed:
                return
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle the complete requests buffered on ``conn``, one at a time, in order.

        Their replies go out together, in one send, once the batch is served (a client that
        pipelines requests, such as ``set`` with ``confirm_sets=False``, costs one syscall per
        batch instead of one per request).
        """
        conn.corked = True
        try:
            while (
                conn.waiter is None
                and not conn.closed
                and conn.out_bytes < OUTPUT_HIGH_WATER
                and len(conn.inbuf) >= U32.size
            ):
                (length,) = U32.unpack_from(conn.inbuf)
                if length == 0 or length > MAX_FRAME_BYTES:
                    self._close(conn)
                    return
                if len(conn.inbuf) < U32.size + length:
                    return
                if len(conn.inbuf) == U32.size + length:  # the usual case: one whole request
                    body = bytes(conn.inbuf)
                    conn.inbuf.clear()
                else:
                    with memoryview(conn.inbuf) as view:
                        body = bytes(view[: U32.size + length])
                    del conn.inbuf[: U32.size + length]
                self._buffered -= U32.size + length
                self._handle(conn, body)
        finally:
            conn.corked = False
            if conn.out and not conn.closed:
                self._flush(conn)

    def _handle(self, conn: _Conn, frame: bytes) -> None:
        """Serve one whole request frame (its length prefix included)."""
        if len(frame) <= U32.size or len(frame) > U32.size + MAX_FRAME_BYTES:
            self._close(conn)
            return
        handler = self._handlers.get(frame[U32.size])
        try:
            if handler is None or not (conn.authed or frame[U32.size] == Op.AUTH):
                raise ProtocolError("an unknown opcode, or no AUTH first")
            handler(conn, Reader(frame, U32.size + 1))
        except ProtocolError:  # a malformed body
            self._close(conn)

    def _interest(self, conn: _Conn) -> None:
        """Read only while replies drain; write while replies are queued."""
        if conn.closed:
            return
        events = selectors.EVENT_WRITE if conn.out else 0
        if conn.out_bytes < OUTPUT_HIGH_WATER:
            events |= selectors.EVENT_READ
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def _reply(self, conn: _Conn, status: Status, payload: bytes = b"") -> None:
        header = HEADER.pack(1 + len(payload), status)
        if len(payload) <= _INLINE_REPLY:
            frame = header + payload
            if not conn.out and not conn.corked:  # the usual case: nothing queued, send now
                try:
                    sent = conn.sock.send(frame)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    self._close(conn)
                    return
                if sent == len(frame):
                    return
                frame = frame[sent:]
                conn.out_bytes += len(frame)
                self._buffered += len(frame)
                conn.out.append(frame)
                return  # the loop writes the rest once the socket takes more
            conn.out.append(frame)
        else:
            conn.out.append(header)
            conn.out.append(payload)  # the stored value itself: no copy
        size = len(header) + len(payload)
        conn.out_bytes += size
        self._buffered += size
        if not conn.corked:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        while out:
            try:
                if len(out) == 1:
                    sent = conn.sock.send(out[0])
                else:
                    sent = conn.sock.sendmsg(list(itertools.islice(out, _SEND_BUFFERS)))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            conn.out_bytes -= sent
            self._buffered -= sent
            while sent:
                first = out[0]
                if len(first) <= sent:
                    sent -= len(first)
                    out.popleft()
                else:
                    out[0] = memoryview(first)[sent:]
                    sent = 0

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._buffered -= len(conn.inbuf) + conn.out_bytes
        conn.inbuf = bytearray()
        conn.out.clear()
        conn.out_bytes = 0
        if conn.waiter is not None:
            self._unwatch(conn.waiter)
            conn.waiter = None
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    # -- waiting ------------------------------------------------------------------------------

    def _park(
        self, conn: _Conn, op: Op, keys: tuple[bytes, ...], seconds: float, target: int = 0
    ) -> None:
        """Hold ``conn``'s request until its keys are set (or a worker count is reached)."""
        waiter = _Waiter(conn, op, keys, target, time.monotonic() + seconds)
        conn.waiter = waiter
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._sequence), waiter))
        self._parked += 1
        if op is Op.QUEUE_POP:
            self._queue_watch.setdefault(keys[0], deque()).append(waiter)
        elif op is Op.WAIT_JOINED:
            self._join_watch.append(waiter)
        elif self._advance(waiter):  # callers park only when a key is missing; stay safe
            self._release(waiter)
        else:
            self._watch.setdefault(waiter.keys[waiter.position], []).append(waiter)

    def _finish(self, waiter: _Waiter) -> None:
        """Mark a waiter done once; drop finished entries when they outnumber the live ones."""
        if waiter.done:
            return
        waiter.done = True
        self._parked -= 1
        if len(self._deadlines) > 2 * self._parked + 1024:
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)

    def _unwatch(self, waiter: _Waiter) -> None:
        """Forget a waiter that will not be answered normally, everywhere it is listed."""
        self._finish(waiter)
        if waiter.op is Op.QUEUE_POP:
            lists: dict[bytes, deque[_Waiter]] | dict[bytes, list[_Waiter]] = self._queue_watch
            key = waiter.keys[0]
        elif waiter.op is Op.WAIT_JOINED:
            with contextlib.suppress(ValueError):
                self._join_watch.remove(waiter)
            key = None
        else:
            lists = self._watch
            key = waiter.keys[min(waiter.position, len(waiter.keys) - 1)] if waiter.keys else None
        if key is not None:
            found = lists.get(key)
            if found is not None:
                with contextlib.suppress(ValueError):
                    found.remove(waiter)
                if not found:
                    del lists[key]

    def _missing(self, waiter: _Waiter) -> list[bytes]:
        """What ``waiter`` still waits for: values (get, multi_get) or values or queues (wait)."""
        if waiter.op is Op.WAIT:
            return self._table.missing(waiter.keys)
        return self._table.unset(waiter.keys)

    def _advance(self, waiter: _Waiter) -> bool:
        """Move past the keys that are set; whether all are."""
        data, queues = self._table.data, self._table.queues
        keys = waiter.keys
        either = waiter.op is Op.WAIT
        while waiter.position < len(keys) and (
            keys[waiter.position] in data or (either and keys[waiter.position] in queues)
        ):
            waiter.position += 1
        if waiter.position < len(keys):
            return False
        missing = self._missing(waiter)  # an earlier key may have been deleted since
        if missing:
            waiter.position = keys.index(missing[0])
            return False
        return True

    def _answer(self, waiter: _Waiter, status: Status, payload: bytes) -> None:
        self._finish(waiter)  # the caller took it off its watch list
        conn = waiter.conn
        conn.waiter = None
        self._reply(conn, status, payload)
        self._runnable.append(conn)  # its next requests run from the loop, not from here

    def _release(self, waiter: _Waiter) -> None:
        """Answer a waiter whose keys are all set."""
        data = self._table.data
        if waiter.op is Op.GET:
            self._answer(waiter, Status.VALUE, data[waiter.keys[0]])
        elif waiter.op is Op.MULTI_GET:
            self._answer(waiter, *self._values(waiter.keys))
        else:
            self._answer(waiter, Status.OK, b"")

    def _values(self, keys: tuple[bytes, ...]) -> tuple[Status, bytes]:
        """The answer to a ``multi_get`` of keys that are all set: their values, if they fit."""
        values = [self._table.data[key] for key in keys]
        total = sum(len(value) for value in values)
        if total > MAX_VALUE_BYTES:
            message = (
                f"multi_get would return {total} bytes; one call moves at most "
                f"{MAX_VALUE_BYTES} bytes. Ask for fewer keys at a time."
            )
            return Status.ERROR, message.encode()
        return Status.VALUES, blobs(values)

    def _notify(self, key: bytes) -> None:
        """Answer the waiters that ``key`` being set completes."""
        waiters = self._watch.pop(key, None)
        if not waiters:
            return
        for waiter in waiters:
            if waiter.done:
                continue
            if self._advance(waiter):
                self._release(waiter)
            else:
                self._watch.setdefault(waiter.keys[waiter.position], []).append(waiter)

    def _expire(self, now: float) -> None:
        while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][2].done):
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.done:
                continue
            self._unwatch(waiter)
            if waiter.op is Op.WAIT_JOINED:
                payload = I64.pack(self._joined)
            else:
                payload = blobs(self._missing(waiter))
            self._answer(waiter, Status.TIMEOUT, payload)

    # -- requests -----------------------------------------------------------------------------

    def _op_auth(self, conn: _Conn, reader: Reader) -> None:
        offered = reader.key()
        reader.end()
        if self._secret is not None and not hmac.compare_digest(offered, self._secret):
            raise ProtocolError("wrong secret")
        conn.authed = True
        self._reply(conn, Status.OK)

    def _op_set(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        value = reader.value()
        reader.end()
        self._table.set(key, value)
        self._reply(conn, Status.OK)
        self._notify(key)

    def _op_get(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        seconds = reader.seconds()
        reader.end()
        value = self._table.data.get(key)
        if value is not None:
            self._reply(conn, Status.VALUE, value)
        else:
            self._park(conn, Op.GET, (key,), seconds)

    def _op_add(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        amount = reader.i64()
        reader.end()
        try:
            new = self._table.add(key, amount)
        except ValueError as exc:
            self._reply(conn, Status.ERROR, str(exc).encode())
            return
        self._reply(conn, Status.INT, I64.pack(int(new)))
        self._notify(key)

    def _op_compare_set(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        expected = reader.value()
        desired = reader.value()
        reader.end()
        self._reply(conn, Status.VALUE, self._table.compare_set(key, expected, desired))
        self._notify(key)

    def _op_append(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        value = reader.value()
        reader.end()
        try:
            self._table.append(key, value)
        except ValueError as exc:
            self._reply(conn, Status.ERROR, str(exc).encode())
            return
        self._reply(conn, Status.OK)
        self._notify(key)

    def _op_multi_set(self, conn: _Conn, reader: Reader) -> None:
        keys = reader.key_list()
        values = reader.value_list()
        reader.end()
        if len(keys) != len(values) or sum(len(v) for v in values) > MAX_VALUE_BYTES:
            raise ProtocolError("multi_set needs one value per key, within MAX_VALUE_BYTES")
        self._table.multi_set(keys, values)
        self._reply(conn, Status.OK)
        for key in keys:
            self._notify(key)

    def _parked_keys(self, conn: _Conn, reader: Reader, op: Op) -> None:
        keys = reader.key_list()
        seconds = reader.seconds()
        reader.end()
        if (self._table.missing if op is Op.WAIT else self._table.unset)(keys):
            self._park(conn, op, keys, seconds)
        elif op is Op.MULTI_GET:
            self._reply(conn, *self._values(keys))
        else:
            self._reply(conn, Status.OK)

    def _op_multi_get(self, conn: _Conn, reader: Reader) -> None:
        self._parked_keys(conn, reader, Op.MULTI_GET)

    def _op_wait(self, conn: _Conn, reader: Reader) -> None:
        self._parked_keys(conn, reader, Op.WAIT)

    def _op_check(self, conn: _Conn, reader: Reader) -> None:
        keys = reader.key_list()
        reader.end()
        self._reply(conn, Status.INT, I64.pack(not self._table.missing(keys)))

    def _op_delete(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        reader.end()
        self._reply(conn, Status.INT, I64.pack(self._table.delete(key)))

    def _op_num_keys(self, conn: _Conn, reader: Reader) -> None:
        reader.end()
        self._reply(conn, Status.INT, I64.pack(len(self._table.data)))

    def _op_queue_push(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        value = reader.value()
        reader.end()
        self._reply(conn, Status.OK)
        waiters = self._queue_watch.get(key)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done:
                self._answer(waiter, Status.VALUE, value)  # handed over, never queued
                break
        else:
            self._table.queue_push(key, value)
            self._notify(key)  # wait() and check() see a non-empty queue, as in torch
        if waiters is not None and not waiters:
            del self._queue_watch[key]

    def _op_queue_pop(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        block = reader.u8()
        seconds = reader.seconds()
        reader.end()
        value = self._table.queue_pop(key)
        if value is not None:
            self._reply(conn, Status.VALUE, value)
        elif block:
            self._park(conn, Op.QUEUE_POP, (key,), seconds)
        else:
            self._reply(conn, Status.TIMEOUT, blobs([key]))

    def _op_queue_len(self, conn: _Conn, reader: Reader) -> None:
        key = reader.key()
        reader.end()
        self._reply(conn, Status.INT, I64.pack(self._table.queue_len(key)))

    def _op_join(self, conn: _Conn, reader: Reader) -> None:
        reader.end()
        self._joined += 1
        self._reply(conn, Status.INT, I64.pack(self._joined))
        waiting, self._join_watch = self._join_watch, []
        for waiter in waiting:
            if waiter.done:
                continue
            if self._joined >= waiter.target:
                self._answer(waiter, Status.OK, b"")
            else:
                self._join_watch.append(waiter)

    def _op_wait_joined(self, conn: _Conn, reader: Reader) -> None:
        target = reader.i64()
        seconds = reader.seconds()
        reader.end()
        if self._joined >= target:
            self._reply(conn, Status.OK)
        else:
            self._park(conn, Op.WAIT_JOINED, (), seconds, target)
