"""Check a tape gradient against central finite differences, as ``torch.autograd.gradcheck``."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arguments import read_real, read_sequence
from cupy_parallel._src.arrays import is_array, to_device
from cupy_parallel._src.compute import on_device_of, zeros_like
from cupy_parallel._src.recording import pullback
from cupy_parallel._src.tape import Tape
from cupy_parallel._src.tree import leaves as tree_leaves

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["GradcheckError", "gradcheck"]


class GradcheckError(RuntimeError):
    """Raised by :func:`gradcheck` when the tape's Jacobian disagrees with finite differences.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import Function
        >>> class WrongSquare(Function):  # a deliberately wrong backward
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_arrays
        ...         return g * x  # should be 2 * g * x
        >>> try:
        ...     gradcheck(WrongSquare.apply, [np.array([1.0, 2.0])])
        ... except GradcheckError as error:
        ...     print(type(error).__name__)
        GradcheckError
    """


def _host(x: Any) -> np.ndarray:
    return np.asarray(to_device(x, "cpu"))


def _outputs(fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    leaves = tree_leaves(fn(*args))
    for i, y in enumerate(leaves):
        if not is_array(y):
            raise TypeError(
                f"gradcheck needs fn to return arrays, but output {i} is a {type(y).__name__}."
            )
    return leaves


def gradcheck(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
) -> bool:
    """Compare the Jacobian the tape computes for ``fn(*inputs)`` with central differences.

    Floating-point and complex array inputs are differentiated, in float64 (complex128) on their
    own devices; other inputs are passed through. Finite differences need double precision: a
    float16/float32/complex64 input draws a ``UserWarning`` (PyTorch's ``gradcheck`` warns on
    non-double inputs too) and is checked on a double copy, so the check tests the math of
    ``fn``, not its rounding in low precision.
    ``fn`` returns an array or a pytree of arrays. Every Jacobian entry ``(output element, input
    element)`` must satisfy ``|analytic - numeric| <= atol + rtol * |numeric|``;
    analytic rows come from one tape gradient per output element (outputs that do not depend
    on the inputs have a zero Jacobian).

    Complex numbers count as pairs of reals, as in PyTorch's convention for complex gradients
    (a real loss ``L`` gives a complex source ``z`` the gradient ``dL/dRe(z) + i dL/dIm(z)``):
    the finite differences step the real and the imaginary part of each complex input element,
    and each complex output element gives two rows, its real part (the tape's gradient for the
    seed ``1``) and its imaginary part (for the seed ``1j``). So both parts of every complex
    gradient are checked; a mismatch names the part.

    Args:
        fn: the function to check, built from differentiable operations.
        inputs: its positional arguments.
        eps: the finite-difference step.
        atol: absolute tolerance.
        rtol: relative tolerance.

    Returns:
        ``True`` when every entry agrees.

    Raises:
        GradcheckError: naming the worst entry (output, input, indices, both values).
        TypeError: ``inputs`` is not a sequence, ``fn`` returns non-arrays, or ``eps``,
            ``atol`` or ``rtol`` is not a real number.
        ValueError: no floating-point or complex array input, ``eps`` not positive and
            finite, or ``atol``/``rtol`` negative or not finite.

    Warns:
        UserWarning: a floating-point input is not float64, or a complex one not complex128
            (it is checked in double precision).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import ops
        >>> x = np.array([0.5, -1.0])
        >>> cupy_parallel.gradcheck(lambda x: ops.tanh(ops.multiply(x, x)), [x])
        True
    """
    read_sequence(
        inputs,
        "inputs",
        expected="a list or tuple of fn's arguments",
        hint="wrap a single array as [x]",
        lists_only=True,
    )
    eps, atol, rtol = (
        _read_tolerance(v, name, positive=name == "eps")
        for v, name in ((eps, "eps"), (atol, "atol"), (rtol, "rtol"))
    )
    args = list(inputs)
    for i, x in enumerate(args):
        double = _DOUBLE.get(x.dtype.kind) if is_array(x) else None
        if double is not None and x.dtype != double:
            warnings.warn(
                f"gradcheck input {i} has dtype {x.dtype}; finite differences need double "
                f"precision, so it is checked on a {double} copy. Pass x.astype(numpy.{double}) "
                f"to check in {double} explicitly.",
                UserWarning,
                stacklevel=2,
            )
            args[i] = on_device_of(x, x.astype, double)
    wrt = [i for i, x in enumerate(args) if is_array(x) and x.dtype.kind in _DOUBLE]
    if not wrt:
        raise ValueError(
            "gradcheck needs at least one floating-point or complex array among inputs."
        )

    outputs, numeric = _numeric_jacobian(fn, args, wrt, eps)  # [output][input]: (out, in)
    analytic = _analytic_jacobian(fn, args, wrt)
    worst: tuple[float, str] | None = None
    for o, per_input in enumerate(numeric):
        for k, num in enumerate(per_input):
            ana = analytic[o][k]
            excess = np.abs(ana - num) - (atol + rtol * np.abs(num))
            if not excess.size or excess.max() <= 0 or (worst and excess.max() <= worst[0]):
                continue
            r, c = (int(i) for i in np.unravel_index(int(np.argmax(excess)), excess.shape))
            source = args[wrt[k]]
            worst = (
                float(excess.max()),
                (
                    f"output {o} at {_where(r, outputs[o])} with respect to input {wrt[k]} at "
                    f"{_where(c, source)}: numerical {num[r, c]:.6g}, analytical "
                    f"{ana[r, c]:.6g} (|difference| {abs(num[r, c] - ana[r, c]):.3g} exceeds "
                    f"atol + rtol * |numerical| with atol={atol}, rtol={rtol})"
                ),
            )
    if worst is not None:
        raise GradcheckError(f"Jacobian mismatch for {worst[1]}.")
    return True


def _read_tolerance(value: Any, name: str, *, positive: bool) -> float:
    """A finite real ``value`` (> 0 when ``positive``, else >= 0) as a float."""
    value = read_real(value, name)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a finite {bound} number, got {value}.")
    return value


_DOUBLE = {"f": np.dtype(np.float64), "c": np.dtype(np.complex128)}
"""The dtype finite differences use, by dtype kind: the kinds gradcheck differentiates."""


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def _where(row: int, x: Any) -> str:
    """Which element (and, for a complex ``x``, which part) row or column ``row`` stands for."""
    if x.dtype.kind != "c":
        return str(_index(row, x.shape))
    part = "imaginary" if row % 2 else "real"
    return f"{_index(row // 2, x.shape)} ({part} part)"


def _steps(x: Any, eps: float) -> list[complex | float]:
    """The finite-difference steps of each element of ``x``: the real, then the imaginary part."""
    return [eps, eps * 1j] if x.dtype.kind == "c" else [eps]


def _perturbed(x: Any, j: int, step: complex | float) -> Any:
    def perturb() -> Any:
        shifted = x.copy()
        index = _index(j, x.shape)
        shifted[index] = shifted[index] + step
        return shifted

    return on_device_of(x, perturb)


def _one_hot(y: Any, j: int, value: complex | float) -> Any:
    seed = zeros_like(y)  # may keep y's memory layout: index it, never a reshaped copy
    on_device_of(seed, seed.__setitem__, _index(j, y.shape), value)
    return seed


def _numeric_jacobian(
    fn: Callable[..., Any], args: list[Any], wrt: list[int], eps: float
) -> tuple[list[Any], list[list[np.ndarray]]]:
    base = _outputs(fn, args)
    columns: list[list[list[np.ndarray]]] = [[[] for _ in wrt] for _ in base]
    for k, i in enumerate(wrt):
        for j in range(args[i].size):
            for step in _steps(args[i], eps):
                plus, minus = (
                    [_flat(y) for y in _call(fn, args, i, _perturbed(args[i], j, sign * step))]
                    for sign in (1, -1)
                )
                for o, (p, m) in enumerate(zip(plus, minus, strict=True)):
                    columns[o][k].append((p - m) / (2 * eps))
    jacobians = [
        [np.stack(c, axis=1) if c else np.zeros((_real_size(y), 0)) for c in per_input]
        for y, per_input in zip(base, columns, strict=True)
    ]
    return base, jacobians


def _real_size(x: Any) -> int:
    """How many real numbers ``x`` holds: a complex element is two."""
    return x.size * (2 if x.dtype.kind == "c" else 1)


def _flat(y: Any, *, pairs: bool | None = None) -> np.ndarray:
    """``y``'s values as float64, flat; with ``pairs`` each element as its real and imaginary part.

    ``pairs`` defaults to whether ``y`` is complex; a gradient takes its source's (a complex
    source's real gradient is complex with a zero imaginary part).
    """
    host = _host(y)
    if host.dtype.kind == "c" if pairs is None else pairs:
        host = host.astype(np.complex128)
        return np.stack([host.real, host.imag], axis=-1).ravel()
    return host.astype(np.float64).ravel()


def _call(fn: Callable[..., Any], args: list[Any], i: int, value: Any) -> list[Any]:
    shifted = list(args)
    shifted[i] = value
    return _outputs(fn, shifted)


def _analytic_jacobian(
    fn: Callable[..., Any], args: list[Any], wrt: list[int]
) -> list[list[np.ndarray]]:
    sources = [args[i] for i in wrt]
    with Tape(persistent=True) as tape:
        tape.watch(sources)
        outputs = _outputs(fn, args)
    jacobians = []
    for y in outputs:
        rows: list[list[np.ndarray]] = [[] for _ in wrt]
        tracked = tape.tracks(y)
        for j in range(y.size):
            for value in _steps(y, 1.0):  # the real part's row, then the imaginary part's
                seed = _one_hot(y, j, value)
                grads = pullback(tape, [y], [seed], sources) if tracked else [None] * len(wrt)
                for k, g in enumerate(grads):
                    source = sources[k]
                    pairs = source.dtype.kind == "c"
                    rows[k].append(
                        np.zeros(_real_size(source)) if g is None else _flat(g, pairs=pairs)
                    )
        jacobians.append(
            [
                np.stack(r) if r else np.zeros((0, _real_size(sources[k])))
                for k, r in enumerate(rows)
            ]
        )
    return jacobians
