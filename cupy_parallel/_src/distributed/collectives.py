"""Collectives and point-to-point calls of the process-group API, as torch.distributed names them.

Every collective is one :func:`_run` call (mpi4py's ``pkl5`` one-liners over one helper are the
model): the runner resolves the group (``None`` means the world; on a non-member the call returns
``None`` at once), lets the collective's ``prepare`` check the arguments in the caller's words
(:func:`_array`, :func:`_arrays`, ``pg.group_rank``, :func:`_reduction`) and name the backend
primitive with its arguments, reads ``async_op``, compares the ranks' arguments in the debug
mode, starts the primitive and waits on the returned :class:`~cupy_parallel.distributed.Work`
unless ``async_op=True``.

Arrays are updated in place, as in torch: ``all_reduce(x)`` leaves the result in ``x``. Arrays must
be C-contiguous (a strided view cannot be a communication buffer; pass ``numpy.ascontiguousarray``).
All arrays of one call live on one device, except the ``*_multigpu`` forms, whose lists hold one
array per local device. ``src``/``dst`` are world ranks, as in torch, also for subgroups; ranks,
tags and indices may be Python or NumPy integers.

Debug mode: with ``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL`` in the environment when a group is
made (torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), every collective first has the ranks compare
what they must agree on (the operation, shapes, dtypes, the reduction and the root); a mismatch
raises ``ValueError`` on every rank, naming the ranks that differ and what each passed, before any
data moves. Off by default: it costs one small extra exchange per collective (see
``benchmarks/bench_collectives.py``). MPI compares on a control communicator, NCCL through
the store.

Types: every function taking ``async_op`` has ``typing.overload``s, so a type checker knows that
the default call returns ``None``, ``async_op=True`` (by keyword or position) a :class:`Work`, and
a ``bool`` only known at run time ``Work | None``; arrays are :data:`cupy_parallel.Array` and
lists of them any ``Sequence`` (the arrays are written in place, never the list).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_int, read_timeout
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.distributed.backend import disagreeing, per_rank
from cupy_parallel._src.distributed.groups import resolve_group
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.hostarray import HostArray

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.arraytypes import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = [
    "P2POp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_multigpu",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_multigpu",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_multigpu",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

_KIND_OF_TYPE: dict[type, str] = {np.ndarray: "cpu", HostArray: "host"}


# ---------------------------------------------------------------------------------------------
# The runner


@dataclasses.dataclass(slots=True)
class _Call:
    """What a collective starts: ``primitive(*args)``; every rank must pass ``agree`` alike.

    ``outputs``: the arrays it writes (``Work.get_future()``'s result); default ``args[0]``.
    (A slotted dataclass: made once per call, it costs a third of a ``NamedTuple``.)
    """

    primitive: Callable[..., Work]
    args: tuple[Any, ...]
    agree: tuple[Any, ...]
    outputs: Any = None


def _run(
    name: str,
    group: Any,
    async_op: Any,
    prepare: Callable[[ProcessGroup, ProcessGroupBackend], _Call],
) -> Work | None:
    """Resolve ``group``, check and start ``prepare``'s call, wait on it unless ``async_op``."""
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    call = prepare(pg, backend)
    asynchronous = async_op if async_op is False else read_bool(async_op, "async_op")
    if backend.detail:
        _compare(pg, backend, name, call.agree)
    work = call.primitive(*call.args)
    if asynchronous:
        outputs = call.args[0] if call.outputs is None and call.args else call.outputs
        work.outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
        return work
    work.wait()
    return None


def _describe(value: Any) -> Any:
    """What the debug mode compares of one argument: arrays by shape and dtype."""
    if isinstance(value, list | tuple):
        return [_describe(v) for v in value]
    if isinstance(value, ReduceOp):
        return f"ReduceOp.{value.name}"
    if value is None or isinstance(value, int | str):
        return value
    dtype = value.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)  # NumPy's dtype.__str__ is slow: once per dtype
    return f"{name}{list(value.shape)}"


_DTYPE_NAMES: dict[Any, str] = {}


def _compare(
    pg: ProcessGroup, backend: ProcessGroupBackend, name: str, agree: tuple[Any, ...]
) -> None:
    mine = repr((name, _describe(agree)))
    records = backend.agree(mine.encode())
    if records is None:
        return
    seen = [record.decode() for record in records]
    if all(record == mine for record in seen):
        return
    passed = per_rank(seen, pg.ranks)
    raise ValueError(
        f"{name}: {disagreeing(seen, pg.ranks)} of process group {pg.name!r} in the arguments "
        "they passed (the operation, shapes, dtypes, reduction and root must agree). Each "
        f"passed (operation, arguments): {passed}."
    )


# ---------------------------------------------------------------------------------------------
# The checks, once


def _backend_of(group: Any) -> tuple[ProcessGroup, ProcessGroupBackend] | None:
    pg = resolve_group(group)
    if pg is None:
        return None
    backend = pg.live_backend()
    if backend.failure is not None:
        raise RuntimeError(
            f"process group {pg.name!r} is unusable: {backend.failure} "
            "Destroy it and create a new group (or restart the job)."
        )
    return pg, backend


def _array(backend: ProcessGroupBackend, x: Any, name: str, *, output: bool = True) -> str:
    """Check one communicated array; return its device kind."""
    kind = _KIND_OF_TYPE.get(type(x))
    if kind is None:
        if not is_array(x):
            raise TypeError(
                f"{name} must be an array (numpy.ndarray, HostArray or cupy.ndarray), "
                f"got {type(x).__name__}."
            )
        kind = device_of(x).kind
    if kind not in backend.array_kinds:
        raise TypeError(
            f"{name} is a {type(x).__name__} on {device_of(x)}, which the "
            f"{backend.backend.value!r} backend cannot communicate (it takes arrays on "
            f"{sorted(backend.array_kinds)} devices); move it with cupy_parallel.to_device."
        )
    flags = x.flags
    if not flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous to serve as a communication buffer, got strides "
            f"{x.strides} for shape {x.shape}; pass numpy/cupy.ascontiguousarray({name}) and "
            "copy the result back."
        )
    if output and not getattr(flags, "writeable", True):
        raise ValueError(f"{name} receives data in place but is read-only; pass a writable array.")
    return kind


def _like(x: Any, ref: Any, name: str, ref_name: str, *, shape: bool = True) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}; every array of the call "
            "must share one dtype."
        )
    if shape and x.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {x.shape} but {ref_name} has {ref.shape}; every array of the "
            "call must have the same shape."
        )


def _arrays(
    backend: ProcessGroupBackend,
    xs: Any,
    name: str,
    *,
    length: int | None = None,
    like: Any = None,
    like_name: str = "",
    same_shape: bool = True,
    output: bool = True,
) -> Sequence[Any]:
    """Check a list of arrays: its type, length, each array, and dtype (shape) against ``like``."""
    if not isinstance(xs, list | tuple):
        raise TypeError(f"{name} must be a list of arrays, got {type(xs).__name__}.")
    if length is not None and len(xs) != length:
        raise ValueError(f"{name} must hold {length} arrays, got {len(xs)}.")
    if not xs:
        raise ValueError(f"{name} must hold at least one array, got an empty list.")
    for index, x in enumerate(xs):
        _array(backend, x, f"{name}[{index}]", output=output)
        if like is not None:
            _like(x, like, f"{name}[{index}]", like_name, shape=same_shape)
    return xs


def _same_device(xs: Sequence[Any], ref: Any, name: str, ref_name: str) -> None:
    device = device_of(ref)
    for index, x in enumerate(xs):
        if device_of(x) != device:
            raise ValueError(
                f"{name}[{index}] is on {device_of(x)} but {ref_name} is on {device}; "
                "every array of the call must live on one device."
            )


def _distinct_devices(xs: Sequence[Any], name: str) -> None:
    seen = [device_of(x) for x in xs]
    if len(set(seen)) != len(seen):
        raise ValueError(
            f"{name} must hold one array per local device (each on a different device), got "
            f"devices {[str(d) for d in seen]}."
        )


def _reduction(backend: ProcessGroupBackend, dtype: Any, op: Any) -> None:
    if type(op) is not ReduceOp:
        raise TypeError(
            f"op must be a ReduceOp ({', '.join(o.name for o in ReduceOp)}), got "
            f"{type(op).__name__} {op!r}."
        )
    if op not in backend.reduce_ops:
        raise NotImplementedError(
            f"ReduceOp.{op.name} is not available with the {backend.backend.value!r} backend "
            f"(it has {', '.join(sorted(o.name for o in backend.reduce_ops))})."
        )
    backend.check_dtype(dtype, op)


def _index(value: Any, length: int, name: str) -> int:
    value = read_int(value, name)
    if not 0 <= value < length:
        raise ValueError(f"{name} must be in [0, {length}) (the list's length), got {value}.")
    return value


def _given(xs: Any) -> bool:
    """Whether an optional list argument was given (``None`` and ``[]`` mean not, as in torch)."""
    return xs is not None and not (isinstance(xs, list | tuple) and len(xs) == 0)


def _tag(backend: ProcessGroupBackend, tag: Any) -> int:
    tag = read_int(tag, "tag", minimum=0)
    if tag > backend.max_tag:
        raise ValueError(
            f"tag must be at most {backend.max_tag} (the largest tag the "
            f"{backend.backend.value!r} backend carries), got {tag}."
        )
    return tag


def _data(backend: ProcessGroupBackend, x: Any, name: str, *, output: bool = True) -> None:
    """Check an array that is moved (not reduced): the array, then its dtype."""
    _array(backend, x, name, output=output)
    backend.check_dtype(x.dtype, None)


def _member_list(
    backend: ProcessGroupBackend,
    xs: Any,
    name: str,
    like: Any,
    like_name: str,
    *,
    length: int,
    output: bool = True,
    on: tuple[Any, str] | None = None,
) -> Sequence[Any]:
    """``length`` arrays shaped and typed as ``like``, on its device (or on ``on``'s array's)."""
    _arrays(backend, xs, name, length=length, like=like, like_name=like_name, output=output)
    ref, ref_name = on or (like, like_name)
    _same_device(xs, ref, name, ref_name)
    return xs


def _lists(
    backend: ProcessGroupBackend,
    lists: Any,
    name: str,
    *,
    length: int,
    inner: Callable[[int, Any, str], None],
) -> Sequence[Sequence[Any]]:
    """A list of ``length`` lists of arrays; ``inner(i, lists[i], "name[i]")`` checks each."""
    if not isinstance(lists, list | tuple):
        raise TypeError(f"{name} must be a list of lists of arrays, got {type(lists).__name__}.")
    if len(lists) != length:
        raise ValueError(f"{name} must hold {length} lists, got {len(lists)}.")
    for i, xs in enumerate(lists):
        inner(i, xs, f"{name}[{i}]")
    return lists


# The argument naming a root rank -> how messages call that rank, and whether its list receives.
_ROOT_ROLES: dict[str, tuple[str, bool]] = {"dst": ("destination", True), "src": ("source", False)}


def _rooted(
    pg: ProcessGroup,
    backend: ProcessGroupBackend,
    tensor: Any,
    xs: Any,
    name: str,
    *,
    rank: Any,
    rank_name: str,
) -> tuple[int, Sequence[Any] | None]:
    """The group rank of root ``rank`` and the list ``name`` (``gather_list``/``scatter_list``).

    The list is required on the root (one array per member, like ``tensor``) and must be ``None``
    (or empty) elsewhere, where ``None`` is returned for it.
    """
    root = pg.group_rank(rank, rank_name)
    role, receives = _ROOT_ROLES[rank_name]
    if root != backend.rank:
        if _given(xs):
            raise ValueError(
                f"{name} must be None on ranks other than the {role} {rank}; "
                f"this is rank {pg.ranks[backend.rank]}."
            )
        return root, None
    if not _given(xs):
        raise ValueError(
            f"{name} must be given on the {role} rank {rank}: a list of "
            f"{pg.size()} arrays shaped like tensor."
        )
    return root, _member_list(
        backend, xs, name, tensor, "tensor", length=pg.size(), output=receives
    )


def _per_device_lists(
    pg: ProcessGroup,
    backend: ProcessGroupBackend,
    lists: Any,
    name: str,
    *,
    per_device: Sequence[Any],
    per_device_name: str,
    output: bool,
) -> None:
    """``lists[i]``: ``size * L`` arrays like ``per_device[0]`` on the device of ``per_device[i]``.

    The list-of-lists argument of the ``*_multigpu`` gathers and scatters, ``L = len(per_device)``.
    """
    local = len(per_device)
    first = f"{per_device_name}[0]"

    def inner(i: int, xs: Any, item: str) -> None:
        on = (per_device[i], f"{per_device_name}[{i}]")
        count = pg.size() * local
        _member_list(backend, xs, item, per_device[0], first, length=count, output=output, on=on)

    _lists(backend, lists, name, length=local, inner=inner)


def _device_list(backend: ProcessGroupBackend, xs: Any, name: str, *, output: bool = True) -> Any:
    _arrays(backend, xs, name, output=output)
    for index, x in enumerate(xs[1:], start=1):
        _like(x, xs[0], f"{name}[{index}]", f"{name}[0]")
    _distinct_devices(xs, name)
    return xs


def _chunks(x: Any, count: int, name: str, like: Any, like_name: str) -> list[Any]:
    """``x`` (shape ``(count * n, ...)`` or ``(count, n, ...)``) as ``count`` views like ``like``.

    PyTorch 2's ``*_tensor`` collectives accept both: chunks concatenated along dimension 0 or
    stacked along a new one.
    """
    _like(x, like, name, like_name, shape=False)
    shape = like.shape
    stacked = (count, *shape)
    concatenated = (count * shape[0], *shape[1:]) if shape else None
    if x.shape not in (stacked, concatenated):
        expected = f"{stacked}" + (f" or {concatenated}" if concatenated else "")
        raise ValueError(
            f"{name} must have shape {expected} ({count} chunks shaped as {like_name}, "
            f"{shape}), got {x.shape}."
        )
    views = x.reshape(stacked)
    return [views[r] for r in range(count)]


# ---------------------------------------------------------------------------------------------
# One array per process


@overload
def broadcast(
    tensor: Array, src: int, group: ProcessGroup | None = None, async_op: Literal[False] = False
) -> None: ...
@overload
def broadcast(
    tensor: Array, src: int, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def broadcast(
    tensor: Array, src: int, group: ProcessGroup | None = None, *, async_op: Literal[True]
) -> Work: ...
@overload
def broadcast(
    tensor: Array, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None: ...
def broadcast(
    tensor: Array, src: int, group: ProcessGroup | None = None, async_op: bool = False
) -> Work | None:
    """Copy ``tensor`` of world rank ``src`` into ``tensor`` of every rank of the group.

    Every rank must name the same ``src`` and pass an array of the same dtype and shape. The
    ``"mpi"`` backend checks both (so do ``reduce``, ``gather`` and ``scatter``): ranks that
    disagree get ``ValueError``, on every rank, instead of MPI's silent overwrite or partly
    filled array. ``"nccl"`` compares them only in the debug mode
    (``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL``); the simulated NCCL reports a differing root,
    element count or dtype always (NCCL itself sees no shapes).

    Args:
        tensor: Data to send on ``src``, buffer receiving it (in place) elsewhere.
        src: World rank of the sender.
        group: The process group (default: the world).
        async_op: Return a :class:`Work` instead of waiting.

    Returns:
        A :class:`Work` if ``async_op``, else ``None`` (also on non-members of ``group``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")  # a world of one here; start N with mpiexec -n N
        >>> x = np.arange(3)
        >>> dist.broadcast(x, src=0)
        >>> x
        array([0, 1, 2])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _data(backend, tensor, "tensor")
        root = pg.group_rank(src, "src")
        return _Call(backend.broadcast, ([tensor], root, 0), (root, tensor))

    return _run("broadcast", group, async_op, prepare)


@overload
def all_reduce(
    tensor: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_reduce(
    tensor: Array, op: ReduceOp, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def all_reduce(
    tensor: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_reduce(
    tensor: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_reduce(
    tensor: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` over the group; every rank gets the result in ``tensor`` (in place).

    See :class:`ReduceOp` for what each reduction does per dtype (``AVG`` of integers rounds
    toward zero). ``float16``: the ``"mpi"`` backend reduces in ``float32`` and rounds once;
    ``"nccl"`` reduces in ``float16`` itself (NCCL's kernels), so error grows with the ranks.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> x = np.array([1.0, 2.0])
        >>> dist.all_reduce(x, op=dist.ReduceOp.MAX)
        >>> x * dist.get_world_size()
        array([1., 2.])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _array(backend, tensor, "tensor")
        _reduction(backend, tensor.dtype, op)
        return _Call(backend.all_reduce, ([tensor], op), (op, tensor))

    return _run("all_reduce", group, async_op, prepare)


@overload
def reduce(
    tensor: Array,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def reduce(
    tensor: Array, dst: int, op: ReduceOp, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def reduce(
    tensor: Array,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def reduce(
    tensor: Array,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def reduce(
    tensor: Array,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` over the group into ``tensor`` of world rank ``dst``.

    Other ranks' ``tensor`` keeps its values (torch leaves it unspecified; MPI leaves it alone).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> x = np.array([3, 4])
        >>> dist.reduce(x, dst=0, op=dist.ReduceOp.PRODUCT)
        >>> x
        array([3, 4])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _array(backend, tensor, "tensor")
        _reduction(backend, tensor.dtype, op)
        root = pg.group_rank(dst, "dst")
        return _Call(backend.reduce, ([tensor], root, 0, op), (root, op, tensor))

    return _run("reduce", group, async_op, prepare)


@overload
def all_gather(
    tensor_list: Sequence[Array],
    tensor: Array,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_gather(
    tensor_list: Sequence[Array], tensor: Array, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def all_gather(
    tensor_list: Sequence[Array],
    tensor: Array,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_gather(
    tensor_list: Sequence[Array],
    tensor: Array,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_gather(
    tensor_list: Sequence[Array],
    tensor: Array,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Every rank receives each rank's ``tensor``: ``tensor_list[r]`` gets group rank ``r``'s.

    ``tensor_list`` holds one array per group member, shaped and typed as ``tensor`` and on its
    device.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [np.zeros(2, int)]
        >>> dist.all_gather(out, np.array([5, 6]))
        >>> out
        [array([5, 6])]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _data(backend, tensor, "tensor", output=False)
        _member_list(backend, tensor_list, "tensor_list", tensor, "tensor", length=pg.size())
        return _Call(backend.all_gather, ([tensor_list], [tensor]), (tensor,), tensor_list)

    return _run("all_gather", group, async_op, prepare)


@overload
def all_gather_into_tensor(
    output_tensor: Array,
    input_tensor: Array,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_gather_into_tensor(
    output_tensor: Array, input_tensor: Array, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def all_gather_into_tensor(
    output_tensor: Array,
    input_tensor: Array,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_gather_into_tensor(
    output_tensor: Array,
    input_tensor: Array,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_gather_into_tensor(
    output_tensor: Array,
    input_tensor: Array,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``all_gather`` into one array: chunk ``r`` of ``output_tensor`` gets group rank r's input.

    ``output_tensor`` has shape ``(world_size * n, ...)`` (chunks concatenated along dimension
    0) or ``(world_size, n, ...)`` (stacked) for an ``input_tensor`` of shape ``(n, ...)``;
    PyTorch 2's function. A 0-d input needs the stacked form ``(world_size,)``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = np.zeros(2)
        >>> dist.all_gather_into_tensor(out, np.array([1.0, 2.0]))
        >>> out
        array([1., 2.])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _data(backend, input_tensor, "input_tensor", output=False)
        _array(backend, output_tensor, "output_tensor")
        _same_device([output_tensor], input_tensor, "[output_tensor]", "input_tensor")
        size = pg.size()
        views = _chunks(output_tensor, size, "output_tensor", input_tensor, "input_tensor")
        args = ([views], [input_tensor])
        return _Call(backend.all_gather, args, (input_tensor,), [output_tensor])

    return _run("all_gather_into_tensor", group, async_op, prepare)


@overload
def gather(
    tensor: Array,
    gather_list: Sequence[Array] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def gather(
    tensor: Array,
    gather_list: Sequence[Array] | None,
    dst: int,
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def gather(
    tensor: Array,
    gather_list: Sequence[Array] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def gather(
    tensor: Array,
    gather_list: Sequence[Array] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def gather(
    tensor: Array,
    gather_list: Sequence[Array] | None = None,
    dst: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """World rank ``dst`` receives every rank's ``tensor``: ``gather_list[r]`` gets group rank r's.

    ``gather_list`` is required on ``dst`` (one array per member, shaped as ``tensor``) and must be
    ``None`` (or empty) elsewhere, as in torch.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [np.zeros(2)]
        >>> dist.gather(np.array([1.0, 2.0]), out, dst=0)
        >>> out
        [array([1., 2.])]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _data(backend, tensor, "tensor", output=False)
        root, outputs = _rooted(
            pg, backend, tensor, gather_list, "gather_list", rank=dst, rank_name="dst"
        )
        return _Call(backend.gather, (outputs, tensor, root), (root, tensor), outputs or [])

    return _run("gather", group, async_op, prepare)


@overload
def scatter(
    tensor: Array,
    scatter_list: Sequence[Array] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def scatter(
    tensor: Array,
    scatter_list: Sequence[Array] | None,
    src: int,
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def scatter(
    tensor: Array,
    scatter_list: Sequence[Array] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def scatter(
    tensor: Array,
    scatter_list: Sequence[Array] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def scatter(
    tensor: Array,
    scatter_list: Sequence[Array] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """World rank ``src`` sends ``scatter_list[r]`` into ``tensor`` of group rank ``r``.

    ``scatter_list`` is required on ``src`` (one array per member, shaped as ``tensor``) and must
    be ``None`` (or empty) elsewhere.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> x = np.zeros(2)
        >>> dist.scatter(x, [np.array([7.0, 8.0])], src=0)
        >>> x
        array([7., 8.])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _data(backend, tensor, "tensor")
        root, inputs = _rooted(
            pg, backend, tensor, scatter_list, "scatter_list", rank=src, rank_name="src"
        )
        return _Call(backend.scatter, (tensor, inputs, root), (root, tensor), [tensor])

    return _run("scatter", group, async_op, prepare)


@overload
def reduce_scatter(
    output: Array,
    input_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def reduce_scatter(
    output: Array,
    input_list: Sequence[Array],
    op: ReduceOp,
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def reduce_scatter(
    output: Array,
    input_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def reduce_scatter(
    output: Array,
    input_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def reduce_scatter(
    output: Array,
    input_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input_list[r]`` over the group into ``output`` of group rank ``r``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = np.zeros(2)
        >>> dist.reduce_scatter(out, [np.array([1.0, 2.0])])
        >>> out
        array([1., 2.])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _array(backend, output, "output")
        _reduction(backend, output.dtype, op)
        size = pg.size()
        _member_list(backend, input_list, "input_list", output, "output", length=size, output=False)
        return _Call(backend.reduce_scatter, ([output], [input_list], op), (op, output))

    return _run("reduce_scatter", group, async_op, prepare)


@overload
def reduce_scatter_tensor(
    output: Array,
    input: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def reduce_scatter_tensor(
    output: Array, input: Array, op: ReduceOp, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def reduce_scatter_tensor(
    output: Array,
    input: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def reduce_scatter_tensor(
    output: Array,
    input: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def reduce_scatter_tensor(
    output: Array,
    input: Array,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter`` from one array: group rank ``r`` gets the reduction of chunk ``r``.

    ``input`` has shape ``(world_size * n, ...)`` (chunks concatenated along dimension 0) or
    ``(world_size, n, ...)`` for an ``output`` of shape ``(n, ...)``; PyTorch 2's function.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = np.zeros(2)
        >>> dist.reduce_scatter_tensor(out, np.array([3.0, 4.0]))
        >>> out
        array([3., 4.])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _array(backend, output, "output")
        _reduction(backend, output.dtype, op)
        _array(backend, input, "input", output=False)
        _same_device([input], output, "[input]", "output")
        views = _chunks(input, pg.size(), "input", output, "output")
        return _Call(backend.reduce_scatter, ([output], [views], op), (op, output), [output])

    return _run("reduce_scatter_tensor", group, async_op, prepare)


@overload
def all_to_all(
    output_tensor_list: Sequence[Array],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_to_all(
    output_tensor_list: Sequence[Array],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_to_all(
    output_tensor_list: Sequence[Array],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_to_all(
    output_tensor_list: Sequence[Array],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_to_all(
    output_tensor_list: Sequence[Array],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Exchange one array with every rank: ``output_tensor_list[q]`` gets rank ``q``'s message.

    Group rank ``r`` sends ``input_tensor_list[q]`` to rank ``q``, into its
    ``output_tensor_list[r]``.
    One dtype and one device for all arrays. Sizes may differ between pairs of ranks (each pair
    must agree: ``output_tensor_list[r]`` of rank ``q`` is shaped as ``input_tensor_list[q]`` of
    rank ``r``); this is torch's list form of ``all_to_all``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [np.zeros(3)]
        >>> dist.all_to_all(out, [np.array([1.0, 2.0, 3.0])])
        >>> out
        [array([1., 2., 3.])]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        size = pg.size()
        inputs = _arrays(backend, input_tensor_list, "input_tensor_list", length=size, output=False)
        ref = inputs[0]
        backend.check_dtype(ref.dtype, None)
        for index, x in enumerate(inputs):
            _like(x, ref, f"input_tensor_list[{index}]", "input_tensor_list[0]", shape=False)
        outputs = _arrays(
            backend,
            output_tensor_list,
            "output_tensor_list",
            length=size,
            like=ref,
            like_name="input_tensor_list[0]",
            same_shape=False,
        )
        _same_device(inputs, ref, "input_tensor_list", "input_tensor_list[0]")
        _same_device(outputs, ref, "output_tensor_list", "input_tensor_list[0]")
        return _Call(backend.all_to_all, (outputs, inputs), (str(ref.dtype),))

    return _run("all_to_all", group, async_op, prepare)


@overload
def all_to_all_single(
    output: Array,
    input: Array,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_to_all_single(
    output: Array,
    input: Array,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_to_all_single(
    output: Array,
    input: Array,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_to_all_single(
    output: Array,
    input: Array,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_to_all_single(  # noqa: PLR0917 - torch's signature
    output: Array,
    input: Array,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``all_to_all`` of one array split along dimension 0 (PyTorch 2).

    Group rank ``r`` sends rows ``input_split_sizes[q]`` of ``input`` (in order) to rank ``q``,
    which receives them into its ``output`` at the rows ``output_split_sizes[r]``. ``None``
    splits dimension 0 into ``world_size`` equal parts (it must divide). Each pair of ranks must
    agree on the sizes they exchange; one dtype, other dimensions equal.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = np.zeros(3)
        >>> dist.all_to_all_single(out, np.array([1.0, 2.0, 3.0]), [3], [3])
        >>> out
        array([1., 2., 3.])
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _data(backend, input, "input", output=False)
        _array(backend, output, "output")
        _like(output, input, "output", "input", shape=False)
        _same_device([output], input, "[output]", "input")
        if output.ndim == 0 or input.ndim == 0 or output.shape[1:] != input.shape[1:]:
            raise ValueError(
                "output and input must have at least one dimension and agree beyond the "
                f"first, got shapes {output.shape} and {input.shape}."
            )
        size = pg.size()
        ins = _rows(input, _splits(input_split_sizes, input, size, "input_split_sizes", "input"))
        outs = _rows(
            output, _splits(output_split_sizes, output, size, "output_split_sizes", "output")
        )
        agree = (str(input.dtype), list(input.shape[1:]))
        return _Call(backend.all_to_all, (outs, ins), agree, [output])

    return _run("all_to_all_single", group, async_op, prepare)


def _splits(sizes: Any, x: Any, count: int, name: str, x_name: str) -> list[int]:
    rows = x.shape[0]
    if sizes is None or (isinstance(sizes, list | tuple) and len(sizes) == 0):
        if rows % count:
            raise ValueError(
                f"{x_name} has {rows} rows, which {count} ranks cannot split equally; pass {name}."
            )
        return [rows // count] * count
    if isinstance(sizes, str | bytes) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, got {type(sizes).__name__}.")
    listed = [read_int(n, f"each of {name}", minimum=0) for n in sizes]
    if len(listed) != count or sum(listed) != rows:
        raise ValueError(
            f"{name} must hold {count} sizes (one per group member) adding up to {x_name}'s "
            f"{rows} rows, got {listed}."
        )
    return listed


def _rows(x: Any, sizes: list[int]) -> list[Any]:
    views, start = [], 0
    for n in sizes:
        views.append(x[start : start + n])
        start += n
    return views


@overload
def barrier(group: ProcessGroup | None = None, async_op: Literal[False] = False) -> None: ...
@overload
def barrier(group: ProcessGroup | None, async_op: Literal[True]) -> Work: ...
@overload
def barrier(group: ProcessGroup | None = None, *, async_op: Literal[True]) -> Work: ...
@overload
def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None: ...
def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Wait until every rank of the group has called ``barrier``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.barrier(async_op=True).wait()
        True
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        return _Call(backend.barrier, (), (), [])

    return _run("barrier", group, async_op, prepare)


# ---------------------------------------------------------------------------------------------
# Point to point


def _p2p(
    tensor: Any, peer: Any, name: str, group: Any, tag: Any, *, receive: bool
) -> tuple[ProcessGroup, ProcessGroupBackend, int | None, int] | None:
    """Check a send (``receive=False``) or receive; ``peer`` (named ``name``) may be None then."""
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _data(backend, tensor, "tensor", output=receive)
    tag = _tag(backend, tag)
    if peer is None:
        if not receive:
            raise TypeError(f"{name} must be an int (a world rank), got None.")
        return pg, backend, None, tag
    local = pg.group_rank(peer, name)
    if local == backend.rank:
        raise ValueError(
            f"{name}={peer} is this process's own rank; a rank cannot "
            f"{'receive from' if receive else 'send to'} itself."
        )
    return pg, backend, local, tag


def isend(tensor: Array, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> Work | None:
    """Start sending ``tensor`` to world rank ``dst``; returns a :class:`Work` to wait on.

    ``tensor`` must not be modified until the work completed. Returns ``None`` on non-members.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.isend(np.zeros(1), dst=0)
        Traceback (most recent call last):
        ...
        ValueError: dst=0 is this process's own rank; a rank cannot send to itself.
        >>> dist.destroy_process_group()
    """
    checked = _p2p(tensor, dst, "dst", group, tag, receive=False)
    if checked is None:
        return None
    _pg, backend, local, tag = checked
    assert local is not None
    work: Work = backend.send(tensor, local, tag)
    return work


def irecv(
    tensor: Array, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
) -> Work | None:
    """Start receiving into ``tensor`` from world rank ``src`` (any rank when ``None``).

    ``Work.source_rank()`` gives the sender's world rank once it completed.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.irecv(np.zeros(1), src=1)
        Traceback (most recent call last):
        ...
        ValueError: src=1 is not a member of process group '0', whose world ranks are [0].
        >>> dist.destroy_process_group()
    """
    checked = _p2p(tensor, src, "src", group, tag, receive=True)
    if checked is None:
        return None
    pg, backend, local, tag = checked
    work: Work = backend.recv(tensor, local, tag)
    work.world_ranks = pg.ranks
    return work


def send(tensor: Array, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to world rank ``dst`` and wait until the buffer can be reused.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.send(np.zeros(1), dst=3)
        Traceback (most recent call last):
        ...
        ValueError: dst=3 is not a member of process group '0', whose world ranks are [0].
        >>> dist.destroy_process_group()
    """
    work = isend(tensor, dst, group, tag)
    if work is not None:
        work.wait()


def recv(
    tensor: Array, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
) -> int:
    """Receive into ``tensor`` from world rank ``src`` (any rank when ``None``).

    The message must be as large as ``tensor``: a larger one raises ``ValueError``, and so does a
    smaller one on the ``"mpi"`` backend (torch's gloo fills the front of the tensor and leaves
    the rest as it was, with no way to tell how much came; a size known to both sides is the
    only safe use). On ``"nccl"`` the sizes must match, as NCCL requires.

    Returns:
        The sender's world rank; ``-1`` on non-members of ``group``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.recv(np.zeros(1), src=0)
        Traceback (most recent call last):
        ...
        ValueError: src=0 is this process's own rank; a rank cannot receive from itself.
        >>> dist.destroy_process_group()
    """
    work = irecv(tensor, src, group, tag)
    if work is None:
        return -1
    return work.source_rank()


# ---------------------------------------------------------------------------------------------
# Coalesced


@overload
def all_reduce_coalesced(
    tensors: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_reduce_coalesced(
    tensors: Sequence[Array], op: ReduceOp, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def all_reduce_coalesced(
    tensors: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_reduce_coalesced(
    tensors: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_reduce_coalesced(
    tensors: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``all_reduce`` of each array of ``tensors`` (one device, any shapes and dtypes) at once.

    Arrays of one dtype travel in one message. As in torch, ranks must pass matching lists
    (this is not checked across ranks).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [np.ones(2), np.arange(3)]
        >>> dist.all_reduce_coalesced(xs)
        >>> xs
        [array([1., 1.]), array([0, 1, 2])]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _arrays(backend, tensors, "tensors")
        for x in tensors:
            _reduction(backend, x.dtype, op)
        _same_device(tensors, tensors[0], "tensors", "tensors[0]")
        return _Call(backend.all_reduce_coalesced, (tensors, op), (op, tensors))

    return _run("all_reduce_coalesced", group, async_op, prepare)


@overload
def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_lists[r][k]`` receives ``input_tensor_list[k]`` of group rank ``r``.

    The inputs may differ in shape and dtype (one device); they travel in one message.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [[np.zeros(1), np.zeros(2, int)]]
        >>> dist.all_gather_coalesced(out, [np.ones(1), np.array([4, 5])])
        >>> out
        [[array([1.]), array([4, 5])]]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        inputs = _arrays(backend, input_tensor_list, "input_tensor_list", output=False)
        for x in inputs:
            backend.check_dtype(x.dtype, None)
        _same_device(inputs, inputs[0], "input_tensor_list", "input_tensor_list[0]")

        def inner(r: int, outputs: Any, item: str) -> None:
            _arrays(backend, outputs, item, length=len(inputs))
            for k, (out, x) in enumerate(zip(outputs, inputs, strict=True)):
                _like(out, x, f"{item}[{k}]", f"input_tensor_list[{k}]")
            _same_device(outputs, inputs[0], item, "input_tensor_list[0]")

        _lists(backend, output_tensor_lists, "output_tensor_lists", length=pg.size(), inner=inner)
        return _Call(backend.all_gather_coalesced, (output_tensor_lists, inputs), (inputs,))

    return _run("all_gather_coalesced", group, async_op, prepare)


# ---------------------------------------------------------------------------------------------
# Several devices per process


@overload
def broadcast_multigpu(
    tensor_list: Sequence[Array],
    src: int,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
    src_tensor: int = 0,
) -> None: ...
@overload
def broadcast_multigpu(
    tensor_list: Sequence[Array],
    src: int,
    group: ProcessGroup | None,
    async_op: Literal[True],
    src_tensor: int = 0,
) -> Work: ...
@overload
def broadcast_multigpu(
    tensor_list: Sequence[Array],
    src: int,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
    src_tensor: int = 0,
) -> Work: ...
@overload
def broadcast_multigpu(
    tensor_list: Sequence[Array],
    src: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    src_tensor: int = 0,
) -> Work | None: ...
def broadcast_multigpu(
    tensor_list: Sequence[Array],
    src: int,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    src_tensor: int = 0,
) -> Work | None:
    """``broadcast`` from ``tensor_list[src_tensor]`` of rank ``src`` to every array of every rank.

    ``tensor_list`` holds one array per local device (``"host:k"`` or ``"cuda:k"``), all of one
    shape and dtype; every rank passes the same number of arrays.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.arange(2), f"host:{k}") for k in range(2)]
        >>> dist.broadcast_multigpu(xs, src=0, src_tensor=1)
        >>> xs[0]
        HostArray([0, 1], device='host:0')
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _device_list(backend, tensor_list, "tensor_list")
        backend.check_dtype(tensor_list[0].dtype, None)
        root = pg.group_rank(src, "src")
        index = _index(src_tensor, len(tensor_list), "src_tensor")
        return _Call(backend.broadcast, (tensor_list, root, index), (root, tensor_list))

    return _run("broadcast_multigpu", group, async_op, prepare)


@overload
def all_reduce_multigpu(
    tensor_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_reduce_multigpu(
    tensor_list: Sequence[Array], op: ReduceOp, group: ProcessGroup | None, async_op: Literal[True]
) -> Work: ...
@overload
def all_reduce_multigpu(
    tensor_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_reduce_multigpu(
    tensor_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_reduce_multigpu(
    tensor_list: Sequence[Array],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``all_reduce`` over every array of every rank; each array receives the result.

    ``ReduceOp.AVG`` divides by the number of arrays in the whole group (ranks × local devices).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.array([k + 1.0]), f"host:{k}") for k in range(2)]
        >>> dist.all_reduce_multigpu(xs)
        >>> [float(x[0]) for x in xs]
        [3.0, 3.0]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _device_list(backend, tensor_list, "tensor_list")
        _reduction(backend, tensor_list[0].dtype, op)
        return _Call(backend.all_reduce, (tensor_list, op), (op, tensor_list))

    return _run("all_reduce_multigpu", group, async_op, prepare)


@overload
def reduce_multigpu(
    tensor_list: Sequence[Array],
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
    dst_tensor: int = 0,
) -> None: ...
@overload
def reduce_multigpu(
    tensor_list: Sequence[Array],
    dst: int,
    op: ReduceOp,
    group: ProcessGroup | None,
    async_op: Literal[True],
    dst_tensor: int = 0,
) -> Work: ...
@overload
def reduce_multigpu(
    tensor_list: Sequence[Array],
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
    dst_tensor: int = 0,
) -> Work: ...
@overload
def reduce_multigpu(
    tensor_list: Sequence[Array],
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    dst_tensor: int = 0,
) -> Work | None: ...
def reduce_multigpu(  # noqa: PLR0917 - torch's signature
    tensor_list: Sequence[Array],
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    dst_tensor: int = 0,
) -> Work | None:
    """``reduce`` over every array of every rank into ``tensor_list[dst_tensor]`` of rank ``dst``.

    The other arrays keep their values.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.array([k + 2]), f"host:{k}") for k in range(2)]
        >>> dist.reduce_multigpu(xs, dst=0, op=dist.ReduceOp.PRODUCT, dst_tensor=1)
        >>> [int(x[0]) for x in xs]
        [2, 6]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        _device_list(backend, tensor_list, "tensor_list")
        _reduction(backend, tensor_list[0].dtype, op)
        root = pg.group_rank(dst, "dst")
        index = _index(dst_tensor, len(tensor_list), "dst_tensor")
        return _Call(backend.reduce, (tensor_list, root, index, op), (root, op, tensor_list))

    return _run("reduce_multigpu", group, async_op, prepare)


@overload
def all_gather_multigpu(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_gather_multigpu(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_gather_multigpu(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_gather_multigpu(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def all_gather_multigpu(
    output_tensor_lists: Sequence[Sequence[Array]],
    input_tensor_list: Sequence[Array],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_lists[i][r * L + j]`` receives ``input_tensor_list[j]`` of group rank ``r``.

    ``L = len(input_tensor_list)``; ``output_tensor_lists[i]`` lives on the device of
    ``input_tensor_list[i]`` and holds ``world_size * L`` arrays.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.array([k]), f"host:{k}") for k in range(2)]
        >>> outs = [[cupy_parallel.empty(1, int, f"host:{i}") for _ in range(2)] for i in range(2)]
        >>> dist.all_gather_multigpu(outs, xs)
        >>> [[int(o[0]) for o in out] for out in outs]
        [[0, 1], [0, 1]]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        inputs = _device_list(backend, input_tensor_list, "input_tensor_list", output=False)
        backend.check_dtype(inputs[0].dtype, None)
        _per_device_lists(
            pg,
            backend,
            output_tensor_lists,
            "output_tensor_lists",
            per_device=inputs,
            per_device_name="input_tensor_list",
            output=True,
        )
        return _Call(backend.all_gather, (output_tensor_lists, inputs), (inputs,))

    return _run("all_gather_multigpu", group, async_op, prepare)


@overload
def reduce_scatter_multigpu(
    output_tensor_list: Sequence[Array],
    input_tensor_lists: Sequence[Sequence[Array]],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def reduce_scatter_multigpu(
    output_tensor_list: Sequence[Array],
    input_tensor_lists: Sequence[Sequence[Array]],
    op: ReduceOp,
    group: ProcessGroup | None,
    async_op: Literal[True],
) -> Work: ...
@overload
def reduce_scatter_multigpu(
    output_tensor_list: Sequence[Array],
    input_tensor_lists: Sequence[Sequence[Array]],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def reduce_scatter_multigpu(
    output_tensor_list: Sequence[Array],
    input_tensor_lists: Sequence[Sequence[Array]],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None: ...
def reduce_scatter_multigpu(
    output_tensor_list: Sequence[Array],
    input_tensor_lists: Sequence[Sequence[Array]],
    op: ReduceOp = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter`` over every array of every rank, one output per local device.

    ``output_tensor_list[j]`` of group rank ``r`` receives the reduction, over every array list
    of every rank, of ``input_tensor_lists[i][r * L + j]`` (``L = len(output_tensor_list)``).

    ``input_tensor_lists[i]`` lives on the device of ``output_tensor_list[i]`` and holds
    ``world_size * L`` arrays.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> outs = [cupy_parallel.empty(1, float, f"host:{i}") for i in range(2)]
        >>> ins = [[cupy_parallel.to_device(np.array([10.0 * i + j]), f"host:{i}")
        ...         for j in range(2)] for i in range(2)]
        >>> dist.reduce_scatter_multigpu(outs, ins)
        >>> [float(o[0]) for o in outs]
        [10.0, 12.0]
        >>> dist.destroy_process_group()
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> _Call:
        outputs = _device_list(backend, output_tensor_list, "output_tensor_list")
        _reduction(backend, outputs[0].dtype, op)
        _per_device_lists(
            pg,
            backend,
            input_tensor_lists,
            "input_tensor_lists",
            per_device=outputs,
            per_device_name="output_tensor_list",
            output=False,
        )
        args = (outputs, input_tensor_lists, op)
        return _Call(backend.reduce_scatter, args, (op, outputs))

    return _run("reduce_scatter_multigpu", group, async_op, prepare)


# ---------------------------------------------------------------------------------------------
# Batched point to point, monitored barrier (PyTorch 2)


class P2POp:
    """One send or receive for :func:`batch_isend_irecv`: ``op`` is :func:`isend` or :func:`irecv`.

    The arguments are those of ``op`` (``peer`` is its ``dst``/``src``, a world rank) and are
    checked when the batch starts.

    Example:
        >>> import numpy as np
        >>> P2POp(isend, np.zeros(2), 1)
        P2POp(isend, peer=1, tag=0)
    """

    __slots__ = ("group", "op", "peer", "tag", "tensor")

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Array,
        peer: int,
        group: ProcessGroup | None = None,
        tag: int = 0,
    ) -> None:
        if op is not isend and op is not irecv:
            raise ValueError(
                "op must be cupy_parallel.distributed.isend or irecv, got "
                f"{getattr(op, '__name__', type(op).__name__)}."
            )
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of ``p2p_op_list``; one :class:`Work` each, in order.

    Every operation is checked before any starts. Operations on groups this process is not a
    member of are skipped (no work for them), as single ``isend``/``irecv`` calls return
    ``None`` there.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.batch_isend_irecv([])
        Traceback (most recent call last):
        ...
        ValueError: p2p_op_list must hold at least one P2POp, got an empty list.
    """
    if not isinstance(p2p_op_list, list | tuple):
        raise TypeError(f"p2p_op_list must be a list of P2POp, got {type(p2p_op_list).__name__}.")
    if not p2p_op_list:
        raise ValueError("p2p_op_list must hold at least one P2POp, got an empty list.")
    checked = []
    for index, item in enumerate(p2p_op_list):
        if not isinstance(item, P2POp):
            raise TypeError(f"p2p_op_list[{index}] must be a P2POp, got {type(item).__name__}.")
        receive = item.op is irecv
        name = "src" if receive else "dst"
        found = _p2p(item.tensor, item.peer, name, item.group, item.tag, receive=receive)
        if found is not None:
            checked.append((item, found))
    works = []
    for item, (pg, backend, local, tag) in checked:
        if item.op is irecv:
            work = backend.recv(item.tensor, local, tag)
            work.world_ranks = pg.ranks
        else:
            assert local is not None
            work = backend.send(item.tensor, local, tag)
        works.append(work)
    return works


def monitored_barrier(
    group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (PyTorch 2).

    Group rank 0 waits for a message from every other rank, then releases them. If some rank
    does not arrive in time, rank 0 raises ``RuntimeError`` naming the first such rank (every
    such rank with ``wait_all_ranks=True``), and the other ranks raise ``RuntimeError`` when
    rank 0 does not release them. Pending receives are cancelled, so the group stays usable.
    Host backends only (it uses point-to-point messages on host arrays), as torch's is gloo's.

    Args:
        group: The process group (default: the world).
        timeout: Seconds or a ``datetime.timedelta``; default: the group's timeout.
        wait_all_ranks: Wait for every rank and name all the missing ones.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.monitored_barrier(timeout=5)
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return
    pg, backend = resolved
    limit = backend.timeout if timeout is None else read_timeout(timeout)
    every = read_bool(wait_all_ranks, "wait_all_ranks")
    if "cpu" not in backend.array_kinds:
        raise NotImplementedError(
            f"monitored_barrier needs a host backend; the {backend.backend.value!r} backend "
            "moves device arrays only (use barrier())."
        )
    tag = backend.max_tag + 1
    deadline = time.monotonic() + limit
    if backend.rank != 0:
        backend.send(np.zeros(1, np.uint8), 0, tag).wait()
        release = backend.recv(np.zeros(1, np.uint8), 0, tag)
        if not release.wait_or_cancel(deadline):
            raise RuntimeError(
                f"monitored_barrier on process group {pg.name!r}: rank {pg.ranks[0]} did not "
                f"release this rank ({pg.ranks[backend.rank]}) within {limit:g} s (some rank "
                "did not arrive; rank 0 names it)."
            )
        return
    arrivals = [(r, backend.recv(np.zeros(1, np.uint8), r, tag)) for r in range(1, backend.size)]
    missing = []
    for r, work in arrivals:
        if not work.wait_or_cancel(deadline):
            missing.append(pg.ranks[r])
            if not every:
                deadline = 0.0  # cancel the rest at once
    if missing:
        raise RuntimeError(
            f"monitored_barrier on process group {pg.name!r}: rank"
            f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive "
            f"within {limit:g} s."
        )
    for r in range(1, backend.size):
        backend.send(np.zeros(1, np.uint8), r, tag).wait()
