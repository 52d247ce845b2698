"""save/load and distributed.checkpoint at their edges: what users pass that the main tests do not.

Oracles: ``open(path, "wb")`` and ``numpy.save`` for what happens to an existing file's mode and a
symbolic link, the saved objects themselves (Python ints compared with ``==``, arrays with
``tobytes``), the NumPy arrays sharded states are cut from; and crafted files, which must raise a
``ValueError`` naming the path (never a bare ``TypeError`` from inside the reader, never a value).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel._src.serialization import write_safetensors
from cupy_parallel.distributed import checkpoint as dcp
from cupy_parallel.distributed.checkpoint import Shard


def test_saving_over_a_private_file_keeps_it_private(tmp_path):
    path, oracle = tmp_path / "state", tmp_path / "oracle"
    for file in (path, oracle):
        file.write_bytes(b"old")
        os.chmod(file, 0o600)
    with open(oracle, "wb") as out:  # what torch.save / numpy.save leave: the file's own mode
        out.write(b"new")
    cp.save({"w": np.arange(3.0)}, path)
    assert oct(os.stat(path).st_mode & 0o777) == oct(os.stat(oracle).st_mode & 0o777) == "0o600"
    np.testing.assert_array_equal(cp.load(path)["w"], np.arange(3.0))


def test_saving_through_a_symbolic_link_replaces_the_file_it_names(tmp_path):
    (tmp_path / "runs").mkdir()
    for name in ("latest", "oracle"):
        (tmp_path / "runs" / name).write_bytes(b"old")
        os.symlink(tmp_path / "runs" / name, tmp_path / f"{name}.link")
    np.save(tmp_path / "oracle.link", np.zeros(1))  # numpy.save writes through the link
    assert (tmp_path / "oracle.link").is_symlink()
    cp.save({"w": np.arange(3.0)}, tmp_path / "latest.link")
    assert (tmp_path / "latest.link").is_symlink()
    np.testing.assert_array_equal(cp.load(tmp_path / "runs" / "latest")["w"], np.arange(3.0))
    assert sorted(os.listdir(tmp_path / "runs")) == ["latest", "oracle"]  # no temporary left


def test_python_ints_past_4300_digits_round_trip(tmp_path):
    huge = {"a": 7**6000, "b": -(2**64), "c": 2**63 - 1, "d": -(2**63)}
    cp.save(huge, tmp_path / "ints")
    back = cp.load(tmp_path / "ints")
    assert back == huge
    assert all(type(v) is int for v in back.values())
    dcp.save(huge, tmp_path / "dist")
    state = dict.fromkeys(huge, 0)
    dcp.load(state, tmp_path / "dist")
    assert state == huge


def test_bytes_paths_work_and_an_empty_path_writes_nothing(tmp_path):
    path = os.fsencode(tmp_path / "b")
    cp.save([1, np.ones(2)], path)
    back = cp.load(path)
    assert back[0] == 1
    np.testing.assert_array_equal(back[1], np.ones(2))
    before = sorted(os.listdir(tmp_path.parent))
    with pytest.raises(FileNotFoundError, match="path to save to is empty"):
        cp.save([1], "")
    assert sorted(os.listdir(tmp_path.parent)) == before


def _with_description(path, change, tensor=None):
    """A file save wrote, its tree description changed by ``change`` (a crafted file)."""
    tensor = np.arange(16, dtype=np.uint8).reshape(2, 8) if tensor is None else tensor
    cp.save({"a": tensor}, path)
    from safetensors import safe_open

    with safe_open(path, "np") as handle:
        description = json.loads(handle.metadata()["cupy_parallel"])
    text = change(description)
    text = json.dumps(description) if text is None else text
    write_safetensors(str(path), {"a": tensor}, {"cupy_parallel": text})


def _record(**fields):
    return lambda description: description["leaves"][0].update(fields)


def _tree(node):
    return lambda description: description.update(tree=node)


def _deep(levels):
    leaf = '{"leaf":0}'
    nested = '{"list":[' * levels + leaf + "]}" * levels
    return lambda d: json.dumps(d, separators=(",", ":")).replace(leaf, nested)


CRAFTED = {
    "object dtype": _record(dtype="|O", raw=True, shape=[2]),
    "structured dtype": _record(dtype="i4,f4", raw=True, shape=[2]),
    "item size": _record(dtype="<c16", raw=True, shape=[2]),
    "raw missing": lambda d: d["leaves"][0].update(raw=None),
    "tensor name": _record(array=5),
    "str record": lambda d: d.update(leaves=[{"str": 5}]),
    "bool record": lambda d: d.update(leaves=[{"bool": "false"}]),
    "float record": lambda d: d.update(leaves=[{"float": 3}]),
    "int record": lambda d: d.update(leaves=[{"int": "9" * 5000}]),
    "complex key": _tree({"dict": [[{"complex": [1, 2]}, {"leaf": 0}]]}),
    "dict body": _tree({"dict": 5}),
    "list body": _tree({"list": "abc"}),
    "namedtuple class path": _tree({"namedtuple": ["os.system", ["a"], [{"leaf": 0}]]}),
    "namedtuple fields": _tree({"namedtuple": ["P", ["a", "b"], [{"leaf": 0}]]}),
    "namedtuple body": _tree({"namedtuple": 5}),
    "key paths": lambda d: d.update(paths=[[1]]),
    "deep": _deep(1500),
}


@pytest.mark.parametrize("change", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_description_raises_a_value_error_naming_the_file(tmp_path, change):
    path = tmp_path / "crafted"
    _with_description(path, change)
    damaged = r"crafted( is damaged|: its .cupy_parallel. metadata is not)"
    with pytest.raises(ValueError, match=damaged):
        cp.load(path)


def test_an_ml_dtypes_name_that_is_not_a_dtype_is_refused(tmp_path):
    pytest.importorskip("ml_dtypes")
    path = tmp_path / "crafted"
    _with_description(path, _record(dtype="ml_dtypes:finfo", raw=True, shape=[2]))
    with pytest.raises(ValueError, match=r"crafted is damaged.*'finfo', which is not an ml_dtypes"):
        cp.load(path)


def test_numpy_integer_offsets_save_and_load_on_every_rank(tmp_path):
    full = np.arange(12.0).reshape(6, 2)
    bounds = np.array([0, 4, 6])  # as numpy.cumsum or array_split's sizes give them

    def shard(rank, filled):
        rows = full[bounds[rank] : bounds[rank + 1]]
        local = rows.copy() if filled else np.zeros_like(rows)
        return Shard(local, bounds[rank], (np.int64(6), np.int64(2)))

    dist.spawn(lambda rank: dcp.save({"w": shard(rank, True)}, tmp_path / "c"), 2, timeout=20)
    loaded = dist.spawn(
        lambda rank: (dcp.load(state := {"w": shard(rank, False)}, tmp_path / "c"), state)[1],
        2,
        timeout=20,
    )
    np.testing.assert_array_equal(np.concatenate([s["w"].local for s in loaded]), full)

    def float_offset(rank):
        try:
            dcp.save({"w": Shard(np.zeros((3, 2)), 3.0 * rank, (6, 2))}, tmp_path / "f")
        except TypeError as error:
            return str(error)
        return None

    for message in dist.spawn(float_offset, 2, timeout=20):
        assert "rank 1: state['w'] is a Shard of offset 3.0 and global_shape (6, 2)" in message


def test_loading_into_a_read_only_array_raises_before_writing_anything(tmp_path):
    dcp.save({"a": np.ones(3), "b": np.ones(3)}, tmp_path / "c")
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    for target in (read_only, np.broadcast_to(np.zeros(1), (3,))):
        state = {"a": np.zeros(3), "b": target}
        with pytest.raises(ValueError, match=r"state\['b'\] is a read-only array"):
            dcp.load(state, tmp_path / "c")
        assert not state["a"].any()  # nothing written: the check comes before every write


def test_a_failure_while_committing_is_raised_on_every_rank(tmp_path, monkeypatch):
    from cupy_parallel._src.checkpoint import storage

    def broken(*args):
        raise TypeError("not JSON serializable")

    monkeypatch.setattr(storage, "_metadata", broken)

    def save(rank):
        try:
            dcp.save({"w": np.zeros(2)}, tmp_path / "c")
        except TypeError as error:
            return str(error)
        return None

    for message in dist.spawn(save, 2, timeout=20):
        assert "save failed on rank 0: committing" in message
        assert "not JSON serializable" in message


def test_a_masked_array_is_refused_rather_than_saved_without_its_mask(tmp_path):
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(TypeError, match=r"tree\['m'\] is a numpy.ma.MaskedArray; .*drop its mask"):
        cp.save({"m": masked}, tmp_path / "m")
    with pytest.raises(TypeError, match=r"state\['m'\] is a numpy.ma.MaskedArray"):
        dcp.save({"m": masked}, tmp_path / "d")
    assert os.listdir(tmp_path) == []
    mapped = np.memmap(tmp_path / "raw", dtype="f4", mode="w+", shape=(1, 2))
    mapped[:] = [[1.0, 2.0]]
    cp.save({"m": mapped}, tmp_path / "x")  # other subclasses: their values
    back = cp.load(tmp_path / "x")["m"]
    assert type(back) is np.ndarray
    np.testing.assert_array_equal(back, np.array([[1.0, 2.0]], np.float32))


def test_an_object_array_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    def save(rank):  # only one rank writes a replicated array: it alone used to find out
        try:
            dcp.save({"a": np.zeros(3), "o": np.array([None, 1], object)}, tmp_path / "c")
        except TypeError as error:
            return str(error)
        return None

    for message in dist.spawn(save, 2, timeout=20):
        assert "rank 1: state['o'] is an array of dtype object" in message
    assert not (tmp_path / "c").exists()


def test_shards_that_leave_the_last_rows_uncovered_are_refused_at_save(tmp_path):
    def save(rank):  # rows 0:2 and 2:4 of a 5-row array: row 4 is nobody's
        try:
            dcp.save({"w": Shard(np.ones((2, 3)), 2 * rank, (5, 3))}, tmp_path / "c")
        except ValueError as error:
            return str(error)
        return None

    for message in dist.spawn(save, 2, timeout=20):
        assert "no rank holds rows 4:5 of state['w'] (its global shape has 5 rows)" in message
    with pytest.raises(ValueError, match=r"no rank holds rows 0:5 of state\['w'\]"):
        dcp.save({"w": Shard(np.zeros((0, 3)), 5, (5, 3))}, tmp_path / "c")
    assert not (tmp_path / "c" / ".metadata").exists()


def test_a_load_that_straddles_a_save_reads_one_version_whole(tmp_path, monkeypatch):
    import safetensors

    path = tmp_path / "ckpt"
    cp.save({"step": 10, "w": np.full(4, 10.0)}, path)
    real, saved = safetensors.safe_open, []

    def opened_then_replaced(*args, **kwargs):  # a trainer's save lands just after this open
        handle = real(*args, **kwargs)
        if not saved:
            saved.append(True)
            cp.save({"step": 15, "w": np.full(4, 15.0)}, path)
        return handle

    monkeypatch.setattr(safetensors, "safe_open", opened_then_replaced)
    back = cp.load(path)
    assert back["w"].tolist() == [float(back["step"])] * 4  # was step 10 with step 15's w


def test_ranks_that_read_different_saves_load_nothing(tmp_path, monkeypatch):
    import shutil
    import threading

    from cupy_parallel._src.checkpoint import storage

    path, other = tmp_path / "c", tmp_path / "other"
    dcp.save({"w": np.full(2, 10.0), "step": 10}, path)
    dcp.save({"w": np.full(2, 15.0), "step": 15}, other)  # the save that lands mid-load
    real, first_read = storage._read_metadata, threading.Event()

    def read(where):
        if dist.get_rank() == 1:  # rank 0 has read step 10's metadata; now step 15 commits
            first_read.wait(10)
            data = json.loads((other / ".metadata").read_text())["data"]
            shutil.copytree(other / data, path / data)
            shutil.copy(other / ".metadata", path / ".metadata")
        metadata = real(where)
        first_read.set()
        return metadata

    monkeypatch.setattr(storage, "_read_metadata", read)

    def load(rank):
        state = {"w": np.zeros(2), "step": 0}
        try:
            dcp.load(state, path)
        except RuntimeError as error:
            return str(error), state
        return None, state

    for message, state in dist.spawn(load, 2, timeout=20):
        assert "was replaced while the ranks read it" in message  # was: rank 0 step 10, rank 1 15
        assert state == {"w": state["w"], "step": 0}
        assert not state["w"].any()


def test_tensor_names_stay_unique_when_a_key_is_spelled_like_a_renamed_one(tmp_path):
    import collections

    tree = collections.OrderedDict(  # "a.b" twice (a nested path and a key), then "a.b#2"
        [("a.b#2", np.array([2.0])), ("a", {"b": np.array([1.0])}), ("a.b", np.array([3.0]))]
    )
    cp.save(tree, tmp_path / "n")
    back = cp.load(tmp_path / "n")
    assert list(back) == list(tree)
    assert [back["a.b#2"][0], back["a"]["b"][0], back["a.b"][0]] == [2.0, 1.0, 3.0]  # was 3, 1, 3


def test_a_saved_negative_zero_value_replaces_a_positive_one(tmp_path):
    import math

    dcp.save({"z": -0.0, "c": complex(0.0, -0.0), "l": [-0.0], "n": float("nan")}, tmp_path / "c")
    state = {"z": 0.0, "c": 0j, "l": [0.0], "n": float("nan")}
    dcp.load(state, tmp_path / "c")
    signs = [math.copysign(1.0, x) for x in (state["z"], state["c"].imag, state["l"][0])]
    assert signs == [-1.0, -1.0, -1.0]  # were 1.0: 0.0 == -0.0 counted as unchanged
    assert math.isnan(state["n"])
    dcp.save({"t": (-0.0,)}, tmp_path / "t")
    with pytest.raises(ValueError, match=r"state\['t'\]\[0\] is 0.0 in a tuple"):
        dcp.load({"t": (0.0,)}, tmp_path / "t")


def _bits(value):
    import struct

    return struct.pack("<d", value).hex()


def test_python_nan_floats_keep_their_sign_and_payload(tmp_path):
    import struct

    nan = struct.unpack("<d", bytes.fromhex("0100000000f8ffff"))[0]  # -NaN, payload 1
    tree = [nan, complex(1.0, nan), float("nan"), -0.0]
    cp.save(tree, tmp_path / "n")
    back = cp.load(tmp_path / "n")
    parts = [back[0], back[1].real, back[1].imag, back[2], back[3]]
    assert [_bits(v) for v in parts] == [_bits(v) for v in (nan, 1.0, nan, float("nan"), -0.0)]
    dcp.save({"n": nan}, tmp_path / "d")  # a state's NaN of other bits is replaced
    state = {"n": float("nan")}
    dcp.load(state, tmp_path / "d")
    assert _bits(state["n"]) == "0100000000f8ffff"  # float.hex gave "nan": 000000000000f87f


def test_python_nan_floats_round_trip_as_torch_save_keeps_them(tmp_path):
    torch = pytest.importorskip("torch")
    import io
    import struct

    nan = struct.unpack("<d", bytes.fromhex("0300000000f8ffff"))[0]
    buffer = io.BytesIO()
    torch.save({"nan": nan}, buffer)
    buffer.seek(0)
    cp.save({"nan": nan}, tmp_path / "n")
    assert _bits(cp.load(tmp_path / "n")["nan"]) == _bits(torch.load(buffer)["nan"])
