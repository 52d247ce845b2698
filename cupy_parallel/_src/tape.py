"""Reverse-mode automatic differentiation on plain NumPy, HostArray and CuPy arrays.

A :class:`Tape` records, while it is active, every differentiable operation (an op of
:mod:`cupy_parallel.ops` or a :class:`Function`) whose inputs it *tracks*: arrays passed to
:meth:`Tape.watch` and the outputs of recorded operations. Arrays stay ordinary array objects; the
tape knows them by identity and keeps a reference to each, so their ids stay valid while it lives.

Every active tape records (``tf.GradientTape`` semantics): an operation is recorded on each tape
of the context that tracks one of its inputs, not only on the innermost. While a tape computes a
gradient it stops recording, but the other active tapes go on; vector-Jacobian products written
with recorded operations are therefore recorded on an outer tape, which gives second derivatives
and Hessian-vector products.

A recorded operation is a *node*, a plain tuple ``(vjp, inputs, needs, outputs, aux, cuda)``:

- ``vjp(cotangents, inputs, needs, outputs, aux)`` maps the list of output gradients to one
  gradient (or ``None``) per input; ``aux`` carries whatever else it needs (axes, a ctx);
- ``needs[i]`` says whether input ``i`` is tracked by this tape (only those receive gradients);
- ``cuda`` is the ``cupy.cuda.Device`` the vjp runs on, ``None`` on the host.

On host devices the tape also notes the version of every host array a node touches when it
first sees it; a node whose array was written in place since refuses to run (PyTorch's version
counter).

While a tape is entered, a HostArray dispatch guard refuses raw NumPy on arrays an active tape
tracks (the tape could not record it); the tape's own arithmetic runs on the host buffers.

Operations record themselves with :func:`record` (or its fast paths :func:`record_unary` and
:func:`record_binary`). Nodes are tuples and vjps module-level functions (no closures) because
recording is the hot path of a training step: fewer allocations, and far fewer objects for
Python's cyclic collector.

Nodes are appended in the order they run; an operation can only consume arrays that already
exist, so that order is a topological order of the graph, and :func:`pullback` is one reversed
loop over it (micrograd's ``Value.backward``). The active tapes live in a
:class:`contextvars.ContextVar`, so ``contextvars.copy_context().run(...)`` carries them into
worker threads; recording takes a lock, so threads may record on one tape concurrently.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import operator
import threading
import zlib
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np

from cupy_parallel._src import tree
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.hostarray import (
    HostArray,
    host_array,
    host_buffer,
    plain_buffer,
    set_dispatch_guard,
    version,
)
from cupy_parallel._src.tree import flatten_with_names

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.arraytypes import Tree

__all__ = [
    "Function",
    "FunctionContext",
    "Tape",
    "active_tapes",
    "is_recording",
    "pause_recording",
    "pullback",
    "record",
    "record_binary",
    "record_unary",
    "stop_gradient",
    "unguarded",
]

_ACTIVE: contextvars.ContextVar[tuple[Tape, ...]] = contextvars.ContextVar(
    "cupy_parallel_active_tapes", default=()
)

_IN_BACKWARD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cupy_parallel_in_backward", default=False
)
"""Whether a :func:`pullback` runs in this context (for the guard's message)."""

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


def _compute(fn: Callable[..., Any], x: Any, /, *args: Any) -> Any:
    """``fn(x, *args)`` on ``x``'s device; a HostArray through its buffer.

    For the tape's own arithmetic (zeros, sums of gradients, casts): the buffers skip the
    HostArray dispatch guard, which refuses raw NumPy on recorded arrays in *user* code.
    """
    if type(x) is HostArray:
        z = fn(host_buffer(x), *[plain_buffer(a) for a in args])
        return host_array(z if type(z) is np.ndarray else np.asarray(z), x.device)
    return on_device_of(x, fn, x, *args)


def _xp(x: Any) -> Any:
    return np if type(x) is np.ndarray or type(x) is HostArray else device_of(x).xp


def zeros_like(x: Any, /) -> Any:
    """Zeros shaped like ``x`` on ``x``'s device (a HostArray stays on its host device)."""
    return _compute(_xp(x).zeros_like, x)


def ones_like(x: Any, /) -> Any:
    """Ones shaped like ``x`` on ``x``'s device."""
    return _compute(_xp(x).ones_like, x)


def _astype(x: Any, dtype: Any) -> Any:
    return x.astype(dtype)


def _copy_of(x: Any) -> Any:
    return x.copy()


# --------------------------------------------------------------------------------------------
# Recording: the interface of differentiable operations


active_tapes: Callable[[], tuple[Tape, ...]] = _ACTIVE.get
"""The tapes recording in this context, outermost first (empty, so false, when none).

The context variable's own ``get``, not a Python function around it: ops call it once per
operation (``if active_tapes(): record...``), so it is the cheapest "is anything recording" test.
"""


def is_recording() -> bool:
    """Whether any tape records in this context (cheap: lets an op skip preparing a record)."""
    return bool(_ACTIVE.get())


@contextlib.contextmanager
def pause_recording() -> Iterator[None]:
    """No tape records inside the block (as a ``Function``'s ``forward`` runs)."""
    token = _ACTIVE.set(())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _placement(tape: Tape, inputs: tuple[Any, ...], outputs: tuple[Any, ...]) -> Any:
    """A node's last slot: the CUDA device its vjp runs on for CuPy, else ``None``.

    On host devices, first notes on ``tape`` the version of each host array the node touches
    that the tape has not seen yet (PyTorch's version-counter rule: :func:`pullback` refuses
    nodes whose arrays were written in place since).
    """
    if type(outputs[0]) is HostArray:
        seen = tape._versions
        for a in (*inputs, *outputs):
            if type(a) is HostArray and id(a) not in seen:
                seen[id(a)] = (a, version(a))
        return None
    return cuda_device(outputs[0])


def record(vjp: Vjp, inputs: tuple[Any, ...], outputs: tuple[Any, ...], aux: Any, /) -> None:
    """Record ``outputs = op(*inputs)`` on every active tape that tracks one of ``inputs``.

    A no-op when no tape does. On each tape that records it, the array ``outputs`` become
    tracked; ``vjp(cotangents, inputs, needs, outputs, aux)`` later maps the output gradients
    (``None`` for an output no gradient reached) to one gradient or ``None`` per input.
    """
    tapes = _ACTIVE.get()
    if not tapes:
        return
    tracked = [y for y in outputs if is_array(y)]
    for tape in tapes:
        needs = tape._needs(inputs)
        if needs is not None:
            extra = _placement(tape, inputs, outputs) if outputs else None
            tape._append((vjp, inputs, needs, outputs, aux, extra), tracked)


def record_unary(vjp: Vjp, x: Any, z: Any, aux: Any, /) -> None:
    """:func:`record` for ``z = op(x)``, the fast path."""
    for tape in _ACTIVE.get():
        if id(x) in tape._tracked:
            node = (
                vjp,
                (x,),
                (True,),
                (z,),
                aux,
                None if isinstance(z, np.ndarray) else _placement(tape, (x,), (z,)),
            )
            with tape._lock:
                tape._nodes.append(node)
                tape._tracked[id(z)] = z


# needs of a binary op, indexed by [a is tracked][b is tracked]: constants, nothing to allocate
_NEEDS = ((None, (False, True)), ((True, False), (True, True)))


def record_binary(vjp: Vjp, a: Any, b: Any, z: Any, aux: Any, /) -> None:
    """:func:`record` for ``z = op(a, b)``, the fast path."""
    for tape in _ACTIVE.get():
        tracked = tape._tracked
        needs = _NEEDS[id(a) in tracked][id(b) in tracked]
        if needs is not None:
            node = (
                vjp,
                (a, b),
                needs,
                (z,),
                aux,
                None if isinstance(z, np.ndarray) else _placement(tape, (a, b), (z,)),
            )
            with tape._lock:
                tape._nodes.append(node)
                tracked[id(z)] = z


# Differentiable helpers the tape itself needs, so that a gradient computed under an outer tape
# is recorded there in full (accumulation, dtype casts, copies).


def _sum_pair(total: Any, grad: Any) -> Any:
    """``total + grad`` of two gradients of one array (same shape), recorded."""
    if type(total) is np.ndarray:
        z = total + grad
        z = z if type(z) is np.ndarray else np.asarray(z)  # 0-d NumPy
    else:
        z = _compute(operator.add, total, grad)
    if _ACTIVE.get():
        record_binary(_sum_pair_vjp, total, grad, z, None)
    return z


def _sum_pair_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return gs[0], gs[0]


def _cast(x: Any, dtype: Any, /) -> Any:
    """``x`` as ``dtype`` (a new array), recorded; its gradient is cast back."""
    z = _compute(_astype, x, dtype)
    record_unary(_cast_vjp, x, z, None)
    return z


def _cast_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return (_cast(gs[0], xs[0].dtype),)


def _copy(x: Any, /) -> Any:
    """A copy of ``x``, recorded (the identity)."""
    z = _compute(_copy_of, x)
    record_unary(_copy_vjp, x, z, None)
    return z


def _copy_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return (gs[0],)


def _constant_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return (zeros_like(xs[0]),)


def stop_gradient(x: Tree, /) -> Tree:
    """``x``'s values as arrays no tape tracks: a constant for differentiation.

    Each array leaf of the pytree ``x`` becomes a new view of the same memory (so writing into
    it is writing into ``x``, as with torch's ``detach``); other leaves are returned as they
    are. Raw NumPy on the result is allowed inside a tape.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import ops
        >>> x = np.array([1.0, 2.0])
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(x)
        ...     y = ops.multiply(x, cupy_parallel.stop_gradient(x))  # the 2nd x is fixed
        >>> tape.gradient(y, x, output_gradients=np.ones(2))
        array([1., 2.])
    """
    return tree.tree_map(lambda leaf: on_device_of(leaf, leaf.view) if is_array(leaf) else leaf, x)


# --------------------------------------------------------------------------------------------
# The HostArray dispatch guard: raw NumPy on a recorded host array would drop its gradient path


def unguarded(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with no tape active, so the dispatch guard lets raw NumPy pass.

    For library code that computes with raw NumPy on recorded host arrays and records the
    result itself (the ops).
    """
    token = _ACTIVE.set(())
    try:
        return fn(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)


_NON_DIFFERENTIABLE = frozenset(
    {
        *("==", "!=", "<", "<=", ">", ">="),
        *("equal", "not_equal", "less", "less_equal", "greater", "greater_equal"),
        *("isnan", "isinf", "isfinite", "isclose", "allclose", "array_equal", "signbit"),
        *("argmax", "argmin", "argsort", "argpartition", "nonzero", "flatnonzero"),
        *("count_nonzero", "searchsorted", "all", "any"),
        *("logical_and", "logical_or", "logical_not", "logical_xor"),
        *("shape", "ndim", "size", "result_type"),
    }
)
"""Operations whose results carry no gradient: raw NumPy may compute them on recorded arrays."""

_OPS_NAMES = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide", "true_divide": "divide"}
_OPS_NAMES |= {"@": "matmul", "**": "power", "absolute": "abs", "amax": "max", "amin": "min"}
"""Operator and NumPy names whose ``cupy_parallel.ops`` function has another name."""

_IN_PLACE = frozenset({"fill", "set", "sort", "partition", "put", "[]=", "copyto"})


def _refuse_raw_numpy(operation: str, operands: tuple[Any, ...]) -> None:
    """The dispatch guard: raise if ``operation`` touches a host array an active tape tracks."""
    tapes = _ACTIVE.get()
    if not tapes:
        return
    for x in tree.leaves(operands):
        if type(x) is HostArray and any(id(x) in t._tracked for t in tapes):
            name = operation.rpartition(" " if operation.startswith("operator") else ".")[2]
            if name not in _NON_DIFFERENTIABLE:
                raise TypeError(_raw_numpy_message(operation, name, len(operands)))
            return


def _raw_numpy_message(operation: str, name: str, count: int) -> str:
    from cupy_parallel._src import ops  # ops builds on this module: imported when needed

    if name in _IN_PLACE or (operation.startswith("operator") and name.endswith("=")):
        return (
            f"{operation} writes in place into an array a tape is recording, which would "
            "change the values its gradient is computed from. Write into a copy, compute a new "
            "array with cupy_parallel.ops, or write outside the `with tape:` block before the "
            "array is used."
        )
    if _IN_BACKWARD.get():
        return (
            f"{operation} is raw NumPy on an array an outer tape is recording, inside a "
            "gradient computation: a vector-Jacobian product (of an op, or the backward of a "
            "Function with differentiable_backward = True) is not written with recorded "
            "operations, so this gradient cannot be differentiated again (higher order). Write "
            "it with cupy_parallel.ops, or leave differentiable_backward False."
        )
    op = "negative" if name == "-" and count == 1 else _OPS_NAMES.get(name, name)
    use = f"cupy_parallel.ops.{op}" if op in ops.__all__ else "a cupy_parallel.ops function"
    return (
        f"{operation} is raw NumPy on an array a tape is recording: the tape cannot see it, so "
        "the gradient would silently miss this path (on a GPU nothing could catch it). Use "
        f"{use} (or a cupy_parallel.Function), or cupy_parallel.stop_gradient(x) to use the "
        "values as a constant."
    )


_entered = 0  # tapes inside their `with` block, in all threads: the guard is installed while > 0
_entered_lock = threading.Lock()


def _count_entered(change: int) -> None:
    global _entered  # one process-wide guard, as hostarray has one hook
    with _entered_lock:
        _entered += change
        if _entered == change == 1:
            set_dispatch_guard(_refuse_raw_numpy)
        elif _entered == 0:
            set_dispatch_guard(None)


# --------------------------------------------------------------------------------------------
# Tape

_UNCONNECTED = {"zero": True, "none": False}  # unconnected_gradients -> fill with zeros


class Tape:
    """Records differentiable operations and computes gradients by reverse accumulation.

    Use it as a context manager: operations run inside the ``with`` block on tracked arrays are
    recorded, on every active tape that tracks one of their inputs (arrays no tape tracks pass
    through unrecorded). Gradients of one array used several times are summed; outputs of a
    multi-output operation whose gradient never arrives get zeros.

    Decisions where PyTorch and TensorFlow differ:

    - Nested tapes follow TensorFlow: every active tape records, and a :meth:`gradient`
      computed under an outer tape that tracks its inputs is recorded on that tape (the tape
      computing stops recording meanwhile), so nested tapes give higher-order derivatives.
    - A source the target does not depend on gets a zero gradient by default
      (``unconnected_gradients="zero"``, TensorFlow's ``UnconnectedGradients.ZERO``), so the
      result has the sources' exact pytree shape. A target that depends on *none* of the sources
      is then an error, as is a source the tape never saw.
    - A target with more than one element needs ``output_gradients`` (as PyTorch's
      ``backward``); TensorFlow's implicit sum would hide shape bugs.
    - A non-persistent tape computes gradients once, then releases its records.
    - Only floating-point arrays can be watched (integer arrays have no gradient); leaves of a
      params pytree that are not arrays (strings, numbers, ``None``) are skipped, as
      :func:`~cupy_parallel.replicate` skips them.
    - Gradients with respect to intermediate results are allowed (as TensorFlow).
    - Worker threads record when they run in a copy of the recording context
      (``contextvars.copy_context().run``, which ``parallel_apply`` does).
    - Gradients have their source's dtype: another floating dtype is cast (as PyTorch does), a
      complex gradient for a real source is refused.

    What is caught, so that no gradient is silently wrong:

    - **Host arrays** (``"host:k"``, where the library owns the array class), always: writing
      in place (``x[...] = v``, ``x += 1``, ``fill``, ``out=``) into an array a recorded
      operation consumed or produced makes :meth:`gradient` raise ``RuntimeError`` naming the
      operation (PyTorch's version-counter rule; for ``cupy_parallel.ops`` every input and
      output counts, since a vjp may read any of them; for a :class:`Function`, the arrays it
      saved). While a tape records, raw NumPy (a ufunc, a ``numpy`` function, an operator, a
      computing method) on an array it tracks raises ``TypeError`` naming the ``ops``
      equivalent or :func:`stop_gradient`, because the tape cannot see it; operations whose
      result carries no gradient (comparisons, ``argmax``, ...) pass, and so does everything
      inside ``Function.forward`` and a non-differentiable ``backward`` (recording is paused).
    - **NumPy and CuPy arrays**: the library cannot see operations on them. Raw NumPy/CuPy on
      a tracked array is not recorded (the target is then "not recorded on this tape" if the
      chain breaks completely, but a side path is silently dropped), and in-place writes are
      only caught with ``check_writes=True``, which fingerprints (CRC-32) every array each
      recorded operation touched and verifies them in :meth:`gradient`. Decision: the check is
      opt-in, because it reads every recorded array twice (a CuPy array through a copy to the
      host), far more than the recording itself costs.

    Args:
        persistent: allow :meth:`gradient` to be called more than once.
        check_writes: also catch in-place writes into NumPy and CuPy arrays the tape recorded
            (see below), at the cost of reading every recorded array twice (CuPy arrays are
            copied to the host to be read): a debugging aid, as PyTorch's anomaly mode.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import ops
        >>> w = np.array([1.0, 2.0])
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(w)
        ...     loss = ops.sum(ops.square(w))
        >>> tape.gradient(loss, w)
        array([2., 4.])
    """

    def __init__(self, *, persistent: bool = False, check_writes: bool = False) -> None:
        if not isinstance(persistent, bool):
            raise TypeError(f"persistent must be a bool, got {type(persistent).__name__}.")
        if not isinstance(check_writes, bool):
            raise TypeError(f"check_writes must be a bool, got {type(check_writes).__name__}.")
        self.persistent = persistent
        self._tracked: dict[int, Any] = {}  # id -> array: every tracked array, kept alive
        self._leaves: set[int] = set()  # ids of watched arrays no recorded operation produced
        self._nodes: list[Node] = _FingerprintedNodes() if check_writes else []
        self._versions: dict[int, tuple[Any, int | None]] = {}  # id -> (host array, 1st version)
        self._lock = threading.Lock()
        self._token: contextvars.Token[tuple[Tape, ...]] | None = None
        self._used = False

    def __repr__(self) -> str:
        return (
            f"Tape(persistent={self.persistent}, nodes={len(self._nodes)}, "
            f"tracked={len(self._tracked)}, recording={self in _ACTIVE.get()})"
        )

    def __enter__(self) -> Tape:
        if self._token is not None:
            raise RuntimeError("This tape is already recording; a tape cannot be entered twice.")
        self._check_unused("record")
        self._token = _ACTIVE.set((*_ACTIVE.get(), self))
        _count_entered(1)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
            _count_entered(-1)

    def _check_unused(self, action: str) -> None:
        if self._used:
            raise RuntimeError(
                f"Cannot {action}: this non-persistent tape already computed its gradients and "
                "released its records. Use cupy_parallel.Tape(persistent=True) to call "
                "gradient() more than once."
            )

    @contextlib.contextmanager
    def stop_recording(self) -> Iterator[None]:
        """A block in which this tape records nothing (other active tapes go on recording).

        Raises:
            RuntimeError: the tape is not recording here (call it inside ``with tape:``).

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import ops
            >>> x = np.array(3.0)
            >>> with cupy_parallel.Tape() as tape:
            ...     tape.watch(x)
            ...     with tape.stop_recording():
            ...         y = ops.square(x)
            >>> tape.tracks(y)
            False
        """
        tapes = _ACTIVE.get()
        if self not in tapes:
            raise RuntimeError(
                "stop_recording() pauses a recording tape, but this tape is not recording "
                "here: call it inside the `with tape:` block."
            )
        with _paused(self):
            yield

    # -- tracking ------------------------------------------------------------------------

    def watch(self, params: object, /) -> None:
        """Track every array leaf of the pytree ``params`` (namespace ``"cupy_parallel"``).

        Leaves that are not arrays are skipped (as :func:`~cupy_parallel.replicate` does);
        array leaves must be floating-point.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> tape = cupy_parallel.Tape()
            >>> tape.watch({"w": np.ones(2), "b": np.zeros(1), "activation": "tanh"})
        """
        self._check_unused("watch")
        names, leaves, _ = flatten_with_names(params, "params")
        arrays = [leaf for leaf in leaves if is_array(leaf)]
        for name, leaf in zip(names, leaves, strict=True):
            if is_array(leaf) and leaf.dtype.kind != "f":
                raise TypeError(
                    f"watch() tracks floating-point arrays, but {name} has dtype {leaf.dtype}. "
                    "Cast it first, e.g. array.astype(numpy.float32)."
                )
        with self._lock:
            for leaf in arrays:
                if id(leaf) not in self._tracked:
                    self._leaves.add(id(leaf))
                    self._tracked[id(leaf)] = leaf

    def tracks(self, x: Any, /) -> bool:
        """Whether ``x`` is watched or was produced by an operation recorded on this tape.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> w = np.ones(2)
            >>> tape = cupy_parallel.Tape()
            >>> tape.watch(w)
            >>> tape.tracks(w), tape.tracks(np.ones(2))
            (True, False)
        """
        return id(x) in self._tracked

    def _needs(self, inputs: Sequence[Any], /) -> tuple[bool, ...] | None:
        """Which ``inputs`` are tracked, or ``None`` when none is (nothing to record)."""
        tracked = self._tracked
        needs = tuple([id(x) in tracked for x in inputs])
        return needs if True in needs else None

    def _append(self, node: Node, tracked: Sequence[Any], /) -> None:
        """Append a node; the arrays ``tracked`` (some of its outputs) become tracked."""
        with self._lock:
            self._nodes.append(node)
            for y in tracked:
                self._tracked[id(y)] = y

    # -- differentiation -----------------------------------------------------------------

    def gradient(
        self,
        target: object,
        sources: Tree,
        output_gradients: object = None,
        *,
        unconnected_gradients: str = "zero",
    ) -> Tree:
        """Gradients of ``target`` with respect to ``sources``, in the sources' pytree shape.

        Args:
            target: a recorded array, or a pytree of them (their contributions add up).
            sources: a pytree of watched or recorded arrays; leaves that are not arrays get
                ``None``.
            output_gradients: the gradient flowing into ``target`` (same pytree, shapes and
                devices). Defaults to ones, which needs a target with exactly one element.
            unconnected_gradients: what a source the target does not depend on gets:
                ``"zero"`` (the default) zeros, ``"none"`` ``None`` (TensorFlow's options).

        Returns:
            One gradient per source leaf, on that source's device, with its shape and dtype
            (a gradient of another floating dtype is cast, as PyTorch does).

        Raises:
            ValueError: the target was not recorded on this tape or (with
                ``unconnected_gradients="zero"``) depends on no source, a source was never
                tracked, ``output_gradients`` does not match, or ``unconnected_gradients`` is
                neither ``"zero"`` nor ``"none"``.
            TypeError: a leaf of ``target`` or ``output_gradients`` is not an array, or a
                real source would get a complex gradient.
            RuntimeError: a non-persistent tape is asked a second time.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import ops
            >>> x, y = np.array(3.0), np.array(4.0)
            >>> with cupy_parallel.Tape() as tape:
            ...     tape.watch((x, y))
            ...     z = ops.multiply(x, y)
            >>> tape.gradient(z, {"x": x, "y": y})
            {'x': array(4.), 'y': array(3.)}
        """
        self._check_unused("compute gradients")
        if isinstance(self._nodes, _FingerprintedNodes):
            self._nodes.verify()
        if unconnected_gradients not in _UNCONNECTED:
            raise ValueError(
                f'unconnected_gradients must be "zero" or "none", got {unconnected_gradients!r}.'
            )
        targets, seeds = self._check_targets(target, output_gradients)
        names, leaves, source_def = flatten_with_names(sources, "sources")
        arrays = [leaf for leaf in leaves if is_array(leaf)]
        for name, leaf in zip(names, leaves, strict=True):
            if is_array(leaf) and id(leaf) not in self._tracked:
                raise ValueError(
                    f"{name} was never watched or recorded on this tape, so it has no "
                    "gradient. Call tape.watch(source) inside the `with tape:` block before "
                    "computing the target from it."
                )
        grads = pullback(self, targets, seeds, arrays)
        fill = _UNCONNECTED[unconnected_gradients]
        if fill and arrays and all(g is None for g in grads):
            raise ValueError(
                "The target does not depend on any of the sources on this tape: no recorded "
                "operation leads from a source to the target. Check that the sources passed to "
                "gradient() are the arrays the target was computed from."
            )
        array_names = [name for name, leaf in zip(names, leaves, strict=True) if is_array(leaf)]
        result = iter(self._finish(array_names, arrays, grads, seeds, fill))
        if not self.persistent:
            self._used = True
            self._nodes, self._tracked, self._leaves, self._versions = [], {}, set(), {}
        return source_def.unflatten(  # type: ignore[return-value]  # the structure of sources
            [next(result) if is_array(leaf) else None for leaf in leaves]
        )

    def _finish(
        self, names: list[str], sources: list[Any], grads: list[Any], seeds: list[Any], fill: bool
    ) -> list[Any]:
        """The gradients as returned, each recorded on the outer tapes that track its source.

        Zeros (or ``None``) where none arrived, the sources' dtypes, never an array the caller
        passed in or one array twice.
        """
        seen = {id(s) for s in seeds}
        result = []
        with _paused(self):
            for name, leaf, grad in zip(names, sources, grads, strict=True):
                g = _returned(name, leaf, grad, fill)
                if g is not None and id(g) in seen:
                    g = _copy(g)
                seen.add(id(g))
                result.append(g)
        for tape in _ACTIVE.get():  # on an outer tape, a gradient is a function of its source
            if tape is not self:
                for leaf, g in zip(sources, result, strict=True):
                    if g is not None and tape.tracks(leaf) and not tape.tracks(g):
                        tape._append((_constant_vjp, (leaf,), (True,), (g,), None, None), [g])
        return result

    def _check_targets(self, target: Any, output_gradients: Any) -> tuple[list[Any], list[Any]]:
        names, targets, target_def = flatten_with_names(target, "target")
        if not targets:
            raise ValueError("gradient() needs a target array, got an empty structure.")
        for name, t in zip(names, targets, strict=True):
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
            for name, t in zip(names, targets, strict=True):
                if t.size != 1:
                    raise ValueError(
                        f"{name} has shape {t.shape}: an implicit output gradient exists only "
                        "for a target with one element. Pass output_gradients with the target's "
                        "shape, or reduce the target first (e.g. ops.sum)."
                    )
            return targets, [ones_like(t) for t in targets]
        seed_names, seeds, seed_def = flatten_with_names(output_gradients, "output_gradients")
        if seed_def != target_def:
            raise ValueError(
                f"output_gradients must have the target's structure {target_def}, got {seed_def}."
            )
        for name, t, s in zip(seed_names, targets, seeds, strict=True):
            if not is_array(s):
                raise TypeError(f"{name} must be an array, got {type(s).__name__}.")
            if s.shape != t.shape or device_of(s) != device_of(t):
                raise ValueError(
                    f"{name} must match its target: shape {t.shape} on {device_of(t)}, got shape "
                    f"{s.shape} on {device_of(s)}. Move it with cupy_parallel.to_device."
                )
        return targets, seeds


class _FingerprintedNodes(list[Node]):
    """The node list of a ``Tape(check_writes=True)``: fingerprints what each node touched.

    Every NumPy and CuPy array among a node's inputs and outputs gets a CRC-32 of its bytes when
    the node is appended (host arrays have version counters instead); :meth:`verify` recomputes
    them. Recording appends through ``list.append``, so ordinary tapes pay nothing for this.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fingerprints: list[tuple[tuple[int, Any, int], ...]] = []

    def append(self, node: Node, /) -> None:
        arrays = (*node[1], *node[3])
        self.fingerprints.append(
            tuple((i, a, _fingerprint(a)) for i, a in enumerate(arrays) if _has_bytes(a))
        )
        super().append(node)

    def verify(self) -> None:
        """Raise ``RuntimeError`` naming the first node whose array's bytes changed."""
        for node, prints in zip(self, self.fingerprints, strict=True):
            for i, a, crc in prints:
                if _fingerprint(a) != crc:
                    count = len(node[1])
                    where = f"input {i}" if i < count else f"output {i - count}"
                    op = _op_name(node[0], node[4])
                    raise RuntimeError(
                        f"Tape(check_writes=True): an array {op} recorded was modified in place: "
                        f"its {where} (shape {a.shape}, on {device_of(a)}) no longer holds the "
                        f"values {op} saw, so the gradient would be computed from other data. "
                        "Write into a copy, or compute a new array with cupy_parallel.ops."
                    )


def _has_bytes(x: Any) -> bool:
    """Whether ``x`` is an array ``check_writes`` fingerprints (NumPy or CuPy)."""
    return isinstance(x, np.ndarray) or (is_array(x) and type(x) is not HostArray)


def _fingerprint(x: Any) -> int:
    data = x if isinstance(x, np.ndarray) else x.get()
    return zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)


def pullback(
    tape: Tape, targets: Sequence[Any], seeds: Sequence[Any], sources: Sequence[Any], /
) -> list[Any]:
    """Reverse accumulation on ``tape``: each source's gradient, ``None`` where none arrives.

    Unchecked: ``targets`` and ``sources`` must be arrays ``tape`` tracks and ``seeds`` the
    targets' cotangents (:meth:`Tape.gradient` is the checked entry). ``tape`` records nothing
    meanwhile; the other active tapes record the vjps' recorded operations (higher order).
    """
    grads: dict[int, Any] = {}  # id(array) -> gradient accumulated so far
    for t, s in zip(targets, seeds, strict=True):
        k = id(t)
        grads[k] = s if k not in grads else _sum_pair(grads[k], s)
    keep = {id(x) for x in sources} - tape._leaves  # sources that are intermediate results
    kept: dict[int, Any] = {}
    written = _written(tape)  # ids of host arrays written in place since they were recorded
    pop = grads.pop
    with _paused(tape, backward=True):
        for node in reversed(tape._nodes):
            vjp, inputs, needs, outputs, aux, cuda = node
            if len(outputs) == 1:  # most nodes: no list comprehension (a frame each, in 3.11)
                if (g := pop(id(outputs[0]), None)) is None:
                    continue  # no gradient reaches this node
                out_grads = [g]  # complete: consumers came later
            else:
                size = len(grads)
                out_grads = [pop(id(y), None) for y in outputs]
                if len(grads) == size:
                    continue
            if keep:
                _keep(kept, keep, outputs, out_grads)
            if written:
                _refuse_written(tape, node, written)
            if cuda is None:
                in_grads = vjp(out_grads, inputs, needs, outputs, aux)
            else:
                with cuda:
                    in_grads = vjp(out_grads, inputs, needs, outputs, aux)
            if len(in_grads) != len(inputs):
                raise _count_error(node, len(in_grads))
            i = 0  # a counter: zip (~300 ns) or enumerate (~50 ns) cost more a node
            for g in in_grads:
                if g is not None and needs[i]:
                    k = id(inputs[i])
                    grads[k] = g if (total := grads.get(k)) is None else _sum_pair(total, g)
                i += 1  # noqa: SIM113 - see above
    kept.update(grads)
    return [kept.get(id(x)) for x in sources]


def _count_error(node: Node, count: int) -> ValueError:
    """A vjp returned ``count`` gradients for a node with another number of inputs."""
    return ValueError(
        f"The vjp of {_op_name(node[0], node[4])} returned {count} gradients for "
        f"{len(node[1])} inputs: a vjp returns one gradient (or None) per input."
    )


def _written(tape: Tape) -> set[int]:
    """Ids of the host arrays on ``tape`` whose version moved since the tape first saw them."""
    return {k for k, (a, recorded) in tape._versions.items() if version(a) != recorded}


def _refuse_written(tape: Tape, node: Node, written: set[int]) -> None:
    """Raise if the node about to run consumed or produced an array written in place since."""
    inputs = node[1]
    for i, a in enumerate((*inputs, *node[3])):
        if id(a) in written:
            where = f"input {i}" if i < len(inputs) else f"output {i - len(inputs)}"
            raise _modified_error(_op_name(node[0], node[4]), where, a, tape._versions[id(a)][1])


def _op_name(vjp: Vjp, aux: Any) -> str:
    """How errors name a node's operation: the Function's class or the op behind a vjp."""
    if vjp is _function_vjp:
        return str(aux[0].__name__)
    name = getattr(vjp, "__name__", repr(vjp))
    return f"ops.{name.strip('_').removesuffix('_vjp')}" if name.endswith("_vjp") else name


def _modified_error(op: str, where: str, array: Any, recorded: int | None) -> RuntimeError:
    return RuntimeError(
        f"An array the gradient of {op} needs was modified in place after {op} was recorded: "
        f"its {where} (shape {array.shape}, on {device_of(array)}) is at version "
        f"{version(array)}, expected {recorded}. Writes such as x[...] = v, x += 1, x.fill(v) "
        "or out=x change the values the gradient is computed from (PyTorch raises here too). "
        "Write into a copy, or compute a new array with cupy_parallel.ops."
    )


def _returned(name: str, source: Any, grad: Any, fill: bool) -> Any:
    """``grad`` as :meth:`Tape.gradient` returns it for ``source`` (named ``name``)."""
    if grad is None:
        return zeros_like(source) if fill else None
    if grad.dtype != source.dtype:
        if grad.dtype.kind == "c" and source.dtype.kind != "c":
            raise TypeError(
                f"The gradient of {name} is complex ({grad.dtype}) but the source is real "
                f"({source.dtype}): take the real part of the target explicitly."
            )
        grad = _cast(grad, source.dtype)  # as PyTorch does
    if grad.shape != source.shape:
        raise ValueError(
            f"The gradient of {name} has shape {grad.shape}, its source {source.shape}: a "
            "recorded operation returned a wrongly shaped gradient."
        )
    return grad


@contextlib.contextmanager
def _paused(tape: Tape, *, backward: bool = False) -> Iterator[None]:
    """``tape`` records nothing inside the block; the other active tapes go on."""
    token = _ACTIVE.set(tuple(t for t in _ACTIVE.get() if t is not tape))
    in_backward = _IN_BACKWARD.set(backward)
    try:
        yield
    finally:
        _IN_BACKWARD.reset(in_backward)
        _ACTIVE.reset(token)


def _keep(kept: dict[int, Any], keep: set[int], outputs: tuple[Any, ...], grads: list[Any]) -> None:
    """Set aside the complete gradients of intermediate results asked for as sources."""
    kept.update((id(y), g) for y, g in zip(outputs, grads, strict=True) if id(y) in keep)


# --------------------------------------------------------------------------------------------
# Function


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
                raise _modified_error(function, f"saved array {i}", a, recorded)

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
        tapes = [(t, n) for t in _ACTIVE.get() if (n := t._needs(args)) is not None]
        needs = tuple(any(n[i] for _, n in tapes) for i in range(len(args)))
        ctx = FunctionContext(needs if tapes else (False,) * len(args))
        token = _ACTIVE.set(())  # forward itself is never recorded
        try:
            result = cls.forward(ctx, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
        multiple = isinstance(result, tuple)
        outputs = tuple(
            np.asarray(y) if isinstance(y, np.generic) else y  # 0-d NumPy results as arrays
            for y in (result if multiple else (result,))
        )
        if tapes:
            outputs, tracked = _fresh_outputs(outputs, args, ctx._non_differentiable)
            cuda = cuda_device(outputs[0]) if outputs else None
            for tape, tape_needs in tapes:
                tape._append((_function_vjp, args, tape_needs, outputs, (cls, ctx), cuda), tracked)
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
    tapes = _ACTIVE.get()
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
        if any(t.tracks(value) for t in _ACTIVE.get()):
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
    outer = _ACTIVE.get()
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
                g = _cast(g, x.dtype)  # as PyTorch does
        checked.append(g)
    return tuple(checked)


def _mark_once_differentiable(
    cls: type[Function], consumed: tuple[Any, ...], grads: tuple[Any, ...]
) -> tuple[Any, ...]:
    """Track a non-differentiable backward's results on the outer tapes, raising if reached.

    Only tapes that track what the backward consumed record the node; its vjp raises if a
    gradient reaches it (PyTorch's ``once_differentiable``).
    """
    tapes = [(t, n) for t in _ACTIVE.get() if (n := t._needs(consumed)) is not None]
    if not tapes:
        return grads
    arrays = [g for g in grads if is_array(g)]
    fresh, tracked = _fresh_outputs(tuple(arrays), consumed, set())
    for tape, needs in tapes:
        tape._append((_once_differentiable_vjp, consumed, needs, fresh, cls, None), tracked)
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
