"""cupy_parallel.distributed.checkpoint: per-rank files, resharding loads, atomic commits.

Oracle: the NumPy arrays the sharded states are cut from (tests/mpi_workers/checkpoint_worker.py),
compared bit for bit, on thread ranks and under mpiexec; the files themselves (safetensors' own
reader) for who wrote what.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from thread_ranks import MPIEXEC, printed, run_mpiexec, run_threads, worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel.distributed import checkpoint as dcp
from cupy_parallel.distributed.checkpoint import Shard

W = worker("checkpoint_worker")
CASES = (("4->4", range(4)), ("4->2", (0, 1)), ("4->3", (1, 2, 3)), ("2->4", range(4)))
EXPECTED = printed("".join(f"rank {r}: OK {case}\n" for case, ranks in CASES for r in ranks))


def test_saved_on_4_loads_on_2_3_and_4_and_saved_on_2_loads_on_4_thread_ranks(tmp_path):
    ran = run_threads("checkpoint_worker", 4, str(tmp_path), timeout=30)
    assert ran.returncode == 0, ran.stderr
    assert printed(ran.stdout) == EXPECTED


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_saved_on_4_loads_on_2_3_and_4_and_saved_on_2_loads_on_4_mpiexec(tmp_path):
    ran = run_mpiexec("checkpoint_worker", 4, str(tmp_path), timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert printed(ran.stdout) == EXPECTED


def save_on(world, path, make=W.state):
    def program(rank):
        dcp.save(make(rank, world, filled=True), path)

    dist.spawn(program, world, timeout=20)


def test_one_process_without_a_group_loads_and_consolidates(tmp_path):
    path = str(tmp_path / "ckpt")
    save_on(4, path)
    one = W.state(0, 1, filled=False)  # one rank: every shard is the whole array
    dcp.load(one, path)
    assert W.same(one, W.state(0, 1, filled=True)) is None
    plain = {"model": {"w": np.zeros((10, 3)), "emb": np.zeros(5, complex)}}  # no Shard at all
    dcp.load(plain, path)
    full = W.full_arrays()
    assert plain["model"]["w"].tobytes() == full["w"].tobytes()
    assert plain["model"]["emb"].tobytes() == full["emb"].tobytes()


def test_each_rank_writes_its_rows_and_replicated_arrays_are_written_once(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "ckpt"
    save_on(4, str(path))
    metadata = json.loads((path / ".metadata").read_text())
    assert metadata["world_size"] == 4
    data = path / metadata["data"]
    assert sorted(os.listdir(data)) == [f"rank-{r}.safetensors" for r in range(4)]
    shapes = {}
    for r in range(4):
        with safe_open(data / f"rank-{r}.safetensors", framework="np") as f:
            shapes[r] = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    items = metadata["items"]
    w = items["['model']['w']"]
    assert [p["rows"] for p in w["pieces"]] == [[0, 3], [3, 6], [6, 9], [9, 10]]
    assert [p["file"] for p in w["pieces"]] == [f"rank-{r}.safetensors" for r in range(4)]
    emb = items["['model']['emb']"]  # complex128: stored as bytes, 5 rows over 4 ranks
    assert [p["rows"] for p in emb["pieces"]] == [[0, 2], [2, 4], [4, 5]]
    assert shapes[0][emb["pieces"][0]["tensor"]] == (2, 16)
    for key in ("['model']['b']", "['s']"):
        (piece,) = items[key]["pieces"]  # once
        held = [r for r in range(4) if piece["tensor"] in shapes[r]]
        assert held == [int(piece["file"][5])]
    # balance: rank 3 holds the fewest shard bytes (one row of w, none of emb), so it gets b
    assert items["['model']['b']"]["pieces"][0]["file"] == "rank-3.safetensors"
    assert items["['optim']['state'][0]['step']"] == {
        "kind": "value",
        "value": {"float": "0x1.8000000000000p+1"},
    }


def test_host_arrays_and_dtypes_round_trip_on_thread_ranks(tmp_path):
    cp.set_host_device_count(2)
    path = str(tmp_path / "h")
    full = np.arange(24, dtype=np.float16).reshape(6, 4)
    when = np.array([1, 2], ">M8[s]")  # big-endian datetimes: stored as bytes

    def program(rank, filled):
        local = full[3 * rank : 3 * rank + 3]
        local = local.copy() if filled else np.zeros_like(local)
        state = {
            "x": Shard(cp.to_device(local, f"host:{rank}"), 3 * rank, (6, 4)),
            "t": when.copy() if filled else np.zeros(2, ">M8[s]"),
        }
        if filled:
            dcp.save(state, path)
            return None
        dcp.load(state, path)
        return (
            cp.to_device(state["x"].local, "cpu"),
            state["t"],
            str(cp.device_of(state["x"].local)),
        )

    dist.spawn(program, 2, (True,), timeout=20)
    for rank, (x, t, device) in enumerate(dist.spawn(program, 2, (False,), timeout=20)):
        assert device == f"host:{rank}"
        assert x.tobytes() == full[3 * rank : 3 * rank + 3].tobytes()
        assert t.dtype == when.dtype
        assert t.tobytes() == when.tobytes()


def test_cupy_arrays_on_simulated_gpus(tmp_path):
    from cupy_parallel.testing import simulated_cuda

    path = str(tmp_path / "g")
    with simulated_cuda(2):
        x = cp.to_device(np.arange(12.0).reshape(4, 3), "cuda:1")
        dcp.save(
            {"x": x, "part": Shard(cp.to_device(np.ones((2, 2), np.float32), "cuda:0"), 0, (2, 2))},
            path,
        )
        state = {
            "x": cp.to_device(np.zeros((4, 3)), "cuda:0"),
            "part": Shard(cp.to_device(np.zeros((1, 2), np.float32), "cuda:1"), 1, (2, 2)),
        }
        dcp.load(state, path)
        assert cp.device_of(state["x"]) == cp.Device("cuda", 0)
        np.testing.assert_array_equal(
            cp.to_device(state["x"], "cpu"), np.arange(12.0).reshape(4, 3)
        )
        np.testing.assert_array_equal(cp.to_device(state["part"].local, "cpu"), np.ones((1, 2)))


def errors_on_every_rank(world, program):
    """What each rank raised (type name and message)."""

    def wrapped(rank):
        try:
            program(rank)
        except Exception as error:  # noqa: BLE001 - the test reads it
            return type(error).__name__, str(error)
        return None

    return dist.spawn(wrapped, world, timeout=20)


def test_a_missing_key_or_a_mismatch_raises_on_every_rank_and_writes_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    save_on(2, path)

    def missing(rank):
        state = W.state(rank, 2, filled=False)
        if rank == 1:
            state["extra"] = np.zeros(2)
        dcp.load(state, path)

    for kind, message in errors_on_every_rank(2, missing):
        assert kind == "KeyError"
        assert "rank 1: state['extra'] is not in the checkpoint" in message

    untouched = []

    def mismatch(rank):
        state = W.state(rank, 2, filled=False)
        untouched.append(state)
        if rank == 0:
            state["model"]["b"] = np.zeros(3, np.float64)
        dcp.load(state, path)

    for kind, message in errors_on_every_rank(2, mismatch):
        assert kind == "ValueError"
        assert (
            "rank 0: state['model']['b'] is float64 of (global) shape (3,), the checkpoint's is <f4"
            in message
        )
    for state in untouched:  # checked everywhere before anything was written
        assert state["optim"]["state"][0]["step"] == 0.0
        assert not state["model"]["w"].local.any()


def test_an_incomplete_checkpoint_or_none_raises_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    save_on(2, str(path))
    data = path / json.loads((path / ".metadata").read_text())["data"]
    (data / "rank-1.safetensors").unlink()
    results = errors_on_every_rank(2, lambda r: dcp.load(W.state(r, 2, filled=False), str(path)))
    for kind, message in results:
        assert kind == "ValueError"
        assert "rank-1.safetensors cannot be read (the checkpoint is incomplete" in message
    with pytest.raises(ValueError, match=r"holds no committed checkpoint \(no \.metadata"):
        dcp.load({"w": np.zeros(2)}, str(tmp_path))


def test_states_that_disagree_or_shards_that_overlap_are_refused_on_every_rank(tmp_path):
    def overlap(rank):
        dcp.save({"w": Shard(np.zeros((3, 2)), 2 * rank, (5, 2))}, str(tmp_path / "o"))

    for kind, message in errors_on_every_rank(2, overlap):
        assert kind == "ValueError"
        assert "the shards of state['w'] overlap at row 2 (rank 1 holds rows 2:5)" in message

    def differ(rank):
        dcp.save({"w": np.zeros(2 + rank)}, str(tmp_path / "d"))

    for kind, message in errors_on_every_rank(2, differ):
        assert kind == "ValueError"
        assert "state['w'] is an array of shape (3,)" in message
    assert not (tmp_path / "o" / ".metadata").exists()

    def bad_leaf(rank):
        dcp.save({"f": object()} if rank == 1 else {"f": 1}, str(tmp_path / "b"))

    for kind, message in errors_on_every_rank(2, bad_leaf):
        assert kind == "TypeError"
        assert "rank 1: state['f'] is a object" in message

    def object_array(rank):
        dcp.save({"o": np.array([None, rank], dtype=object)}, str(tmp_path / "b"))

    for kind, message in errors_on_every_rank(2, object_array):
        assert kind == "TypeError"
        assert "rank 0: state['o'] is an array of dtype object" in message
    assert not (tmp_path / "b").exists()


def test_damaged_metadata_is_an_error_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    save_on(2, str(path))
    metadata = json.loads((path / ".metadata").read_text())
    del metadata["items"]["['model']['b']"]["pieces"]
    (path / ".metadata").write_text(json.dumps(metadata))
    results = errors_on_every_rank(2, lambda r: dcp.load(W.state(r, 2, filled=False), str(path)))
    for kind, message in results:
        assert kind == "ValueError"
        assert "the checkpoint's metadata is damaged (KeyError('pieces'))" in message


def test_a_failed_write_raises_everywhere_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from cupy_parallel._src.checkpoint import storage

    path = str(tmp_path / "ckpt")
    save_on(2, path)
    real = storage.write_safetensors

    def failing(where, tensors, metadata):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        real(where, tensors, metadata)

    monkeypatch.setattr(storage, "write_safetensors", failing)

    def save_new(rank):
        state = W.state(rank, 2, filled=True)
        state["optim"]["state"][0]["step"] = 4.0
        dcp.save(state, path)

    for kind, message in errors_on_every_rank(2, save_new):
        assert kind == "RuntimeError"
        assert "save failed on rank 1: [Errno 28] No space left on device" in message
    monkeypatch.setattr(storage, "write_safetensors", real)
    one = W.state(0, 1, filled=False)
    dcp.load(one, path)
    assert W.same(one, W.state(0, 1, filled=True)) is None  # step 3.0: the previous one
    save_on(2, path)  # the next save removes the abandoned data directory
    assert len([n for n in os.listdir(path) if n.startswith("data-")]) == 1


def test_values_are_set_in_dicts_and_lists_but_never_in_tuples(tmp_path):
    path = str(tmp_path / "v")
    dcp.save({"a": [1, "x"], "t": (2,)}, path)
    state = {"a": [0, ""], "t": (2,)}
    dcp.load(state, path)
    assert state == {"a": [1, "x"], "t": (2,)}
    with pytest.raises(ValueError, match=r"state\['t'\]\[0\] is 5 in a tuple"):
        dcp.load({"a": [0, ""], "t": (5,)}, path)


CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from cupy_parallel.distributed import checkpoint as dcp
    version = 0
    while True:
        version += 1
        dcp.save({"version": version, "w": np.full(6_000_000, float(version))}, sys.argv[1])
    """
)


def test_a_killed_save_leaves_the_previous_checkpoint_whole(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"version": 0, "w": np.zeros(6_000_000)}, str(path))
    rng = random.Random(99)
    for _trial in range(8):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)],
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        )
        time.sleep(rng.uniform(0.4, 1.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        state = {"version": -1, "w": np.empty(6_000_000)}
        dcp.load(state, str(path))
        assert np.all(state["w"] == float(state["version"]))


def test_ddp_parameters_and_adam_state_saved_on_2_ranks_resume_in_one_process(tmp_path):
    """torch's layout of an optimizer's state goes through the checkpoint and on training."""
    from cupy_parallel.optim import Adam

    path = str(tmp_path / "train")
    rng = np.random.default_rng(3)
    start = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}
    grads = [{"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)} for _ in range(4)]

    def two_steps(rank):  # the replicated state of a DDP run after two steps
        params = {k: v.copy() for k, v in start.items()}
        opt = Adam(params, lr=0.1, amsgrad=True)
        for g in grads[:2]:
            opt.step(g)
        dcp.save({"model": params, "optim": opt.state_dict()}, path)

    dist.spawn(two_steps, 2, timeout=20)
    # resume: parameters first, then an optimizer on them whose state is loaded in place
    params = {k: np.zeros_like(v) for k, v in start.items()}
    opt = Adam(params, lr=0.1, amsgrad=True)
    zeros = {name: np.zeros_like(start[key]) for name, key in (("w", "w"), ("b", "b"))}
    slots = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    optim = {
        "state": {
            i: {"step": 0.0, **{s: zeros[k].copy() for s in slots}} for i, k in enumerate("bw")
        },
        "param_groups": opt.state_dict()["param_groups"],
    }
    dcp.load({"model": params, "optim": optim}, path)
    opt.load_state_dict(optim)
    for g in grads[2:]:
        opt.step(g)
    # the oracle: the same four steps without a checkpoint
    expected = {k: v.copy() for k, v in start.items()}
    uninterrupted = Adam(expected, lr=0.1, amsgrad=True)
    for g in grads:
        uninterrupted.step(g)
    for key, value in expected.items():
        assert params[key].tobytes() == value.tobytes()
