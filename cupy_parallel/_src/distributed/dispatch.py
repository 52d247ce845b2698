"""Validate and dispatch, once for every collective: the runner and the argument checks.

Every collective is one :func:`run` call (mpi4py's ``pkl5`` one-liners over one helper are the
model): the runner resolves the group (``None`` means the world; on a non-member the call warns,
as torch's does, and returns ``None`` at once), lets the collective's ``prepare`` check the
arguments in the caller's words (the checks below, and ``ProcessGroup.group_rank`` for ranks)
and name the backend primitive with its arguments, reads ``async_op``, compares the ranks'
arguments in the debug mode, starts the primitive and waits on the returned
:class:`~cupy_parallel.distributed.Work` unless ``async_op=True``.

The collectives, by concern, each module calling this runner: ``rooted`` (one root rank:
``broadcast``, ``reduce``, ``gather``, ``scatter``), ``reductions`` (every rank receives a
reduction: ``all_reduce``, ``reduce_scatter``, ``reduce_scatter_tensor``,
``all_reduce_coalesced``), ``exchanges`` (every rank sends to every rank, nothing reduced:
``all_gather``, ``all_gather_into_tensor``, ``all_gather_coalesced``, ``all_to_all``,
``all_to_all_single``), ``multigpu`` (the ``*_multigpu`` forms: one array per local device),
``p2p`` (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) and ``barriers``
(``barrier``, ``monitored_barrier``).

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

The checks: each names the argument, what it expected and what it got, and suggests the fix:
``TypeError`` for a wrong type, ``ValueError`` for a wrong value or shape,
``NotImplementedError`` for what the group's backend lacks. A backend sees only checked
arguments (see :mod:`~cupy_parallel._src.distributed.backend`). A check only one module needs
lives there instead (``rooted``'s root and list, ``p2p``'s tag, ``multigpu``'s device lists).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import tree
from cupy_parallel._src.arguments import (
    ArgumentError,
    CheckedArgumentError,
    CheckedValueError,
    read_bool,
    read_sequence,
)
from cupy_parallel._src.arrays import check_outs, device_of, is_array
from cupy_parallel._src.distributed.backend import disagreeing, per_rank
from cupy_parallel._src.distributed.groups import (
    get_rank,
    is_initialized,
    resolve_group,
    world_backend,
)
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.hostarray import HostArray
from cupy_parallel._src.recording import note_overwritten, tapes_exist

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = [
    "Call",
    "all_reduce_now",
    "backend_of",
    "check_array",
    "check_arrays",
    "check_data",
    "check_disjoint",
    "check_like",
    "check_lists",
    "check_member_list",
    "check_reduction",
    "check_same_device",
    "chunk_views",
    "list_given",
    "run",
]


# ---------------------------------------------------------------------------------------------
# The runner


@dataclasses.dataclass(slots=True)
class Call:
    """What a collective starts: ``primitive(*args)``; every rank must pass ``agree`` alike.

    ``outputs``: the arrays it writes (``Work.get_future()``'s result); default ``args[0]``.
    ``writes``: what this rank's call writes in place when that is not ``outputs`` (a
    broadcast's root and a reduce's other ranks only read: ``()``); every tape is told
    (:func:`~cupy_parallel._src.recording.note_overwritten`).
    (A slotted dataclass: made once per call, it costs a third of a ``NamedTuple``.)
    """

    primitive: Callable[..., Work]
    args: tuple[Any, ...]
    agree: tuple[Any, ...]
    outputs: Any = None
    writes: Any = None


def run(
    name: str,
    group: Any,
    async_op: Any,
    prepare: Callable[[ProcessGroup, ProcessGroupBackend], Call],
) -> Work | None:
    """Resolve ``group``, check and start ``prepare``'s call, wait on it unless ``async_op``."""
    resolved = backend_of(group, name)
    if resolved is None:
        return None
    pg, backend = resolved
    call = prepare(pg, backend)
    asynchronous = async_op if async_op is False else read_bool(async_op, "async_op")
    if backend.detail:
        _compare(pg, backend, name, call.agree)
    work = call.primitive(*call.args)
    outputs = call.args[0] if call.outputs is None and call.args else call.outputs
    if tapes_exist():
        note_overwritten(
            tree.leaves(outputs if call.writes is None else call.writes), f"dist.{name}"
        )
    if asynchronous:
        work.outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
        return work
    work.wait()
    return None


def all_reduce_now(tensor: Any, op: Any, group: Any) -> bool:
    """``all_reduce(tensor, op, group)`` with ``async_op=False``, if ``tensor`` is a host array.

    ``False`` for any other array, and on a group that failed or runs the debug mode (the
    caller then goes through :func:`run`, which says so, or compares). What :func:`run` does
    for the call, in its order (resolve the group, check the array and the reduction, tell
    the tapes, finish the call), without the closure, :class:`Call` and
    :class:`~cupy_parallel.distributed.Work` it builds for every collective; the checks of a
    reduction the group's backend passed before (a loop's calls) are a set lookup. The
    backend finishes the call (:meth:`ProcessGroupBackend.all_reduce_now`; issue 35).
    """
    kind = _KIND_OF_TYPE.get(type(tensor))
    if kind is None:
        return False
    backend = world_backend() if group is None else None
    if backend is None:
        resolved = backend_of(group, "all_reduce")
        if resolved is None:
            return True
        backend = resolved[1]
    if backend.failure is not None or backend.detail:
        return False
    flags = tensor.flags
    if not (
        kind in backend.array_kinds
        and flags.c_contiguous
        and flags.writeable
        and type(op) is ReduceOp  # (before hashing it: an op in a list says so)
        and (tensor.dtype, op) in backend.reductions_passed
    ):  # check_array and check_reduction say what is wrong
        check_array(backend, tensor, "tensor")
        check_reduction(backend, tensor.dtype, op)
    if tapes_exist():  # before it starts: what it may write, even if it fails
        note_overwritten([tensor], "dist.all_reduce")
    backend.all_reduce_now(tensor, op)
    return True


def backend_of(group: Any, operation: str) -> tuple[ProcessGroup, ProcessGroupBackend] | None:
    """The group ``group`` names and its backend; a failed one raises.

    On a non-member ``None``, after torch's ``UserWarning`` saying that ``operation`` ran on a
    rank outside the group (the call then does nothing, as in torch).
    """
    pg = resolve_group(group)
    if pg is None:
        _warn_not_member(operation)
        return None
    backend = pg.live_backend()
    if backend.failure is not None:
        raise RuntimeError(
            f"process group {pg.name!r} is unusable: {backend.failure} "
            "Destroy it and create a new group (or restart the job)."
        )
    return pg, backend


def _warn_not_member(operation: str) -> None:
    """Warn as torch does of a call on a group this rank is not in, at the user's line.

    The first sentence is torch's (``c10d``'s ``_warn_not_in_group``), so that a filter written
    for torch's warning matches ours too; the global rank is ``-1`` before
    ``init_process_group``, as there.
    """
    rank = get_rank() if is_initialized() else -1
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("cupy_parallel."):
        frame, level = frame.f_back, level + 1  # the first frame outside the package
    warnings.warn(
        f"Running {operation} on global rank {rank} which does not belong to the given group. "
        "It does nothing here: the arrays are left as they are and it returns None (recv -1).",
        UserWarning,
        stacklevel=level,
    )


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


_KIND_OF_TYPE: dict[type, str] = {np.ndarray: "cpu", HostArray: "host"}


def check_array(backend: ProcessGroupBackend, x: Any, name: str, *, output: bool = True) -> str:
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
        raise CheckedValueError(
            f"{name} must be C-contiguous to serve as a communication buffer, got strides "
            f"{x.strides} for shape {x.shape}; pass numpy/cupy.ascontiguousarray({name}) and "
            "copy the result back."
        )
    if output and not getattr(flags, "writeable", True):
        raise ValueError(f"{name} receives data in place but is read-only; pass a writable array.")
    return kind


def check_like(x: Any, ref: Any, name: str, ref_name: str, *, shape: bool = True) -> None:
    """Check that ``x`` has ``ref``'s dtype (and shape, unless ``shape=False``)."""
    if x.dtype != ref.dtype:
        raise CheckedArgumentError(  # a TypeError, and torch's ValueError and RuntimeError
            f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}; every array of the call "
            "must share one dtype (torch: invalid usage of tensors with different dtypes)."
        )
    if shape and x.shape != ref.shape:
        raise CheckedValueError(
            f"{name} has shape {x.shape} but {ref_name} has {ref.shape}; every array of the "
            "call must have the same shape."
        )


def check_arrays(
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
    read_sequence(xs, name, expected="a list of arrays", lists_only=True)
    if length is not None and len(xs) != length:
        raise CheckedValueError(f"{name} must hold {length} arrays, got {len(xs)}.")
    if not xs:
        raise ValueError(f"{name} must hold at least one array, got an empty list.")
    for index, x in enumerate(xs):
        check_array(backend, x, f"{name}[{index}]", output=output)
        if like is not None:
            check_like(x, like, f"{name}[{index}]", like_name, shape=same_shape)
    if output:
        check_disjoint([(f"{name}[{index}]", x) for index, x in enumerate(xs)])
    return xs


def check_disjoint(outputs: Sequence[tuple[str, Any]]) -> None:
    """Refuse arrays a collective writes that share memory (``[buf] * n``): ``ValueError``.

    ``outputs`` are ``(name, array)`` pairs. The collective would write every entry into the
    same memory, leaving each holding the last rank's data; ``comm``'s overlap test
    (:func:`~cupy_parallel._src.arrays.check_outs`) says so instead.
    """
    check_outs(outputs, (), "this collective")


def list_given(xs: Any) -> bool:
    """Whether an optional list argument was given (``None`` and ``[]`` mean not, as in torch)."""
    return xs is not None and not (isinstance(xs, list | tuple) and len(xs) == 0)


def check_same_device(xs: Sequence[Any], ref: Any, name: str, ref_name: str) -> None:
    """Check that every array of ``xs`` lives on ``ref``'s device."""
    device = device_of(ref)
    for index, x in enumerate(xs):
        if device_of(x) != device:
            raise ValueError(
                f"{name}[{index}] is on {device_of(x)} but {ref_name} is on {device}; "
                "every array of the call must live on one device."
            )


def check_reduction(backend: ProcessGroupBackend, dtype: Any, op: Any) -> None:
    """Check ``op`` (a ``ReduceOp`` the backend has) and that it can reduce ``dtype``.

    A pair that passed is remembered by the backend (``reductions_passed``): the checks
    depend on nothing else, and a loop's calls pass the same pair.
    """
    if type(op) is ReduceOp and (dtype, op) in backend.reductions_passed:
        return
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
    if op in _ORDERED and np.dtype(dtype).kind == "c":
        raise ArgumentError(  # a TypeError, and torch's ValueError
            f"ReduceOp.{op.name} is not defined for complex dtype {dtype} (complex numbers "
            "have no order); reduce abs() or the real and imaginary parts separately."
        )
    if op in _NOT_ON_COMPLEX and np.dtype(dtype).kind == "c":
        raise ArgumentError(  # a TypeError, and torch's ValueError
            f"ReduceOp.{op.name} is not supported on complex dtype {dtype}, as in torch (which "
            f"refuses it: 'does not support RedOpType.{op.name} on complex tensors'); "
            + (
                "gather the arrays (all_gather) and multiply them on each rank."
                if op is ReduceOp.PRODUCT
                else "reduce an integer view of the bits (x.view(np.int32 or np.int64))."
            )
        )
    backend.check_dtype(dtype, op)
    backend.reductions_passed.add((dtype, op))


_ORDERED = frozenset({ReduceOp.MIN, ReduceOp.MAX})
_NOT_ON_COMPLEX = frozenset({ReduceOp.PRODUCT, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
"""What torch refuses on complex tensors besides the orders: the product and the bitwise ops."""


def check_data(backend: ProcessGroupBackend, x: Any, name: str, *, output: bool = True) -> None:
    """Check an array that is moved (not reduced): the array, then its dtype."""
    check_array(backend, x, name, output=output)
    backend.check_dtype(x.dtype, None)


def check_member_list(
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
    check_arrays(backend, xs, name, length=length, like=like, like_name=like_name, output=output)
    ref, ref_name = on or (like, like_name)
    check_same_device(xs, ref, name, ref_name)
    return xs


def check_lists(
    backend: ProcessGroupBackend,
    lists: Any,
    name: str,
    *,
    length: int,
    inner: Callable[[int, Any, str], None],
    output: bool,
) -> Sequence[Sequence[Any]]:
    """A list of ``length`` lists of arrays; ``inner(i, lists[i], "name[i]")`` checks each.

    ``output=True``: the collective writes them, so no two arrays of all the lists may share
    memory (``[[buf]] * n`` is refused as ``[buf] * n`` is).
    """
    read_sequence(lists, name, expected="a list of lists of arrays", lists_only=True)
    if len(lists) != length:
        raise CheckedValueError(f"{name} must hold {length} lists, got {len(lists)}.")
    for i, xs in enumerate(lists):
        inner(i, xs, f"{name}[{i}]")
    if output:
        check_disjoint(
            [(f"{name}[{i}][{k}]", x) for i, xs in enumerate(lists) for k, x in enumerate(xs)]
        )
    return lists


def chunk_views(x: Any, count: int, name: str, like: Any, like_name: str) -> list[Any]:
    """``x`` (shape ``(count * n, ...)`` or ``(count, n, ...)``) as ``count`` views like ``like``.

    PyTorch 2's ``*_tensor`` collectives accept both: chunks concatenated along dimension 0 or
    stacked along a new one.
    """
    check_like(x, like, name, like_name, shape=False)
    shape = like.shape
    stacked = (count, *shape)
    concatenated = (count * shape[0], *shape[1:]) if shape else None
    if x.shape not in (stacked, concatenated):
        expected = f"{stacked}" + (f" or {concatenated}" if concatenated else "")
        raise CheckedValueError(
            f"{name} must have shape {expected} ({count} chunks shaped as {like_name}, "
            f"{shape}), got {x.shape}."
        )
    views = x.reshape(stacked)
    return [views[r] for r in range(count)]
