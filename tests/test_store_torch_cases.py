"""The cases of PyTorch's ``test/distributed/test_store.py``, as our own tests.

Each test names the torch case it covers. Where torch compares a message text, we compare our
own message; exception *types* are torch's (``DistStoreError``/``DistNetworkError`` are
``RuntimeError``s, ``NotImplementedError`` is one too, rendezvous raises torch's
``RuntimeError``/``AssertionError`` as subclasses of ``ValueError``).

Cases that do not apply, and why:

- ``test_init_pg_and_rpc_with_same_file`` / ``..._same_socket``: we have no RPC framework.
- ``PythonStoreTest.test_set_get`` runs torch's C++ trampoline (``_test_python_store``); we
  have no C++ side, so :func:`test_a_subclass_that_overrides_the_public_methods` checks the
  same user store through ``PrefixStore`` and ``rendezvous``-level helpers instead.
- ``num_keys`` totals: torch's TCPStore counts one extra key of its own (6 instead of 5); ours
  counts only user keys (documented in the store package), so every kind expects 5 here.
- ``rendezvous`` returns a generator in torch (``next(gen)``); ours returns the tuple (it is
  internal; ``init_process_group`` is the public entry). Torch raises ``AssertionError`` when
  rank/world_size appear in the URL *and* as arguments even if equal; we raise only when they
  conflict (equal values are not ambiguous).
- ``test_dns_timeout``: the type is torch's (``DistNetworkError``, a ``DistError``); the text
  is ours (it names the host, not "client socket has timed out").
- libuv/non-libuv variants (``LibUvTCPStoreTest``, ``test_tcp_store_url_with_libuv``,
  ``InitPgWithNonUvStore``, ``libuvBackend``): there is one server implementation here.
- ``test_repr``: torch's repr shows its C++ socket objects; ours is ``TCPStore(host, port,
  is_master=...)``.
- ``test_agent_store`` (``TORCHELASTIC_USE_AGENT_STORE``): we have no elastic agent.
- ``test_underlying_non_prefix_store`` tests a private torch attribute.
- ``test_get_underlying_store`` also expects ``PrefixStore("prefix", None)`` to raise
  ``ValueError``; ours raises ``ArgumentError``, a ``TypeError`` (a wrong type, by the
  project's rules) that is also a ``ValueError``.
- Message texts such as "wait timeout after 100ms, keys: /k" are torch's; ours say
  "timeout after 0.1 s" and name the keys (pinned in the tests below and in test_store.py).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import pytest

from cupy_parallel._src.distributed.rendezvous import rendezvous
from cupy_parallel.distributed import (
    DistNetworkError,
    DistStoreError,
    FileStore,
    HashStore,
    PrefixStore,
    QueueEmptyError,
    Store,
    TCPStore,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

HOST = "127.0.0.1"
KINDS = ["file", "hash", "tcp", "prefix-file", "prefix-tcp"]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Store]:
    kind = request.param
    if kind.endswith("file"):
        base: Store = FileStore(os.path.join(tmp_path, "store"), 1)
    elif kind.endswith("tcp"):
        base = TCPStore(HOST, 0, world_size=1, is_master=True)
    else:
        base = HashStore()
    base.set_timeout(timedelta(seconds=300))
    yield PrefixStore("test_prefix", base) if kind.startswith("prefix") else base
    base.close()


# --------------------------------------------------------------------------------------------
# StoreTestBase, for every kind


def test_set_get(store: Store) -> None:
    """torch: StoreTestBase.test_set_get."""
    for amount in (1, 2, 3):
        store.add("key", amount)
    store.set("key0", "value0")
    for amount, key in [(1, "key3"), (2, "key3")]:
        store.add(key, amount)
    store.set("key1", "value1")
    store.set("key2", "value2")
    for amount in (3, 4, 5, 6):
        store.add("key3", amount)
    assert store.num_keys() == 5
    assert [store.get(k) for k in ("key", "key0", "key1", "key2", "key3")] == [
        b"6",
        b"value0",
        b"value1",
        b"value2",
        b"21",
    ]
    store.set("-key3", "7")
    assert store.get("-key3") == b"7"
    assert store.delete_key("-key3")
    assert store.num_keys() == 5


def test_compare_set(store: Store) -> None:
    """torch: StoreTestBase.test_compare_set."""
    assert store.compare_set("cs0", "expected", "new0") == b"expected"  # missing: unchanged
    assert not store.check(["cs0"])
    store.set("cs0", "value0")
    assert store.compare_set("cs0", "wrong", "new0") == b"value0"
    assert store.get("cs0") == b"value0"
    assert store.compare_set("cs0", "value0", "new0") == b"new0"
    assert store.get("cs0") == b"new0"
    assert store.compare_set("cs1", "", "new1") == b"new1"  # missing counts as empty
    assert store.get("cs1") == b"new1"


def test_simple_wait(store: Store) -> None:
    """torch: StoreTestBase.test_simple_wait (a RuntimeError naming the timeout)."""
    with pytest.raises(RuntimeError, match=r"timeout after 0\.25 s"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])


def test_append(store: Store) -> None:
    """torch: test_append (creates the key, then extends it)."""
    store.append("a", "po")
    store.append("a", b"tato")
    assert store.get("a") == b"potato"


def test_multi_set_and_multi_get(store: Store) -> None:
    """torch: test_multi_set / test_multi_get."""
    store.multi_set(["m1", "m2", "m3"], ["v1", b"v2", "v3"])
    assert store.multi_get(["m3", "m1", "m2"]) == [b"v3", b"v1", b"v2"]
    assert store.multi_get([]) == []
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(DistStoreError, match=r"multi_get: timeout after 0\.2 s: keys not set"):
        store.multi_get(["m1", "nope"])


def test_check(store: Store) -> None:
    """torch: test_check."""
    store.set("k1", "v")
    assert store.check(["k1"])
    assert not store.check(["k1", "k2"])
    store.set("k2", "v")
    assert store.check(["k1", "k2"])


def test_queues(store: Store) -> None:
    """torch: test_queues, test_queues_nonblocking, test_queues_timeout."""
    assert not store.check(["q"])
    assert store.queue_len("q") == 0
    store.queue_push("q", "1")
    store.queue_push("q", b"2")
    assert store.check(["q"])  # check and wait see a non-empty queue, as in torch
    store.wait(["q"])
    assert store.queue_len("q") == 2
    assert store.queue_pop("q") == b"1"
    assert store.queue_pop("q", block=False) == b"2"
    assert not store.check(["q"])
    with pytest.raises(QueueEmptyError, match=r"queue_pop\('(test_prefix/)?q', block=False\)"):
        store.queue_pop("q", block=False)
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(DistStoreError, match=r"timeout after 0\.2 s: the queue stayed empty"):
        store.queue_pop("q")


def test_queue_pop_waits_for_a_push(store: Store) -> None:
    """torch: test_queues (a blocked pop is released by a push from another handle)."""
    other = store.clone()
    timer = threading.Timer(0.1, other.queue_push, ("jobs", "job"))
    timer.start()
    assert store.queue_pop("jobs") == b"job"
    timer.join()
    assert store.queue_len("jobs") == 0
    if not isinstance(other, HashStore | PrefixStore):
        other.close()


def test_queues_bidirectional(store: Store) -> None:
    """torch: test_queues_bidirectional (two threads, each with a clone, exchange values)."""
    store.set_timeout(timedelta(seconds=10))
    got: dict[str, bytes] = {}

    def worker_a() -> None:
        mine = store.clone()
        mine.queue_push("a", "a1")
        got["a"] = mine.queue_pop("b")

    def worker_b() -> None:
        mine = store.clone()
        got["b"] = mine.queue_pop("a")
        mine.queue_push("b", "b1")

    threads = [threading.Thread(target=worker_a), threading.Thread(target=worker_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert got == {"a": b"b1", "b": b"a1"}


def test_a_wait_for_a_queue_is_released_by_a_push(store: Store) -> None:
    """torch: test_queues (wait on a queue key), from another handle."""
    twin = store.clone()
    timer = threading.Timer(0.1, twin.queue_push, ("later", "x"))
    timer.start()
    store.wait(["later"], timedelta(seconds=10))
    timer.join()
    assert store.queue_pop("later") == b"x"


def test_clone(store: Store) -> None:
    """torch: test_clone (a new handle sees the same keys and is usable from a thread)."""
    twin = store.clone()
    store.set("shared", "yes")
    seen: list[bytes] = []
    thread = threading.Thread(target=lambda: seen.append(twin.get("shared")))
    thread.start()
    thread.join(10)
    assert seen == [b"yes"]
    assert store.has_extended_api()
    assert twin.has_extended_api()


def test_wait_across_threads(store: Store) -> None:
    """torch: TestMultiThreadedWait.test_wait (two threads, one waits for the other's set)."""
    store.set_timeout(timedelta(seconds=2))
    twin = store.clone()
    setter = threading.Timer(0.1, twin.set, ("key1", "value1"))
    setter.start()
    store.wait(["key1"])
    assert store.get("key1") == b"value1"
    setter.join()


# --------------------------------------------------------------------------------------------
# TCPStore


@pytest.mark.slow
def test_numkeys_delkeys() -> None:
    """torch: TCPStoreTest.test_numkeys_delkeys (without torch's extra bookkeeping key)."""
    with TCPStore(HOST, 0, world_size=1, is_master=True) as store:
        assert store.num_keys() == 0
        for amount in (1, 2, 3):
            store.add("key", amount)
        store.set("key0", "value0")
        store.add("key3", 1)
        store.set("key1", "value1")
        assert store.num_keys() == 4
        store.delete_key("key")
        assert store.num_keys() == 3
        store.set_timeout(timedelta(seconds=2))
        with pytest.raises(RuntimeError):
            store.get("key")
        store.delete_key("key0")
        store.delete_key("key3")
        assert store.num_keys() == 1
        store.set("key4", "value2")
        assert store.num_keys() == 2
        assert (store.get("key1"), store.get("key4")) == (b"value1", b"value2")


def test_address_already_in_use() -> None:
    """torch: TCPStoreTest.test_address_already_in_use."""
    with (
        TCPStore(HOST, 0, 1, True) as first,
        pytest.raises(DistNetworkError, match=r"could not listen"),
    ):
        TCPStore(HOST, first.port, 1, True)


def test_take_over_listen_socket() -> None:
    """torch: TCPStoreTest.test_take_over_listen_socket (master_listen_fd)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    port = listener.getsockname()[1]
    with TCPStore(HOST, port, 1, is_master=True, master_listen_fd=listener.detach()) as store:
        store.set("key", "value")
        assert store.get("key") == b"value"


@pytest.mark.slow
def test_store_timeout_on_missing_clients() -> None:
    """torch: TCPStoreTest.test_store_timeout_on_missing_clients."""
    with pytest.raises(DistStoreError, match=r"timeout after 0\.5 s waiting for workers: 1 of 2"):
        TCPStore("localhost", 0, 2, True, timeout=0.5)
    TCPStore("localhost", 0, 2, True, timeout=0.5, wait_for_workers=False).close()


def test_world_size_0_raises() -> None:
    """torch: TCPStoreTest.test_world_size_0_raises."""
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        TCPStore("localhost", 0, world_size=0, is_master=False)


@pytest.mark.slow
def test_interrupt_doesnt_break_wait() -> None:
    """torch: TimeoutTest.test_interrupt_doesnt_break_wait (a signal hits the waiting thread)."""
    with TCPStore(HOST, 0, 2, True, wait_for_workers=False) as rank0:
        rank1 = TCPStore(HOST, rank0.port, 2, wait_for_workers=False)
        result: list[object] = []

        def wait() -> None:
            try:
                rank1.wait(["foo"], timedelta(seconds=10))
                result.append(True)
            except Exception as exc:  # noqa: BLE001 - recorded, asserted below
                result.append(exc)

        previous = signal.signal(signal.SIGUSR1, lambda *_: None)
        try:
            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(0.3)
            signal.pthread_kill(thread.ident, signal.SIGUSR1)  # type: ignore[arg-type]
            time.sleep(0.3)
            rank0.set("foo", "bar")
            thread.join(10)
        finally:
            signal.signal(signal.SIGUSR1, previous)
        rank1.close()
    assert result == [True]


def test_multitenancy() -> None:
    """torch: TCPStoreTest.test_multitenancy (two masters in one process share the server)."""
    first = TCPStore(HOST, 0, 1, True, multi_tenant=True)
    second = TCPStore(HOST, first.port, 1, True, multi_tenant=True)
    first.set("k", "v")
    assert second.get("k") == b"v"
    first.close()
    assert second.get("k") == b"v"  # the server lives while one tenant does
    second.close()


@pytest.mark.parametrize("world_size", [5, None], ids=["fixed", "nonfixed"])
def test_multi_worker(world_size: int | None) -> None:
    """torch: test_multi_worker_with_fixed_world_size / ..._nonfixed_world_size."""
    with TCPStore(HOST, 0, world_size, True, wait_for_workers=False) as server:
        server.set("key", "value")
        for index in range(world_size or 1):
            with TCPStore(HOST, server.port, world_size, timeout=10) as client:
                assert client.get("key") == b"value"
                client.set(f"new_key{index}", f"new_value{index}")
                assert (
                    client.compare_set(f"new_key{index}", f"new_value{index}", f"next_value{index}")
                    == f"next_value{index}".encode()
                )


# --------------------------------------------------------------------------------------------
# FileStore, HashStore, PrefixStore


def test_file_store_refcount(tmp_path: os.PathLike[str]) -> None:
    """torch: FileStoreTest.test_refcount."""
    path = os.path.join(tmp_path, "store")
    first, second = FileStore(path, 1), FileStore(path, 1)
    del first
    assert os.path.exists(path)
    del second
    assert not os.path.exists(path)


def test_get_underlying_store(tmp_path: os.PathLike[str]) -> None:
    """torch: PrefixStoreTest.test_get_underlying_store."""
    stores = [
        TCPStore("localhost", 0, 1, True),
        HashStore(),
        FileStore(os.path.join(tmp_path, "s"), 1),
    ]
    for base in stores:
        assert PrefixStore("prefix", base).underlying_store is base
        base.close()


# --------------------------------------------------------------------------------------------
# Python subclasses of Store


class _PythonStore(Store):
    """torch's MyPythonStore: overrides only set/get/add, the public methods."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes | str) -> None:
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key: str) -> bytes:
        return self.data.get(key, b"")

    def add(self, key: str, amount: int) -> int:
        new = int(self.data.get(key, b"0")) + amount
        self.set(key, str(new))
        return new


def test_a_subclass_that_overrides_the_public_methods() -> None:
    """torch: PythonStoreTest.test_set_get (here through PrefixStore, which calls them)."""
    base = _PythonStore()
    view = PrefixStore("p", base)
    view.set("key0", "value0")
    assert view.add("key", 1) == 1
    assert view.add("key", 2) == 3
    assert view.get("key0") == b"value0"
    assert base.data == {"p/key0": b"value0", "p/key": b"3"}
    assert not view.has_extended_api()


class _DummyStore(Store):
    """torch's DummyStore: records extended-API calls."""

    def __init__(self) -> None:
        self.appends: list[tuple[str, bytes | str]] = []
        self.multi_sets: list[tuple[list[str], list[bytes | str]]] = []
        self.multi_gets: list[list[str]] = []
        self.results = [[b"x", b"y"]]
        super().__init__()

    def append(self, key: str, value: bytes | str) -> None:
        self.appends.append((key, value))

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        self.multi_gets.append(keys)
        return self.results.pop(0)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:  # type: ignore[override]
        self.multi_sets.append((keys, values))

    def has_extended_api(self) -> bool:
        return True


@pytest.mark.parametrize("through_prefix", [False, True], ids=["direct", "prefix"])
def test_optional_methods_fail(through_prefix: bool) -> None:
    """torch: test_optional_methods_fail / test_has_extended_api_passthrough."""
    store: Store = Store()
    if through_prefix:
        store = PrefixStore("p", store)
    assert not store.has_extended_api()
    for call in (
        lambda: store.append("foo", "bar"),
        lambda: store.multi_get(["foo", "bar"]),
        lambda: store.multi_set(["foo", "bar"], [b"v", b"v"]),
        lambda: store.queue_push("q", "v"),
        store.clone,
    ):
        with pytest.raises(RuntimeError, match=r"Store\.\w+: Not implemented\."):
            call()


def test_extended_methods_fallbacks() -> None:
    """torch: test_extended_methods_fallbacks (append/multi_* built on compare_set/get/set)."""

    class WithCompareSet(_PythonStore):
        def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
            assert isinstance(expected, bytes)
            assert isinstance(desired, bytes)
            current = self.data.get(key)
            if current is None or current == expected:
                self.data[key] = current = desired
            return current

    store = PrefixStore("p", WithCompareSet())
    assert not store.has_extended_api()
    store.append("foo", b"po")
    store.append("foo", b"tato")
    assert store.get("foo") == b"potato"
    store.multi_set(["a", "b"], [b"c", b"d"])
    assert store.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]


def test_extended_api_roundtrips_through_a_prefix() -> None:
    """torch: test_has_extended_api_roundtrip, test_append/multi_get/multi_set_roundtrip."""
    base = _DummyStore()
    view = PrefixStore("p", base)
    assert view.has_extended_api()
    view.append("foo", "bar")
    assert base.appends == [("p/foo", b"bar")]  # torch: str reaches the subclass as bytes
    assert view.multi_get(["foo", "bar"]) == [b"x", b"y"]
    assert base.multi_gets == [["p/foo", "p/bar"]]
    view.multi_set(["foo", "bar"], ["x", b"y"])
    assert base.multi_sets == [(["p/foo", "p/bar"], [b"x", b"y"])]


def test_a_subclass_holding_str_round_trips_as_bytes() -> None:
    """A subclass may keep and return str; torch hands it bytes and returns bytes to the caller.

    Before, a str given to PrefixStore reached the subclass as str, and what the subclass
    returned came back unconverted (``get`` gave ``'po'``, ``append`` mixed str and bytes).
    """

    class Loose(Store):  # keeps whatever it is given, returns it as it is
        def __init__(self) -> None:
            super().__init__()
            self.data: dict[str, object] = {}
            self.given: list[object] = []

        def set(self, key: str, value: bytes | str) -> None:
            self.given.append(value)
            self.data[key] = value

        def get(self, key: str) -> bytes:
            return self.data[key]  # type: ignore[return-value]

        def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
            self.given.extend([expected, desired])
            current = self.data.get(key)
            if current is None or current == expected:
                self.data[key] = current = desired
            return current  # type: ignore[return-value]

    base = Loose()
    view = PrefixStore("p", base)
    view.set("foo", "po")
    view.append("foo", "tato")
    assert view.get("foo") == b"potato"
    assert all(type(value) is bytes for value in base.given)
    base.data["p/raw"] = "text"  # set on the subclass directly, as str
    assert view.get("raw") == b"text"
    view.append("raw", b"!")
    assert view.get("raw") == b"text!"
    direct = Loose()  # append on the subclass itself: its str value is extended as bytes
    direct.set("k", "po")
    direct.append("k", "tato")
    assert direct.get("k") == b"potato"


# --------------------------------------------------------------------------------------------
# rendezvous


def test_unknown_handler() -> None:
    """torch: RendezvousTest.test_unknown_handler (a RuntimeError; ours is also a ValueError)."""
    with pytest.raises(RuntimeError, match=r"^No rendezvous handler for invalid://"):
        rendezvous("invalid://")
    with pytest.raises(ValueError, match=r"unknown scheme 'invalid'"):
        rendezvous("invalid://")


def test_url_with_node_params(tmp_path: os.PathLike[str]) -> None:
    """torch: test_url_with_node_params (an AssertionError; ours only when values conflict)."""
    url = f"file://{tmp_path}/foo?rank=12&world_size=16"
    with pytest.raises(AssertionError, match=r"has node-specific arguments \(rank=12\)"):
        rendezvous(url, 11, 16)
    with pytest.raises(ValueError, match=r"has node-specific arguments \(world_size=16\)"):
        rendezvous(url, 12, 15)


def test_env_nominal(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch: RendezvousEnvTest.test_nominal."""
    probe = TCPStore(HOST, 0, is_master=True)
    port = probe.port
    probe.close()
    for name, value in [("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", HOST)]:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(port))
    store, rank, size = rendezvous("env://", timeout=10)
    with store:
        assert (rank, size) == (0, 1)
        store.set("key0", "value0")
        assert store.get("key0") == b"value0"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://?rank=0&world_size=1", r"must name an absolute path"),
        ("file:///tmp/foo?world_size=1", r"file:// rendezvous needs rank"),
        ("file:///tmp/foo?rank=0", r"file:// rendezvous needs world_size"),
        ("tcp://127.0.0.1?rank=0&world_size=1", r"needs a host and a non-zero port"),
        ("tcp://127.0.0.1:23456?world_size=1", r"tcp:// rendezvous needs rank"),
        ("tcp://127.0.0.1:23456?rank=0", r"tcp:// rendezvous needs world_size"),
    ],
)
def test_common_errors(url: str, message: str) -> None:
    """torch: RendezvousFileTest / RendezvousTCPTest.test_common_errors."""
    with pytest.raises(ValueError, match=message):
        rendezvous(url)


def test_file_nominal(tmp_path: os.PathLike[str]) -> None:
    """torch: RendezvousFileTest.test_nominal."""
    url = f"file://{tmp_path}/store?world_size=2"
    store0, rank0, size0 = rendezvous(url + "&rank=0")
    store1, rank1, size1 = rendezvous(url + "&rank=1")
    assert (rank0, size0, rank1, size1) == (0, 2, 1, 2)
    store0.set("key0", "value0")
    store1.set("key1", "value1")
    assert (store1.get("key0"), store0.get("key1")) == (b"value0", b"value1")
    store0.close()
    store1.close()


@pytest.mark.slow
def test_tcp_nominal_and_timeout_set() -> None:
    """torch: RendezvousTCPTest.test_nominal / test_tcp_store_timeout_set."""
    probe = TCPStore(HOST, 0, is_master=True)
    port = probe.port
    probe.close()
    store, rank, size = rendezvous(f"tcp://{HOST}:{port}?world_size=1&rank=0", timeout=1)
    with store:
        assert (rank, size) == (0, 1)
        store.set("key0", "value0")
        assert store.get("key0") == b"value0"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"timeout after 1\.0 s"):
            store.get("nonexistent key")
        assert time.monotonic() - start < 10


@pytest.mark.slow
def test_dns_failure_is_reported_within_the_timeout() -> None:
    """torch: RendezvousTCPTest.test_dns_timeout (our type: DistNetworkError)."""
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=r"dnsnotexist\.invalid"):
        rendezvous("tcp://dnsnotexist.invalid:23456?world_size=2&rank=1", timeout=1)
    assert time.monotonic() - start < 10
