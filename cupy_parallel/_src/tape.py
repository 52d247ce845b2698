"""Reverse-mode automatic differentiation on plain NumPy, HostArray and CuPy arrays.

A :class:`Tape` records, while it is active, every differentiable operation (an op of
:mod:`cupy_parallel.ops` or a :class:`Function`) whose inputs it *tracks*: arrays passed to
:meth:`Tape.watch` and the outputs of recorded operations. Arrays stay ordinary array objects; the
tape knows them by identity and keeps a reference to each, so their ids stay valid while it lives.

A recorded operation is a *node*, a plain tuple ``(vjp, inputs, needs, outputs, aux, cuda)``:

- ``vjp(cotangents, inputs, needs, outputs, aux)`` maps the list of output gradients to one
  gradient (or ``None``) per input; ``aux`` carries whatever else it needs (axes, a ctx);
- ``needs[i]`` says whether input ``i`` is tracked (only those receive gradients);
- ``cuda`` is the ``cupy.cuda.Device`` the vjp runs on, ``None`` on the host.

Nodes are tuples and vjps module-level functions (no closures) because recording is the hot path
of a training step: fewer allocations, and far fewer objects for Python's cyclic collector.

Nodes are appended in the order they run; an operation can only consume arrays that already
exist, so that order is a topological order of the graph, and :meth:`Tape.gradient` is one
reversed loop over it (micrograd's ``Value.backward``). The active tape lives in a
:class:`contextvars.ContextVar`, so ``contextvars.copy_context().run(...)`` carries it into worker
threads; recording takes a lock, so threads may record on one tape concurrently.
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import optree

from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.hostarray import HostArray

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["Function", "FunctionContext", "Tape"]

NAMESPACE = "cupy_parallel"
"""The optree namespace of pytrees in this package (custom nodes register under it)."""

_ACTIVE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar(
    "cupy_parallel_active_tape", default=None
)

Vjp: TypeAlias = (
    "Callable[[list[Any], tuple[Any, ...], tuple[bool, ...], tuple[Any, ...], Any], Sequence[Any]]"
)
Node: TypeAlias = "tuple[Vjp, tuple[Any, ...], tuple[bool, ...], tuple[Any, ...], Any, Any]"


# --------------------------------------------------------------------------------------------
# Device helpers: CuPy computes on its *current* device, so CUDA work enters the array's device.


def cuda_device(x: Any, /) -> Any:
    """The ``cupy.cuda.Device`` of a CuPy array, ``None`` for host arrays and scalars."""
    if isinstance(x, np.ndarray) or type(x) is HostArray or not is_array(x):
        return None
    return x.device


def on_device_of(x: Any, fn: Callable[..., Any], /, *args: Any) -> Any:
    """``fn(*args)`` with CuPy's current device set to that of ``x`` (a plain call on the host)."""
    device = cuda_device(x)
    if device is None:
        return fn(*args)
    with device:
        return fn(*args)


def _namespace(x: Any) -> Any:
    return np if isinstance(x, np.ndarray) else device_of(x).xp


def zeros_like(x: Any, /) -> Any:
    """Zeros shaped like ``x`` on ``x``'s device (a HostArray stays on its host device)."""
    return on_device_of(x, _namespace(x).zeros_like, x)


def ones_like(x: Any, /) -> Any:
    """Ones shaped like ``x`` on ``x``'s device."""
    return on_device_of(x, _namespace(x).ones_like, x)


def _accumulate(total: Any, grad: Any) -> Any:
    if isinstance(total, np.ndarray):
        total = total + grad
        return total if isinstance(total, np.ndarray) else np.asarray(total)  # 0-d NumPy
    with total.device:
        return total + grad


def active_tape() -> Tape | None:
    """The tape recording in this context, or ``None``."""
    return _ACTIVE.get()


# needs of a binary op, indexed by [a is tracked][b is tracked]: constants, nothing to allocate
_NEEDS = ((None, (False, True)), ((True, False), (True, True)))


def _keystr(path: tuple[Any, ...], root: str) -> str:
    return root + "".join(f"[{key!r}]" for key in path)


# --------------------------------------------------------------------------------------------
# Tape


class Tape:
    """Records differentiable operations and computes gradients by reverse accumulation.

    Use it as a context manager: operations run inside the ``with`` block on tracked arrays are
    recorded (the innermost active tape records; arrays it does not track pass through
    unrecorded). Gradients of one array used several times are summed; outputs of a multi-output
    operation whose gradient never arrives get zeros.

    Decisions where PyTorch and TensorFlow differ:

    - A source the target does not depend on gets a zero gradient (TensorFlow's
      ``UnconnectedGradients.ZERO``), so the result has the sources' exact pytree shape. A target
      that depends on *none* of the sources is an error, as is a source the tape never saw.
    - A target with more than one element needs ``output_gradients`` (as PyTorch's
      ``backward``); TensorFlow's implicit sum would hide shape bugs.
    - A non-persistent tape computes gradients once, then releases its records.
    - Only floating-point arrays can be watched (integer arrays have no gradient).
    - Gradients with respect to intermediate results are allowed (as TensorFlow); gradient
      computations themselves are never recorded (no higher-order derivatives).
    - Worker threads record when they run in a copy of the recording context
      (``contextvars.copy_context().run``, which ``parallel_apply`` does).

    Args:
        persistent: allow :meth:`gradient` to be called more than once.

    Example:
        >>> from cupy_parallel import ops
        >>> w = np.array([1.0, 2.0])
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(w)
        ...     loss = ops.sum(ops.square(w))
        >>> tape.gradient(loss, w)
        array([2., 4.])
    """

    def __init__(self, *, persistent: bool = False) -> None:
        if not isinstance(persistent, bool):
            raise TypeError(f"persistent must be a bool, got {type(persistent).__name__}.")
        self.persistent = persistent
        self._tracked: dict[int, Any] = {}  # id -> array: every tracked array, kept alive
        self._leaves: set[int] = set()  # ids of watched arrays no recorded operation produced
        self._nodes: list[Node] = []
        self._lock = threading.Lock()
        self._token: contextvars.Token[Tape | None] | None = None
        self._used = False

    def __repr__(self) -> str:
        return (
            f"Tape(persistent={self.persistent}, nodes={len(self._nodes)}, "
            f"tracked={len(self._tracked)}, recording={self._token is not None})"
        )

    def __enter__(self) -> Tape:
        if self._token is not None:
            raise RuntimeError("This tape is already recording; a tape cannot be entered twice.")
        self._check_unused("record")
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None

    def _check_unused(self, action: str) -> None:
        if self._used:
            raise RuntimeError(
                f"Cannot {action}: this non-persistent tape already computed its gradients and "
                "released its records. Use cupy_parallel.Tape(persistent=True) to call "
                "gradient() more than once."
            )

    # -- tracking ------------------------------------------------------------------------

    def watch(self, params: Any, /) -> None:
        """Track every array leaf of the pytree ``params`` (namespace ``"cupy_parallel"``).

        Example:
            >>> tape = cupy_parallel.Tape()
            >>> tape.watch({"w": np.ones(2), "b": np.zeros(1)})
        """
        self._check_unused("watch")
        leaves_with_paths = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
        paths, leaves = leaves_with_paths[0], leaves_with_paths[1]
        for path, leaf in zip(paths, leaves, strict=True):
            if not is_array(leaf):
                raise TypeError(
                    f"watch() tracks arrays, but {_keystr(path, 'params')} is a "
                    f"{type(leaf).__name__}. Pass NumPy/CuPy/HostArray leaves (None is skipped)."
                )
            if leaf.dtype.kind != "f":
                raise TypeError(
                    f"watch() tracks floating-point arrays, but {_keystr(path, 'params')} has "
                    f"dtype {leaf.dtype}. Cast it first, e.g. array.astype(numpy.float32)."
                )
        with self._lock:
            for leaf in leaves:
                if id(leaf) not in self._tracked:
                    self._leaves.add(id(leaf))
                    self._tracked[id(leaf)] = leaf

    def tracks(self, x: Any, /) -> bool:
        """Whether ``x`` is watched or was produced by an operation recorded on this tape.

        Example:
            >>> w = np.ones(2)
            >>> tape = cupy_parallel.Tape()
            >>> tape.watch(w)
            >>> tape.tracks(w), tape.tracks(np.ones(2))
            (True, False)
        """
        return id(x) in self._tracked

    def _needs(self, inputs: tuple[Any, ...], /) -> tuple[bool, ...] | None:
        """Which ``inputs`` are tracked, or ``None`` when none is (nothing to record)."""
        tracked = self._tracked
        needs = tuple([id(x) in tracked for x in inputs])
        return needs if True in needs else None

    def _record(
        self,
        vjp: Vjp,
        inputs: tuple[Any, ...],
        needs: tuple[bool, ...],
        outputs: tuple[Any, ...],
        aux: Any,
        *,
        tracked: Sequence[Any],
    ) -> None:
        """Append a node; the ``tracked`` outputs (a subset of ``outputs``) become tracked."""
        node = (vjp, inputs, needs, outputs, aux, cuda_device(outputs[0]) if outputs else None)
        with self._lock:
            self._nodes.append(node)
            for y in tracked:
                self._tracked[id(y)] = y

    def _record_unary(self, vjp: Vjp, x: Any, z: Any, aux: Any, /) -> None:
        """Record ``z = op(x)`` if ``x`` is tracked (the fast path of :meth:`_record`)."""
        if id(x) in self._tracked:
            node = (vjp, (x,), (True,), (z,), aux, None if isinstance(z, np.ndarray) else z.device)
            with self._lock:
                self._nodes.append(node)
                self._tracked[id(z)] = z

    def _record_binary(self, vjp: Vjp, a: Any, b: Any, z: Any, aux: Any, /) -> None:
        """Record ``z = op(a, b)`` if ``a`` or ``b`` is tracked."""
        tracked = self._tracked
        needs = _NEEDS[id(a) in tracked][id(b) in tracked]
        if needs is not None:
            node = (vjp, (a, b), needs, (z,), aux, None if isinstance(z, np.ndarray) else z.device)
            with self._lock:
                self._nodes.append(node)
                tracked[id(z)] = z

    # -- differentiation -----------------------------------------------------------------

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None) -> Any:
        """Gradients of ``target`` with respect to ``sources``, in the sources' pytree shape.

        Args:
            target: a recorded array, or a pytree of them (their contributions add up).
            sources: a pytree of watched or recorded arrays.
            output_gradients: the gradient flowing into ``target`` (same pytree, shapes and
                devices). Defaults to ones, which needs a target with exactly one element.

        Returns:
            One gradient per source leaf, on that source's device, with its shape and dtype.
            Sources the target does not depend on get zeros.

        Raises:
            ValueError: the target was not recorded on this tape or does not depend on any
                source, a source was never tracked, or ``output_gradients`` does not match.
            TypeError: a leaf of ``target``, ``sources`` or ``output_gradients`` is not an array.
            RuntimeError: a non-persistent tape is asked a second time.

        Example:
            >>> from cupy_parallel import ops
            >>> x, y = np.array(3.0), np.array(4.0)
            >>> with cupy_parallel.Tape() as tape:
            ...     tape.watch((x, y))
            ...     z = ops.multiply(x, y)
            >>> tape.gradient(z, {"x": x, "y": y})
            {'x': array(4.), 'y': array(3.)}
        """
        self._check_unused("compute gradients")
        targets, seeds = self._check_targets(target, output_gradients)
        source_paths, source_leaves, source_def = optree.tree_flatten_with_path(
            sources, namespace=NAMESPACE
        )
        for path, leaf in zip(source_paths, source_leaves, strict=True):
            if not is_array(leaf):
                raise TypeError(
                    f"gradient() differentiates with respect to arrays, but "
                    f"{_keystr(path, 'sources')} is a {type(leaf).__name__}."
                )
            if id(leaf) not in self._tracked:
                raise ValueError(
                    f"{_keystr(path, 'sources')} was never watched or recorded on this tape, so "
                    "it has no gradient. Call tape.watch(source) inside the `with tape:` block "
                    "before computing the target from it."
                )
        grads = self._pullback(targets, seeds, source_leaves)
        if source_leaves and all(g is None for g in grads):
            raise ValueError(
                "The target does not depend on any of the sources on this tape: no recorded "
                "operation leads from a source to the target. Check that the sources passed to "
                "gradient() are the arrays the target was computed from."
            )
        seen = {id(s) for s in seeds}
        result = []
        for leaf, grad in zip(source_leaves, grads, strict=True):
            g = zeros_like(leaf) if grad is None else grad
            if id(g) in seen:  # never hand back an array the caller passed in, or one twice
                g = on_device_of(g, g.copy)
            seen.add(id(g))
            result.append(g)
        if not self.persistent:
            self._used = True
            self._nodes, self._tracked, self._leaves = [], {}, set()
        return optree.tree_unflatten(source_def, result)

    def _check_targets(self, target: Any, output_gradients: Any) -> tuple[list[Any], list[Any]]:
        paths, targets, target_def = optree.tree_flatten_with_path(target, namespace=NAMESPACE)
        if not targets:
            raise ValueError("gradient() needs a target array, got an empty structure.")
        for path, t in zip(paths, targets, strict=True):
            name = "target" if not path else _keystr(path, "target")
            if not is_array(t):
                raise TypeError(
                    f"gradient() needs {name} to be an array, got {type(t).__name__}. Compute "
                    "it with cupy_parallel.ops inside the `with tape:` block."
                )
            if id(t) not in self._tracked:
                raise ValueError(
                    f"{name} was not recorded on this tape: it was produced by an operation the "
                    "tape never saw. Likely causes: a raw NumPy/CuPy expression such as `x @ w` "
                    "instead of cupy_parallel.ops.matmul(x, w), a computation outside the "
                    "`with tape:` block, or inputs that were never watched."
                )
        if output_gradients is None:
            for path, t in zip(paths, targets, strict=True):
                if t.size != 1:
                    raise ValueError(
                        f"{'target' if not path else _keystr(path, 'target')} has shape "
                        f"{t.shape}: an implicit output gradient exists only for a target with "
                        "one element. Pass output_gradients with the target's shape, or reduce "
                        "the target first (e.g. ops.sum)."
                    )
            return targets, [ones_like(t) for t in targets]
        seeds = optree.tree_leaves(output_gradients, namespace=NAMESPACE)
        seed_def = optree.tree_structure(output_gradients, namespace=NAMESPACE)
        if seed_def != target_def:
            raise ValueError(
                f"output_gradients must have the target's structure {target_def}, got {seed_def}."
            )
        for path, t, s in zip(paths, targets, seeds, strict=True):
            name = _keystr(path, "output_gradients")
            if not is_array(s):
                raise TypeError(f"{name} must be an array, got {type(s).__name__}.")
            if s.shape != t.shape or device_of(s) != device_of(t):
                raise ValueError(
                    f"{name} must match its target: shape {t.shape} on {device_of(t)}, got shape "
                    f"{s.shape} on {device_of(s)}. Move it with cupy_parallel.to_device."
                )
        return targets, seeds

    def _pullback(
        self, targets: Sequence[Any], seeds: Sequence[Any], sources: Sequence[Any], /
    ) -> list[Any]:
        """Reverse accumulation: the gradient of each source, ``None`` where none arrives.

        Unchecked: ``targets`` and ``sources`` must be tracked arrays and ``seeds`` their
        cotangents (:meth:`gradient` is the checked entry).
        """
        grads: dict[int, Any] = {}  # id(array) -> gradient accumulated so far
        for t, s in zip(targets, seeds, strict=True):
            k = id(t)
            grads[k] = s if k not in grads else _accumulate(grads[k], s)
        keep = {id(x) for x in sources} - self._leaves  # sources that are intermediate results
        kept: dict[int, Any] = {}
        pop = grads.pop
        token = _ACTIVE.set(None)  # backward computations are never recorded
        try:
            for vjp, inputs, needs, outputs, aux, cuda in reversed(self._nodes):
                size = len(grads)
                out_grads = [pop(id(y), None) for y in outputs]  # complete: consumers came later
                if len(grads) == size:
                    continue  # no gradient reaches this node
                if keep:
                    kept.update(
                        (id(y), g) for y, g in zip(outputs, out_grads, strict=True) if id(y) in keep
                    )
                if cuda is None:
                    in_grads = vjp(out_grads, inputs, needs, outputs, aux)
                else:
                    with cuda:
                        in_grads = vjp(out_grads, inputs, needs, outputs, aux)
                for x, need, g in zip(inputs, needs, in_grads, strict=True):
                    if need and g is not None:
                        k = id(x)
                        grads[k] = g if (total := grads.get(k)) is None else _accumulate(total, g)
        finally:
            _ACTIVE.reset(token)
        kept.update(grads)
        return [kept.get(id(x)) for x in sources]


# --------------------------------------------------------------------------------------------
# Function


class FunctionContext:
    """The ``ctx`` a :class:`Function`'s ``forward`` fills in and its ``backward`` reads.

    Besides the methods below, ``forward`` may store any attribute on it (``ctx.dim = dim``).

    Example:
        >>> ctx = FunctionContext((True, False))
        >>> ctx.save_for_backward(np.ones(2))
        >>> ctx.needs_input_grad, len(ctx.saved_arrays)
        ((True, False), 1)
    """

    def __init__(self, needs_input_grad: tuple[bool, ...], /) -> None:
        self.needs_input_grad = needs_input_grad
        self._saved: tuple[Any, ...] = ()
        self._non_differentiable: set[int] = set()

    if TYPE_CHECKING:  # forward stores arbitrary attributes for backward (ctx.dim = dim)

        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...

    def save_for_backward(self, *arrays: Any) -> None:
        """Keep arrays (or ``None``) for ``backward``; read them back from :attr:`saved_arrays`."""
        for i, a in enumerate(arrays):
            if a is not None and not is_array(a):
                raise TypeError(
                    f"save_for_backward takes arrays or None, got {type(a).__name__} at "
                    f"position {i}. Store other values as ctx attributes (ctx.name = value)."
                )
        self._saved = arrays

    @property
    def saved_arrays(self) -> tuple[Any, ...]:
        """The arrays given to :meth:`save_for_backward`, in order."""
        return self._saved

    def mark_non_differentiable(self, *outputs: Any) -> None:
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
    ``forward`` takes one argument). Call ``MyFunction.apply(*args)``.

    ``forward`` runs unrecorded. The call is recorded when the active tape tracks any array
    argument; ``ctx.needs_input_grad[i]`` tells whether argument ``i`` is tracked. ``backward``
    receives zeros for outputs whose gradient never arrived, and must return gradients with
    their input's shape on their input's device (checked). An output that is one of the inputs
    is returned as a new view, so that the graph stays acyclic.

    Example:
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
    def apply(cls, *args: Any) -> Any:
        """Run ``forward`` and record it on the active tape when it tracks an argument."""
        tape = _ACTIVE.get()
        needs = None if tape is None else tape._needs(args)
        ctx = FunctionContext(needs or (False,) * len(args))
        token = _ACTIVE.set(None)  # forward itself is never recorded
        try:
            result = cls.forward(ctx, *args)
        finally:
            _ACTIVE.reset(token)
        multiple = isinstance(result, tuple)
        outputs = tuple(
            np.asarray(y) if isinstance(y, np.generic) else y  # 0-d NumPy results as arrays
            for y in (result if multiple else (result,))
        )
        if tape is None or needs is None:
            return outputs if multiple else outputs[0]
        reused = {id(a) for a in args if is_array(a)}
        tracked_outputs = []
        fresh = []
        for y in outputs:
            differentiable = is_array(y) and id(y) not in ctx._non_differentiable
            if is_array(y) and (id(y) in reused or tape.tracks(y)):
                y = on_device_of(y, y.view)  # noqa: PLW2901 - a new object keeps the graph acyclic
            fresh.append(y)
            if differentiable:
                tracked_outputs.append(y)
        outputs = tuple(fresh)

        tape._record(_function_vjp, args, needs, outputs, (cls, ctx), tracked=tracked_outputs)
        return outputs if multiple else outputs[0]


def _function_vjp(
    cotangents: list[Any],
    inputs: tuple[Any, ...],
    needs: tuple[bool, ...],
    outputs: tuple[Any, ...],
    aux: tuple[type[Function], FunctionContext],
) -> Sequence[Any]:
    cls, ctx = aux
    filled = [
        zeros_like(y) if g is None and is_array(y) else g
        for y, g in zip(outputs, cotangents, strict=True)
    ]
    grads = cls.backward(ctx, *filled)
    grads = grads if isinstance(grads, tuple) else (grads,)
    grads = tuple(np.asarray(g) if isinstance(g, np.generic) else g for g in grads)  # 0-d NumPy
    _check_input_grads(cls, inputs, needs, grads)
    return grads


def _check_input_grads(
    cls: type, args: tuple[Any, ...], needs: tuple[bool, ...], grads: tuple[Any, ...]
) -> None:
    if len(grads) != len(args):
        raise ValueError(
            f"{cls.__name__}.backward returned {len(grads)} gradients, expected {len(args)}: one "
            "per forward argument, None for arguments without a gradient."
        )
    for i, (x, need, g) in enumerate(zip(args, needs, grads, strict=True)):
        if not need or g is None:
            continue
        if not is_array(g) or g.shape != x.shape or device_of(g) != device_of(x):
            got = f"shape {g.shape} on {device_of(g)}" if is_array(g) else type(g).__name__
            raise ValueError(
                f"{cls.__name__}.backward returned an invalid gradient for argument {i}: expected "
                f"shape {x.shape} on {device_of(x)}, got {got}."
            )
