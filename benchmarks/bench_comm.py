"""cupy_parallel.comm on 4 host devices against plain NumPy copies and sums of the same bytes.

Four measurements, each timed by the harness's ``compare`` against its baseline in interleaved
rounds (so machine load hits both alike; the row reports the median per-round ratio and its
spread):

* ``scatter``: 256 MiB of float32 from ``"cpu"`` to 4 host devices, vs one preallocated
  ``numpy.copyto`` of the same bytes (target ratio 1.5);
* ``gather``: those 4 chunks back to ``"cpu"``, vs the same copy (target 1.5);
* ``broadcast_coalesced``: the 161 ResNet-50 parameter arrays (25.6 M float32) from host:0 to
  4 devices, vs ``numpy.copyto`` of every array into 3 preallocated replicas (devices[0] gets
  the originals) (target 1.2);
* ``reduce_add_coalesced``: 4 replicas of those parameters summed onto host:0, vs the per-array
  NumPy loop ``a0 + a1 + a2 + a3`` (target 1.0).

Run ``python benchmarks/bench_comm.py [--quick] [--json PATH]``; ``run(quick)`` returns the rows
for ``cupy-parallel bench``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupy_parallel._src import comm
from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.devices import host_device_count, set_host_device_count
from cupy_parallel._src.hostarray import plain_buffer
from cupy_parallel._tools.benchmarking import compare, script_main

DEVICES = [f"host:{k}" for k in range(4)]
MIB = 1 << 20


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of torchvision's ResNet-50 (convs, batch-norm affines, fc)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if block == 0:
                shapes += [(4 * width, channels, 1, 1), (4 * width,), (4 * width,)]
            channels = 4 * width
    shapes += [(1000, 2048), (1000,)]
    return shapes


def _scatter_gather(quick: bool, repeats: int) -> list[dict[str, Any]]:
    count = (64 if quick else 256) * MIB // 4
    x = np.random.default_rng(0).standard_normal(count, dtype=np.float32)
    copy = np.empty_like(x)
    scatter = compare(lambda: comm.scatter(x, DEVICES), lambda: np.copyto(copy, x), rounds=repeats)
    parts = comm.scatter(x, DEVICES)
    gather = compare(
        lambda: comm.gather(parts, 0, "cpu"), lambda: np.copyto(copy, x), rounds=repeats
    )
    if not np.array_equal(comm.gather(parts, 0, "cpu"), x):
        raise AssertionError("scatter/gather round trip changed the data")
    return [
        scatter.row("scatter cpu->4 host devices", 1.5, bytes=x.nbytes),
        gather.row("gather 4 host devices->cpu", 1.5, bytes=x.nbytes),
    ]


def _coalesced(repeats: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    shapes = resnet50_shapes()
    params = [to_device(rng.standard_normal(s, dtype=np.float32), "host:0") for s in shapes]
    nbytes = sum(p.nbytes for p in params)
    plain = [plain_buffer(p) for p in params]
    replicas = [[np.empty_like(p) for p in plain] for _ in DEVICES[1:]]

    def copies() -> None:
        for replica in replicas:
            for dst, src in zip(replica, plain, strict=True):
                np.copyto(dst, src)

    broadcast = compare(lambda: comm.broadcast_coalesced(params, DEVICES), copies, rounds=repeats)

    grads = [
        [to_device(rng.standard_normal(s, dtype=np.float32), d) for s in shapes] for d in DEVICES
    ]
    plain_grads = [[plain_buffer(g) for g in per_device] for per_device in grads]

    def numpy_sums() -> list[np.ndarray]:
        return [a0 + a1 + a2 + a3 for a0, a1, a2, a3 in zip(*plain_grads, strict=True)]

    reduce = compare(lambda: comm.reduce_add_coalesced(grads, "host:0"), numpy_sums, rounds=repeats)
    got = comm.reduce_add_coalesced(grads, "host:0")
    if not all(np.array_equal(plain_buffer(g), w) for g, w in zip(got, numpy_sums(), strict=True)):
        raise AssertionError("reduce_add_coalesced differs from the NumPy sums")
    return [
        broadcast.row("broadcast_coalesced ResNet-50 ->4", 1.2, bytes=3 * nbytes),
        reduce.row("reduce_add_coalesced ResNet-50 x4", 1.0, bytes=4 * nbytes),
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    """Time the four comm operations on 4 host devices; one result dict per operation.

    The host device count is set to 4 for the run and restored afterwards.
    """
    previous = host_device_count()
    set_host_device_count(len(DEVICES))
    repeats = 3 if quick else 9
    try:
        return _scatter_gather(quick, repeats) + _coalesced(repeats)
    finally:
        set_host_device_count(previous)


def main() -> None:
    script_main(run, "bench_comm", __doc__.splitlines()[0], quick_help="64 MiB scatter, 3 repeats")


if __name__ == "__main__":
    main()
