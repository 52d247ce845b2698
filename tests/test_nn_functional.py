"""The differentiable collectives (``cupy_parallel.distributed.nn.functional``, issue 21 item 2).

Under ``mpiexec`` (2, 3 and 4 ranks) ``mpi_workers/nn_functional_worker.py`` checks every
collective's loss, gradient and second derivative against a one-process oracle of the summed
loss, the dot-product (adjoint) identity of every linear one, MIN/MAX ties, the refusal of
PRODUCT's gradient, and the zero cotangent (one rank's loss ignores the outputs: no rank waits).
The same check functions also run on thread ranks of ``spawn`` (2-4 MPI ranks with NumPy
and host arrays, printing what the processes print; 2-3 NCCL ranks under ``simulated_cuda``
with CuPy arrays) and here in a world of one (MPI singleton; NCCL under ``simulated_cuda``),
next to the argument checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from helpers import on_each_kind_of_stream
from thread_ranks import MPIEXEC, Outcome, printed, run_mpiexec, run_threads
from thread_ranks import worker as load_worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.distributed import ReduceOp
from cupy_parallel.distributed.nn import functional as nnf

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


pytestmark = pytest.mark.mpi  # MPI throughout: mpiexec, or the MPI singleton (a world of one)
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")


worker = load_worker("nn_functional_worker")


def launch(ranks: int, mode: str, timeout: float = 120) -> tuple[Outcome, float]:
    ran = run_mpiexec("nn_functional_worker", ranks, mode, timeout=timeout)
    return ran, ran.seconds


# ---------------------------------------------------------------------------------------------
# Several ranks, under mpiexec


@pytest.mark.slow
@needs_mpiexec
def test_gradients_match_the_one_process_oracle() -> None:
    """Processes at one world size print what thread ranks print (which run every size, below)."""
    ranks = 3
    result, _ = launch(ranks, "all")
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.count("all checks passed") == ranks, result.stdout
    threads = run_threads("nn_functional_worker", ranks, "all", timeout=120)
    assert printed(threads.stdout) == printed(result.stdout)


# ---------------------------------------------------------------------------------------------
# Several ranks as threads of this process (spawn): MPI, and NCCL on simulated GPUs


def all_passed(ranks: int) -> list[str]:
    return [f"rank {r}: all checks passed" for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3, 4], ids=lambda n: f"{n}ranks")
def test_gradients_match_the_oracle_on_thread_ranks(ranks: int) -> None:
    ran = run_threads("nn_functional_worker", ranks, "all", timeout=120)
    assert ran.returncode == 0, ran.stderr[-6000:]
    assert printed(ran.stdout) == all_passed(ranks)


def test_a_thread_rank_ignoring_the_outputs_still_takes_part_in_the_backward_pass() -> None:
    ran = run_threads("nn_functional_worker", 3, "zero-cotangent", timeout=8)
    assert ran.returncode == 0, ran.stderr[-6000:]
    assert printed(ran.stdout) == all_passed(3)


@pytest.mark.slow
@on_each_kind_of_stream
def test_cupy_arrays_on_nccl_thread_ranks(ranks: int) -> None:
    """First and second derivatives with CuPy arrays, rank r on simulated GPU r (race checker
    on), against the one-process NumPy oracle; on 3 ranks (the MPI thread ranks above run 2, 3
    and 4 through the same worker; a simulated GPU per rank makes each world seconds long), on 2
    off the legacy stream."""
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(ranks):
        ran = run_threads("nn_functional_worker", ranks, "cupy", timeout=60, backend="nccl")
    assert ran.returncode == 0, ran.stderr[-6000:]
    assert printed(ran.stdout) == all_passed(ranks)


@pytest.mark.slow
@needs_mpiexec
def test_a_rank_ignoring_the_outputs_still_takes_part_in_the_backward_pass() -> None:
    """Rank 0's loss ignores the collectives' outputs; its peers get their gradients, none waits.

    The worker's process group times out after 8 s: code that skipped the collectives' vjps on
    rank 0 (no gradient reaches them there) fails, rank 0 with a gradient lacking its peers'
    contributions and the peers blocked in the backward collective.
    """
    result, seconds = launch(3, "zero-cotangent", timeout=60)
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.count("all checks passed") == 3, result.stdout
    assert seconds < 30


@pytest.mark.slow
@needs_mpiexec
def test_cupy_arrays_over_mpi_under_simulated_cuda() -> None:
    result, _ = launch(2, "simulated-cupy")
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.count("all checks passed") == 2, result.stdout


# ---------------------------------------------------------------------------------------------
# A world of one, in this process


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("mpi", world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("kind", ["cpu", "host"])
@pytest.mark.parametrize("check", worker.CHECKS, ids=lambda c: c.__name__)
def test_checks_in_a_world_of_one(check: Callable[[str], None], kind: str) -> None:
    check(kind)


@pytest.mark.parametrize("check", worker.CHECKS, ids=lambda c: c.__name__)
def test_checks_with_cupy_arrays_on_one_simulated_nccl_rank(check: Callable[[str], None]) -> None:
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(1):
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            check("cupy")
        finally:
            dist.destroy_process_group()


@pytest.mark.usefixtures("world")
def test_the_gradient_of_a_world_of_one_is_the_identity() -> None:
    """Against ops: y = collective(x) is x (or (x,)), so the gradient is the loss's own."""
    x = np.array([0.5, -1.0, 2.0])
    for apply in (
        nnf.all_reduce,
        lambda x: nnf.all_reduce(x, ReduceOp.AVG),
        lambda x: nnf.all_reduce(x, ReduceOp.MAX),
        lambda x: nnf.broadcast(x, 0),
        lambda x: nnf.reduce(x, 0, ReduceOp.MIN),
        lambda x: nnf.all_gather(x)[0],
        lambda x: nnf.gather(x, 0)[0],
        lambda x: nnf.reduce_scatter([x]),
        lambda x: nnf.scatter([x], 0),
        lambda x: nnf.all_to_all([x])[0],
        nnf.all_to_all_single,
    ):
        with cp.Tape() as tape:
            tape.watch(x)
            y = apply(x)
            loss = ops.sum(ops.tanh(y))
        np.testing.assert_array_equal(y, x)
        np.testing.assert_allclose(tape.gradient(loss, x), 1 - np.tanh(x) ** 2, rtol=1e-14)


@pytest.mark.usefixtures("world")
def test_inputs_are_never_written_and_outputs_are_new() -> None:
    x = np.array([1.0, 2.0])
    before = x.copy()
    outputs = [
        nnf.all_reduce(x),
        nnf.broadcast(x, 0),
        nnf.reduce(x, 0),
        *nnf.all_gather(x),
        nnf.reduce_scatter([x]),
        *nnf.all_to_all([x]),
        nnf.all_to_all_single(x),
        *nnf.gather(x, 0),
        nnf.scatter([x], 0),
    ]
    np.testing.assert_array_equal(x, before)
    for y in outputs:
        assert not np.shares_memory(x, y)
        y[...] = 0.0  # writable, and writing it leaves x alone
    np.testing.assert_array_equal(x, before)


@pytest.mark.usefixtures("world")
def test_non_contiguous_inputs_are_copied() -> None:
    x = np.arange(12.0).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(nnf.all_reduce(x), x)
    np.testing.assert_array_equal(nnf.all_to_all_single(x), x)


BAD_CALLS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "x not an array",
        lambda: nnf.all_reduce([1.0, 2.0]),
        TypeError,
        r"x must be an array .*got list",
    ),
    (
        "op not a ReduceOp",
        lambda: nnf.all_reduce(np.ones(2), "sum"),
        TypeError,
        r"op must be a ReduceOp",
    ),
    (
        "MIN of complex",
        lambda: nnf.all_reduce(np.ones(2, complex), ReduceOp.MIN),
        TypeError,
        r"complex",
    ),
    ("BAND of floats", lambda: nnf.reduce(np.ones(2), 0, ReduceOp.BAND), TypeError, r"BAND"),
    (
        "src outside the group",
        lambda: nnf.broadcast(np.ones(2), 3),
        ValueError,
        r"src=3 is not a member",
    ),
    (
        "dst outside the group",
        lambda: nnf.gather(np.ones(2), 1),
        ValueError,
        r"dst=1 is not a member",
    ),
    ("dst not an int", lambda: nnf.reduce(np.ones(2), "0"), TypeError, r"dst must be an int"),
    (
        "inputs too long",
        lambda: nnf.reduce_scatter([np.ones(2)] * 2),
        ValueError,
        r"inputs must hold 1 arrays \(one per group member\), got 2",
    ),
    ("inputs not a list", lambda: nnf.scatter(np.ones(2), 0), TypeError, r"inputs must be a list"),
    (
        "inputs[0] not an array",
        lambda: nnf.all_to_all(["a"]),
        TypeError,
        r"inputs\[0\] must be an array .*got str",
    ),
    (
        "split sizes not a list",
        lambda: nnf.all_to_all_single(np.ones(2), 2),
        TypeError,
        r"output_split_sizes must be a list of ints",
    ),
    (
        "split sizes of the wrong length",
        lambda: nnf.all_to_all_single(np.ones(2), [1, 1], [2]),
        ValueError,
        r"output_split_sizes must hold 1 sizes \(one per group member\) .* got \[1, 1\]",
    ),
    (
        "negative split size",
        lambda: nnf.all_to_all_single(np.ones(2), [-1], [2]),
        ValueError,
        r"output_split_sizes",
    ),
    (
        "0-d all_to_all_single",
        lambda: nnf.all_to_all_single(np.array(1.0)),
        ValueError,
        r"x must have at least one dimension",
    ),
    (
        "not a member of group",
        lambda: nnf.all_reduce(np.ones(2), group=dist.GroupMember.NON_GROUP_MEMBER),
        ValueError,
        r"nn.functional.all_reduce: this rank is not a member of group",
    ),
    (
        "group of a wrong type",
        lambda: nnf.all_gather(np.ones(2), group=3),
        TypeError,
        r"group must be",
    ),
]


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("call", "error", "match"),
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_arguments_raise_before_anything_is_recorded(
    call: Callable[[], Any], error: type[Exception], match: str
) -> None:
    w = np.ones(2)
    with cp.Tape() as tape:
        tape.watch(w)
        with pytest.raises(error, match=match):
            call()
        loss = ops.sum(ops.square(w))
    assert len(tape._nodes) == 2  # square and sum only: the failed call recorded nothing
    np.testing.assert_array_equal(tape.gradient(loss, w), 2 * w)


@pytest.mark.usefixtures("world")
def test_product_computes_but_refuses_its_gradient() -> None:
    x = np.array([2.0, 3.0])
    with cp.Tape() as tape:
        tape.watch(x)
        y = nnf.all_reduce(x, ReduceOp.PRODUCT)
        loss = ops.sum(y)
    np.testing.assert_array_equal(y, x)
    with pytest.raises(
        RuntimeError,
        match=r"nn.functional.all_reduce with ReduceOp.PRODUCT has no gradient here: only SUM, "
        r"AVG, MIN and MAX are differentiable \(torch would silently",
    ):
        tape.gradient(loss, x)


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR, ReduceOp.PRODUCT])
def test_the_refusal_names_each_reduction_without_a_gradient(op: ReduceOp) -> None:
    """Bitwise reductions take integers only, which are never recorded: the rule still refuses."""
    from cupy_parallel._src.distributed import nn_functional
    from cupy_parallel._src.distributed.groups import resolve_group

    x = np.ones(2)
    pg = resolve_group(None)
    for name in ("all_reduce", "reduce", "reduce_scatter"):
        aux = (name, op, pg)
        with pytest.raises(RuntimeError, match=rf"{name} with ReduceOp.{op.name} has no gradient"):
            nn_functional._refused_vjp([x], (x,), (True,), (x,), aux)
        # no gradient arrived (an output kept for logging): nothing to refuse (issue 34)
        assert nn_functional._refused_vjp([None], (x,), (True,), (x,), aux) == (None,)


@pytest.mark.usefixtures("world")
def test_a_node_is_recorded_on_every_active_tape() -> None:
    """Also where no input is tracked: whether a rank records must not depend on its data."""
    w, c = np.ones(2), np.full(2, 3.0)
    with cp.Tape() as tape:
        tape.watch(w)
        y = nnf.broadcast(c, 0)  # c is not watched (a non-source rank's buffer, say)
        ints = nnf.all_reduce(np.arange(2))  # integers: never recorded
    assert tape.tracks(y)
    assert not tape.tracks(ints)
    with cp.Tape() as tape:
        y = nnf.all_reduce(c)
    assert tape.tracks(y)  # nothing watched, but a tape is active: recorded
    # a tape that is not recording is left alone
    with cp.Tape() as tape:
        tape.watch(w)
        with tape.stop_recording():
            y = nnf.all_reduce(w)
    assert not tape.tracks(y)


@pytest.mark.usefixtures("world")
def test_host_arrays_stay_on_their_device() -> None:
    x = cp.to_device(np.array([1.0, -2.0]), "host:0")
    with cp.Tape() as tape:
        tape.watch(x)
        ys = nnf.all_gather(x)
        loss = ops.sum(ops.square(ys[0]))
    assert str(ys[0].device) == "host:0"
    grad = tape.gradient(loss, x)
    assert str(grad.device) == "host:0"
    np.testing.assert_array_equal(cp.to_device(grad, "cpu"), [2.0, -4.0])
