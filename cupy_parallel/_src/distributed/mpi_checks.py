"""The MPI backend's always-on argument comparisons, and their messages when the ranks disagree.

MPI pairs a communicator's collectives in the order each rank issues them and trusts the ranks
to pass matching arguments; when they do not, its result is undefined, silently: one rank's
array overwrites the root's, a reduction reads another dtype's bytes or a peer's stale buffer,
a receiver expecting more than is sent keeps zeros. So every collective of the MPI backend
(``barrier`` aside, which passes nothing) has the ranks compare what they passed, beside the
operation, and finishes only once they agree:

* the thread that issued it (its name, and how many collectives that thread has issued on the
  group): two threads issuing on one group at once issue in no set order across the ranks, so
  one rank's call from thread A pairs with another's from thread B (see :func:`caller_fields`);
* the operation (an ``all_reduce`` never pairs with a ``broadcast``);
* the root of ``broadcast``/``reduce``/``gather``/``scatter``, and the reduction (``ReduceOp``);
* the arrays: how many, the dtype, the number of elements, and their shapes (a checksum);
* for ``all_to_all`` (and ``all_to_all_single``), the bytes each rank sends to and expects from
  each other rank, and the dtype.

Ranks that disagree get ``ValueError`` naming them, on every rank, and the group is unusable
(MPI may have written the arrays already, or may never finish: the job is aborted at exit).
torch's gloo refuses a size mismatch the same way ("Received data size doesn't match").

The backend's work runs the exchange: an ``Iallgather`` of one row of ``int64`` per rank
(:class:`Comparison`'s first item) on the group's control communicator, overlapping the
operation; this module says what each rank sends and what the rows of every rank mean.

Cost: a second collective beside every operation, and the Python that makes and reads its rows.
A 4 KiB ``all_reduce`` on the 2-core development machine, ``python -m
benchmarks.bench_collectives`` (fastest of many rounds), before and after the rows were made
once per call signature (:class:`Caller`) and the exchange's own request ``Test`` polled, two
alternated runs each: 2 ranks, mpi4py + 10.3 and + 11.7 us before, + 8.5 and + 9.2 us after
(the 10 us target met); 4 ranks sharing the 2 cores, + 59 and + 60 us before, + 48 and + 48 us
after (missed). On those 4 ranks the second collective alone, in C, already costs more than
the target: mpi4py's ``Iallreduce`` with an ``Iallgather`` of the rows beside it, + 18 us over
the ``Iallreduce`` alone; with a persistent ``Allgather_init`` request, + 12 us; and the pair
against mpi4py's ``Allreduce``, + 14.6 us with the rows and + 14.0 us with the smallest
comparison there is (a 16-byte ``Iallreduce(MIN)`` of a fingerprint and its negation): a
second collective costs its round of messages, not its bytes. ``bench_collectives`` reports
that floor in each run. Earlier alternatives, no better: an ``Iallreduce(MAX)`` of
``[row, -row]``; the rows on the group's own communicator ahead of the operation, with a small
``all_reduce``'s data inside them so that it needs no second collective (+ 16.9 us on 2 ranks,
+ 96.7 on 4).
"""

from __future__ import annotations

import functools
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.distributed.backend import disagreeing, per_rank
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    # What a rank sends, and what says how every rank's rows disagree (None: they agree).
    Comparison = tuple[np.ndarray, Callable[[np.ndarray], str | None]]

__all__ = [
    "OPERATIONS",
    "Caller",
    "caller_fields",
    "compare_call",
    "compare_counts",
    "dtype_row",
    "dtype_said",
]

# The collectives the ranks compare, by number (the first field of every row).
OPERATIONS = (
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)
_OPERATION_NUMBERS = {name: number for number, name in enumerate(OPERATIONS)}
_OP_NUMBERS = {op: number for number, op in enumerate(ReduceOp)}
_OPS = list(ReduceOp)
_NAME_BYTES = 32  # of a thread's name, for the message (its checksum compares all of it)
_CALLER_SIZE = 2 + _NAME_BYTES // 8 + 1  # a row's caller: caller_fields, then its calls


def caller_fields(name: str, /) -> tuple[int, ...]:
    """A thread's name as the ranks compare it: checksum, length and its first 32 bytes.

    The ranks compare the name of the thread that issued each collective, and how many that
    thread had issued on the group: in a program whose ranks issue a group's collectives in
    one order, these agree (the main thread is ``MainThread`` everywhere, and threads made
    without a name are numbered in the order they are made); when threads race, the first call
    that pairs two threads' calls has different names. Threads of one process that issue on one
    group must have different names.

    Example:
        >>> caller_fields("MainThread")[1]
        10
    """
    encoded = name.encode()
    head = np.zeros(_NAME_BYTES, np.uint8)
    head[: min(len(encoded), _NAME_BYTES)] = np.frombuffer(encoded[:_NAME_BYTES], np.uint8)
    return (zlib.crc32(encoded), len(encoded), *head.view(np.int64).tolist())


def _caller_said(fields: Sequence[int]) -> str:
    length = fields[1]
    head = np.array(fields[2 : 2 + _NAME_BYTES // 8], np.int64).view(np.uint8).tobytes()
    name = head[: min(length, _NAME_BYTES)].decode(errors="replace")
    more = "..." if length > _NAME_BYTES else ""
    return f"thread {name!r}{more}, its call {fields[-1]}"


def dtype_row(dtype: np.dtype[Any]) -> list[int]:
    """A dtype as the ranks compare it: number, item size and a checksum of its spelling.

    The number and item size name it (:func:`dtype_said`); the spelling holds the byte order
    and the unit.
    """
    return [dtype.num, dtype.itemsize, zlib.crc32(dtype.str.encode())]


def dtype_said(number: int, itemsize: int) -> str:
    """The name of a dtype the ranks compared by ``dtype.num`` and ``dtype.itemsize``."""
    dtype = _DTYPES_BY_NUMBER.get(number)
    name = dtype.name if dtype is not None else f"dtype number {number}"
    if dtype is None or dtype.kind in "SUVMm":  # flexible, or with a unit: say the item size
        name = f"{name} ({itemsize}-byte items)"
    return name


_DTYPES_BY_NUMBER: dict[int, np.dtype[Any]] = {
    np.dtype(code).num: np.dtype(code) for code in np.typecodes["All"]
}


def _verify_call(every: np.ndarray, world: Sequence[int], start: int) -> str | None:
    """What the ranks disagree on in the thread and the operation (fields up to ``start``)."""
    callers = [tuple(row) for row in every[:, 1:start].tolist()]
    if callers.count(callers[0]) != len(callers):
        said = per_rank([_caller_said(c) for c in callers], world)
        return (
            f"{disagreeing(callers, world)} in the thread that issued it ({said}): MPI pairs "
            "a group's collectives in the order each rank issues them, and threads issuing on "
            "one group at once issue in no set order across the ranks, so one thread's call "
            "met another's. Issue a group's collectives from one thread at a time, in the same "
            "order on every rank, or give each thread a group of its own (new_group)."
        )
    operations = every[:, 0].tolist()
    if operations.count(operations[0]) != len(operations):
        said = per_rank([OPERATIONS[n] for n in operations], world)
        return (
            f"{disagreeing(operations, world)} in the collective they called ({said}). Every "
            "rank must call a group's collectives in the same order."
        )
    return None


class Caller:
    """A thread issuing collectives on one group, as the ranks compare it (one per thread).

    ``fields``: :func:`caller_fields` of its name; ``calls``: how many collectives it has issued
    on the group, the current one included; ``rows``: :func:`compare_call`'s rows made for it,
    by call (the group's world and this thread fixed, a row differs between two calls alike
    only in ``calls``).
    """

    __slots__ = ("calls", "fields", "rows")

    def __init__(self, name: str, /) -> None:
        self.fields = caller_fields(name)
        self.calls = 0
        self.rows: dict[Any, Comparison] = {}

    def numbered(self) -> tuple[int, ...]:
        """``fields`` and ``calls``: the caller as a row holds it."""
        return (*self.fields, self.calls)


def compare_call(
    operation: str,
    caller: Caller,
    arrays: Sequence[Any],
    world: Sequence[int],
    /,
    *,
    root: int = -1,
    op: ReduceOp | None = None,
) -> Comparison:
    """What the ranks exchange to compare a collective's call: thread, operation, root, arrays.

    ``caller``: the issuing thread, counting this call. ``world`` holds the group's ranks as
    global ranks, for the messages. ``arrays``: the call's local arrays (one, or one per local
    device, or a coalesced call's); their number, dtype (the first's), total elements and
    shapes and dtypes (a checksum) must agree, as must ``root`` (group rank; ``-1``: not rooted)
    and ``op``. A call of one array is made into a row once per thread, operation, root, op,
    dtype and shape, then copied with the call's number: a loop's calls cost a copy each.
    """
    first = arrays[0]
    key = (operation, root, op, first.dtype, first.shape) if len(arrays) == 1 else None
    made = caller.rows.get(key)
    if made is None:
        made = _call_row(_call_fields(operation, arrays, root, op), caller.fields, world)
        if key is not None:
            if len(caller.rows) >= _ROWS_KEPT:
                caller.rows.clear()
            caller.rows[key] = made
    template, verify = made
    mine = template.copy()
    mine[_CALLS] = caller.calls
    return mine, verify


_ROWS_KEPT = 1024  # rows a caller keeps (one per call signature; cleared when full)
_CALLS = _CALLER_SIZE  # a row's index of the caller's calls (after the operation, caller_fields)


def _call_row(call: Sequence[int], fields: Sequence[int], world: Sequence[int]) -> Comparison:
    """:func:`compare_call`'s row with ``calls`` at 0, and what says how every rank's differ.

    ``call``: :func:`_call_fields`; ``fields``: the caller's :func:`caller_fields`.
    """
    row = np.array((call[0], *fields, 0, *call[1:]), np.int64)
    return row, functools.partial(_verify_arrays, world, 1 + _CALLER_SIZE)


def _verify_arrays(world: Sequence[int], start: int, every: np.ndarray) -> str | None:
    """What the ranks' :func:`compare_call` rows disagree on, or ``None``."""
    problem = _verify_call(every, world, start)
    if problem is not None:
        return problem
    roots = every[:, start].tolist()
    if roots.count(roots[0]) != len(roots):
        named = per_rank([world[r] for r in roots], world)
        return (
            f"{disagreeing(roots, world)} in the root they named (src/dst, as global "
            f"ranks: {named}). Every rank must pass the same root."
        )
    ops = every[:, start + 1].tolist()
    if ops.count(ops[0]) != len(ops):
        named = per_rank([f"ReduceOp.{_OPS[n].name}" for n in ops], world)
        return (
            f"{disagreeing(ops, world)} in the reduction they passed ({named}). Every rank "
            "must pass the same op."
        )
    rows = [tuple(row) for row in every[:, start + 2 :].tolist()]
    if rows.count(rows[0]) == len(rows):
        return None
    said = [_arrays_said(*row) for row in rows]
    layout = (
        " (the same dtype and size: their shapes or byte orders differ; the debug mode "
        "CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL names the shapes)"
        if len(set(said)) == 1
        else ""
    )
    passed = per_rank(said, world)
    return (
        f"{disagreeing(rows, world)} in the array they passed{layout} ({passed}). Every "
        "rank must pass an array of the same dtype and shape."
    )


def _call_fields(
    operation: str, arrays: Sequence[Any], root: int, op: ReduceOp | None
) -> tuple[int, ...]:
    """The row of :func:`compare_call` but the caller's fields (which follow the first)."""
    first = arrays[0]
    if len(arrays) == 1:
        elements = first.size
        layout = zlib.crc32(repr(first.shape).encode())
    else:
        elements = sum(x.size for x in arrays)
        layout = zlib.crc32(repr([(x.dtype.str, x.shape) for x in arrays]).encode())
    return (
        _OPERATION_NUMBERS[operation],
        root,
        -1 if op is None else _OP_NUMBERS[op],
        len(arrays),
        first.dtype.num,
        first.dtype.itemsize,
        zlib.crc32(first.dtype.str.encode()),
        elements,
        first.ndim,
        layout,
    )


def _arrays_said(
    count: int, number: int, itemsize: int, _: int, elements: int, ndim: int, __: int
) -> str:
    dtype = dtype_said(number, itemsize)
    if count == 1:
        return f"{dtype}, {elements} elements, {ndim}-d"
    return f"{count} arrays, the first {dtype}, {elements} elements in all"


def compare_counts(
    caller: Caller,
    sends: Sequence[int],
    receives: Sequence[int],
    dtype: np.dtype[Any],
    world: Sequence[int],
    /,
) -> Comparison:
    """What the ranks exchange to compare the bytes each sends to and expects from each other.

    And the thread and operation (as :func:`compare_call`), and the dtype (each rank's inputs
    and outputs share one): bytes of another dtype, even of the same size, would be read as
    garbage.
    """
    size = len(sends)
    start = 1 + _CALLER_SIZE

    def verify(every: np.ndarray) -> str | None:
        problem = _verify_call(every, world, start)
        if problem is not None:
            return problem
        sent = every[:, start : start + size]  # [r, j]: r sends j
        expected = every[:, start + size : start + 2 * size]
        pairs = [
            f"rank {world[r]} sends {sent[r, j]} bytes to rank {world[j]}, which expects "
            f"{expected[j, r]}"
            for r in range(size)
            for j in range(size)
            if sent[r, j] != expected[j, r]
        ]
        if pairs:
            return (
                f"the ranks disagree on the sizes they exchange (global ranks): "
                f"{'; '.join(pairs)}. What rank r sends to rank j must be the size rank j "
                "expects from rank r."
            )
        dtypes = [tuple(row) for row in every[:, start + 2 * size :].tolist()]
        if dtypes.count(dtypes[0]) == len(dtypes):
            return None
        said = [dtype_said(number, itemsize) for number, itemsize, _ in dtypes]
        order = "; their byte orders differ" if len(set(said)) == 1 else ""
        passed = per_rank(said, world)
        return (
            f"{disagreeing(dtypes, world)} in the dtype they exchange ({passed}{order}). "
            "Every rank must pass arrays of one dtype."
        )

    operation = _OPERATION_NUMBERS["all_to_all"]
    mine = [operation, *caller.numbered(), *sends, *receives, *dtype_row(dtype)]
    return np.array(mine, np.int64), verify
