"""Collectives with one root rank (``src``/``dst``): broadcast, reduce, gather, scatter.

The root is a world rank, as in torch, also for subgroups. ``gather``'s and ``scatter``'s list
is given on the root only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

from cupy_parallel._src.distributed.dispatch import (
    Call,
    check_array,
    check_data,
    check_member_list,
    check_reduction,
    list_given,
    run,
)
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = ["broadcast", "gather", "reduce", "scatter"]


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
        if list_given(xs):
            raise ValueError(
                f"{name} must be None on ranks other than the {role} {rank}; "
                f"this is rank {pg.ranks[backend.rank]}."
            )
        return root, None
    if not list_given(xs):
        raise ValueError(
            f"{name} must be given on the {role} rank {rank}: a list of "
            f"{pg.size()} arrays shaped like tensor."
        )
    return root, check_member_list(
        backend, xs, name, tensor, "tensor", length=pg.size(), output=receives
    )


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_data(backend, tensor, "tensor")
        root = pg.group_rank(src, "src")
        writes = () if pg.rank() == root else None  # the root only sends
        return Call(backend.broadcast, ([tensor], root, 0), (root, tensor), writes=writes)

    return run("broadcast", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_array(backend, tensor, "tensor")
        check_reduction(backend, tensor.dtype, op)
        root = pg.group_rank(dst, "dst")
        writes = None if pg.rank() == root else ()  # only the destination receives
        return Call(backend.reduce, ([tensor], root, 0, op), (root, op, tensor), writes=writes)

    return run("reduce", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_data(backend, tensor, "tensor", output=False)
        root, outputs = _rooted(
            pg, backend, tensor, gather_list, "gather_list", rank=dst, rank_name="dst"
        )
        return Call(backend.gather, (outputs, tensor, root), (root, tensor), outputs or [])

    return run("gather", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_data(backend, tensor, "tensor")
        root, inputs = _rooted(
            pg, backend, tensor, scatter_list, "scatter_list", rank=src, rank_name="src"
        )
        return Call(backend.scatter, (tensor, inputs, root), (root, tensor), [tensor])

    return run("scatter", group, async_op, prepare)
