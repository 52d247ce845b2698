"""Rendezvous: turn an ``init_method`` URL into a shared store, this process's rank and the size.

``env://`` reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` from the environment
(``RANK``/``WORLD_SIZE`` fall back to what ``mpiexec`` or Slurm set, see
:func:`~cupy_parallel._src.distributed.env.detect_launch_env`); ``tcp://host:port`` names rank
0's :class:`TCPStore` directly; ``file:///path`` shares a :class:`FileStore`. All three accept
``?rank=R&world_size=W`` query parameters, as PyTorch does; a value given both as an argument and in
the URL must agree. ``use_libuv`` (torch's choice of TCP server implementation, which
``init_process_group`` URLs carry) is accepted and ignored: there is one server here. Other
unknown query parameters are refused rather than ignored (PyTorch ignores them), so that a typo
does not go unnoticed.

``MASTER_ADDR`` (or the host of ``tcp://``) is where rank 0's server listens *and* where the
other ranks connect: rank 0 binds exactly that address (see :class:`TCPStore`). On one machine
``127.0.0.1`` keeps the store off the network; across nodes it must be an address of rank 0's
node that the others can reach (its IP on the cluster network, not a name that resolves to
loopback there); ``0.0.0.0`` listens everywhere but is no address to connect to from another
node. The store has no authentication unless ``CUPY_PARALLEL_STORE_SECRET`` is set to the same
value in every process.

:func:`rendezvous` only opens the store; :func:`wait_for_world` then blocks until every rank has
checked in, under a key :func:`init_key` makes fresh for each ``init_process_group`` on the store.
"""

from __future__ import annotations

import enum
import os
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import parse_qs, unquote, urlparse

from cupy_parallel._src.arguments import read_int, read_timeout
from cupy_parallel._src.distributed.env import detect_launch_env
from cupy_parallel._src.distributed.store import FileStore, Store, TCPStore
from cupy_parallel._src.distributed.store.interface import format_seconds

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta
    from urllib.parse import ParseResult

__all__ = [
    "ConflictingArgumentError",
    "InitMethod",
    "UnknownInitMethodError",
    "init_key",
    "rendezvous",
    "wait_for_world",
]

_MISSING = -1
_DEFAULT_TIMEOUT_S = 1800.0  # torch's default process-group timeout, 30 minutes
_SHOWN_MISSING_RANKS = 8


class InitMethod(enum.Enum):
    """The ``init_method`` URL schemes :func:`rendezvous` understands.

    Example:
        >>> [method.value + "://" for method in InitMethod]
        ['env://', 'tcp://', 'file://']
    """

    ENV = "env"
    TCP = "tcp"
    FILE = "file"


_SUPPORTED = ", ".join(f"{method.value}://" for method in InitMethod)


class UnknownInitMethodError(ValueError, RuntimeError):
    """An ``init_method`` with a scheme no handler serves.

    A ``ValueError`` (a wrong value) that is also the ``RuntimeError`` torch raises ("No
    rendezvous handler for ..."), so that ported code catches it either way.
    """


class ConflictingArgumentError(ValueError, AssertionError):
    """``rank``/``world_size`` given as arguments and, differently, in the URL.

    A ``ValueError`` that is also the ``AssertionError`` torch raises ("... has node-specific
    arguments ..."), so that ported code catches it either way. Unlike torch, equal values
    given in both places are accepted: nothing is ambiguous then.
    """


class _Place(NamedTuple):
    rank: int
    world_size: int


# torch's parameters that choose how its store is implemented, meaningless here: accepted, ignored.
_IGNORED_QUERY = ("use_libuv",)


def _query_ints(url: ParseResult, init_method: str) -> dict[str, int]:
    """``rank``/``world_size`` from the URL query, refusing anything else."""
    found: dict[str, int] = {}
    for name, values in parse_qs(url.query, keep_blank_values=True).items():
        if name in _IGNORED_QUERY:
            continue
        if name not in _Place._fields:
            raise ValueError(
                f"init_method {init_method!r} has an unknown query parameter {name!r}; "
                f"only {' and '.join(_Place._fields)} are accepted (and {', '.join(_IGNORED_QUERY)}"
                ", ignored)."
            )
        if len(values) != 1:
            raise ValueError(f"init_method {init_method!r} gives {name} {len(values)} times.")
        found[name] = _place_int(
            values[0], name, f"init_method {init_method!r}: query parameter {name}"
        )
    return found


_LEAST = {"rank": 0, "world_size": 1}  # the least value of each field of a _Place


def _place_int(text: str, name: str, said: str) -> int:
    """``text`` read as ``name`` (``rank``/``world_size``), which ``said`` names in errors.

    Below its least value it is refused here: -1 would read as "not given" later.
    """
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{said} must be an integer, got {text!r}.") from None
    if value < _LEAST[name]:
        raise ValueError(f"{said} must be >= {_LEAST[name]}, got {value}.")
    return value


def _merge(init_method: str, url: ParseResult, rank: int, world_size: int) -> _Place:
    """Combine arguments and query parameters; -1 stays -1 when neither gives a value."""
    query = _query_ints(url, init_method)
    merged = []
    for name, argument in zip(_Place._fields, (rank, world_size), strict=True):
        if name in query and argument != _MISSING and query[name] != argument:
            raise ConflictingArgumentError(
                f"init_method {init_method!r} has node-specific arguments ({name}="
                f"{query[name]}) that conflict with the {name} argument ({argument}); give "
                f"{name} in one place."
            )
        merged.append(query.get(name, argument))
    return _Place(*merged)


def _check_place(place: _Place, method: InitMethod) -> _Place:
    rank, world_size = place
    for name, value in zip(_Place._fields, place, strict=True):
        if value == _MISSING:
            raise ValueError(
                f"{method.value}:// rendezvous needs {name}: pass {name}=... or add "
                f"?{name}=... to the init_method URL."
            )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    return place


def _tcp_store(host: str, port: int, place: _Place, timeout: float) -> Store:
    return TCPStore(
        host,
        port,
        place.world_size,
        is_master=place.rank == 0,
        timeout=timeout,
        wait_for_workers=False,  # wait_for_world does the waiting, with a better message
    )


def _from_env(url: ParseResult, place: _Place, timeout: float) -> tuple[Store, _Place]:
    detected = detect_launch_env()
    fallback = {"rank": detected.get("rank"), "world_size": detected.get("world_size")}
    values = list(place)
    for i, (name, variable) in enumerate(zip(_Place._fields, ("RANK", "WORLD_SIZE"), strict=True)):
        if values[i] != _MISSING:
            continue
        if variable in os.environ:
            values[i] = _place_int(os.environ[variable], name, f"environment variable {variable}")
        elif (found := fallback[name]) is not None:
            values[i] = found
        else:
            raise ValueError(
                f"env:// rendezvous needs environment variable {variable}, which is not set; "
                f"set it, pass {name}=..., or start the job with cupy-parallel launch, "
                "mpiexec or srun."
            )
    checked = _check_place(_Place(*values), InitMethod.ENV)
    host = os.environ.get("MASTER_ADDR", "")
    if not host:
        raise ValueError(
            "env:// rendezvous needs environment variable MASTER_ADDR (the address of rank 0), "
            "which is not set."
        )
    port_text = os.environ.get("MASTER_PORT")
    if port_text is None:
        raise ValueError(
            "env:// rendezvous needs environment variable MASTER_PORT (a free port on rank 0), "
            "which is not set."
        )
    try:
        port = int(port_text)
    except ValueError:
        port = _MISSING
    if not 1 <= port <= 65535:
        raise ValueError(
            f"environment variable MASTER_PORT must be a port in [1, 65535], got {port_text!r}."
        )
    return _tcp_store(host, port, checked, timeout), checked


def _from_tcp(url: ParseResult, place: _Place, timeout: float) -> tuple[Store, _Place]:
    example = "tcp://10.1.1.20:23456"
    try:
        port = url.port
    except ValueError:
        raise ValueError(
            f"init_method {url.geturl()!r} has an invalid port; write it as {example}."
        ) from None
    if not url.hostname or port is None or port == 0:
        raise ValueError(
            f"init_method {url.geturl()!r} needs a host and a non-zero port, e.g. {example}."
        )
    checked = _check_place(place, InitMethod.TCP)
    return _tcp_store(url.hostname, port, checked, timeout), checked


def _from_file(url: ParseResult, place: _Place, timeout: float) -> tuple[Store, _Place]:
    if url.netloc not in ("", "localhost") or not url.path:
        raise ValueError(
            f"init_method {url.geturl()!r} must name an absolute path after three slashes, "
            "e.g. file:///tmp/cupy_parallel_store."
        )
    checked = _check_place(place, InitMethod.FILE)
    return FileStore(unquote(url.path), checked.world_size, timeout=timeout), checked


_HANDLERS: dict[InitMethod, Callable[[ParseResult, _Place, float], tuple[Store, _Place]]] = {
    InitMethod.ENV: _from_env,
    InitMethod.TCP: _from_tcp,
    InitMethod.FILE: _from_file,
}


def rendezvous(
    init_method: str,
    rank: int = -1,
    world_size: int = -1,
    *,
    timeout: timedelta | float = _DEFAULT_TIMEOUT_S,
) -> tuple[Store, int, int]:
    """Open the store named by ``init_method``; return it with this process's rank and the size.

    ``rank`` and ``world_size`` default to ``-1``: taken from the URL query or (``env://``) the
    environment. For ``env://`` and ``tcp://`` rank 0 hosts a :class:`TCPStore`; the other
    ranks connect to it, retrying until ``timeout``. The store's timeout is set to ``timeout``.

    Args:
        init_method: ``"env://"``, ``"tcp://host:port"`` or ``"file:///path"``, optionally with
            ``?rank=R&world_size=W``.
        rank: this process's rank, or -1.
        world_size: the number of processes, or -1.
        timeout: how long to wait for the store (and, later, for its keys); 30 minutes by
            default, as torch.

    Returns:
        ``(store, rank, world_size)``.

    Raises:
        ValueError: an unknown scheme, or a missing or invalid rank, size, host, port or
            environment variable (the message names it).

    Example:
        >>> import os, tempfile
        >>> from datetime import timedelta
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> store, rank, size = rendezvous(f"file://{path}?world_size=1", rank=0,
        ...                                timeout=timedelta(seconds=5))
        >>> store.set("hello", "world")
        >>> rank, size, store.get("hello")
        (0, 1, b'world')
        >>> store.close()
        >>> rendezvous("udp://x", timeout=timedelta(seconds=5))
        Traceback (most recent call last):
        cupy_parallel._src.distributed.rendezvous.UnknownInitMethodError: No rendezvous handler ...
    """
    if not isinstance(init_method, str):
        raise TypeError(
            f"init_method must be a str URL, got {type(init_method).__name__} {init_method!r}."
        )
    seconds = read_timeout(timeout, "timeout")
    rank = read_int(rank, "rank")
    world_size = read_int(world_size, "world_size")
    url = urlparse(init_method)
    try:
        method = InitMethod(url.scheme)
    except ValueError:
        raise UnknownInitMethodError(
            f"No rendezvous handler for {url.scheme}://: init_method {init_method!r} has an "
            f"unknown scheme {url.scheme!r}; supported: {_SUPPORTED}."
        ) from None
    place = _merge(init_method, url, rank, world_size)
    store, place = _HANDLERS[method](url, place, seconds)
    return store, place.rank, place.world_size


def init_key(store: Store, group_name: str, world_size: int) -> str:
    """The rendezvous key of one ``init_process_group``: the same on every rank, new each time.

    Every rank of every initialisation adds 1 to a join counter kept in ``store`` (one counter
    per group name and world size). A rank cannot start the next initialisation before the
    whole world finished this one's rendezvous, so the ``world_size`` joins of one
    initialisation are consecutive and ``(count - 1) // world_size`` numbers it: a world can
    destroy its group and initialise again on the same store, as in torch.

    Args:
        store: the store all ranks share.
        group_name: the name of the world group.
        world_size: the number of ranks of this initialisation.

    Returns:
        ``f"cupy_parallel/init/{group_name}/{world_size}/{generation}"``.

    Example:
        >>> import cupy_parallel
        >>> from cupy_parallel._src.distributed.store import TCPStore
        >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
        ...     [init_key(store, "0", 2) for _ in range(4)]  # two ranks, two initialisations
        ['cupy_parallel/init/0/2/0', 'cupy_parallel/init/0/2/0', \
'cupy_parallel/init/0/2/1', 'cupy_parallel/init/0/2/1']
    """
    base = f"cupy_parallel/init/{group_name}/{world_size}"
    generation = (store.add(f"{base}/joins", 1) - 1) // world_size
    return f"{base}/{generation}"


def wait_for_world(
    store: Store,
    rank: int,
    world_size: int,
    *,
    timeout: timedelta | float,
    key: str = "cupy_parallel/rendezvous",
) -> None:
    """Check this rank in under ``key`` and wait until all ``world_size`` ranks have.

    Every rank increments ``f"{key}/arrived"``; the last to arrive sets ``f"{key}/complete"``,
    which all ranks wait for. A rank checking in twice under one key (two processes given the
    same rank, or a store left over from an earlier job) is an error; use a fresh key (or a
    :class:`PrefixStore`) to rendezvous again on the same store.

    Args:
        store: the store all ranks share.
        rank: this process's rank in ``[0, world_size)``.
        world_size: the number of ranks to wait for.
        timeout: how long to wait.
        key: the key prefix of this rendezvous.

    Raises:
        TimeoutError: not every rank arrived in time; the message says how many did and
            which are missing.
        ValueError: ``rank`` already checked in under ``key``.

    Example:
        >>> import cupy_parallel
        >>> from datetime import timedelta
        >>> from cupy_parallel._src.distributed.store import TCPStore
        >>> with TCPStore("127.0.0.1", 0, is_master=True) as store:
        ...     wait_for_world(store, 0, 1, timeout=timedelta(seconds=5))
        ...     wait_for_world(store, 0, 2, timeout=timedelta(seconds=0.2), key="other")
        Traceback (most recent call last):
        TimeoutError: rendezvous timed out after 0.2 s: 1 of 2 ranks arrived (missing ranks: 1).
    """
    if not isinstance(store, Store):
        raise TypeError(f"store must be a cupy_parallel Store, got {type(store).__name__}.")
    rank = read_int(rank, "rank")
    world_size = read_int(world_size, "world_size")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}.")
    seconds = read_timeout(timeout, "timeout", positive=False)
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__} {key!r}.")

    if store.add(f"{key}/rank/{rank}", 1) > 1:
        raise ValueError(
            f"rank {rank} checked in twice under rendezvous key {key!r}: two processes were "
            "given the same rank, or the store still holds an earlier job's keys (use a new "
            "file or port, or another key)."
        )
    arrived = store.add(f"{key}/arrived", 1)
    if arrived == world_size:
        store.set(f"{key}/complete", b"1")
    try:
        store.wait([f"{key}/complete"], seconds)
    except TimeoutError:
        arrived = store.add(f"{key}/arrived", 0)
        missing = [r for r in range(world_size) if not store.check([f"{key}/rank/{r}"])]
        shown = ", ".join(str(r) for r in missing[:_SHOWN_MISSING_RANKS])
        if len(missing) > _SHOWN_MISSING_RANKS:
            shown += ", ..."
        raise TimeoutError(
            f"rendezvous timed out after {format_seconds(seconds)} s: {arrived} of {world_size} "
            f"ranks arrived (missing ranks: {shown})."
        ) from None
