"""Collectives of picklable Python objects (PyTorch 2): ``broadcast_object_list``, ``*_object``.

Objects travel as their ``pickle`` bytes in ``uint8`` arrays through the array collectives (host
arrays on host backends, CuPy arrays on the current device on device-only backends): first the
sizes, then the bytes, padded to the largest size where a collective needs one size for all.

``pickle`` runs code while loading: these functions are for objects among the job's own ranks,
which trust each other (torch documents the same). Never use them with data from elsewhere.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.distributed.dispatch import backend_of, list_given
from cupy_parallel._src.distributed.exchanges import all_gather
from cupy_parallel._src.distributed.rooted import broadcast, gather, scatter

if TYPE_CHECKING:
    from cupy_parallel._src.distributed.groups import ProcessGroup

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
]


def _member(group: Any, operation: str) -> ProcessGroup | None:
    resolved = backend_of(group, operation)  # raises the group's failure in the usual words
    return None if resolved is None else resolved[0]


def _buffer(pg: ProcessGroup, data: bytes | int, dtype: Any = np.uint8) -> Any:
    """An array for the group's backend holding ``data`` (bytes) or ``data`` zeros."""
    host = np.frombuffer(data, dtype).copy() if isinstance(data, bytes) else np.zeros(data, dtype)
    if "cpu" in pg.live_backend().array_kinds:
        return host
    cupy: Any = cupy_module()
    return cupy.asarray(host)


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()


def _sizes(pg: ProcessGroup, own: int, group: Any) -> list[int]:
    """Every member's ``own``, by group rank (an ``all_gather`` of one int64)."""
    parts = [_buffer(pg, 1, np.int64) for _ in range(pg.size())]
    all_gather(parts, _buffer(pg, np.int64(own).tobytes(), np.int64), group)
    return [int(_host(p)[0]) for p in parts]


def _list(value: Any, name: str, *, length: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list (filled in place), got {type(value).__name__}.")
    if length is not None and len(value) != length:
        raise ValueError(
            f"{name} must hold {length} items (one per group member), got {len(value)}."
        )
    return value


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, device: Any = None
) -> None:
    """Replace ``object_list``'s items on every rank with those of world rank ``src``.

    Every rank passes a list of the same length; the items of ranks other than ``src`` are
    overwritten in place. ``device`` is accepted for torch's signature and not used (device-only
    backends use the current device). See the module's note on ``pickle``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> objects = [{"lr": 0.1}, "step", 3]
        >>> dist.broadcast_object_list(objects, src=0)
        >>> objects
        [{'lr': 0.1}, 'step', 3]
        >>> dist.destroy_process_group()
    """
    del device
    pg = _member(group, "broadcast_object_list")
    if pg is None:
        return
    _list(object_list, "object_list")
    root = pg.group_rank(src, "src")
    is_root = root == pg.rank()
    pickled = [pickle.dumps(o) for o in object_list] if is_root else []
    sizes = _buffer(pg, np.array([len(p) for p in pickled], np.int64).tobytes(), np.int64)
    if not is_root:
        sizes = _buffer(pg, len(object_list), np.int64)
    broadcast(sizes, src, group)
    counts = [int(n) for n in _host(sizes)]
    data = _buffer(pg, b"".join(pickled)) if is_root else _buffer(pg, sum(counts))
    broadcast(data, src, group)
    if not is_root:
        raw, start = _host(data).tobytes(), 0
        for i, n in enumerate(counts):
            object_list[i] = pickle.loads(raw[start : start + n])  # noqa: S301 - see module
            start += n


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """``object_list[r]`` receives ``obj`` of group rank ``r`` on every rank.

    ``object_list`` holds one (placeholder) item per group member. See the module's note on
    ``pickle``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [None]
        >>> dist.all_gather_object(out, {"rank": dist.get_rank()})
        >>> out
        [{'rank': 0}]
        >>> dist.destroy_process_group()
    """
    pg = _member(group, "all_gather_object")
    if pg is None:
        return
    _list(object_list, "object_list", length=pg.size())
    mine = pickle.dumps(obj)
    sizes = _sizes(pg, len(mine), group)
    longest = max(sizes)
    parts = [_buffer(pg, longest) for _ in sizes]
    all_gather(parts, _buffer(pg, mine.ljust(longest, b"\0")), group)
    for r, (part, n) in enumerate(zip(parts, sizes, strict=True)):
        object_list[r] = pickle.loads(_host(part).tobytes()[:n])  # noqa: S301 - see module


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """World rank ``dst`` receives every rank's ``obj``: ``object_gather_list[r]`` gets rank r's.

    ``object_gather_list`` is required on ``dst`` (one item per group member) and must be
    ``None`` or empty elsewhere (torch's rule). See the module's note on ``pickle``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [None]
        >>> dist.gather_object(("done", 7), out, dst=0)
        >>> out
        [('done', 7)]
        >>> dist.destroy_process_group()
    """
    pg = _member(group, "gather_object")
    if pg is None:
        return
    root = pg.group_rank(dst, "dst")
    is_root = root == pg.rank()
    if is_root:
        _list(object_gather_list, "object_gather_list", length=pg.size())
    elif list_given(object_gather_list):  # None or [] elsewhere, as in torch
        raise ValueError(
            f"object_gather_list must be None (or empty) on ranks other than the destination {dst}."
        )
    mine = pickle.dumps(obj)
    sizes = _sizes(pg, len(mine), group)
    longest = max(sizes)
    parts = [_buffer(pg, longest) for _ in sizes] if is_root else None
    gather(_buffer(pg, mine.ljust(longest, b"\0")), parts, dst, group)
    if parts is not None and object_gather_list is not None:
        for r, (part, n) in enumerate(zip(parts, sizes, strict=True)):
            object_gather_list[r] = pickle.loads(_host(part).tobytes()[:n])  # noqa: S301


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Group rank ``r`` receives ``scatter_object_input_list[r]`` of world rank ``src``.

    The object lands in ``scatter_object_output_list[0]`` (a list of at least one item, as in
    torch). ``scatter_object_input_list`` is required on ``src`` (one object per member) and
    ignored elsewhere. See the module's note on ``pickle``.

    Example:
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")
        >>> out = [None]
        >>> dist.scatter_object_list(out, ["for rank 0"], src=0)
        >>> out
        ['for rank 0']
        >>> dist.destroy_process_group()
    """
    pg = _member(group, "scatter_object_list")
    if pg is None:
        return
    output = _list(scatter_object_output_list, "scatter_object_output_list")
    if not output:
        raise ValueError("scatter_object_output_list must hold at least one item, got [].")
    root = pg.group_rank(src, "src")
    is_root = root == pg.rank()
    if is_root:
        inputs = _list(scatter_object_input_list, "scatter_object_input_list", length=pg.size())
        pickled = [pickle.dumps(o) for o in inputs]
        longest = max(len(p) for p in pickled)
    else:
        pickled, longest = [], 0
    top = _buffer(pg, np.int64(longest).tobytes(), np.int64)
    broadcast(top, src, group)
    longest = int(_host(top)[0])
    size_out = _buffer(pg, 1, np.int64)
    size_in = [_buffer(pg, np.int64(len(p)).tobytes(), np.int64) for p in pickled] or None
    scatter(size_out, size_in, src, group)
    data_out = _buffer(pg, longest)
    data_in = [_buffer(pg, p.ljust(longest, b"\0")) for p in pickled] or None
    scatter(data_out, data_in, src, group)
    n = int(_host(size_out)[0])
    output[0] = pickle.loads(_host(data_out).tobytes()[:n])  # noqa: S301 - see module
