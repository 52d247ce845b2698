"""Differentiable collectives (``torch.distributed.nn.functional``): out of place, on the tape.

Each function returns new arrays (the caller's are never written) and, when a tape records,
records a node whose vjp is itself written with these collectives, so nested tapes give second
and higher derivatives through them (JAX's transposes: ``psum`` of ``psum``, ``psum_scatter`` of
``all_gather``).

**What a rank's gradient means.** Every rank computes its own loss; the gradient a rank gets
for its inputs is the gradient, with respect to that rank's inputs, of the **sum over the ranks
of the ranks' losses** (torch's and JAX's convention). So after ``y = all_reduce(x)`` each
rank's gradient for ``x`` is the sum over ranks of the gradients arriving at ``y``.

The adjoints: ``all_reduce`` ``SUM`` ↔ ``SUM`` and ``AVG`` ↔ ``AVG``; ``broadcast`` ↔ ``reduce``
(``SUM``); ``all_gather`` ↔ ``reduce_scatter``; ``all_to_all`` ↔ ``all_to_all`` (transposed);
``all_to_all_single`` ↔ itself with the split sizes swapped; ``scatter`` ↔ ``gather``. ``MIN``
and ``MAX`` route the gradient to the rank(s) holding the extremum; ``k`` ranks tied share it
equally, ``1/k`` each (``ops.maximum``'s rule, 1/2 for two equal operands, for ``k`` ranks).
``PRODUCT`` and the bitwise reductions compute, but their gradient is refused with a
``RuntimeError`` when a backward pass reaches them (torch silently treats them as ``SUM``).

Decisions:

- A backward pass through a collective is a collective: the nodes are marked
  (:func:`~cupy_parallel._src.recording.mark_collective`), so each pass runs them with zero
  cotangents where no gradient arrived, and a rank whose loss ignores a collective's output
  still takes part in its backward. A node is recorded on **every** active tape, also where no
  input is tracked (the non-source ranks of a broadcast, a zero cotangent's collective under an
  outer tape): whether a rank records must not depend on its data, or ranks would disagree on
  which collectives a backward pass runs. What must hold across ranks: every rank of the group
  calls the collective under the same tapes and computes the same gradients
  (``Tape.gradient``) from them, as for any collective.
- ``reduce`` and ``gather`` return zeros on the ranks other than ``dst`` (torch's ``gather``
  does; torch leaves ``reduce``'s result there unspecified): the outputs are defined on every
  rank, and those zeros are constants, so their gradients are ignored.
- ``scatter`` takes ``inputs`` on every rank (as torch's): the other ranks' arrays give the
  output's shape and dtype; their values are not read and their gradient is zero. Likewise a
  ``broadcast``'s non-source inputs get a zero gradient.
- ``all_to_all`` returns arrays shaped as the other ranks' inputs: it first exchanges the
  shapes (``all_gather_object``); its backward knows them and skips that.
- Integer and ``bool`` arrays are communicated but never recorded (they have no gradient).
- A rank outside ``group`` gets ``ValueError`` (the in-place collectives warn and do nothing;
  a differentiable collective has an output to return).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arguments import read_int, read_sequence
from cupy_parallel._src.arrays import device_of, empty, is_array
from cupy_parallel._src.compute import compute, cuda_device, on_device_of, run_kernel, zeros_like
from cupy_parallel._src.distributed import exchanges, reductions, rooted
from cupy_parallel._src.distributed.dispatch import (
    backend_of,
    check_data,
    check_like,
    check_reduction,
    check_same_device,
)
from cupy_parallel._src.distributed.groups import resolve_group
from cupy_parallel._src.distributed.objects import all_gather_object
from cupy_parallel._src.elementwise import multiply
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.recording import (
    active_tapes,
    append_node,
    mark_collective,
    record,
    tapes_tracking,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.recording import Vjp

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]

Args = tuple[Any, ...]
Needs = tuple[bool, ...]


# --------------------------------------------------------------------------------------------
# Checks, buffers and recording


def _member(group: Any, name: str) -> tuple[ProcessGroup, ProcessGroupBackend]:
    """The group ``group`` names and its backend; ``ValueError`` on a rank outside it."""
    pg = resolve_group(group)
    resolved = None if pg is None else backend_of(pg, name)  # raises a failed group's error
    if resolved is None:
        raise ValueError(
            f"nn.functional.{name}: this rank is not a member of group (got "
            "GroupMember.NON_GROUP_MEMBER); a differentiable collective returns a result, so "
            "call it on the group's members only."
        )
    return resolved


def _contiguous_copy(x: Any) -> Any:
    return x.copy(order="C")


def _copy(x: Any) -> Any:
    """A C-contiguous copy of ``x`` on its device: the buffer a collective works on."""
    return compute(_contiguous_copy, x)


def _dtype(x: Any, name: str) -> Any:
    """``x``'s dtype, ``TypeError`` naming ``name`` when ``x`` is no array."""
    if not is_array(x):
        raise TypeError(
            f"{name} must be an array (numpy.ndarray, HostArray or cupy.ndarray), "
            f"got {type(x).__name__}."
        )
    return x.dtype


def _input(backend: ProcessGroupBackend, x: Any, name: str) -> Any:
    """``x`` checked (an array this backend communicates) and copied into a new buffer."""
    _dtype(x, name)
    buffer = _copy(x)
    check_data(backend, buffer, name)
    return buffer


def _inputs(
    backend: ProcessGroupBackend, xs: Any, name: str, count: int, *, same_shape: bool = True
) -> list[Any]:
    """``count`` arrays (one per group member) of one dtype (and shape), copied (:func:`_input`)."""
    listed = read_sequence(xs, name, expected="a list of arrays (one per group member)")
    if len(listed) != count:
        raise ValueError(
            f"{name} must hold {count} arrays (one per group member), got {len(listed)}."
        )
    copies = [_input(backend, x, f"{name}[{i}]") for i, x in enumerate(listed)]
    for i, x in enumerate(copies):
        check_like(x, copies[0], f"{name}[{i}]", f"{name}[0]", shape=same_shape)
    check_same_device(copies, copies[0], name, f"{name}[0]")
    return copies


def _zeros_kernel(xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    return xp.zeros(shape, dtype)


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of ``shape`` with ``like``'s dtype, on its device."""
    return run_kernel(_zeros_kernel, like, shape=shape, dtype=like.dtype)


def _record(vjp: Vjp, inputs: Args, outputs: Args, aux: Any) -> None:
    """Record a collective on every active tape (see the module's decisions).

    The tapes tracking an input record it as any op; the others with no input needing a
    gradient, so that every rank's backward pass runs the collective. Arrays of a dtype with no
    gradient (integers, ``bool``) are not recorded.
    """
    tapes = active_tapes()
    if not tapes or outputs[0].dtype.kind not in "fc":
        return
    recorded = {id(tape) for tape, _ in tapes_tracking(inputs)}
    record(vjp, inputs, outputs, aux)
    untracked = (False,) * len(inputs)
    cuda = cuda_device(outputs[0])
    for tape in tapes:
        if id(tape) not in recorded:
            append_node(tape, (vjp, inputs, untracked, outputs, aux, cuda), outputs)


def _refused(name: str, op: ReduceOp) -> RuntimeError:
    """The error for a reduction with no gradient, raised when a backward pass reaches it."""
    return RuntimeError(
        f"nn.functional.{name} with ReduceOp.{op.name} has no gradient here: only SUM, AVG, "
        "MIN and MAX are differentiable (torch would silently differentiate it as SUM). For a "
        "product, all_gather the arrays and multiply them with cupy_parallel.ops; compute "
        "bitwise reductions outside the tape (Tape.stop_recording)."
    )


_DIFFERENTIABLE = frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX})


def _refused_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    """The vjp of a reduction with no gradient: raises on every rank if any rank's gradient came.

    Given ``None`` where no gradient reached the output (``mark_collective(zeros=False)``):
    an output the loss does not use (kept for logging) is never differentiated (torch never
    visits it), and one that some rank's loss uses raises on every rank (the ranks tell one
    another, so none goes on alone into the backward collectives that follow).
    """
    name, op, pg = aux
    flag = empty((1,), ys[0].dtype, device_of(ys[0]))
    on_device_of(flag, flag.fill, any(g is not None for g in gs))
    reductions.all_reduce(flag, ReduceOp.MAX, pg)
    if float(flag[0]):
        raise _refused(name, op)
    return (None,) * len(xs)


def _mask_kernel(xp: Any, x: Any, extremum: Any, *, largest: bool, dtype: Any) -> Any:
    """1 where ``x`` holds the extremum (ties and NaN included), else 0, as ``dtype``."""
    return (~(x < extremum) if largest else ~(extremum < x)).astype(dtype)


def _divide_kernel(xp: Any, a: Any, b: Any) -> Any:
    return a / b


def _extremum_weights(
    xs: Sequence[Any], extrema: Sequence[Any], op: ReduceOp, pg: Any
) -> list[Any]:
    """Each rank's share of an extremum's gradient, ``mask / (ranks tied)``: constants.

    ``xs[i]`` is this rank's contribution to the extremum ``extrema[i]`` (known on this rank).
    The masks are summed over the group (one ``all_reduce_coalesced``) to count the ranks tied.
    """
    largest = op is ReduceOp.MAX
    masks = [
        run_kernel(_mask_kernel, x, x, e, largest=largest, dtype=x.dtype)
        for x, e in zip(xs, extrema, strict=True)
    ]
    counts = [_copy(m) for m in masks]
    reductions.all_reduce_coalesced(counts, ReduceOp.SUM, pg)
    return [run_kernel(_divide_kernel, m, m, c) for m, c in zip(masks, counts, strict=True)]


# --------------------------------------------------------------------------------------------
# all_reduce


def all_reduce(x: Array, /, op: ReduceOp = ReduceOp.SUM, group: Any = None) -> Array:
    """The reduction of ``x`` over the group, on every rank: a new array, recorded.

    Its gradient is the ``SUM`` (for ``AVG`` the average) over the ranks of the gradients
    arriving at the result; ``MIN``/``MAX`` send it to the rank(s) holding the extremum.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")  # a world of one here; start N with mpiexec -n N
        >>> x = np.array([1.0, 2.0])
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(x)
        ...     y = F.all_reduce(x)
        ...     loss = cupy_parallel.ops.sum(cupy_parallel.ops.square(y))
        >>> y, tape.gradient(loss, x)
        (array([1., 2.]), array([2., 4.]))
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "all_reduce")
    check_reduction(backend, _dtype(x, "x"), op)
    y = _input(backend, x, "x")
    reductions.all_reduce(y, op, pg)
    if op in _DIFFERENTIABLE:
        _record(_all_reduce_vjp, (x,), (y,), (op, pg))
    else:
        _record(_refused_vjp, (x,), (y,), ("all_reduce", op, pg))
    return y


def _all_reduce_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    op, pg = aux
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        return (all_reduce(gs[0], op, pg),)
    (weights,) = _extremum_weights(xs, ys, op, pg)
    return (multiply(all_reduce(gs[0], ReduceOp.SUM, pg), weights),)


# --------------------------------------------------------------------------------------------
# broadcast and reduce


def broadcast(x: Array, /, src: int, group: Any = None) -> Array:
    """World rank ``src``'s ``x`` on every rank of the group: a new array, recorded.

    Every rank passes an array of the same shape and dtype. ``src`` gets the sum over ranks of
    the gradients arriving at the result (a ``reduce``); the other ranks' ``x`` is not read and
    gets a zero gradient.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.broadcast(np.array([3.0, 4.0]), src=0)
        array([3., 4.])
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "broadcast")
    pg.group_rank(src, "src")
    y = _input(backend, x, "x")
    rooted.broadcast(y, src, pg)
    _record(_broadcast_vjp, (x,), (y,), (src, pg))
    return y


def _broadcast_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    src, pg = aux
    return (reduce(gs[0], src, ReduceOp.SUM, pg),)


def reduce(x: Array, /, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None) -> Array:
    """The reduction of ``x`` over the group on world rank ``dst``, zeros elsewhere (new arrays).

    Every rank's gradient is ``dst``'s gradient for the result (a ``broadcast``; divided by
    the group's size for ``AVG``; for ``MIN``/``MAX`` only to the rank(s) holding the
    extremum). The zeros of the other ranks are constants: gradients reaching them are dropped.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.reduce(np.array([3.0, 4.0]), dst=0, op=dist.ReduceOp.MAX)
        array([3., 4.])
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "reduce")
    check_reduction(backend, _dtype(x, "x"), op)
    root = pg.group_rank(dst, "dst")
    y = _input(backend, x, "x")
    rooted.reduce(y, dst, op, pg)
    if pg.rank() != root:
        y = zeros_like(y)
    if op in _DIFFERENTIABLE:
        _record(_reduce_vjp, (x,), (y,), (dst, op, pg))
    else:
        _record(_refused_vjp, (x,), (y,), ("reduce", op, pg))
    return y


def _reduce_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    dst, op, pg = aux
    g = broadcast(gs[0], dst, pg)
    if op is ReduceOp.SUM:
        return (g,)
    if op is ReduceOp.AVG:
        return (multiply(g, 1.0 / pg.size()),)
    extremum = _copy(ys[0])  # known on dst only
    rooted.broadcast(extremum, dst, pg)
    (weights,) = _extremum_weights(xs, [extremum], op, pg)
    return (multiply(g, weights),)


# --------------------------------------------------------------------------------------------
# all_gather and reduce_scatter


def all_gather(x: Array, /, group: Any = None) -> tuple[Array, ...]:
    """Every rank's ``x`` (same shape and dtype on every rank), in group-rank order: a tuple.

    Each rank's gradient is the sum over ranks of the gradients arriving at its entry of the
    tuples (a ``reduce_scatter``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.all_gather(np.array([1.0, 2.0]))
        (array([1., 2.]),)
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "all_gather")
    send = _input(backend, x, "x")
    outputs = tuple(zeros_like(send) for _ in range(pg.size()))
    exchanges.all_gather(outputs, send, pg)
    _record(_all_gather_vjp, (x,), outputs, pg)
    return outputs


def _all_gather_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, pg: Any) -> Args:
    return (reduce_scatter(gs, ReduceOp.SUM, pg),)


def reduce_scatter(
    inputs: Sequence[Array], /, op: ReduceOp = ReduceOp.SUM, group: Any = None
) -> Array:
    """Group rank ``r`` gets the reduction over the group of every rank's ``inputs[r]``.

    ``inputs`` holds one array per group member, all of one shape and dtype. The gradient of
    ``inputs[r]`` is group rank ``r``'s gradient for its result (an ``all_gather``; divided by
    the group's size for ``AVG``; for ``MIN``/``MAX`` only where the rank holds the extremum).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.reduce_scatter([np.array([1.0, 2.0])])
        array([1., 2.])
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "reduce_scatter")
    sends = _inputs(backend, inputs, "inputs", pg.size())
    check_reduction(backend, sends[0].dtype, op)
    y = zeros_like(sends[0])
    reductions.reduce_scatter(y, sends, op, pg)
    if op in _DIFFERENTIABLE:
        _record(_reduce_scatter_vjp, tuple(inputs), (y,), (op, pg))
    else:
        _record(_refused_vjp, tuple(inputs), (y,), ("reduce_scatter", op, pg))
    return y


def _reduce_scatter_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    op, pg = aux
    gathered = all_gather(gs[0], pg)
    if op is ReduceOp.SUM:
        return gathered
    if op is ReduceOp.AVG:
        return tuple(multiply(g, 1.0 / pg.size()) for g in gathered)
    extrema = [zeros_like(ys[0]) for _ in xs]
    exchanges.all_gather(extrema, _copy(ys[0]), pg)
    weights = _extremum_weights(xs, extrema, op, pg)
    return tuple(multiply(g, w) for g, w in zip(gathered, weights, strict=True))


# --------------------------------------------------------------------------------------------
# all_to_all and all_to_all_single


def all_to_all(inputs: Sequence[Array], /, group: Any = None) -> tuple[Array, ...]:
    """Group rank ``r`` sends ``inputs[q]`` to rank ``q``; entry ``r`` of the tuple is rank r's.

    ``inputs`` holds one array per group member, all of one dtype; their shapes may differ
    (each output has the shape of the array sent to it: the ranks first exchange the shapes).
    The gradient of ``inputs[q]`` is rank ``q``'s gradient for its entry ``r`` (the transposed
    ``all_to_all``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.all_to_all([np.array([1.0, 2.0, 3.0])])
        (array([1., 2., 3.]),)
        >>> dist.destroy_process_group()
    """
    return _all_to_all(inputs, group, None)


def _all_to_all(inputs: Any, group: Any, shapes: list[tuple[int, ...]] | None) -> Any:
    """``all_to_all``, the outputs shaped ``shapes`` (exchanged first when ``None``)."""
    pg, backend = _member(group, "all_to_all")
    size = pg.size()
    sends = _inputs(backend, inputs, "inputs", size, same_shape=False)
    if shapes is None:
        table: list[Any] = [None] * size
        on_device_of(sends[0], all_gather_object, table, [s.shape for s in sends], pg)
        shapes = [tuple(table[j][pg.rank()]) for j in range(size)]
    outputs = tuple(_zeros(sends[0], shape) for shape in shapes)
    exchanges.all_to_all(list(outputs), sends, pg)
    _record(_all_to_all_vjp, tuple(inputs), outputs, pg)
    return outputs


def _all_to_all_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, pg: Any) -> Args:
    return _all_to_all(gs, pg, [x.shape for x in xs])


def all_to_all_single(
    x: Array,
    /,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
) -> Array:
    """``all_to_all`` of one array split along dimension 0: a new array, recorded.

    Group rank ``r`` sends rows ``input_split_sizes[q]`` of ``x`` (in order) to rank ``q`` and
    receives rank ``q``'s rows for it at rows ``output_split_sizes[q]`` of the result, which has
    ``sum(output_split_sizes)`` rows (``x``'s number of rows when ``None``; ``None`` splits
    equally). Its gradient is the same exchange with the split sizes swapped.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.all_to_all_single(np.array([1.0, 2.0]), [2], [2])
        array([1., 2.])
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "all_to_all_single")
    send = _input(backend, x, "x")
    outs = _split_sizes(output_split_sizes, "output_split_sizes")
    ins = _split_sizes(input_split_sizes, "input_split_sizes")
    if send.ndim == 0:
        raise ValueError("x must have at least one dimension (split along dimension 0), got 0-d.")
    rows = send.shape[0] if outs is None else sum(outs)
    y = _zeros(send, (rows, *send.shape[1:]))
    exchanges.all_to_all_single(y, send, outs, ins, pg)
    _record(_all_to_all_single_vjp, (x,), (y,), (outs, ins, pg))
    return y


def _split_sizes(sizes: Any, name: str) -> list[int] | None:
    """``None`` (equal splits) or a list of non-negative ints (checked against the group later)."""
    if sizes is None:
        return None
    listed = read_sequence(sizes, name, expected="a list of ints (one per group member) or None")
    return [read_int(n, f"each of {name}", minimum=0) for n in listed] or None


def _all_to_all_single_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    outs, ins, pg = aux
    if ins is None:  # x's rows went out in equal splits: as many come back, not y's rows
        ins = [xs[0].shape[0] // pg.size()] * pg.size()
    return (all_to_all_single(gs[0], ins, outs, pg),)


# --------------------------------------------------------------------------------------------
# gather and scatter


def gather(x: Array, /, dst: int, group: Any = None) -> tuple[Array, ...]:
    """Every rank's ``x`` on world rank ``dst`` (a tuple in group-rank order); zeros elsewhere.

    Every rank passes an array of the same shape and dtype, and gets a tuple of one array per
    member. Each rank's gradient is ``dst``'s gradient for its entry (a ``scatter``); the
    other ranks' zeros are constants.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.gather(np.array([1.0, 2.0]), dst=0)
        (array([1., 2.]),)
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "gather")
    root = pg.group_rank(dst, "dst")
    send = _input(backend, x, "x")
    outputs = tuple(zeros_like(send) for _ in range(pg.size()))
    rooted.gather(send, list(outputs) if pg.rank() == root else None, dst, pg)
    _record(_gather_vjp, (x,), outputs, (dst, pg))
    return outputs


def _gather_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    dst, pg = aux
    return (scatter(gs, dst, pg),)


def scatter(inputs: Sequence[Array], /, src: int, group: Any = None) -> Array:
    """Group rank ``r`` gets world rank ``src``'s ``inputs[r]``: a new array, recorded.

    Every rank passes ``inputs`` (one array per member, all of one shape and dtype): on ``src``
    the data, elsewhere their shape and dtype only (torch's rule). ``src``'s ``inputs[r]`` gets
    rank ``r``'s gradient for its result (a ``gather``); the other ranks' inputs get zeros.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.nn import functional as F
        >>> dist.init_process_group("mpi")
        >>> F.scatter([np.array([7.0, 8.0])], src=0)
        array([7., 8.])
        >>> dist.destroy_process_group()
    """
    pg, backend = _member(group, "scatter")
    root = pg.group_rank(src, "src")
    sends = _inputs(backend, inputs, "inputs", pg.size())
    y = zeros_like(sends[pg.rank()])
    rooted.scatter(y, sends if pg.rank() == root else None, src, pg)
    _record(_scatter_vjp, tuple(inputs), (y,), (src, pg))
    return y


def _scatter_vjp(gs: list[Any], xs: Args, needs: Needs, ys: Args, aux: Any) -> Args:
    src, pg = aux
    return gather(gs[0], src, pg)


for _vjp in (
    _all_reduce_vjp,
    _broadcast_vjp,
    _reduce_vjp,
    _all_gather_vjp,
    _reduce_scatter_vjp,
    _all_to_all_vjp,
    _all_to_all_single_vjp,
    _gather_vjp,
    _scatter_vjp,
):
    mark_collective(_vjp)
mark_collective(_refused_vjp, zeros=False)
