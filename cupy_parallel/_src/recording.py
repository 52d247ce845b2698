"""The autodiff core: the active tapes, recording an operation, and the reverse pass.

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
counter). It reads those versions only when a write is about to be counted (an array no write
has hit since it was recorded still has its version), so most recorded ops read none.

Operations record themselves with :func:`record` (or its fast paths :func:`record_unary` and
:func:`record_binary`). Nodes are tuples and vjps module-level functions (no closures) because
recording is the hot path of a training step: fewer allocations, and far fewer objects for
Python's cyclic collector.

Nodes are appended in the order they run; an operation can only consume arrays that already
exist, so that order is a topological order of the graph, and :func:`pullback` is one reversed
loop over it (micrograd's ``Value.backward``). Two things break the rule "a node no gradient
reaches is skipped": the vjp of a *collective* (:func:`mark_collective`) is itself a
collective, so it runs on every pass, with zero cotangents where no gradient arrived (its peers
would otherwise wait for this rank forever); and a watched leaf with gradient-ready hooks
(:func:`add_ready_hook`) has them called as soon as its gradient is final, in the middle of the
pass, which is what lets a data-parallel reduction start during the backward pass.

A tape keeps every array its nodes consumed or produced alive until it is released. For
sharded training that is too long: :func:`swap_out` takes chosen arrays (and the views of their
memory) out of the nodes, leaving stand-ins of one element, and has each node that needs them
rebuild them from a ``restore`` callback when the pass reaches it (torch FSDP frees an unsharded
parameter's storage under the autograd graph the same way). The restore is a collective for
FSDP, so where it runs may not depend on where gradients arrive: a swap's last node runs on
every pass (as a collective's), and a node several swaps wrapped restores them in the order
their first nodes were recorded.

The active tapes live in a :class:`contextvars.ContextVar`, so
``contextvars.copy_context().run(...)`` carries them into worker threads; recording takes a
lock, so threads may record on one tape concurrently.

What a tape records is :class:`Records`, the base of :class:`~cupy_parallel.Tape`: this module
reads and writes it, under its lock. It knows no op: the ops and
:class:`~cupy_parallel.Function` build on it (HIPS autograd's core never imports its NumPy
vjps).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import threading
import weakref
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.compute import compute, cuda_device, zeros_like
from cupy_parallel._src.hostarray import HostArray, host_array, host_ufunc, plain_buffer, version
from cupy_parallel._src.versions import (
    listen_to_writes,
    read_before_writes,
    root_buffer,
    unread_versions,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "Node",
    "ReadyHook",
    "Records",
    "Swap",
    "Vjp",
    "activate",
    "active_tapes",
    "add_ready_hook",
    "append_node",
    "at_pass_end",
    "backward_schedule",
    "cast",
    "deactivate",
    "in_backward",
    "is_recording",
    "mark_collective",
    "mark_shapes_only",
    "modified_error",
    "name_nodes",
    "node_count",
    "note_overwritten",
    "op_name",
    "pause_recording",
    "pullback",
    "record",
    "record_binary",
    "record_unary",
    "release",
    "swap_out",
    "tapes_exist",
    "tapes_tracking",
    "track_leaves",
    "unconnected_as_none",
    "unreach",
]


_ACTIVE: contextvars.ContextVar[tuple[Records, ...]] = contextvars.ContextVar(
    "cupy_parallel_active_tapes", default=()
)

_LIVE: set[weakref.ref[Records]] = set()
"""Every tape that exists, in any thread, recording or not: :func:`note_overwritten` tells them.

An in-place write matters to a tape whose ``with`` block has ended (its ``gradient()`` is still
to come), to one paused by ``stop_recording``, and to an inner tape under an outer one, none of
which is active where the write happens. A weak reference to each tape is added when it is made
and discarded when it is collected (a released tape holds nothing, so telling it costs
nothing). The set holds the references, where a ``WeakSet`` would hold the tapes: the
reference's callback is then the set's own ``discard`` (no Python frame), and adding to the set
and copying it are single operations of the set, atomic across threads without a lock (a
``WeakSet`` under a lock: 0.4 us a tape made and collected, this 0.17; a one-op step makes one).
"""

Vjp: TypeAlias = (
    "Callable[[list[Any], tuple[Any, ...], tuple[bool, ...], tuple[Any, ...], Any], Sequence[Any]]"
)
Node: TypeAlias = "tuple[Vjp, tuple[Any, ...], tuple[bool, ...], tuple[Any, ...], Any, Any]"
ReadyHook: TypeAlias = "Callable[[Any], Any]"
"""``hook(gradient) -> replacement or None``: see :func:`add_ready_hook`."""


class Records:
    """What a tape recorded: its nodes, the arrays it tracks, the host versions it noted.

    The base of :class:`~cupy_parallel.Tape`. Recording (:func:`record`, :func:`append_node`)
    and :func:`pullback` read and write it, in this module, under its lock.
    """

    def __init__(self, nodes: list[Node], /) -> None:
        self._tracked: dict[int, Any] = {}  # id -> array: every tracked array, kept alive
        self._leaves: set[int] = set()  # ids of watched arrays no recorded operation produced
        self._nodes = nodes
        self._versions: dict[int, tuple[Any, int | None]] = {}  # id -> (host array, 1st version)
        self._unread: list[Node] = []  # nodes of host arrays whose versions are still to be read
        # memory key -> (array, what wrote it): arrays the library's own code (a collective)
        # wrote in place while the tape held them (note_overwritten)
        self._overwritten: dict[Any, tuple[Any, str]] = {}
        # the memory keys of the nodes' arrays, gathered by note_overwritten up to node _scanned
        self._held: set[Any] = set()
        self._scanned = 0
        # the memory keys of the watched leaves, and the leaves whose key is still to be added
        # (computed when asked for, _leaf_memory: most tapes are never asked)
        self._leaf_keys: set[Any] = set()
        self._unkeyed: list[Any] = []
        # id(watched leaf) -> its gradient-ready hooks, in registration order (add_ready_hook)
        self._ready_hooks: dict[int, list[ReadyHook]] = {}
        self._lock = threading.Lock()
        _LIVE.add(weakref.ref(self, _LIVE.discard))

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


# --------------------------------------------------------------------------------------------
# Recording: the interface of differentiable operations


active_tapes: Callable[[], tuple[Records, ...]] = _ACTIVE.get
"""The tapes recording in this context, outermost first (empty, so false, when none).

The context variable's own ``get``, not a Python function around it: ops call it once per
operation (``if active_tapes(): record...``), so it is the cheapest "is anything recording" test.
"""


def is_recording() -> bool:
    """Whether any tape records in this context (cheap: lets an op skip preparing a record)."""
    return bool(_ACTIVE.get())


class _Setting:
    """A block in which a context variable has a value.

    A class: a generator-based ``contextmanager`` costs three times as much, and a gradient
    enters two.
    """

    __slots__ = ("_token", "_value", "_variable")

    def __init__(self, variable: contextvars.ContextVar[Any], value: Any, /) -> None:
        self._variable, self._value = variable, value

    def __enter__(self) -> None:
        self._token = self._variable.set(self._value)

    def __exit__(self, *exc_info: object) -> None:
        self._variable.reset(self._token)


def pause_recording(tape: Records | None = None, /) -> contextlib.AbstractContextManager[None]:
    """No tape records inside the block (as a ``Function``'s ``forward`` runs).

    With ``tape``, only that tape stops recording; the other active tapes go on (as
    ``Tape.stop_recording``, and while a tape computes a gradient).
    """
    active = _ACTIVE.get()
    if not active or (tape is not None and tape not in active):
        return _UNCHANGED  # nothing to pause (a gradient taken after the tape's block)
    return _Setting(_ACTIVE, () if tape is None else tuple([t for t in active if t is not tape]))


_UNCHANGED = contextlib.nullcontext()


def in_backward() -> bool:
    """Whether a :func:`pullback` runs in this context (for the raw-NumPy guard's message)."""
    return _PASS.get() is not None


def activate(tape: Records, /) -> contextvars.Token[tuple[Records, ...]]:
    """Make ``tape`` the innermost active tape here; :func:`deactivate` with the token ends it."""
    return _ACTIVE.set((*_ACTIVE.get(), tape))


def deactivate(token: contextvars.Token[tuple[Records, ...]], /) -> None:
    """Restore the active tapes as :func:`activate` found them."""
    _ACTIVE.reset(token)


def tapes_tracking(inputs: Sequence[Any], /) -> list[tuple[Records, tuple[bool, ...]]]:
    """The active tapes that track one of ``inputs``, each with which of them it tracks."""
    return [(t, n) for t in _ACTIVE.get() if (n := t._needs(inputs)) is not None]


def append_node(tape: Records, node: Node, tracked: Sequence[Any], /) -> None:
    """Append a node to ``tape``; the arrays ``tracked`` (some of its outputs) become tracked."""
    with tape._lock:
        tape._nodes.append(node)
        for y in tracked:
            tape._tracked[id(y)] = y


def track_leaves(tape: Records, arrays: Sequence[Any], /) -> None:
    """Track ``arrays`` on ``tape`` as watched leaves, those it does not track already."""
    with tape._lock:
        tracked = tape._tracked
        for leaf in arrays:
            k = id(leaf)
            if k not in tracked:
                tape._leaves.add(k)
                tracked[k] = leaf
                tape._unkeyed.append(leaf)


def _leaf_memory(tape: Records) -> set[Any]:
    """The memory keys of ``tape``'s watched leaves (call under its lock)."""
    unkeyed = tape._unkeyed
    if unkeyed:
        tape._leaf_keys.update(map(_memory_key, unkeyed))
        unkeyed.clear()
    return tape._leaf_keys


def release(tape: Records, /) -> None:
    """Drop everything ``tape`` recorded (a non-persistent tape, once it computed gradients)."""
    tape._nodes, tape._tracked, tape._leaves, tape._versions = [], {}, set(), {}
    tape._unread = []
    tape._overwritten, tape._held, tape._scanned, tape._leaf_keys = {}, set(), 0, set()
    tape._unkeyed = []
    tape._ready_hooks = {}


def add_ready_hook(tape: Records, leaf: Any, hook: ReadyHook, /) -> Callable[[], None]:
    """Call ``hook(gradient)`` in every :func:`pullback` on ``tape`` once ``leaf``'s is final.

    ``leaf`` must be a watched leaf of ``tape`` (unchecked: ``Tape`` checks). Its gradient is
    final when the pass has run the earliest recorded node that consumed it; the hook is called
    right then, before the pass goes on, with that gradient (``None`` when no gradient reached
    ``leaf``). A leaf no recorded node consumed is final from the start: its hooks are called
    before the first node runs. What it returns, unless ``None``, replaces the
    gradient (``pullback`` returns it for ``leaf``). Returns a function removing the hook.
    """
    with tape._lock:
        hooks = tape._ready_hooks.setdefault(id(leaf), [])
        hooks.append(hook)

    def remove() -> None:
        with tape._lock:
            if hook in hooks:
                hooks.remove(hook)

    return remove


_COLLECTIVE_VJPS: set[Vjp] = set()
"""The vjps that are collectives: their nodes run on every pass (:func:`mark_collective`)."""


_UNZEROED_VJPS: set[Vjp] = set()
"""The collectives given ``None`` (not zeros) for an output no gradient reached."""


def _no_gradient(vjp: Vjp, output: Any) -> Any:
    """What a collective's vjp gets for an output no gradient reached (see mark_collective)."""
    return None if vjp in _UNZEROED_VJPS else zeros_like(output)


def mark_collective(vjp: Vjp, /, *, zeros: bool = True) -> None:
    """Declare ``vjp`` a collective: :func:`pullback` runs its nodes even when no gradient arrived.

    A differentiable collective's vjp communicates with the other ranks, which run it too: a
    rank whose loss does not depend on the collective's output must still take part, or its
    peers wait for it forever. Such a node's vjp therefore runs on every pass, given zeros for
    each output no gradient reached (``None`` with ``zeros=False``: a vjp that must tell "no
    gradient arrived" from a zero gradient, as a refused reduction's, which raises only where
    some rank's gradient did arrive).
    """
    _COLLECTIVE_VJPS.add(vjp)
    if not zeros:
        _UNZEROED_VJPS.add(vjp)


def tapes_exist() -> bool:
    """Whether any tape exists, in any thread (else :func:`note_overwritten` has nothing to do)."""
    return bool(_LIVE)


def note_overwritten(arrays: Sequence[Any], operation: str, /) -> None:
    """Tell every tape that the library's own ``operation`` wrote ``arrays`` in place.

    A collective (``dist.all_reduce(x)``, a ``recv`` into ``x``, ...) knows what it writes,
    whatever the kind of array: a tape that tracks or saved one of ``arrays`` (or another view
    of its memory) then refuses, in :meth:`Tape.gradient`, every node that needs it, with the
    same ``RuntimeError`` as any other in-place write, for NumPy, host and CuPy arrays alike and
    without ``check_writes``. Every tape that exists hears of it, not only those recording here:
    one whose ``with`` block has ended, one paused by ``stop_recording``, an inner tape under
    an outer one (torch's version counters do not see a c10d collective at all, and give the
    wrong gradient there). Nothing to do when no tape exists.
    """
    if not _LIVE:
        return
    tapes = [tape for ref in list(_LIVE) if (tape := ref()) is not None]
    written = {_memory_key(a): a for a in arrays}
    for tape in tapes:
        if not tape._nodes and not tape._leaves:
            continue
        with tape._lock:
            held = tape._held  # the nodes' arrays, scanned once each (amortised over the calls)
            for node in tape._nodes[tape._scanned :]:
                held.update(_memory_key(a) for a in (*node[1], *node[3]) if is_array(a))
            tape._scanned = len(tape._nodes)
            leaves = _leaf_memory(tape)
            for key, array in written.items():
                if (key in held or key in leaves) and key not in tape._overwritten:
                    tape._overwritten[key] = (array, operation)


listen_to_writes(note_overwritten)  # the writes of layers below (comm's out= forms)


def _memory_key(x: Any) -> Any:
    """What identifies ``x``'s memory: the NumPy buffer owning it, or the CuPy allocation."""
    data = plain_buffer(x)
    if isinstance(data, np.ndarray):
        return id(root_buffer(data))
    memory = getattr(getattr(data, "data", None), "mem", None)  # a CuPy array's allocation
    return ("cuda", id(memory)) if memory is not None else id(data)


def _to_read(tape: Records, node: Node) -> None:
    """Have ``tape`` note the versions of the host arrays of ``node``: call under its lock.

    PyTorch's version-counter rule: :func:`pullback` refuses nodes whose host arrays were
    written in place since the tape first saw them. The versions are read later, all at once:
    before the next in-place write of any host array is counted (:func:`_read_all_versions`,
    which the version counters call), or before a swap. Until then no count has moved, so an
    array still to be read has the version it had when recorded, and the pass knows it was not
    written (reading three versions cost a recorded host op 0.5 us, and the pass as much).
    """
    unread = tape._unread
    unread.append(node)
    if len(unread) == 1:  # after the append: a reader that ran meanwhile left the list empty
        unread_versions()


def _read_versions(tape: Records) -> None:
    """Note the versions of the host arrays of ``tape``'s unread nodes: call under its lock.

    Each array's first sighting counts (the nodes in the order recorded; one seen before keeps
    its version).
    """
    seen = tape._versions
    for node in tape._unread:
        for a in (*node[1], *node[3]):
            if type(a) is HostArray and id(a) not in seen:
                seen[id(a)] = (a, version(a))
    tape._unread.clear()


def _read_all_versions() -> None:
    """Every tape reads its unread versions (called before a write is counted)."""
    for ref in list(_LIVE):
        tape = ref()
        if tape is not None and tape._unread:
            with tape._lock:
                _read_versions(tape)


read_before_writes(_read_all_versions)


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
    host = bool(outputs) and type(outputs[0]) is HostArray  # the node's versions are noted
    cuda = cuda_device(outputs[0]) if outputs and not host else None
    for tape in tapes:
        needs = tape._needs(inputs)
        if needs is not None:
            node = (vjp, inputs, needs, outputs, aux, cuda)
            append_node(tape, node, tracked)
            if host:
                with tape._lock:
                    _to_read(tape, node)


def record_unary(vjp: Vjp, x: Any, z: Any, aux: Any, /) -> None:
    """:func:`record` for ``z = op(x)``, the fast path."""
    for tape in _ACTIVE.get():
        if id(x) in tape._tracked:
            if not isinstance(z, np.ndarray):  # a host or CuPy array
                _append_on_device(tape, vjp, (x,), (True,), z, aux)
                continue
            node = (vjp, (x,), (True,), (z,), aux, None)
            with tape._lock:
                tape._nodes.append(node)
                tape._tracked[id(z)] = z


def _append_on_device(  # noqa: PLR0917 - a node's slots, positional: the recording hot path
    tape: Records, vjp: Vjp, inputs: tuple[Any, ...], needs: tuple[bool, ...], z: Any, aux: Any
) -> None:
    """Append the node of a host or CuPy result ``z`` (the fast paths of :func:`record`).

    Its last slot is the CUDA device of a CuPy ``z``; a host node has its versions read later.
    """
    host = type(z) is HostArray
    node = (vjp, inputs, needs, (z,), aux, None if host else cuda_device(z))
    with tape._lock:
        tape._nodes.append(node)
        tape._tracked[id(z)] = z
        if host:  # _to_read, inline (one call less per recorded host op)
            unread = tape._unread
            unread.append(node)
            if len(unread) == 1:
                unread_versions()


# needs of a binary op, indexed by [a is tracked][b is tracked]: constants, nothing to allocate
_NEEDS = ((None, (False, True)), ((True, False), (True, True)))


def record_binary(vjp: Vjp, a: Any, b: Any, z: Any, aux: Any, /) -> None:
    """:func:`record` for ``z = op(a, b)``, the fast path."""
    for tape in _ACTIVE.get():
        tracked = tape._tracked
        needs = _NEEDS[id(a) in tracked][id(b) in tracked]
        if needs is not None:
            if not isinstance(z, np.ndarray):  # a host or CuPy array
                _append_on_device(tape, vjp, (a, b), needs, z, aux)
                continue
            node = (vjp, (a, b), needs, (z,), aux, None)
            with tape._lock:
                tape._nodes.append(node)
                tracked[id(z)] = z


# Differentiable helpers the tape itself needs, so that a gradient computed under an outer tape
# is recorded there in full (accumulation, dtype casts).


def _sum_pair(total: Any, grad: Any) -> Any:
    """``total + grad`` of two gradients of one array (same shape), recorded."""
    if type(total) is np.ndarray:
        z = total + grad
        z = z if type(z) is np.ndarray else np.asarray(z)  # 0-d NumPy
    elif (z := host_ufunc(np.add, total, grad)) is None:  # two host arrays: their buffers
        z = compute(operator.add, total, grad)
    if _ACTIVE.get():
        record_binary(_sum_pair_vjp, total, grad, z, None)
    return z


def _sum_pair_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return gs[0], gs[0]


def _astype(x: Any, dtype: Any) -> Any:
    if x.dtype.kind == "c" and np.dtype(dtype).kind != "c":
        return x.real.astype(dtype)  # the real part, said so (astype would warn, then do it)
    return x.astype(dtype)


def cast(x: Any, dtype: Any, /) -> Any:
    """``x`` as ``dtype`` (a new array), recorded; its gradient is cast back.

    The one recorded cast: the tape's gradients and every vjp's ``fit`` use it. A complex
    ``x`` cast to a real dtype is its real part, whose gradient is the real gradient cast to
    complex; a real ``x`` cast to complex gets the real part of its complex gradient back
    (PyTorch's rule for a real input of complex arithmetic: ``dL/dx`` is real).
    """
    z = compute(_astype, x, dtype)
    record_unary(_cast_vjp, x, z, None)
    return z


def _cast_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return (cast(gs[0], xs[0].dtype),)


# --------------------------------------------------------------------------------------------
# The reverse pass


def pullback(
    tape: Records,
    targets: Sequence[Any],
    seeds: Sequence[Any],
    sources: Sequence[Any],
    /,
    *,
    unconnected_none: bool = False,
) -> list[Any]:
    """Reverse accumulation on ``tape``: each source's gradient, ``None`` where none arrives.

    Unchecked: ``targets`` and ``sources`` must be arrays ``tape`` tracks and ``seeds`` the
    targets' cotangents (:meth:`Tape.gradient` is the checked entry). ``tape`` records nothing
    meanwhile; the other active tapes record the vjps' recorded operations (higher order).
    Collective nodes run even when no gradient reached them (:func:`mark_collective`), and the
    gradient-ready hooks are called as the leaves' gradients become final (:func:`add_ready_hook`).
    ``unconnected_none``: the caller returns ``None``, not zeros, where ``None`` comes back (its
    ``unconnected_gradients="none"``), which the hooks may read (:func:`unconnected_as_none`).
    A leaf :func:`unreach`-ed in the pass gets ``None``, whatever its hooks returned.
    """
    # id(array) -> gradient accumulated so far
    grads = {id(targets[0]): seeds[0]} if len(targets) == 1 else _seeded(targets, seeds)
    # sources that are intermediate results: their gradients are set aside as the pass goes
    keep = _kept_sources(tape, sources)
    kept: dict[int, Any] = {}
    # ids of host arrays written in place since they were recorded
    written = _written(tape) if tape._versions else None
    pop = grads.pop
    # node index -> ids of the hooked leaves final once it ran
    ready = _ready_at(tape) if tape._ready_hooks else None
    nodes = tape._nodes
    with _Backward(tape, unconnected_none, grads):
        if ready and -1 in ready:  # hooked leaves no node consumed: final from the start
            _call_ready_hooks(tape, grads, ready.pop(-1))
        for index in range(len(nodes) - 1, -1, -1):
            node = nodes[index]
            vjp, inputs, needs, outputs, aux, cuda = node
            if len(outputs) == 1:  # most nodes: no list comprehension (a frame each, in 3.11)
                g = pop(id(outputs[0]), None)
                out_grads = None if g is None else [g]  # complete: consumers came later
                if g is None and vjp in _COLLECTIVE_VJPS:
                    out_grads = [_no_gradient(vjp, outputs[0])]
            else:
                size = len(grads)
                out_grads = [pop(id(y), None) for y in outputs]
                if vjp in _COLLECTIVE_VJPS and vjp not in _UNZEROED_VJPS:
                    out_grads = [
                        zeros_like(y) if g is None else g
                        for y, g in zip(outputs, out_grads, strict=True)
                    ]
                elif len(grads) == size and vjp not in _COLLECTIVE_VJPS:
                    out_grads = None  # no gradient reaches this node (a collective still runs)
            if out_grads is not None:
                if keep:
                    _keep(kept, keep, outputs, out_grads)
                if written and _reached(out_grads):
                    _refuse_written(tape, node, written)
                if tape._overwritten and _reached(out_grads):
                    _refuse_overwritten(tape, node)
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
            if ready and index in ready:
                _call_ready_hooks(tape, grads, ready.pop(index))

    if keep:
        kept.update(grads)
        grads = kept
    one = len(sources) == 1  # then no comprehension (a frame)
    return [grads.get(id(sources[0]))] if one else [grads.get(id(x)) for x in sources]


def _kept_sources(tape: Records, sources: Sequence[Any]) -> set[int] | None:
    """The ids of ``sources`` that are no watched leaf of ``tape``; ``None`` when all are."""
    leaves = tape._leaves
    return None if leaves.issuperset(map(id, sources)) else set(map(id, sources)) - leaves


def _seeded(targets: Sequence[Any], seeds: Sequence[Any]) -> dict[int, Any]:
    """The gradients a pass starts from: each target's seed, by ``id``, summed for a repeat."""
    grads: dict[int, Any] = {}
    for t, s in zip(targets, seeds, strict=True):
        k = id(t)
        grads[k] = s if k not in grads else _sum_pair(grads[k], s)
    return grads


def _reached(grads: list[Any]) -> bool:
    """Whether a gradient reached a node (a collective given ``None`` everywhere reads nothing)."""
    return any(g is not None for g in grads)


def _ready_at(tape: Records) -> dict[int, list[int]]:
    """Where each hooked leaf's gradient becomes final: node index -> the leaves' ids.

    The earliest recorded node consuming a leaf is the last the reverse pass runs that adds to
    its gradient; a hooked leaf no node consumes is filed under index ``-1`` (final at once:
    its hooks are called before the first node runs).
    """
    if not tape._ready_hooks:
        return {}
    hooked = {k for k, hooks in tape._ready_hooks.items() if hooks}
    if not hooked:
        return {}
    first: dict[int, int] = {}
    for index, node in enumerate(tape._nodes):
        for x in node[1]:
            k = id(x)
            if k in hooked and k not in first:
                first[k] = index
    ready: dict[int, list[int]] = {}
    for k in hooked:
        ready.setdefault(first.get(k, -1), []).append(k)
    return ready


def _call_ready_hooks(tape: Records, grads: dict[int, Any], leaves: list[int]) -> None:
    """Call the hooks of ``leaves``, whose gradients are final; a returned array replaces one."""
    for k in leaves:
        for hook in list(tape._ready_hooks.get(k, ())):
            replacement = hook(grads.get(k))
            if replacement is not None:
                grads[k] = replacement


_PASS: contextvars.ContextVar[_Backward | None] = contextvars.ContextVar(
    "cupy_parallel_pass", default=None
)
"""The reverse pass in progress in this context (``None``: none).

The one variable a pass sets also says that it runs (:func:`in_backward`): each ``set`` and
``reset`` of a context variable costs a gradient 0.1 us.
"""


def at_pass_end(callback: Callable[[], object], /) -> bool:
    """Run ``callback()`` once the reverse pass in progress here has run its last node.

    torch's ``Variable._execution_engine.queue_callback``: a gradient-ready hook that must wait
    for something (DDP's buckets) waits there, after every collective of the pass was issued,
    not in the middle of the pass, where a peer may first wait for this rank in a collective
    of the pass still to come. Returns ``False`` (and runs nothing) outside a reverse pass.
    """
    current = _PASS.get()
    if current is None:
        return False
    current.ends.append(callback)
    return True


def unconnected_as_none() -> bool:
    """Whether the pass in progress here ends in ``None``, not zeros, where no gradient arrived.

    The caller's ``unconnected_gradients="none"`` (``False`` outside a reverse pass): a hook
    that decides between a reduced gradient and none (DDP) learns what "none" will become.
    """
    current = _PASS.get()
    return current is not None and current.none


def unreach(leaf: Any, /) -> None:
    """Have the pass in progress here give no gradient to the watched ``leaf``, as if none came.

    Whatever ``leaf``'s gradient-ready hooks returned, :func:`pullback` then returns ``None``
    for it, which its caller turns into its ``unconnected_gradients`` value (zeros or
    ``None``). For a hook, or an :func:`at_pass_end` callback, that learns only at the end of
    the pass that no rank's gradient reached a parameter (DDP's ``find_unused_parameters``).

    Raises:
        RuntimeError: No reverse pass is in progress here.
    """
    current = _PASS.get()
    if current is None:
        raise RuntimeError(
            "unreach() needs a reverse pass in progress: call it from a gradient-ready hook or "
            "an at_pass_end callback."
        )
    current.unreached.append(leaf)


class _Backward:
    """The block a :func:`pullback` on ``tape`` runs in.

    ``tape`` records nothing inside (the other active tapes go on, as under
    :func:`pause_recording`), and the guard's message knows that a pass runs. When the pass
    completes without an error, the callbacks of :func:`at_pass_end` run, in the order queued
    (one queued meanwhile runs too), then the leaves :func:`unreach`-ed leave ``grads`` (the
    pass's gradients, by ``id``), before ``tape`` records again. One class for all of it (as
    :class:`_Setting`): a second context manager cost each gradient 0.3 us. It is also the
    pass in progress here (:data:`_PASS`): what its caller asked, what its hooks queued.
    """

    __slots__ = ("_grads", "_paused", "_tape", "_token", "ends", "none", "unreached")

    def __init__(self, tape: Records, none: bool, grads: dict[int, Any], /) -> None:
        self._tape = tape
        self.none = none  # the caller takes None (not zeros) where no gradient arrived
        self.ends: list[Callable[[], object]] = []  # at_pass_end's callbacks, in order
        self.unreached: list[Any] = []  # unreach's leaves
        self._grads = grads

    def __enter__(self) -> None:
        active = _ACTIVE.get()
        tape = self._tape
        self._paused = (
            _ACTIVE.set(tuple([t for t in active if t is not tape])) if tape in active else None
        )
        self._token = _PASS.set(self)

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        try:
            if exc_type is None:
                for callback in self.ends:
                    callback()
                for leaf in self.unreached:
                    self._grads.pop(id(leaf), None)
        finally:
            _PASS.reset(self._token)
            if self._paused is not None:
                _ACTIVE.reset(self._paused)


def _keep(kept: dict[int, Any], keep: set[int], outputs: tuple[Any, ...], grads: list[Any]) -> None:
    """Set aside the complete gradients of intermediate results asked for as sources."""
    kept.update((id(y), g) for y, g in zip(outputs, grads, strict=True) if id(y) in keep)


def _count_error(node: Node, count: int) -> ValueError:
    """A vjp returned ``count`` gradients for a node with another number of inputs."""
    return ValueError(
        f"The vjp of {op_name(node[0], node[4])} returned {count} gradients for "
        f"{len(node[1])} inputs: a vjp returns one gradient (or None) per input."
    )


def _written(tape: Records) -> set[int]:
    """Ids of the host arrays on ``tape`` whose version moved since the tape first saw them.

    Those still to be read (:func:`_to_read`) are not among them: no write was counted since.
    """
    if not tape._versions:
        return set()
    return {k for k, (a, recorded) in tape._versions.items() if version(a) != recorded}


def _refuse_written(tape: Records, node: Node, written: set[int]) -> None:
    """Raise if the node about to run consumed or produced an array written in place since."""
    inputs = node[1]
    for i, a in enumerate((*inputs, *node[3])):
        if id(a) in written:
            where = f"input {i}" if i < len(inputs) else f"output {i - len(inputs)}"
            raise modified_error(op_name(node[0], node[4]), where, a, tape._versions[id(a)][1])


def _refuse_overwritten(tape: Records, node: Node) -> None:
    """Raise if the node about to run needs an array a collective wrote since it was recorded."""
    inputs = node[1]
    for i, a in enumerate((*inputs, *node[3])):
        if not is_array(a):
            continue
        found = tape._overwritten.get(_memory_key(a))
        if found is not None:
            where = f"input {i}" if i < len(inputs) else f"output {i - len(inputs)}"
            op = op_name(node[0], node[4])
            raise RuntimeError(
                f"An array the gradient of {op} needs was modified in place after {op} was "
                f"recorded: its {where} (shape {a.shape}, on {device_of(a)}) was written by "
                f"{found[1]}, which puts its result into the arrays it is given. The gradient "
                "would be computed from the new values (PyTorch raises here too). Pass the "
                "collective a copy of the array (y = x.copy(); dist.all_reduce(y)), or record "
                "the collective's result as a new array."
            )


_NODE_NAMES: list[tuple[Vjp, Callable[[Any], str]]] = []
"""(vjp, name_of): how errors name the nodes of a vjp from their ``aux`` (:func:`name_nodes`)."""


def name_nodes(vjp: Vjp, name_of: Callable[[Any], str], /) -> None:
    """Have errors name the nodes of ``vjp`` as ``name_of(aux)`` (a Function's by its class)."""
    _NODE_NAMES.append((vjp, name_of))


def op_name(vjp: Vjp, aux: Any) -> str:
    """How errors name a node's operation: the Function's class or the op behind a vjp."""
    for named, name_of in _NODE_NAMES:
        if vjp is named:
            return name_of(aux)
    name = getattr(vjp, "__name__", repr(vjp))
    return f"ops.{name.strip('_').removesuffix('_vjp')}" if name.endswith("_vjp") else name


def modified_error(op: str, where: str, array: Any, recorded: int | None) -> RuntimeError:
    """The error for an array ``op`` needs that was written in place since (version moved)."""
    return RuntimeError(
        f"An array the gradient of {op} needs was modified in place after {op} was recorded: "
        f"its {where} (shape {array.shape}, on {device_of(array)}) is at version "
        f"{version(array)}, expected {recorded}. Writes such as x[...] = v, x += 1, x.fill(v) "
        "or out=x change the values the gradient is computed from (PyTorch raises here too). "
        "Write into a copy, or compute a new array with cupy_parallel.ops."
    )


# --------------------------------------------------------------------------------------------
# Swapping arrays out of a tape (FSDP's resharding): freed after the forward pass, rebuilt
# when the backward pass needs them


def node_count(tape: Records, /) -> int:
    """How many nodes ``tape`` holds: the index the next recorded node gets."""
    return len(tape._nodes)


class _Rebuild:
    """How to rebuild one array a swap took out: a view of its owner's memory, and its stand-in."""

    __slots__ = ("host", "offset", "original", "owner", "shape", "stand_in", "strides")

    def __init__(self, array: Any, owner: int, base: Any) -> None:
        data, root = plain_buffer(array), plain_buffer(base)
        self.owner = owner
        self.offset = _address(data) - _address(root)
        self.shape, self.strides = tuple(data.shape), tuple(data.strides)
        self.host = device_of(array) if type(array) is HostArray else None
        self.original: Any = array  # dropped once the swap is committed (see Swap.commit)
        self.stand_in = _stand_in(array)

    def view(self, bases: Sequence[Any]) -> Any:
        """The array rebuilt from ``bases[owner]`` (a restored owner of the same layout)."""
        root = plain_buffer(bases[self.owner])
        dtype = self.stand_in.dtype
        if isinstance(root, np.ndarray):
            data = np.ndarray(
                self.shape, dtype, buffer=root, offset=self.offset, strides=self.strides
            )
            return data if self.host is None else host_array(data, self.host)
        xp = device_of(root).xp
        return xp.ndarray(self.shape, dtype, memptr=root.data + self.offset, strides=self.strides)


def _address(data: Any) -> int:
    """The address of ``data``'s first element (NumPy or CuPy)."""
    if isinstance(data, np.ndarray):
        return int(data.__array_interface__["data"][0])
    return int(data.data.ptr)


def _broadcast_zero(xp: Any, x: Any) -> Any:
    return xp.broadcast_to(xp.zeros((), x.dtype), x.shape)


def _stand_in(x: Any) -> Any:
    """An array of ``x``'s shape, dtype, type and device holding one element (stride 0)."""
    data = plain_buffer(x)
    if isinstance(data, np.ndarray):
        z = _broadcast_zero(np, data)
        return host_array(z, device_of(x)) if type(x) is HostArray else z
    return compute(lambda a: _broadcast_zero(device_of(a).xp, a), x)


class Swap:
    """Arrays swapped out of a tape's nodes by :func:`swap_out`; :meth:`undo` puts some back."""

    def __init__(
        self, tape: Records, restore: Callable[[], Sequence[Any]], owners: Sequence[Any]
    ) -> None:
        self.tape = tape
        self.restore = restore
        self.rebuilds: dict[int, _Rebuild] = {}  # id(original) -> how to rebuild it
        self.changed: list[tuple[int, bool]] = []  # (node index, whether its vjp was wrapped)
        self.keys = [_memory_key(o) for o in owners]
        # id(original) -> the host version the tape noted (the entry holds no array: a swap's
        # references are counted by its caller); put back by undo
        self.versions: dict[int, int | None] = {}
        self.first = 0  # the index of the tape's first node it looked at (set by swap_out)
        self.last = -1  # the index of the last node it wrapped: the arrays are rebuilt there

    def commit(self) -> None:
        """Drop the originals: from now on only :meth:`restore` gives the arrays back.

        Only now does the tape forget the owners' memory (the keys :func:`note_overwritten`
        looks for): until then an :meth:`undo` leaves the tape as it was, so an in-place
        write into arrays the nodes keep still makes its gradient raise.
        """
        with self.tape._lock:
            self.tape._held.difference_update(self.keys)
        for rebuild in self.rebuilds.values():
            rebuild.original = None
        self.versions = {}

    def undo(self, owners: Sequence[Any]) -> None:
        """Put the arrays back in the nodes (``owners`` are the arrays' live owners).

        Before :meth:`commit`, the original arrays go back. After it, the nodes get views of
        ``owners`` (the memory gathered again, same layout). Either way the tape watches the
        owners' memory for in-place writes again (another thread's write may have scanned the
        nodes while they held the stand-ins); a later swap may have wrapped a node again, and
        keeps its own wrapper.
        """
        tape = self.tape
        back = {
            id(r.stand_in): (r.original if r.original is not None else r.view(owners))
            for r in self.rebuilds.values()
        }
        with tape._lock:
            # what a scan since the swap noted: the stand-ins (freed now, their memory reused)
            # in place of the arrays coming back
            tape._held.difference_update(_memory_key(r.stand_in) for r in self.rebuilds.values())
            tape._held.update(_memory_key(o) for o in owners)
            for index, wrapped in self.changed:
                vjp, inputs, needs, outputs, aux, cuda = tape._nodes[index]
                if wrapped:
                    vjp, aux = _unwrap(vjp, aux, self)
                    if vjp is _swapped_last_vjp and all(s.last != index for s in _chain(aux)):
                        vjp = _swapped_vjp  # the last node of no swap left around it
                inputs = tuple(back.get(id(a), a) for a in inputs)
                outputs = tuple(back.get(id(a), a) for a in outputs)
                tape._nodes[index] = (vjp, inputs, needs, outputs, aux, cuda)
            for stand_id, array in back.items():
                if tape._tracked.pop(stand_id, None) is not None:
                    tape._tracked[id(array)] = array
            for r in self.rebuilds.values():
                if id(r.original) in self.versions:  # the host versions noted before the swap
                    tape._versions[id(r.original)] = (r.original, self.versions[id(r.original)])
        self.rebuilds, self.changed, self.versions = {}, [], {}


def _unwrap(vjp: Vjp, aux: Any, swap: Swap) -> tuple[Vjp, Any]:
    """A swapped node's ``vjp`` and ``aux`` without ``swap``'s wrapper (outer ones stay)."""
    inner_vjp, inner_aux, positions, owner = aux
    if owner is swap:
        return inner_vjp, inner_aux
    inner_vjp, inner_aux = _unwrap(inner_vjp, inner_aux, swap)
    return vjp, (inner_vjp, inner_aux, positions, owner)


def swap_out(
    tape: Records,
    first: int,
    owners: Sequence[Any],
    restore: Callable[[], Sequence[Any]],
    /,
) -> Swap | None:
    """Take every array whose memory is one of ``owners``' out of ``tape``'s nodes from ``first``.

    Each such array (an owner, or a view of one) is replaced, in the nodes and among the tracked
    arrays, by a stand-in of its shape, dtype and device holding one element; each node that
    held one gets a vjp that first rebuilds the arrays from ``restore()`` (the owners again,
    same shapes, dtypes and layout: the caller caches them for a pass) and then runs the
    original vjp with them. Nothing else changes: the gradients accumulate at the stand-ins as
    they did at the originals. The tape then no longer keeps the owners' memory alive (torch
    FSDP's ``storage.resize_(0)`` of the unsharded parameters, for any array type).

    Returns ``None`` (nothing swapped) for a tape that fingerprints its arrays
    (``check_writes``: it needs their bytes) or when an owner is a watched leaf. The caller
    checks that the owners' memory is really gone once it drops its own references, and
    :meth:`Swap.undo` puts the arrays back where it is not (someone else holds them).
    """
    if type(tape._nodes) is not list:
        return None
    swap = Swap(tape, restore, owners)
    swap.first = first
    keys = {key: j for j, key in enumerate(swap.keys)}
    with tape._lock:
        _read_versions(tape)  # the nodes change below: their arrays' versions first
        if not _leaf_memory(tape).isdisjoint(keys):
            return None
        nodes = tape._nodes
        last = -1  # the last node wrapped: the pass rebuilds the arrays there, on every rank
        for index in range(first, len(nodes)):
            vjp, inputs, needs, outputs, aux, cuda = nodes[index]
            positions = []
            arrays = (*inputs, *outputs)
            for i, a in enumerate(arrays):
                if not is_array(a):
                    continue
                j = keys.get(_memory_key(a))
                if j is None:
                    continue
                rebuild = swap.rebuilds.get(id(a))
                if rebuild is None:
                    rebuild = swap.rebuilds[id(a)] = _Rebuild(a, j, owners[j])
                positions.append((i, rebuild))
            if positions:
                subs = {id(r.original): r.stand_in for _, r in positions}
                new_inputs = tuple(subs.get(id(a), a) for a in inputs)
                new_outputs = tuple(subs.get(id(a), a) for a in outputs)
                wrap = vjp not in _SHAPES_ONLY
                if wrap:
                    aux = (vjp, aux, tuple(positions), swap)
                    vjp = _wrapper(vjp)
                    last = index
                nodes[index] = (vjp, new_inputs, needs, new_outputs, aux, cuda)
                swap.changed.append((index, wrap))
        if last >= 0 and nodes[last][0] is _swapped_vjp:
            nodes[last] = (_swapped_last_vjp, *nodes[last][1:])
        swap.last = last
        for k, rebuild in swap.rebuilds.items():
            if tape._tracked.pop(k, None) is not None:
                tape._tracked[id(rebuild.stand_in)] = rebuild.stand_in
            noted = tape._versions.pop(k, None)
            if noted is not None:
                swap.versions[k] = noted[1]
    return swap


def _wrapper(vjp: Vjp) -> Vjp:
    """The vjp a swap puts around a node's ``vjp`` (maybe a wrapper already): run when it ran.

    A collective's wrapper runs on every pass, given zeros or ``None`` as the collective's own
    vjp; a wrapper around a swap's last node (:func:`_swapped_last_vjp`) stays one.
    """
    if vjp is _swapped_last_vjp:
        return _swapped_last_vjp
    if vjp in _UNZEROED_VJPS:
        return _swapped_unzeroed_vjp
    return _swapped_collective_vjp if vjp in _COLLECTIVE_VJPS else _swapped_vjp


def _chain(aux: Any) -> list[Swap]:
    """The swaps whose wrappers are around a node, outermost first (``aux``: the outermost's)."""
    swaps = []
    while True:
        vjp, inner, _, swap = aux
        swaps.append(swap)
        if vjp not in _WRAPPERS:
            return swaps
        aux = inner


def _restore_in_order(aux: Any) -> None:
    """Rebuild the arrays of every swap around a node, in the order their gathers were recorded.

    A node holding the arrays of several swaps is wrapped once by each, in the order they
    were made, which is each rank's own (a unit swapped out while ``fn`` reads the next one on
    one rank, at the end of the call on another): restoring them by that order would have the
    ranks gather the units in different orders (two units of one layout exchanging their rows
    without an error). Their first nodes are the same on every rank.
    """
    for swap in sorted(_chain(aux), key=lambda s: s.first):
        swap.restore()


def backward_schedule(
    tape: Records, start: int, names: dict[int, Any], /
) -> list[tuple[str, list[Any]]]:
    """What a reverse pass over ``tape``'s nodes from ``start`` does that other ranks must match.

    In the order the nodes were recorded: ``("collective", swaps)`` for a collective's node,
    ``("restore", swaps)`` for a swap's last node (where the pass rebuilds the swapped arrays,
    a collective for FSDP, whether or not a gradient arrives), ``swaps`` the names (from
    ``names``, by ``id`` of the :class:`Swap`; others left out) of the swaps around the node,
    sorted. Nodes of neither kind are left out: which of them a rank recorded (a statistic
    logged on one rank) changes nothing the other ranks see, unless it moves a swap's last
    node, which this shows.
    """
    schedule: list[tuple[str, list[Any]]] = []
    with tape._lock:
        for node in tape._nodes[start:]:
            vjp, aux = node[0], node[4]
            last = vjp is _swapped_last_vjp
            if not last and vjp not in _COLLECTIVE_VJPS:
                continue
            swaps = _chain(aux) if vjp in _WRAPPERS else []
            named = sorted(names[id(s)] for s in swaps if id(s) in names)
            schedule.append(("restore" if last else "collective", named))
    return schedule


def _swapped_vjp(
    gs: list[Any], xs: tuple[Any, ...], needs: Any, ys: tuple[Any, ...], aux: Any
) -> Any:
    """A swapped node's vjp: rebuild the arrays swapped out, then run the original vjp."""
    vjp, inner, positions, swap = aux
    if vjp in _WRAPPERS:  # wrapped by several swaps: every rank restores them in one order
        _restore_in_order(aux)
    bases = swap.restore()
    arrays = [*xs, *ys]
    for i, rebuild in positions:
        arrays[i] = rebuild.view(bases)
    count = len(xs)
    return vjp(gs, tuple(arrays[:count]), needs, tuple(arrays[count:]), inner)


def _swapped_collective_vjp(
    gs: list[Any], xs: tuple[Any, ...], needs: Any, ys: tuple[Any, ...], aux: Any
) -> Any:
    """:func:`_swapped_vjp` of a collective's node (run on every pass, as the collective's)."""
    return _swapped_vjp(gs, xs, needs, ys, aux)


def _swapped_unzeroed_vjp(
    gs: list[Any], xs: tuple[Any, ...], needs: Any, ys: tuple[Any, ...], aux: Any
) -> Any:
    """:func:`_swapped_vjp` of a collective given ``None`` where no gradient arrived."""
    return _swapped_vjp(gs, xs, needs, ys, aux)


def _swapped_last_vjp(
    gs: list[Any], xs: tuple[Any, ...], needs: Any, ys: tuple[Any, ...], aux: Any
) -> Any:
    """:func:`_swapped_vjp` of a swap's last node, run on every pass even where no gradient came.

    Where a swap's arrays are rebuilt is a collective (FSDP gathers the unit again): it must
    happen at the same node on every rank, not at the first node some gradient reaches, which
    differs where a rank's loss does not use an output (a head whose task has no labels in
    that rank's batch). The reverse pass reaches a swap's last node before its others: here
    it rebuilds the arrays on every rank; with no gradient it only does that.
    """
    if _reached(gs):
        return _swapped_vjp(gs, xs, needs, ys, aux)
    _restore_in_order(aux)
    return (None,) * len(xs)


mark_collective(_swapped_collective_vjp)
mark_collective(_swapped_unzeroed_vjp, zeros=False)
mark_collective(_swapped_last_vjp, zeros=False)
_WRAPPERS = frozenset(
    {_swapped_vjp, _swapped_collective_vjp, _swapped_unzeroed_vjp, _swapped_last_vjp}
)
for _wrapped in _WRAPPERS:
    name_nodes(_wrapped, lambda aux: op_name(aux[0], aux[1]))

_SHAPES_ONLY: set[Vjp] = set()
"""The vjps reading only their outputs' shapes and dtypes (:func:`mark_shapes_only`)."""


def mark_shapes_only(vjp: Vjp, /) -> None:
    """Declare that ``vjp`` reads only its outputs' shapes, dtypes and devices, never values.

    :func:`swap_out` then leaves its nodes' stand-ins in place (nothing to rebuild), as for the
    gather whose outputs a swap takes out: its adjoint needs the cotangents only.
    """
    _SHAPES_ONLY.add(vjp)
