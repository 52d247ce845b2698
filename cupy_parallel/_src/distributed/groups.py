"""Process groups: ``init_process_group``, ``new_group``, ``destroy_process_group`` and queries.

The state is a :class:`GroupState`: the *world* :class:`ProcessGroup` plus the subgroups made
from it. It is the process's own, except on a thread rank of
:func:`~cupy_parallel.distributed.spawn`, which runs in a context of its own with a fresh state
(:func:`state` reads it from a ``ContextVar`` whose default is the process's state). A
:class:`ProcessGroup` caches what every collective needs (its backend object, the world ranks of its
members and their group ranks), so a call resolves its group with a few attribute loads.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import os
import threading
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arguments import CheckedValueError, read_bool, read_int, read_timeout
from cupy_parallel._src.cuda.nccl_runtime import is_available as nccl_is_available
from cupy_parallel._src.enums import Backend, ReduceOp

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from cupy_parallel._src.distributed.backend import ProcessGroupBackend
    from cupy_parallel._src.distributed.store import Store

__all__ = [
    "GroupMember",
    "GroupState",
    "ProcessGroup",
    "debug_detail",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "new_group",
    "register_method",
    "resolve_group",
    "state",
    "use_state",
    "world_backend",
]

# Backend -> (module, class) implementing it, imported on first use.
_BACKENDS: dict[Backend, tuple[str, str]] = {
    Backend.MPI: ("cupy_parallel._src.distributed.mpi", "MPIBackend"),
    Backend.NCCL: ("cupy_parallel._src.distributed.nccl_backend", "NCCLBackend"),
}

_DEFAULT_TIMEOUT = timedelta(minutes=30)
_DEBUG_VAR = "CUPY_PARALLEL_DISTRIBUTED_DEBUG"


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


class _World(_Sentinel):
    """``group.WORLD``: names the default group, and acts as its :class:`ProcessGroup`.

    torch's ``group.WORLD`` is the default ``ProcessGroup`` itself
    (``group.WORLD.allreduce([t])``, ``group.WORLD.rank()``); here it stays one object for
    every context (each thread rank has a world of its own) and hands every attribute to the
    calling context's default group, so that it works as torch's does.
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy/pickle probing: not the group's
            raise AttributeError(name)
        return getattr(_world_group(), name)


class group:  # noqa: N801 - torch's spelling: ``group.WORLD``
    """Namespace of ``group.WORLD``, the default group (``group=None`` means it too).

    ``group.WORLD`` also acts as the default :class:`ProcessGroup` object, as torch's does:
    ``group.WORLD.allreduce([x]).wait()``, ``group.WORLD.rank()``, ``group.WORLD.size()``.

    Example:
        >>> group.WORLD
        group.WORLD
    """

    WORLD: Any = _World("group.WORLD")


class GroupMember:
    """``GroupMember.NON_GROUP_MEMBER``: what ``new_group`` returns to processes left out.

    Collectives given it do nothing and return ``None``; ``get_rank`` and ``get_world_size``
    return ``-1``.

    Example:
        >>> GroupMember.NON_GROUP_MEMBER
        GroupMember.NON_GROUP_MEMBER
    """

    WORLD: Any = group.WORLD
    NON_GROUP_MEMBER: Any = _Sentinel("GroupMember.NON_GROUP_MEMBER")


class ProcessGroup:
    """A set of processes that communicate together; made by ``new_group``.

    ``rank()``/``size()`` are this process's rank in the group and the group's size; ``ranks``
    lists the members' world ranks (a member's group rank is its position there). For the
    collectives' layer: ``live_backend()`` is the group's backend object and ``group_rank()``
    reads a world rank argument into a group rank.

    The methods of torch's ``ProcessGroup`` that torch code calls on a group object:
    :meth:`allreduce` and :meth:`barrier` (which start the operation and return its
    :class:`~cupy_parallel.distributed.Work`, as torch's do) and :meth:`monitored_barrier`.
    They are the module functions on this group; those register them here when they are
    imported (``cupy_parallel.distributed`` imports them all), since they sit above this module.

    Example:
        >>> ProcessGroup.rank.__doc__
        "This process's rank in the group."
    """

    __slots__ = ("_backend", "_group_rank", "name", "ranks")

    def __init__(self, backend: ProcessGroupBackend, ranks: tuple[int, ...], name: str) -> None:
        self._backend: ProcessGroupBackend | None = backend
        self.ranks = ranks
        self.name = name
        self._group_rank = {world: index for index, world in enumerate(ranks)}

    def rank(self) -> int:
        """This process's rank in the group."""
        return self.live_backend().rank

    def size(self) -> int:
        """The number of processes in the group."""
        return len(self.ranks)

    def live_backend(self) -> ProcessGroupBackend:
        """The group's backend object, which the collectives call; ``ValueError`` once destroyed."""
        backend = self._backend
        if backend is None:
            raise ValueError(
                f"process group {self.name!r} was destroyed; create a new one with new_group()."
            )
        return backend

    def group_rank(self, world_rank: Any, name: str = "global_rank") -> int:
        """The group rank of world rank ``world_rank``, the caller's argument ``name``.

        Raises ``ValueError`` naming ``name`` when that rank is not a member. The one reading of
        a world rank into the group: ``get_group_rank`` and every ``src``/``dst``/``peer``.
        """
        local = self._group_rank.get(world_rank) if type(world_rank) is int else None
        if local is None:
            local = self._group_rank.get(read_int(world_rank, name))
            if local is None:
                raise CheckedValueError(  # torch's backends: RuntimeError "invalid root rank"
                    f"{name}={world_rank} is not a member of process group {self.name!r}, whose "
                    f"world ranks are {list(self.ranks)}."
                )
        return local

    # torch's ProcessGroup methods, the module functions registered in _METHODS.

    def allreduce(self, tensors: Any, op: Any = ReduceOp.SUM) -> Any:
        """Start ``all_reduce`` on this group; return its ``Work`` (torch's ``pg.allreduce``).

        ``tensors``: an array, or a list of one array (``[x]``, torch's usual call), or one
        array per local device (``all_reduce_multigpu``). ``op``: a ``ReduceOp`` (torch's
        ``AllreduceOptions`` is not taken; pass its ``reduceOp``).
        """
        return _method("allreduce")(self, tensors, op)

    def barrier(self) -> Any:
        """Start a barrier on this group; return its ``Work`` (torch's ``pg.barrier()``)."""
        return _method("barrier")(self)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """``monitored_barrier`` on this group (torch's ``pg.monitored_barrier(timeout)``)."""
        _method("monitored_barrier")(self, timeout, wait_all_ranks)

    def __repr__(self) -> str:
        state = "destroyed" if self._backend is None else str(self._backend.backend)
        return f"<ProcessGroup {self.name!r} ({state}) of world ranks {list(self.ranks)}>"


# ProcessGroup's torch methods by name, registered by the modules defining the collectives.
_METHODS: dict[str, Callable[..., Any]] = {}


def register_method(name: str, implementation: Callable[..., Any], /) -> None:
    """Make ``implementation(pg, *args)`` the body of ``ProcessGroup.<name>``."""
    _METHODS[name] = implementation


def _method(name: str) -> Callable[..., Any]:
    found = _METHODS.get(name)
    if found is None:
        raise NotImplementedError(
            f"ProcessGroup.{name} needs cupy_parallel.distributed imported (it registers it)."
        )
    return found


class GroupState:
    """What ``init_process_group`` and ``new_group`` made: the world and its subgroups.

    One per process (the default), and one per thread rank of ``spawn`` (:func:`use_state`).
    """

    __slots__ = ("group_count", "local_groups", "owned_store", "spawned", "subgroups", "world")

    def __init__(self) -> None:
        self.world: ProcessGroup | None = None
        # The store init_process_group opened from init_method (not one the user passed):
        # closed with the world.
        self.owned_store: Store | None = None
        self.subgroups: list[ProcessGroup] = []
        self.group_count = 0
        # use_local_synchronization groups made, by ranks
        self.local_groups: dict[tuple[int, ...], int] = {}
        # A thread rank of spawn, whose world spawn made: init_process_group says so
        self.spawned = False


# The default is the process's state, shared by every context that did not set its own.
_PROCESS_STATE = GroupState()
_STATE: contextvars.ContextVar[GroupState] = contextvars.ContextVar(
    "cupy_parallel_groups",
    default=_PROCESS_STATE,  # one mutable state per process, on purpose
)
_SPAWN_RUNS: dict[int, frozenset[int]] = {}
"""Running spawns: ``id(run) ->`` the idents of the threads alive when it started (see
:func:`_current`); written under the GIL by :func:`spawn_running`."""


@contextlib.contextmanager
def spawn_running(run: object, /) -> Iterator[None]:
    """While ``spawn`` runs thread ranks: threads started meanwhile belong to no rank."""
    _SPAWN_RUNS[id(run)] = frozenset(t.ident for t in threading.enumerate() if t.ident)
    try:
        yield
    finally:
        del _SPAWN_RUNS[id(run)]


def _current() -> GroupState:
    """The calling context's state; refuses a thread that a thread rank started plainly.

    ``threading.Thread(target=f)`` inside a thread rank runs ``f`` in a fresh context, which
    sees the process's state: the caller's own world, if it has one, so that ``f``'s
    collectives would silently run on another world (rank 0 of 1, its all_reduce the local
    value). While a spawn runs and the process has a world, a thread that uses the process's
    state and was started after the spawn began (not the caller's, not a rank's) is taken for
    such a thread and refused. (Without a world of the process's, it is told that none is
    initialized, as before.)
    (Threads that existed before, such as a thread pool's, cannot be told apart.)
    """
    current = _STATE.get()
    if current is _PROCESS_STATE and _SPAWN_RUNS and current.world is not None:
        me = threading.get_ident()
        if all(me not in alive for alive in list(_SPAWN_RUNS.values())):
            raise RuntimeError(
                f"Thread {threading.current_thread().name!r} belongs to no rank: it was started "
                "while spawn runs thread ranks, without a rank's context, so it would use the "
                "process's own process group (another world). Start it in the rank's context: "
                "threading.Thread(target=contextvars.copy_context().run, args=(f,)) inside the "
                "rank (see spawn)."
            )
    return current


def state() -> GroupState:
    """The group state of the calling context: the process's, or a thread rank's.

    Example:
        >>> state().world is None
        True
    """
    return _current()


def use_state(fresh: GroupState, /) -> None:
    """Make ``fresh`` the group state of the current context (a thread rank's, set by spawn)."""
    _STATE.set(fresh)


def _not_initialized() -> RuntimeError:
    return RuntimeError(
        "The default process group is not initialized; call "
        "cupy_parallel.distributed.init_process_group(backend) first."
    )


def resolve_group(group: Any) -> ProcessGroup | None:
    """The group a call names (``None``: the world), or ``None`` for a non-member."""
    if group is None or group is _WORLD:
        return _world_group()
    if group is _NON_MEMBER:
        return None
    if type(group) is not ProcessGroup:
        raise TypeError(
            "group must be None, group.WORLD, GroupMember.NON_GROUP_MEMBER or a group from "
            f"new_group(), got {type(group).__name__} {group!r}."
        )
    group.live_backend()
    return group


_WORLD = group.WORLD
_NON_MEMBER = GroupMember.NON_GROUP_MEMBER


def world_backend() -> ProcessGroupBackend | None:
    """The backend of the calling context's world group, or ``None`` (none, or destroyed).

    ``resolve_group(None).live_backend()`` for a collective's quick path, in one call (the
    refusal of a thread that belongs to no thread rank included); ``None`` sends the caller
    the general way, which says what is missing.

    Example:
        >>> world_backend() is None  # no init_process_group yet
        True
    """
    current = _STATE.get()
    if current is _PROCESS_STATE and _SPAWN_RUNS:
        current = _current()
    world = current.world
    return None if world is None else world._backend


def _world_group() -> ProcessGroup:
    world = _current().world
    if world is None:
        raise _not_initialized()
    return world


def _loaded_class(backend: Backend) -> type[ProcessGroupBackend]:
    module_name, class_name = _BACKENDS[backend]
    cls: type[ProcessGroupBackend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def _backend_class(backend: Backend) -> type[ProcessGroupBackend]:
    cls = _loaded_class(backend)
    why = cls.unavailable_reason()
    if why is not None:
        raise RuntimeError(f"The {backend.value!r} backend is not available here: {why}")
    return cls


def _default_backend() -> Backend:
    """The backend ``init_process_group()`` picks when given none (see its docstring)."""
    from cupy_parallel._src.distributed.env import detect_launch_env

    named = os.environ.get("CUPY_PARALLEL_BACKEND", "").strip()
    if named:
        return Backend(named)
    if detect_launch_env().get("source", "Slurm") != "Slurm":  # started by mpiexec
        return Backend.MPI
    if is_nccl_available():
        return Backend.NCCL
    return Backend.MPI


def debug_detail() -> bool:
    """Whether ``CUPY_PARALLEL_DISTRIBUTED_DEBUG`` asks for the ``DETAIL`` checks.

    Example:
        >>> isinstance(debug_detail(), bool)
        True
    """
    level = os.environ.get(_DEBUG_VAR, "OFF").strip().upper()
    if level not in ("OFF", "INFO", "DETAIL", ""):
        raise ValueError(f"{_DEBUG_VAR} must be OFF, INFO or DETAIL, got {level!r}.")
    return level == "DETAIL"


def is_initialized() -> bool:
    """Whether ``init_process_group`` has run (and ``destroy_process_group`` has not).

    Example:
        >>> is_initialized()
        False
    """
    return _current().world is not None


def is_mpi_available() -> bool:
    """Whether the MPI backend can be used: ``mpi4py`` is installed.

    Example:
        >>> isinstance(is_mpi_available(), bool)
        True
    """
    return importlib.util.find_spec("mpi4py") is not None


def is_nccl_available() -> bool:
    """Whether the NCCL backend can be used: CuPy with NCCL support and a GPU.

    Example:
        >>> isinstance(is_nccl_available(), bool)
        True
    """
    return nccl_is_available()


def init_process_group(  # noqa: PLR0917 - torch's signature
    backend: Backend | str | None = None,
    init_method: str | None = None,
    timeout: timedelta | float = _DEFAULT_TIMEOUT,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
) -> None:
    """Start the default process group (the *world*) that collectives use when ``group=None``.

    ``"mpi"`` takes rank and world size from ``MPI.COMM_WORLD`` (start the processes with
    ``mpiexec -n N`` or ``cupy-parallel launch --backend mpi``); ``rank``/``world_size``, when
    given, must agree with it, and ``init_method``/``store`` are not used. ``"nccl"`` meets its
    peers through ``store`` (with ``rank`` and ``world_size``) or ``init_method``: ``"env://"``
    (the default; reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``),
    ``"tcp://host:port"`` or ``"file:///path"``, and waits until the whole world arrived. Each
    initialisation meets under its own key, so after ``destroy_process_group()`` the world can
    initialise again on the same ``store``.

    ``RANK``/``WORLD_SIZE`` in the environment that disagree with ``MPI.COMM_WORLD`` are refused
    (``RuntimeError``): processes started without ``mpiexec`` are each a world of one. In an MPI
    world of several processes, a rank that fails (uncaught exception, Ctrl-C, ``sys.exit(n)``
    with ``n != 0``) aborts the whole job with its exit code, so that no peer waits for it (see
    :mod:`cupy_parallel._src.distributed.mpi`). ``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL`` turns
    on the debug mode, in which the ranks compare every collective's arguments first.

    Args:
        backend: ``"nccl"`` or ``"mpi"`` (any case) or a :class:`Backend`. ``None`` (PyTorch 2's
            default) picks one: ``CUPY_PARALLEL_BACKEND`` if set (``cupy-parallel launch
            --backend`` sets it); ``"mpi"`` in processes started by ``mpiexec``; else
            ``"nccl"`` where a GPU and NCCL are available; else ``"mpi"``.
        init_method: How NCCL ranks find each other; exclusive with ``store``.
        timeout: How long any operation of the group may wait for peers (also the rendezvous):
            a ``datetime.timedelta`` or a number of seconds.
            Past it the operation raises ``TimeoutError`` naming itself and the group. A started
            collective cannot be cancelled, so the group is unusable afterwards: NCCL aborts the
            communicator, and MPI aborts the whole job (``MPI_Abort``, non-zero exit) when this
            process exits, so that no peer stays stuck. An MPI receive is cancelled instead (the
            group stays usable); ``Work.wait(timeout=t)`` with a shorter ``t`` only stops waiting.
        world_size: The number of processes (required with ``store``).
        rank: This process's rank (required with ``store``).
        store: A :class:`~cupy_parallel.distributed.Store` all ranks share.
        group_name: Name of the world group (used in messages); default ``"0"``.

    Raises:
        RuntimeError: Already initialized, the backend's libraries are missing, or the
            environment's ``RANK``/``WORLD_SIZE`` disagree with MPI's world.
        ValueError: ``CUPY_PARALLEL_DISTRIBUTED_DEBUG`` is not ``OFF``, ``INFO`` or ``DETAIL``.
        TimeoutError: The world did not fill within ``timeout`` (the message says how many
            ranks arrived).

    Example:
        >>> is_initialized()
        False
        >>> init_process_group("gloo")
        Traceback (most recent call last):
        ...
        ValueError: backend must be 'nccl' or 'mpi', got 'gloo'. Use Backend.MPI ('mpi') ...
    """
    current = _current()
    if current.world is not None and current.spawned:  # first: whatever the arguments
        raise RuntimeError(
            "init_process_group was called in a function run by cupy_parallel.distributed."
            f"spawn, which already initialised this rank's default process group (rank "
            f"{current.world.rank()} of {current.world.size()}): remove the call. (torch's "
            "mp.spawn starts processes that call init_process_group themselves; spawn's thread "
            "ranks start with their group, and cupy-parallel launch's processes call it.)"
        )
    backend = _default_backend() if backend is None else Backend(backend)
    detail = debug_detail()
    limit = read_timeout(timeout)
    world_size = read_int(world_size, "world_size", minimum=-1)
    rank = read_int(rank, "rank", minimum=-1)
    if not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str, got {type(group_name).__name__}.")
    if init_method is not None and not isinstance(init_method, str):
        raise TypeError(
            "init_method must be a URL string ('env://', 'tcp://host:port', 'file:///path'), "
            f"got {type(init_method).__name__}."
        )
    if current.world is not None:
        raise RuntimeError(
            "init_process_group was called twice; the default process group already exists "
            "(call destroy_process_group() first to start a new one)."
        )
    if store is not None and init_method is not None:
        raise ValueError(
            "init_method and store are exclusive; pass one of them (got both "
            f"init_method={init_method!r} and a store)."
        )
    if store is not None and (world_size < 1 or not 0 <= rank < world_size):
        raise ValueError(
            "with a store, pass world_size >= 1 and 0 <= rank < world_size; "
            f"got world_size={world_size}, rank={rank}."
        )
    cls = _backend_class(backend)
    name = group_name or "0"
    if not cls.needs_store:
        world = cls.create_world(
            rank=rank, world_size=world_size, store=None, timeout=limit, group_name=name
        )
    else:
        from cupy_parallel._src.distributed.rendezvous import init_key, rendezvous, wait_for_world

        owned = None
        if store is None:
            store, rank, world_size = rendezvous(
                init_method or "env://", rank, world_size, timeout=timedelta(seconds=limit)
            )
            owned = store
        try:
            key = init_key(store, name, world_size)
            wait_for_world(store, rank, world_size, timeout=timedelta(seconds=limit), key=key)
            world = cls.create_world(
                rank=rank, world_size=world_size, store=store, timeout=limit, group_name=name
            )
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        current.owned_store = owned
    world.detail = detail
    current.world = ProcessGroup(world, tuple(range(world.size)), name)
    current.group_count = 1
    if world.size == 1 and world_size == -1 and store is None and init_method is None:
        _warn_alone()


_warned_alone = False


def _warn_alone() -> None:
    """Warn, once per process, of a world of one that nothing asked for (a forgotten launcher).

    ``init_process_group()`` in a script started with plain ``python`` makes a world of one
    and trains alone, silently. Not when ``world_size=1`` is explicit, a launcher's or
    torchrun's environment says so (``WORLD_SIZE``, ``mpiexec``'s, Slurm's), or on a thread
    rank of ``spawn``.
    """
    global _warned_alone
    from cupy_parallel._src.distributed.env import detect_launch_env
    from cupy_parallel._src.distributed.mpi_job import thread_rank

    if _warned_alone or "WORLD_SIZE" in os.environ or thread_rank() is not None:
        return
    if detect_launch_env():
        return
    _warned_alone = True
    warnings.warn(
        "init_process_group() made a world of one process: this script was not started by a "
        "launcher, so it trains alone. Start N ranks with `cupy-parallel launch "
        "--nproc-per-node N script.py` or `mpiexec -n N python script.py`; pass world_size=1 "
        "to mean a world of one (no warning).",
        UserWarning,
        stacklevel=3,
    )


def new_group(
    ranks: Iterable[int] | None = None,
    timeout: timedelta | float | None = None,
    backend: Backend | str | None = None,
    *,
    use_local_synchronization: bool = False,
) -> ProcessGroup | Any:
    """A group of some world ranks; every process of the world must call it, in the same order.

    Args:
        ranks: World ranks of the members (any order; group ranks follow sorted order). ``None``
            means every rank.
        timeout: Deadline of the group's operations; default: the world's.
        backend: Must be the world's backend (the default); mixing backends is not supported.
        use_local_synchronization: As torch's: only the members need to call it (non-members
            may, and get ``GroupMember.NON_GROUP_MEMBER`` at once), so that different ranks can
            make different groups, each synchronising its own members only. The members of one
            group must make their local groups of the same ranks in the same order (the name
            that pairs them is the ranks and how many such groups came before).

    Returns:
        The new :class:`ProcessGroup` on members, ``GroupMember.NON_GROUP_MEMBER`` on the others.

    Example:
        >>> new_group([0])
        Traceback (most recent call last):
        ...
        RuntimeError: The default process group is not initialized; call ...
    """
    current = _current()
    world = _world_group()
    world_backend = world.live_backend()
    size = world.size()
    if ranks is None:
        members = tuple(range(size))
    else:
        if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"ranks must be a list of ints, got {type(ranks).__name__}.")
        listed = [read_int(r, "each of ranks") for r in ranks]
        members = tuple(sorted(set(listed)))
        if len(members) != len(listed):
            raise ValueError(f"ranks must be distinct, got {listed}.")
        bad = [r for r in members if not 0 <= r < size]
        if bad:
            raise ValueError(
                f"ranks must be world ranks in [0, {size}), got {listed} (out of range: {bad})."
            )
    limit = world_backend.timeout if timeout is None else read_timeout(timeout)
    debug_detail()  # a bad CUPY_PARALLEL_DISTRIBUTED_DEBUG is refused before the split
    if backend is not None and Backend(backend) is not world_backend.backend:
        raise NotImplementedError(
            f"new_group(backend={Backend(backend).value!r}) under a "
            f"{world_backend.backend.value!r} world is not supported; leave backend=None to use "
            f"{world_backend.backend.value!r}."
        )
    local = read_bool(use_local_synchronization, "use_local_synchronization")
    if local:
        if world.rank() not in members:
            return _NON_MEMBER
        made_before = current.local_groups.get(members, 0)
        current.local_groups[members] = made_before + 1
        name = f"local {list(members)} #{made_before}"
    else:
        name = str(current.group_count)
        current.group_count += 1
    sub = world_backend.new_subgroup(members, timeout=limit, group_name=name, local=local)
    if sub is None:
        return _NON_MEMBER
    sub.detail = debug_detail()
    made = ProcessGroup(sub, members, name)
    current.subgroups.append(made)
    return made


def destroy_process_group(group: Any = None) -> None:
    """Release ``group``; with ``None``/``group.WORLD`` release every group and de-initialize.

    De-initializing also closes the store ``init_process_group`` opened from ``init_method`` (a
    ``FileStore``'s file goes once every rank closed it, a ``TCPStore`` server stops); a store
    passed as ``store=`` stays open for its owner, who may initialize again on it.

    Example:
        >>> destroy_process_group(GroupMember.NON_GROUP_MEMBER)  # a non-member has nothing to free
    """
    if group is _NON_MEMBER:
        return
    current = _current()
    pg = _world_group() if group is None or group is _WORLD else resolve_group(group)
    if pg is None:
        return
    if pg is not current.world:
        current.subgroups.remove(pg)
        _release(pg)
        return
    for sub in current.subgroups:
        _release(sub)
    current.subgroups.clear()
    _release(pg)
    current.world = None
    current.group_count = 0
    current.local_groups.clear()
    store, current.owned_store = current.owned_store, None
    if store is not None:
        store.close()


def _release(pg: ProcessGroup) -> None:
    backend, pg._backend = pg._backend, None
    if backend is not None:
        backend.shutdown()


def get_backend(group: Any = None) -> Backend:
    """The backend of ``group`` (default: the world), a :class:`Backend` equal to its name.

    Example:
        >>> get_backend()
        Traceback (most recent call last):
        ...
        RuntimeError: The default process group is not initialized; call ...
    """
    pg = resolve_group(group)
    if pg is None:
        raise ValueError(
            "get_backend got GroupMember.NON_GROUP_MEMBER: this process is not in that group."
        )
    return pg.live_backend().backend


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); ``-1`` if it is not a member.

    Example:
        >>> get_rank(GroupMember.NON_GROUP_MEMBER)
        -1
    """
    pg = resolve_group(group)
    return -1 if pg is None else pg.live_backend().rank


def get_world_size(group: Any = None) -> int:
    """The number of processes in ``group`` (default: the world); ``-1`` if not a member.

    Example:
        >>> get_world_size(GroupMember.NON_GROUP_MEMBER)
        -1
    """
    pg = resolve_group(group)
    return -1 if pg is None else len(pg.ranks)


def _member_group(group: Any, caller: str) -> ProcessGroup:
    pg = resolve_group(group)
    if pg is None:
        raise ValueError(
            f"{caller} got GroupMember.NON_GROUP_MEMBER; pass a group of this process."
        )
    return pg


def get_process_group_ranks(group: Any) -> list[int]:
    """The world ranks of ``group``'s members, in group-rank order (PyTorch 2).

    Example:
        >>> get_process_group_ranks(None)
        Traceback (most recent call last):
        ...
        RuntimeError: The default process group is not initialized; call ...
    """
    return list(_member_group(group, "get_process_group_ranks").ranks)


def get_global_rank(group: Any, group_rank: int) -> int:
    """The world rank of ``group``'s member ``group_rank`` (PyTorch 2).

    Example:
        >>> get_global_rank(None, 0)
        Traceback (most recent call last):
        ...
        RuntimeError: The default process group is not initialized; call ...
    """
    pg = _member_group(group, "get_global_rank")
    index = read_int(group_rank, "group_rank")
    if not 0 <= index < len(pg.ranks):
        raise ValueError(
            f"group_rank must be in [0, {len(pg.ranks)}) for process group {pg.name!r}, got "
            f"{index}."
        )
    return pg.ranks[index]


def get_group_rank(group: Any, global_rank: int) -> int:
    """The rank in ``group`` of world rank ``global_rank`` (PyTorch 2).

    Example:
        >>> get_group_rank(None, 0)
        Traceback (most recent call last):
        ...
        RuntimeError: The default process group is not initialized; call ...
    """
    return _member_group(group, "get_group_rank").group_rank(global_rank, "global_rank")
