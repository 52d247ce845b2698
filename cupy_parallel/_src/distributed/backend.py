"""The interface a communication backend implements: :class:`ProcessGroupBackend`.

The public functions of :mod:`cupy_parallel.distributed` check everything once (group membership,
ranks, array types, shapes, dtypes, in-place targets, the reduction), translate global ranks to
ranks inside the group, and then call one *primitive* of the group's backend object. A backend
therefore never validates user input beyond what only it knows (:meth:`check_dtype`), and never
sees global ranks or ``None`` groups.

Conventions every primitive follows:

* Arrays arrive validated: C-contiguous, of a device kind in :attr:`array_kinds`; in one call they
  share dtype and shape unless stated otherwise. ``root``/``src``/``dst`` are ranks *in the group*.
* Multi-device forms come for free: each primitive takes a *list* of local arrays, one per local
  device (torch's ``*_multigpu``); the single-array functions pass a list of one. With ``L`` local
  arrays per process and ``n = self.size`` processes there are ``n * L`` participants; participant
  ``r * L + j`` is local array ``j`` of group rank ``r``.
* Every primitive starts the operation and returns a :class:`~.work.Work` at once (or after
  finishing it, for backends without asynchronous progress). Results must be in the output arrays
  once ``Work.wait()`` returned; register copies-back with ``Work.add_finalizer``.
* ``Work.wait(None)`` must end by :attr:`timeout` (seconds): a backend's work either completes,
  fails with an error, or times out (see :class:`~.work.Work`).
* ``ReduceOp`` is mapped to the backend's constant through one dict in the backend module.
  ``ReduceOp.AVG`` is the sum divided by the number of participants ``n * L`` (integers: the
  exact mean rounded toward zero, summed where the sum cannot wrap:
  :mod:`cupy_parallel._src.averages`).

A backend class is listed in ``cupy_parallel._src.distributed.groups._BACKENDS`` (a table from
:class:`~cupy_parallel._src.enums.Backend` to ``(module, class name)``, imported lazily);
everything else the group
layer needs to know about it is on the class (:attr:`ProcessGroupBackend.needs_store`,
:meth:`ProcessGroupBackend.unavailable_reason`), so a new backend touches only that table.

After a timeout the group cannot be used any more: the backend (or its ``Work._on_timeout``) sets
:attr:`ProcessGroupBackend.failure` to a sentence saying what happened, and the public layer
refuses every later call on the group with ``RuntimeError`` quoting it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, cast

from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    import numpy as np

    from cupy_parallel._src.distributed.work import Work
    from cupy_parallel._src.enums import Backend

__all__ = [
    "ProcessGroupBackend",
    "disagreeing",
    "per_rank",
]


def disagreeing(values: Sequence[Hashable], ranks: Sequence[int]) -> str:
    """Which ranks differ from a strict majority (or all, without one), for error messages.

    ``values[i]`` is what rank ``ranks[i]`` passed.

    Example:
        >>> disagreeing([0, 0, 1], [4, 5, 6]), disagreeing([0, 1], [0, 1])
        ('ranks [6] differ from the rest', 'ranks [0, 1] disagree (no majority)')
    """
    majority = max(set(values), key=values.count)
    if 2 * values.count(majority) > len(values):
        differ = [r for r, v in zip(ranks, values, strict=True) if v != majority]
        return f"ranks {differ} differ from the rest"
    return f"ranks {list(ranks)} disagree (no majority)"


def per_rank(values: Sequence[object], ranks: Sequence[int]) -> str:
    """What each rank passed, for error messages: ``values[i]`` is rank ``ranks[i]``'s.

    Example:
        >>> per_rank(["float32", "int32"], [4, 5])
        'rank 4: float32; rank 5: int32'
    """
    return "; ".join(f"rank {r}: {v}" for r, v in zip(ranks, values, strict=True))


class ProcessGroupBackend(abc.ABC):
    """One process group's communicator, seen from this process (torch's ``ProcessGroup``).

    Attributes:
        rank: This process's rank in the group, ``0 <= rank < size``.
        size: The number of processes in the group.
        timeout: Seconds after which a waiting operation raises ``TimeoutError``.
        group_name: The group's name, used in error messages.
        failure: ``None``, or why the group became unusable (set by the backend).

    Subclasses set :attr:`backend` and :attr:`array_kinds` and implement the constructors
    :meth:`create_world` and :meth:`new_subgroup`, :meth:`check_dtype`, :meth:`shutdown` and the
    primitives below.

    Example:
        >>> sorted(ProcessGroupBackend.__abstractmethods__)[:3]
        ['all_gather', 'all_gather_coalesced', 'all_reduce']
    """

    #: The :class:`~cupy_parallel._src.enums.Backend` member this class implements.
    backend: ClassVar[Backend]
    #: Device kinds (``"cpu"``, ``"host"``, ``"cuda"``) whose arrays this backend communicates.
    array_kinds: ClassVar[frozenset[str]]
    #: Whether ranks meet through a store (``init_method``/``store``) before :meth:`create_world`;
    #: ``False``: the backend finds its peers itself (MPI's ``COMM_WORLD``).
    needs_store: ClassVar[bool] = True
    #: The largest ``tag`` users may give :meth:`send`/:meth:`recv` (MPI: ``TAG_UB - 1``); the
    #: tag above it is reserved for ``monitored_barrier``.
    max_tag: int = 2**31 - 2
    #: The reductions the backend has; ``all_reduce`` refuses the others before communicating.
    #: (A tuple: membership tests by identity, cheaper than hashing an enum on the hot path.)
    reduce_ops: ClassVar[tuple[ReduceOp, ...]] = (
        ReduceOp.SUM,
        ReduceOp.PRODUCT,
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.AVG,
    )
    #: ``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL``: compare every collective's arguments first.
    detail: bool = False

    def __init__(self, rank: int, size: int, *, timeout: float, group_name: str) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.group_name = group_name
        self.failure: str | None = None
        #: The ``(dtype, op)`` pairs the public layer's reduction checks passed on this group.
        self.reductions_passed: set[tuple[Any, ReduceOp]] = set()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} group {self.group_name!r}: rank {self.rank} of {self.size}>"

    # --------------------------------------------------------------------------- life cycle

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool:
        """Whether the backend's libraries can be loaded here (never raises)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend cannot be used here (what is missing, how to get it), or ``None``."""
        return None if cls.is_available() else f"{cls.__name__} cannot be loaded."

    @classmethod
    @abc.abstractmethod
    def create_world(
        cls, *, rank: int, world_size: int, store: Any, timeout: float, group_name: str
    ) -> ProcessGroupBackend:
        """The default group of every process, called once by ``init_process_group``.

        For store-based backends (NCCL) ``store`` is a connected store every rank of the world has
        reached (``wait_for_world`` has returned) and ``rank``/``world_size`` are known. MPI gets
        ``store=None`` and ``-1`` or the user's values for ``rank``/``world_size``, which it checks
        against ``MPI.COMM_WORLD`` (raising ``ValueError`` on a mismatch).
        """

    @abc.abstractmethod
    def new_subgroup(
        self, ranks: Sequence[int], *, timeout: float, group_name: str, local: bool = False
    ) -> ProcessGroupBackend | None:
        """A group of the world ranks ``ranks`` (sorted, distinct); called on the world group.

        Every world rank calls it, in the same order; members get their backend object, the
        others ``None``. With ``local=True`` (``use_local_synchronization``) only the members
        call it, and ``group_name`` is the same on every member. The group rank of world rank
        ``ranks[i]`` is ``i``. Must not block past ``timeout`` seconds waiting for peers (raise
        ``TimeoutError``).
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the communicator; the object is not used afterwards."""

    @abc.abstractmethod
    def check_dtype(self, dtype: np.dtype[Any], op: ReduceOp | None, /) -> None:
        """Raise ``TypeError`` unless arrays of ``dtype`` can be communicated (and reduced).

        ``op`` is the reduction, or ``None`` for data movement. Called by the public layer before
        any communication; the message names the dtype and what would work.
        """

    # --------------------------------------------------------------------------- collectives

    @abc.abstractmethod
    def broadcast(self, arrays: Sequence[Any], root: int, root_index: int, /) -> Work:
        """Every array of every rank receives ``arrays[root_index]`` of rank ``root``."""

    @abc.abstractmethod
    def all_reduce(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """Every array of every rank receives the reduction over all participants' arrays."""

    def all_reduce_now(self, x: Any, op: ReduceOp, /) -> None:
        """``all_reduce([x], op)`` waited on: a synchronous call of one host array.

        The public layer's quick path (``async_op=False``, a NumPy or host array, checked). A
        backend may finish it without building the :class:`~.work.Work` the general path waits
        on, keeping every check and the timeout; by default it is exactly that path.
        """
        self.all_reduce([x], op).wait()

    @abc.abstractmethod
    def reduce(self, arrays: Sequence[Any], root: int, root_index: int, op: ReduceOp, /) -> Work:
        """``arrays[root_index]`` of rank ``root`` gets the reduction; other arrays keep theirs."""

    @abc.abstractmethod
    def all_gather(self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], /) -> Work:
        """``outputs[i][r * L + j]`` receives ``inputs[j]`` of rank ``r``, for every local ``i``.

        ``outputs[i]`` lives on the device of ``inputs[i]`` and has ``size * L`` arrays shaped as
        the inputs.
        """

    @abc.abstractmethod
    def gather(self, outputs: Sequence[Any] | None, input: Any, root: int, /) -> Work:
        """``outputs[r]`` of rank ``root`` receives ``input`` of rank ``r``.

        ``outputs`` is ``None`` on the other ranks.
        """

    @abc.abstractmethod
    def scatter(self, output: Any, inputs: Sequence[Any] | None, root: int, /) -> Work:
        """``output`` of rank ``r`` receives ``inputs[r]`` of rank ``root``.

        ``inputs`` is ``None`` on the other ranks.
        """

    @abc.abstractmethod
    def reduce_scatter(
        self, outputs: Sequence[Any], inputs: Sequence[Sequence[Any]], op: ReduceOp, /
    ) -> Work:
        """``outputs[j]`` of rank ``r`` receives a reduction over all participants.

        It reduces ``inputs[i][r * L + j]`` over every local ``i`` of every rank
        (``L = len(outputs)``; ``inputs[i]`` has ``size * L`` arrays and lives on the device of
        ``outputs[i]``).
        """

    @abc.abstractmethod
    def all_to_all(self, outputs: Sequence[Any], inputs: Sequence[Any], /) -> Work:
        """``outputs[r]`` receives ``inputs[self.rank]`` of rank ``r``.

        One dtype for all arrays; shapes may differ between peers (each pair agrees on its own).
        """

    def agree(self, record: bytes, /) -> list[bytes] | None:
        """Every group member's ``record``, in group-rank order (the debug mode's comparison).

        ``None`` when the backend cannot exchange them (the comparison is then skipped). Must
        not block past :attr:`timeout` and must not match any user communication.
        """
        del record
        return None

    @abc.abstractmethod
    def barrier(self) -> Work:
        """Completes once every rank of the group has entered the barrier."""

    @abc.abstractmethod
    def send(self, array: Any, dst: int, tag: int, /) -> Work:
        """Send ``array`` to group rank ``dst``, matched by a receive with the same ``tag``."""

    @abc.abstractmethod
    def recv(self, array: Any, src: int | None, tag: int, /) -> Work:
        """Receive into ``array`` from group rank ``src`` (any rank when ``None``).

        The returned work records the sender with ``Work.set_source(group_rank)`` before it
        reports completion.
        """

    def batch_p2p(self, ops: Sequence[tuple[bool, Any, int | None, int, str]], /) -> list[Work]:
        """Start the sends and receives of one ``batch_isend_irecv``; one work each, in order.

        ``ops`` holds ``(receive, array, peer, tag, name)``, ``peer`` a group rank and ``name``
        the entry's name for messages. By default each starts as :meth:`send`/:meth:`recv`
        would; a backend whose sends and receives must progress together to complete (NCCL)
        issues them as one launch.
        """
        return [
            self.recv(array, peer, tag) if receive else self.send(array, cast("int", peer), tag)
            for receive, array, peer, tag, _ in ops
        ]

    @abc.abstractmethod
    def all_reduce_coalesced(self, arrays: Sequence[Any], op: ReduceOp, /) -> Work:
        """``all_reduce`` of every array of the list, in as few communications as possible.

        The arrays share one device; dtypes and shapes may differ.
        """

    @abc.abstractmethod
    def all_gather_coalesced(
        self, outputs: Sequence[Sequence[Any]], inputs: Sequence[Any], /
    ) -> Work:
        """``outputs[r][k]`` receives ``inputs[k]`` of rank ``r``.

        The arrays share one device; dtypes and shapes may differ between ``k``.
        """
