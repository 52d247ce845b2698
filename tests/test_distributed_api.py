"""The process-group API in one process: state errors, argument checks, Work, a world of one.

MPI runs here as a singleton (mpi4py needs no mpiexec for a world of one), so every call really
goes through the MPI backend; multi-rank behaviour is in test_mpi_collectives.py.
"""

from __future__ import annotations

import concurrent.futures
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import pytest

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel._src.averages import average_in_place, decode_average, encode_average
from cupy_parallel._src.distributed import dispatch, groups
from cupy_parallel._src.distributed.work import CompletedWork, Work
from cupy_parallel.distributed import Backend, ReduceOp

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("mpi", world_size=1, timeout=timedelta(seconds=20))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Enums


@pytest.mark.parametrize("name", ["mpi", "MPI", " Mpi "])
def test_backend_parses_any_case(name: str) -> None:
    assert Backend(name) is Backend.MPI
    assert Backend(name) == "mpi"


def test_backend_gloo_points_to_mpi() -> None:
    with pytest.raises(ValueError, match=r"got 'gloo'\. Use Backend\.MPI \('mpi'\)"):
        Backend("gloo")
    with pytest.raises(TypeError, match=r"backend must be a str or Backend"):
        Backend(3)


def test_reduce_op_members() -> None:
    assert [op.name for op in ReduceOp] == [
        *("SUM", "PRODUCT", "MIN", "MAX", "AVG"),
        *("BAND", "BOR", "BXOR"),
    ]


# ---------------------------------------------------------------------------------------------
# State


def test_calls_before_init_raise() -> None:
    assert not dist.is_initialized()
    for call in (
        dist.get_rank,
        dist.get_world_size,
        dist.get_backend,
        dist.new_group,
        dist.barrier,
        lambda: dist.all_reduce(np.zeros(1)),
    ):
        with pytest.raises(RuntimeError, match=r"not initialized; call .*init_process_group"):
            call()


def test_init_twice_raises(world: None) -> None:
    with pytest.raises(RuntimeError, match=r"init_process_group was called twice"):
        dist.init_process_group("mpi")
    assert dist.get_backend() == "mpi"
    assert dist.get_backend() is Backend.MPI
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)


def test_init_argument_errors_change_nothing() -> None:
    with pytest.raises(ValueError, match=r"MPI\.COMM_WORLD \(rank 0 of 1\), got rank=3"):
        dist.init_process_group("mpi", rank=3)
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta"):
        dist.init_process_group("mpi", timeout="30")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"init_method and store are exclusive"):
        dist.init_process_group("mpi", init_method="env://", store=object())
    with pytest.raises(TypeError, match=r"world_size must be an int"):
        dist.init_process_group("mpi", world_size=1.0)  # type: ignore[arg-type]
    assert not dist.is_initialized()


def test_destroy_and_reinit(world: None) -> None:
    dist.destroy_process_group()
    assert not dist.is_initialized()
    dist.init_process_group("MPI", world_size=1)
    x = np.array([2.0])
    dist.all_reduce(x)
    assert x.tolist() == [2.0]


def test_failed_rendezvous_closes_the_store_it_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A world that never fills: init_process_group raises and stops the TCPStore it started.

    The store path serves the NCCL backend; its table entry points at the MPI class here so the
    path runs without a GPU (the rendezvous fails before any backend is made).
    """
    from cupy_parallel._src.distributed.mpi import MPIBackend

    monkeypatch.setitem(groups._BACKENDS, Backend.NCCL, groups._BACKENDS[Backend.MPI])
    monkeypatch.setattr(MPIBackend, "needs_store", True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(
        TimeoutError, match=r"after 0\.3 s: 1 of 2 ranks arrived \(missing ranks: 1\)"
    ):
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=2,
            timeout=timedelta(seconds=0.3),
        )
    assert not dist.is_initialized()
    assert groups.state().owned_store is None
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # the server is gone


def test_groups(world: None) -> None:
    sub = dist.new_group([0])
    assert isinstance(sub, dist.ProcessGroup)
    assert (dist.get_rank(sub), dist.get_world_size(sub), sub.ranks) == (0, 1, (0,))
    assert dist.get_backend(sub) == "mpi"
    x = np.array([1, 2])
    dist.all_reduce(x, group=sub)
    assert x.tolist() == [1, 2]
    dist.destroy_process_group(sub)
    with pytest.raises(ValueError, match=r"process group '1' was destroyed"):
        dist.all_reduce(x, group=sub)
    with pytest.raises(
        ValueError, match=r"world ranks in \[0, 1\), got \[0, 1\] \(out of range: \[1\]\)"
    ):
        dist.new_group([0, 1])
    with pytest.raises(ValueError, match=r"ranks must be distinct"):
        dist.new_group([0, 0])
    with pytest.raises(NotImplementedError, match=r"new_group\(backend='nccl'\) under a 'mpi'"):
        dist.new_group(backend="nccl")
    with pytest.raises(TypeError, match=r"group must be None, group.WORLD"):
        dist.all_reduce(x, group="world")
    non_member = dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_rank(non_member) == -1
    assert dist.get_world_size(non_member) == -1
    with pytest.warns(UserWarning, match=r"Running all_reduce on global rank 0 which does not"):
        assert dist.all_reduce(x, group=non_member) is None
    with pytest.warns(UserWarning, match=r"Running recv on global rank 0 which does not"):
        assert dist.recv(x, group=non_member) == -1
    assert dist.get_rank(dist.group.WORLD) == 0


_NON_MEMBER_CALLS = {
    "broadcast": lambda x, g: dist.broadcast(x, 0, g),
    "all_reduce": lambda x, g: dist.all_reduce(x, group=g),
    "reduce": lambda x, g: dist.reduce(x, 0, group=g),
    "all_gather": lambda x, g: dist.all_gather([x], x, g),
    "all_to_all_single": lambda x, g: dist.all_to_all_single(x, x.copy(), group=g),
    "gather": lambda x, g: dist.gather(x, [x], 0, g),
    "scatter": lambda x, g: dist.scatter(x, [x.copy()], 0, g),
    "barrier": lambda x, g: dist.barrier(g),
    "monitored_barrier": lambda x, g: dist.monitored_barrier(g),
    "send": lambda x, g: dist.send(x, 0, g),
    "isend": lambda x, g: dist.isend(x, 0, g),
    "irecv": lambda x, g: dist.irecv(x, 0, g),
    "batch_isend_irecv": lambda x, g: dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0, g)]),
    "all_gather_object": lambda x, g: dist.all_gather_object([None], 1, g),
    "broadcast_object_list": lambda x, g: dist.broadcast_object_list([x], 0, g),
}


@pytest.mark.parametrize("initialized", [True, False], ids=["world", "before-init"])
@pytest.mark.parametrize("name", list(_NON_MEMBER_CALLS))
def test_non_members_are_warned_as_torch_warns(name: str, initialized: bool) -> None:
    """A call on a group this rank is not in does nothing, as in torch, but no longer silently.

    torch (c10d's ``_warn_not_in_group``) warns ``Running <op> on global rank <r> which does not
    belong to the given group.``, with ``r = -1`` before ``init_process_group``; the warning
    points at the caller's line.
    """
    if initialized:
        dist.init_process_group("mpi", world_size=1, timeout=timedelta(seconds=20))
    try:
        x = np.arange(3.0)
        rank = 0 if initialized else -1
        message = (
            rf"^Running {name} on global rank {rank} which does not belong to the given group\."
        )
        with pytest.warns(UserWarning, match=message) as caught:
            result = _NON_MEMBER_CALLS[name](x, dist.GroupMember.NON_GROUP_MEMBER)
        assert result is None or result == []
        assert x.tolist() == [0.0, 1.0, 2.0]
        assert [w.filename for w in caught] == [__file__]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Argument checks, pinned


_TORCH_VALUE_ERRORS = {
    "complex-min": (
        lambda: dist.all_reduce(np.zeros(2, complex), op=ReduceOp.MIN),
        r"ReduceOp\.MIN is not defined for complex dtype complex128",
    ),
    "complex-max-reduce": (
        lambda: dist.reduce(np.zeros(2, np.complex64), 0, op=ReduceOp.MAX),
        r"ReduceOp\.MAX is not defined for complex dtype complex64",
    ),
    "all_gather-dtypes": (
        lambda: dist.all_gather([np.zeros(2, np.float32)], np.zeros(2)),
        r"tensor_list\[0\] has dtype float32 but tensor has float64",
    ),
    "batch-entry": (
        lambda: dist.batch_isend_irecv([1]),  # type: ignore[list-item]
        r"p2p_op_list\[0\] must be a P2POp, got int",
    ),
    "batch-not-a-list": (
        lambda: dist.batch_isend_irecv(3),  # type: ignore[arg-type]
        r"p2p_op_list must be a list of P2POp, got int",
    ),
    "Backend(None)": (lambda: Backend(None), r"backend must be a str or Backend"),
    "PrefixStore(p, None)": (
        lambda: dist.PrefixStore("p", None),  # type: ignore[arg-type]
        r"store must be a cupy_parallel Store .*got NoneType",
    ),
}


@pytest.mark.parametrize("case", list(_TORCH_VALUE_ERRORS))
@pytest.mark.parametrize("caught", [ValueError, TypeError], ids=["torch", "ours"])
def test_errors_torch_raises_as_value_errors_are_both(
    world: None, case: str, caught: type[Exception]
) -> None:
    """torch raises ValueError here, where our convention says TypeError: both catch ours.

    (torch: ``_check_p2p_op_list``, ``Backend.__new__``, ``_ensure_all_tensors_same_dtype``, the
    complex check of ``all_reduce``/``reduce``; ``PrefixStore`` refuses a ``None`` store.)
    """
    call, message = _TORCH_VALUE_ERRORS[case]
    with pytest.raises(caught, match=message):
        call()


def test_array_checks(world: None) -> None:
    with pytest.raises(TypeError, match=r"tensor must be an array .* got list"):
        dist.all_reduce([1.0])
    with pytest.raises(ValueError, match=r"tensor must be C-contiguous"):
        dist.all_reduce(np.zeros((4, 4))[:, 0])
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"tensor receives data in place but is read-only"):
        dist.broadcast(frozen, src=0)
    with pytest.raises(TypeError, match=r"op must be a ReduceOp .* got str 'sum'"):
        dist.all_reduce(np.zeros(1), op="sum")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ReduceOp.AVG is not defined for bool arrays"):
        dist.all_reduce(np.zeros(1, bool), op=ReduceOp.AVG)
    with pytest.raises(TypeError, match=r"ReduceOp.MAX is not defined for complex dtype"):
        dist.all_reduce(np.zeros(1, complex), op=ReduceOp.MAX)
    with pytest.raises(TypeError, match=r"hold Python objects"):
        dist.broadcast(np.zeros(1, object), src=0)
    with pytest.raises(TypeError, match=r"cannot reduce arrays of dtype <U1"):
        dist.all_reduce(np.array(["a"]))
    with pytest.raises(
        ValueError, match=r"src=1 is not a member of process group '0', whose world ranks are \[0\]"
    ):
        dist.broadcast(np.zeros(1), src=1)
    with pytest.raises(TypeError, match=r"src must be an int"):
        dist.broadcast(np.zeros(1), src="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"async_op must be a bool, got str"):
        dist.all_reduce(np.zeros(1), async_op="yes")  # type: ignore[arg-type]


def test_a_waited_all_reduce_checks_every_call_once_its_reduction_passed(world: None) -> None:
    """A synchronous all_reduce of a host array takes the quick path (dispatch.all_reduce_now:
    no Work), and a dtype and op that passed their checks on a group are a set lookup there
    after; what can change from call to call is still checked at every call, in run()'s
    words. Oracle: a world of one sums to the array itself (NumPy's copy)."""
    x = np.arange(4.0)
    dist.all_reduce(x)  # float64 and SUM pass here
    dist.all_reduce(np.zeros(2, complex))  # complex and SUM too
    _, backend = dispatch.backend_of(None, "all_reduce")  # type: ignore[misc]
    assert {(np.dtype(float), ReduceOp.SUM), (np.dtype(complex), ReduceOp.SUM)} <= (
        backend.reductions_passed
    )
    with pytest.raises(ValueError, match=r"tensor must be C-contiguous"):
        dist.all_reduce(np.zeros((4, 4))[:, 0])
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"tensor receives data in place but is read-only"):
        dist.all_reduce(frozen)
    with pytest.raises(TypeError, match=r"op must be a ReduceOp .* got str 'sum'"):
        dist.all_reduce(np.zeros(1), op="sum")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"op must be a ReduceOp .* got list \[<ReduceOp.SUM"):
        dist.all_reduce(np.zeros(1), op=[ReduceOp.SUM])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ReduceOp.MAX is not defined for complex dtype"):
        dist.all_reduce(np.zeros(1, complex), op=ReduceOp.MAX)
    with pytest.raises(TypeError, match=r"tensor must be an array .* got list"):
        dist.all_reduce([1.0])  # type: ignore[arg-type]
    expected = x.copy()
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, expected)
    h = cupy_parallel.to_device(np.arange(3.0), "host:0")
    dist.all_reduce(h, op=ReduceOp.AVG)  # a host array: the same path, its mean taken
    np.testing.assert_array_equal(cupy_parallel.to_device(h, "cpu"), np.arange(3.0))
    work = dist.all_reduce(x, async_op=True)  # async_op=True: a Work, as ever
    assert isinstance(work, Work)
    assert work.result() == [x]
    sub = dist.new_group([0])
    dist.all_reduce(x, group=sub)
    dist.destroy_process_group(sub)
    with pytest.raises(ValueError, match=r"process group '1' was destroyed"):
        dist.all_reduce(x, group=sub)
    backend.failure = "a call timed out (this test says so)."
    with pytest.raises(RuntimeError, match=r"process group '0' is unusable: a call timed out"):
        dist.all_reduce(x)
    backend.failure = None


def test_list_checks(world: None) -> None:
    x = np.zeros(2)
    with pytest.raises(ValueError, match=r"gather_list must be given on the destination rank 0"):
        dist.gather(x)
    with pytest.raises(ValueError, match=r"tensor_list must hold 1 arrays, got 2"):
        dist.all_gather([np.zeros(2), np.zeros(2)], x)
    with pytest.raises(
        ValueError, match=r"tensor_list\[0\] has shape \(3,\) but tensor has \(2,\)"
    ):
        dist.all_gather([np.zeros(3)], x)
    with pytest.raises(TypeError, match=r"tensor_list\[0\] has dtype int64 but tensor has float64"):
        dist.all_gather([np.zeros(2, np.int64)], x)
    with pytest.raises(TypeError, match=r"scatter_list must be a list of arrays, got ndarray"):
        dist.scatter(x, np.zeros((1, 2)))  # type: ignore[arg-type]
    host = cupy_parallel.to_device(np.zeros(2), "host:1")
    with pytest.raises(ValueError, match=r"tensor_list\[0\] is on cpu but tensor is on host:1"):
        dist.all_gather([np.zeros(2)], host)
    same = [cupy_parallel.to_device(np.zeros(2), "host:1") for _ in range(2)]
    with pytest.raises(
        ValueError, match=r"one array per local device .* got devices \['host:1', 'host:1'\]"
    ):
        dist.all_reduce_multigpu(same)
    pair = [cupy_parallel.to_device(np.zeros(2), f"host:{k}") for k in range(2)]
    with pytest.raises(ValueError, match=r"src_tensor must be in \[0, 2\)"):
        dist.broadcast_multigpu(pair, src=0, src_tensor=2)
    with pytest.raises(ValueError, match=r"tensors must hold at least one array"):
        dist.all_reduce_coalesced([])
    with pytest.raises(
        TypeError,
        match=r"output_tensor_list\[0\] has dtype int32 but input_tensor_list\[0\] has float64",
    ):
        dist.all_to_all([np.zeros(1, np.int32)], [np.zeros(1)])


@pytest.mark.parametrize(
    ("lists", "arrays", "error", "message"),
    [
        (np.zeros(2), np.zeros(2), TypeError, r"must be a list of (lists of )?arrays, got ndarray"),
        ([], [], ValueError, r"must hold 1 (arrays|lists), got 0"),
        ([[np.zeros(2)]] * 2, [np.zeros(2)] * 2, ValueError, r"must hold 1 (arrays|lists), got 2"),
    ],
    ids=["not-a-list", "empty", "too-long"],
)
def test_all_to_all_and_all_gather_coalesced_share_list_checks(
    world: None, lists: object, arrays: object, error: type[Exception], message: str
) -> None:
    """The same bad output list raises the same exception type in both (they used to differ)."""
    x = np.zeros(2)
    with pytest.raises(error, match=message):
        dist.all_gather_coalesced(lists, [x])  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        dist.all_to_all(arrays, [x])  # type: ignore[arg-type]


def test_outputs_sharing_memory_are_refused(world: None) -> None:
    """``[[buf, buf]]`` used to be accepted: buf held the last input, the first result was lost.

    (The lists of one array per rank, ``[buf] * n``, need ranks: mpi_workers/api_worker.py.)
    """
    buf = np.full(2, -1.0)
    with pytest.raises(
        ValueError,
        match=r"output_tensor_lists\[0\]\[0\] and output_tensor_lists\[0\]\[1\] share memory, "
        r"but this collective writes into each of them.*they are one array \(a list made as "
        r"\[buf\] \* n repeats buf\)",
    ):
        dist.all_gather_coalesced([[buf, buf]], [np.ones(2), np.zeros(2)])
    base = np.full(3, -1.0)
    with pytest.raises(ValueError, match=r"\[0\]\[0\] and output_tensor_lists\[0\]\[1\] share"):
        dist.all_gather_coalesced([[base[:2], base[1:]]], [np.ones(2), np.zeros(2)])
    assert buf.tolist() == [-1.0, -1.0]
    assert base.tolist() == [-1.0] * 3
    # Past 8 outputs the overlap test sorts by address instead of testing every pair.
    many = np.zeros(21)
    disjoint = [many[2 * k : 2 * k + 2] for k in range(10)]
    inputs = [np.full(2, float(k)) for k in range(10)]
    dist.all_gather_coalesced([disjoint], inputs)
    assert many.tolist() == [float(k) for k in range(10) for _ in range(2)] + [0.0]
    with pytest.raises(ValueError, match=r"\[0\]\[8\] and output_tensor_lists\[0\]\[9\] share"):
        dist.all_gather_coalesced([[*disjoint[:9], many[17:19]]], inputs)
    # Reading and writing one array is fine (MPI stages the input): the own slot as the input.
    out = [np.zeros(2)]
    out[0][:] = [1.0, 2.0]
    dist.all_gather(out, out[0])
    assert out[0].tolist() == [1.0, 2.0]


def test_p2p_checks(world: None) -> None:
    with pytest.raises(
        ValueError, match=r"dst=0 is this process's own rank; a rank cannot send to itself"
    ):
        dist.send(np.zeros(1), dst=0)
    with pytest.raises(ValueError, match=r"tag must be >= 0, got -1"):
        dist.isend(np.zeros(1), dst=0, tag=-1)
    with pytest.raises(TypeError, match=r"dst must be an int"):
        dist.isend(np.zeros(1), dst=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("entry", "message", "error"),
    [
        ({"tensor": [1.0]}, r"p2p_op_list\[1\]\.tensor must be an array .*got list", TypeError),
        ({"tensor": "frozen"}, r"p2p_op_list\[1\]\.tensor receives data in place", ValueError),
        ({"tensor": "strided"}, r"p2p_op_list\[1\]\.tensor must be C-contiguous", ValueError),
        ({"peer": 0}, r"p2p_op_list\[1\]\.peer=0 is this process's own rank", ValueError),
        ({"peer": 5}, r"p2p_op_list\[1\]\.peer=5 is not a member of process group", ValueError),
        ({"peer": "1"}, r"p2p_op_list\[1\]\.peer must be an int, got str", TypeError),
        ({"tag": -1}, r"p2p_op_list\[1\]\.tag must be >= 0, got -1", ValueError),
        ({"tag": 1.0}, r"p2p_op_list\[1\]\.tag must be an int, got float", TypeError),
    ],
    ids=[
        "not-an-array",
        "read-only",
        "strided",
        "own-rank",
        "not-a-member",
        "peer-str",
        "tag-negative",
        "tag-float",
    ],
)
def test_batch_isend_irecv_names_the_entry_it_refuses(
    world: None, entry: dict[str, object], message: str, error: type[Exception]
) -> None:
    """A bad entry of a batch is named by its index and field (``p2p_op_list[1].tensor``);
    the message used to say ``tensor`` (or ``src``/``tag``) alone, leaving the reader to find
    which of the batch's operations was meant. Nothing is started: the first entry's buffer
    keeps its contents."""
    first = np.full(2, -1.0)
    fields: dict[str, object] = {"tensor": np.zeros(2), "peer": None, "tag": 0}
    fields.update(entry)
    if isinstance(fields["tensor"], str):  # an array made here: "frozen" or "strided"
        made = np.zeros((2, 2))[:, 0] if fields["tensor"] == "strided" else np.zeros(2)
        made.flags.writeable = fields["tensor"] != "frozen"
        fields["tensor"] = made
    ops = [
        dist.P2POp(dist.irecv, first, None),
        dist.P2POp(dist.irecv, fields["tensor"], fields["peer"], tag=fields["tag"]),  # type: ignore[arg-type]
    ]
    with pytest.raises(error, match=message):
        dist.batch_isend_irecv(ops)
    assert first.tolist() == [-1.0, -1.0]
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, first, None)])  # still usable
    assert len(works) == 1
    assert not works[0].is_completed()


# ---------------------------------------------------------------------------------------------
# A world of one against NumPy


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint16, np.int64, np.float16, np.float32, np.complex128]
)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG])
def test_single_rank_reductions_are_identity(world: None, dtype: type, op: ReduceOp) -> None:
    original = (np.arange(6) - 2).reshape(2, 3).astype(dtype)
    x = original.copy()
    if op is ReduceOp.PRODUCT and np.dtype(dtype).kind == "c":  # torch refuses it (issue 34)
        with pytest.raises(ValueError, match=r"PRODUCT is not supported on complex dtype"):
            dist.all_reduce(x, op=op)
        return
    work = dist.all_reduce(x, op=op, async_op=True)
    assert isinstance(work, Work)
    assert work.wait() is True
    np.testing.assert_array_equal(x, original)
    assert x.dtype == original.dtype


def test_work_result_and_torch_futures(world: None) -> None:
    """Work.result() and a future with torch.futures.Future's wait/value/then (they were absent)."""
    x = np.arange(3.0)
    work = dist.all_reduce(x, async_op=True)
    result = work.result()
    assert len(result) == 1
    assert result[0] is x
    assert dist.barrier(async_op=True).result() == []
    future = dist.all_reduce(x, async_op=True).get_future()
    assert future.wait()[0] is x  # torch's wait() returns the value
    assert future.value()[0] is x
    assert future.then(lambda f: f.value()[0].sum() + 1).wait() == 4.0
    failing = future.then(lambda f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    assert isinstance(future, concurrent.futures.Future)
    with pytest.raises(RuntimeError, match=r"value\(\) of a future that is not done yet"):
        type(future)().value()
    # barrier(timeout=): read and passed on (a late rank: mpi_workers/api_worker.py)
    assert dist.barrier(timeout=5) is None
    assert dist.barrier(timeout=timedelta(seconds=5)) is None
    with pytest.raises(ValueError, match=r"barrier got timeout=5 and async_op=True"):
        dist.barrier(async_op=True, timeout=5)
    with pytest.raises(ValueError, match=r"timeout must be more than 0 seconds, got -1"):
        dist.barrier(timeout=-1)


def test_process_group_methods_torch_code_calls(world: None) -> None:
    """pg.allreduce/pg.barrier return a Work; pg.monitored_barrier(timeout) (all were missing)."""
    pg = dist.new_group([0])
    x = np.arange(3.0)
    for tensors in (x, [x]):
        work = pg.allreduce(tensors)
        assert isinstance(work, Work)
        assert work.result()[0] is x
    assert x.tolist() == [0.0, 1.0, 2.0]  # a sum over one rank
    assert pg.allreduce([x], ReduceOp.MAX).wait()
    with pytest.raises(TypeError, match=r"op must be a ReduceOp .*got str 'max'"):
        pg.allreduce([x], "max")
    with pytest.raises(TypeError, match=r"tensors must be an array or a list of arrays, got set"):
        pg.allreduce({1})
    barrier_work = pg.barrier()
    assert isinstance(barrier_work, Work)
    assert barrier_work.wait()
    assert pg.monitored_barrier(timedelta(seconds=5)) is None
    assert pg.monitored_barrier(5, wait_all_ranks=True) is None


def test_single_rank_movement(world: None) -> None:
    x = np.arange(6.0).reshape(2, 3)
    out = [np.zeros((2, 3))]
    dist.all_gather(out, x)
    np.testing.assert_array_equal(out[0], x)
    got = np.zeros((2, 3))
    dist.scatter(got, [x], src=0)
    np.testing.assert_array_equal(got, x)
    multi = [[np.zeros(2), np.zeros((), np.int8)]]
    dist.all_gather_coalesced(multi, [np.array([1.5, 2.5]), np.array(7, np.int8)])
    assert multi[0][0].tolist() == [1.5, 2.5]
    assert int(multi[0][1]) == 7


# ---------------------------------------------------------------------------------------------
# Work


class _Never(Work):
    __slots__ = ("abandoned",)

    def __init__(self) -> None:
        super().__init__("all_reduce", "7", 30.0)
        self.abandoned = False

    def _test(self) -> bool:
        return False

    def _on_timeout(self) -> None:
        self.abandoned = True


class _Broken(Work):
    __slots__ = ()

    def _test(self) -> bool:
        raise OSError("link down")


def test_work_timeout_names_operation_and_group() -> None:
    work = _Never()
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"all_reduce on process group '7' did not complete within 0.05 s"
    ):
        work.wait(timeout=timedelta(milliseconds=50))
    assert 0.05 <= time.monotonic() - start < 5
    assert work.abandoned
    assert not work.is_completed()
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta or a number"):
        work.wait(timeout="1")  # type: ignore[arg-type]


class _FinishesOnTest(Work):
    """An operation that has finished by the ``n``-th time it is tested."""

    __slots__ = ("n", "tests")

    def __init__(self, n: int) -> None:
        super().__init__("broadcast", "3", 30.0)
        self.n = n
        self.tests = 0

    def _test(self) -> bool:
        self.tests += 1
        return self.tests >= self.n


def test_a_wait_past_its_deadline_still_tests_before_reporting_a_timeout() -> None:
    finished = _FinishesOnTest(3)
    assert finished.wait(timeout=1e-9) is True  # it had finished: no TimeoutError
    assert finished.tests == 3
    never = _FinishesOnTest(10**9)
    with pytest.raises(TimeoutError, match=r"broadcast on process group '3' .* within 1e-09 s"):
        never.wait(timeout=1e-9)
    assert never.tests > 0  # it was asked before being reported late


def test_a_completed_work_lets_go_of_its_arrays(world: None) -> None:
    x = np.arange(4.0)
    work = dist.all_reduce(x, async_op=True)
    assert work._keep is x  # MPI may write into x until the operation completed
    assert work.wait()
    assert work._keep is None
    np.testing.assert_array_equal(x, np.arange(4.0))


class _ArrivesAtTheCancel(Work):
    """A receive whose message lands between the group's timeout and the cancel."""

    __slots__ = ("received",)

    def __init__(self) -> None:
        super().__init__("recv from group rank 1", "0", 0.05)
        self.received = False

    def _test(self) -> bool:
        return False

    def _cancel(self) -> bool:
        self.received = True  # MPI's cancel found the message already delivered
        self.complete()
        return True


def test_a_receive_that_finished_at_the_cancel_is_not_reported_lost() -> None:
    work = _ArrivesAtTheCancel()
    assert work.wait() is True  # the message is in the array: no TimeoutError
    assert work.received
    assert work.is_success()
    assert work.exception() is None


class _CancelledAtTheTimeout(_ArrivesAtTheCancel):
    """A receive that the cancel takes back: nothing arrived."""

    __slots__ = ()

    def _cancel(self) -> bool:
        self.fail(TimeoutError("recv from group rank 1 was cancelled."))
        return True


def test_a_cancelled_receive_repeats_the_whole_account_on_every_wait() -> None:
    work = _CancelledAtTheTimeout()
    account = (
        r"recv from group rank 1 on process group '0' did not complete within 0.05 s \(a peer "
        r"did not join, died, or is far behind\). It was cancelled; the process group stays "
        r"usable."
    )
    for _ in range(2):
        with pytest.raises(TimeoutError, match=account):
            work.wait()
    assert not work.received
    assert isinstance(work.exception(), TimeoutError)


def test_work_reports_backend_errors() -> None:
    work = _Broken("barrier", "0")
    with pytest.raises(OSError, match=r"link down"):
        work.wait()
    assert work.is_completed()
    assert isinstance(work.exception(), OSError)
    assert not work.is_success()


def test_work_finalizers_run_once_in_order() -> None:
    calls: list[int] = []
    work = CompletedWork("x", "0")
    work.add_finalizer(lambda: calls.append(1)).add_finalizer(lambda: calls.append(2))
    assert work.wait()
    assert work.wait()
    assert calls == [1, 2]
    failing = CompletedWork("x", "0").add_finalizer(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    assert isinstance(failing.exception(), ZeroDivisionError)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint8, np.uint64])
def test_integer_average_rounds_toward_zero(dtype: type) -> None:
    info = np.iinfo(dtype)
    candidates = [info.min, info.min + 1, -7, -6, -5, -1, 0, 1, 5, 6, 7, info.max - 1, info.max]
    values = np.array([v for v in candidates if info.min <= v <= info.max], dtype)
    for count in (2, 3, 4):
        x = values.copy()
        average_in_place(x, count, np)
        expected = [int(v) // count if int(v) >= 0 else -(-int(v) // count) for v in values]
        assert x.tolist() == expected


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_exact_integer_average_of_0d_arrays(dtype: type) -> None:
    # AVG of 64-bit integers travels as quotient and remainder; a 0-d array's (a scalar
    # loss, say) decoded through NumPy's 0-d floor_divide, a scalar, raised TypeError ("return
    # arrays must be of ArrayType") on every backend. Oracle: Python's integers.
    info = np.iinfo(dtype)
    for candidates in ([info.max, info.max, 1], [info.min, 5, -3], [7, 8, 0]):
        values = [v for v in candidates if info.min <= v <= info.max]
        total = np.zeros((2,), dtype)
        for v in values:
            part = np.zeros((2,), dtype)
            encode_average(np.array(v, dtype), len(values), part, np)
            total += part
        mean = decode_average(total, len(values), np)
        exact = sum(values)
        expected = exact // len(values) if exact >= 0 else -(-exact // len(values))
        assert isinstance(mean, np.ndarray)
        assert mean.shape == ()
        assert int(mean) == expected


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_average_divides_each_part(dtype: type) -> None:
    # AVG of complex arrays: the sum's real and imaginary parts divided by the count, as NCCL's
    # average of the float pairs torch reduces complex tensors as. NumPy's x / 2 divides by
    # 2+0j, which turned the mean of inf+0j and inf+0j into inf+nanj. Oracle: the parts
    # divided one by one; then AVG on 2 and 3 thread ranks (the MPI backend).
    inf = np.inf
    values = np.array([inf + 0j, complex(inf, -inf), complex(0, inf), 3 - 1j, 1e-40 + 5j], dtype)
    for x in (values.copy(), values[::2].copy(), np.array(values[0])):
        expected = np.empty_like(x)
        expected.real, expected.imag = x.real / 2, x.imag / 2
        average_in_place(x, 2, np)
        assert x.tobytes() == expected.tobytes()

    def mean(rank: int, n: int) -> np.ndarray:
        x = np.array([inf + 0j, 2 + 4j * (rank + 1), complex(-inf, 1)], dtype)
        dist.all_reduce(x, op=ReduceOp.AVG)
        return x

    for n in (2, 3):
        expected = np.array([inf, 2, -inf], dtype)
        expected.imag = [0, 4 * sum(range(1, n + 1)) / n, 1]
        for got in dist.spawn(mean, n, args=(n,)):
            np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------------------------------------
# One argument reader: NumPy integers and every timeout form


@pytest.mark.parametrize("timeout", [5, 5.0, np.int64(5), np.float32(5.0), timedelta(seconds=5)])
def test_every_timeout_accepts_seconds_and_timedelta(timeout: object) -> None:
    dist.init_process_group("mpi", world_size=1, timeout=timeout)  # type: ignore[arg-type]
    try:
        sub = dist.new_group(np.arange(1), timeout=timeout)  # type: ignore[arg-type]
        assert dist.get_process_group_ranks(sub) == [0]
        work = dist.all_reduce(np.ones(1), group=sub, async_op=True)
        assert work is not None
        assert work.wait(timeout=timeout) is True  # type: ignore[arg-type]
        dist.monitored_barrier(timeout=timeout)
    finally:
        dist.destroy_process_group()


def test_numpy_integers_for_ranks_tags_and_indices(world: None) -> None:
    with pytest.raises(ValueError, match=r"dst=0 is this process's own rank"):
        dist.isend(np.zeros(1), dst=np.int64(0), tag=np.int64(1))  # the tag was accepted
    pair = [cupy_parallel.to_device(np.arange(2), f"host:{k}") for k in range(2)]
    dist.broadcast_multigpu(pair, src=np.int32(0), src_tensor=np.uint8(1))
    assert dist.get_global_rank(None, np.int16(0)) == 0
    assert dist.get_group_rank(dist.group.WORLD, np.uint64(0)) == 0
    with pytest.raises(TypeError, match=r"tag must be an int, got float"):
        dist.isend(np.zeros(1), dst=0, tag=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"each of ranks must be an int, got bool"):
        dist.new_group([True])


def test_pytorch2_argument_errors(world: None) -> None:
    x = np.zeros(2)
    with pytest.raises(
        ValueError, match=r"output_tensor must have shape \(1, 2\) or \(2,\) .* got \(3,\)"
    ):
        dist.all_gather_into_tensor(np.zeros(3), x)
    with pytest.raises(TypeError, match=r"output_tensor has dtype int64 but input_tensor has"):
        dist.all_gather_into_tensor(np.zeros(2, np.int64), x)
    with pytest.raises(ValueError, match=r"input must have shape \(1, 2\) or \(2,\)"):
        dist.reduce_scatter_tensor(x, np.zeros(4))
    with pytest.raises(
        ValueError, match=r"input_split_sizes must hold 1 sizes .* adding up to input's 2 rows"
    ):
        dist.all_to_all_single(x, x, [2], [1])
    with pytest.raises(TypeError, match=r"each of output_split_sizes must be an int"):
        dist.all_to_all_single(x, x, ["2"], [2])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"op must be cupy_parallel.distributed.isend or irecv"):
        dist.P2POp(dist.send, x, 0)
    with pytest.raises(ValueError, match=r"p2p_op_list must hold at least one P2POp"):
        dist.batch_isend_irecv([])
    with pytest.raises(TypeError, match=r"p2p_op_list\[0\] must be a P2POp, got tuple"):
        dist.batch_isend_irecv([(dist.isend, x, 0)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"group_rank must be in \[0, 1\)"):
        dist.get_global_rank(None, 1)
    with pytest.raises(ValueError, match=r"global_rank=3 is not a member"):
        dist.get_group_rank(None, 3)
    with pytest.raises(ValueError, match=r"scatter_object_output_list must hold at least one"):
        dist.scatter_object_list([], ["a"])
    with pytest.raises(TypeError, match=r"object_list must be a list \(filled in place\)"):
        dist.broadcast_object_list(("a",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"object_list must hold 1 items"):
        dist.all_gather_object([None, None], 1)
    with pytest.raises(TypeError, match=r"ReduceOp.BOR is a bitwise reduction"):
        dist.all_reduce(np.zeros(1), op=ReduceOp.BOR)


def test_single_rank_pytorch2_results(world: None) -> None:
    x = np.array([3, 5], np.uint8)
    dist.all_reduce(x, op=ReduceOp.BXOR)
    assert x.tolist() == [3, 5]
    out = np.zeros((1, 2))
    dist.all_gather_into_tensor(out, np.array([1.0, 2.0]))
    assert out.tolist() == [[1.0, 2.0]]
    y = np.array([1.0, 2.0])
    work = dist.all_reduce(y, async_op=True)
    assert work is not None
    future = work.get_future()
    assert future.result(timeout=10)[0] is y
    gathered: list[object] = [None]
    dist.all_gather_object(gathered, {"k": [1, 2]})
    assert gathered == [{"k": [1, 2]}]
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, np.zeros(1), None)])
    assert len(works) == 1  # a receive from any rank; none will come
    assert not works[0].is_completed()


def test_debug_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match=r"must be OFF, INFO or DETAIL, got 'LOUD'"):
        dist.init_process_group("mpi")
    assert not dist.is_initialized()
    monkeypatch.setenv("CUPY_PARALLEL_DISTRIBUTED_DEBUG", "detail")
    dist.init_process_group("mpi", world_size=1)
    try:
        x = np.ones(2)
        dist.all_reduce(x)  # a world of one agrees with itself
        assert x.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_init_without_backend_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_BACKEND", "mpi")
    dist.init_process_group(world_size=1)
    try:
        assert dist.get_backend() is Backend.MPI
    finally:
        dist.destroy_process_group()
    monkeypatch.delenv("CUPY_PARALLEL_BACKEND")
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "1")
    assert groups._default_backend() is Backend.MPI


# What torch 2.13's gloo backend raises RuntimeError for (its C++ checks), recorded from a
# two-process run: "invalid root rank: 2", "invalid output tensor list at index 0 (expected
# length 2, got 1)", "invalid tensor size at index 0", "Check failed: outputShape[0] *
# worldSize == inputShape[0]", "Split sizes doesn't match total dim 0 size", "Tag must be
# nonnegative", "Tensors must be contiguous". Ours raise ValueError, and RuntimeError too.
TORCH_RUNTIME_ERRORS = {
    "broadcast root out of range": lambda: dist.broadcast(np.zeros(2), src=1),
    "reduce root out of range": lambda: dist.reduce(np.zeros(2), dst=-1),
    "broadcast_object_list root": lambda: dist.broadcast_object_list([1], src=3),
    "all_gather list too long": lambda: dist.all_gather([np.zeros(2), np.zeros(2)], np.zeros(2)),
    "all_gather entry shape": lambda: dist.all_gather([np.zeros(3)], np.zeros(2)),
    "all_gather_into_tensor size": lambda: dist.all_gather_into_tensor(np.zeros(3), np.zeros(2)),
    "reduce_scatter_tensor size": lambda: dist.reduce_scatter_tensor(np.zeros(2), np.zeros(3)),
    "all_gather_into_tensor dtype": lambda: dist.all_gather_into_tensor(
        np.zeros(2, np.float32), np.zeros(2)
    ),
    "all_to_all_single splits": lambda: dist.all_to_all_single(np.zeros(2), np.zeros(2), None, [3]),
    "negative tag": lambda: dist.isend(np.zeros(1), dst=0, tag=-1),
    "non-contiguous receive": lambda: dist.irecv(np.zeros((4, 4))[:, 0], src=0),
}


@pytest.mark.parametrize("case", TORCH_RUNTIME_ERRORS)
def test_errors_torch_raises_as_runtime_error_are_caught_by_both(world: None, case: str) -> None:
    with pytest.raises(RuntimeError) as caught:
        TORCH_RUNTIME_ERRORS[case]()
    assert isinstance(caught.value, ValueError), type(caught.value).__mro__
    x = np.ones(2)
    dist.all_reduce(x)  # refused before any communication: the group goes on
    assert x.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("elsewhere", ["none", "empty", "full"])
def test_gather_object_takes_none_or_an_empty_list_off_the_destination(elsewhere: str) -> None:
    """torch's rule (``_validate_output_list_for_rank``): ``None`` or ``[]`` on the other ranks;
    a non-empty list there raises, on that rank, before anything is sent."""
    given = {"none": None, "empty": [], "full": [None, None]}[elsewhere]

    def program(rank: int) -> object:
        out = [None, None] if rank == 0 else given
        dist.gather_object({"rank": rank}, out, dst=0)
        return out

    if elsewhere == "full":
        with pytest.raises(RuntimeError, match=r"rank 1 failed \(ValueError: object_gather_list "):
            dist.spawn(program, 2, timeout=5)
        return
    root, other = dist.spawn(program, 2)
    assert root == [{"rank": 0}, {"rank": 1}]
    assert other == given
