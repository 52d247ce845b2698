"""The ops at their edges: infinities, crossed bounds, empty pieces, aliased arguments.

Each case was a wrong answer without an error (issue 23). The oracles are independent: NumPy
written out by hand, finite differences (``gradcheck``) and PyTorch's numbers, hard-coded
because PyTorch is not a test dependency. Each PyTorch number says how it was obtained (torch
2.13 CPU, float64).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import Tape, gradcheck, ops, to_device

INF = np.inf


def _vjp_and_second(
    fn: Any, xs: list[np.ndarray], g: np.ndarray, u: np.ndarray, which: int | None = None
) -> tuple[list[Any], list[Any], Any]:
    """``fn``'s vjps with ``g``, and the derivatives of ``<vjp_i, u>`` (summed over ``i``).

    Returns the vjps, the second derivatives with respect to each input (Hessian-vector
    products) and with respect to ``g`` (a Jacobian-vector product): what PyTorch computes with
    ``torch.autograd.grad(..., create_graph=True)`` and a second ``grad``. ``which`` picks one
    vjp ``i`` instead of the sum.
    """
    with Tape() as outer:
        outer.watch((xs, g))
        with Tape() as inner:
            inner.watch(xs)
            y = fn(*xs)
        vjps = inner.gradient(y, list(xs), output_gradients=g)
        picked = vjps if which is None else [vjps[which]]
        total = ops.sum(ops.multiply(picked[0], u))
        for v in picked[1:]:
            total = ops.add(total, ops.sum(ops.multiply(v, u)))
    second, second_g = outer.gradient(total, (list(xs), g))
    return vjps, second, second_g


# --------------------------------------------------------------------------------------------
# softmax_cross_entropy with masked classes (logit -inf)

MASKED_LOGITS = np.array([[2.0, -INF, 1.0], [0.5, 1.5, -INF]])
MASKED_LABELS = np.array([0, 1])


def _masked_losses_by_hand() -> np.ndarray:
    """The losses with the masked classes dropped: a stable log-softmax over the rest."""
    losses = []
    for row, label in zip(MASKED_LOGITS, MASKED_LABELS, strict=True):
        kept = row[np.isfinite(row)]
        top = kept.max()
        losses.append(-(row[label] - top - np.log(np.exp(kept - top).sum())))
    return np.array(losses)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_masked_classes_is_finite(reduction: str) -> None:
    losses = _masked_losses_by_hand()
    expected = {"mean": losses.mean(), "sum": losses.sum(), "none": losses}[reduction]
    actual = ops.softmax_cross_entropy(MASKED_LOGITS, MASKED_LABELS, reduction=reduction)
    np.testing.assert_allclose(actual, expected, rtol=1e-14)
    # torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)
    torch_loss = {
        "mean": 0.31326168751822286,
        "sum": 0.6265233750364457,
        "none": [0.31326168751822286] * 2,
    }
    np.testing.assert_allclose(actual, torch_loss[reduction], rtol=1e-14)


def test_cross_entropy_with_masked_classes_first_and_second_derivatives() -> None:
    u = np.array([[0.3, -0.2, 0.5], [0.1, 0.4, -0.7]])
    (grad,), (hvp,), _ = _vjp_and_second(
        lambda z: ops.softmax_cross_entropy(z, MASKED_LABELS), [MASKED_LOGITS], np.array(1.0), u
    )
    # softmax - one_hot, averaged over the rows, with the masked classes at probability 0
    probabilities = np.exp(MASKED_LOGITS - MASKED_LOGITS.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    np.testing.assert_allclose(grad, (probabilities - np.eye(3)[MASKED_LABELS]) / 2, rtol=1e-14)
    # torch: grad of cross_entropy (create_graph=True), then grad of <grad, u>
    torch_grad = [
        [-0.13447071068499755, 0.0, 0.13447071068499755],
        [0.13447071068499755, -0.13447071068499755, 0.0],
    ]
    torch_hvp = [
        [-0.019661193324148174, 0.0, 0.019661193324148188],
        [-0.02949178998622228, 0.029491789986222268, 0.0],
    ]
    np.testing.assert_allclose(grad, torch_grad, rtol=1e-14)
    np.testing.assert_allclose(hvp, torch_hvp, rtol=1e-12, atol=1e-17)


def test_cross_entropy_with_masked_classes_on_a_host_device() -> None:
    logits = to_device(MASKED_LOGITS, "host:1")
    labels = to_device(MASKED_LABELS, "host:1")
    loss = ops.softmax_cross_entropy(logits, labels, reduction="none")
    assert loss.device == cp.as_device("host:1")
    np.testing.assert_allclose(to_device(loss, "cpu"), _masked_losses_by_hand(), rtol=1e-14)


def test_cross_entropy_target_at_minus_infinity_is_infinite_as_in_torch() -> None:
    logits = np.array([[-INF, 1.0, 2.0]])
    loss, grad = cp.value_and_grad(lambda z: ops.softmax_cross_entropy(z, np.array([0])))(logits)
    assert loss == INF  # the target has probability 0; torch: inf
    # torch: [[-1.0, 0.2689, 0.7311]] (softmax - one_hot, finite)
    np.testing.assert_allclose(grad, [[-1.0, 1 / (1 + np.e), np.e / (1 + np.e)]], rtol=1e-14)


def test_cross_entropy_row_of_minus_infinities_is_nan_as_in_torch() -> None:
    with np.errstate(invalid="ignore"):  # -inf - -inf in NumPy's log-softmax
        loss = ops.softmax_cross_entropy(np.array([[-INF, -INF], [0.0, 0.0]]), np.array([0, 1]))
    assert np.isnan(loss)  # no distribution over the classes; torch: nan


# --------------------------------------------------------------------------------------------
# clip with crossed bounds (lo > hi): the value is hi, and so is the gradient

# x, lo, hi away from every kink (|x - lo|, |x - hi|, |lo - hi| >= 0.25): the last three
# elements have crossed bounds, with x below lo, between them, and above lo
CLIP_X = np.array([-1.0, 0.5, 2.0, 0.0, 1.5, 3.0])
CLIP_LO = np.array([0.0, 0.0, 0.0, 2.0, 2.0, 2.0])
CLIP_HI = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_clip_with_crossed_bounds_has_numpys_value() -> None:
    expected = np.clip(CLIP_X, CLIP_LO, CLIP_HI)
    np.testing.assert_array_equal(expected[3:], CLIP_HI[3:])  # NumPy: hi where lo > hi
    np.testing.assert_array_equal(ops.clip(CLIP_X, CLIP_LO, CLIP_HI), expected)
    np.testing.assert_array_equal(ops.clip(CLIP_X, 2.0, 1.0), np.full(6, 1.0))


def test_clip_with_crossed_bounds_matches_finite_differences() -> None:
    assert gradcheck(ops.clip, [CLIP_X, CLIP_LO, CLIP_HI])
    assert gradcheck(lambda x: ops.clip(x, 2.0, 1.0), [CLIP_X])


def test_clip_gradients_where_the_bounds_cross_or_meet_are_torchs() -> None:
    # torch.clamp(x, lo, hi).sum() differentiated in x, lo and hi (torch 2.13): the 4th and
    # 5th elements have lo == hi (the kink), the rest crossed bounds
    x = np.array([0.0, 1.0, 2.0, 0.0, 1.0, 3.0])
    lo = np.array([2.0, 2.0, 2.0, 1.0, 1.0, 1.0])
    hi = np.array([0.5, 1.0, 1.5, 1.0, 1.0, 1.0])
    gx, glo, ghi = cp.grad(lambda *a: ops.sum(ops.clip(*a)), argnums=(0, 1, 2))(x, lo, hi)
    np.testing.assert_array_equal(gx, [0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(glo, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(ghi, [1.0, 1.0, 1.0, 0.0, 0.0, 1.0])


# --------------------------------------------------------------------------------------------
# split at decreasing indices: NumPy's empty and overlapping pieces

SPLITS = [[3, 1], [-2, 7, 2], [4, -4], [-9, 2], [2, 2], [1, 3]]


@pytest.mark.parametrize("indices", SPLITS, ids=str)
@pytest.mark.parametrize("device", ["cpu", "host:1"])
def test_split_pieces_are_numpys(indices: list[int], device: str) -> None:
    x = np.arange(12.0).reshape(2, 6)
    pieces = ops.split(to_device(x, device), indices, 1)
    expected = np.split(x, indices, 1)
    assert len(pieces) == len(expected)
    for piece, want in zip(pieces, expected, strict=True):
        assert cp.device_of(piece) == cp.as_device(device)
        np.testing.assert_array_equal(to_device(piece, "cpu"), want)


@pytest.mark.parametrize("indices", SPLITS, ids=str)
def test_split_gradients_match_finite_differences(indices: list[int]) -> None:
    x = np.random.default_rng(0).uniform(-1.0, 1.0, (2, 6))

    def weighted(x: Any) -> Any:  # every piece counts, nonlinearly, so overlaps must add up
        pieces = ops.split(x, indices, 1)
        return ops.concatenate(
            [ops.multiply(ops.tanh(p), float(k + 1)) for k, p in enumerate(pieces)], 1
        )

    assert gradcheck(weighted, [x])
    assert gradcheck(cp.grad(lambda x: ops.sum(ops.square(weighted(x)))), [x])  # second order


def test_split_gradient_at_decreasing_indices_is_torchs() -> None:
    x = np.arange(5.0)
    weights = [np.array([1.0, 2.0, 3.0]), np.zeros(0), np.array([10.0, 20.0, 30.0, 40.0])]

    def loss(x: Any) -> Any:
        pieces = ops.split(x, [3, 1])
        total = ops.sum(ops.multiply(pieces[0], weights[0]))
        for piece, w in zip(pieces[1:], weights[1:], strict=True):
            total = ops.add(total, ops.sum(ops.multiply(piece, w)))
        return total

    # torch.tensor_split(x, [3, 1]) (NumPy's pieces), the same weighted sum, backward()
    np.testing.assert_array_equal(cp.grad(loss)(x), [1.0, 12.0, 23.0, 30.0, 40.0])
    # a piece no gradient reaches contributes nothing (the empty one, and here x[:3])
    g = cp.grad(lambda x: ops.sum(ops.split(x, [3, 1])[2]))(x)
    np.testing.assert_array_equal(g, [0.0, 1.0, 1.0, 1.0, 1.0])


def test_split_refuses_indices_that_are_not_ints() -> None:
    with pytest.raises(TypeError, match=r"indices_or_sections\[1\] must be an int, got float 2.0"):
        ops.split(np.arange(5.0), [1, 2.0])


# --------------------------------------------------------------------------------------------
# power's exponent gradient where log(base) is not finite: PyTorch's values, inf and NaN included

# bases 0, 0, -0, -2, -2, 0, 3 with exponents -1, -0.5, -1, 2, 3, 2, 0.5
POWER_A = np.array([0.0, 0.0, -0.0, -2.0, -2.0, 0.0, 3.0])
POWER_B = np.array([-1.0, -0.5, -1.0, 2.0, 3.0, 2.0, 0.5])
POWER_G = np.array([1.0, 1.0, 1.0, 1.0, 1.0, -2.0, 1.0])
POWER_U = np.full(7, 0.5)
NAN = np.nan

# torch (2.13, float64): ga, gb = autograd.grad(a ** b, (a, b), g, create_graph=True), then
# autograd.grad((v * u).sum(), (a, b, g)) for v = ga and v = gb
TORCH_POWER_VJPS = (
    [-INF, -INF, -INF, -4.0, 12.0, -0.0, 0.28867513459481287],
    [-INF, -INF, INF, NAN, NAN, -0.0, 1.902852301792692],
)
TORCH_POWER_SECOND = (
    (
        [INF, INF, -INF, 1.0, -6.0, -2.0, -0.024056261216234408],
        [INF, INF, INF, NAN, NAN, -0.0, 0.4472461597442039],
        [-INF, -INF, -INF, -2.0, 6.0, 0.0, 0.14433756729740643],
    ),
    (
        [INF, INF, INF, NAN, NAN, NAN, 0.4472461597442039],
        [INF, INF, -INF, NAN, NAN, NAN, 1.045248461134925],
        [-INF, -INF, INF, NAN, NAN, 0.0, 0.951426150896346],
    ),
)


@pytest.mark.parametrize("which", [0, 1], ids=["base", "exponent"])
def test_power_first_and_second_derivatives_are_torchs(which: int) -> None:
    """-inf for the exponent at base 0 (inf * log 0), NaN through log of a negative base."""
    with np.errstate(divide="ignore", invalid="ignore"):  # NumPy's 0 ** -1, 0 * inf, ...
        vjps, (second_a, second_b), second_g = _vjp_and_second(
            ops.power, [POWER_A, POWER_B], POWER_G, POWER_U, which
        )
    for actual, expected in zip(vjps, TORCH_POWER_VJPS, strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-14)
    for actual, expected in zip(
        (second_a, second_b, second_g), TORCH_POWER_SECOND[which], strict=True
    ):
        np.testing.assert_allclose(actual, expected, rtol=1e-14)


@pytest.mark.parametrize(
    ("base", "first", "second", "second_g"),
    [  # torch: the same with a Python number as the base, exponents [-1, 0, 2], g = u = 1
        (0.0, [-INF, 0.0, 0.0], [INF, NAN, NAN], [-INF, 0.0, 0.0]),
        (-2.0, [NAN] * 3, [NAN] * 3, [NAN] * 3),
    ],
    ids=["zero", "negative"],
)
def test_power_of_a_constant_base_exponent_derivatives_are_torchs(
    base: float, first: list[float], second: list[float], second_g: list[float]
) -> None:
    exponent, g, u = np.array([-1.0, 0.0, 2.0]), np.ones(3), np.ones(3)
    with np.errstate(divide="ignore", invalid="ignore"):
        (vjp,), (hvp,), jvp = _vjp_and_second(lambda b: ops.power(base, b), [exponent], g, u)
    np.testing.assert_allclose(vjp, first, rtol=1e-14)
    np.testing.assert_allclose(hvp, second, rtol=1e-14)
    np.testing.assert_allclose(jvp, second_g, rtol=1e-14)


def test_power_exponent_gradient_draws_no_numpy_warning() -> None:
    """log(0) and log(-2) are computed on purpose: no RuntimeWarning (PyTorch gives none)."""
    grad = cp.grad(lambda b: ops.sum(ops.power(np.array([0.0, -2.0, 2.0]), b)))
    np.testing.assert_allclose(grad(np.array([1.0, 2.0, 3.0])), [0.0, NAN, 8 * np.log(2.0)])


def test_split_takes_a_numpy_array_of_indices_as_numpy_does() -> None:
    x = np.arange(10.0)
    indices = np.array([3, 7])
    pieces = ops.split(x, indices)
    for got, want in zip(pieces, np.split(x, indices), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match=r"indices_or_sections\[0\] must be an int"):
        ops.split(x, np.array([1.5]))
