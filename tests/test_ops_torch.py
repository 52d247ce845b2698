"""The ops' first and second derivatives against PyTorch autograd, to 1e-10.

How PyTorch runs here (a decision): CI installs only the project's test extra, and PyTorch is not
in it — ``pip install torch`` on a clean machine pulls the CUDA build (gigabytes); the CPU wheel
this machine uses comes from a local ``PIP_FIND_LINKS`` directory that a clean machine lacks. So
PyTorch's answers for every op case and for 150 seeded random op graphs are stored in
``tests/data/torch_oracle.npz`` by ``tests/make_torch_oracle.py`` (run it after changing
``tests/torch_oracle.py``), and the tests compare against that file everywhere. Where PyTorch is
importable, the same cases are also evaluated live, and a hypothesis fuzzer draws new random
graphs (fan-out, reuse, broadcasting, every op, nested tapes, ``to_device`` hops
across host devices) and compares them with PyTorch.

Each comparison covers the value, the vjp ``d<y, g>/dx`` and, through nested tapes (the
gradient computed under an outer tape is recorded there), the Hessian-vector product
``d<vjp, u>/dx`` and the Jacobian-vector product ``d<vjp, u>/dg``, as PyTorch computes them
with ``create_graph=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch_oracle
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel import gradcheck

try:
    import torch
except ImportError:  # CI: compare with the stored oracle only
    torch = None

ORACLE_FILE = Path(__file__).parent / "data" / "torch_oracle.npz"
GRAPH_SEEDS = range(150)  # as in make_torch_oracle.py
TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


@pytest.fixture(scope="module")
def oracle() -> Any:
    with np.load(ORACLE_FILE) as data:
        return dict(data)


def _close(actual: Any, expected: Any, what: str) -> None:
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(
        actual, expected, rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"] * scale, err_msg=what
    )


def _stored(oracle: dict[str, Any], prefix: str, n: int) -> torch_oracle.Result:
    return torch_oracle.Result(
        oracle[f"{prefix}/value"],
        [oracle[f"{prefix}/first{i}"] for i in range(n)],
        [oracle[f"{prefix}/second{i}"] for i in range(n)],
        oracle[f"{prefix}/second_g"],
    )


def _compare_first(
    fn: Any, xs: list[np.ndarray], seed: int, expected: torch_oracle.Result, device: str = "cpu"
) -> None:
    value, first = torch_oracle.ours_first(fn, xs, seed, device)
    _close(value, expected.value, "value")
    for i, (a, e) in enumerate(zip(first, expected.first, strict=True)):
        assert a.shape == e.shape, f"vjp {i}: shape {a.shape}, PyTorch {e.shape}"
        _close(a, e, f"vjp with respect to input {i}")


def _compare_second(
    fn: Any, xs: list[np.ndarray], seed: int, expected: torch_oracle.Result, device: str = "cpu"
) -> None:
    result = torch_oracle.ours(fn, xs, seed, device)
    for i, (a, e) in enumerate(zip(result.second, expected.second, strict=True)):
        _close(a, e, f"Hessian-vector product with respect to input {i}")
    _close(result.second_g, expected.second_g, "Jacobian-vector product (d/d cotangent)")


CASE_NAMES = sorted(torch_oracle.CASES)


# --------------------------------------------------------------------------------------------
# Op cases against the stored oracle (always) and live PyTorch (when installed)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_first_order_matches_pytorch(name: str, oracle: Any) -> None:
    xs = torch_oracle.case_inputs(name)
    expected = _stored(oracle, f"case/{name}", len(xs))
    _compare_first(torch_oracle.CASES[name].ours, xs, 0, expected)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_second_order_matches_pytorch(name: str, oracle: Any) -> None:
    xs = torch_oracle.case_inputs(name)
    expected = _stored(oracle, f"case/{name}", len(xs))
    _compare_second(torch_oracle.CASES[name].ours, xs, 0, expected)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_on_a_host_device_matches_pytorch(name: str, oracle: Any) -> None:
    """The same derivatives with every array on host:1 (ops compute on the host buffers)."""
    xs = torch_oracle.case_inputs(name)
    expected = _stored(oracle, f"case/{name}", len(xs))
    _compare_first(torch_oracle.CASES[name].ours, xs, 0, expected, "host:1")
    _compare_second(torch_oracle.CASES[name].ours, xs, 0, expected, "host:1")


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_on_a_gpu_matches_pytorch(name: str, oracle: Any) -> None:
    """The same derivatives with every array on the first GPU (CuPy kernels)."""
    xs = torch_oracle.case_inputs(name)
    expected = _stored(oracle, f"case/{name}", len(xs))
    _compare_first(torch_oracle.CASES[name].ours, xs, 0, expected, "cuda:0")
    _compare_second(torch_oracle.CASES[name].ours, xs, 0, expected, "cuda:0")


KINKS = {"relu", "clip-lower"}  # inputs sit on the kink on purpose: finite differences disagree


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if n not in KINKS])
def test_case_gradcheck(name: str) -> None:
    assert gradcheck(torch_oracle.CASES[name].ours, torch_oracle.case_inputs(name))


@needs_torch
@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_live_pytorch(name: str) -> None:
    case = torch_oracle.CASES[name]
    xs = torch_oracle.case_inputs(name)
    expected = torch_oracle.theirs(torch, case.theirs, xs, seed=0)
    _compare_first(case.ours, xs, 0, expected)
    _compare_second(case.ours, xs, 0, expected)


# --------------------------------------------------------------------------------------------
# Random op graphs


@pytest.mark.parametrize("seed", GRAPH_SEEDS)
def test_seeded_graph_matches_pytorch(seed: int, oracle: Any) -> None:
    graph = torch_oracle.seeded_graph(seed)
    assert str(oracle[f"graph/{seed}/key"]) == graph.key(), (
        "tests/torch_oracle.py draws other graphs than the stored oracle: run "
        "python tests/make_torch_oracle.py"
    )
    xs = torch_oracle.graph_inputs(graph, seed)
    expected = _stored(oracle, f"graph/{seed}", len(xs))
    fn = torch_oracle.graph_functions(graph)[0]
    _compare_first(fn, xs, seed, expected)
    _compare_second(fn, xs, seed, expected)


@pytest.mark.slow
@needs_torch
@given(data=st.data(), steps=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_random_graphs_match_live_pytorch(data: st.DataObject, steps: int, seed: int) -> None:
    graph = torch_oracle.make_graph(
        lambda n: data.draw(st.integers(0, n - 1)), steps=steps, hops=True
    )
    xs = torch_oracle.graph_inputs(graph, seed)
    f_ours, f_theirs = torch_oracle.graph_functions(graph)
    expected = torch_oracle.theirs(torch, f_theirs, xs, seed)
    _compare_first(f_ours, xs, seed, expected)
    _compare_second(f_ours, xs, seed, expected)
