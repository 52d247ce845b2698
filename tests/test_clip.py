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


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16], ids=["f64", "f32", "f16"])
@pytest.mark.parametrize("p", NORMS, ids=str)
def test_against_torch(p: float, dtype: Any) -> None:
    torch = pytest.importorskip("torch")
    grads = _grads(dtype)
    params = [torch.zeros(a.shape, dtype=torch.from_numpy(a).dtype) for a in _leaves(grads)]
    for t, a in zip(params, _leaves(grads), strict=True):
        t.grad = torch.from_numpy(a.copy())
    theirs = torch.nn.utils.clip_grad_norm_(params, 0.7, p, foreach=False)
    clipped, total = cp.clip_grad_norm(grads, 0.7, p)
    tol = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-3}[dtype]
    assert total.dtype == theirs.numpy().dtype
    assert float(total) == pytest.approx(float(theirs), rel=tol)
    for got, t in zip(_leaves(clipped), params, strict=True):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=tol, atol=0)


@pytest.mark.parametrize("p", [2.0, 3.0, 1e6], ids=str)
@pytest.mark.parametrize("scale", [300.0, 1e-4], ids=["large", "small"])
def test_float16_norms_are_summed_in_float32(scale: float, p: float) -> None:
    # torch sums float16 in float32 and rounds the norm to float16; summing in float16 gave
    # inf for 1000 gradients of 300 (the total 9490 overflowed: every gradient clipped to 0)
    # and 0 for gradients of 1e-4 (the squares underflowed)
    rng = np.random.default_rng(5)
    grads = [(scale * (1 + rng.random(n))).astype(np.float16) for n in (1000, 10)]
    clipped, total = cp.clip_grad_norm(grads, 1.0, p)
    wide = [g.astype(np.float32) for g in grads]
    with np.errstate(over="ignore"):  # 300**1e6: inf, as in torch
        norms = [np.float16(np.sum(np.abs(g) ** np.float32(p)) ** np.float32(1 / p)) for g in wide]
        want = np.float16(np.sum(np.float32(norms) ** np.float32(p)) ** np.float32(1 / p))
    assert total.dtype == np.float16
    np.testing.assert_allclose(total, want, rtol=2e-3)
    coefficient = min(1.0 / (float(want) + 1e-6), 1.0)
    for got, given in zip(clipped, grads, strict=True):
        np.testing.assert_allclose(got, given.astype(np.float64) * coefficient, rtol=4e-3)


def test_an_infinite_float16_total_with_a_large_max_norm_scales_by_zero_as_torch() -> None:
    # torch: 1e9 / inf = reciprocal(inf) * 1e9 = 0 (the number enters in float32); NumPy's
    # float16 1e9 is inf, and inf / inf made every gradient NaN
    grads = [np.full(1000, 300.0, np.float16)]
    clipped, total = cp.clip_grad_norm(grads, 1e9, 1.0)
    assert total == np.inf
    np.testing.assert_array_equal(clipped[0], np.zeros(1000, np.float16))


def test_float16_gradients_scaled_in_float32_by_a_float32_total() -> None:
    torch = pytest.importorskip("torch")
    grads = [np.full(5, 3.0, np.float16), np.full(5, 4.0, np.float32)]
    params = [torch.zeros(5, dtype=torch.from_numpy(g).dtype) for g in grads]
    for t, g in zip(params, grads, strict=True):
        t.grad = torch.from_numpy(g.copy())
    theirs = torch.nn.utils.clip_grad_norm_(params, 1.0)
    clipped, total = cp.clip_grad_norm(grads, 1.0)
    assert total == theirs.numpy()
    for got, t in zip(clipped, params, strict=True):  # the coefficient not rounded to float16
        np.testing.assert_array_equal(got, t.grad.numpy())


def test_the_string_inf_of_torch_s_docs_is_the_max_norm() -> None:
    # torch: "norm_type: Can be 'inf' for infinity norm"; ours raised TypeError
    for spelled, want in [("inf", 4.0), ("-inf", 3.0)]:
        _, total = cp.clip_grad_norm([np.array([3.0, -4.0])], 1.0, spelled)
        assert float(total) == want


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


def _uneven_shards(rank: int, world: int, p: float) -> list[Any]:
    # leaves of 24, 9, 6 and 1 entries over 4 ranks: ranks 1-3 hold an empty shard of the
    # last; rank 3 passes no gradient for the first (-inf) or none at all (-1)
    grads = [*_leaves(_grads()), np.array([0.25])]
    shards: list[Any] = [np.array_split(g.ravel(), world)[rank] for g in grads]
    if rank == 3:
        shards = [None] * len(shards) if p == -1.0 else [None, *shards[1:]]
    return shards


def _uneven_rank(rank: int, world: int, p: float) -> float:
    shards = _uneven_shards(rank, world, p)
    _, total = cp.clip_grad_norm(shards, 0.5, p, process_group=dist.group.WORLD)
    return float(total)


@pytest.mark.parametrize("p", [-math.inf, -1.0], ids=str)
def test_empty_shards_and_a_rank_without_gradients_for_negative_orders(p: float) -> None:
    # -inf: the empty shard's min raised on ranks 1-3 (NumPy's "zero-size array to reduction
    # operation minimum") and rank 0 waited in the all_reduce; -1: a rank without gradients
    # added torch's zero as 0**-1 = inf, which made the total 0
    passed = [s for r in range(4) for s in _uneven_shards(r, 4, p) if s is not None]
    flat = np.abs(np.concatenate(passed))
    want = np.min(flat) if math.isinf(p) else np.sum(flat**p) ** (1 / p)
    totals = dist.spawn(_uneven_rank, 4, (4, p), timeout=60)
    assert totals[:3] == [pytest.approx(float(want), rel=1e-12)] * 3
    assert totals[3] == pytest.approx(float(want), rel=1e-6)  # float32 without gradients


def _count_rank(rank: int, world: int) -> str:
    with pytest.raises(ValueError, match="norm_type=0 cannot be computed from gradient shards"):
        cp.clip_grad_norm([np.ones(2)], 1.0, 0.0, process_group=dist.group.WORLD)
    return "refused"


def test_the_zero_norm_of_shards_is_refused_on_every_rank() -> None:
    # torch's 0-"norm" counts the gradients with a nonzero entry: the sum of the ranks' counts
    # gave 7 for 3 gradients sharded over 4 ranks
    assert dist.spawn(_count_rank, 2, (2,), timeout=60) == ["refused"] * 2


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
    with pytest.raises(TypeError, match=r"grads\[0\] must be a floating-point or complex array"):
        cp.clip_grad_norm([np.array([3, 4])], 1.0)  # was scaled to [0, 0] silently
    with pytest.raises(TypeError, match="got dtype bool"):
        cp.clip_grad_norm({"w": np.array([True])}, 1.0)
    # torch scales by a negative max_norm: every gradient's sign flipped, silently
    with pytest.raises(ValueError, match=r"max_norm must be >= 0 \(a norm\), got -1\.0"):
        cp.clip_grad_norm([np.ones(2)], -1.0)
    with pytest.raises(ValueError, match="got nan"):
        cp.clip_grad_norm([np.ones(2)], float("nan"))
    with pytest.raises(TypeError, match="max_norm must be a real number, got str"):
        cp.clip_grad_norm([np.ones(2)], "1")
    with pytest.raises(TypeError, match="norm_type must be a real number"):
        cp.clip_grad_norm([np.ones(2)], 1.0, None)
    with pytest.raises(TypeError, match="error_if_nonfinite must be a bool"):
        cp.clip_grad_norm([np.ones(2)], 1.0, error_if_nonfinite=1)


@pytest.mark.parametrize("p", [-1.0, -2.5, -math.inf], ids=str)
def test_negative_norms_of_fsdp_shards_raise(p: float) -> None:
    # seen before: -inf and p < 0 gave 0.0 from FSDP's zero padding rows (DDP's whole
    # gradients: 0.0135 and 0.0027); shards without padding (ZeRO's, a user's) still reduce
    from cupy_parallel._src.optim.clip import mark_sharded_gradients

    def rank(r: int) -> None:
        shards = {"a": np.array_split(_grads()["a"], 2)[r]}
        mark_sharded_gradients([shards["a"]])  # as FullyShardedDataParallel marks its own
        with pytest.raises(ValueError, match=f"norm_type must be positive .* got {p}"):
            cp.clip_grad_norm(shards, 0.5, p, process_group=dist.group.WORLD)

    dist.spawn(rank, 2, timeout=60)
    _, total = cp.clip_grad_norm({"a": np.array([0.0, 2.0]), "b": np.zeros(2)}, 1.0, 0.0)
    assert float(total) == 1.0  # without a group: torch's count of nonzero gradients
