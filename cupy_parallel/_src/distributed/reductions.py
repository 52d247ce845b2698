"""Collectives whose every rank receives a reduction: ``all_reduce`` and ``reduce_scatter`` forms.

``all_reduce``, ``reduce_scatter``, ``reduce_scatter_tensor`` (PyTorch 2) and
``all_reduce_coalesced`` (several arrays in one call). ``reduce`` has a root: see ``rooted``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

from cupy_parallel._src.distributed.dispatch import (
    Call,
    all_reduce_now,
    check_array,
    check_arrays,
    check_member_list,
    check_reduction,
    check_same_device,
    chunk_views,
    run,
)
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = ["all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor"]


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

    See :class:`ReduceOp` for what each reduction does per dtype (``AVG`` of integers is the
    exact mean rounded toward zero). ``float16`` and ``bfloat16`` (``ml_dtypes``): the ``"mpi"``
    backend reduces in ``float32`` and rounds once, to nearest even; ``"nccl"`` reduces in the
    16-bit dtype itself (NCCL's kernels), so error grows with the ranks.

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
    if async_op is False and all_reduce_now(tensor, op, group):  # host arrays, waited on
        return None

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_array(backend, tensor, "tensor")
        check_reduction(backend, tensor.dtype, op)
        return Call(backend.all_reduce, ([tensor], op), (op, tensor))

    return run("all_reduce", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_array(backend, output, "output")
        check_reduction(backend, output.dtype, op)
        size = pg.size()
        check_member_list(
            backend, input_list, "input_list", output, "output", length=size, output=False
        )
        return Call(backend.reduce_scatter, ([output], [input_list], op), (op, output))

    return run("reduce_scatter", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_array(backend, output, "output")
        check_reduction(backend, output.dtype, op)
        check_array(backend, input, "input", output=False)
        check_same_device([input], output, "[input]", "output")
        views = chunk_views(input, pg.size(), "input", output, "output")
        return Call(backend.reduce_scatter, ([output], [views], op), (op, output), [output])

    return run("reduce_scatter_tensor", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_arrays(backend, tensors, "tensors")
        for x in tensors:
            check_reduction(backend, x.dtype, op)
        check_same_device(tensors, tensors[0], "tensors", "tensors[0]")
        return Call(backend.all_reduce_coalesced, (tensors, op), (op, tensors))

    return run("all_reduce_coalesced", group, async_op, prepare)
