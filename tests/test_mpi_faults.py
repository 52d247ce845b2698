"""The fault matrix: a failing rank ends an MPI job within seconds, with its exit code.

{raise, sys.exit(3), SIGKILL, SIGINT, skip a collective, stall} x {``cupy-parallel launch
--backend mpi``, plain ``mpiexec``} x {2, 3 ranks}, run by mpi_workers/fault_worker.py with a 3 s
group timeout. Each job must end within 15 s with the failing rank's code (the launcher names
the rank; ``mpiexec`` reports a rank killed by signal N as N, MPICH's convention), and leave no
process behind. The cases run a few at a time, in threads.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from cupy_parallel._tools.launch import find_mpiexec

WORKER = Path(__file__).parent / "mpi_workers" / "fault_worker.py"
MPIEXEC = find_mpiexec()
LAUNCHER = "import sys; from cupy_parallel._tools.launch import main; sys.exit(main())"
LIMIT_S = 15.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.mpi,
    pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)"),
]


class Case(NamedTuple):
    mode: str
    ranks: int
    launcher_code: int  # what cupy-parallel launch exits with
    mpiexec_code: int  # what mpiexec exits with
    culprit: str  # the rank the launcher names (a regex)


def cases() -> list[Case]:
    out = []
    for n in (2, 3):
        last = str(n - 1)
        out += [
            Case("raise", n, 1, 1, last),
            Case("exit3", n, 3, 3, last),
            Case("sigkill", n, 128 + signal.SIGKILL, signal.SIGKILL, last),
            Case("sigint", n, 128 + signal.SIGINT, 128 + signal.SIGINT, last),
            # the others time out in the all_reduce the last rank never joins
            Case("skip", n, 1, 1, f"[0-{n - 2}]"),
            Case("stall", n, 1, 1, f"[0-{n - 2}]"),
        ]
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def run_case(case: Case, via: str, *worker_args: str) -> str | None:
    """Run one case; return what went wrong, or None."""
    with tempfile.TemporaryDirectory() as piddir:
        if via == "mpiexec":
            command = [str(MPIEXEC), "-n", str(case.ranks), sys.executable]
        else:
            command = [sys.executable, "-c", LAUNCHER, "--backend", "mpi", "--master-port", "0"]
            command += ["--nproc-per-node", str(case.ranks), "--grace-period", "2"]
        command += [str(WORKER), case.mode, piddir, *worker_args]
        start = time.monotonic()
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=60, check=False
            )
        except subprocess.TimeoutExpired:
            return f"{case} via {via}: still running after 60 s"
        elapsed = time.monotonic() - start
        pids = [
            int(Path(piddir, name).read_text()) for name in os.listdir(piddir) if name.isdigit()
        ]
        deadline = time.monotonic() + 3
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in pids if not _gone(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    expected = case.mpiexec_code if via == "mpiexec" else case.launcher_code
    problems = []
    if len(pids) != case.ranks:
        problems.append(f"only {len(pids)} ranks started")
    if result.returncode != expected:
        problems.append(f"exit code {result.returncode}, expected {expected}")
    if elapsed > LIMIT_S:
        problems.append(f"took {elapsed:.1f} s")
    if left:
        problems.append(f"processes left behind: {left}")
    if via == "launcher":
        named = rf"rank {case.culprit} exited with code {expected}; stopped the other ranks\."
        if not re.search(named, result.stderr):
            problems.append(f"launcher did not name the rank ({named!r})")
    if problems:
        return f"{case} via {via}: {'; '.join(problems)}\n{result.stderr[-1500:]}"
    return None


@pytest.mark.parametrize("via", ["launcher", "mpiexec"])
def test_fault_matrix(via: str) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        problems = [p for p in pool.map(lambda c: run_case(c, via), cases()) if p is not None]
    assert not problems, "\n\n".join(problems)


def test_the_quit_builtin_ends_the_job_too() -> None:
    assert run_case(Case("quit4", 2, 4, 4, "1"), "mpiexec") is None


@pytest.mark.parametrize("via", ["launcher", "mpiexec"])
def test_a_rank_that_left_ends_the_job_before_the_timeout(via: str) -> None:
    """``raise SystemExit(3)`` and a skipped collective, with a 60 s group timeout: the others
    learn that the rank's program ended and fail within seconds (exit code 1, their own)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = pool.map(
            lambda mode: run_case(Case(mode, 2, 1, 1, "0"), via, "60"), ["raise-systemexit", "skip"]
        )
        assert [p for p in problems if p is not None] == []
