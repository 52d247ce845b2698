"""The MPI backend's always-on argument comparisons, and their messages when the ranks disagree.

MPI pairs a communicator's collectives in the order each rank issues them and trusts the ranks
to pass matching arguments; when they do not, its result is undefined, silently: one rank's
array overwrites the root's, a reduction reads another dtype's bytes or a peer's stale buffer,
a receiver expecting more than is sent keeps zeros. So every collective of the MPI backend
(``barrier`` too, which passes nothing but must meet a barrier) has the ranks compare what they
passed, beside the operation, and finishes only once they agree:

* the thread that issued it (its name): two threads issuing on one group at once issue in no
  set order across the ranks, so one rank's call from thread A pairs with another's from
  thread B (see :func:`caller_fields`);
* what came before it on the rank (:func:`stamp`): how many collectives the rank had started
  on the group's communicator (MPI pairs each rank's ``k``-th), and a digest of the thread and
  operation of every comparison it had sent on the group. Comparing the thread of the call
  alone is not enough once the ranks' orders differed: after a call that met another thread's
  (an error on every rank), a later call of thread A could still meet a call of thread A, but
  not the same one (A's second ``async_op=True`` call met A's first), or MPI could pair its
  data with another call's (a debug-mode comparison met another thread's collective: data
  started on one rank only); both gave wrong sums without an error (2 of 4,000 results on 2
  ranks, 6 of 6,000 on 3, two threads racing in the debug mode). Rows that agree in these say
  that every rank sent the same threads' comparisons in the same order before this one, so
  this call is the same call of the same thread on every rank, and MPI pairs its data with
  itself;
* the operation (an ``all_reduce`` never pairs with a ``broadcast``, nor with a ``barrier``: a
  barrier that compared nothing would shift the ranks' comparisons by one, so that one rank's
  next collective met another's comparison of the collective the barrier met, and returned
  what MPI made of the mismatch, on MPICH the rank's own array as an ``all_reduce``'s sum);
* the root of ``broadcast``/``reduce``/``gather``/``scatter``, and the reduction (``ReduceOp``);
* the arrays: how many, the dtype, the number of elements, and their shapes (a checksum);
* for ``all_to_all`` (and ``all_to_all_single``), the bytes each rank sends to and expects from
  each other rank, and the dtype.

Ranks that disagree get ``ValueError`` naming them, on every rank, and the group is unusable
(MPI may have written the arrays already, or may never finish: the job is aborted at exit).
torch's gloo refuses a size mismatch the same way ("Received data size doesn't match").

The backend's work runs the exchange: an ``Iallgather`` of one row per rank (:class:`Comparison`'s
first item) on the group's control communicator, overlapping the operation (a group of two sends
the row to the peer instead, which MPI pairs in the same order: ``mpi.MPIBackend._rows``); this
module says what each rank sends and what the rows of every rank mean. Every row is 20 ``int64``,
whatever the collective: ranks at different collectives still exchange rows of one size, which MPI
pairs (rows of two sizes make the exchange itself undefined: on 4 ranks an ``all_to_all``'s longer
row was read as garbage, and the error named a thread instead of the collective). ``all_to_all``'s
sizes, one per rank, travel as two fingerprints (:func:`compare_counts`), and only when those
differ do the ranks exchange the sizes themselves. A row is bytes, made once per thread and
call signature and compared as bytes: rows that agree, the common case, never become an array.

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
+ 96.7 on 4). Rows as bytes made once per call signature instead of arrays copied per call
(2026-11-26), a script timing 15 rounds of 2,000 calls on 2 ranks, the code before and after
alternated: + 12.7, 12.0, 13.6 us before, + 9.9, 9.2, 11.6 after (a world of one: 8.8 us a call
before, 7.6 after). And what no Python over mpi4py can go below on 4 ranks sharing 2 cores
(mpi4py alone, polling ``Test`` and yielding the core as the backend does): an ``Iallreduce`` + 4
to 10 us over ``Allreduce``, with an ``Iallgather`` of a row beside it + 20 to 26 us, twice the
target before any code of ours runs.

Issue 35 (2026-11-28, 2 ranks, the 4 KiB ``all_reduce``, medians of single calls after a
barrier against mpi4py's ``Allreduce`` in the same run, the 2-core machine loaded by other
jobs): one message instead of two is no cheaper from Python. The rows' ``Iallgather`` beside
the ``Iallreduce`` (this design, mpi4py alone) 1.39-1.53x; a 16-byte ``Iallreduce(MIN)`` of a
fingerprint instead 1.46-1.47x; one ``Iallgather`` of each rank's row and data, summed in
NumPy (no second collective) 1.57-1.60x, the local sum and copies costing more than the
second collective's round. What stays above that floor is Python: the backend's
``all_reduce`` and its wait took 3.6-3.8 us a call on a world of one (1.5 of them the two MPI
calls), the public layer's runner and checks 1.6 us more; 2.6-2.8x in all (three
``bench_collectives`` runs alternated with the code before the row, the verification and
every rank's rows when alike were kept per call signature: 2.81-2.98x before; fastest rounds
3.18-3.26x before, 3.00-3.09x after). The same checks, row and calls with none of the layers
between them (no runner, staging wrapper or ``Work``: a script, not the library, and without
timeouts) measured 1.89-1.90x.

Then (issue 35, same machine and estimators): a synchronous ``all_reduce`` of a host array waits
without a ``Work`` (``dispatch.all_reduce_now``, ``MPIBackend.all_reduce_now``: the same checks,
tape note, stamp and comparison, from what its thread keeps per call signature, and a ``Work`` only
for what does not finish within one stretch of spinning, so that timeouts and disagreements are as
before), and a group of two sends its rows point to point through persistent requests
(``Send_init``/``Recv_init``, any free pair of a pool; an ``Isend``/``Irecv`` when none is, which
MPI pairs alike). The floor of that exchange, mpi4py alone: 1.27-1.38x back to back, 1.21-1.23x
single calls (the ``Iallgather``'s 1.49-1.62x and 1.38-1.47x in the same runs); a plain
``Isend``/``Irecv`` 1.43x, and from the library's Python no faster than the ``Iallgather`` (async
``all_reduce``, ``broadcast`` and ``barrier`` measured 3.6x, 3.0x and 2.3x with it, 3.2x, 2.7x and
1.9x before; with the pool 3.2-3.4x, 2.5-2.8x and 1.7-2.0x). Where the microseconds of a call went,
on 2 ranks before the last trims (rank 0, timed in the loop, a clock read per phase): the caller's
loop and the public layer 0.9, the row's lookup 0.65, the ``Iallreduce`` 1.6, the stamp 0.55,
starting the rows' exchange 1.0, waiting for the rows 2.2 and for the data 1.2; about 8.5 us a call
against mpi4py's 3.6-3.9. ``mpiexec -n 2 python benchmarks/bench_collectives.py``, six runs
alternated with the code before (its medians 3.15-3.46x back to back, 2.89-3.69x single calls, two
outliers of a loaded machine aside): 1.89-2.10x back to back (median 2.00x) and 1.81-1.96x single
calls (one run 2.59x under load), the fastest rounds 1.91-2.01x (before 3.07-3.40x). What is left
is Python: a script with every layer flattened into one function (no checks skipped, no timeouts)
still saves about 0.3-0.6 us a call (0.1-0.2x).

Then (issue 35, 2026-11-29): in a group of two, a synchronous ``all_reduce`` of a host array of up
to 16 KiB sends its array behind its row, one persistent message, and each rank reduces the pair
itself in rank order (``mpi.MPIBackend._all_reduce_carried``; a peer that went the general way
sent its row alone, and this rank then starts the ``Iallreduce`` it waits for). The row is this
module's, stamped as any collective's, so the comparison says what it said. Same machine,
full ``bench_collectives`` runs alternated with the two-message code, the machine otherwise idle:
back to back 1.58-1.61x (before 1.96-1.99x), single calls after a barrier 1.60x (before
1.77-1.84x). Earlier that day, while mpi4py's own ``Allreduce`` ran 30 % slower (4.3-4.5 us
against 3.3-3.4: a busier host), the same code measured 2.01-2.12x and 2.74-3.07x (before:
2.26-2.31x and 2.83-2.97x): a single call's Python runs cold, which a busy host slows more than
mpi4py's C. mpi4py alone in the same design: 0.81-0.98x and 0.89-1.24x. Each rank's path, timed
by stage in a script in that busy stretch: the stamp 1.0-1.2 us, the copy into the message
0.8-0.9, ``Startall`` 0.9-1.1, waiting 1.2-1.5, the comparison 0.4-0.5, the reduction 0.9-1.1
(MPI's ``Reduce_local``; NumPy's ufunc in a quiet error context, kept, costs half), the layers
above the backend 1.0-1.7.
"""

from __future__ import annotations

import functools
import struct
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.distributed.backend import disagreeing, per_rank
from cupy_parallel._src.dtypes import canonical_dtype
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    # Every rank's int64 array of one length (rank r's in row r): a verification's way of
    # asking the ranks for more than their rows (every rank settles the same rows, so asks).
    # The row of a rank that did not answer within the group's timeout is -1 throughout.
    Exchange = Callable[[np.ndarray], np.ndarray]
    # What says how every rank's rows (one per row of the array) disagree, or None.
    Verify = Callable[[np.ndarray, Exchange], str | None]
    # What a rank sends (a row: _ROW_FIELDS native int64, the last two the backend's stamp),
    # and its Verify.
    Comparison = tuple[bytes, Verify]

__all__ = [
    "OPERATIONS",
    "ROW_BYTES",
    "Caller",
    "caller_fields",
    "compare_barrier",
    "compare_call",
    "compare_counts",
    "compare_digest",
    "compare_new_group",
    "dtype_row",
    "dtype_said",
    "followed",
    "history_token",
    "stamp",
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
    "barrier",
    "new_group",
    "a collective in the debug mode",  # compare_digest's rows
)
_OPERATION_NUMBERS = {name: number for number, name in enumerate(OPERATIONS)}
_OP_NUMBERS = {op: number for number, op in enumerate(ReduceOp)}
_OPS = list(ReduceOp)
_NAME_BYTES = 32  # of a thread's name, for the message (its checksum compares all of it)
_CALLER_SIZE = 2 + _NAME_BYTES // 8  # a row's caller: caller_fields


def caller_fields(name: str, /) -> tuple[int, ...]:
    """A thread's name as the ranks compare it: checksum, length and its first 32 bytes.

    The ranks compare the name of the thread that issued each collective: in a program whose
    ranks issue a group's collectives in one order, these agree (the main thread is
    ``MainThread`` everywhere, and threads made without a name are numbered in the order they
    are made); when threads race, the first call that pairs two threads' calls has different
    names. Threads of one process that issue on one group must have different names. (The
    ranks do not compare how many calls each thread made: where the names agree call by call,
    which the history of :func:`stamp` says, so do those counts, and a thread that ended and a
    new one of its name, on one rank only, made the counts differ in a program without fault.)

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
    return f"thread {name!r}{more}"


def dtype_row(dtype: np.dtype[Any]) -> list[int]:
    """A dtype as the ranks compare it: number, item size and a checksum of its spelling.

    The number and item size name it (:func:`dtype_said`); the spelling holds the byte order
    and the unit. An integer's number is its canonical C type's (:func:`canonical_dtype`): an
    ``np.longlong`` array and an ``np.int64`` one agree, as they are equal.
    """
    return [canonical_dtype(dtype).num, dtype.itemsize, zlib.crc32(dtype.str.encode())]


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


def _verify_call(every: np.ndarray, world: Sequence[int]) -> str | None:
    """What the ranks disagree on in the thread and the operation (a row's first fields)."""
    callers = [tuple(row) for row in every[:, 1:_START].tolist()]
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
    posted = every[:, _POSTED].tolist()
    if posted.count(posted[0]) != len(posted):
        said = per_rank(posted, world)
        return (
            f"{disagreeing(posted, world)} in how many collectives they had started on this "
            f"group before this one ({said}), so MPI pairs this call's data with another "
            f"call's: {_EARLIER}"
        )
    histories = every[:, _HISTORY].tolist()
    if histories.count(histories[0]) != len(histories):
        return (
            f"{disagreeing(histories, world)} in the calls they had issued on this group "
            "before this one (the threads and collectives of those calls, in order), so this "
            f"call met another call: {_EARLIER}"
        )
    return None


_EARLIER = (
    "an earlier collective of the group met another call on some ranks (and raised there), as "
    "when threads issuing on one group at once met each other's calls. Issue a group's "
    "collectives from one thread at a time, in the same order on every rank, or give each "
    "thread a group of its own (new_group)."
)


class Caller:
    """A thread issuing collectives on one group, as the ranks compare it (one per thread).

    ``fields``: :func:`caller_fields` of its name; ``rows``: :func:`compare_call`'s rows made for
    it, by call signature (the group's world and this thread fixed, two calls alike have one
    row); ``ready``: what a backend keeps beside such a row, by a key of its own (its entries
    hold rows: whoever changes ``fields`` clears both).
    """

    __slots__ = ("fields", "ready", "rows")

    def __init__(self, name: str, /) -> None:
        self.fields = caller_fields(name)
        self.rows: dict[Any, Comparison] = {}
        self.ready: dict[Any, Any] = {}


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

    ``caller``: the issuing thread. ``world`` holds the group's ranks as
    global ranks, for the messages. ``arrays``: the call's local arrays (one, or one per local
    device, or a coalesced call's); their number, dtype (the first's), total elements and
    shapes and dtypes (a checksum) must agree, as must ``root`` (group rank; ``-1``: not rooted)
    and ``op``. A call of one array is made into a row once per thread, operation, root, op,
    dtype and shape: a loop's calls cost a dictionary lookup each.
    """
    first = arrays[0]
    key = (operation, root, op, first.dtype, first.shape) if len(arrays) == 1 else None
    made = caller.rows.get(key)
    if made is None:
        number, root_field, op_field, *fields = _call_fields(operation, arrays, root, op)
        row = _row(number, caller, root=root_field, op=op_field, arrays=fields)
        made = row, functools.partial(_verify_arrays, world)
        if key is not None:
            if len(caller.rows) >= _ROWS_KEPT:
                caller.rows.clear()
            caller.rows[key] = made
    return made


def compare_barrier(caller: Caller, world: Sequence[int], /) -> Comparison:
    """What the ranks exchange beside a barrier: the thread and the operation (no arrays).

    A barrier must meet a barrier: its row is :func:`compare_call`'s, with no root, no op and
    no arrays.
    """
    made = caller.rows.get("barrier")
    if made is None:
        row = _row(_OPERATION_NUMBERS["barrier"], caller)
        made = caller.rows["barrier"] = row, functools.partial(_verify_arrays, world)
    return made


def compare_new_group(
    caller: Caller, world: Sequence[int], /, *, split: int, members: int
) -> Comparison:
    """What the world's ranks exchange before ``new_group`` splits the world's communicator.

    A row as a collective's (the thread and the operation first, so that a rank at a collective
    where the others make a group is told so, as they are), then which ``new_group`` call of
    this process this is (``split``) and a checksum of the member list (``members``).
    """
    mine = _row(_OPERATION_NUMBERS["new_group"], caller, arrays=(split, members))

    def verify(every: np.ndarray, exchange: Exchange) -> str | None:
        del exchange
        problem = _verify_call(every, world)
        if problem is not None:
            return problem
        calls = [tuple(row) for row in every[:, _ARRAYS : _ARRAYS + 2].tolist()]
        if calls.count(calls[0]) == len(calls):
            return None
        return (
            f"{disagreeing(calls, world)} in the members they passed or in which new_group call "
            "this is. Every rank must call new_group with the same ranks, in the same order."
        )

    return mine, verify


def compare_digest(caller: Caller, world: Sequence[int], /, *, digest: bytes) -> Comparison:
    """What the ranks exchange in the debug mode before a collective: a digest of the call.

    A row as a collective's (the thread and the operation first, so that a rank making a group
    where the others compare a collective is told so, as they are), with the 16-byte digest of
    the call's description in the arrays' first fields. The verification names the thread and
    the operation; digests that differ are left to the caller (which exchanges the
    descriptions themselves, to name what differs).
    """
    fields = np.frombuffer(digest, np.int64).tolist()
    row = _row(_OPERATION_NUMBERS["a collective in the debug mode"], caller, arrays=fields)

    def verify(every: np.ndarray, exchange: Exchange) -> str | None:
        del exchange
        return _verify_call(every, world)

    return row, verify


#: Rows a caller keeps (one per call signature; cleared when full).
_ROWS_KEPT = 1024
_START = 1 + _CALLER_SIZE  # a row's first field after the operation and the caller
# A row's fields after the caller: root, op, the arrays' seven (see _call_fields), the
# fingerprints of the bytes an all_to_all sends and expects (see compare_counts), then the
# backend's stamp (see stamp).
_ROOT = _START
_OP = _START + 1
_ARRAYS = _START + 2
_SENT = _ARRAYS + 7
_EXPECTED = _SENT + 1
_POSTED = _EXPECTED + 1
_HISTORY = _POSTED + 1
_ROW_FIELDS = _HISTORY + 1
#: The bytes of every row a rank sends (stamped): one size for every comparison.
ROW_BYTES = _ROW_FIELDS * 8


def _row(
    operation: int,
    caller: Caller,
    *,
    root: int = -1,
    op: int = -1,
    arrays: Sequence[int] = (),
    sent: int = 0,
    expected: int = 0,
) -> bytes:
    """A row (as MPI's ``INT64_T``): the operation, the caller, then the call's fields.

    ``arrays``: up to the seven fields of :func:`_call_fields`' arrays, the rest zero; every
    row has one size, so that any two ranks' rows pair in MPI (once :func:`stamp` added its
    last two fields).
    """
    padding = (0,) * (_SENT - _ARRAYS - len(arrays))
    row = np.array(
        (operation, *caller.fields, root, op, *arrays, *padding, sent, expected), np.int64
    )
    assert row.size == _POSTED  # every row has one size: any two ranks' rows pair in MPI
    return row.tobytes()


def stamp(row: bytes, posted: int, history: int, /) -> bytes:
    """``row`` as a rank sends it: with what came before it on the rank, its last two fields.

    ``posted``: how many collectives the rank had started on the group's communicator before
    this call (as MPI counts them: each ``MPI_I*`` call, ``Split`` too); ``history``: the
    :func:`followed` digest of every row the rank had sent on the group before this one. Rows
    that agree in both say that MPI pairs the call with the same call on every rank. The
    backend reads and advances both under the lock it starts the collective and sends the row
    under (see ``mpi._in_issue_order``). Rows are made once per call signature
    (:class:`Caller`); the stamp, which changes every call, is added to them as bytes.

    Example:
        >>> np.frombuffer(stamp(b"", 7, 5), np.int64)
        array([7, 5])
    """
    return row + _STAMP.pack(posted, history)


def history_token(row: bytes, /) -> int:
    """What ``row`` adds to a history (:func:`followed`): a checksum of its operation and thread.

    64 bits (CRC-32 and Adler-32 of those fields). Only the operation and the thread enter the
    history: rows that differ in another field raise on every rank alike, which moves no rank's
    calls against another's, and the debug mode's refusal of arguments that differ leaves the
    group usable (a history of every field would make every later call raise).

    Example:
        >>> history_token(_row(0, Caller("t"))) == history_token(_row(0, Caller("u")))
        False
    """
    head = row[: _START * 8]  # the operation and the caller
    return zlib.crc32(head) << 32 | zlib.adler32(head)


def followed(history: int, token: int, /) -> int:
    """``history`` once a row of :func:`history_token` ``token`` was sent after it.

    A polynomial hash modulo the prime ``2**61 - 1`` of the sequence of the rows' tokens: two
    ranks that sent different sequences have different histories but with a probability of
    about ``2**-61`` per call.

    Example:
        >>> followed(followed(0, 1), 2) != followed(followed(0, 2), 1)
        True
    """
    return (history * _HISTORY_BASE + token) % _HISTORY_PRIME


_STAMP = struct.Struct("=qq")  # posted and history, native int64 as the rows
_HISTORY_PRIME = (1 << 61) - 1
_HISTORY_BASE = 0x2545F4914F6CDD1D % _HISTORY_PRIME  # any number in (1, prime) would do


def _verify_arrays(world: Sequence[int], every: np.ndarray, exchange: Exchange) -> str | None:
    """What the ranks' :func:`compare_call` rows disagree on, or ``None``."""
    del exchange  # the rows hold the whole call
    problem = _verify_call(every, world)
    if problem is not None:
        return problem
    roots = every[:, _ROOT].tolist()
    if roots.count(roots[0]) != len(roots):
        named = per_rank([world[r] for r in roots], world)
        return (
            f"{disagreeing(roots, world)} in the root they named (src/dst, as global "
            f"ranks: {named}). Every rank must pass the same root."
        )
    ops = every[:, _OP].tolist()
    if ops.count(ops[0]) != len(ops):
        named = per_rank([f"ReduceOp.{_OPS[n].name}" for n in ops], world)
        return (
            f"{disagreeing(ops, world)} in the reduction they passed ({named}). Every rank "
            "must pass the same op."
        )
    rows = [tuple(row) for row in every[:, _ARRAYS:_SENT].tolist()]
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
        canonical_dtype(first.dtype).num,
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
    *,
    rank: int,
) -> Comparison:
    """What the ranks exchange to compare the bytes each sends to and expects from each other.

    And the thread and operation (as :func:`compare_call`), and the dtype (each rank's inputs
    and outputs share one): bytes of another dtype, even of the same size, would be read as
    garbage. ``rank``: this rank's in the group.

    The sizes differ from rank to rank, and a row has one size (any two ranks' rows must pair,
    even at different collectives), so a row holds two fingerprints instead: of the triples
    (this rank, ``j``, ``sends[j]``) and (``j``, this rank, ``receives[j]``), summed over ``j``.
    Their sums over the ranks are equal exactly when every rank expects what is sent to it
    (but with a probability of 2**-63); only when they differ do the ranks exchange the sizes
    themselves, to say which.
    """
    size = len(sends)
    ranks = np.arange(size, dtype=np.uint64)
    me = np.full(size, rank, np.uint64)
    arrays = (0, *dtype_row(dtype))  # the dtype; the sizes are in the fingerprints
    mine = _row(
        _OPERATION_NUMBERS["all_to_all"],
        caller,
        arrays=arrays,
        sent=_fingerprint(me, ranks, sends),
        expected=_fingerprint(ranks, me, receives),
    )

    def verify(every: np.ndarray, exchange: Exchange) -> str | None:
        problem = _verify_call(every, world)
        if problem is not None:
            return problem
        if (sum(every[:, _SENT].tolist()) - sum(every[:, _EXPECTED].tolist())) % _MODULUS:
            problem = _sizes_problem(exchange(np.array([*sends, *receives], np.int64)), world)
            if problem is not None:
                return problem
        dtypes = [tuple(row) for row in every[:, _ARRAYS + 1 : _ARRAYS + 4].tolist()]
        if dtypes.count(dtypes[0]) == len(dtypes):
            return None
        said = [dtype_said(number, itemsize) for number, itemsize, _ in dtypes]
        order = "; their byte orders differ" if len(set(said)) == 1 else ""
        passed = per_rank(said, world)
        return (
            f"{disagreeing(dtypes, world)} in the dtype they exchange ({passed}{order}). "
            "Every rank must pass arrays of one dtype."
        )

    return mine, verify


_MODULUS = 1 << 63  # of a fingerprint, so that it is a nonnegative int64


def _fingerprint(senders: np.ndarray, receivers: np.ndarray, sizes: Sequence[int]) -> int:
    """The sum of a hash of each (sender, receiver, size) triple, modulo 2**63.

    Two lists of triples with equal sums are the same triples but with a probability of about
    2**-63 (each hash is splitmix64's finalizer of the three, chained).
    """
    hashed = _mix(_mix(_mix(senders) ^ receivers) ^ np.asarray(sizes, np.uint64))
    return int(hashed.sum(dtype=np.uint64)) % _MODULUS


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise on ``uint64`` (whose products wrap)."""
    x = (x ^ (x >> 30)) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> 31)


def _sizes_problem(counts: np.ndarray, world: Sequence[int]) -> str | None:
    """Which ranks disagree on the bytes they exchange, or ``None``.

    ``counts[r]``: rank ``r``'s sends, then its receives (see :func:`compare_counts`); ``-1``
    throughout when rank ``r`` did not tell them (the fingerprints already said that the sizes
    differ: the message says so, with the pairs known to differ).
    """
    size = len(counts)
    sent = counts[:, :size]  # [r, j]: r sends j
    expected = counts[:, size:]  # [j, r]: j expects from r
    silent = [r for r in range(size) if (counts[r] < 0).all()]
    pairs = [
        f"rank {world[r]} sends {sent[r, j]} bytes to rank {world[j]}, which expects "
        f"{expected[j, r]}"
        for r in range(size)
        for j in range(size)
        if r not in silent and j not in silent and sent[r, j] != expected[j, r]
    ]
    if silent:
        ranks = [world[r] for r in silent]
        pairs.append(
            f"the sizes of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            "are unknown: it did not tell them within the group's timeout (as a rank does that "
            "has not waited on this all_to_all: one started with async_op=True and waited on "
            "only after another collective of the group, which the other ranks never reach)"
        )
    if not pairs:
        return None
    return (
        f"the ranks disagree on the sizes they exchange (global ranks): {'; '.join(pairs)}. "
        "What rank r sends to rank j must be the size rank j expects from rank r."
    )
