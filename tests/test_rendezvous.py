"""rendezvous() for env://, tcp:// and file:// across processes, and wait_for_world()."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from cupy_parallel._src.distributed.rendezvous import (
    InitMethod,
    init_key,
    rendezvous,
    wait_for_world,
)
from cupy_parallel._src.distributed.store import FileStore, PrefixStore, TCPStore

HOST = "127.0.0.1"
FIVE = timedelta(seconds=5)
ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


# --------------------------------------------------------------------------------------------
# Across processes: every rank finds the others and reads what each one wrote

_RANK = """
import json, os, sys
from datetime import timedelta
from cupy_parallel._src.distributed.rendezvous import rendezvous, wait_for_world
url, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store, rank, size = rendezvous(url, rank, size, timeout=timedelta(seconds=30))
wait_for_world(store, rank, size, timeout=timedelta(seconds=30))
store.set(f"hello/{rank}", f"from {rank}")
seen = [store.get(f"hello/{r}").decode() for r in range(size)]
store.set(f"done/{rank}", "1")
if rank == 0:  # the host of a TCPStore stays until everyone has read
    store.wait([f"done/{r}" for r in range(size)])
print(json.dumps({"rank": rank, "size": size, "seen": seen}))
store.close()
"""


def _run_ranks(urls: list[str], args: list[tuple[int, int]], envs: list[dict[str, str]]) -> list:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, url, str(rank), str(size)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url, (rank, size), env in zip(urls, args, envs, strict=True)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    return results


def _expected(size: int) -> list[dict[str, object]]:
    seen = [f"from {r}" for r in range(size)]
    return [{"rank": r, "size": size, "seen": seen} for r in range(size)]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(InitMethod), ids=lambda m: m.value)
def test_rendezvous_across_processes(method: InitMethod, tmp_path: os.PathLike[str]) -> None:
    size = 3
    port = _free_port()
    base = dict(os.environ)
    if method is InitMethod.ENV:
        # rank and size come from the environment: the arguments stay -1
        urls = ["env://"] * size
        args = [(-1, -1)] * size
        envs = [
            dict(base, MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(size))
            for r in range(size)
        ]
    elif method is InitMethod.TCP:
        # the size comes from the query, the rank from the argument
        urls = [f"tcp://{HOST}:{port}?world_size={size}"] * size
        args = [(r, -1) for r in range(size)]
        envs = [base] * size
    else:
        path = os.path.join(tmp_path, "store")
        urls = [f"file://{path}?rank={r}&world_size={size}" for r in range(size)]
        args = [(-1, -1)] * size
        envs = [base] * size
    results = sorted(_run_ranks(urls, args, envs), key=lambda result: result["rank"])
    assert results == _expected(size)
    if method is InitMethod.FILE:
        assert not os.path.exists(path)  # the last of world_size users removed the file


def test_env_rendezvous_reads_an_mpi_launchers_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "1")
    store, rank, size = rendezvous("env://", timeout=FIVE)
    with store:
        assert (rank, size) == (0, 1)
        assert isinstance(store, TCPStore)
        assert store.is_master
        assert store.timeout == FIVE
        wait_for_world(store, rank, size, timeout=FIVE)


def test_env_variables_yield_to_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "9")
    store, rank, size = rendezvous("env://", 0, 1, timeout=FIVE)
    with store:
        assert (rank, size) == (0, 1)


def test_file_rendezvous_in_one_process(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "a b")  # quoted in the URL
    store, rank, size = rendezvous(f"file://{path.replace(' ', '%20')}", 0, 1, timeout=FIVE)
    with store:
        assert isinstance(store, FileStore)
        assert store.path == path
        assert (rank, size) == (0, 1)


@pytest.mark.parametrize("flag", ["0", "1"])
def test_use_libuv_in_a_url_is_accepted_and_ignored(flag: str) -> None:
    """torch's URLs may carry ``use_libuv`` (its choice of TCP server); it was refused here.

    The other query parameters are still read (rank, world_size from the URL) and still checked.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}?use_libuv={flag}&rank=0&world_size=1"
    store, rank, size = rendezvous(url, -1, -1, timeout=FIVE)
    with store:
        assert isinstance(store, TCPStore)
        assert (rank, size) == (0, 1)
    with pytest.raises(
        ValueError, match=r"unknown query parameter 'use_libuvv'.*use_libuv, ignored"
    ):
        rendezvous(f"tcp://127.0.0.1:{port}?use_libuvv=1", 0, 1, timeout=FIVE)


# --------------------------------------------------------------------------------------------
# Errors name the missing or invalid piece


@pytest.mark.parametrize(
    ("init_method", "rank", "size", "message"),
    [
        ("udp://h:1", 0, 1, r"unknown scheme 'udp'; supported: env://, tcp://, file://\."),
        ("localhost:1234", 0, 1, r"unknown scheme 'localhost'"),
        ("tcp://127.0.0.1", 0, 1, r"needs a host and a non-zero port, e\.g\. tcp://"),
        ("tcp://127.0.0.1:0", 0, 1, r"needs a host and a non-zero port"),
        ("tcp://:29500", 0, 1, r"needs a host and a non-zero port"),
        ("tcp://127.0.0.1:port", 0, 1, r"has an invalid port"),
        ("tcp://127.0.0.1:1", -1, 2, r"tcp:// rendezvous needs rank: pass rank=\.\.\. or add"),
        ("tcp://127.0.0.1:1", 0, -1, r"tcp:// rendezvous needs world_size"),
        ("tcp://127.0.0.1:1", 2, 2, r"rank must be in \[0, world_size=2\), got 2"),
        ("tcp://127.0.0.1:1", 0, 0, r"world_size must be >= 1, got 0"),
        ("tcp://127.0.0.1:1?rank=1", 0, 2, r"node-specific arguments \(rank=1\) that conflict"),
        ("tcp://127.0.0.1:1?world=2", 0, 2, r"unknown query parameter 'world'"),
        ("tcp://127.0.0.1:1?rank=x", -1, 2, r"query parameter rank must be an integer, got 'x'"),
        ("tcp://127.0.0.1:1?rank=0&rank=1", -1, 2, r"gives rank 2 times"),
        ("tcp://127.0.0.1:1?rank=-1", -1, 2, r"query parameter rank must be >= 0, got -1"),
        ("file:///tmp/s?world_size=-1", 0, -1, r"query parameter world_size must be >= 1, got -1"),
        ("env://?rank=-1", -1, 1, r"query parameter rank must be >= 0, got -1"),
        ("file://tmp/store", 0, 1, r"absolute path after three slashes, e\.g\. file:///"),
        ("file:///tmp/s?rank=0", -1, -1, r"file:// rendezvous needs world_size"),
        ("env://", 0, 1, r"environment variable MASTER_ADDR"),
        ("env://", -1, 1, r"needs environment variable RANK, which is not set"),
        ("env://", 0, -1, r"needs environment variable WORLD_SIZE, which is not set"),
    ],
)
def test_bad_init_methods_are_named(init_method: str, rank: int, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rendezvous(init_method, rank, size, timeout=FIVE)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MASTER_ADDR": HOST}, r"environment variable MASTER_PORT \(a free port on rank 0\)"),
        ({"MASTER_ADDR": HOST, "MASTER_PORT": "http"}, r"MASTER_PORT must be a port .*'http'"),
        ({"MASTER_ADDR": HOST, "MASTER_PORT": "0"}, r"MASTER_PORT must be a port .*'0'"),
        ({"RANK": "first"}, r"environment variable RANK must be an integer, got 'first'"),
        # -1 is the arguments' "not given": set in the environment, it is a bad value, not a
        # missing one (it was reported as "needs rank: pass rank=... or add ?rank=...").
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"environment variable RANK must be >= 0, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "-1"}, r"variable WORLD_SIZE must be >= 1, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"variable WORLD_SIZE must be >= 1, got 0"),
        ({"PMI_RANK": "0", "PMI_SIZE": "zero"}, r"PMI_SIZE must be an integer >= 1, got 'zero'"),
    ],
)
def test_bad_environments_are_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    rank = -1 if "RANK" in env or "PMI_RANK" in env else 0
    size = -1 if "PMI_SIZE" in env or "WORLD_SIZE" in env else 1
    with pytest.raises(ValueError, match=message):
        rendezvous("env://", rank, size, timeout=FIVE)


def test_argument_types_are_checked() -> None:
    with pytest.raises(TypeError, match=r"init_method must be a str URL, got int"):
        rendezvous(3, timeout=FIVE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rank must be an int, got str"):
        rendezvous("env://", "0", timeout=FIVE)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta or a number"):
        rendezvous("env://", timeout="30")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# wait_for_world


@pytest.mark.slow
def test_wait_for_world_names_the_arrivals(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "store")
    errors: list[str] = []

    def rank(r: int) -> None:
        with FileStore(path) as store:
            try:
                wait_for_world(store, r, 4, timeout=timedelta(seconds=0.5))
            except TimeoutError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert (
        errors
        == [
            "rendezvous timed out after 0.5 s: 2 of 4 ranks arrived (missing ranks: 1, 3).",
        ]
        * 2
    )


def test_wait_for_world_lists_at_most_eight_missing_ranks() -> None:
    with (
        TCPStore(HOST, 0, is_master=True) as store,
        pytest.raises(
            TimeoutError,
            match=r"^rendezvous timed out after 0\.2 s: 1 of 20 ranks arrived "
            r"\(missing ranks: 0, 1, 2, 3, 4, 5, 6, 7, \.\.\.\)\.$",
        ),
    ):
        wait_for_world(store, 19, 20, timeout=timedelta(seconds=0.2))


def test_wait_for_world_refuses_a_rank_twice() -> None:
    with TCPStore(HOST, 0, is_master=True) as store:
        wait_for_world(store, 0, 1, timeout=FIVE)
        with pytest.raises(ValueError, match=r"rank 0 checked in twice under rendezvous key"):
            wait_for_world(store, 0, 1, timeout=FIVE)
        # a new key (or a PrefixStore) rendezvouses again on the same store
        wait_for_world(store, 0, 1, timeout=FIVE, key="second")
        wait_for_world(PrefixStore("group", store), 0, 1, timeout=FIVE)


def test_init_key_lets_a_world_meet_again_on_one_store() -> None:
    """Three ranks, each with its own connection, initialise three times on one TCPStore."""
    size, rounds = 3, 3
    keys: dict[int, list[str]] = {r: [] for r in range(size)}
    errors: list[BaseException] = []
    with TCPStore(HOST, 0, is_master=True) as server:

        def rank(r: int) -> None:
            try:
                with TCPStore(HOST, server.port) as store:
                    for _ in range(rounds):
                        key = init_key(store, "0", size)
                        wait_for_world(store, r, size, timeout=FIVE, key=key)
                        keys[r].append(key)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        expected = [f"cupy_parallel/init/0/3/{g}" for g in range(rounds)]
        assert keys == dict.fromkeys(range(size), expected)
        # another world size or group name counts on its own
        assert init_key(server, "0", 1) == "cupy_parallel/init/0/1/0"
        assert init_key(server, "main", 3) == "cupy_parallel/init/main/3/0"


def test_wait_for_world_checks_its_arguments() -> None:
    with TCPStore(HOST, 0, is_master=True) as store:
        with pytest.raises(TypeError, match=r"store must be a cupy_parallel Store, got str"):
            wait_for_world("s", 0, 1, timeout=FIVE)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got -1"):
            wait_for_world(store, -1, 2, timeout=FIVE)
        with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
            wait_for_world(store, 0, 0, timeout=FIVE)
        with pytest.raises(TypeError, match=r"key must be a str, got int"):
            wait_for_world(store, 0, 1, timeout=FIVE, key=3)  # type: ignore[arg-type]
        assert store.num_keys() == 0
