"""cupy_parallel.save / load of 1 GiB against numpy.save / numpy.load of one array, same run.

The tree is one float64 array of 1 GiB (64 MiB with ``--quick``) in a dict, written to a
temporary directory: ``cupy_parallel.save`` (a safetensors file, written under a temporary name,
``fsync``-ed and renamed into place) against ``numpy.save`` of the same array to a ``.npy``
file, and ``cupy_parallel.load`` against ``numpy.load``. ``numpy.save`` does not ``fsync``, so
a second row compares with ``numpy.save`` followed by an ``fsync`` of the file (the same
durability: the data on disk when the call returns). The target is 1.2x (the disk is the
limit: both write the bytes once). Each round times ours then NumPy's; the median ratio is
reported. The files of both stay in the page cache between rounds, so the loads measure
copying out of it more than the disk.

Run ``python benchmarks/bench_save.py [--quick] [--json PATH]``; ``run(quick)`` returns the
rows for ``cupy-parallel bench``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

import cupy_parallel as cp
from cupy_parallel._tools.benchmarking import compare, script_main

TARGET = 1.2


def _numpy_save_fsync(path: str, x: np.ndarray) -> None:
    with open(path, "wb") as out:
        np.save(out, x)
        out.flush()
        os.fsync(out.fileno())


def run(quick: bool) -> list[dict[str, Any]]:
    """Three rows: save vs numpy.save, save vs numpy.save + fsync, load vs numpy.load."""
    nbytes = (64 if quick else 1024) << 20
    rounds = 5 if quick else 3
    x = np.random.default_rng(0).standard_normal(nbytes // 8)
    size = f"{nbytes >> 20} MiB float64"
    with tempfile.TemporaryDirectory(prefix="bench_save_") as directory:
        ours, theirs = os.path.join(directory, "x.safetensors"), os.path.join(directory, "x.npy")
        save = compare(
            lambda: cp.save({"x": x}, ours), lambda: np.save(theirs, x), rounds=rounds, warmup=0
        )
        durable = compare(
            lambda: cp.save({"x": x}, ours),
            lambda: _numpy_save_fsync(theirs, x),
            rounds=rounds,
            warmup=0,
        )
        loaded: dict[str, Any] = {}

        def load_ours() -> None:
            loaded["ours"] = cp.load(ours)["x"]

        def load_theirs() -> None:
            loaded["theirs"] = np.load(theirs)

        load = compare(load_ours, load_theirs, rounds=rounds, warmup=1)
        if loaded["ours"].tobytes() != x.tobytes() or loaded["theirs"].tobytes() != x.tobytes():
            raise AssertionError("a load did not give back the array saved")
    return [
        save.row(f"save {size} (atomic, fsync) vs numpy.save", TARGET, bytes=nbytes),
        durable.row(f"save {size} vs numpy.save + fsync", TARGET, bytes=nbytes),
        load.row(f"load {size} vs numpy.load", TARGET, bytes=nbytes),
    ]


def main() -> None:
    script_main(run, "bench_save", __doc__.splitlines()[0], quick_help="64 MiB instead of 1 GiB")


if __name__ == "__main__":
    main()
