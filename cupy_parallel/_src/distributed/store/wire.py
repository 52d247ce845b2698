"""The TCPStore wire format (also the record format of the FileStore log).

No pickle: only byte strings and integers, all big-endian. Every message, in either direction,
is a frame: a ``u32`` body length, then the body. A request body is an ``u8`` opcode
(:class:`Op`) then its fields; byte strings are a ``u32`` length then the bytes; lists are a
``u32`` count then their items; integers ``i64``; timeouts ``u64`` milliseconds. A response
body is an ``u8`` :class:`Status` then its payload. A frame longer than :data:`MAX_FRAME_BYTES`,
a key or value over its bound, an unknown opcode, a short or over-long body, or more than
``MAX_WAIT_KEYS`` keys is a protocol error: the server closes that connection.
"""

from __future__ import annotations

import enum
import struct
from typing import TYPE_CHECKING

from cupy_parallel._src.distributed.store.interface import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MAX_WAIT_KEYS,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "HEADER",
    "I64",
    "MAX_FRAME_BYTES",
    "U32",
    "Op",
    "ProtocolError",
    "Reader",
    "Status",
    "blob",
    "blobs",
    "millis",
]


class Op(enum.IntEnum):
    """Request opcodes."""

    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    DELETE = 6
    NUM_KEYS = 7
    JOIN = 8
    WAIT_JOINED = 9
    COMPARE_SET = 10
    APPEND = 11
    MULTI_GET = 12
    MULTI_SET = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    AUTH = 17


class Status(enum.IntEnum):
    """Response status bytes."""

    OK = 0
    VALUE = 1  # one byte string: the rest of the body
    INT = 2  # one i64
    TIMEOUT = 3  # a list of the keys still missing
    ERROR = 4  # a UTF-8 message (a ValueError on the client)
    VALUES = 5  # a list of byte strings


class ProtocolError(Exception):
    """A peer sent bytes that are not a well-formed message."""


U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
I64 = struct.Struct(">q")
HEADER = struct.Struct(">IB")  # frame length, then the opcode or status byte
MAX_TIMEOUT_MS = 2**40  # ~35 years; anything longer is "forever"
_LIST_BYTES = 4 + MAX_WAIT_KEYS * (4 + MAX_KEY_BYTES)
MAX_FRAME_BYTES = 1 + 8 + 2 * _LIST_BYTES + MAX_VALUE_BYTES + 4 * MAX_WAIT_KEYS
"""The longest legal frame body: a ``multi_set`` of the most keys and the most value bytes."""


def blob(data: bytes) -> bytes:
    """A length-prefixed byte string."""
    return U32.pack(len(data)) + data


def blobs(items: Sequence[bytes]) -> bytes:
    """A counted list of byte strings."""
    return U32.pack(len(items)) + b"".join([U32.pack(len(item)) + item for item in items])


def millis(seconds: float) -> bytes:
    """A timeout field."""
    return U64.pack(min(max(0, round(seconds * 1000)), MAX_TIMEOUT_MS))


class Reader:
    """Reads the fields of one message body, raising :class:`ProtocolError` on any malformation."""

    __slots__ = ("_body", "_pos")

    def __init__(self, body: bytes, start: int = 0) -> None:
        self._body = body
        self._pos = start

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._body):
            raise ProtocolError("message ends early")
        data = self._body[self._pos : end]
        self._pos = end
        return data

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return int(U32.unpack(self._take(4))[0])

    def i64(self) -> int:
        return int(I64.unpack(self._take(8))[0])

    def seconds(self) -> float:
        value = int(U64.unpack(self._take(8))[0])
        return min(value, MAX_TIMEOUT_MS) / 1000

    def blob(self, limit: int) -> bytes:
        body, start = self._body, self._pos + U32.size  # _take and u32 inlined: the hot path
        if start > len(body):
            raise ProtocolError("message ends early")
        (n,) = U32.unpack_from(body, self._pos)
        if n > limit:
            raise ProtocolError(f"field of {n} bytes exceeds {limit}")
        end = start + n
        if end > len(body):
            raise ProtocolError("message ends early")
        self._pos = end
        return body[start:end]

    def key(self) -> bytes:
        return self.blob(MAX_KEY_BYTES)

    def value(self) -> bytes:
        return self.blob(MAX_VALUE_BYTES)

    def key_list(self) -> tuple[bytes, ...]:
        count = self.u32()
        if count > MAX_WAIT_KEYS:
            raise ProtocolError(f"{count} keys exceed {MAX_WAIT_KEYS}")
        return tuple([self.blob(MAX_KEY_BYTES) for _ in range(count)])

    def value_list(self, limit: int = MAX_WAIT_KEYS) -> list[bytes]:
        count = self.u32()
        if count > limit:
            raise ProtocolError(f"{count} values exceed {limit}")
        return [self.blob(MAX_VALUE_BYTES) for _ in range(count)]

    def rest(self) -> bytes:
        return self._take(len(self._body) - self._pos)

    def end(self) -> None:
        if self._pos != len(self._body):
            raise ProtocolError("trailing bytes after the message")
