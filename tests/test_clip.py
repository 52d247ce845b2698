"""clip_grad_norm against torch.nn.utils.clip_grad_norm_ and a NumPy statement of its math.

The torch-free oracle: total = (sum_i ||g_i||_p^p)^(1/p) (max for inf), coefficient
min(max_norm / (total + 1e-6), 1). Sharded gradients (``process_group``) on thread ranks give
the unsharded norm and the shards of the unsharded clipped gradients.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import distributed as dist

NORMS = [2.0, 1.0, math.inf, 3.5, 0.5]


def _grads(dtype: Any = np.float64) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "a": rng.normal(size=(6, 4)).astype(dtype),
        "b": {"c": rng.normal(size=(9,)).astype(dtype), "frozen": None},
        "d": (rng.normal(size=(3, 2)) * 4).astype(dtype),
    }


def _reference(arrays: list[np.ndarray], max_norm: float, p: float) -> tuple[float, float]:
    flat = np.concatenate([a.astype(np.float64).ravel() for a in arrays])
    total = np.max(np.abs(flat)) if math.isinf(p) else np.sum(np.abs(flat) ** p) ** (1 / p)
    return float(total), min(max_norm / (total + 1e-6), 1.0)


def _leaves(tree: Any) -> list[Any]:
    return [tree["a"], tree["b"]["c"], tree["d"]]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "does-not-clip"])
@pytest.mark.parametrize("p", NORMS, ids=str)
def test_against_the_formula(p: float, max_norm: float, dtype: Any) -> None:
    grads = _grads(dtype)
    before = [a.copy() for a in _leaves(grads)]
    clipped, total = cp.clip_grad_norm(grads, max_norm, p)
    want_total, coefficient = _reference(_leaves(grads), max_norm, p)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert total.shape == ()
    assert total.dtype == dtype
    assert float(total) == pytest.approx(want_total, rel=tol)
    for got, given, kept in zip(_leaves(clipped), _leaves(grads), before, strict=True):
        np.testing.assert_allclose(got, given * coefficient, rtol=tol, atol=0)
        assert got.dtype == dtype
        np.testing.assert_array_equal(given, kept)  # out of place
    assert clipped["b"]["frozen"] is None
    if max_norm == 1e6:
        for got, given in zip(_leaves(clipped), _leaves(grads), strict=True):
            np.testing.assert_array_equal(got, given)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("p", NORMS, ids=str)
def test_against_torch(p: float, dtype: Any) -> None:
    torch = pytest.importorskip("torch")
    grads = _grads(dtype)
    params = [torch.zeros(a.shape, dtype=torch.from_numpy(a).dtype) for a in _leaves(grads)]
    for t, a in zip(params, _leaves(grads), strict=True):
        t.grad = torch.from_numpy(a.copy())
    theirs = torch.nn.utils.clip_grad_norm_(params, 0.7, p, foreach=False)
    clipped, total = cp.clip_grad_norm(grads, 0.7, p)
    tol = 1e-12 if dtype == np.float64 else 1e-6
    assert float(total) == pytest.approx(float(theirs), rel=tol)
    for got, t in zip(_leaves(clipped), params, strict=True):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=tol, atol=0)


def test_non_finite_norms() -> None:
    grads = {"a": np.array([1.0, np.nan]), "b": np.array([2.0])}
    with pytest.raises(RuntimeError, match=r"The total norm of order 2\.0 .* is non-finite"):
        cp.clip_grad_norm(grads, 1.0, error_if_nonfinite=True)
    clipped, total = cp.clip_grad_norm(grads, 1.0)  # scaled by NaN anyway, as torch does
    assert np.isnan(total)
    assert np.isnan(clipped["b"]).all()
    infinite = {"a": np.array([np.inf, 1.0])}
    with pytest.raises(RuntimeError, match="order inf"):
        cp.clip_grad_norm(infinite, 1.0, math.inf, error_if_nonfinite=True)
    clipped, total = cp.clip_grad_norm(infinite, 1.0)
    assert total == np.inf
    np.testing.assert_array_equal(clipped["a"], [np.nan, 0.0])  # inf * 0 and 1 * 0, as torch


def test_no_gradients_give_torch_zero() -> None:
    clipped, total = cp.clip_grad_norm({"a": None}, 1.0)
    assert clipped == {"a": None}
    assert total.dtype == np.float32
    assert float(total) == 0.0


def test_gradients_on_several_devices_total_on_the_first() -> None:
    cp.set_host_device_count(2)
    grads = _grads()
    placed = {
        "a": cp.to_device(grads["a"], "host:1"),
        "b": {"c": cp.to_device(grads["b"]["c"], "host:0"), "frozen": None},
        "d": grads["d"],
    }
    clipped, total = cp.clip_grad_norm(placed, 0.5)
    assert str(cp.device_of(total)) == "host:1"  # "a" comes first in flatten order
    want_total, coefficient = _reference(_leaves(grads), 0.5, 2.0)
    assert float(cp.to_device(total, "cpu")) == pytest.approx(want_total, rel=1e-12)
    for got, given, device in zip(
        _leaves(clipped), _leaves(grads), ["host:1", "host:0", "cpu"], strict=True
    ):
        assert str(cp.device_of(got)) == device
        np.testing.assert_allclose(cp.to_device(got, "cpu"), given * coefficient, rtol=1e-12)


def test_cupy_gradients_under_simulated_cuda() -> None:
    from cupy_parallel.testing import simulated_cuda

    grads = _grads()
    want_total, coefficient = _reference(_leaves(grads), 0.5, 2.0)
    with simulated_cuda(2):
        placed = {
            "a": cp.to_device(grads["a"], "cuda:1"),
            "b": {"c": cp.to_device(grads["b"]["c"], "cuda:0"), "frozen": None},
            "d": cp.to_device(grads["d"], "cuda:1"),
        }
        clipped, total = cp.clip_grad_norm(placed, 0.5)
        assert str(cp.device_of(total)) == "cuda:1"
        assert float(cp.to_device(total, "cpu")) == pytest.approx(want_total, rel=1e-12)
        for got, given, device in zip(
            _leaves(clipped), _leaves(grads), ["cuda:1", "cuda:0", "cuda:1"], strict=True
        ):
            assert str(cp.device_of(got)) == device
            np.testing.assert_allclose(cp.to_device(got, "cpu"), given * coefficient, rtol=1e-12)


def _sharded_rank(rank: int, world: int, p: float) -> tuple[float, list[np.ndarray]]:
    grads = _grads()
    shards = {
        "a": np.array_split(grads["a"], world)[rank],
        "b": {"c": np.array_split(grads["b"]["c"], world)[rank], "frozen": None},
        "d": np.array_split(grads["d"], world)[rank],
    }
    clipped, total = cp.clip_grad_norm(shards, 0.5, p, process_group=dist.group.WORLD)
    return float(total), _leaves(clipped)


@pytest.mark.parametrize("p", NORMS, ids=str)
def test_sharded_gradients_over_a_process_group(p: float) -> None:
    world = 3
    results = dist.spawn(_sharded_rank, world, (world, p), timeout=60)
    want_total, coefficient = _reference(_leaves(_grads()), 0.5, p)
    for total, _ in results:
        assert total == pytest.approx(want_total, rel=1e-12)
    for i, whole in enumerate(_leaves(_grads())):
        gathered = np.concatenate([leaves[i] for _, leaves in results])
        np.testing.assert_allclose(gathered, whole * coefficient, rtol=1e-12)


def _float32_rank(rank: int, world: int) -> float:
    # rank 0 holds nothing (torch's float32 zero); the others float32 shards of "a"
    grads = _grads(np.float32)
    shard = None if rank == 0 else np.array_split(grads["a"], world - 1)[rank - 1]
    _, total = cp.clip_grad_norm({"a": shard}, 0.5, process_group=dist.group.WORLD)
    assert total.dtype == np.float32
    return float(total)


def test_a_rank_without_gradients_joins_the_reduction() -> None:
    totals = dist.spawn(_float32_rank, 3, (3,), timeout=60)
    want, _ = _reference([_grads(np.float32)["a"]], 0.5, 2.0)
    assert totals == [pytest.approx(want, rel=1e-6)] * 3


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"grads\['w'\] must be an array or None, got str"):
        cp.clip_grad_norm({"w": "x"}, 1.0)
    with pytest.raises(TypeError, match="max_norm must be a real number, got str"):
        cp.clip_grad_norm([np.ones(2)], "1")
    with pytest.raises(TypeError, match="norm_type must be a real number"):
        cp.clip_grad_norm([np.ones(2)], 1.0, None)
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool"):
        cp.clip_grad_norm([np.ones(2)], 1.0, error_if_nonfinite=1)


@pytest.mark.parametrize("p", [0.0, -1.0, -2.5, -math.inf], ids=str)
def test_sharded_norms_that_shards_cannot_give_raise(p: float) -> None:
    # seen before: p = 0 summed per-rank counts (8 for 3 gradients on 4 ranks, torch: 3, the
    # number of gradients with a nonzero element), -inf and p < 0 gave 0.0 from FSDP's zero
    # padding rows (DDP's whole gradients: 0.0135 and 0.0027)
    def rank(r: int) -> None:
        shards = {"a": np.array_split(_grads()["a"], 2)[r]}
        with pytest.raises(ValueError, match=f"norm_type must be positive .* got {p}"):
            cp.clip_grad_norm(shards, 0.5, p, process_group=dist.group.WORLD)

    dist.spawn(rank, 2, timeout=60)
    _, total = cp.clip_grad_norm({"a": np.array([0.0, 2.0]), "b": np.zeros(2)}, 1.0, 0.0)
    assert float(total) == 1.0  # without a group: torch's count of nonzero gradients
