"""The tutorial notebooks run top to bottom and print what they claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT = 120


def execute(name: str, workdir: Path) -> tuple[str, list[dict]]:
    """Run a notebook in a fresh python3 kernel; return its printed text and all outputs."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
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


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata.kernelspec.name == "python3"
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == []
            assert cell.execution_count is None
