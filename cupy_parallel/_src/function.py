"""Differentiable operations with a hand-written backward, as ``torch.autograd.Function``.

A :class:`Function` subclass defines ``forward`` and ``backward``; ``apply`` runs ``forward`` with
recording paused and records one node whose vjp calls ``backward`` with the
:class:`FunctionContext` ``forward`` filled in. Its checks name the Function and the argument:
a gradient of the wrong shape, device or count, a saved array written in place since.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.compute import cuda_device, on_device_of, zeros_like
from cupy_parallel._src.hostarray import version
from cupy_parallel._src.recording import (
    active_tapes,
    append_node,
    cast,
    modified_error,
    name_nodes,
    pause_recording,
    tapes_tracking,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array

__all__ = ["Function", "FunctionContext"]


class FunctionContext:
    """The ``ctx`` a :class:`Function`'s ``forward`` fills in and its ``backward`` reads.

    Besides the methods below, ``forward`` may store any attribute on it (``ctx.dim = dim``).

    Example:
        >>> import numpy as np
        >>> ctx = FunctionContext((True, False))
        >>> ctx.save_for_backward(np.ones(2))
        >>> ctx.needs_input_grad, len(ctx.saved_arrays)
        ((True, False), 1)
    """

    def __init__(self, needs_input_grad: tuple[bool, ...], /) -> None:
        self.needs_input_grad = needs_input_grad
        self._saved: tuple[Any, ...] = ()
        self._versions: tuple[int | None, ...] = ()
        self._non_differentiable: set[int] = set()

    if TYPE_CHECKING:  # forward stores arbitrary attributes for backward (ctx.dim = dim)

        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def save_for_backward(self, *arrays: Array | None) -> None:
        """Keep arrays (or ``None``) for ``backward``; read them back from :attr:`saved_arrays`."""
        for i, a in enumerate(arrays):
            if a is not None and not is_array(a):
                raise TypeError(
                    f"save_for_backward takes arrays or None, got {type(a).__name__} at "
                    f"position {i}. Store other values as ctx attributes (ctx.name = value)."
                )
        self._saved = arrays
        self._versions = tuple(version(a) for a in arrays)

    def _check_saved(self, function: str) -> None:
        """Raise if a saved host array was written in place since it was saved."""
        for i, (a, recorded) in enumerate(zip(self._saved, self._versions, strict=True)):
            if recorded is not None and version(a) != recorded:
                raise modified_error(function, f"saved array {i}", a, recorded)

    @property
    def saved_arrays(self) -> tuple[Array, ...]:
        """The arrays given to :meth:`save_for_backward`, in order."""
        return self._saved

    @property
    def saved_tensors(self) -> tuple[Array, ...]:
        """PyTorch's name for :attr:`saved_arrays` (the same tuple)."""
        return self._saved

    def mark_non_differentiable(self, *outputs: Array) -> None:
        """Declare outputs that carry no gradient: the tape does not track them."""
        for i, y in enumerate(outputs):
            if not is_array(y):
                raise TypeError(
                    f"mark_non_differentiable takes output arrays, got {type(y).__name__} at "
                    f"position {i}."
                )
        self._non_differentiable.update(id(y) for y in outputs)


class Function:
    """Base class of differentiable operations with a hand-written backward, as in PyTorch.

    Subclasses define ``@staticmethod forward(ctx, *args)`` returning an array or a tuple of
    arrays, and ``@staticmethod backward(ctx, *grads)`` returning one gradient per ``forward``
    argument (``None`` for non-arrays and arguments that need none; a single value when
    ``forward`` takes one argument). Call ``MyFunction.apply(*args, **kwargs)``; keyword
    arguments are bound to ``forward``'s parameters and count as the positional argument of
    that name (keyword-only parameters are never differentiated).

    ``forward`` runs with recording paused (as PyTorch runs it under ``no_grad``). The call is
    recorded on every active tape that tracks an array argument; ``ctx.needs_input_grad[i]``
    tells whether argument ``i`` is tracked by one. Outputs that are not floating-point (or
    complex) arrays, and those passed to ``ctx.mark_non_differentiable``, are not tracked.
    ``backward`` receives zeros for outputs whose gradient never arrived, and must return
    gradients with their input's shape on their input's device (checked, naming the Function
    and the argument); a gradient of another dtype is cast to the input's (as PyTorch does),
    but a complex gradient for a real input is refused. An output that is one of the inputs is
    returned as a new view, so that the graph stays acyclic.

    Higher order: by default ``backward`` also runs with recording paused, so raw NumPy is fine
    in it, and differentiating its result again raises (PyTorch's ``once_differentiable``).
    A subclass whose ``backward`` is written with recorded operations (``cupy_parallel.ops``,
    other Functions) sets ``differentiable_backward = True``: its backward is then recorded on
    the outer tapes, giving second derivatives.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> class Cube(cupy_parallel.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x**3
        ...
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         (x,) = ctx.saved_arrays
        ...         return 3 * x**2 * grad
        >>> x = np.array([1.0, 2.0])
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(x)
        ...     y = Cube.apply(x)
        >>> tape.gradient(y, x, output_gradients=np.ones(2))
        array([ 3., 12.])
    """

    differentiable_backward: ClassVar[bool] = False
    _forward_parameters: ClassVar[tuple[inspect.Signature, tuple[str, ...]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("forward", "backward"):
            if getattr(cls, name) is getattr(Function, name):
                raise TypeError(
                    f"Function subclass {cls.__name__} must define @staticmethod {name}(ctx, ...)."
                )

    @staticmethod
    def forward(ctx: FunctionContext, *args: Any) -> Any:
        """Compute the outputs from ``args`` (defined by subclasses)."""
        raise NotImplementedError("Function subclasses define forward(ctx, *args).")

    @staticmethod
    def backward(ctx: FunctionContext, *grads: Any) -> Any:
        """Map output gradients to input gradients (defined by subclasses)."""
        raise NotImplementedError("Function subclasses define backward(ctx, *grads).")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run ``forward`` and record it on every active tape that tracks an argument."""
        if kwargs:
            args, kwargs = _bind(cls, args, kwargs)
        tapes = tapes_tracking(args)
        needs = tuple(any(n[i] for _, n in tapes) for i in range(len(args)))
        ctx = FunctionContext(needs if tapes else (False,) * len(args))
        with pause_recording():  # forward itself is never recorded
            result = cls.forward(ctx, *args, **kwargs)
        multiple = isinstance(result, tuple)
        outputs = tuple(
            np.asarray(y) if isinstance(y, np.generic) else y  # 0-d NumPy results as arrays
            for y in (result if multiple else (result,))
        )
        if tapes:
            outputs, tracked = _fresh_outputs(outputs, args, ctx._non_differentiable)
            cuda = cuda_device(outputs[0]) if outputs else None
            for tape, tape_needs in tapes:
                node = (_function_vjp, args, tape_needs, outputs, (cls, ctx), cuda)
                append_node(tape, node, tracked)
        return outputs if multiple else outputs[0]


def _differentiable(y: Any) -> bool:
    return is_array(y) and y.dtype.kind in "fc"


def _fresh_outputs(
    outputs: tuple[Any, ...], inputs: Sequence[Any], excluded: set[int]
) -> tuple[tuple[Any, ...], list[Any]]:
    """Outputs as new objects where they are inputs or already tracked, and those to track.

    A new object keeps the graph acyclic; the outputs to track are the differentiable ones not
    in ``excluded``.
    """
    reused = {id(a) for a in inputs if is_array(a)}
    tapes = active_tapes()
    fresh, tracked = [], []
    for y in outputs:
        differentiable = _differentiable(y) and id(y) not in excluded
        if is_array(y) and (id(y) in reused or any(t.tracks(y) for t in tapes)):
            y = on_device_of(y, y.view)  # noqa: PLW2901 - a new object keeps the graph acyclic
        fresh.append(y)
        if differentiable:
            tracked.append(y)
    return tuple(fresh), tracked


def _parameters(cls: type[Function]) -> tuple[inspect.Signature, tuple[str, ...]]:
    """``forward``'s signature and the names of its positional arguments after ``ctx``."""
    if "_forward_parameters" in cls.__dict__:
        return cls._forward_parameters
    signature = inspect.signature(cls.forward)
    names = []
    for p in list(signature.parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            names.append(f"*{p.name}")
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    cls._forward_parameters = (signature, tuple(names))
    return cls._forward_parameters


def _bind(cls: type[Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``args, kwargs`` with every keyword that names a positional parameter moved into args."""
    signature, _ = _parameters(cls)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{cls.__name__}.apply: {error}.") from None
    bound.apply_defaults()
    positional, keywords = bound.args[1:], bound.kwargs
    for name, value in keywords.items():
        if any(t.tracks(value) for t in active_tapes()):
            raise ValueError(
                f"{cls.__name__}.apply: keyword-only argument {name!r} is an array a tape "
                "tracks, but only positional arguments of forward are differentiated. Make it a "
                "positional parameter, or pass cupy_parallel.stop_gradient(value)."
            )
    return positional, keywords


def _argument(cls: type[Function], i: int) -> str:
    """``argument 1 ('w')``: how an error names forward's argument ``i``."""
    names = _parameters(cls)[1]
    name = names[i] if i < len(names) and not names[i].startswith("*") else (names or ["?"])[-1]
    return f"argument {i} ({name!r})"


def _function_vjp(
    cotangents: list[Any],
    inputs: tuple[Any, ...],
    needs: tuple[bool, ...],
    outputs: tuple[Any, ...],
    aux: tuple[type[Function], FunctionContext],
) -> Sequence[Any]:
    cls, ctx = aux
    ctx._check_saved(cls.__name__)
    filled = [
        zeros_like(y) if g is None and is_array(y) else g
        for y, g in zip(outputs, cotangents, strict=True)
    ]
    outer = active_tapes()
    if cls.differentiable_backward or not outer:
        grads = cls.backward(ctx, *filled)
    else:
        with pause_recording():
            grads = cls.backward(ctx, *filled)
    grads = grads if isinstance(grads, tuple) else (grads,)
    grads = tuple(np.asarray(g) if isinstance(g, np.generic) else g for g in grads)  # 0-d NumPy
    grads = _check_input_grads(cls, inputs, needs, grads)
    if outer and not cls.differentiable_backward:
        grads = _mark_once_differentiable(cls, (*inputs, *filled), grads)
    return grads


def _check_input_grads(
    cls: type[Function], args: tuple[Any, ...], needs: tuple[bool, ...], grads: tuple[Any, ...]
) -> tuple[Any, ...]:
    if len(grads) != len(args):
        raise ValueError(
            f"{cls.__name__}.backward returned {len(grads)} gradients, expected {len(args)}: one "
            "per forward argument, None for arguments without a gradient."
        )
    checked = []
    for i, (x, need, grad) in enumerate(zip(args, needs, grads, strict=True)):
        g = grad
        if need and g is not None:
            if not is_array(g) or g.shape != x.shape or device_of(g) != device_of(x):
                got = f"shape {g.shape} on {device_of(g)}" if is_array(g) else type(g).__name__
                raise ValueError(
                    f"{cls.__name__}.backward returned an invalid gradient for "
                    f"{_argument(cls, i)}: expected shape {x.shape} on {device_of(x)}, got {got}."
                )
            if g.dtype != x.dtype:
                if g.dtype.kind == "c" and x.dtype.kind != "c":
                    raise TypeError(
                        f"{cls.__name__}.backward returned a complex gradient ({g.dtype}) for "
                        f"{_argument(cls, i)}, which is real ({x.dtype})."
                    )
                g = cast(g, x.dtype)  # as PyTorch does
        checked.append(g)
    return tuple(checked)


def _mark_once_differentiable(
    cls: type[Function], consumed: tuple[Any, ...], grads: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Track a non-differentiable backward's results on the outer tapes, raising if reached.

    Only tapes that track what the backward consumed record the node; its vjp raises if a
    gradient reaches it (PyTorch's ``once_differentiable``).
    """
    tapes = tapes_tracking(consumed)
    if not tapes:
        return grads
    arrays = [g for g in grads if is_array(g)]
    fresh, tracked = _fresh_outputs(tuple(arrays), consumed, set())
    for tape, needs in tapes:
        append_node(tape, (_once_differentiable_vjp, consumed, needs, fresh, cls, None), tracked)
    swap = iter(fresh)
    return tuple(next(swap) if is_array(g) else g for g in grads)


def _once_differentiable_vjp(
    gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, cls: type[Function]
) -> Any:
    raise RuntimeError(
        f"{cls.__name__}.backward is not differentiable: it ran with recording paused, so a "
        "higher-order gradient through it is unknown. Write its backward with "
        f"cupy_parallel.ops (or other Functions) and set {cls.__name__}.differentiable_backward "
        "= True."
    )


def _function_name(aux: tuple[type[Function], FunctionContext]) -> str:
    return str(aux[0].__name__)


name_nodes(_function_vjp, _function_name)  # errors name a Function's nodes by its class
