"""Gradients through complex numbers, in PyTorch's convention, against finite differences.

For a real loss ``L``, a complex source ``z`` gets ``dL/dRe(z) + i dL/dIm(z)`` and a real source
``x`` of complex arithmetic gets ``dL/dx`` (PyTorch's ``.grad``): the finite differences below
step the real and the imaginary part of each element. Each case goes from the source through
complex intermediate results to a real loss (``ops.real``, ``ops.imag``, ``ops.abs``,
``ops.var``), and is written once for a namespace of ops, so that PyTorch, where importable,
evaluates the same case as a second oracle (skipped in CI, which has no PyTorch).

The audit that found these (a real ``x``, a complex ``c``): ``sum(|x c| ** 2)`` had the
gradient ``2 Re(c ** 2) x`` instead of ``2 |c| ** 2 x``, because ``multiply``'s vjp did not
conjugate, and the complex gradient was cast to the real source with only NumPy's
``ComplexWarning``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel import Function, Tape, ops, to_device

if TYPE_CHECKING:
    from collections.abc import Callable

try:
    import torch
except ImportError:  # CI: finite differences only
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")

# Constants small enough that tanh stays away from its poles (|x c| < 0.8 < pi / 2) and the
# logarithm and square root from their branch cut (Re(x c + 2) > 1).
C = np.array([0.5 + 0.25j, 0.3 - 0.4j, -0.2 + 0.1j])
M = np.array(
    [[0.3 - 0.2j, 1.0 + 0.5j, -0.4j], [0.7, -0.6 + 0.1j, 0.2 + 0.9j], [-0.5 + 0.5j, 0.1, 1.2j]]
)
MASK = np.array([True, False, True])
INDEX = np.array([0, 2, 0])  # a repeated element: its gradients add up


def _shapes(m: Any, x: Any, k: dict[str, Any]) -> Any:
    w = m.multiply(x, k["c"])
    s = m.stack([w, m.conj(w)])  # (2, 3)
    column = m.getitem(m.transpose(m.reshape(s, (2, 3, 1)), (2, 0, 1)), (0, 1))  # conj(w)
    head, tail = m.split(w, [1])
    joined = m.concatenate([column, tail, m.getitem(w, k["index"]), m.multiply(head, 2.0)])
    return m.sum(m.abs(joined))


# id -> loss(m, x, constants): m is ``ops`` or the PyTorch namespace below.
CASES: dict[str, Callable[[Any, Any, dict[str, Any]], Any]] = {
    "abs-square": lambda m, x, k: m.sum(m.square(m.abs(m.multiply(x, k["c"])))),
    "real-imag": lambda m, x, k: m.add(
        m.sum(m.real(m.multiply(k["c"], m.multiply(x, x)))),
        m.sum(m.imag(m.multiply(x, k["c"]))),
    ),
    "add-subtract-negative": lambda m, x, k: m.sum(
        m.abs(m.negative(m.subtract(m.add(x, k["c"]), m.multiply(k["c"], m.multiply(x, x)))))
    ),
    "divide": lambda m, x, k: m.sum(
        m.abs(m.add(m.divide(x, k["c"]), m.divide(k["c"], m.add(x, 2.0))))
    ),
    "square": lambda m, x, k: m.sum(m.real(m.multiply(m.square(m.multiply(x, k["c"])), k["c"]))),
    "exp": lambda m, x, k: m.sum(m.imag(m.exp(m.multiply(x, k["c"])))),
    "log": lambda m, x, k: m.sum(
        m.real(m.multiply(m.log(m.add(m.multiply(x, k["c"]), 2.0)), k["c"]))
    ),
    "sqrt": lambda m, x, k: m.sum(
        m.imag(m.multiply(m.sqrt(m.add(m.multiply(x, k["c"]), 2.0)), k["c"]))
    ),
    "tanh": lambda m, x, k: m.sum(m.real(m.multiply(m.tanh(m.multiply(x, k["c"])), k["c"]))),
    "abs": lambda m, x, k: m.sum(m.abs(m.multiply(x, k["c"]))),
    "conj": lambda m, x, k: m.sum(
        m.imag(m.multiply(m.conj(m.multiply(x, k["c"])), m.multiply(x, x)))
    ),
    "matmul": lambda m, x, k: m.add(
        m.sum(m.abs(m.matmul(k["m"], m.multiply(x, k["c"])))),
        m.sum(m.imag(m.matmul(m.multiply(x, k["c"]), k["m"]))),
    ),
    "matmul-2d": lambda m, x, k: m.sum(
        m.abs(m.matmul(m.reshape(x, (3, 1)), m.reshape(k["c"], (1, 3))))
    ),
    "sum-mean": lambda m, x, k: m.add(
        m.mean(m.abs(m.multiply(x, k["c"]))), m.abs(m.sum(m.multiply(m.add(x, 3.0), k["c"])))
    ),
    "var": lambda m, x, k: m.var(m.multiply(m.add(x, k["c"]), k["c"])),
    "shapes": _shapes,
    "where": lambda m, x, k: m.sum(
        m.abs(m.where(k["mask"], m.multiply(x, k["c"]), m.add(m.square(x), 1.0)))
    ),
    "broadcast": lambda m, x, k: m.sum(m.abs(m.multiply(m.reshape(x, (3, 1)), k["c"]))),
}

CONSTANTS = {"c": C, "m": M, "mask": MASK, "index": INDEX}


def _promoted(a: Any, b: Any) -> tuple[Any, Any]:
    """``a`` and ``b`` in their common dtype: ``torch.matmul`` needs one, and ``torch.where``
    would hand a real input a complex gradient (PyTorch's engine then refuses it)."""
    assert torch is not None
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def _torch_namespace() -> Any:
    """PyTorch's functions under the names of ``ops`` (for the cases above)."""
    assert torch is not None
    return SimpleNamespace(
        **{name: getattr(torch, name) for name in ("sum", "mean", "square", "abs", "exp")},
        **{name: getattr(torch, name) for name in ("log", "sqrt", "tanh", "real", "imag")},
        **{name: getattr(torch, name) for name in ("reshape", "stack")},
        matmul=lambda a, b: torch.matmul(*_promoted(a, b)),
        where=lambda mask, a, b: torch.where(mask, *_promoted(a, b)),
        multiply=torch.mul,
        divide=torch.div,
        add=torch.add,
        subtract=torch.sub,
        negative=torch.neg,
        conj=lambda x: torch.conj(x).resolve_conj(),
        var=lambda x: torch.var(x, correction=0),
        transpose=lambda x, axes: x.permute(axes),
        getitem=lambda x, i: x[torch.from_numpy(i) if isinstance(i, np.ndarray) else i],
        concatenate=torch.cat,
        split=lambda x, i: list(torch.tensor_split(x, i)),
    )


def _source(seed: int, dtype: Any) -> np.ndarray:
    """Three values of magnitude 0.2 to 1 (away from the kink of ``abs`` at 0)."""
    rng = np.random.default_rng(seed)
    magnitude = rng.uniform(0.2, 1.0, 3)
    if np.dtype(dtype).kind == "c":
        return magnitude * np.exp(1j * rng.uniform(-np.pi, np.pi, 3))
    return magnitude * rng.choice([-1.0, 1.0], 3)


def _tape_gradient(loss: Callable[[Any], Any], x: Any) -> Any:
    with Tape() as tape:
        tape.watch(x)
        y = loss(x)
    return tape.gradient(y, x)


def _finite_differences(loss: Callable[[Any], Any], x: np.ndarray, eps: float = 1e-6) -> Any:
    """``dL/dRe(x) + i dL/dIm(x)`` (``dL/dx`` for a real ``x``) by central differences."""
    directions = (1.0, 1j) if x.dtype.kind == "c" else (1.0,)
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        for d in directions:
            step = np.zeros_like(x)
            step[index] = eps * d
            slope = (float(loss(x + step)) - float(loss(x - step))) / (2 * eps)
            grad[index] += d * slope
    return grad


@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["real", "complex"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@given(seed=st.integers(0, 2**32 - 1))
def test_gradients_through_complex_values_match_finite_differences(
    case: str, dtype: Any, seed: int
) -> None:
    x = _source(seed, dtype)

    def loss(x: Any) -> Any:
        return CASES[case](ops, x, CONSTANTS)

    grad = _tape_gradient(loss, x)
    assert grad.dtype == x.dtype  # a real source gets a real gradient
    np.testing.assert_allclose(grad, _finite_differences(loss, x), rtol=1e-6, atol=1e-7)


@needs_torch
@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["real", "complex"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_gradients_through_complex_values_match_pytorch(case: str, dtype: Any) -> None:
    assert torch is not None
    x = _source(7, dtype)
    theirs = torch.from_numpy(x.copy()).requires_grad_()
    constants = {
        name: torch.from_numpy(v) if name != "index" else v for name, v in CONSTANTS.items()
    }
    value = CASES[case](_torch_namespace(), theirs, constants)
    value.backward()
    assert theirs.grad is not None
    ours = _tape_gradient(lambda x: CASES[case](ops, x, CONSTANTS), x)
    np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-12, atol=1e-12)


SECOND_ORDER = ["abs-square", "abs", "divide", "exp", "log", "sqrt", "tanh", "matmul", "var"]


@pytest.mark.parametrize("dtype", [np.float64, np.complex128], ids=["real", "complex"])
@pytest.mark.parametrize("case", SECOND_ORDER)
def test_second_derivatives_through_complex_values(case: str, dtype: Any) -> None:
    """A Hessian-vector product (nested tapes) against finite differences of the gradient.

    It needs every vjp written with recorded ops: the conjugates, ``abs``'s phase ``z / |z|``.
    """
    x = _source(11, dtype)
    u = np.random.default_rng(12).uniform(-1.0, 1.0, 3)

    def loss(x: Any) -> Any:
        return CASES[case](ops, x, CONSTANTS)

    def directional(x: Any) -> Any:  # Re<grad, u>, a real function of x
        with Tape() as tape:
            tape.watch(x)
            y = loss(x)
        return ops.sum(ops.real(ops.multiply(tape.gradient(y, x), u)))

    np.testing.assert_allclose(
        _tape_gradient(directional, x), _finite_differences(directional, x), rtol=1e-5, atol=1e-6
    )


def test_the_audited_case_gets_twice_abs_c_squared_x() -> None:
    """The audit's repro: [10, -10], not [-6, -8] (NumPy's ComplexWarning is an error here)."""
    x, c = np.array([1.0, -0.5]), np.array([1 + 2j, 3 - 1j])
    grad = _tape_gradient(lambda x: ops.sum(ops.square(ops.abs(ops.multiply(x, c)))), x)
    assert grad.dtype == np.float64
    np.testing.assert_allclose(grad, 2 * np.abs(c) ** 2 * x, rtol=1e-14)
    np.testing.assert_allclose(grad, [10.0, -10.0], rtol=1e-14)


def test_complex_gradients_on_a_host_device() -> None:
    x = to_device(_source(3, np.complex128), "host:2")
    c = to_device(C, "host:2")
    grad = _tape_gradient(lambda x: ops.sum(ops.square(ops.abs(ops.multiply(x, c)))), x)
    assert grad.device == x.device
    np.testing.assert_allclose(
        np.asarray(to_device(grad, "cpu")),
        2 * np.abs(C) ** 2 * _source(3, np.complex128),
        rtol=1e-14,
    )


@pytest.mark.parametrize(
    ("op", "oracle", "x"),
    [
        (ops.real, np.real, np.array([1 + 2j, 3 - 1j])),
        (ops.imag, np.imag, np.array([1 + 2j, 3 - 1j])),
        (ops.conj, np.conj, np.array([1 + 2j, 3 - 1j])),
        (ops.real, np.real, np.array([1.5, -2.0])),
        (ops.imag, np.imag, np.array([1.5, -2.0])),
        (ops.conj, np.conj, np.array(2.5)),
    ],
    ids=["real", "imag", "conj", "real-of-real", "imag-of-real", "conj-0d"],
)
def test_real_imag_conj_values_are_new_arrays(op: Any, oracle: Any, x: np.ndarray) -> None:
    z = op(x)
    assert type(z) is np.ndarray
    np.testing.assert_array_equal(z, oracle(x))
    assert z.dtype == oracle(x).dtype
    assert not np.shares_memory(z, x)  # NumPy's real and imag are views; these are not


def test_gradients_of_real_and_imag_for_a_real_source() -> None:
    """``imag`` of a real array is a constant 0; ``real`` and ``conj`` are the identity."""
    x = np.array([0.5, -1.0])
    with Tape(persistent=True) as tape:
        tape.watch(x)
        parts = ops.real(x), ops.imag(x), ops.conj(x)
    ones = np.ones(2)
    grads = [tape.gradient(p, x, output_gradients=ones) for p in parts]
    np.testing.assert_array_equal(grads[0], ones)
    np.testing.assert_array_equal(grads[1], np.zeros(2))
    np.testing.assert_array_equal(grads[2], ones)


REAL_ONLY: list[tuple[str, Callable[[Any], Any]]] = [
    ("maximum", lambda z: ops.maximum(z, 0.5)),
    ("minimum", lambda z: ops.minimum(0.5, z)),
    ("relu", ops.relu),
    ("clip", lambda z: ops.clip(z, -0.5, 0.5)),
    ("power", lambda z: ops.power(z, 3.0)),
    ("logsumexp", ops.logsumexp),
    ("softmax", ops.softmax),
    ("log_softmax", ops.log_softmax),
]


@pytest.mark.parametrize("source", ["complex", "real-times-complex"])
@pytest.mark.parametrize(("name", "op"), REAL_ONLY, ids=[r[0] for r in REAL_ONLY])
def test_ops_with_real_only_gradients_refuse_complex_values_when_recorded(
    name: str, op: Callable[[Any], Any], source: str
) -> None:
    z = C.copy()
    x = np.array([0.5, -1.0, 2.0])
    with Tape() as tape:
        tape.watch(z if source == "complex" else x)
        operand = z if source == "complex" else ops.multiply(x, C)
        with pytest.raises(TypeError, match=rf"ops\.{name} has no gradient for complex arrays"):
            op(operand)
    # Unrecorded (no tape tracks the operand), it computes as NumPy does.
    assert op(C).dtype.kind == "c"


def test_a_real_source_of_a_real_only_op_with_a_complex_operand_is_refused() -> None:
    x = np.array([0.5, -1.0, 2.0])
    with Tape() as tape:
        tape.watch(x)
        with pytest.raises(TypeError, match=r"ops\.maximum has no gradient for complex arrays"):
            ops.maximum(x, C)  # x is tracked, C a constant: the result is complex


def test_watch_takes_complex_arrays() -> None:
    z = C.copy()
    with Tape() as tape:
        tape.watch(z)
        y = ops.sum(ops.abs(z))
    np.testing.assert_allclose(tape.gradient(y, z), C / np.abs(C), rtol=1e-14)


def test_a_complex_target_needs_explicit_output_gradients() -> None:
    x = np.array([0.5, -1.0, 2.0])
    with Tape(persistent=True) as tape:
        tape.watch(x)
        y = ops.sum(ops.multiply(x, C))
    with pytest.raises(TypeError, match=r"target is complex \(complex128\).*ops\.real"):
        tape.gradient(y, x)
    seed = np.array(1j)  # the gradient of Im(y): Im(C)
    np.testing.assert_allclose(tape.gradient(y, x, output_gradients=seed), C.imag, rtol=1e-14)


def test_a_real_target_refuses_a_complex_output_gradient() -> None:
    x = np.array([0.5, -1.0])
    with Tape() as tape:
        tape.watch(x)
        y = ops.square(x)
    with pytest.raises(TypeError, match=r"output_gradients is complex .* target is real"):
        tape.gradient(y, x, output_gradients=np.ones(2, complex))


def test_a_function_returning_a_complex_gradient_for_a_complex_input_is_kept() -> None:
    class Scale(Function):
        @staticmethod
        def forward(ctx: Any, z: Any) -> Any:
            return z * (1 + 1j)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g * (1 - 1j)  # g conj(1 + i)

    z = C.copy()
    with Tape() as tape:
        tape.watch(z)
        y = ops.sum(ops.real(Scale.apply(z)))
    np.testing.assert_allclose(tape.gradient(y, z), np.full(3, 1 - 1j), rtol=1e-14)
