"""Collectives in which every rank sends to every rank, nothing reduced: gathers and all-to-all.

``all_gather``, ``all_gather_into_tensor`` (PyTorch 2), ``all_gather_coalesced``, ``all_to_all``
and ``all_to_all_single`` (PyTorch 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

from cupy_parallel._src.arguments import CheckedValueError, read_int
from cupy_parallel._src.distributed.dispatch import (
    Call,
    check_array,
    check_arrays,
    check_data,
    check_like,
    check_lists,
    check_member_list,
    check_same_device,
    chunk_views,
    list_given,
    run,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
]


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_data(backend, tensor, "tensor", output=False)
        check_member_list(backend, tensor_list, "tensor_list", tensor, "tensor", length=pg.size())
        return Call(backend.all_gather, ([tensor_list], [tensor]), (tensor,), tensor_list)

    return run("all_gather", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_data(backend, input_tensor, "input_tensor", output=False)
        check_array(backend, output_tensor, "output_tensor")
        check_same_device([output_tensor], input_tensor, "[output_tensor]", "input_tensor")
        size = pg.size()
        views = chunk_views(output_tensor, size, "output_tensor", input_tensor, "input_tensor")
        args = ([views], [input_tensor])
        return Call(backend.all_gather, args, (input_tensor,), [output_tensor])

    return run("all_gather_into_tensor", group, async_op, prepare)


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

    The inputs may differ in shape and dtype (one device). On the MPI backend each input of
    64 KiB or more travels in its own message, received straight into its outputs when they
    lie end to end in rank order (views of one buffer: nothing copied), and the smaller ones
    together in one; NCCL packs them all into one.

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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        inputs = check_arrays(backend, input_tensor_list, "input_tensor_list", output=False)
        for x in inputs:
            backend.check_dtype(x.dtype, None)
        check_same_device(inputs, inputs[0], "input_tensor_list", "input_tensor_list[0]")

        def inner(r: int, outputs: Any, item: str) -> None:
            check_arrays(backend, outputs, item, length=len(inputs))
            for k, (out, x) in enumerate(zip(outputs, inputs, strict=True)):
                check_like(out, x, f"{item}[{k}]", f"input_tensor_list[{k}]")
            check_same_device(outputs, inputs[0], item, "input_tensor_list[0]")

        check_lists(
            backend,
            output_tensor_lists,
            "output_tensor_lists",
            length=pg.size(),
            inner=inner,
            output=True,
        )
        return Call(backend.all_gather_coalesced, (output_tensor_lists, inputs), (inputs,))

    return run("all_gather_coalesced", group, async_op, prepare)


def all_gather_coalesced_unchecked(
    output_tensor_lists: list[list[Any]], input_tensor_list: list[Any], group: Any, written: Any
) -> Work | None:
    """:func:`all_gather_coalesced`, ``async_op=True``, for arrays the library made itself.

    FSDP gathers a unit twice a step into buffers it has just allocated, from its own
    shards: the public function's checks of every output (type, layout, device, overlap:
    ``W * k`` arrays) cost more there than the collective's own Python (measured 55 us of
    215 a unit on 2 ranks). What the ranks must agree on is compared all the same (the
    backend's call rows, and the debug mode's comparison). ``written``: the array the outputs
    view (the tapes are told it is written).
    """

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        inputs = list(input_tensor_list)
        return Call(
            backend.all_gather_coalesced,
            (output_tensor_lists, inputs),
            (inputs,),
            outputs=output_tensor_lists,
            writes=[written],
        )

    return run("all_gather_coalesced", group, async_op=True, prepare=prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        size = pg.size()
        inputs = check_arrays(
            backend, input_tensor_list, "input_tensor_list", length=size, output=False
        )
        ref = inputs[0]
        backend.check_dtype(ref.dtype, None)
        for index, x in enumerate(inputs):
            check_like(x, ref, f"input_tensor_list[{index}]", "input_tensor_list[0]", shape=False)
        outputs = check_arrays(
            backend,
            output_tensor_list,
            "output_tensor_list",
            length=size,
            like=ref,
            like_name="input_tensor_list[0]",
            same_shape=False,
        )
        check_same_device(inputs, ref, "input_tensor_list", "input_tensor_list[0]")
        check_same_device(outputs, ref, "output_tensor_list", "input_tensor_list[0]")
        return Call(backend.all_to_all, (outputs, inputs), (str(ref.dtype),))

    return run("all_to_all", group, async_op, prepare)


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

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        check_data(backend, input, "input", output=False)
        check_array(backend, output, "output")
        check_like(output, input, "output", "input", shape=False)
        check_same_device([output], input, "[output]", "input")
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
        return Call(backend.all_to_all, (outs, ins), agree, [output])

    return run("all_to_all_single", group, async_op, prepare)


def _splits(sizes: Any, x: Any, count: int, name: str, x_name: str) -> list[int]:
    rows = x.shape[0]
    if not list_given(sizes):
        if rows % count:
            raise CheckedValueError(
                f"{x_name} has {rows} rows, which {count} ranks cannot split equally; pass {name}."
            )
        return [rows // count] * count
    if isinstance(sizes, str | bytes) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, got {type(sizes).__name__}.")
    listed = [read_int(n, f"each of {name}", minimum=0) for n in sizes]
    if len(listed) != count or sum(listed) != rows:
        raise CheckedValueError(
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
