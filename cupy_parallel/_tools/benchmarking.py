"""Running a benchmark suite for ``cupy-parallel bench``: discover, run, record, plot, tabulate.

A *suite* is a directory of ``bench_*.py`` modules. A module that defines a top-level
``run(quick)`` function is a benchmark; it returns a list of result dicts with the keys
``name``, ``seconds``, ``baseline_seconds``, ``ratio`` (``seconds / baseline_seconds``, so below
1 means faster than the baseline), ``target`` (the largest ratio the benchmark aims for, or
``None``) and, for transfers, ``bytes``. Other ``bench_*.py`` modules are helpers the
benchmarks import, and are not run. Each benchmark runs in this process; one that fails to import
or run, or returns malformed results, is recorded as failed with the reason, and the rest still
run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import cupy_parallel

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = [
    "NOISY_SPREAD",
    "REQUIRED_KEYS",
    "Timing",
    "compare",
    "default_suite_dir",
    "discover",
    "format_table",
    "pinned_blas_threads",
    "plot_bandwidth",
    "plot_ratios",
    "result",
    "run_all",
    "run_module",
    "script_main",
    "write_outputs",
]

#: Keys every result dict must carry.
REQUIRED_KEYS = ("name", "seconds", "baseline_seconds", "ratio", "target")
JSON_NAME = "bench.json"
RATIOS_PNG = "bench_ratios.png"
BANDWIDTH_PNG = "bench_bandwidth.png"


def result(
    name: str, seconds: float, baseline_seconds: float, target: float | None, /, **extra: Any
) -> dict[str, Any]:
    """One result dict of ``run(quick)``, its ``ratio`` computed; ``extra`` keys are added.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._tools.benchmarking import result
        >>> result("copy", 3.0, 2.0, 1.2, bytes=8)
        {'name': 'copy', 'seconds': 3.0, 'baseline_seconds': 2.0, 'ratio': 1.5, 'target': 1.2, \
'bytes': 8}
    """
    return {
        "name": name,
        "seconds": seconds,
        "baseline_seconds": baseline_seconds,
        "ratio": seconds / baseline_seconds,
        "target": target,
        **extra,
    }


#: A row whose per-round ratios spread more than this (interquartile range over the median)
#: is flagged ``noisy``: its ratio is not a measurement to compare against a target.
NOISY_SPREAD = 0.25


@dataclass(frozen=True)
class Timing:
    """What :func:`compare` measured: per-call seconds of a candidate and its baseline.

    ``seconds``/``baseline_seconds`` are medians over the rounds, ``min_seconds``/
    ``baseline_min_seconds`` the fastest round; ``ratio`` is the median of the per-round ratios
    (each round times both, back to back, so load that comes and goes hits both alike) and
    ``spread`` the interquartile range of those ratios divided by their median.
    """

    seconds: float
    baseline_seconds: float
    min_seconds: float
    baseline_min_seconds: float
    ratio: float
    spread: float
    rounds: int

    @classmethod
    def of(cls, seconds: Sequence[float], baseline_seconds: Sequence[float], /) -> Timing:
        """The statistics of per-call seconds measured in rounds (round ``i`` of each together).

        For timing loops that :func:`compare` cannot run (one per MPI rank, in step).

        Example:
            >>> import cupy_parallel
            >>> from cupy_parallel._tools.benchmarking import Timing
            >>> timing = Timing.of([2.0, 3.0, 2.2], [1.0, 2.0, 1.0])
            >>> timing.ratio, timing.min_seconds, timing.baseline_min_seconds
            (2.0, 2.0, 1.0)
        """
        ratios = sorted(a / b for a, b in zip(seconds, baseline_seconds, strict=True))
        middle = statistics.median(ratios)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [middle] * 3
        return cls(
            seconds=statistics.median(seconds),
            baseline_seconds=statistics.median(baseline_seconds),
            min_seconds=min(seconds),
            baseline_min_seconds=min(baseline_seconds),
            ratio=middle,
            spread=(quartiles[2] - quartiles[0]) / middle if middle > 0 else math.inf,
            rounds=len(ratios),
        )

    @property
    def noisy(self) -> bool:
        """Whether the spread makes the ratio meaningless (more than :data:`NOISY_SPREAD`)."""
        return self.spread > NOISY_SPREAD

    def row(self, name: str, target: float | None, /, **extra: Any) -> dict[str, Any]:
        """The result dict for ``run(quick)``: :func:`result`'s keys plus the statistics."""
        return {
            **result(name, self.seconds, self.baseline_seconds, target),
            "ratio": self.ratio,
            "min_seconds": self.min_seconds,
            "baseline_min_seconds": self.baseline_min_seconds,
            "spread": self.spread,
            "rounds": self.rounds,
            "noisy": self.noisy,
            **extra,
        }


def compare(
    candidate: Callable[[], object],
    baseline: Callable[[], object],
    /,
    *,
    rounds: int = 15,
    number: int = 1,
    warmup: int = 1,
) -> Timing:
    """Time ``candidate`` against ``baseline``: the one timing loop every benchmark uses.

    After ``warmup`` untimed calls of each, every round times ``number`` calls of the candidate
    and then ``number`` calls of the baseline, so both see the same machine state; the per-call
    seconds of each round give the statistics of :class:`Timing`.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._tools.benchmarking import compare
        >>> timing = compare(lambda: sum(range(2000)), lambda: sum(range(1000)), rounds=5)
        >>> timing.rounds, timing.ratio > 1
        (5, True)
    """
    if rounds < 1 or number < 1 or warmup < 0:
        raise ValueError(
            f"rounds and number must be >= 1 and warmup >= 0, got rounds={rounds}, "
            f"number={number}, warmup={warmup}."
        )
    for _ in range(warmup):
        candidate()
        baseline()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        for fn, times in ((candidate, ours), (baseline, theirs)):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            times.append((time.perf_counter() - start) / number)
    return Timing.of(ours, theirs)


@contextlib.contextmanager
def pinned_blas_threads() -> Iterator[str]:
    """Run the block with one BLAS/OpenMP thread per process thread; yields what was done.

    Benchmarks on few cores are otherwise at the mercy of BLAS: four replica threads each
    starting a pool of OpenBLAS threads over-subscribe a 2-core machine and made the
    data-parallel row swing from 0.27x to 28.7x between runs. threadpoolctl (the ``cli`` extra)
    limits every BLAS and OpenMP pool the process has loaded.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._tools.benchmarking import pinned_blas_threads
        >>> with pinned_blas_threads() as state:
        ...     state in ("1 BLAS thread", "unpinned (threadpoolctl is not installed)")
        True
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield "unpinned (threadpoolctl is not installed)"
        return
    with threadpool_limits(limits=1):
        yield "1 BLAS thread"


def default_suite_dir() -> Path | None:
    """The benchmark suite: ``benchmarks/`` of a source checkout, else the installed copy.

    In a checkout the suite is the ``benchmarks/`` directory beside the package, the place people
    read and edit it. A wheel ships the same modules as the package ``cupy_parallel.benchmarks``
    (see ``pyproject.toml``), so ``cupy-parallel bench`` runs after ``pip install`` too. ``None``
    when neither exists.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._tools.benchmarking import default_suite_dir
        >>> default_suite_dir().name
        'benchmarks'
    """
    checkout = Path(cupy_parallel.__file__).resolve().parent.parent / "benchmarks"
    if checkout.is_dir():
        return checkout
    spec = importlib.util.find_spec("cupy_parallel.benchmarks")
    if spec is None or not spec.submodule_search_locations:
        return None
    installed = Path(next(iter(spec.submodule_search_locations)))
    return installed if installed.is_dir() else None


def _defines_run(path: Path) -> bool:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return True  # run it, so that the failure is reported with its reason
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run"
        for node in tree.body
    )


def discover(directory: Path, /) -> list[Path]:
    r"""The benchmark modules of a suite: ``bench_*.py`` files defining ``run``, sorted by name.

    Example:
        >>> import tempfile
        >>> suite = Path(tempfile.mkdtemp())
        >>> _ = (suite / "bench_a.py").write_text("def run(quick):\n    return []\n")
        >>> _ = (suite / "bench_helper.py").write_text("def timeit():\n    pass\n")
        >>> [p.name for p in discover(suite)]
        ['bench_a.py']
    """
    return [p for p in sorted(Path(directory).glob("bench_*.py")) if _defines_run(p)]


def _plain(value: Any) -> Any:
    """JSON-ready copies of NumPy scalars and arrays; anything else unknown becomes its str."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _check_results(results: Any) -> list[dict[str, Any]]:
    if not isinstance(results, list | tuple):
        raise TypeError(f"run(quick) must return a list of dicts, got {type(results).__name__}")
    for index, row in enumerate(results):
        if not isinstance(row, dict):
            raise TypeError(f"result {index} must be a dict, got {type(row).__name__}")
        missing = [key for key in REQUIRED_KEYS if key not in row]
        if missing:
            raise ValueError(f"result {index} ({row.get('name', '?')!r}) lacks keys {missing}")
    return [json.loads(json.dumps(row, default=_plain)) for row in results]


def run_module(path: Path, /, *, quick: bool) -> dict[str, Any]:
    """Import one benchmark module from ``path``, call its ``run(quick)``, and record the outcome.

    The module's directory is put on ``sys.path`` while it runs, so it can import its helpers.

    Returns:
        ``{"name", "path", "ok", "error", "seconds", "results"}``: ``error`` is ``None`` or the
        reason it failed (the exception's type and message; ``traceback`` holds the details).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "bench_one.py"
        >>> _ = path.write_text('''def run(quick):
        ...     return [{"name": "x", "seconds": 1.0, "baseline_seconds": 2.0,
        ...              "ratio": 0.5, "target": 1.0}]''')
        >>> outcome = run_module(path, quick=True)
        >>> outcome["ok"], outcome["results"][0]["ratio"]
        (True, 0.5)
    """
    outcome: dict[str, Any] = {
        "name": path.stem,
        "path": str(path),
        "ok": False,
        "error": None,
        "seconds": 0.0,
        "results": [],
    }
    directory = str(path.parent.resolve())
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    start = time.perf_counter()
    try:
        spec = importlib.util.spec_from_file_location(f"_cupy_parallel_bench_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "run", None)):
            raise TypeError(f"{path.name} defines no run(quick) function")
        outcome["results"] = _check_results(module.run(quick))
        outcome["ok"] = True
    except Exception as error:  # noqa: BLE001 - a failing suite is a row of the report
        lines = str(error).strip().splitlines()
        outcome["error"] = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        outcome["traceback"] = traceback.format_exc()
    finally:
        outcome["seconds"] = time.perf_counter() - start
        if added:
            sys.path.remove(directory)
    return outcome


def run_all(
    modules: Sequence[Path],
    /,
    *,
    quick: bool,
    machine: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    r"""Run every module with :func:`run_module`, showing progress on stderr; return the report.

    The suites run with BLAS pinned to one thread (:func:`pinned_blas_threads`). The report is
    what ``bench.json`` holds: ``cupy_parallel`` (version), ``created`` (UTC, ISO 8601),
    ``quick``, ``blas_threads`` (what the pinning did), ``machine`` (what ``machine()``
    returns, e.g. ``cupy-parallel info`` as a dict; it is called after the suites ran, so that
    probing CUDA or MPI initialises nothing before a benchmark starts) and ``suites`` (one
    :func:`run_module` outcome each).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "bench_bad.py"
        >>> _ = path.write_text("import no_such_module_here\ndef run(quick):\n    return []\n")
        >>> report = run_all([path], quick=True)
        >>> report["suites"][0]["error"]
        "ModuleNotFoundError: No module named 'no_such_module_here'"
    """
    report: dict[str, Any] = {
        "cupy_parallel": cupy_parallel.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": {},
        "suites": [],
    }
    try:
        from tqdm import tqdm
    except ImportError:  # no bar: the line printed after each suite is the progress display
        bar = None
    else:  # disable=None: a bar on a terminal, none in a log file
        bar = tqdm(total=len(modules), desc="bench", unit="suite", file=sys.stderr, disable=None)
    try:
        with pinned_blas_threads() as blas:
            report["blas_threads"] = blas
            for path in modules:
                if bar is not None:
                    bar.set_postfix_str(path.stem)
                outcome = run_module(path, quick=quick)
                report["suites"].append(outcome)
                status = "ok" if outcome["ok"] else f"FAILED ({outcome['error']})"
                line = f"{path.stem}: {status} in {outcome['seconds']:.1f} s"
                if bar is None:
                    print(line, file=sys.stderr, flush=True)
                else:
                    bar.write(line, file=sys.stderr)
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if machine is not None:
        report["machine"] = machine()
    return report


def _rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(s["name"], r) for s in report["suites"] for r in s["results"]]


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _meets(row: dict[str, Any]) -> bool | None:
    target, ratio = _number(row.get("target")), _number(row.get("ratio"))
    if math.isnan(target) or math.isnan(ratio):
        return None
    return ratio <= target


def plot_ratios(report: dict[str, Any], path: Path, /) -> Path | None:
    """Bar chart of every result's ratio with its target marked; ``None`` when there is no result.

    The ratio axis is logarithmic and each bar runs from 1 (as fast as the baseline, the dashed
    line) to the ratio, left when faster, right when slower. Bars are green where the ratio meets
    the target (ratio <= target), red where it misses, grey where there is no target; a black
    tick marks each target.

    Example:
        >>> import tempfile
        >>> report = {"suites": [{"name": "s", "results": [
        ...     {"name": "a", "ratio": 0.5, "target": 1.0}]}]}
        >>> plot_ratios(report, Path(tempfile.mkdtemp()) / "r.png").stat().st_size > 0
        True
    """
    from matplotlib.figure import Figure

    rows = _rows(report)
    if not rows:
        return None
    labels = [f"{suite}: {row['name']}" for suite, row in rows]
    ratios = [_number(row["ratio"]) for _, row in rows]
    colours = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    figure = Figure(figsize=(11, 1.4 + 0.32 * len(rows)), dpi=100)
    axes = figure.add_subplot()
    ys = np.arange(len(rows))
    colour = [colours[_meets(row)] for _, row in rows]
    axes.barh(ys, [r - 1.0 for r in ratios], left=1.0, color=colour, alpha=0.6)
    axes.scatter(ratios, ys, color=colour, zorder=3)  # visible where the ratio is about 1
    for y, ratio in zip(ys, ratios, strict=True):
        axes.annotate(
            f"{ratio:.3g}", (ratio, y), xytext=(6, -3), textcoords="offset points", fontsize=7
        )
    axes.set_xscale("log")
    targets = [(y, _number(row.get("target"))) for y, (_, row) in zip(ys, rows, strict=True)]
    marked = [(y, t) for y, t in targets if not math.isnan(t)]
    if marked:
        axes.scatter(
            [t for _, t in marked],
            [y for y, _ in marked],
            marker="|",
            s=300,
            c="black",
            zorder=3,
            label="target",
        )
        axes.legend(loc="best")
    axes.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    axes.set_yticks(ys, labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("seconds / baseline seconds (log scale; lower is better)")
    axes.set_title(f"cupy_parallel benchmarks ({report.get('machine', {}).get('platform', '?')})")
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


_SIZE = re.compile(r"[\s,=:_-]*\b\d+(?:\.\d+)?\s*(?:[KMGT]i?B|B|bytes)\b", re.IGNORECASE)


def _series(name: str) -> str:
    """A result's name without its size, so that the sizes of one transfer form one line."""
    words = " ".join(_SIZE.sub(" ", name).split())
    return re.sub(r"\s+([,;:)])", r"\1", words) or name


def plot_bandwidth(report: dict[str, Any], path: Path, /) -> Path | None:
    """Bandwidth (bytes / seconds) against size for results carrying ``bytes``; else ``None``.

    Results whose names differ only in a size (``"broadcast 1 MiB"``, ``"broadcast 4 MiB"``)
    form one line; the baseline of each line is drawn dashed.

    Example:
        >>> import tempfile
        >>> rows = [{"name": f"copy {n} KiB", "bytes": n * 1024, "seconds": n * 1e-6,
        ...          "baseline_seconds": n * 2e-6, "ratio": 0.5, "target": 1.0} for n in (1, 4)]
        >>> report = {"suites": [{"name": "s", "results": rows}]}
        >>> plot_bandwidth(report, Path(tempfile.mkdtemp()) / "b.png").stat().st_size > 0
        True
    """
    from matplotlib.figure import Figure

    lines: dict[str, list[tuple[float, float, float]]] = {}
    for suite, row in _rows(report):
        size = _number(row.get("bytes"))
        if math.isnan(size) or size <= 0:
            continue
        seconds, baseline = _number(row["seconds"]), _number(row["baseline_seconds"])
        lines.setdefault(f"{suite}: {_series(str(row['name']))}", []).append(
            (
                size,
                size / seconds if seconds > 0 else math.nan,
                size / baseline if baseline > 0 else math.nan,
            )
        )
    if not lines:
        return None
    figure = Figure(figsize=(8, 5), dpi=100)
    axes = figure.add_subplot()
    for label, points in sorted(lines.items()):
        points.sort()
        sizes = [p[0] for p in points]
        (line,) = axes.plot(sizes, [p[1] / 1e9 for p in points], marker="o", label=label)
        axes.plot(
            sizes,
            [p[2] / 1e9 for p in points],
            linestyle="--",
            marker="x",
            color=line.get_color(),
        )
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("bytes")
    axes.set_ylabel("GB/s (o: cupy_parallel, x and dashed: baseline)")
    axes.set_title("bandwidth against size")
    axes.grid(visible=True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def write_outputs(report: dict[str, Any], directory: Path, /) -> list[Path]:
    """Write ``bench.json`` and the PNG plots that have data into ``directory``; return the paths.

    Example:
        >>> import tempfile
        >>> report = {"machine": {}, "suites": [{"name": "s", "ok": True, "results": [
        ...     {"name": "a", "seconds": 1.0, "baseline_seconds": 1.0, "ratio": 1.0,
        ...      "target": 2.0}]}]}
        >>> [p.name for p in write_outputs(report, Path(tempfile.mkdtemp()))]
        ['bench.json', 'bench_ratios.png']
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / JSON_NAME
    json_path.write_text(json.dumps(report, indent=2, default=_plain) + "\n", encoding="utf-8")
    written = [json_path]
    for plot, name in ((plot_ratios, RATIOS_PNG), (plot_bandwidth, BANDWIDTH_PNG)):
        path = plot(report, directory / name)
        if path is not None:
            written.append(path)
    return written


_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))


def _unit(values: Sequence[float]) -> tuple[str, float]:
    """One unit for a column: the largest in which its median value is at least 1."""
    finite = sorted(v for v in values if not math.isnan(v) and v > 0)
    if not finite:
        return _UNITS[0]
    middle = finite[len(finite) // 2]
    return next(((u, s) for u, s in _UNITS if middle >= s), _UNITS[-1])


def _status(row: dict[str, Any]) -> str:
    if row.get("noisy"):
        return "noisy: no verdict"
    return {True: "ok", False: "misses target", None: "no target"}[_meets(row)]


def format_table(report: dict[str, Any], /) -> str:
    """The results as a text table: one row per result, one per failed suite.

    Both time columns use one unit, chosen for the whole table. A row with ``"unit": "bytes"``
    (a memory measurement: its ``seconds`` and ``baseline_seconds`` hold bytes) shows them as
    bytes, ``B`` after each, and takes no part in choosing the time unit. ``spread`` is the
    interquartile range of the per-round ratios over their median (rows timed with
    :func:`compare`); a row whose spread exceeds :data:`NOISY_SPREAD` gets no verdict against
    its target.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._tools.benchmarking import format_table
        >>> report = {"suites": [
        ...     {"name": "s", "ok": True, "results": [{"name": "a", "seconds": 0.002,
        ...      "baseline_seconds": 0.004, "ratio": 0.5, "target": 1.0, "spread": 0.05},
        ...      {"name": "b", "seconds": 0.0005, "baseline_seconds": 0.0004, "ratio": 1.25,
        ...      "target": 1.0, "spread": 0.6, "noisy": True},
        ...     {"name": "m", "seconds": 3072, "baseline_seconds": 4096, "ratio": 0.75,
        ...      "target": 0.8, "unit": "bytes"}]},
        ...     {"name": "t", "ok": False, "error": "ImportError: no cupy", "results": []}]}
        >>> print(format_table(report))
        suite  benchmark  ms       baseline ms  ratio  spread  target  status
        s      a          2        4            0.5    5%      1       ok
        s      b          0.5      0.4          1.25   60%     1       noisy: no verdict
        s      m          3,072 B  4,096 B      0.75   -       0.8     ok
        t      -          -        -            -      -       -       FAILED: ImportError: no cupy
    """
    rows = _rows(report)
    unit, scale = _unit(
        [
            _number(r[key])
            for _, r in rows
            if r.get("unit") != "bytes"
            for key in ("seconds", "baseline_seconds")
        ]
    )

    def seconds(value: Any, row: dict[str, Any]) -> str:
        number = _number(value)
        if math.isnan(number):
            return "-"
        if row.get("unit") == "bytes":
            return f"{number:,.0f} B"
        number /= scale
        return f"{number:,.0f}" if abs(number) >= 1000 else f"{number:.4g}"

    header = ("suite", "benchmark", unit, f"baseline {unit}", "ratio", "spread", "target", "status")
    table: list[tuple[str, ...]] = [header]
    for suite in report["suites"]:
        if not suite["ok"]:
            failed = ("-",) * (len(header) - 2)
            table.append((suite["name"], *failed, f"FAILED: {suite['error']}"))
            continue
        for row in suite["results"]:
            target, spread = _number(row.get("target")), _number(row.get("spread"))
            table.append(
                (
                    suite["name"],
                    str(row["name"]),
                    seconds(row["seconds"], row),
                    seconds(row["baseline_seconds"], row),
                    f"{_number(row['ratio']):.3g}",
                    "-" if math.isnan(spread) else f"{spread:.0%}",
                    "-" if math.isnan(target) else f"{target:.3g}",
                    _status(row),
                )
            )
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(line, widths, strict=False)), line[-1]])
        for line in table
    )


def script_main(
    run: Callable[[bool], Sequence[dict[str, Any]]],
    name: str,
    description: str,
    /,
    *,
    quick_help: str = "smaller sizes, fewer repeats",
    argv: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """The command line of one benchmark module: ``python bench_x.py [--quick] [--json PATH]``.

    Calls ``run(quick)`` with BLAS pinned to one thread, checks its rows as the suite runner does,
    prints them with :func:`format_table` (as suite ``name``) and, with ``--json PATH``, writes
    them there.

    Returns:
        The checked rows.

    Example:
        >>> def run(quick):
        ...     return [{"name": "x", "seconds": 1e-3, "baseline_seconds": 2e-3, "ratio": 0.5,
        ...              "target": 1.0}]
        >>> rows = script_main(run, "bench_x", "Times x.", argv=["--quick"])
        suite    benchmark  ms  baseline ms  ratio  spread  target  status
        bench_x  x          1   2            0.5    -       1       ok
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    with pinned_blas_threads():
        rows = _check_results(run(args.quick))
    print(format_table({"suites": [{"name": name, "ok": True, "results": rows}]}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return rows


def polled_as_the_backend_polls(ranks: int, /) -> Callable[[Any], None]:
    """A ``wait(request)`` for raw mpi4py baselines that polls as the library's MPI backend does.

    ``request.Test()`` a few times, then the core yielded: every 4 tests when ``ranks`` outnumber
    this machine's cores, else every 64 (``MPIBackend.create_world``), so that a baseline and
    the library share the cores alike.
    """
    per_yield = range(4 if ranks > (os.cpu_count() or 1) else 64)

    def wait(request: Any) -> None:
        while True:
            for _ in per_yield:
                if request.Test():
                    return
            os.sched_yield()

    return wait


def under_mpiexec() -> bool:
    """Whether this process is a rank that ``mpiexec`` started (MPICH's, Open MPI's, PMIx's)."""
    return any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def run_ranks(script: str, ranks: int, /, *, quick: bool, timeout: float = 900) -> list[Any]:
    """Run ``script --worker`` on ``ranks`` MPI processes; the rows its first rank printed.

    The script's worker mode (:func:`mpi_script_main`) prints them on a line ``ROWS <json>``.
    """
    from cupy_parallel._tools.launch import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise RuntimeError(f"{Path(script).stem} needs mpiexec (pip install mpich).")
    command = [mpiexec, "-n", str(ranks), sys.executable, str(Path(script).resolve()), "--worker"]
    if quick:
        command.append("--quick")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"mpiexec -n {ranks} failed:\n{done.stderr[-3000:]}{done.stdout[-3000:]}"
        )
    marker = next(line for line in done.stdout.splitlines() if line.startswith("ROWS "))
    rows: list[Any] = json.loads(marker[5:])
    return rows


def mpi_script_main(
    measure: Callable[[bool], Sequence[dict[str, Any]]],
    run: Callable[[bool], Sequence[dict[str, Any]]],
    name: str,
    description: str,
    /,
    *,
    quick_help: str = "fewer rounds",
) -> None:
    """The command line of a benchmark whose ranks are MPI processes.

    ``python bench_x.py`` starts the ranks (``run``, through :func:`run_ranks`) and prints their
    rows as :func:`script_main` does; under ``mpiexec`` every rank measures (``measure``) and the
    first prints; ``--worker`` is the mode :func:`run_ranks` starts, which prints ``ROWS <json>``.
    Every rank measures with BLAS pinned to one thread (:func:`pinned_blas_threads`): two ranks'
    OpenBLAS pools on two cores made each ``D = 512`` matmul of ``bench_sharded`` 20x slower
    (a step of 0.52 s against 0.027 s), which every variant's row then measured instead.
    """
    argv = sys.argv[1:]
    quick = "--quick" in argv
    if "--worker" in argv:
        with pinned_blas_threads():
            rows = measure(quick)
        if rows:
            print("ROWS " + json.dumps(rows), flush=True)
        return
    if under_mpiexec():
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() != 0:
            with pinned_blas_threads():  # as script_main pins the first rank's
                measure(quick)
            return
    script_main(measure if under_mpiexec() else run, name, description, quick_help=quick_help)
