"""The distributed checkpoint: every rank writes its own file, a metadata file maps the rows.

torch DCP's contract (``torch.distributed.checkpoint.save`` / ``load``), on the safetensors
files of :mod:`cupy_parallel._src.serialization`:

- A state is a pytree whose leaves are :class:`~cupy_parallel._src.checkpoint.shard.Shard`
  (this rank's rows of an array sharded along dim 0), arrays (replicated: the same on every
  rank) and Python scalars and strings (rank 0's are saved; a load sets them in their dicts and
  lists).
- ``save``: rank ``r`` writes ``data-<id>/rank-<r>.safetensors`` holding its shards' rows and the
  replicated arrays it was given. Nothing is gathered: each replicated array is written once,
  by the rank that has written the fewest bytes so far (its shards counted; ties to the lowest
  rank; arrays in key-path order), so that the files come out balanced. Rank 0 then writes
  ``.metadata`` (JSON: for each key path, its dtype, global shape and which file holds which
  rows) under a temporary name and renames it in place; that rename is the commit. A save killed
  before it leaves the previous checkpoint (its ``.metadata`` and data directory) whole; the
  data directories no committed metadata names are removed by the next save.
- ``load``: every rank reads ``.metadata`` and, for each of its leaves, only the rows it needs
  from the files that hold them (``safe_open``'s slices): a checkpoint saved on N ranks loads on
  M ranks, sharded or replicated either way (a sharded array loads whole into a plain array).
  Every check and every read happens before anything in ``state`` is written.
- Errors: a problem on any rank (a missing key, a shape or dtype mismatch, an incomplete
  checkpoint, a failed write) is exchanged with the group's collectives (under the group's
  timeout: never a hang) and raised on **every** rank, naming the rank and the key path.

The files live on a file system every rank sees (as torch's ``FileSystemWriter``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import recording
from cupy_parallel._src import tree as _tree
from cupy_parallel._src.arrays import copy_into, device_of, is_array
from cupy_parallel._src.checkpoint.shard import Shard
from cupy_parallel._src.distributed import groups
from cupy_parallel._src.distributed.objects import all_gather_object
from cupy_parallel._src.hostarray import plain_buffer
from cupy_parallel._src.serialization import (
    SCALAR_TYPES,
    decode_array,
    dtype_name,
    dtype_of_name,
    encode_array,
    fsync_directory,
    read_scalar,
    replace_atomically,
    scalar_record,
    write_safetensors,
)

if TYPE_CHECKING:
    from optree import PyTreeAccessor

__all__ = ["load", "save"]

METADATA = ".metadata"
_FORMAT = "cupy_parallel.distributed.checkpoint"
_VERSION = 1
_DATA_PREFIX = "data-"
_ERRORS: dict[str, type[Exception]] = {
    "KeyError": KeyError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


class _RankError(Exception):
    """A problem found on this rank, to be shared with every rank before anyone raises."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind.__name__


# --------------------------------------------------------------------------------------------
# The group


class _Group:
    """This rank's place in the process group (a world of one without a group)."""

    def __init__(self, process_group: Any, operation: str) -> None:
        self.operation = operation
        if process_group is None and not groups.is_initialized():
            self.group, self.rank, self.size = None, 0, 1
            return
        self.group = process_group
        self.rank = groups.get_rank(process_group)
        self.size = groups.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError(
                f"{operation}: this rank is not a member of process_group; call it on the "
                "group's members only."
            )

    def agree(self, mine: Any, problem: _RankError | None = None) -> list[Any]:
        """Every rank's ``mine``; raises on every rank if any rank had a ``problem``."""
        sent = (None, None, mine) if problem is None else (problem.kind, str(problem), None)
        gathered: list[Any]
        if self.size == 1:
            gathered = [sent]
        else:
            gathered = [None] * self.size
            all_gather_object(gathered, sent, self.group)
        failed = [(r, kind, text) for r, (kind, text, _) in enumerate(gathered) if kind]
        if failed:
            _rank, kind, _text = failed[0]
            lines = "; ".join(f"rank {r}: {text}" for r, _kind, text in failed)
            error = _ERRORS.get(kind, RuntimeError)(f"{self.operation} failed on {lines}")
            raise error from problem
        return [value for _kind, _text, value in gathered]


# --------------------------------------------------------------------------------------------
# The state's leaves


def _where(accessor: PyTreeAccessor) -> str:
    return f"state{_tree.key_path(accessor, '')}" if len(accessor) else "state"


def _read_state(state: Any) -> tuple[list[str], list[Any], list[PyTreeAccessor]]:
    accessors, leaves, _spec = _tree.flatten(state)
    return [_tree.key_path(a, "") for a in accessors], leaves, list(accessors)


def _check_shard(shard: Shard, where: str) -> None:
    local, shape = shard.local, tuple(shard.global_shape)
    if not is_array(local):
        raise _RankError(TypeError, f"{where} is a Shard whose local is {type(local).__name__}")
    if len(shape) == 0 or local.ndim != len(shape) or tuple(local.shape[1:]) != shape[1:]:
        raise _RankError(
            ValueError,
            f"{where} is a Shard of local shape {tuple(local.shape)} for global shape {shape}: "
            "only dim 0 may differ",
        )
    if not 0 <= shard.offset <= shard.offset + local.shape[0] <= shape[0]:
        raise _RankError(
            ValueError,
            f"{where} is a Shard of rows {shard.offset}:{shard.offset + local.shape[0]}, "
            f"outside the global shape {shape}",
        )


def _entry(leaf: Any, where: str) -> dict[str, Any]:
    """What a rank says about one leaf of its state (JSON)."""
    if isinstance(leaf, Shard):
        _check_shard(leaf, where)
        rows = [leaf.offset, leaf.offset + int(leaf.local.shape[0])]
        shape, dtype = list(leaf.global_shape), np.dtype(leaf.local.dtype)
        return {"kind": "shard", "dtype": dtype_name(dtype), "shape": shape, "rows": rows}
    if is_array(leaf):
        dtype = np.dtype(leaf.dtype)
        return {"kind": "array", "dtype": dtype_name(dtype), "shape": list(leaf.shape)}
    if type(leaf) in SCALAR_TYPES:
        return {"kind": "value", "value": scalar_record(leaf)}
    raise _RankError(
        TypeError,
        f"{where} is a {type(leaf).__qualname__}; a checkpoint holds Shards, arrays (NumPy, "
        "host, CuPy) and bool, int, float, complex, str, bytes and None",
    )


def _nbytes(entry: dict[str, Any]) -> int:
    shape = entry["shape"] if entry["kind"] == "array" else [entry["rows"][1] - entry["rows"][0]]
    return int(np.prod(shape, dtype=np.int64)) * dtype_of_name(entry["dtype"]).itemsize


# --------------------------------------------------------------------------------------------
# save


def _plan(group: _Group, state: Any) -> tuple[list[str], list[Any], list[list[Any]], str]:
    """Every rank's entries, checked to describe one state; the data directory's name."""
    keys, leaves, accessors = _read_state(state)
    problem, entries = None, []
    try:
        entries = [_entry(leaf, _where(a)) for leaf, a in zip(leaves, accessors, strict=True)]
    except _RankError as found:
        problem = found
    token = secrets.token_hex(8)
    everyone = group.agree((keys, entries, token), problem)
    first_keys, first_entries, token = everyone[0]
    for rank, (other_keys, other_entries, _token) in enumerate(everyone):
        if other_keys != first_keys:
            missing = sorted(set(first_keys) ^ set(other_keys)) or ["(their order)"]
            raise ValueError(
                f"distributed.checkpoint.save: the ranks' states differ: rank {rank} and rank 0 "
                f"disagree on state{missing[0]}; every rank passes the same keys."
            )
        for key, a, b in zip(keys, first_entries, other_entries, strict=True):
            same = (a["kind"], a.get("dtype"), a.get("shape")) == (
                b["kind"],
                b.get("dtype"),
                b.get("shape"),
            )
            if not same:
                raise ValueError(
                    f"distributed.checkpoint.save: state{key} is {_describe(b)} on rank {rank} "
                    f"but {_describe(a)} on rank 0; a leaf is a Shard of one array on every "
                    "rank, or the same array everywhere."
                )
    for index, key in enumerate(keys):
        if first_entries[index]["kind"] == "shard":
            _check_cover(key, [entries_[index]["rows"] for _k, entries_, _t in everyone])
    return keys, leaves, [e for _k, e, _t in everyone], token


def _describe(entry: dict[str, Any]) -> str:
    if entry["kind"] == "value":
        return "a Python value"
    what = "a Shard of an array" if entry["kind"] == "shard" else "an array"
    return f"{what} of shape {tuple(entry['shape'])} and dtype {entry['dtype']}"


def _check_cover(key: str, rows: list[list[int]]) -> None:
    """The ranks' rows of a sharded array must cover it once (empty shards aside)."""
    spans = sorted((start, stop, rank) for rank, (start, stop) in enumerate(rows) if stop > start)
    total = None
    for start, stop, rank in spans:
        expected = 0 if total is None else total
        if start != expected:
            problem = "overlap" if start < expected else "leave a gap"
            raise ValueError(
                f"distributed.checkpoint.save: the shards of state{key} {problem} at row "
                f"{min(start, expected)} (rank {rank} holds rows {start}:{stop})."
            )
        total = stop


def _assign(entries: list[list[Any]]) -> list[int | None]:
    """For each leaf, the rank that writes it if it is replicated (balanced by bytes)."""
    written = [0] * len(entries)
    for rank, own in enumerate(entries):
        written[rank] = sum(_nbytes(e) for e in own if e["kind"] == "shard")
    writers: list[int | None] = []
    for entry in entries[0]:
        if entry["kind"] != "array":
            writers.append(None)
            continue
        rank = min(range(len(entries)), key=lambda r: (written[r], r))
        written[rank] += _nbytes(entry)
        writers.append(rank)
    return writers


def save(state: Any, path: str | os.PathLike[str], *, process_group: Any = None) -> None:
    """Save ``state`` into the directory ``path``: each rank its own rows, atomically as a whole.

    Called on every rank of ``process_group`` (default: the world; without an initialised
    process group, one process saves alone) with states of the same keys: a
    :class:`~cupy_parallel.distributed.checkpoint.Shard` where a rank holds rows of an array
    sharded along dim 0, a plain array where every rank holds the same array, Python scalars and
    strings (rank 0's are saved). See the module for the files; the previous checkpoint at
    ``path`` stays whole until this one is committed.

    Args:
        state: a pytree of Shards, arrays and scalars (the same keys on every rank).
        path: the checkpoint's directory (created; on a file system every rank sees).
        process_group: the ranks that save together (default: the world).

    Raises:
        TypeError: a leaf of another kind; ValueError: the ranks' states disagree (keys,
            shapes, dtypes, shards that overlap or leave a gap); OSError-born failures are
            raised on every rank as ``RuntimeError`` naming the rank. The same error is raised
            on every rank.

    Example:
        >>> import os, tempfile, numpy as np
        >>> from cupy_parallel.distributed import checkpoint as dcp
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> dcp.save({"w": np.arange(4.0), "step": 7}, path)
        >>> state = {"w": np.zeros(4), "step": 0}
        >>> dcp.load(state, path)
        >>> state
        {'w': array([0., 1., 2., 3.]), 'step': 7}
    """
    group = _Group(process_group, "distributed.checkpoint.save")
    path = os.path.abspath(os.fspath(path))
    keys, leaves, entries, token = _plan(group, state)
    writers = _assign(entries)
    data = f"{_DATA_PREFIX}{token}"
    file = f"rank-{group.rank}.safetensors"
    tensors, raw = {}, {}
    for index, leaf in enumerate(leaves):
        mine = entries[group.rank][index]
        if mine["kind"] == "shard" or writers[index] == group.rank:
            array = leaf.local if mine["kind"] == "shard" else leaf
            stored, tag = encode_array(array, f"state{keys[index]}")
            tensors[str(index)], raw[index] = stored, tag is not None
    problem = None
    try:
        if group.rank == 0 and os.path.exists(path) and not os.path.isdir(path):
            raise _RankError(ValueError, f"{path} exists and is not a directory")
        os.makedirs(os.path.join(path, data), exist_ok=True)
        write_safetensors(os.path.join(path, data, file), tensors, None)
    except (OSError, _RankError) as error:
        problem = error if isinstance(error, _RankError) else _RankError(OSError, f"{error}")
    written = group.agree(sorted(raw.items()), problem)
    problem = None
    if group.rank == 0:
        try:
            fsync_directory(os.path.join(path, data))
            metadata = _metadata(keys, entries, writers, written, data)
            text = json.dumps(metadata, separators=(",", ":"))
            replace_atomically(os.path.join(path, METADATA), lambda temp: _write_text(temp, text))
        except OSError as error:
            problem = _RankError(OSError, f"committing {path}: {error}")
        else:
            _remove_old_data(path, keep=data)
    group.agree(None, problem)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())


def _metadata(
    keys: list[str],
    entries: list[list[Any]],
    writers: list[int | None],
    written: list[list[Any]],
    data: str,
) -> dict[str, Any]:
    raw = [dict(pairs) for pairs in written]
    items = {}
    for index, key in enumerate(keys):
        first = entries[0][index]
        if first["kind"] == "value":
            items[key] = {"kind": "value", "value": first["value"]}
            continue
        pieces = []
        if first["kind"] == "shard":
            for rank, own in enumerate(entries):
                start, stop = own[index]["rows"]
                if stop > start:
                    pieces.append(_piece(rank, index, [start, stop], raw))
        else:
            shape = first["shape"]
            rows = [0, shape[0]] if shape else None
            pieces.append(_piece(int(writers[index] or 0), index, rows, raw))
        items[key] = {
            "kind": "array",
            "dtype": first["dtype"],
            "shape": first["shape"],
            "pieces": pieces,
        }
    return {
        "format": _FORMAT,
        "version": _VERSION,
        "world_size": len(entries),
        "data": data,
        "items": items,
    }


def _piece(rank: int, index: int, rows: list[int] | None, raw: list[dict[int, bool]]) -> Any:
    return {
        "file": f"rank-{rank}.safetensors",
        "tensor": str(index),
        "rows": rows,
        "raw": raw[rank][index],
    }


def _remove_old_data(path: str, keep: str) -> None:
    """Remove the data directories of earlier (or killed) saves: only ``keep`` is committed."""
    for name in os.listdir(path):
        if name.startswith(_DATA_PREFIX) and name != keep:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


# --------------------------------------------------------------------------------------------
# load


def _read_metadata(path: str) -> dict[str, Any]:
    where = os.path.join(path, METADATA)
    if not os.path.exists(where):
        raise _RankError(
            ValueError,
            f"{path} holds no committed checkpoint (no {METADATA}: not a checkpoint "
            "directory, or every save into it was cut short)",
        )
    try:
        with open(where, encoding="utf-8") as file:
            metadata = json.load(file)
    except (OSError, ValueError) as error:
        raise _RankError(ValueError, f"{where} cannot be read: {error}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != _FORMAT:
        raise _RankError(ValueError, f"{where} is not a distributed checkpoint's metadata")
    if metadata.get("version") != _VERSION:
        raise _RankError(
            ValueError, f"{where} is format version {metadata.get('version')!r}, not {_VERSION}"
        )
    return metadata


def _need(leaf: Any, where: str, item: dict[str, Any], key: str) -> tuple[int, int] | None:
    """The rows of item ``key`` this leaf needs (``None``: all of a 0-d array), checked."""
    if isinstance(leaf, Shard):
        _check_shard(leaf, where)
        shape, dtype = tuple(leaf.global_shape), np.dtype(leaf.local.dtype)
    else:
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    saved_shape = tuple(item["shape"])
    if saved_shape != shape or item["dtype"] != dtype_name(dtype):
        raise _RankError(
            ValueError,
            f"state{key} is {dtype} of (global) shape {shape}, the checkpoint's is "
            f"{item['dtype']} of shape {saved_shape}",
        )
    if isinstance(leaf, Shard):
        return leaf.offset, leaf.offset + int(leaf.local.shape[0])
    return (0, shape[0]) if shape else None


class _Files:
    """The rank files a load opens, each once."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.open: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        from safetensors import safe_open

        handle = self.open.get(name)
        if handle is None:
            where = os.path.join(self.directory, name)
            try:
                handle = safe_open(where, framework="np")
            except Exception as error:  # noqa: BLE001 - safetensors' own error type
                raise _RankError(
                    ValueError,
                    f"{where} cannot be read (the checkpoint is incomplete or damaged): {error}",
                ) from None
            self.open[name] = handle
        return handle

    def close(self) -> None:
        for handle in self.open.values():
            handle.__exit__(None, None, None)


def _read(files: _Files, item: dict[str, Any], rows: tuple[int, int] | None, key: str) -> Any:
    """The rows ``rows`` of saved item ``key`` as a host array of its dtype."""
    dtype = dtype_of_name(item["dtype"])
    if rows is None:  # a 0-d array: one piece, whole
        piece = item["pieces"][0]
        stored = _tensor(files, piece, key, None)
        return decode_array(stored, item["dtype"] if piece["raw"] else None)
    start, stop = rows
    out = np.empty((stop - start, *item["shape"][1:]), dtype)
    filled = 0
    for piece in item["pieces"]:
        first, last = piece["rows"]
        low, high = max(first, start), min(last, stop)
        if low >= high:
            continue
        stored = _tensor(files, piece, key, (low - first, high - first))
        out[low - start : high - start] = decode_array(
            stored, item["dtype"] if piece["raw"] else None
        )
        filled += high - low
    if filled != stop - start:
        raise _RankError(ValueError, f"the checkpoint's pieces of state{key} do not cover its rows")
    return out


def _tensor(files: _Files, piece: dict[str, Any], key: str, rows: tuple[int, int] | None) -> Any:
    handle = files.get(piece["file"])
    try:
        if rows is None:
            return handle.get_tensor(piece["tensor"])
        return handle.get_slice(piece["tensor"])[rows[0] : rows[1]]
    except Exception as error:  # noqa: BLE001 - safetensors' own error type
        raise _RankError(
            ValueError, f"state{key} cannot be read from {piece['file']}: {error}"
        ) from None


def load(state: Any, path: str | os.PathLike[str], *, process_group: Any = None) -> None:
    """Fill ``state``'s arrays (and Shard locals) in place from the checkpoint at ``path``.

    Called on every rank of ``process_group`` (default: the world; without an initialised
    process group, one process loads alone), on any number of ranks: each rank reads the rows
    its leaves need, whatever number of ranks saved them (see the module). Every key path of
    ``state`` must be in the checkpoint with the same (global) shape and dtype; keys the
    checkpoint has beyond them are not read (torch DCP's partial load). Python values in
    ``state`` are replaced in their dicts and lists. Nothing is written into ``state`` unless
    every rank found everything it needs.

    Args:
        state: a pytree of Shards, arrays and scalars, as :func:`save` takes (the arrays are
            written in place, on their devices).
        path: a checkpoint directory :func:`save` wrote.
        process_group: the ranks that load together (default: the world).

    Raises:
        KeyError: a key path of ``state`` is not in the checkpoint (on every rank, naming it).
        ValueError: no committed checkpoint at ``path``, a file missing or damaged, a shape or
            dtype that differs, a value in a tuple that would have to change.

    Example:
        >>> import os, tempfile, numpy as np
        >>> from cupy_parallel.distributed import checkpoint as dcp
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> dcp.save({"w": dcp.Shard(np.arange(6.0).reshape(3, 2), 0, (3, 2))}, path)
        >>> part = {"w": dcp.Shard(np.zeros((1, 2)), offset=2, global_shape=(3, 2))}
        >>> dcp.load(part, path)  # rows 2:3 of what was saved
        >>> part["w"].local
        array([[4., 5.]])
    """
    group = _Group(process_group, "distributed.checkpoint.load")
    path = os.path.abspath(os.fspath(path))
    keys, leaves, accessors = _read_state(state)
    problem, reads, values = None, [], []
    files: _Files | None = None
    try:
        metadata = _read_metadata(path)
        items = metadata["items"]
        files = _Files(os.path.join(path, str(metadata["data"])))
        for key, leaf, accessor in zip(keys, leaves, accessors, strict=True):
            item = items.get(key)
            where = _where(accessor)
            if item is None:
                raise _RankError(KeyError, f"{where} is not in the checkpoint at {path}")
            if isinstance(leaf, Shard) or is_array(leaf):
                if item["kind"] != "array":
                    raise _RankError(ValueError, f"{where} is an array; the checkpoint has a value")
                rows = _need(leaf, where, item, key)
                reads.append((leaf, _read(files, item, rows, key)))
            else:
                _entry(leaf, where)  # a kind a checkpoint holds
                if item["kind"] != "value":
                    raise _RankError(ValueError, f"{where} is a value; the checkpoint has an array")
                values.append((accessor, _settable(state, accessor, item["value"], where)))
    except _RankError as found:
        problem = found
    finally:
        if files is not None:
            files.close()
    group.agree(None, problem)
    targets = [leaf.local if isinstance(leaf, Shard) else leaf for leaf, _ in reads]
    recording.note_overwritten(targets, "distributed.checkpoint.load")
    for target, host in zip(targets, (host for _leaf, host in reads), strict=True):
        if device_of(target).kind == "cuda":
            copy_into(target, host)
        else:
            np.copyto(plain_buffer(target), host, casting="no")
    for accessor, value in values:
        if value is not _UNCHANGED:
            accessor[:-1](state)[accessor[-1].entry] = value


_UNCHANGED = object()


def _settable(state: Any, accessor: PyTreeAccessor, record: Any, where: str) -> Any:
    """The saved value to set at ``accessor``, or ``_UNCHANGED``; checked to be settable."""
    is_scalar, value = read_scalar(record)
    if not is_scalar:
        raise _RankError(ValueError, f"the checkpoint's value of {where} is damaged")
    current = accessor(state)
    both_nan = current != current and value != value  # noqa: PLR0124 - NaN is saved as NaN
    if type(current) is type(value) and (current == value or both_nan):
        return _UNCHANGED
    if not len(accessor):
        raise _RankError(ValueError, f"{where} is a value, which cannot be set in place")
    parent = accessor[:-1](state)
    if not isinstance(parent, dict | list):
        raise _RankError(
            ValueError,
            f"{where} is {current!r} in a {type(parent).__qualname__}, which cannot be changed "
            f"in place to the saved {value!r}; hold values in dicts or lists",
        )
    return value
