"""cupy_parallel.save / load of 1 GiB against numpy.save / numpy.load of one array, same run.

The tree is one float64 array of 1 GiB (64 MiB with ``--quick``) in a dict, in a temporary
directory. ``cupy_parallel.save`` writes a safetensors file under a temporary name, ``fsync``-s
it, renames it over the previous file and ``fsync``-s the directory; the baseline of the target
row is ``numpy.save`` of the same array over its previous ``.npy`` followed by an ``fsync`` of
the file: the same durability (the bytes on disk when the call returns) and the same work for
the file system (both replace a 1 GiB file that is on disk: ``numpy.save`` truncates it, the
rename unlinks it). ``numpy.save`` alone (no ``fsync``) is a row for information. The target is
1.2x: the disk is the limit, both write the bytes once from the array's memory.

Loads are timed twice: from the page cache (both files were just written) and with the files'
cached pages dropped first by ``posix_fadvise(POSIX_FADV_DONTNEED)`` (:func:`drop_cached_pages`,
no root needed), so that the bytes come from the disk, or from the host's cache of this virtual
disk.

The machine is shared and its disk is noisy, so each row is measured in rounds that run ours and
the baseline back to back, in alternating order (AB BA AB ...: neither always inherits the
other's leftovers), each call after an untimed ``os.sync`` (no dirty pages of the previous call
are written back during the next); the ratio is the median of the per-round ratios and the
spread their interquartile range over it (``noisy`` above 25%). The CPU time (user + system)
of the same calls is a row of its own: other processes' load lengthens the wall time of
copying into and out of the page cache, not its CPU time, so this row says whether ours does
more work than NumPy's where the wall-time rows are noisy.

The rows ``save piece: ...`` and ``numpy.save piece: ...`` say where the time goes: the same
steps as ``save`` (:func:`encode_tree`, the temporary file's creation and the drop of the
previous file's cached pages, :func:`write_safetensors` without its ``fsync``, the ``fsync``,
the rename, the ``fsync`` of the directory) and as ``numpy.save`` + ``fsync``
(the truncating open, the write, the ``fsync``), timed one by one in alternating rounds; each
piece's ratio is its share of that round's ``numpy.save`` + ``fsync``.

Run ``python benchmarks/bench_save.py [--quick] [--json PATH]``; ``run(quick)`` returns the
rows for ``cupy-parallel bench``.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

import cupy_parallel as cp
from cupy_parallel._src.serialization import (
    drop_cached_pages,
    encode_tree,
    fsync_directory,
    write_safetensors,
)
from cupy_parallel._tools.benchmarking import Timing, script_main

if TYPE_CHECKING:
    from collections.abc import Callable

TARGET = 1.2


def _numpy_save_fsync(path: str, x: np.ndarray) -> None:
    with open(path, "wb") as out:
        np.save(out, x)
        out.flush()
        os.fsync(out.fileno())


def _settle() -> None:
    if hasattr(os, "sync"):
        os.sync()


def _alternating(
    ours: Callable[[], object],
    theirs: Callable[[], object],
    rounds: int,
    before: Callable[[], None] = _settle,
) -> tuple[Timing, Timing]:
    """Wall and CPU (user + system) seconds of both, timed in rounds in order AB, BA, AB, ...

    ``before()`` runs untimed before each call.
    """
    wall: dict[Any, list[float]] = {ours: [], theirs: []}
    cpu: dict[Any, list[float]] = {ours: [], theirs: []}
    for fn in (ours, theirs):  # warm-up: both files exist and the code is loaded
        before()
        fn()
    for index in range(rounds):
        for fn in (ours, theirs) if index % 2 == 0 else (theirs, ours):
            before()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            cpu[fn].append(time.process_time() - start_cpu)
            wall[fn].append(time.perf_counter() - start)
    return Timing.of(wall[ours], wall[theirs]), Timing.of(cpu[ours], cpu[theirs])


def _save_in_pieces(tree: Any, path: str) -> dict[str, float]:
    """The steps of ``cupy_parallel.save`` (``replace_atomically`` of ``write_safetensors``)."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    tensors, metadata = encode_tree(tree)
    now = time.perf_counter()
    times["encode the tree (no copy of a contiguous array)"], start = now - start, now
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    drop_cached_pages(path)
    now = time.perf_counter()
    times["create the temporary, drop the previous file's cached pages"], start = now - start, now
    write_safetensors(temporary, tensors, metadata, sync=False)
    now = time.perf_counter()
    times["write the temporary file (page cache)"], start = now - start, now
    fd = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    now = time.perf_counter()
    times["fsync of the temporary file"], start = now - start, now
    os.replace(temporary, path)
    now = time.perf_counter()
    times["rename over the previous file (which frees it)"], start = now - start, now
    fsync_directory(directory)
    times["fsync of the directory"] = time.perf_counter() - start
    return times


def _numpy_in_pieces(x: np.ndarray, path: str) -> dict[str, float]:
    """The steps of ``numpy.save`` + ``fsync`` of the file."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    with open(path, "wb") as out:
        now = time.perf_counter()
        times["truncating open of the previous .npy (which frees it)"], start = now - start, now
        np.save(out, x)
        out.flush()
        now = time.perf_counter()
        times["write (page cache)"], start = now - start, now
        os.fsync(out.fileno())
    times["fsync of the file"] = time.perf_counter() - start
    return times


def _piece_rows(x: np.ndarray, ours: str, theirs: str, rounds: int, size: str) -> list[Any]:
    ours_pieces: list[dict[str, float]] = []
    numpy_pieces: list[dict[str, float]] = []
    steps = (
        lambda: ours_pieces.append(_save_in_pieces({"x": x}, ours)),
        lambda: numpy_pieces.append(_numpy_in_pieces(x, theirs)),
    )
    for index in range(rounds + 1):  # round 0 warms up
        for step in steps if index % 2 == 0 else steps[::-1]:
            _settle()
            step()
    ours_pieces, numpy_pieces = ours_pieces[1:], numpy_pieces[1:]
    totals = [sum(pieces.values()) for pieces in numpy_pieces]
    rows = []
    for who, runs in (("save", ours_pieces), ("numpy.save", numpy_pieces)):
        for piece in runs[0]:
            timing = Timing.of([run[piece] for run in runs], totals)
            rows.append(timing.row(f"{who} piece {size}: {piece}", None))
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """The save and load rows against NumPy, then the pieces of both saves."""
    nbytes = (64 if quick else 1024) << 20
    rounds = 5 if quick else 7
    x = np.random.default_rng(0).standard_normal(nbytes // 8)
    size = f"{nbytes >> 20} MiB float64"
    with tempfile.TemporaryDirectory(prefix="bench_save_") as directory:
        ours, theirs = os.path.join(directory, "x.safetensors"), os.path.join(directory, "x.npy")
        durable, durable_cpu = _alternating(
            lambda: cp.save({"x": x}, ours), lambda: _numpy_save_fsync(theirs, x), rounds
        )
        plain, _ = _alternating(lambda: cp.save({"x": x}, ours), lambda: np.save(theirs, x), rounds)
        _numpy_save_fsync(theirs, x)  # on disk, as the cached-page drops need
        loaded: dict[str, Any] = {}

        def load_ours() -> None:
            loaded["ours"] = cp.load(ours)["x"]

        def load_theirs() -> None:
            loaded["theirs"] = np.load(theirs)

        def free() -> None:  # the previous result's memory is freed untimed
            loaded.clear()

        def free_and_drop() -> None:
            loaded.clear()
            drop_cached_pages(ours)
            drop_cached_pages(theirs)

        warm, warm_cpu = _alternating(load_ours, load_theirs, rounds, free)
        cold, _ = _alternating(load_ours, load_theirs, rounds, free_and_drop)
        free()
        bits = x.view(np.uint64)  # compared as integers: NaN payloads and -0.0 count
        for load in (load_ours, load_theirs):
            load()
            if not all(np.array_equal(y.view(np.uint64), bits) for y in loaded.values()):
                raise AssertionError("a load did not give back the array saved")
            free()
        pieces = _piece_rows(x, ours, theirs, rounds, size)
    return [
        durable.row(f"save {size} (atomic) vs numpy.save + fsync", TARGET, bytes=nbytes),
        durable_cpu.row(f"save {size} vs numpy.save + fsync: CPU time (user+sys)", None),
        plain.row(f"save {size} (atomic) vs numpy.save, no fsync", None, bytes=nbytes),
        warm.row(f"load {size} vs numpy.load, page cache", TARGET, bytes=nbytes),
        warm_cpu.row(f"load {size} vs numpy.load, page cache: CPU time (user+sys)", None),
        cold.row(f"load {size} vs numpy.load, pages dropped", TARGET, bytes=nbytes),
        *pieces,
    ]


def main() -> None:
    script_main(run, "bench_save", __doc__.splitlines()[0], quick_help="64 MiB instead of 1 GiB")


if __name__ == "__main__":
    main()
