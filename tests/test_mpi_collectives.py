"""The MPI backend with real processes: mpiexec -n N runs mpi_workers/collectives_worker.py.

Each worker checks every collective (every root, dtype and reduction) against NumPy and exits
non-zero on a mismatch; the fault modes check that no failure hangs the job.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "mpi_workers" / "collectives_worker.py"
MPIEXEC = shutil.which("mpiexec")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)"),
]


def launch(
    ranks: int, mode: str, *args: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    start = time.monotonic()
    result = subprocess.run(
        [str(MPIEXEC), "-n", str(ranks), sys.executable, str(WORKER), mode, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    return result, time.monotonic() - start


@pytest.mark.parametrize("ranks", [2, 3, 4], ids=lambda n: f"{n}ranks")
def test_every_collective_matches_numpy(ranks: int) -> None:
    result, _ = launch(ranks, "all")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


def test_init_destroy_init_on_one_store(tmp_path: Path) -> None:
    """Three worlds on a user's store; stores opened from init_method close with their world."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result, _ = launch(2, "reinit", str(tmp_path), str(port))
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("rank 0: 24 checks passed") == 1, result.stdout
    assert not (tmp_path / "user").exists()  # the user closed their store at the end


def test_timeout_raises_then_aborts_the_job() -> None:
    result, seconds = launch(2, "timeout", timeout=60)
    assert result.returncode != 0
    assert seconds < 30
    assert (
        "CAUGHT TimeoutError: all_reduce on process group '0' did not complete within 3 s"
        in result.stderr
    )
    assert (
        "CAUGHT RuntimeError: process group '0' is unusable: all_reduce timed out" in result.stderr
    )
    assert "cupy_parallel: aborting the MPI job" in result.stderr


def test_rank_missing_at_init_times_out() -> None:
    result, seconds = launch(2, "init-timeout", timeout=60)
    assert result.returncode != 0
    assert seconds < 30
    assert (
        "CAUGHT TimeoutError: init_process_group (duplicating MPI.COMM_WORLD) on process group "
        "'0' did not complete within 2 s" in result.stderr
    )


def test_dead_peer_ends_the_job_non_zero() -> None:
    result, seconds = launch(2, "die", timeout=60)
    assert result.returncode != 0
    assert seconds < 30


@pytest.mark.gpu
def test_cupy_arrays_through_mpi() -> None:
    result, _ = launch(2, "cupy")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == 2, result.stdout
