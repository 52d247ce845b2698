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

    Floating-point array inputs are differentiated, in float64 on their own devices; other
    inputs are passed through. Finite differences need float64: a float16/float32 input draws a
    ``UserWarning`` (PyTorch's ``gradcheck`` warns on non-double inputs too) and is checked on a
    float64 copy, so the check tests the math of ``fn``, not its rounding in low precision.
    ``fn`` returns an array or a pytree of arrays. Every Jacobian entry ``(output element, input
    element)`` must satisfy ``|analytic - numeric| <= atol + rtol * |numeric|``;
    analytic columns come from one tape gradient per output element (outputs that do not depend
    on the inputs have a zero Jacobian).

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
        ValueError: no floating-point array input, ``eps`` not positive and finite, or
            ``atol``/``rtol`` negative or not finite.

    Warns:
        UserWarning: a floating-point input is not float64 (it is checked in float64).

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
        if is_array(x) and x.dtype.kind == "f" and x.dtype != np.float64:
            warnings.warn(
                f"gradcheck input {i} has dtype {x.dtype}; finite differences need float64, so "
                "it is checked on a float64 copy. Pass x.astype(numpy.float64) to check in "
                "float64 explicitly.",
                UserWarning,
                stacklevel=2,
            )
            args[i] = on_device_of(x, x.astype, np.float64)
    wrt = [i for i, x in enumerate(args) if is_array(x) and x.dtype.kind == "f"]
    if not wrt:
        raise ValueError("gradcheck needs at least one floating-point array among inputs.")

    shapes, numeric = _numeric_jacobian(fn, args, wrt, eps)  # [output][input]: (out, in)
    analytic = _analytic_jacobian(fn, args, wrt)
    worst: tuple[float, str] | None = None
    for o, per_input in enumerate(numeric):
        for k, num in enumerate(per_input):
            ana = analytic[o][k]
            excess = np.abs(ana - num) - (atol + rtol * np.abs(num))
            if not excess.size or excess.max() <= 0 or (worst and excess.max() <= worst[0]):
                continue
            r, c = (int(i) for i in np.unravel_index(int(np.argmax(excess)), excess.shape))
            worst = (
                float(excess.max()),
                (
                    f"output {o} at {_index(r, shapes[o])} with respect to input {wrt[k]} at "
                    f"{_index(c, args[wrt[k]].shape)}: numerical {num[r, c]:.6g}, analytical "
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


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def _perturbed(x: Any, j: int, step: float) -> Any:
    def perturb() -> Any:
        shifted = x.copy()
        index = _index(j, x.shape)
        shifted[index] = shifted[index] + step
        return shifted

    return on_device_of(x, perturb)


def _one_hot(y: Any, j: int) -> Any:
    seed = zeros_like(y)  # may keep y's memory layout: index it, never a reshaped copy
    on_device_of(seed, seed.__setitem__, _index(j, y.shape), 1)
    return seed


def _numeric_jacobian(
    fn: Callable[..., Any], args: list[Any], wrt: list[int], eps: float
) -> tuple[list[tuple[int, ...]], list[list[np.ndarray]]]:
    base = _outputs(fn, args)
    columns: list[list[list[np.ndarray]]] = [[[] for _ in wrt] for _ in base]
    for k, i in enumerate(wrt):
        for j in range(args[i].size):
            plus, minus = (
                [_flat(y) for y in _call(fn, args, i, _perturbed(args[i], j, step))]
                for step in (eps, -eps)
            )
            for o, (p, m) in enumerate(zip(plus, minus, strict=True)):
                columns[o][k].append((p - m) / (2 * eps))
    jacobians = [
        [np.stack(c, axis=1) if c else np.zeros((y.size, 0)) for c in per_input]
        for y, per_input in zip(base, columns, strict=True)
    ]
    return [y.shape for y in base], jacobians


def _flat(y: Any) -> np.ndarray:
    return _host(y).astype(np.float64).ravel()


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
        for j in range(y.size):
            seed = _one_hot(y, j)
            grads = pullback(tape, [y], [seed], sources) if tape.tracks(y) else [None] * len(wrt)
            for k, g in enumerate(grads):
                rows[k].append(np.zeros(sources[k].size) if g is None else _flat(g))
        jacobians.append(
            [np.stack(r) if r else np.zeros((0, sources[k].size)) for k, r in enumerate(rows)]
        )
    return jacobians
