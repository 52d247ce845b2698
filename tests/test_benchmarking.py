"""The bench harness's timing: ``compare``'s statistics against a scripted clock, BLAS pinning.

A fake ``time.perf_counter`` that each timed function advances by a scripted amount makes the
expected medians, ratios and spreads exact numbers (the oracle), whatever the machine does.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from cupy_parallel._tools import benchmarking
from cupy_parallel._tools.benchmarking import NOISY_SPREAD, compare, pinned_blas_threads


class ScriptedClock:
    """``perf_counter`` stand-in: a function ``tick(seconds)`` moves it forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ScriptedClock:
    fake = ScriptedClock()
    monkeypatch.setattr(benchmarking.time, "perf_counter", fake)
    return fake


def test_compare_pairs_rounds_and_reports_medians(clock: ScriptedClock) -> None:
    ours = iter([9.0, 9.0, 3.0, 2.0, 2.0, 2.0, 4.0])  # first value: the warm-up call
    theirs = iter([1.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    timing = compare(lambda: clock.tick(next(ours)), lambda: clock.tick(next(theirs)), rounds=6)
    per_round = [9.0, 3.0, 2.0, 2.0, 2.0, 4.0], [1.0, 1.0, 1.0, 2.0, 1.0, 1.0]
    ratios = sorted(a / b for a, b in zip(*per_round, strict=True))
    assert timing.seconds == statistics.median(per_round[0])
    assert timing.baseline_seconds == statistics.median(per_round[1])
    assert timing.min_seconds == 2.0
    assert timing.baseline_min_seconds == 1.0
    assert timing.ratio == statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    assert timing.spread == pytest.approx((q3 - q1) / statistics.median(ratios))
    assert timing.noisy is (timing.spread > NOISY_SPREAD)
    assert timing.rounds == 6


def test_compare_divides_by_number_and_a_steady_pair_is_not_noisy(clock: ScriptedClock) -> None:
    calls = {"ours": 0, "theirs": 0}

    def ours() -> None:
        calls["ours"] += 1
        clock.tick(3e-6)

    def theirs() -> None:
        calls["theirs"] += 1
        clock.tick(2e-6)

    timing = compare(ours, theirs, rounds=4, number=10, warmup=2)
    assert calls == {"ours": 42, "theirs": 42}
    assert timing.seconds == pytest.approx(3e-6)
    assert timing.ratio == pytest.approx(1.5)
    assert timing.spread == pytest.approx(0.0, abs=1e-9)
    assert not timing.noisy
    row = timing.row("x", 2.0, bytes=8)
    assert row["ratio"] == pytest.approx(1.5)
    assert row["noisy"] is False
    assert row["bytes"] == 8
    assert set(benchmarking.REQUIRED_KEYS) <= set(row)


@pytest.mark.parametrize(
    ("rounds", "number", "warmup"),
    [(0, 1, 1), (1, 0, 1), (1, 1, -1)],
    ids=["rounds", "number", "warmup"],
)
def test_compare_refuses_empty_measurements(rounds: int, number: int, warmup: int) -> None:
    with pytest.raises(ValueError, match=r"rounds and number must be >= 1 and warmup >= 0"):
        compare(lambda: None, lambda: None, rounds=rounds, number=number, warmup=warmup)


def test_noisy_rows_get_no_verdict_in_the_table() -> None:
    rows = [
        {"name": "steady", "seconds": 2e-3, "baseline_seconds": 1e-3, "ratio": 2.0,
         "target": 3.0, "spread": 0.1, "noisy": False},
        {"name": "swinging", "seconds": 2e-3, "baseline_seconds": 1e-3, "ratio": 2.0,
         "target": 3.0, "spread": 0.9, "noisy": True},
    ]  # fmt: skip
    table = benchmarking.format_table({"suites": [{"name": "s", "ok": True, "results": rows}]})
    lines = table.splitlines()
    assert lines[1].endswith("ok")
    assert lines[2].endswith("noisy: no verdict")
    assert "90%" in lines[2]


def test_pinned_blas_threads_limits_blas_and_restores_it() -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    np.dot(np.ones((64, 64)), np.ones((64, 64)))  # make sure NumPy's BLAS is loaded
    before = [pool["num_threads"] for pool in threadpoolctl.threadpool_info()]
    with pinned_blas_threads() as state:
        inside = [pool["num_threads"] for pool in threadpoolctl.threadpool_info()]
    assert state == "1 BLAS thread"
    assert inside
    assert all(n == 1 for n in inside)
    assert [pool["num_threads"] for pool in threadpoolctl.threadpool_info()] == before


def test_table_uses_one_unit_and_writes_large_values_without_exponents() -> None:
    rows = [
        {"name": "small", "seconds": 2e-6, "baseline_seconds": 3e-6, "ratio": 2 / 3, "target": 1},
        {"name": "small2", "seconds": 4e-6, "baseline_seconds": 5e-6, "ratio": 0.8, "target": 1},
        {"name": "large", "seconds": 0.0367, "baseline_seconds": 0.051, "ratio": 0.72, "target": 1},
    ]
    table = benchmarking.format_table({"suites": [{"name": "s", "ok": True, "results": rows}]})
    header, small, _, large = table.splitlines()
    assert header.split()[2:5] == ["us", "baseline", "us"]
    assert small.split()[2:4] == ["2", "3"]
    assert large.split()[2:4] == ["36,700", "51,000"]


_RANKS_SCRIPT = """
import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info

from cupy_parallel._tools.benchmarking import mpi_script_main, run_ranks


def measure(quick):
    np.dot(np.ones((64, 64)), np.ones((64, 64)))
    mine = max(pool["num_threads"] for pool in threadpool_info())
    every = MPI.COMM_WORLD.allgather(mine)
    if MPI.COMM_WORLD.Get_rank() != 0:  # the first rank reports, as the benchmarks do
        return []
    row = {"name": f"BLAS threads by rank: {every}", "seconds": 1.0, "baseline_seconds": 1.0}
    return [{**row, "ratio": 1.0, "target": None, "every": every}]


mpi_script_main(measure, lambda quick: run_ranks(__file__, 2, quick=quick), "pins", "pins")
"""


@pytest.mark.mpi
def test_every_rank_of_an_mpi_benchmark_measures_with_one_blas_thread(tmp_path: Any) -> None:
    """Seen before: only the first rank was pinned; ``bench_sharded``'s other ranks ran two
    OpenBLAS threads each on a 2-core machine, which made every ``D = 512`` matmul about 20x
    slower (a step of 0.52 s against 0.027 s) and every variant's ratio about 1.0."""
    pytest.importorskip("threadpoolctl")
    from thread_ranks import MPIEXEC

    if MPIEXEC is None:
        pytest.skip("needs mpiexec (pip install mpich)")
    script = tmp_path / "bench_pins.py"
    script.write_text(_RANKS_SCRIPT)
    rows = benchmarking.run_ranks(str(script), 2, quick=True, timeout=120)  # --worker mode
    assert rows[0]["every"] == [1, 1]
    done = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BLAS threads by rank: [1, 1]" in done.stdout, done.stdout


def test_memory_rows_show_bytes_and_leave_the_time_unit_to_the_timed_rows() -> None:
    rows = [
        {"name": "step", "seconds": 0.025, "baseline_seconds": 0.020, "ratio": 1.25, "target": 1.2},
        {"name": "memory", "seconds": 20_987_904, "baseline_seconds": 33_570_816,
         "ratio": 20_987_904 / 33_570_816, "target": 0.625, "unit": "bytes"},
    ]  # fmt: skip
    table = benchmarking.format_table({"suites": [{"name": "s", "ok": True, "results": rows}]})
    header, step, memory = table.splitlines()
    assert header.split()[2:5] == ["ms", "baseline", "ms"]  # not chosen from the byte counts
    assert step.split()[2:4] == ["25", "20"]
    assert memory.split()[2:6] == ["20,987,904", "B", "33,570,816", "B"]
    assert memory.endswith("misses target")  # 0.62518 > 0.625: the verdict is the ratio's
