"""The ``*_multigpu`` collectives: several devices per process, one array per local device.

``broadcast_multigpu``, ``all_reduce_multigpu``, ``reduce_multigpu``, ``all_gather_multigpu`` and
``reduce_scatter_multigpu`` (torch 1.5's). Every rank passes the same number of arrays; with
``L`` of them, participant ``r * L + j`` is array ``j`` of group rank ``r``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

from cupy_parallel._src.arguments import read_int, read_sequence
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.distributed.dispatch import (
    Call,
    check_arrays,
    check_like,
    check_lists,
    check_member_list,
    check_reduction,
    run,
)
from cupy_parallel._src.distributed.groups import register_method
from cupy_parallel._src.distributed.reductions import all_reduce
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = [
    "all_gather_multigpu",
    "all_reduce_multigpu",
    "broadcast_multigpu",
    "reduce_multigpu",
    "reduce_scatter_multigpu",
]


def _distinct_devices(xs: Sequence[Any], name: str) -> None:
    seen = [device_of(x) for x in xs]
    if len(set(seen)) != len(seen):
        raise ValueError(
            f"{name} must hold one array per local device (each on a different device), got "
            f"devices {[str(d) for d in seen]}."
        )


def _index(value: Any, length: int, name: str) -> int:
    value = read_int(value, name)
    if not 0 <= value < length:
        raise ValueError(f"{name} must be in [0, {length}) (the list's length), got {value}.")
    return value


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
        check_member_list(
            backend, xs, item, per_device[0], first, length=count, output=output, on=on
        )

    check_lists(backend, lists, name, length=local, inner=inner, output=output)


def _device_list(backend: ProcessGroupBackend, xs: Any, name: str, *, output: bool = True) -> Any:
    check_arrays(backend, xs, name, output=output)
    for index, x in enumerate(xs[1:], start=1):
        check_like(x, xs[0], f"{name}[{index}]", f"{name}[0]")
    _distinct_devices(xs, name)
    return xs


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        _device_list(backend, tensor_list, "tensor_list")
        backend.check_dtype(tensor_list[0].dtype, None)
        root = pg.group_rank(src, "src")
        index = _index(src_tensor, len(tensor_list), "src_tensor")
        source = tensor_list[index] if pg.rank() == root else None  # the root's source is read
        writes = [x for x in tensor_list if x is not source]
        return Call(
            backend.broadcast, (tensor_list, root, index), (root, tensor_list), writes=writes
        )

    return run("broadcast_multigpu", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        _device_list(backend, tensor_list, "tensor_list")
        check_reduction(backend, tensor_list[0].dtype, op)
        return Call(backend.all_reduce, (tensor_list, op), (op, tensor_list))

    return run("all_reduce_multigpu", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        _device_list(backend, tensor_list, "tensor_list")
        check_reduction(backend, tensor_list[0].dtype, op)
        root = pg.group_rank(dst, "dst")
        index = _index(dst_tensor, len(tensor_list), "dst_tensor")
        writes = [tensor_list[index]] if pg.rank() == root else []  # the destination only
        return Call(
            backend.reduce, (tensor_list, root, index, op), (root, op, tensor_list), writes=writes
        )

    return run("reduce_multigpu", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
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
        return Call(backend.all_gather, (output_tensor_lists, inputs), (inputs,))

    return run("all_gather_multigpu", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        outputs = _device_list(backend, output_tensor_list, "output_tensor_list")
        check_reduction(backend, outputs[0].dtype, op)
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
        return Call(backend.reduce_scatter, args, (op, outputs))

    return run("reduce_scatter_multigpu", group, async_op, prepare)


def _allreduce_method(pg: ProcessGroup, tensors: Any, op: Any) -> Work:
    """``ProcessGroup.allreduce``: an array or ``[array]`` -> ``all_reduce``, more -> multigpu."""
    if is_array(tensors):
        return all_reduce(tensors, op, pg, async_op=True)
    listed = read_sequence(
        tensors, "tensors", expected="an array or a list of arrays", lists_only=True
    )
    if len(listed) == 1:
        return all_reduce(listed[0], op, pg, async_op=True)
    return all_reduce_multigpu(list(listed), op, pg, async_op=True)


register_method("allreduce", _allreduce_method)
