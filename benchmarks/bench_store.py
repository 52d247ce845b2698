"""TCPStore latency against PyTorch's TCPStore, measured in the same run.

Each store's server runs in its own subprocess (as rank 0's would, seen from the other ranks),
and the clients run here. Rows: ``set``, ``get`` and ``add`` round trips (16-byte values), one
``multi_get`` of 1,000 keys, and a 64-rank rendezvous simulated with 64 threads, each with a
client connected beforehand (each adds itself to a counter, the last sets a key, all wait for
it). The baseline is ``torch.distributed.TCPStore`` doing the same; the target is at most 1.5x
its time. Torch's ``set`` does not wait for the server and ours does by default (see
``TCPStore``), so the ``set`` row compares a send with a round trip; the
``confirm_sets=False`` row is our torch-like ``set`` against the same torch call. Every
configuration runs alternately and the fastest repeat is kept (the usual estimate for
microbenchmarks on a shared machine). Without PyTorch there is no baseline and no rows.

Run ``python benchmarks/bench_store.py [--quick] [--json PATH]``; ``run(quick)`` returns the
rows for ``cupy-parallel bench``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from cupy_parallel._tools.benchmarking import result, script_main

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

TARGET = 1.5
HOST = "127.0.0.1"
RANKS = 64
KEYS = 1000

_SERVER = """
import sys
kind = sys.argv[1]
if kind == "torch":
    from torch.distributed import TCPStore
else:
    from cupy_parallel.distributed import TCPStore
from datetime import timedelta
store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
print(store.port, flush=True)
sys.stdin.read()
"""


class _Server:
    """A master in a subprocess; ``connect()`` makes a client of the matching kind."""

    def __init__(self, kind: str, module: Any) -> None:
        self.kind = kind
        self._module = module
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())

    def connect(self, *, confirm_sets: bool = True) -> Any:
        """A client; ``confirm_sets=False`` is our torch-like ``set`` (torch has only that)."""
        from datetime import timedelta

        options = {} if self.kind == "torch" else {"confirm_sets": confirm_sets}
        return self._module.TCPStore(HOST, self.port, timeout=timedelta(seconds=120), **options)

    def close(self) -> None:
        self._proc.kill()
        self._proc.communicate(timeout=30)


def _import_torch() -> Any:
    try:
        import torch.distributed
    except ImportError:
        return None
    return torch.distributed


def _per_call(fn: Callable[[], object], iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def _rendezvous(clients: list[Any], tag: str) -> float:
    """Seconds until all simulated ranks have checked in and seen the others.

    Each rank is a thread with its own client, connected beforehand (64 threads connecting
    at once to torch's store stall for ~10 s in its connect retries, which would hide the
    rendezvous itself).
    """
    key = f"rdzv-{tag}"
    ready = threading.Barrier(len(clients) + 1)
    done: list[float] = []

    def rank(store: Any) -> None:
        ready.wait()
        if store.add(f"{key}/arrived", 1) == len(clients):
            store.set(f"{key}/complete", "1")
        store.wait([f"{key}/complete"])
        done.append(time.perf_counter())

    threads = [threading.Thread(target=rank, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    ready.wait()
    for thread in threads:
        thread.join(60)
    assert len(done) == len(clients), "a simulated rank did not finish"
    return max(done) - start


def _cases(client: Any, server: _Server) -> Iterator[tuple[str, Callable[[int], float]]]:
    value = b"x" * 16
    client.set("k", value)
    keys = [f"many/{i}" for i in range(KEYS)]
    for key in keys:
        client.set(key, value)
    assert client.multi_get(keys) == [value] * KEYS
    rounds = iter(range(10**9))
    ranks = [server.connect() for _ in range(RANKS)]
    posting = server.connect(confirm_sets=False)
    yield "set latency", lambda n: _per_call(lambda: client.set("k", value), n)
    yield (
        "set latency, confirm_sets=False",
        lambda n: _per_call(lambda: posting.set("k", value), n),
    )
    yield "get latency", lambda n: _per_call(lambda: client.get("k"), n)
    yield "add latency", lambda n: _per_call(lambda: client.add("counter", 1), n)
    yield (
        "multi_get 1,000 keys",
        lambda n: _per_call(lambda: client.multi_get(keys), max(n // 100, 2)),
    )
    yield (
        f"rendezvous {RANKS} ranks (threads)",
        lambda n: _rendezvous(ranks, f"{server.kind}{next(rounds)}"),
    )


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Time both stores alternately; one row per operation (none without PyTorch)."""
    torch_dist = _import_torch()
    if torch_dist is None:
        print("bench_store: PyTorch is not installed; no baseline, no rows.", file=sys.stderr)
        return []
    from cupy_parallel import distributed as ours_dist

    # many short rounds: the best of them is steadier on a busy machine
    iterations, repeats = (100, 5) if quick else (300, 30)
    servers = {"ours": _Server("ours", ours_dist), "torch": _Server("torch", torch_dist)}
    try:
        clients = {kind: server.connect() for kind, server in servers.items()}
        cases = {kind: dict(_cases(clients[kind], servers[kind])) for kind in servers}
        rows = []
        for name in cases["ours"]:
            best = {"ours": float("inf"), "torch": float("inf")}
            for _ in range(repeats):
                for kind in ("torch", "ours"):
                    best[kind] = min(best[kind], cases[kind][name](iterations))
            rows.append(
                result(
                    f"TCPStore {name}",
                    best["ours"],
                    best["torch"],
                    TARGET,
                    goal=f"<= {TARGET}x torch.distributed.TCPStore",
                    met=best["ours"] <= TARGET * best["torch"],
                )
            )
        clients["ours"].close()
        return rows
    finally:
        for server in servers.values():
            server.close()


if __name__ == "__main__":
    script_main(run, "bench_store", __doc__.splitlines()[0], quick_help="fewer iterations")
