"""Stores: TCPStore, FileStore, HashStore and PrefixStore, within one process and across processes.

PyTorch's own store tests are covered in tests/test_store_torch_cases.py, the abuse suite in
tests/test_store_abuse.py.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel._src.distributed.store import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MAX_WAIT_KEYS,
    DistNetworkError,
    DistStoreError,
    FileStore,
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
)
from cupy_parallel._src.distributed.store.client import listen

HOST = "127.0.0.1"
SHORT = timedelta(seconds=0.5)
KINDS = ["tcp", "file", "prefix", "hash"]


class Pair:
    """Two handles on one store (as two processes would hold), and their clean-up."""

    def __init__(self, kind: str, tmp_path: os.PathLike[str]) -> None:
        self.closers: list[Store] = []
        if kind == "hash":
            self.a = self._keep(HashStore(timeout=5))
            self.b = self._keep(self.a.clone())
        elif kind == "file":
            path = os.path.join(tmp_path, "store")
            self.a: Store = self._keep(FileStore(path, timeout=timedelta(seconds=5)))
            self.b: Store = self._keep(FileStore(path, timeout=timedelta(seconds=5)))
        else:
            master = self._keep(TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=5)))
            client = self._keep(TCPStore(HOST, master.port, timeout=timedelta(seconds=5)))
            self.a, self.b = master, client
            if kind == "prefix":
                self.a, self.b = PrefixStore("pre", master), PrefixStore("pre", client)

    def _keep(self, store: Store) -> Store:
        self.closers.append(store)
        return store

    def close(self) -> None:
        for store in reversed(self.closers):
            store.close()

    def name_and_prefix(self) -> tuple[str, str]:
        """The class named by timeout messages (the store holding the keys), the key prefix."""
        if isinstance(self.b, PrefixStore):
            return type(self.b.underlying_store).__name__, "pre/"
        return type(self.b).__name__, ""


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]):
    handles = Pair(request.param, tmp_path)
    yield handles
    handles.close()


@pytest.fixture
def master():
    with TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=5)) as store:
        yield store


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 60) -> list[str]:
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs


# --------------------------------------------------------------------------------------------
# The Store API on every kind


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        (b"", b""),
        (bytes(range(256)), bytes(range(256))),
        ("héllo", "héllo".encode()),
        (bytearray(b"ab"), b"ab"),
        (memoryview(b"xyz"), b"xyz"),
    ],
    ids=["empty", "all-bytes", "str-utf8", "bytearray", "memoryview"],
)
def test_set_get_roundtrip_between_handles(pair: Pair, value: object, stored: bytes) -> None:
    pair.a.set("k", value)  # type: ignore[arg-type]
    assert pair.b.get("k") == stored
    pair.b.set("k", b"replaced")
    assert pair.a.get("k") == b"replaced"


def test_keys_may_be_any_unicode(pair: Pair) -> None:
    for key in ["", "a/b/c", "ключ", "k" * (MAX_KEY_BYTES - len("pre/"))]:
        pair.a.set(key, key)
        assert pair.b.get(key) == key.encode()


@pytest.mark.slow
def test_get_times_out_naming_the_key(pair: Pair) -> None:
    pair.b.set_timeout(SHORT)
    start = time.monotonic()
    name, prefix = pair.name_and_prefix()
    with pytest.raises(
        DistStoreError, match=rf"^{name}\.get\('{prefix}missing'\): timeout after 0\.5"
    ):
        pair.b.get("missing")
    assert 0.45 < time.monotonic() - start < 3


def test_get_waits_for_a_later_set(pair: Pair) -> None:
    timer = threading.Timer(0.2, pair.a.set, ("late", b"v"))
    timer.start()
    assert pair.b.get("late") == b"v"
    timer.join()


@pytest.mark.slow
def test_wait_lists_the_missing_keys(pair: Pair) -> None:
    pair.a.set("here", "1")
    name, p = pair.name_and_prefix()
    with pytest.raises(
        DistStoreError,
        match=rf"^{name}\.wait: timeout after 0\.5 s: keys not set: \['{p}gone', '{p}absent'\]\.$",
    ):
        pair.b.wait(["here", "gone", "absent"], SHORT)
    pair.b.wait(["here"], timedelta(0))
    pair.b.wait([])
    timer = threading.Timer(0.1, pair.a.set, ("gone", b""))
    timer.start()
    with pytest.raises(TimeoutError, match=r"keys not set: \['(pre/)?absent'\]"):
        pair.b.wait(["gone", "absent"], timedelta(seconds=0.4))
    timer.join()
    pair.a.set("absent", b"")
    pair.b.wait(["gone", "absent"], SHORT)


def test_add_counts_and_reads_back_as_decimal(pair: Pair) -> None:
    assert pair.a.add("n", 5) == 5
    assert pair.b.add("n", -7) == -2
    assert pair.a.get("n") == b"-2"
    assert pair.b.add("n", 0) == -2
    pair.a.set("m", "41")
    assert pair.b.add("m", 1) == 42
    assert pair.a.add("big", 2**63 - 1) == 2**63 - 1


def test_add_refuses_non_counters_and_overflow(pair: Pair) -> None:
    pair.a.set("text", "abc")
    with pytest.raises(ValueError, match=r"holds b'abc', which is not an integer counter"):
        pair.b.add("text", 1)
    assert pair.a.get("text") == b"abc"
    pair.a.add("top", 2**63 - 1)
    with pytest.raises(ValueError, match=r"would leave the int64 range"):
        pair.b.add("top", 1)
    assert pair.b.get("top") == str(2**63 - 1).encode()


def test_check_delete_and_num_keys(pair: Pair) -> None:
    base = pair.a.num_keys()
    assert not pair.b.check(["x"])
    pair.a.set("x", "1")
    pair.a.add("y", 1)
    assert pair.b.check(["x", "y"])
    assert not pair.b.check(["x", "z"])
    assert pair.b.check([])
    assert pair.b.num_keys() == base + 2
    assert pair.b.delete_key("x")
    assert not pair.a.delete_key("x")
    assert not pair.a.check(["x"])
    assert pair.a.num_keys() == base + 1
    pair.b.set("x", "again")
    assert pair.a.get("x") == b"again"


def test_timeout_property(pair: Pair) -> None:
    assert pair.a.timeout == timedelta(seconds=5)
    pair.a.set_timeout(timedelta(seconds=2))
    assert pair.a.timeout == timedelta(seconds=2)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda s: s.set(1, b"v"), TypeError, r"key must be a str, got int 1"),
        (lambda s: s.set("k", 3), TypeError, r"value must be bytes or str, got int 3"),
        (lambda s: s.get(b"k"), TypeError, r"key must be a str, got bytes"),
        (lambda s: s.add("k", 1.5), TypeError, r"amount must be an int, got float 1\.5"),
        (lambda s: s.add("k", True), TypeError, r"amount must be an int, got bool"),
        (lambda s: s.add("k", 2**63), ValueError, r"amount must fit in a signed 64-bit"),
        # torch's binding raises TypeError there: ours is both
        (lambda s: s.add("k", -(2**63) - 1), TypeError, r"amount must fit in a signed 64-bit"),
        (lambda s: s.wait("k"), TypeError, r"keys must be a list of str.*\['k'\]"),
        (lambda s: s.wait([1]), TypeError, r"keys\[0\] must be a str"),
        (lambda s: s.check(["k"] * (MAX_WAIT_KEYS + 1)), ValueError, r"at most 1024 keys"),
        (lambda s: s.wait(["k"], "5"), TypeError, r"timeout must be a datetime\.timedelta or a"),
        (lambda s: s.wait(["k"], timedelta(seconds=-1)), ValueError, r"timeout must be at least 0"),
        (lambda s: s.set_timeout(timedelta(0)), ValueError, r"timeout must be more than 0"),
        (lambda s: s.queue_pop("q", 1), TypeError, r"block must be a bool, got int 1"),
        (lambda s: s.multi_set(["a"], []), ValueError, r"one value per key: 1 keys, 0 values"),
        (lambda s: s.compare_set("k", 1, b""), TypeError, r"expected_value must be bytes or str"),
        (lambda s: s.set("k" * (MAX_KEY_BYTES + 1), b""), ValueError, r"keys are limited to 4096"),
        (
            lambda s: s.set("é" * 2049, b""),
            ValueError,
            r"'(pre/)?é+'\.\.\. is 4\d\d\d bytes long in UTF-8",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_arguments_raise_before_any_change(pair: Pair, call, error, message) -> None:
    before = pair.a.num_keys()
    with pytest.raises(error, match=message):
        call(pair.b)
    assert pair.a.num_keys() == before
    assert pair.a.timeout == timedelta(seconds=5)


def test_value_size_bound() -> None:
    store = _NullStore()
    with pytest.raises(ValueError, match=r"limited to 67108864 bytes"):
        store.set("k", bytes(MAX_VALUE_BYTES + 1))
    store.set("k", bytes(MAX_VALUE_BYTES))
    assert store.calls == ["set"]


class _NullStore(Store):
    """Records primitive calls: checks must stop bad input before any of them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def _set(self, key: str, value: bytes) -> None:
        self.calls.append("set")

    def _get(self, key: str, seconds: float) -> bytes:
        self.calls.append("get")
        return b""

    def _add(self, key: str, amount: int) -> int:
        self.calls.append("add")
        return 0

    def _wait(self, keys: list[str], seconds: float) -> None:
        self.calls.append("wait")

    def _check(self, keys: list[str]) -> bool:
        self.calls.append("check")
        return True

    def _delete(self, key: str) -> bool:
        self.calls.append("delete")
        return False

    def _num_keys(self) -> int:
        return 0

    def close(self) -> None:
        self.calls.append("close")


def test_large_values_cross_tcp(master: TCPStore) -> None:
    value = os.urandom(3 * 2**20 + 7)  # bigger than socket buffers: partial sends and reads
    with TCPStore(HOST, master.port) as client:
        client.set("big", value)
        assert master.get("big") == value
        assert client.get("big") == value


def test_closed_stores_refuse_calls(tmp_path: os.PathLike[str]) -> None:
    tcp = TCPStore(HOST, 0, is_master=True)
    tcp.close()
    tcp.close()
    with pytest.raises(ValueError, match=r"TCPStore\(127\.0\.0\.1:\d+\) is closed"):
        tcp.get("k")
    file = FileStore(os.path.join(tmp_path, "s"))
    file.close()
    with pytest.raises(ValueError, match=r"FileStore\('.*s'\) is closed"):
        file.set("k", "v")


# --------------------------------------------------------------------------------------------
# PrefixStore


def test_prefix_stores_are_isolated(master: TCPStore) -> None:
    first, second = PrefixStore("g1", master), PrefixStore("g2", master)
    first.set("k", "one")
    second.set("k", "two")
    assert (first.get("k"), second.get("k")) == (b"one", b"two")
    assert master.get("g1/k") == b"one"
    assert master.get("g2/k") == b"two"
    assert not master.check(["k"])
    assert first.add("n", 3) == 3
    assert not second.check(["n"])
    assert second.delete_key("k")
    assert first.get("k") == b"one"
    nested = PrefixStore("sub", first)
    nested.set("k", "deep")
    assert master.get("g1/sub/k") == b"deep"
    with pytest.raises(TimeoutError, match=r"TCPStore\.wait: .* keys not set: \['g1/sub/x'\]\."):
        nested.wait(["k", "x"], timedelta(seconds=0.2))
    assert nested.underlying_store is first
    assert nested.prefix == "sub"
    nested.close()
    master.set("open", "still")  # closing a view leaves the store open


def test_prefix_store_checks_its_arguments(master: TCPStore) -> None:
    with pytest.raises(TypeError, match=r"prefix must be a str, got int"):
        PrefixStore(1, master)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"store must be a cupy_parallel Store.*got dict"):
        PrefixStore("p", {})  # type: ignore[arg-type]


@pytest.mark.slow
def test_prefix_store_shares_the_timeout(master: TCPStore) -> None:
    view = PrefixStore("p", master)
    view.set_timeout(SHORT)
    assert master.timeout == SHORT
    with pytest.raises(TimeoutError, match=r"TCPStore\.get\('p/k'\): timeout after 0\.5 s"):
        view.get("k")


# --------------------------------------------------------------------------------------------
# Across processes

_ADDER = """
import json, sys
from datetime import timedelta
from cupy_parallel._src.distributed.store import FileStore, TCPStore
kind, where, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "tcp":
    store = TCPStore("127.0.0.1", int(where), timeout=timedelta(seconds=30))
else:
    store = FileStore(where, timeout=timedelta(seconds=30))
store.get("go")
print(json.dumps([store.add("counter", 1) for _ in range(n)]))
store.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_add_is_atomic_across_processes(kind: str, tmp_path: os.PathLike[str]) -> None:
    procs_n, adds = 4, 200
    if kind == "tcp":
        store: Store = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=30))
        where = str(store.port)  # type: ignore[attr-defined]
    else:
        where = os.path.join(tmp_path, "store")
        store = FileStore(where, timeout=timedelta(seconds=30))
    with store:
        procs = [_python(_ADDER, kind, where, str(adds)) for _ in range(procs_n)]
        store.set("go", "1")  # every process starts adding at about the same time
        seen = [value for out in _finish(procs) for value in json.loads(out)]
        assert store.get("counter") == str(procs_n * adds).encode()
    # every intermediate value was handed out exactly once: no lost or doubled increment
    assert sorted(seen) == list(range(1, procs_n * adds + 1))


_WORKER = """
import sys
from datetime import timedelta
from cupy_parallel._src.distributed.store import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), world_size=3, timeout=timedelta(seconds=30))
store.set(f"from-{sys.argv[2]}", sys.argv[2])
print(store.get("from-master").decode())
"""


def test_master_waits_for_workers() -> None:
    port = _free_port()
    procs = [_python(_WORKER, str(port), str(i)) for i in range(2)]
    with TCPStore(HOST, port, world_size=3, is_master=True, timeout=timedelta(seconds=30)) as m:
        m.wait(["from-0", "from-1"])
        m.set("from-master", "hello")
        assert _finish(procs) == ["hello\n", "hello\n"]
        assert m.get("from-1") == b"1"


@pytest.mark.slow
def test_master_times_out_waiting_for_workers_and_stops_serving() -> None:
    port = _free_port()
    with pytest.raises(
        DistStoreError,
        match=r"^TCPStore master: timeout after 0\.5 s waiting for workers: 1 of 2 joined\.$",
    ):
        TCPStore(HOST, port, world_size=2, is_master=True, timeout=SHORT)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=2).close()


@pytest.mark.slow
def test_client_times_out_without_a_server() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(
        DistNetworkError,
        match=rf"^could not connect to the TCPStore at 127\.0\.0\.1:{port} within 0\.5 s",
    ):
        TCPStore(HOST, port, timeout=SHORT)
    assert time.monotonic() - start < 3


def test_client_retries_until_the_master_appears() -> None:
    port = _free_port()
    result: list[bytes] = []

    def client() -> None:
        with TCPStore(HOST, port, timeout=timedelta(seconds=10)) as store:
            result.append(store.get("k"))

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(0.3)
    with TCPStore(HOST, port, is_master=True) as store:
        store.set("k", "v")
        thread.join(10)
    assert result == [b"v"]


def test_tcp_store_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match=r"host_name must be a non-empty str"):
        TCPStore("", 1)
    with pytest.raises(TypeError, match=r"port must be an int, got str"):
        TCPStore(HOST, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"port must be in \[0, 65535\], got 70000"):
        TCPStore(HOST, 70000)
    with pytest.raises(ValueError, match=r"port=0 lets the master pick a port"):
        TCPStore(HOST, 0)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        TCPStore(HOST, 1, world_size=0)
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta or a number"):
        TCPStore(HOST, 0, is_master=True, timeout="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"is_master must be a bool, got int 1"):
        TCPStore(HOST, 0, is_master=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.5", "127.0.0.5"),  # a specific address: only that one (was 0.0.0.0)
        ("::1", "::1"),
        ("localhost", ("127.0.0.1", "::1")),  # a name resolving to loopback stays there
        ("0.0.0.0", "0.0.0.0"),  # every interface only when asked for
    ],
)
def test_the_server_binds_exactly_what_was_asked(host: str, address: str | tuple[str]) -> None:
    try:
        sock = listen(host, 0)
    except DistNetworkError as exc:  # e.g. no IPv6 on this machine
        pytest.skip(str(exc))
    with sock:
        bound = sock.getsockname()[0]
    assert bound in (address if isinstance(address, tuple) else (address,))


def test_port_in_use_is_reported(master: TCPStore) -> None:
    with pytest.raises(DistNetworkError, match=rf"could not listen on 127\.0\.0\.1:{master.port}"):
        TCPStore(HOST, master.port, is_master=True)


def test_clients_see_the_master_closing(master: TCPStore) -> None:
    client = TCPStore(HOST, master.port)
    client.set("k", "v")
    master.close()
    with pytest.raises(ConnectionError, match=r"lost the connection to the TCPStore server"):
        client.get("k")
    client.close()


def test_a_parked_get_does_not_block_other_clients(master: TCPStore) -> None:
    waiting = TCPStore(HOST, master.port, timeout=timedelta(seconds=10))
    other = TCPStore(HOST, master.port)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(waiting.get("late")))
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    for i in range(50):
        other.set(f"k{i}", str(i))
        assert master.get(f"k{i}") == str(i).encode()
    assert time.monotonic() - start < 2
    assert thread.is_alive()
    other.set("late", "now")
    thread.join(5)
    assert got == [b"now"]
    waiting.close()
    other.close()


def test_closing_wakes_a_thread_blocked_in_get(master: TCPStore) -> None:
    client = TCPStore(HOST, master.port, timeout=timedelta(seconds=60))
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            client.get("never")
        except (ConnectionError, ValueError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    client.close()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - start < 2
    assert len(errors) == 1


_EXITING_MASTER = """
import threading
from datetime import timedelta
from cupy_parallel._src.distributed.store import TCPStore
master = TCPStore("127.0.0.1", 0, is_master=True)
client = TCPStore("127.0.0.1", master.port, timeout=timedelta(seconds=300))
threading.Thread(target=client.get, args=("never",), daemon=True).start()
print(master.port, flush=True)
"""


def test_server_thread_does_not_block_exit() -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _EXITING_MASTER],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 10
    port = int(proc.stdout)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=2).close()


# --------------------------------------------------------------------------------------------
# The wire protocol


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _raw_call(sock: socket.socket, body: bytes) -> bytes:
    sock.sendall(_frame(body))
    header = _recv_exact(sock, 4)
    return _recv_exact(sock, struct.unpack(">I", header)[0])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "server closed the connection"
        data += chunk
    return data


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_documented_protocol_by_hand(master: TCPStore) -> None:
    with socket.create_connection((HOST, master.port), timeout=5) as sock:
        assert _raw_call(sock, b"\x01" + _blob(b"key") + _blob(b"value")) == b"\x00"  # SET -> OK
        assert _raw_call(sock, b"\x02" + _blob(b"key") + struct.pack(">Q", 0)) == b"\x01value"
        assert _raw_call(sock, b"\x03" + _blob(b"n") + struct.pack(">q", 7)) == b"\x02" + (
            struct.pack(">q", 7)
        )
        missing = _raw_call(sock, b"\x04" + struct.pack(">I", 1) + _blob(b"no") + bytes(8))
        assert missing == b"\x03" + struct.pack(">I", 1) + _blob(b"no")  # TIMEOUT, missing keys
        assert _raw_call(sock, b"\x07") == b"\x02" + struct.pack(">q", 2)  # NUM_KEYS
    assert master.get("key") == b"value"


def test_huge_timeouts_are_capped(master: TCPStore) -> None:
    forever = struct.pack(">Q", 2**64 - 1)
    with (
        socket.create_connection((HOST, master.port), timeout=5) as get,
        socket.create_connection((HOST, master.port), timeout=5) as joined,
    ):
        get.sendall(_frame(b"\x02" + _blob(b"later") + forever))  # GET, parked "forever"
        joined.sendall(_frame(b"\x09" + struct.pack(">q", 2**62) + forever))  # WAIT_JOINED
        time.sleep(0.1)
        with TCPStore(HOST, master.port) as client:
            client.set("later", "here")
        assert _recv_exact(get, 9) == struct.pack(">I", 5) + b"\x01here"


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack(">I", 2**31),  # length header far over the bound
        struct.pack(">I", 0),  # empty frame
        _frame(b"\xff"),  # unknown opcode
        _frame(b"\x01" + struct.pack(">I", MAX_KEY_BYTES + 1)),  # key over its bound
        _frame(b"\x01" + _blob(b"k") + _blob(b"v") + b"junk"),  # trailing bytes
        _frame(b"\x02" + _blob(b"k")),  # GET without its timeout
        _frame(b"\x04" + struct.pack(">I", MAX_WAIT_KEYS + 1)),  # too many keys
        _frame(b"\x07\x00"),  # NUM_KEYS takes no fields
    ],
    ids=["huge-length", "empty", "opcode", "key-bound", "trailing", "short", "many-keys", "extra"],
)
def test_malformed_messages_close_only_their_connection(master: TCPStore, payload: bytes) -> None:
    with (
        socket.create_connection((HOST, master.port), timeout=5) as good,
        socket.create_connection((HOST, master.port), timeout=5) as bad,
    ):
        bad.sendall(payload)
        assert _closed_by_server(bad)
        assert _raw_call(good, b"\x01" + _blob(b"alive") + _blob(b"yes")) == b"\x00"
    assert master.get("alive") == b"yes"
    assert master.get("alive") == b"yes"


@pytest.fixture(scope="module")
def fuzz_master():
    with TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=5)) as store:
        yield store


_garbage = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda length, body: struct.pack(">I", length) + body,
        st.integers(0, 2**32 - 1),
        st.binary(max_size=64),
    ),
    st.builds(
        lambda op, body: _frame(bytes([op]) + body),
        st.integers(0, 12),
        st.binary(max_size=64),
    ),
)


@given(garbage=_garbage)
def test_fuzzed_bytes_never_break_the_server(fuzz_master: TCPStore, garbage: bytes) -> None:
    with socket.create_connection((HOST, fuzz_master.port), timeout=5) as raw:
        raw.sendall(garbage)
    with TCPStore(HOST, fuzz_master.port, timeout=timedelta(seconds=2)) as client:
        client.set("probe", garbage[:16])
        assert fuzz_master.get("probe") == garbage[:16]


# --------------------------------------------------------------------------------------------
# FileStore specifics


def test_file_store_removes_its_file_after_world_size_closes(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    first = FileStore(path, 2)
    first.set("k", "v")
    first.close()
    assert os.path.exists(path)  # one of two users finished
    with FileStore(path, 2) as second:
        assert second.get("k") == b"v"
    assert not os.path.exists(path)


def test_file_store_with_unknown_world_size_keeps_its_file(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    with FileStore(path) as store:
        store.set("k", "v")
    with FileStore(path) as again:
        assert again.get("k") == b"v"
        assert again.num_keys() == 1
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_file_store_checks_its_arguments(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(TypeError, match=r"file_name must be a str path, got int"):
        FileStore(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"world_size must be -1 \(unknown\) or >= 1, got 0"):
        FileStore(os.path.join(tmp_path, "s"), 0)
    with pytest.raises(ValueError, match=r"directory '.*nowhere' does not exist"):
        FileStore(os.path.join(tmp_path, "nowhere", "s"))
    foreign = os.path.join(tmp_path, "foreign")
    with open(foreign, "w") as f:
        f.write("not a store")
    with pytest.raises(ValueError, match=r"is not a FileStore file"):
        FileStore(foreign)
    with open(foreign) as f:
        assert f.read() == "not a store"


def test_a_returned_set_is_seen_by_every_other_handle(master: TCPStore) -> None:
    """set() waits for the server (torch's does not): no stale read on another connection."""
    with TCPStore(HOST, master.port) as client:
        for i in range(200):
            client.set("latest", str(i))
            assert master.get("latest") == str(i).encode()


# --------------------------------------------------------------------------------------------
# confirm_sets=False: torch's set (returns once sent); the answers are read later, never dropped


@given(
    steps=st.lists(
        st.tuples(st.sampled_from(["set", "get", "add", "check"]), st.integers(0, 3)),
        max_size=40,
    )
)
def test_posted_sets_apply_in_order_like_a_dict(fuzz_master: TCPStore, steps: list) -> None:
    # Oracle: a dict. The posting store's own later calls see every set it posted.
    model: dict[str, bytes] = {}
    with TCPStore(HOST, fuzz_master.port, confirm_sets=False) as store:
        prefix = f"posted/{time.monotonic_ns()}/"
        for index, (operation, k) in enumerate(steps):
            key = f"{prefix}{k}"
            if operation == "set":
                model[key] = str(index).encode()
                store.set(key, str(index))
            elif operation == "get" and key in model:
                assert store.get(key) == model[key]
            elif operation == "add" and (key not in model or model[key].isdigit()):
                model[key] = str(int(model.get(key, b"0")) + index).encode()
                assert store.add(key, index) == int(model[key])
            elif operation == "check":
                assert store.check([key]) == (key in model)
        keys = sorted(model)
    if keys:  # close() read every answer; another connection sees the final state
        assert fuzz_master.multi_get(keys) == [model[key] for key in keys]


def test_posted_sets_are_seen_by_others_after_any_later_call(master: TCPStore) -> None:
    with TCPStore(HOST, master.port, confirm_sets=False) as client:
        for i in range(200):
            client.set("latest", str(i))
            assert client.check(["latest"])  # a round trip: the set was applied before it
            assert master.get("latest") == str(i).encode()


def test_posted_sets_beyond_the_bound_and_close_lose_nothing(master: TCPStore) -> None:
    # 3,000 sets: their answers are read 1,024 at a time while posting, the rest by close().
    client = TCPStore(HOST, master.port, confirm_sets=False)
    keys = [f"many/{i}" for i in range(3000)]
    for i, key in enumerate(keys):
        client.set(key, str(i))
    client.close()
    for start in range(0, 3000, 1000):  # multi_get names at most 1,024 keys
        chunk = keys[start : start + 1000]
        assert master.multi_get(chunk) == [str(i).encode() for i in range(start, start + 1000)]


class _FakeServer:
    """A listening socket whose one connection gets ``answer(frame_body)`` per request frame.

    ``answer`` returns the reply frame's bytes, ``None`` to stay silent, or ``b""`` to close.
    """

    def __init__(self, answer) -> None:
        self._listener = listen(HOST, 0)
        self.port = self._listener.getsockname()[1]
        self._answer = answer
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            while True:
                header = conn.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    return
                body = _recv_exact(conn, struct.unpack(">I", header)[0])
                reply = self._answer(body)
                if reply == b"":
                    return
                if reply is not None:
                    conn.sendall(reply)

    def close(self) -> None:
        self._listener.close()


def _error_frame(message: str) -> bytes:
    return _frame(bytes([4]) + message.encode())  # Status.ERROR, then the message


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        pytest.param(
            lambda body: None,
            DistStoreError,
            r"did not confirm 2 set\(\) calls \(keys 'a', 'b'\) by GET \(timeout\); their "
            r"values may be lost",
            id="silent",
        ),
        pytest.param(
            lambda body: b"",
            DistNetworkError,
            r"during GET .*2 set\(\) calls \(keys 'a', 'b'\) sent before were not confirmed "
            r"and may be lost",
            id="closes",
        ),
        pytest.param(
            lambda body: _error_frame("disk full"),
            ValueError,
            r"^2 set\(\) calls \(keys 'a', 'b'\) failed on the TCPStore server at "
            r"127\.0\.0\.1:\d+: disk full$",
            id="refuses",
        ),
    ],
)
@pytest.mark.slow
def test_an_unconfirmed_posted_set_fails_the_next_call(answer, error, message) -> None:
    server = _FakeServer(answer)
    try:
        store = TCPStore(HOST, server.port, timeout=SHORT, confirm_sets=False)
        store.set("a", b"1")  # returns at once: nothing is read yet
        store.set("b", b"2")
        with pytest.raises(error, match=message):
            store.get("a")
        store.close()
    finally:
        server.close()


@pytest.mark.slow
def test_close_raises_for_a_posted_set_never_confirmed() -> None:
    server = _FakeServer(lambda body: None)
    try:
        store = TCPStore(HOST, server.port, timeout=SHORT, confirm_sets=False)
        store.set("k", b"v")
        with pytest.raises(DistStoreError, match=r"did not confirm set\('k'\) by close"):
            store.close()
        with pytest.raises(ValueError, match=r"is closed"):
            store.get("k")  # closed all the same
    finally:
        server.close()


def test_confirm_sets_is_checked_and_cloned(master: TCPStore) -> None:
    with pytest.raises(TypeError, match=r"confirm_sets must be a bool"):
        TCPStore(HOST, master.port, confirm_sets="no")  # type: ignore[arg-type]
    with TCPStore(HOST, master.port, confirm_sets=False) as posting, posting.clone() as twin:
        assert (posting._confirm_sets, twin._confirm_sets) == (False, False)


@pytest.mark.slow
def test_multi_get_refuses_an_answer_over_the_bound(master: TCPStore) -> None:
    big = bytes(MAX_VALUE_BYTES // 2 + 1)
    master.multi_set(["b1"], [big])
    master.multi_set(["b2"], [big])
    with pytest.raises(ValueError, match=r"multi_get would return 67108866 bytes; one call"):
        master.multi_get(["b1", "b2"])
    assert master.multi_get(["b1"]) == [big]
