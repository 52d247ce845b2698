"""The stores under hostile or broken peers: the server keeps serving, memory stays bounded.

Every attack runs against a TCPStore master, in this process or (where memory or file
descriptors are measured) in a subprocess, and then a well-behaved client must still be
served within its timeout. Only loopback addresses are used; every loop and wait is bounded.

Bounds stated here (the server's own limits are in ``store/server.py``):

- unread replies: the server's RSS grows by less than 64 MiB while one client sends 200 GETs
  of an 8 MiB value and never reads (the old server grew by 1.6 GB);
- ten half-sent 64 MiB frames: RSS grows by less than 320 MiB (``MAX_BUFFERED_BYTES`` is
  256 MiB; the old server buffered all 640 MiB);
- out of file descriptors: the server uses less than 30 % of a CPU while ``accept`` fails
  (the old one spun at 100 %), and existing clients are served.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

from cupy_parallel.distributed import (
    DistNetworkError,
    DistStoreError,
    FileStore,
    TCPStore,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

HOST = "127.0.0.1"
MiB = 2**20


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _get(key: bytes, millis: int = 30_000) -> bytes:
    return _frame(b"\x02" + _blob(key) + struct.pack(">Q", millis))


def _set(key: bytes, value: bytes) -> bytes:
    return _frame(b"\x01" + _blob(key) + _blob(value))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def _reply(sock: socket.socket) -> bytes:
    (length,) = struct.unpack(">I", _recv_exact(sock, 4))
    return _recv_exact(sock, length)


def _served(port: int, timeout: float = 5.0) -> float:
    """A well-behaved client's round trips; returns how long they took (within ``timeout``)."""
    start = time.monotonic()
    with TCPStore(HOST, port, timeout=timeout) as client:
        key = f"probe-{random.random()}"
        client.set(key, "ok")
        assert client.get(key) == b"ok"
        assert client.add(key + "n", 2) == 2
    elapsed = time.monotonic() - start
    assert elapsed < timeout
    return elapsed


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.2)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SERVER = """
import resource, sys
limit = int(sys.argv[1])
if limit:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
from cupy_parallel.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, timeout=60)
print(store.port, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _server_process(nofile: int = 0) -> Iterator[tuple[int, int]]:
    """A master in a subprocess: yields (pid, port); stops it when done."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(nofile)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the server process did not start"
        yield proc.pid, int(line)
    finally:
        proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes the pipes


@pytest.fixture
def master() -> Iterator[TCPStore]:
    with TCPStore(HOST, 0, is_master=True, timeout=10) as store:
        yield store


@pytest.fixture(autouse=True, scope="module")
def _many_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --------------------------------------------------------------------------------------------
# 1. No recursion; a dead server thread is reported at once


def test_a_chain_of_parked_gets_released_by_pipelined_sets(master: TCPStore) -> None:
    """GET k_i parked on socket i, with SET k_{i+1} pipelined behind it: one SET releases all."""
    n = 250
    socks = [socket.create_connection((HOST, master.port), timeout=10) for _ in range(n)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(_get(b"chain%d" % i) + _set(b"chain%d" % (i + 1), b"v%d" % (i + 1)))
        time.sleep(0.2)
        master.set("chain0", "v0")
        for i, sock in enumerate(socks):
            assert _reply(sock) == b"\x01v%d" % i  # its GET's value
            assert _reply(sock) == b"\x00"  # its SET's OK
    finally:
        for sock in socks:
            sock.close()
    assert master.get(f"chain{n}") == f"v{n}".encode()
    _served(master.port)


def test_a_dead_server_thread_fails_every_call_at_once(master: TCPStore) -> None:
    other = TCPStore(HOST, master.port, timeout=30)
    parked = TCPStore(HOST, master.port, timeout=30)
    errors: list[BaseException] = []

    def wait_forever() -> None:
        try:
            parked.get("never")
        except DistNetworkError as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait_forever)
    thread.start()
    time.sleep(0.2)
    server = master._server
    assert server is not None

    def broken(timeout: float | None = None) -> list:
        raise MemoryError("injected")

    server._sel.select = broken  # type: ignore[method-assign]
    server._wake_w.send(b"\0")  # the loop calls select again, and dies
    start = time.monotonic()
    thread.join(5)
    assert errors, "the parked client was not woken"
    with pytest.raises(DistNetworkError, match=r"stopped serving \(MemoryError\('injected'\)\)"):
        master.set("k", "v")
    with pytest.raises(DistNetworkError, match=r"lost the connection|could not connect"):
        other.add("k", 1)
    assert time.monotonic() - start < 3
    other.close()
    parked.close()


# --------------------------------------------------------------------------------------------
# 2. Bounded memory


@pytest.mark.slow
def test_unread_replies_do_not_grow_the_server() -> None:
    with _server_process() as (pid, port):
        with TCPStore(HOST, port, timeout=30) as client:
            client.set("big", os.urandom(8 * MiB))
        before = _rss(pid)
        with socket.create_connection((HOST, port), timeout=10) as greedy:
            greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            greedy.settimeout(0.5)
            requests = _get(b"big") * 200
            with contextlib.suppress(TimeoutError, BlockingIOError):
                greedy.sendall(requests)  # stops when the server stops reading: that is the point
            time.sleep(1.0)
            grown = _rss(pid) - before
            _served(port)
        assert grown < 64 * MiB, f"server RSS grew by {grown / MiB:.0f} MiB"


@pytest.mark.slow
def test_half_sent_huge_frames_are_capped() -> None:
    with _server_process() as (pid, port):
        before = _rss(pid)
        frame_start = struct.pack(">I", 64 * MiB + 16) + b"\x01" + _blob(b"k")
        filler = b"\0" * MiB
        socks = []
        try:
            for _ in range(10):
                sock = socket.create_connection((HOST, port), timeout=10)
                socks.append(sock)
                with contextlib.suppress(OSError):  # reset by the server
                    sock.sendall(frame_start + struct.pack(">I", 64 * MiB))
                    for _ in range(63):
                        sock.sendall(filler)
            time.sleep(0.5)
            grown = _rss(pid) - before
            _served(port)
            reset = sum(_closed_by_server(sock) for sock in socks)
        finally:
            for sock in socks:
                sock.close()
        assert reset >= 5, f"the server reset {reset} of 10 connections holding 64 MiB each"
        assert grown < 320 * MiB, f"server RSS grew by {grown / MiB:.0f} MiB"


# --------------------------------------------------------------------------------------------
# 3. Out of file descriptors


@pytest.mark.slow
def test_emfile_backs_off_and_keeps_serving_existing_clients() -> None:
    with _server_process(nofile=48) as (pid, port), TCPStore(HOST, port, timeout=10) as existing:
        flood: list[socket.socket] = []
        try:
            # well past the limit: accept() fails with EMFILE
            flood.extend(socket.create_connection((HOST, port), timeout=5) for _ in range(80))
            time.sleep(0.3)
            cpu = _cpu_seconds(pid)
            start = time.monotonic()
            for i in range(20):
                existing.set(f"k{i}", "v")
                assert existing.get(f"k{i}") == b"v"
            time.sleep(max(0.0, 1.0 - (time.monotonic() - start)))
            busy = (_cpu_seconds(pid) - cpu) / (time.monotonic() - start)
        finally:
            for sock in flood:
                sock.close()
        assert busy < 0.3, f"the server used {busy:.0%} of a CPU while out of descriptors"
        time.sleep(1.5)  # the backoff ends; descriptors are free again
        _served(port)


# --------------------------------------------------------------------------------------------
# 4. Garbage, truncated and oversized frames; idle and slowloris clients


@pytest.mark.parametrize(
    "attack",
    [
        b"\xde\xad\xbe\xef" * 1000,  # garbage
        struct.pack(">I", 100) + b"\x01" * 50,  # truncated, then the peer leaves
        struct.pack(">I", 2**32 - 1),  # oversized
        _frame(b"\x01" + _blob(b"k") + struct.pack(">I", 2**31)),  # a value length over bound
    ],
    ids=["garbage", "truncated", "oversized", "value-bound"],
)
def test_bad_frames_cost_only_their_connection(master: TCPStore, attack: bytes) -> None:
    for _ in range(20):
        with socket.create_connection((HOST, master.port), timeout=5) as bad:
            bad.sendall(attack)
    _served(master.port)


@pytest.mark.slow
def test_a_thousand_idle_and_slowloris_clients() -> None:
    with _server_process() as (pid, port):
        before = _rss(pid)
        idle = [socket.create_connection((HOST, port), timeout=10) for _ in range(1000)]
        try:
            slow = idle[:200]
            for sock in slow:
                sock.sendall(struct.pack(">I", 1000))  # a frame that never completes
            elapsed = []
            for step in range(10):  # each slowloris trickles one more byte per round
                for sock in slow:
                    sock.sendall(b"\x01")
                elapsed.append(_served(port, timeout=5))
                assert step < 10
            grown = _rss(pid) - before
        finally:
            for sock in idle:
                sock.close()
        assert max(elapsed) < 2.0
        assert grown < 64 * MiB, f"server RSS grew by {grown / MiB:.0f} MiB"
        _served(port)


# --------------------------------------------------------------------------------------------
# 5. Client timeouts


@pytest.mark.slow
def test_a_silent_server_times_out_after_the_clients_timeout() -> None:
    with socket.create_server((HOST, 0)) as silent:
        port = silent.getsockname()[1]
        store = TCPStore(HOST, port, timeout=1.0)  # connects: the kernel accepts for us
        try:
            start = time.monotonic()
            with pytest.raises(DistStoreError, match=r"did not answer ADD within 1\.0 s"):
                store.add("k", 1)
            assert time.monotonic() - start < 2.5  # the old client waited 30 s
            # not "closed": the store reconnects and tries again
            with pytest.raises(DistStoreError, match=r"did not answer GET"):
                store.get("k")
        finally:
            store.close()


@pytest.mark.slow
def test_a_server_that_never_reads_times_a_large_set_out() -> None:
    """The request itself cannot be sent: the client's send waits up to the timeout only."""
    with socket.create_server((HOST, 0)) as silent:
        port = silent.getsockname()[1]
        store = TCPStore(HOST, port, timeout=0.5)
        try:
            start = time.monotonic()
            with pytest.raises(DistStoreError, match=r"did not answer SET within 0\.5 s"):
                store.set("k", b"x" * (32 * MiB))  # far more than the socket buffers hold
            assert 0.5 <= time.monotonic() - start < 3.0
        finally:
            store.close()


@pytest.mark.slow
def test_a_long_wait_outlasts_a_shorter_earlier_call() -> None:
    """A parked call longer than the store's timeout still gets its answer.

    The client's receive timer is left at the last call's limit (0.3 s here); a wait that
    may take longer must re-arm it when it runs out, not time out.
    """
    master = TCPStore(HOST, 0, is_master=True, timeout=0.3)
    try:
        master.add("warm", 1)  # the receive timer is now about 0.3 s
        other = master.clone()
        setter = threading.Timer(0.8, other.set, ("late", "1"))
        setter.start()
        start = time.monotonic()
        master.wait(["late"], timeout=2.0)
        assert 0.7 <= time.monotonic() - start < 2.0
        setter.join(5)
        other.close()
    finally:
        master.close()


# --------------------------------------------------------------------------------------------
# 6. The shared secret


def test_a_secret_rejects_clients_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_STORE_SECRET", "s3cret")
    with TCPStore(HOST, 0, is_master=True, timeout=5) as master:
        with TCPStore(HOST, master.port, timeout=5) as friend:
            friend.set("k", "v")
        with socket.create_connection((HOST, master.port), timeout=5) as stranger:
            stranger.sendall(_get(b"k", 0))
            assert stranger.recv(16) == b""  # closed without an answer
        monkeypatch.setenv("CUPY_PARALLEL_STORE_SECRET", "wrong")
        with pytest.raises(DistNetworkError, match=r"refused this client's CUPY_PARALLEL_STORE"):
            TCPStore(HOST, master.port, timeout=5)
        monkeypatch.delenv("CUPY_PARALLEL_STORE_SECRET")
        with TCPStore(HOST, master.port, timeout=5) as plain, pytest.raises(DistNetworkError):
            plain.get("k")
        assert master.get("k") == b"v"


# --------------------------------------------------------------------------------------------
# 7. FileStore and a killed writer; compaction

_WRITER = """
import os, sys
from cupy_parallel.distributed import FileStore
store = FileStore(sys.argv[1])
value = os.urandom(8 << 20)
store.set("big", value)  # one whole value before any kill, however slow the machine
print("ready", flush=True)
while True:
    store.set("big", value)
    store.add("count", 1)
"""


@pytest.mark.slow
def test_file_store_survives_a_writer_killed_mid_set(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    survivor = FileStore(path, timeout=5)
    rng = random.Random(0)
    for trial in range(4):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, path], stdout=subprocess.PIPE, text=True
        )
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline() == "ready\n"
            time.sleep(0.05 + rng.random() * 0.3)
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.communicate(timeout=30)
        counted = survivor.add("count", 0)
        assert survivor.add("count", 1) == counted + 1
        survivor.set(f"after-{trial}", "seen")
        with FileStore(path, timeout=5) as newcomer:
            assert newcomer.get(f"after-{trial}") == b"seen"
            assert newcomer.add("count", 0) == counted + 1
            assert len(newcomer.get("big")) == 8 << 20
    survivor.close()


def test_a_torn_tail_is_skipped_then_cut(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    with FileStore(path) as store:
        store.set("a", "1")
        with open(path, "ab") as f:  # a record that promises 200 bytes: its writer died
            f.write(struct.pack(">II", 200, 0) + b"\x01" + _blob(b"b") + b"xx")
        with FileStore(path) as reader:
            assert reader.check(["a"])
            assert not reader.check(["b"])
            reader.set("c", "3")  # a writer cuts the torn tail before appending
            assert reader.get("c") == b"3"
        assert (store.get("c"), store.get("a"), store.check(["b"])) == (b"3", b"1", False)


def test_corruption_before_the_tail_is_an_error(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    with FileStore(path) as store:
        store.set("a", "value-a")
        store.set("b", "value-b")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[data.index(b"value-a")] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ValueError, match=r"is corrupt at byte \d+ \(a record fails its checksum"):
        FileStore(path)


def test_the_log_is_compacted(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    stale = path + ".compact-999999-1"  # what a compactor killed mid-copy leaves behind
    with open(stale, "wb") as f:
        f.write(bytes(MiB))
    value = os.urandom(MiB)
    with FileStore(path) as writer, FileStore(path) as other:
        for i in range(40):  # 40 MiB written; the live state is 1 MiB
            writer.set("v", value)
            other.add("n", 1)
            assert os.path.getsize(path) < 4 * MiB
            if i % 7 == 0:
                assert other.get("v") == value
        assert other.get("n") == b"40"
        assert writer.get("v") == value
    with FileStore(path) as reopened:
        assert (reopened.get("n"), reopened.get("v")) == (b"40", value)
    assert sorted(os.listdir(tmp_path)) == ["store"]
