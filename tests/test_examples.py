"""examples/: the training loop killed mid-run and resumed ends with an uninterrupted run's bits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from thread_ranks import MPIEXEC, ROOT

import cupy_parallel as cp
from cupy_parallel._tools.launch import main

if TYPE_CHECKING:
    from pathlib import Path

SCRIPT = str(ROOT / "examples" / "train_resume.py")


@pytest.mark.slow  # ~25 s: two 2-rank jobs under mpiexec, one of them started twice
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_a_killed_and_resumed_run_ends_with_the_uninterrupted_parameters(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    launch = ["--nproc-per-node", "2", "--backend", "mpi", "--master-port", "0"]
    assert main([*launch, SCRIPT, str(whole)]) == 0
    assert main([*launch, "--max-restarts", "1", SCRIPT, str(resumed), "--kill-at", "13"]) == 0
    out, err = capfd.readouterr()
    assert "rank 1 exited with code 137; stopped the other ranks." in err
    assert "restarting the job (1 of 1 restarts)." in err
    assert "rank 0: start 1 resumed at step 10" in out  # the checkpoint of step 10, not 13
    expected = cp.load(whole / "final.safetensors")
    got = cp.load(resumed / "final.safetensors")
    assert sorted(got) == sorted(expected) == ["b1", "b2", "w1", "w2"]
    for key, array in expected.items():
        assert got[key].dtype == array.dtype
        assert got[key].tobytes() == array.tobytes(), key  # bit for bit
    # and the run did train: the parameters moved from their initial values
    assert expected["b2"].tobytes() != bytes(8)
