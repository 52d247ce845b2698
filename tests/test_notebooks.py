"""The tutorial notebooks run top to bottom and print what they claim."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_parallel._tools.launch import find_mpiexec

pytestmark = pytest.mark.slow  # each notebook runs in a kernel of its own

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 120


def checkout_env() -> dict[str, str]:
    """This environment, with this checkout first on the path (the kernel imports it, not an
    installed copy)."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *([path] if path else [])]))


def execute(name: str, workdir: Path) -> tuple[str, list[dict]]:
    """Run a notebook in a fresh python3 kernel; return its printed text and all outputs."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute(env=checkout_env())
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    return text, outputs


def test_tour(tmp_path: Path) -> None:
    text, _ = execute("01_tour.ipynb", tmp_path)
    assert "TypeError:" in text  # a device array met a plain NumPy array
    assert re.search(r"ValueError: device \w+:\d+ does not exist", text)
    assert "round trip equal: True" in text
    total, expected = re.search(r"sum over devices: (\S+) = (\S+)", text).groups()
    assert float(total) == float(expected)


def test_data_parallel_training(tmp_path: Path) -> None:
    text, outputs = execute("02_data_parallel_training.ipynb", tmp_path)
    assert "tape.gradient: [ 2. -4.  6.]" in text
    assert "gradient of sum(w**2): [ 2. -4.  6.]" in text  # cupy_parallel.grad
    assert "second order: [ 4. -8. 12.]" in text  # grad of a grad
    assert "gradcheck: True" in text
    first, last = map(float, re.search(r"loss: first (\S+), last (\S+)", text).groups())
    assert last < 0.5 * first
    difference = float(re.search(r"max \|DataParallel - one device\| = (\S+)", text).group(1))
    assert difference < 1e-10
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss plot


def test_property_testing(tmp_path: Path) -> None:
    text, _ = execute("03_property_testing.ipynb", tmp_path)
    assert re.search(r"the naive version fails in [1-9]\d* distinct way", text)
    # hypothesis's shrunk counterexample ("Failing test case" since hypothesis 6.16x)
    assert re.search(r"(Falsifying example|Failing test case): round_trip\(", text)
    assert "HypothesisWarning" not in text  # no warning blocks in what users read
    failures = re.findall(r"^- (\w+): .*\n  meaning: (.*)$", text, flags=re.MULTILINE)
    assert failures  # each failure printed with what it means
    assert all(meaning != "another failure: read the example" for _, meaning in failures)
    assert "move_batch: the round-trip property holds on 30 examples" in text
    assert "scatter/gather: the round-trip property holds on 30 examples" in text


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict], Path]:
    """04_distributed_training executed once: its text, outputs and working directory."""
    workdir = tmp_path_factory.mktemp("distributed")
    text, outputs = execute("04_distributed_training.ipynb", workdir)
    return text, outputs, workdir


def test_distributed_training(distributed_run: tuple[str, list[dict], Path]) -> None:
    text, outputs, workdir = distributed_run
    assert re.search(r"^rank 3 of 4: .* -> \[ 0\. 10\. 20\. 30\.\]$", text, flags=re.MULTILINE)
    assert "every rank holds the NumPy sum: True" in text
    assert "every rank ends with rank 0's parameters: True" in text
    first, last = map(float, re.search(r"loss: first (\S+), last (\S+)", text).groups())
    assert last < 0.5 * first
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss plot
    difference = float(re.search(r"max \|DDP - one process\| = (\S+)", text).group(1))
    assert difference < 1e-12
    assert "closed form equal: True" in text
    assert re.search(r"^2 ranks: final loss \S+$", text, flags=re.MULTILINE)
    assert (workdir / "ddp_train.py").is_file()  # written by the notebook


@pytest.mark.mpi
def test_distributed_training_under_the_launcher(
    distributed_run: tuple[str, list[dict], Path],
) -> None:
    """The command the notebook shows, run in its directory: the same bits as its thread ranks."""
    if find_mpiexec() is None:
        pytest.skip("needs mpiexec")
    text, _, workdir = distributed_run
    notebook = nbformat.read(NOTEBOOKS / "04_distributed_training.ipynb", as_version=4)
    shown = "".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    command = shlex.split(re.search(r"^cupy-parallel launch .*$", shown, re.MULTILINE).group(0))
    assert command[2:] == ["--backend", "mpi", "--nproc-per-node", "2", "ddp_train.py"]
    done = subprocess.run(
        [sys.executable, "-m", "cupy_parallel", *command[1:]],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    on_threads = re.search(r"^2 ranks: final loss \S+$", text, flags=re.MULTILINE).group(0)
    assert done.stdout.strip() == on_threads  # rank 0 prints it, bit for bit the same


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == []
            assert cell.execution_count is None


def test_training_state(tmp_path: Path) -> None:
    text, _ = execute("05_training_state.ipynb", tmp_path)
    assert "the job died: spawn: rank 1 failed" in text
    assert "the checkpoint on disk is step 10" in text
    assert "resumed from step 10" in text
    assert "bit for bit the parameters of the uninterrupted run: True" in text
    assert "same losses after the restart: True" in text
    first, last = map(float, re.search(r"loss (\S+) at step 0, (\S+) at step", text).groups())
    assert last < first


def test_sharded_training(tmp_path: Path) -> None:
    text, outputs = execute("06_sharded_training.ipynb", tmp_path)
    assert "loss curves equal: True" in text
    peaks = dict(re.findall(r"^(\S+(?: grad_op)?) +peak bytes per rank +([\d,]+)", text, re.M))
    ddp, fsdp = (int(peaks[k].replace(",", "")) for k in ("ddp", "fsdp"))
    assert fsdp < 0.4 * ddp, peaks  # measured: 0.3 (1/N of the state, plus the units in flight)
    assert int(peaks["fsdp grad_op"].replace(",", "")) > fsdp, peaks
    if "zero1" in peaks:  # ZeroRedundancyOptimizer: Adam's state sharded, measured 0.94 of DDP's
        assert fsdp < int(peaks["zero1"].replace(",", "")) < ddp, peaks
    assert any("image/png" in o.get("data", {}) for o in outputs)  # bars and loss curves
