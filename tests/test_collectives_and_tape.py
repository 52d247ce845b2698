"""A collective writing into an array a tape recorded makes the gradient raise (issue 21, item 1).

``dist.all_reduce(h)`` on a recorded ``h`` used to give a silently wrong gradient (the tanh's
gradient computed from the reduced values). The collective knows what it writes: each one that
writes in place into an array an active tape tracks or saved makes ``Tape.gradient`` raise the
in-place ``RuntimeError``, for NumPy and host arrays (MPI) and CuPy arrays (NCCL, under
``simulated_cuda``), sync and async, without ``check_writes``.
Reading a recorded array (the send side, a broadcast's root) stays allowed. A world of one rank
(MPI outside mpiexec) runs every collective here.
Every tape hears of the write, not only those recording where it happens: after the tape's
block, under ``stop_recording``, an inner tape under an outer one, another thread.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from helpers import to_numpy

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.testing import simulated_cuda

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


@pytest.fixture(autouse=True)
def world(request: pytest.FixtureRequest) -> Iterator[None]:
    """A world of one: MPI for NumPy and host arrays, NCCL under ``simulated_cuda(2)`` for CuPy."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("kind") == "cupy":
        with simulated_cuda(2):
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            yield
            dist.destroy_process_group()
        return
    cp.set_host_device_count(2)
    dist.init_process_group("mpi", world_size=1)
    yield
    dist.destroy_process_group()


KINDS = ["numpy", "host", "cupy"]


def on(kind: str, x: np.ndarray, device: str = "host:0") -> Any:
    if kind == "cupy":
        return cp.to_device(x, device.replace("host", "cuda"))
    return x if kind == "numpy" else cp.to_device(x, device)


def zeros_like(kind: str, shape: tuple[int, ...], device: str = "host:0") -> Any:
    return on(kind, np.zeros(shape), device)


# Each case writes into the recorded array h (shape (4,)) in place, as the named collective does.
WRITERS: dict[str, Callable[[Any, str, bool], Any]] = {
    "all_reduce": lambda h, k, a: dist.all_reduce(h, async_op=a),
    "reduce": lambda h, k, a: dist.reduce(h, dst=0, async_op=a),
    "scatter": lambda h, k, a: dist.scatter(h, [on(k, np.ones(4))], src=0, async_op=a),
    "gather (dst's list)": lambda h, k, a: dist.gather(on(k, np.ones(4)), [h], dst=0, async_op=a),
    "all_gather": lambda h, k, a: dist.all_gather([h], on(k, np.ones(4)), async_op=a),
    "all_gather_into_tensor": lambda h, k, a: dist.all_gather_into_tensor(
        h, on(k, np.ones(4)), async_op=a
    ),
    "reduce_scatter": lambda h, k, a: dist.reduce_scatter(h, [on(k, np.ones(4))], async_op=a),
    "reduce_scatter_tensor": lambda h, k, a: dist.reduce_scatter_tensor(
        h, on(k, np.ones(4)), async_op=a
    ),
    "all_to_all": lambda h, k, a: dist.all_to_all([h], [on(k, np.ones(4))], async_op=a),
    "all_to_all_single": lambda h, k, a: dist.all_to_all_single(h, on(k, np.ones(4)), async_op=a),
    "all_reduce_coalesced": lambda h, k, a: dist.all_reduce_coalesced(
        [h, on(k, np.ones(2))], async_op=a
    ),
}


def recorded(kind: str) -> tuple[cp.Tape, Any, Any]:
    w = on(kind, np.array([0.3, -1.2, 0.5, 2.0]))
    tape = cp.Tape()
    tape.__enter__()
    tape.watch(w)
    h = ops.tanh(w)
    return tape, w, h


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(WRITERS))
def test_a_collective_writing_a_recorded_array_makes_the_gradient_raise(
    name: str, kind: str, asynchronous: bool
) -> None:
    tape, w, h = recorded(kind)
    try:
        work = WRITERS[name](h, kind, asynchronous)
        if work is not None:
            work.wait()
        loss = ops.sum(h)
    finally:
        tape.__exit__(None, None, None)
    with pytest.raises(
        RuntimeError, match=rf"modified in place .* written by dist\.{name.split(maxsplit=1)[0]}"
    ):
        tape.gradient(loss, w)


@pytest.mark.parametrize("kind", KINDS)
def test_reading_a_recorded_array_is_allowed(kind: str) -> None:
    """A broadcast's root and the send side only read: the gradient is the tanh's (1 - tanh²)."""
    tape, w, h = recorded(kind)
    try:
        dist.broadcast(h, src=0)  # this rank is the root: it sends h
        out = zeros_like(kind, (4,))
        dist.all_gather([out], h)  # h is the input: read
        loss = ops.sum(ops.multiply(h, 2.0))
    finally:
        tape.__exit__(None, None, None)
    expected = 2.0 * (1.0 - np.tanh(to_numpy(w)) ** 2)
    np.testing.assert_allclose(to_numpy(tape.gradient(loss, w)), expected, rtol=1e-14)


def test_a_view_written_by_a_collective_is_caught() -> None:
    tape, w, h = recorded("numpy")
    try:
        dist.all_reduce(h[1:3])  # another view of h's memory
        loss = ops.sum(h)
    finally:
        tape.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match=r"written by dist\.all_reduce"):
        tape.gradient(loss, w)


@pytest.mark.parametrize("kind", ["host", "cupy"])
@pytest.mark.parametrize("name", ["broadcast_multigpu", "all_reduce_multigpu"])
def test_multigpu_forms_name_what_they_wrote(name: str, kind: str) -> None:
    """One array per local device (two host devices under MPI, two simulated GPUs under NCCL)."""
    w = on(kind, np.array([0.3, -1.2]), "host:0")
    with cp.Tape() as tape:
        tape.watch(w)
        h = ops.tanh(w)
        copies = [h, on(kind, np.zeros(2), "host:1")]
        if name == "broadcast_multigpu":
            dist.broadcast_multigpu(copies, src=0, src_tensor=1)  # writes h (index 0)
        else:
            dist.all_reduce_multigpu(copies)
        loss = ops.sum(h)
    with pytest.raises(RuntimeError, match=rf"written by dist\.{name}"):
        tape.gradient(loss, w)


def test_writing_an_array_no_tape_holds_changes_nothing() -> None:
    w = np.array([0.3, -1.2])
    with cp.Tape() as tape:
        tape.watch(w)
        h = ops.tanh(w)
        other = np.ones(2)
        dist.all_reduce(other)
        loss = ops.sum(h)
    np.testing.assert_allclose(tape.gradient(loss, w), 1.0 - np.tanh(w) ** 2, rtol=1e-14)


def _after_the_block(tape: cp.Tape, h: Any) -> None:
    tape.__exit__(None, None, None)
    dist.all_reduce(h)


def _in_stop_recording(tape: cp.Tape, h: Any) -> None:
    with tape.stop_recording():
        dist.all_reduce(h)
    tape.__exit__(None, None, None)


def _under_an_outer_tape(tape: cp.Tape, h: Any) -> None:
    tape.__exit__(None, None, None)
    with cp.Tape() as outer:
        outer.watch(h)  # the outer tape records; the inner one has ended
        dist.all_reduce(h)


def _in_another_thread(tape: cp.Tape, h: Any) -> None:
    tape.__exit__(None, None, None)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a thread where no tape records
        pool.submit(dist.all_reduce, h).result()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "where",
    [_after_the_block, _in_stop_recording, _under_an_outer_tape, _in_another_thread],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_tape_that_is_not_recording_hears_of_the_write(
    where: Callable[[cp.Tape, Any], None], kind: str
) -> None:
    """A write where the tape is not active still reaches it (torch's c10d would be silent).

    The audit's case: before, the gradient here came out of the written values, without error.
    """
    tape, w, h = recorded(kind)
    loss = ops.sum(ops.multiply(h, h))  # its gradient reads h
    where(tape, h)
    with pytest.raises(RuntimeError, match=r"written by dist\.all_reduce"):
        tape.gradient(loss, w)


def test_a_recv_after_the_block_is_caught_too() -> None:
    """Point-to-point: a receive into a recorded array, after the tape's block (2 thread ranks)."""

    def rank_main(rank: int) -> str:
        w = np.array([0.3, -1.2])
        with cp.Tape() as tape:
            tape.watch(w)
            h = ops.tanh(w)
            loss = ops.sum(ops.multiply(h, h))
        if rank == 0:
            dist.send(np.ones(2), dst=1)
            return "sent"
        dist.recv(h, src=0)
        try:
            tape.gradient(loss, w)
        except RuntimeError as error:
            return str(error)
        return "no error"

    sent, received = dist.spawn(rank_main, 2)
    assert sent == "sent"
    assert "written by dist.recv" in received
