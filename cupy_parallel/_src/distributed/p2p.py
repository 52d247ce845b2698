"""Point-to-point messages: ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``.

``dst``/``src`` are world ranks; ``recv``/``irecv`` take any sender when ``src=None``.
``batch_isend_irecv`` starts a list of :class:`P2POp` (PyTorch 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arguments import ArgumentError, CheckedValueError, read_int
from cupy_parallel._src.distributed.dispatch import backend_of, check_data
from cupy_parallel._src.recording import note_overwritten, tapes_exist

if TYPE_CHECKING:
    from collections.abc import Callable

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.groups import ProcessGroup
    from cupy_parallel._src.distributed.work import Work

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _tag(backend: ProcessGroupBackend, tag: Any, name: str = "tag") -> int:
    tag = read_int(tag, name)
    if tag < 0:  # torch: RuntimeError "Tag must be nonnegative"
        raise CheckedValueError(f"{name} must be >= 0, got {tag}.")
    if tag > backend.max_tag:
        raise CheckedValueError(
            f"{name} must be at most {backend.max_tag} (the largest tag the "
            f"{backend.backend.value!r} backend carries), got {tag}."
        )
    return tag


def _p2p(
    tensor: Any,
    peer: Any,
    name: str,
    group: Any,
    tag: Any,
    *,
    receive: bool,
    operation: str,
    where: str = "",
) -> tuple[ProcessGroup, ProcessGroupBackend, int | None, int] | None:
    """Check a send (``receive=False``) or receive; ``peer`` (named ``name``) may be None then.

    ``operation``: the public function called, for the warning on a non-member. ``where``
    prefixes the names of ``tensor`` and ``tag`` in messages (a batch's ``p2p_op_list[i].``).
    """
    resolved = backend_of(group, operation)
    if resolved is None:
        return None
    pg, backend = resolved
    check_data(backend, tensor, f"{where}tensor", output=receive)
    tag = _tag(backend, tag, f"{where}tag")
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
    return _send(tensor, dst, group, tag, "isend")


def _send(tensor: Any, dst: Any, group: Any, tag: Any, operation: str) -> Work | None:
    checked = _p2p(tensor, dst, "dst", group, tag, receive=False, operation=operation)
    if checked is None:
        return None
    _pg, backend, local, tag = checked
    assert local is not None
    work: Work = backend.send(tensor, local, tag)
    work.outputs = [tensor]  # Work.result(), get_future(): torch's hold the tensor
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
        >>> try:  # a ValueError, and a RuntimeError as torch's "invalid rank"
        ...     dist.irecv(np.zeros(1), src=1)
        ... except ValueError as error:
        ...     print(error)
        src=1 is not a member of process group '0', whose world ranks are [0].
        >>> dist.destroy_process_group()
    """
    return _recv(tensor, src, group, tag, "irecv")


def _recv(tensor: Any, src: Any, group: Any, tag: Any, operation: str) -> Work | None:
    checked = _p2p(tensor, src, "src", group, tag, receive=True, operation=operation)
    if checked is None:
        return None
    pg, backend, local, tag = checked
    work: Work = backend.recv(tensor, local, tag)
    work.world_ranks = pg.ranks
    work.outputs = [tensor]
    if tapes_exist():
        note_overwritten([tensor], f"dist.{operation}")
    return work


def send(tensor: Array, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None:
    """Send ``tensor`` to world rank ``dst`` and wait until the buffer can be reused.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> try:  # a ValueError, and a RuntimeError as torch's "invalid rank"
        ...     dist.send(np.zeros(1), dst=3)
        ... except ValueError as error:
        ...     print(error)
        dst=3 is not a member of process group '0', whose world ranks are [0].
        >>> dist.destroy_process_group()
    """
    work = _send(tensor, dst, group, tag, "send")
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
    work = _recv(tensor, src, group, tag, "recv")
    if work is None:
        return -1
    return work.source_rank()


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
        raise ArgumentError(
            f"p2p_op_list must be a list of P2POp, got {type(p2p_op_list).__name__}."
        )
    if not p2p_op_list:
        raise ValueError("p2p_op_list must hold at least one P2POp, got an empty list.")
    checked = []
    names: list[str] = []
    for index, item in enumerate(p2p_op_list):
        if not isinstance(item, P2POp):
            raise ArgumentError(f"p2p_op_list[{index}] must be a P2POp, got {type(item).__name__}.")
        where = f"p2p_op_list[{index}]."  # messages name the entry and its field
        found = _p2p(
            item.tensor,
            item.peer,
            f"{where}peer",
            item.group,
            item.tag,
            receive=item.op is irecv,
            operation="batch_isend_irecv",
            where=where,
        )
        if found is not None:
            checked.append((item, found))
            names.append(f"p2p_op_list[{index}]")
    # One batch per backend (in the order the backends first appear): NCCL issues a backend's
    # sends and receives in one group, since a pairwise exchange or a ring completes only then.
    batches: dict[int, tuple[ProcessGroupBackend, list[int]]] = {}
    for position, (_, (_, backend, _, _)) in enumerate(checked):
        batches.setdefault(id(backend), (backend, []))[1].append(position)
    works: list[Work | None] = [None] * len(checked)
    for backend, positions in batches.values():
        ops = []
        for position in positions:
            item, (_, _, local, tag) = checked[position]
            ops.append((item.op is irecv, item.tensor, local, tag, names[position]))
        for position, started in zip(positions, backend.batch_p2p(ops), strict=True):
            works[position] = started
    for (item, (pg, _, _, _)), work in zip(checked, works, strict=True):
        if item.op is irecv and work is not None:
            work.world_ranks = pg.ranks
            if tapes_exist():
                note_overwritten([item.tensor], "dist.batch_isend_irecv")
    return [work for work in works if work is not None]
