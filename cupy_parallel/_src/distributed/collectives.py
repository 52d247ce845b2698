"""Collectives and point-to-point calls of the process-group API, as torch.distributed names them.

Every function here does the same three things, each in one helper: resolve the group
(:func:`_backend_of`: ``None`` means the world, a non-member returns ``None`` at once), check the
arguments in the caller's words (:func:`_array`, :func:`_arrays`, :func:`_peer`,
:func:`_reduction`), and hand the checked arrays to the backend's primitive, waiting on the returned
:class:`~cupy_parallel.distributed.Work` unless ``async_op=True`` (:func:`_finish`).

Arrays are updated in place, as in torch: ``all_reduce(x)`` leaves the result in ``x``. Arrays must
be C-contiguous (a strided view cannot be a communication buffer; pass ``numpy.ascontiguousarray``).
All arrays of one call live on one device, except the ``*_multigpu`` forms, whose lists hold one
array per local device. ``src``/``dst`` are world ranks, as in torch, also for subgroups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_int
from cupy_parallel._src.devices import HostArray, device_of, is_array
from cupy_parallel._src.distributed.enums import ReduceOp
from cupy_parallel._src.distributed.groups import _resolve

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_gather_multigpu",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_multigpu",
    "gather",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_multigpu",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "scatter",
    "send",
]

_KIND_OF_TYPE: dict[type, str] = {np.ndarray: "cpu", HostArray: "host"}


# ---------------------------------------------------------------------------------------------
# The checks, once


def _backend_of(group: Any) -> tuple[ProcessGroup, ProcessGroupBackend] | None:
    pg = _resolve(group)
    if pg is None:
        return None
    backend = pg._live()
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


def _like(x: Any, ref: Any, name: str, ref_name: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}; every array of the call "
            "must share one dtype."
        )
    if x.shape != ref.shape:
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
    output: bool = True,
) -> Sequence[Any]:
    """Check a list of arrays: its type, length, each array, and shape/dtype against ``like``."""
    if not isinstance(xs, list | tuple):
        raise TypeError(f"{name} must be a list of arrays, got {type(xs).__name__}.")
    if length is not None and len(xs) != length:
        raise ValueError(f"{name} must hold {length} arrays, got {len(xs)}.")
    if not xs:
        raise ValueError(f"{name} must hold at least one array, got an empty list.")
    for index, x in enumerate(xs):
        _array(backend, x, f"{name}[{index}]", output=output)
        if like is not None:
            _like(x, like, f"{name}[{index}]", like_name)
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


def _peer(pg: ProcessGroup, rank: Any, name: str) -> int:
    """The group rank of world rank ``rank``."""
    local = pg._group_rank.get(rank) if type(rank) is int else None
    if local is None:
        local = pg._group_rank.get(read_int(rank, name))
        if local is None:
            raise ValueError(
                f"{name}={rank} is not a member of process group {pg.name!r}, whose world "
                f"ranks are {list(pg.ranks)}."
            )
    return local


def _reduction(backend: ProcessGroupBackend, dtype: Any, op: Any) -> None:
    if type(op) is not ReduceOp:
        raise TypeError(
            f"op must be a ReduceOp (SUM, PRODUCT, MIN, MAX, AVG), got {type(op).__name__} {op!r}."
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


def _check_async(async_op: Any) -> None:
    read_bool(async_op, "async_op")


def _finish(async_op: Any, primitive: Callable[..., Work], /, *args: Any) -> Work | None:
    """Check ``async_op`` (the last check), start ``primitive(*args)``, wait unless async."""
    _check_async(async_op)
    work = primitive(*args)
    if async_op:
        return work
    work.wait()
    return None


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
    root = _peer(pg, rank, rank_name)
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
    if not isinstance(lists, list | tuple) or len(lists) != local:
        raise ValueError(
            f"{name} must be a list of {local} lists (one per array of {per_device_name}), "
            f"got {lists!r:.80}."
        )
    for i, xs in enumerate(lists):
        item = f"{name}[{i}]"
        first, own = f"{per_device_name}[0]", f"{per_device_name}[{i}]"
        count = pg.size() * local
        on = (per_device[i], own)
        _member_list(backend, xs, item, per_device[0], first, length=count, output=output, on=on)


# ---------------------------------------------------------------------------------------------
# One array per process


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False) -> Work | None:
    """Copy ``tensor`` of world rank ``src`` into ``tensor`` of every rank of the group.

    Args:
        tensor: Data to send on ``src``, buffer receiving it (in place) elsewhere.
        src: World rank of the sender.
        group: The process group (default: the world).
        async_op: Return a :class:`Work` instead of waiting.

    Returns:
        A :class:`Work` if ``async_op``, else ``None`` (also on non-members of ``group``).

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")  # a world of one here; start N with mpiexec -n N
        >>> x = np.arange(3)
        >>> dist.broadcast(x, src=0)
        >>> x
        array([0, 1, 2])
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _data(backend, tensor, "tensor")
    root = _peer(pg, src, "src")
    return _finish(async_op, backend.broadcast, [tensor], root, 0)


def all_reduce(
    tensor: Any, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` over the group; every rank gets the result in ``tensor`` (in place).

    See :class:`ReduceOp` for what each reduction does per dtype (``AVG`` of integers rounds
    toward zero; ``float16`` is reduced in ``float32`` and rounded once).

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> x = np.array([1.0, 2.0])
        >>> dist.all_reduce(x, op=dist.ReduceOp.MAX)
        >>> x * dist.get_world_size()
        array([1., 2.])
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    backend = resolved[1]
    _array(backend, tensor, "tensor")
    _reduction(backend, tensor.dtype, op)
    if async_op is False:  # the latency-critical path, kept short
        backend.all_reduce([tensor], op).wait()
        return None
    _check_async(async_op)
    return backend.all_reduce([tensor], op)


def reduce(
    tensor: Any,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``tensor`` over the group into ``tensor`` of world rank ``dst``.

    Other ranks' ``tensor`` keeps its values (torch leaves it unspecified; MPI leaves it alone).

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> x = np.array([3, 4])
        >>> dist.reduce(x, dst=0, op=dist.ReduceOp.PRODUCT)
        >>> x
        array([3, 4])
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _array(backend, tensor, "tensor")
    _reduction(backend, tensor.dtype, op)
    root = _peer(pg, dst, "dst")
    return _finish(async_op, backend.reduce, [tensor], root, 0, op)


def all_gather(
    tensor_list: list[Any], tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """Every rank receives each rank's ``tensor``: ``tensor_list[r]`` gets group rank ``r``'s.

    ``tensor_list`` holds one array per group member, shaped and typed as ``tensor`` and on its
    device.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [np.zeros(2, int)]
        >>> dist.all_gather(out, np.array([5, 6]))
        >>> out
        [array([5, 6])]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _data(backend, tensor, "tensor", output=False)
    _member_list(backend, tensor_list, "tensor_list", tensor, "tensor", length=pg.size())
    return _finish(async_op, backend.all_gather, [tensor_list], [tensor])


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """World rank ``dst`` receives every rank's ``tensor``: ``gather_list[r]`` gets group rank r's.

    ``gather_list`` is required on ``dst`` (one array per member, shaped as ``tensor``) and must be
    ``None`` (or empty) elsewhere, as in torch.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [np.zeros(2)]
        >>> dist.gather(np.array([1.0, 2.0]), out, dst=0)
        >>> out
        [array([1., 2.])]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _data(backend, tensor, "tensor", output=False)
    root, outputs = _rooted(
        pg, backend, tensor, gather_list, "gather_list", rank=dst, rank_name="dst"
    )
    return _finish(async_op, backend.gather, outputs, tensor, root)


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """World rank ``src`` sends ``scatter_list[r]`` into ``tensor`` of group rank ``r``.

    ``scatter_list`` is required on ``src`` (one array per member, shaped as ``tensor``) and must
    be ``None`` (or empty) elsewhere.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> x = np.zeros(2)
        >>> dist.scatter(x, [np.array([7.0, 8.0])], src=0)
        >>> x
        array([7., 8.])
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _data(backend, tensor, "tensor")
    root, inputs = _rooted(
        pg, backend, tensor, scatter_list, "scatter_list", rank=src, rank_name="src"
    )
    return _finish(async_op, backend.scatter, tensor, inputs, root)


def reduce_scatter(
    output: Any,
    input_list: list[Any],
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input_list[r]`` over the group into ``output`` of group rank ``r``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = np.zeros(2)
        >>> dist.reduce_scatter(out, [np.array([1.0, 2.0])])
        >>> out
        array([1., 2.])
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _array(backend, output, "output")
    _reduction(backend, output.dtype, op)
    size = pg.size()
    _member_list(backend, input_list, "input_list", output, "output", length=size, output=False)
    return _finish(async_op, backend.reduce_scatter, [output], [input_list], op)


def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Exchange one array with every rank: ``output_tensor_list[q]`` gets rank ``q``'s message.

    Group rank ``r`` sends ``input_tensor_list[q]`` to rank ``q``, into its
    ``output_tensor_list[r]``.
    One dtype and one device for all arrays. Sizes may differ between pairs of ranks (each pair
    must agree: ``output_tensor_list[r]`` of rank ``q`` is shaped as ``input_tensor_list[q]`` of
    rank ``r``); this is torch's list form of ``all_to_all``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [np.zeros(3)]
        >>> dist.all_to_all(out, [np.array([1.0, 2.0, 3.0])])
        >>> out
        [array([1., 2., 3.])]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    inputs = _arrays(
        backend, input_tensor_list, "input_tensor_list", length=pg.size(), output=False
    )
    outputs = _arrays(backend, output_tensor_list, "output_tensor_list", length=pg.size())
    ref = inputs[0]
    backend.check_dtype(ref.dtype, None)
    for name, xs in (("input_tensor_list", inputs), ("output_tensor_list", outputs)):
        for index, x in enumerate(xs):
            if x.dtype != ref.dtype:
                raise TypeError(
                    f"{name}[{index}] has dtype {x.dtype} but input_tensor_list[0] has "
                    f"{ref.dtype}; all_to_all moves one dtype."
                )
        _same_device(xs, ref, name, "input_tensor_list[0]")
    return _finish(async_op, backend.all_to_all, outputs, inputs)


def barrier(group: Any = None, async_op: bool = False) -> Work | None:
    """Wait until every rank of the group has called ``barrier``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.barrier(async_op=True).wait()
        True
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    return _finish(async_op, resolved[1].barrier)


# ---------------------------------------------------------------------------------------------
# Point to point


def _p2p(tensor: Any, peer: Any, name: str, group: Any, tag: Any) -> Any:
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _data(backend, tensor, "tensor", output=name == "src")
    tag = _tag(backend, tag)
    if peer is None:
        if name != "src":
            raise TypeError("dst must be an int (a world rank), got None.")
        return pg, backend, None, tag
    local = _peer(pg, peer, name)
    if local == backend.rank:
        raise ValueError(
            f"{name}={peer} is this process's own rank; a rank cannot "
            f"{'send to' if name == 'dst' else 'receive from'} itself."
        )
    return pg, backend, local, tag


def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Work | None:
    """Start sending ``tensor`` to world rank ``dst``; returns a :class:`Work` to wait on.

    ``tensor`` must not be modified until the work completed. Returns ``None`` on non-members.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.isend(np.zeros(1), dst=0)
        Traceback (most recent call last):
        ...
        ValueError: dst=0 is this process's own rank; a rank cannot send to itself.
        >>> dist.destroy_process_group()
    """
    checked = _p2p(tensor, dst, "dst", group, tag)
    if checked is None:
        return None
    _pg, backend, local, tag = checked
    work: Work = backend.send(tensor, local, tag)
    return work


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> Work | None:
    """Start receiving into ``tensor`` from world rank ``src`` (any rank when ``None``).

    ``Work.source_rank()`` gives the sender's world rank once it completed.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.irecv(np.zeros(1), src=1)
        Traceback (most recent call last):
        ...
        ValueError: src=1 is not a member of process group '0', whose world ranks are [0].
        >>> dist.destroy_process_group()
    """
    checked = _p2p(tensor, src, "src", group, tag)
    if checked is None:
        return None
    pg, backend, local, tag = checked
    work: Work = backend.recv(tensor, local, tag)
    work._ranks = pg.ranks
    return work


def send(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to world rank ``dst`` and wait until the buffer can be reused.

    Example:
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


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from world rank ``src`` (any rank when ``None``).

    Returns:
        The sender's world rank; ``-1`` on non-members of ``group``.

    Example:
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


def all_reduce_coalesced(
    tensors: list[Any], op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """``all_reduce`` of each array of ``tensors`` (one device, any shapes and dtypes) at once.

    Arrays of one dtype travel in one message. As in torch, ranks must pass matching lists
    (this is not checked across ranks).

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [np.ones(2), np.arange(3)]
        >>> dist.all_reduce_coalesced(xs)
        >>> xs
        [array([1., 1.]), array([0, 1, 2])]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    backend = resolved[1]
    _arrays(backend, tensors, "tensors")
    for x in tensors:
        _reduction(backend, x.dtype, op)
    _same_device(tensors, tensors[0], "tensors", "tensors[0]")
    return _finish(async_op, backend.all_reduce_coalesced, tensors, op)


def all_gather_coalesced(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_lists[r][k]`` receives ``input_tensor_list[k]`` of group rank ``r``.

    The inputs may differ in shape and dtype (one device); they travel in one message.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [[np.zeros(1), np.zeros(2, int)]]
        >>> dist.all_gather_coalesced(out, [np.ones(1), np.array([4, 5])])
        >>> out
        [[array([1.]), array([4, 5])]]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    inputs = _arrays(backend, input_tensor_list, "input_tensor_list", output=False)
    for x in inputs:
        backend.check_dtype(x.dtype, None)
    _same_device(inputs, inputs[0], "input_tensor_list", "input_tensor_list[0]")
    if not isinstance(output_tensor_lists, list | tuple):
        raise TypeError(
            "output_tensor_lists must be a list of lists of arrays, got "
            f"{type(output_tensor_lists).__name__}."
        )
    if len(output_tensor_lists) != pg.size():
        raise ValueError(
            f"output_tensor_lists must hold {pg.size()} lists (one per group member), got "
            f"{len(output_tensor_lists)}."
        )
    for r, outputs in enumerate(output_tensor_lists):
        _arrays(backend, outputs, f"output_tensor_lists[{r}]", length=len(inputs))
        for k, (out, x) in enumerate(zip(outputs, inputs, strict=True)):
            _like(out, x, f"output_tensor_lists[{r}][{k}]", f"input_tensor_list[{k}]")
        _same_device(outputs, inputs[0], f"output_tensor_lists[{r}]", "input_tensor_list[0]")
    return _finish(async_op, backend.all_gather_coalesced, output_tensor_lists, inputs)


# ---------------------------------------------------------------------------------------------
# Several devices per process


def _device_list(backend: ProcessGroupBackend, xs: Any, name: str, *, output: bool = True) -> Any:
    _arrays(backend, xs, name, output=output)
    for index, x in enumerate(xs[1:], start=1):
        _like(x, xs[0], f"{name}[{index}]", f"{name}[0]")
    _distinct_devices(xs, name)
    return xs


def broadcast_multigpu(
    tensor_list: list[Any],
    src: int,
    group: Any = None,
    async_op: bool = False,
    src_tensor: int = 0,
) -> Work | None:
    """``broadcast`` from ``tensor_list[src_tensor]`` of rank ``src`` to every array of every rank.

    ``tensor_list`` holds one array per local device (``"host:k"`` or ``"cuda:k"``), all of one
    shape and dtype; every rank passes the same number of arrays.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.arange(2), f"host:{k}") for k in range(2)]
        >>> dist.broadcast_multigpu(xs, src=0, src_tensor=1)
        >>> xs[0]
        HostArray([0, 1], device='host:0')
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _device_list(backend, tensor_list, "tensor_list")
    backend.check_dtype(tensor_list[0].dtype, None)
    root = _peer(pg, src, "src")
    index = _index(src_tensor, len(tensor_list), "src_tensor")
    return _finish(async_op, backend.broadcast, tensor_list, root, index)


def all_reduce_multigpu(
    tensor_list: list[Any], op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """``all_reduce`` over every array of every rank; each array receives the result.

    ``ReduceOp.AVG`` divides by the number of arrays in the whole group (ranks × local devices).

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.array([k + 1.0]), f"host:{k}") for k in range(2)]
        >>> dist.all_reduce_multigpu(xs)
        >>> [float(x[0]) for x in xs]
        [3.0, 3.0]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    backend = resolved[1]
    _device_list(backend, tensor_list, "tensor_list")
    _reduction(backend, tensor_list[0].dtype, op)
    return _finish(async_op, backend.all_reduce, tensor_list, op)


def reduce_multigpu(  # noqa: PLR0917 - torch's signature
    tensor_list: list[Any],
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    dst_tensor: int = 0,
) -> Work | None:
    """``reduce`` over every array of every rank into ``tensor_list[dst_tensor]`` of rank ``dst``.

    The other arrays keep their values.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.array([k + 2]), f"host:{k}") for k in range(2)]
        >>> dist.reduce_multigpu(xs, dst=0, op=dist.ReduceOp.PRODUCT, dst_tensor=1)
        >>> [int(x[0]) for x in xs]
        [2, 6]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
    _device_list(backend, tensor_list, "tensor_list")
    _reduction(backend, tensor_list[0].dtype, op)
    root = _peer(pg, dst, "dst")
    index = _index(dst_tensor, len(tensor_list), "dst_tensor")
    return _finish(async_op, backend.reduce, tensor_list, root, index, op)


def all_gather_multigpu(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_lists[i][r * L + j]`` receives ``input_tensor_list[j]`` of group rank ``r``.

    ``L = len(input_tensor_list)``; ``output_tensor_lists[i]`` lives on the device of
    ``input_tensor_list[i]`` and holds ``world_size * L`` arrays.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> xs = [cupy_parallel.to_device(np.array([k]), f"host:{k}") for k in range(2)]
        >>> outs = [[cupy_parallel.empty(1, int, f"host:{i}") for _ in range(2)] for i in range(2)]
        >>> dist.all_gather_multigpu(outs, xs)
        >>> [[int(o[0]) for o in out] for out in outs]
        [[0, 1], [0, 1]]
        >>> dist.destroy_process_group()
    """
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
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
    return _finish(async_op, backend.all_gather, output_tensor_lists, inputs)


def reduce_scatter_multigpu(
    output_tensor_list: list[Any],
    input_tensor_lists: list[list[Any]],
    op: ReduceOp = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """``reduce_scatter`` over every array of every rank, one output per local device.

    ``output_tensor_list[j]`` of group rank ``r`` receives the reduction, over every array list
    of every rank, of ``input_tensor_lists[i][r * L + j]`` (``L = len(output_tensor_list)``).

    ``input_tensor_lists[i]`` lives on the device of ``output_tensor_list[i]`` and holds
    ``world_size * L`` arrays.

    Example:
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
    resolved = _backend_of(group)
    if resolved is None:
        return None
    pg, backend = resolved
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
    return _finish(async_op, backend.reduce_scatter, outputs, input_tensor_lists, op)
