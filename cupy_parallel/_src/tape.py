"""The :class:`Tape`: watch arrays, record while entered, compute gradients in reverse.

A :class:`Tape` records, while it is active, every differentiable operation (an op of
:mod:`cupy_parallel.ops` or a :class:`~cupy_parallel.Function`) whose inputs it *tracks*: arrays
passed to :meth:`Tape.watch` and the outputs of recorded operations. Arrays stay ordinary array
objects; the tape knows them by identity and keeps a reference to each, so their ids stay valid
while it lives.

How operations are recorded and gradients accumulated (nodes, the active tapes, the reverse pass)
is :mod:`cupy_parallel._src.recording`; this module is the user's entry to it: entering a tape
(which installs the raw-NumPy guard of :mod:`cupy_parallel._src.guard`), :meth:`Tape.watch`,
:meth:`Tape.gradient` with its checks, and :func:`stop_gradient`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import tree
from cupy_parallel._src.arguments import read_bool, read_callable
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.compute import compute, on_device_of, ones_like, zeros_like
from cupy_parallel._src.fingerprints import FingerprintedNodes
from cupy_parallel._src.guard import count_entered
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer
from cupy_parallel._src.recording import (
    Records,
    activate,
    active_tapes,
    add_ready_hook,
    append_node,
    cast,
    deactivate,
    pause_recording,
    pullback,
    record_unary,
    release,
    track_leaves,
)
from cupy_parallel._src.tree import flatten_leaves, leaf_names

if TYPE_CHECKING:
    import contextvars
    from collections.abc import Callable, Iterator

    from optree import PyTreeSpec

    from cupy_parallel._src.arraytypes import Tree

__all__ = [
    "DisconnectedError",
    "HookHandle",
    "Tape",
    "refuse_untrackable",
    "scalar_problem",
    "stop_gradient",
]


def refuse_untrackable(names: list[str], leaves: list[Any], who: str) -> None:
    """``TypeError`` for the first array leaf a tape cannot track (neither floating nor complex).

    ``names`` name the leaves in the caller's words; ``who`` says who refuses (``"watch()
    tracks"``).
    """
    for name, leaf in zip(names, leaves, strict=True):
        if is_array(leaf) and leaf.dtype.kind not in "fc":
            raise TypeError(
                f"{who} floating-point and complex arrays, but {name} has dtype "
                f"{leaf.dtype}. Cast it first, e.g. array.astype(numpy.float32)."
            )


def scalar_problem(t: Any, name: str) -> TypeError | ValueError | None:
    """Why the array ``t`` (named ``name``) has no implicit output gradient, or ``None``.

    The implicit gradient is ``1`` for a real array of one element (as in PyTorch); the error
    says which of the two ``t`` misses, for the caller to add what to do.
    """
    if t.dtype.kind == "c":
        return TypeError(
            f"{name} is complex ({t.dtype}): an implicit output gradient exists only for a real "
            "target (as in PyTorch)."
        )
    if t.size != 1:
        return ValueError(
            f"{name} has shape {t.shape}: an implicit output gradient exists only for a target "
            "with one element."
        )
    return None


_UNCONNECTED = {"zero": True, "none": False}  # unconnected_gradients -> fill with zeros

_PLAIN_ARRAYS = frozenset({np.ndarray, HostArray})
"""The array types whose instances :meth:`Tape.watch` and :meth:`Tape.gradient` take as they come
(a single one or a flat tuple of them: a step's usual arguments) without flattening a pytree."""


class DisconnectedError(ValueError):
    """:meth:`Tape.gradient`'s ``ValueError`` when the target depends on none of the sources.

    A ``ValueError`` (what callers catch); its own class lets ``grad`` add what it knows.
    """


class Tape(Records):
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
    - Only floating-point and complex arrays can be watched (integer arrays have no
      gradient); leaves of a params pytree that are not arrays (strings, numbers, ``None``)
      are skipped, as :func:`~cupy_parallel.replicate` skips them.
    - Gradients with respect to intermediate results are allowed (as TensorFlow).
    - Worker threads record when they run in a copy of the recording context
      (``contextvars.copy_context().run``, which ``parallel_apply`` does).
    - Gradients have their source's dtype: another floating dtype is cast (as PyTorch does).
    - Complex numbers follow PyTorch: for a real target ``L``, a complex source ``z`` gets
      ``dL/dRe(z) + i dL/dIm(z)`` (the conjugate Wirtinger derivative times 2), and a real
      source of complex arithmetic (``ops.multiply(x, c)`` with a complex ``c``) gets the real
      gradient ``dL/dx``: each op's vjp takes the real part for its real inputs, as PyTorch's
      derivative formulas do. A complex gradient that still reaches a real source (from a
      hand-written vjp or ``Function.backward``) is refused, as PyTorch's engine refuses it;
      so is a complex ``output_gradients`` for a real target, and the implicit one of a
      complex target (take ``ops.real`` or ``ops.abs`` first). The ops whose gradient holds
      for real numbers only (``maximum``, ``relu``, ``softmax``, ...) refuse complex values
      when recorded.

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
    - **The library's own in-place writes** (a collective such as ``dist.all_reduce(x)``, a
      ``recv`` into ``x``), always, for every kind of array: every tape that holds ``x`` hears
      of it, recording or not (after its ``with`` block, under :meth:`stop_recording`, an inner
      tape under an outer one, in another thread), and its :meth:`gradient` then refuses the
      nodes that need ``x``. torch does not: a c10d collective leaves the version counter alone.

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
        if persistent is not False:  # the defaults need no reading (a tape per step)
            persistent = read_bool(persistent, "persistent")
        if check_writes is not False:
            check_writes = read_bool(check_writes, "check_writes")
        super().__init__(FingerprintedNodes() if check_writes else [])
        self.persistent = persistent
        self._token: contextvars.Token[tuple[Records, ...]] | None = None
        self._used = False

    def __repr__(self) -> str:
        return (
            f"Tape(persistent={self.persistent}, nodes={len(self._nodes)}, "
            f"tracked={len(self._tracked)}, recording={self in active_tapes()})"
        )

    def __enter__(self) -> Tape:
        if self._token is not None:
            raise RuntimeError("This tape is already recording; a tape cannot be entered twice.")
        if self._used:
            self._check_unused("record")
        self._token = activate(self)
        count_entered(1)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            deactivate(self._token)
            self._token = None
            count_entered(-1)

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
        tapes = active_tapes()
        if self not in tapes:
            raise RuntimeError(
                "stop_recording() pauses a recording tape, but this tape is not recording "
                "here: call it inside the `with tape:` block."
            )
        with pause_recording(self):
            yield

    # -- tracking ------------------------------------------------------------------------

    def watch(self, params: object, /) -> None:
        """Track every array leaf of the pytree ``params`` (namespace ``"cupy_parallel"``).

        Leaves that are not arrays are skipped (as :func:`~cupy_parallel.replicate` does);
        array leaves must be floating-point or complex.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> tape = cupy_parallel.Tape()
            >>> tape.watch({"w": np.ones(2), "b": np.zeros(1), "activation": "tanh"})
        """
        if self._used:
            self._check_unused("watch")
        given: Any = params
        kind = type(given)
        if kind is np.ndarray or kind is HostArray:  # one array, or a flat tuple of them: what
            arrays: Any = (params,)  # a step watches, without flatten's structure (0.3 us)
        elif kind is tuple and _PLAIN_ARRAYS.issuperset(map(type, given)):
            arrays = given
        else:
            leaves, spec = flatten_leaves(params)
            arrays = [leaf for leaf in leaves if is_array(leaf)]
            if not all(a.dtype.kind in "fc" for a in arrays):
                refuse_untrackable(leaf_names(spec, "params"), leaves, "watch() tracks")
            track_leaves(self, arrays)
            return
        for a in arrays:
            if a.dtype.kind not in "fc":
                leaves, spec = flatten_leaves(params)
                refuse_untrackable(leaf_names(spec, "params"), leaves, "watch() tracks")
        track_leaves(self, arrays)

    def register_gradient_ready_hook(
        self, source: Any, hook: Callable[[Any], Any], /
    ) -> HookHandle:
        """Call ``hook(gradient)`` in each :meth:`gradient` as soon as ``source``'s is final.

        The model is torch's ``Tensor.register_post_accumulate_grad_hook``: the hook runs in
        the middle of the backward pass, once every contribution to the gradient of the
        watched array ``source`` has been summed (the pass has run the earliest recorded
        operation that consumed it), before the pass goes on. That is what lets
        :class:`~cupy_parallel.DistributedDataParallel` start reducing a bucket of gradients
        while the rest of the backward pass still runs.

        Where torch and this differ, decided for data parallelism:

        - A source no gradient reaches in a pass (an unused parameter) has its hook called too,
          with ``None`` (torch calls nothing): every rank's hooks then run the same number of
          times, whatever each rank's step used. When no recorded operation consumed the
          source at all, it is called at the start of the pass (its gradient is final from the
          start, as torch's ``find_unused_parameters`` marks such parameters ready at once),
          else once the earliest operation that consumed it has run.
        - The hook may return an array: it replaces the gradient (what :meth:`gradient`
          returns for ``source``, as if torch's hook wrote ``.grad``). It must have the
          source's shape; it need not hold its final values yet, only by the time
          :meth:`gradient` returns (a later hook may finish it, as a bucket's reduction does).
          Returning ``None`` keeps the gradient. The hook must not write into the gradient it
          is given: that array may be shared with another source's gradient.
        - Hooks are called in the order the gradients become final, a source's hooks in the
          order they were registered, with this tape's recording paused (other active tapes
          record what they compute). A hook that raises ends :meth:`gradient` with its error.

        Args:
            source: an array watched on this tape (:meth:`watch`), not a recorded result.
            hook: called as ``hook(gradient)``.

        Returns:
            A handle whose ``remove()`` unregisters the hook.

        Raises:
            ValueError: ``source`` is not a watched array of this tape.
            TypeError: ``hook`` is not callable.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import ops
            >>> w, b = np.array([1.0, 2.0]), np.array(3.0)
            >>> events = []
            >>> with cupy_parallel.Tape() as tape:
            ...     tape.watch((w, b))
            ...     loss = ops.add(ops.sum(ops.square(w)), b)
            >>> for name, x in {"w": w, "b": b}.items():
            ...     _ = tape.register_gradient_ready_hook(x, lambda g, n=name: events.append(n))
            >>> _ = tape.gradient(loss, (w, b))
            >>> events  # b's gradient is final first: the add was recorded last
            ['b', 'w']
        """
        self._check_unused("register a hook")
        hook = read_callable(hook, "hook", call="hook(gradient)")
        if not is_array(source) or id(source) not in self._leaves:
            what = "a recorded result" if self.tracks(source) else "not watched on this tape"
            raise ValueError(
                "register_gradient_ready_hook needs an array watched on this tape "
                f"(tape.watch(source)), got {type(source).__name__} that is {what}."
            )
        return HookHandle(add_ready_hook(self, source, hook))

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
            TypeError: a leaf of ``target`` or ``output_gradients`` is not an array, a real
                target has a complex output gradient, a complex target has none, or a real
                source would get a complex gradient.
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
        if self._used:
            self._check_unused("compute gradients")
        if type(self._nodes) is not list:  # check_writes: its FingerprintedNodes
            self._nodes.verify()  # type: ignore[attr-defined]
        if not isinstance(unconnected_gradients, str) or unconnected_gradients not in _UNCONNECTED:
            raise ValueError(
                f'unconnected_gradients must be "zero" or "none", got {unconnected_gradients!r}.'
            )
        tracked = self._tracked
        # the common calls first: one recorded target, one array or a flat tuple of tracked
        # sources (tracked, so arrays: they are the leaves), flattened by nothing
        if id(target) in tracked and _seed_matches(target, output_gradients):
            targets = [target]
            seeds = [ones_like(target) if output_gradients is None else output_gradients]
        else:
            targets, seeds = self._check_targets(target, output_gradients)
        given: Any = sources
        kind = type(given)
        source_def: PyTreeSpec | None = None  # None: sources is one array, or a tuple of them
        if id(given) in tracked:
            leaves: list[Any] = [given]
        elif kind is tuple and all(map(tracked.__contains__, map(id, given))):
            leaves = list(given)
        else:
            leaves, source_def = flatten_leaves(sources)
        if source_def is None or all(map(tracked.__contains__, map(id, leaves))):
            arrays = leaves
        else:
            arrays = [leaf for leaf in leaves if is_array(leaf)]
            for name, leaf in zip(leaf_names(source_def, "sources"), leaves, strict=True):
                if is_array(leaf) and not self.tracks(leaf):
                    raise ValueError(
                        f"{name} was never watched or recorded on this tape, so it has no "
                        "gradient. Call tape.watch(source) inside the `with tape:` block before "
                        "computing the target from it."
                    )
        fill = _UNCONNECTED[unconnected_gradients]
        grads = pullback(self, targets, seeds, arrays, unconnected_none=not fill)
        if fill and arrays:
            for g in grads:
                if g is not None:
                    break
            else:
                raise DisconnectedError(
                    "The target does not depend on any of the sources on this tape: no recorded "
                    "operation leads from a source to the target. Check that the sources passed "
                    "to gradient() are the arrays the target was computed from."
                )
        result = self._finish(arrays, grads, seeds, fill, sources)
        if not self.persistent:
            self._used = True
            release(self)
        if source_def is None:
            return result[0] if kind is not tuple else tuple(result)  # type: ignore[return-value]
        if len(arrays) < len(leaves):  # the leaves that are not arrays get None
            returned = iter(result)
            result = [next(returned) if is_array(leaf) else None for leaf in leaves]
        return source_def.unflatten(result)  # type: ignore[return-value]  # sources' structure

    def _finish(
        self,
        sources: list[Any],
        grads: list[Any],
        seeds: list[Any],
        fill: bool,
        given: Tree,
    ) -> list[Any]:
        """The gradients as returned, each recorded on the outer tapes that track its source.

        Zeros (or ``None``) where none arrived, the sources' dtypes, never an array the caller
        passed in or one array twice. ``given`` is what the caller passed as ``sources`` (they
        are its array leaves), to name them in the errors.
        """
        active = active_tapes()
        if not active:  # nothing records: no block to pause (the common case)
            return _returned_all(sources, grads, seeds, fill, given)
        with pause_recording(self):
            result = _returned_all(sources, grads, seeds, fill, given)
        for tape in active:  # on an outer tape, a gradient is a function of its source
            if tape is not self:
                for leaf, g in zip(sources, result, strict=True):
                    if g is not None and tape.tracks(leaf) and not tape.tracks(g):
                        node = (_constant_vjp, (leaf,), (True,), (g,), None, None)
                        append_node(tape, node, [g])
        return result

    def _check_targets(self, target: Any, output_gradients: Any) -> tuple[list[Any], list[Any]]:
        targets, target_def = flatten_leaves(target)
        if not targets:
            raise ValueError("gradient() needs a target array, got an empty structure.")
        tracked = self._tracked
        if all(id(t) in tracked for t in targets):  # tracked, so arrays: the errors are named
            names: list[str] = []  # only when one is raised
        else:
            names = leaf_names(target_def, "target")
        for name, t in zip(names, targets, strict=False):
            if not is_array(t):
                raise TypeError(
                    f"gradient() needs {name} to be an array, got {type(t).__name__}. Compute "
                    "it with cupy_parallel.ops inside the `with tape:` block."
                )
            if not self.tracks(t):
                raise ValueError(
                    f"{name} was not recorded on this tape: it was produced by an operation the "
                    "tape never saw. Likely causes: a raw NumPy/CuPy expression such as `x @ w` "
                    "instead of cupy_parallel.ops.matmul(x, w), a computation outside the "
                    "`with tape:` block, or inputs that were never watched."
                )
        if output_gradients is None:
            for i, t in enumerate(targets):
                if t.size == 1 and t.dtype.kind != "c":
                    continue
                problem = scalar_problem(t, leaf_names(target_def, "target")[i])
                if problem is not None:
                    remedy = (
                        "Take ops.real(target) or ops.abs(target) first, or pass output_gradients."
                        if isinstance(problem, TypeError)
                        else "Pass output_gradients with the target's shape, or reduce the target "
                        "first (e.g. ops.sum)."
                    )
                    raise type(problem)(f"{problem} {remedy}")
            return targets, [ones_like(t) for t in targets]
        seeds, seed_def = flatten_leaves(output_gradients)
        if seed_def != target_def:
            raise ValueError(
                f"output_gradients must have the target's structure {target_def}, got {seed_def}."
            )
        if not all(map(_seed_fits, targets, seeds)):  # then one of these raises
            seed_names = leaf_names(seed_def, "output_gradients")
            for name, t, s in zip(seed_names, targets, seeds, strict=True):
                if not is_array(s):
                    raise TypeError(f"{name} must be an array, got {type(s).__name__}.")
                if s.dtype.kind == "c" and t.dtype.kind != "c":
                    raise TypeError(
                        f"{name} is complex ({s.dtype}) but its target is real ({t.dtype}): a real "
                        "target's output gradient is real (as in PyTorch)."
                    )
                if s.shape != t.shape or device_of(s) != device_of(t):
                    raise ValueError(
                        f"{name} must match its target: shape {t.shape} on {device_of(t)}, got "
                        f"shape {s.shape} on {device_of(s)}. Move it with cupy_parallel.to_device."
                    )
        return targets, seeds


def _seed_matches(target: Any, seed: Any) -> bool:
    """Whether ``seed`` (``None`` included) is a valid output gradient of the array ``target``.

    The fast path of :meth:`Tape._check_targets` for one target (``False`` means: check there).
    """
    if seed is None:
        return target.size == 1 and target.dtype.kind != "c"
    kind = type(seed)
    if kind is type(target) and (
        kind is np.ndarray or (kind is HostArray and seed.device is target.device)
    ):  # one device: _seed_fits' other checks, without its calls
        return seed.shape == target.shape and (seed.dtype.kind != "c" or target.dtype.kind == "c")
    return (kind is np.ndarray or kind is HostArray) and _seed_fits(target, seed)


def _returned_all(
    sources: list[Any], grads: list[Any], seeds: list[Any], fill: bool, given: Tree
) -> list[Any]:
    """The gradients of :meth:`Tape._finish`, before the outer tapes hear of them."""
    seen = set(map(id, seeds))
    result = []
    i = 0
    for leaf, grad in zip(sources, grads, strict=True):
        g = grad
        if g is None or g.dtype != leaf.dtype or g.shape != leaf.shape:
            g = _returned(given, i, leaf, g, fill)
        if g is not None and id(g) in seen:
            g = _copy(g)
        seen.add(id(g))
        result.append(g)
        i += 1  # noqa: SIM113 - cheaper than enumerate (recording.pullback)
    return result


def _seed_fits(target: Any, seed: Any) -> bool:
    """Whether ``seed`` is a valid output gradient of ``target`` (the fast path of the checks).

    Devices are interned, so the same device is mostly the same object: ``is`` first, since
    ``Device``'s ``==`` is a Python call (0.15 us).
    """
    if not is_array(seed) or seed.shape != target.shape:
        return False
    if seed.dtype.kind == "c" and target.dtype.kind != "c":
        return False
    device, target_device = device_of(seed), device_of(target)
    return device is target_device or device == target_device


def _array_names(sources: Tree) -> list[str]:
    """The names of the array leaves of ``sources`` (gradient's argument), for messages."""
    leaves, spec = flatten_leaves(sources)
    names = leaf_names(spec, "sources")
    return [name for name, leaf in zip(names, leaves, strict=True) if is_array(leaf)]


class HookHandle:
    """What :meth:`Tape.register_gradient_ready_hook` returns: ``remove()`` unregisters the hook.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> w = np.ones(2)
        >>> tape = cupy_parallel.Tape()
        >>> tape.watch(w)
        >>> handle = tape.register_gradient_ready_hook(w, print)
        >>> handle.remove()
        >>> handle.remove()  # a second remove() does nothing, as torch's RemovableHandle
    """

    __slots__ = ("_remove",)

    def __init__(self, remove: Callable[[], None], /) -> None:
        self._remove = remove

    def remove(self) -> None:
        """Unregister the hook (nothing happens if it was removed already)."""
        self._remove()


def _returned(given: Tree, i: int, source: Any, grad: Any, fill: bool) -> Any:
    """``grad`` as :meth:`Tape.gradient` returns it for ``source``, leaf ``i`` of ``given``."""
    if grad is None:
        return zeros_like(source) if fill else None
    if grad.dtype != source.dtype:
        if grad.dtype.kind == "c" and source.dtype.kind != "c":
            raise TypeError(
                f"The gradient of {_array_names(given)[i]} is complex ({grad.dtype}) but the "
                f"source is real ({source.dtype}): take the real part of the target explicitly."
            )
        grad = cast(grad, source.dtype)  # as PyTorch does
    if grad.shape != source.shape:
        raise ValueError(
            f"The gradient of {_array_names(given)[i]} has shape {grad.shape}, its source "
            f"{source.shape}: a recorded operation returned a wrongly shaped gradient."
        )
    return grad


def _copy_of(x: Any) -> Any:
    return x.copy()


def _copy(x: Any, /) -> Any:
    """A copy of ``x``, recorded (the identity)."""
    if type(x) is np.ndarray:
        z = x.copy()
    elif type(x) is HostArray:
        z = host_array(host_buffer(x).copy(), x.device)
    else:
        z = compute(_copy_of, x)
    if active_tapes():
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
