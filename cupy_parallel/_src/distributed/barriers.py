"""Barriers: ``barrier``, and ``monitored_barrier`` (PyTorch 2), which names the late ranks."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_timeout
from cupy_parallel._src.distributed.dispatch import Call, backend_of, run
from cupy_parallel._src.distributed.groups import register_method

if TYPE_CHECKING:
    from datetime import timedelta

    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = ["barrier", "monitored_barrier"]


@overload
def barrier(
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
    *,
    timeout: float | timedelta | None = None,
) -> None: ...
@overload
def barrier(
    group: ProcessGroup | None,
    async_op: Literal[True],
    *,
    timeout: float | timedelta | None = None,
) -> Work: ...
@overload
def barrier(
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
    timeout: float | timedelta | None = None,
) -> Work: ...
@overload
def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | timedelta | None = None,
) -> Work | None: ...
def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    timeout: float | timedelta | None = None,
) -> Work | None:
    """Wait until every rank of the group has called ``barrier``.

    ``timeout`` (seconds or a ``datetime.timedelta``; torch's ``BarrierOptions.timeout``): how
    long the barrier waits before it raises ``TimeoutError`` naming the group (the default is
    the group's timeout). On the ``"mpi"`` backend the barrier keeps running then and the group
    stays usable, as after ``Work.wait(timeout=...)``. With ``async_op=True`` give it to the
    returned work's ``wait(timeout=...)`` instead (both at once is refused, not ignored).

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.barrier(async_op=True).wait()
        True
        >>> dist.barrier(timeout=5)
        >>> dist.destroy_process_group()
    """
    limit = None if timeout is None else read_timeout(timeout)

    def prepare(pg: ProcessGroup, backend: ProcessGroupBackend) -> Call:
        return Call(backend.barrier, (), (), [])

    if limit is None:
        return run("barrier", group, async_op, prepare)
    if read_bool(async_op, "async_op"):
        raise ValueError(
            f"barrier got timeout={timeout!r} and async_op=True; pass the timeout to the "
            "returned work's wait(timeout=...) instead."
        )
    work = run("barrier", group, async_op=True, prepare=prepare)
    if work is not None:
        work.wait(timeout=limit)
    return None


def monitored_barrier(
    group: ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (PyTorch 2).

    Group rank 0 waits for a message from every other rank, then releases them. If some rank
    does not arrive in time, rank 0 raises ``RuntimeError`` naming the first such rank (every
    such rank with ``wait_all_ranks=True``), and the other ranks raise ``RuntimeError`` when
    rank 0 does not release them. Pending receives are cancelled, and the messages carry the
    call's number, so the group stays usable: a late rank's arrival, or a release that came
    after its rank gave up, is dropped by the next call (torch's gloo closes the pair instead,
    and the later calls fail).
    Host backends only (it uses point-to-point messages on host arrays), as torch's is gloo's.

    Args:
        group: The process group (default: the world).
        timeout: Seconds or a ``datetime.timedelta`` (0 allowed, as in torch: the ranks not
            arrived yet are missing at once); default: the group's timeout.
        wait_all_ranks: Wait for every rank and name all the missing ones.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> dist.monitored_barrier(timeout=5)
        >>> dist.destroy_process_group()
    """
    resolved = backend_of(group, "monitored_barrier")
    if resolved is None:
        return
    pg, backend = resolved
    # 0 s is allowed (torch's): rank 0 gives up at once on a rank not arrived yet
    limit = backend.timeout if timeout is None else read_timeout(timeout, positive=False)
    every = read_bool(wait_all_ranks, "wait_all_ranks")
    if "cpu" not in backend.array_kinds:
        raise NotImplementedError(
            f"monitored_barrier needs a host backend; the {backend.backend.value!r} backend "
            "moves device arrays only (use barrier())."
        )
    tag = backend.max_tag + 1
    deadline = time.monotonic() + limit
    call = _CALLS[backend] = _CALLS.get(backend, 0) + 1
    if backend.rank != 0:
        backend.send(np.array([call], np.int64), 0, tag).wait()
        if not _receive(backend, 0, tag, call, deadline):
            raise RuntimeError(
                f"monitored_barrier on process group {pg.name!r}: rank {pg.ranks[0]} did not "
                f"release this rank ({pg.ranks[backend.rank]}) within {limit:g} s (some rank "
                "did not arrive; rank 0 names it)."
            )
        return
    missing = []
    for r in range(1, backend.size):
        if not _receive(backend, r, tag, call, deadline):
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
        backend.send(np.array([call], np.int64), r, tag).wait()


_CALLS: weakref.WeakKeyDictionary[ProcessGroupBackend, int] = weakref.WeakKeyDictionary()
"""How many ``monitored_barrier`` calls this rank made on each group (its messages' number)."""


def _receive(
    backend: ProcessGroupBackend, source: int, tag: int, call: int, deadline: float
) -> bool:
    """Receive ``source``'s message of call number ``call`` by ``deadline``; ``False``: none came.

    Messages of earlier calls are dropped: a rank that arrives after rank 0 gave up on a call
    still sends its arrival, and rank 0's release of a call may reach a rank that gave up on
    it; both stay queued, and the next call must not take them for its own (it did: rank 0's
    next barrier returned before the late rank had entered it). Between two ranks, messages on
    one tag arrive in the order sent, so no later call's message comes before this one's.
    """
    message = np.zeros(1, np.int64)
    while backend.recv(message, source, tag).wait_or_cancel(deadline):
        if message[0] == call:
            return True
    return False


def _barrier_method(pg: ProcessGroup) -> Work:
    work = barrier(pg, async_op=True)
    assert work is not None  # a ProcessGroup object: this rank is a member
    return work


register_method("barrier", _barrier_method)
register_method("monitored_barrier", monitored_barrier)
