"""The MPI backend with real processes: mpiexec -n N runs mpi_workers/collectives_worker.py.

Each worker checks every collective (every root, dtype and reduction) against NumPy and exits
non-zero on a mismatch; the fault modes check that no failure hangs the job.

The same tests run the same workers on thread ranks too (``via="threads"``:
``cupy_parallel.distributed.spawn`` in this process, see thread_ranks.py), with the same
expectations: thread ranks are the MPI backend over an in-process MPI, so every result and every
message must be MPI's. Where MPI aborts the job (a collective that timed out or whose ranks
disagreed), spawn ends the run with an error instead (``ENDED``). Modes with no thread
equivalent stay MPI-only: ``reinit`` (the store rendezvous path, which spawn does not take),
``init-timeout`` (spawn makes every rank's world itself), ``cupy`` (a GPU per process).
"""

from __future__ import annotations

import contextvars
import re
import socket
import subprocess
import sys
import threading
import warnings
from typing import TYPE_CHECKING

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thread_ranks import MPIEXEC, printed, run_mpiexec, run_threads

from cupy_parallel import distributed as dist
from cupy_parallel._src.distributed.mpi_checks import Caller, compare_counts, stamp

if TYPE_CHECKING:
    from pathlib import Path

MPI_ONLY = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)"),
]
# Every test of both kinds: processes under mpiexec, and thread ranks of spawn.
VIA = pytest.mark.parametrize("via", [pytest.param("mpiexec", marks=MPI_ONLY), "threads"])


def via_sizes(sizes: list[int], mpiexec: int | None = None) -> pytest.MarkDecorator:
    """Thread ranks at every world size of ``sizes``, processes (``mpiexec``) at one of them.

    Thread ranks are the MPI backend over an in-process MPI, so each world size's results and
    messages are proved there; processes add what only they show (MPICH's own algorithms and
    errors, a job aborted) and take seconds per world, so they run at one size. ``mpiexec=None``
    where :func:`test_thread_ranks_print_what_mpi_processes_print` runs the worker's mode under
    mpiexec already (it proves the processes print what the thread ranks print, line for line,
    so the thread-rank test's assertions hold for them).
    """
    params = [pytest.param(n, "threads", id=f"{n}ranks-threads") for n in sizes]
    if mpiexec is not None:
        process = pytest.param(mpiexec, "mpiexec", marks=MPI_ONLY, id=f"{mpiexec}ranks-mpiexec")
        params.insert(0, process)
    return pytest.mark.parametrize(("ranks", "via"), params)


# What says that the job was ended because a collective cannot be taken back.
ENDED = {
    "mpiexec": "cupy_parallel: aborting the MPI job",
    "threads": "A started collective cannot be cancelled, so the run ends (as an MPI job is "
    "aborted).",
}


def launch(
    ranks: int,
    mode: str,
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    via: str = "mpiexec",
    group_timeout: float = 120,
) -> tuple[subprocess.CompletedProcess[str], float]:
    if via == "threads":
        ran = run_threads("collectives_worker", ranks, mode, *args, timeout=group_timeout, env=env)
    else:
        ran = run_mpiexec("collectives_worker", ranks, mode, *args, timeout=timeout, env=env)
    return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr), ran.seconds


@pytest.mark.slow
@via_sizes([2, 3, 4])  # processes: the replay's all-3ranks
def test_every_collective_matches_numpy(ranks: int, via: str) -> None:
    result, _ = launch(ranks, "all", via=via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


@pytest.mark.slow
@via_sizes([2, 3, 4], mpiexec=3)
def test_integer_average_is_exact_where_the_sum_overflows(ranks: int, via: str) -> None:
    # INT64_MIN/MAX on every rank, mixed signs, uint64's maximum: the mean rounded toward zero
    # of Python integers, from every reducing collective, with 1 and 3 local arrays per rank.
    result, _ = launch(ranks, "exact-average", via=via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


@via_sizes([2, 3, 4], mpiexec=3)
def test_bfloat16_reduces_in_float32_rounded_to_nearest_even(ranks: int, via: str) -> None:
    # SUM, PRODUCT, MIN, MAX, AVG as torch/gloo has them; BAND/BOR/BXOR refused.
    pytest.importorskip("ml_dtypes")
    result, _ = launch(ranks, "bfloat16", via=via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


def test_a_float16_sum_past_its_range_is_inf_without_a_warning() -> None:
    """MPI reduces float16 in float32 and casts back: a sum past 65504 is ``inf``, with no
    ``RuntimeWarning`` (an error under pytest's filters, as it was) and no
    ``FloatingPointError`` under ``np.errstate(all="raise")``, as NCCL's native float16 sum
    (oracle: NumPy's float32 sum cast to float16, its warning silenced). Three ranks: the
    general path, not the carried one of a group of two."""
    big = np.array([40000.0, -40000.0, 1.0, 60000.0], np.float16)

    def reduce(rank: int) -> list[list[float]]:
        with np.errstate(all="raise"):
            total = big.copy()
            dist.all_reduce(total)
            chunk = np.zeros(4, np.float16)
            dist.reduce_scatter_tensor(chunk, np.tile(big, 3))
            mean = big.copy()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        return [total.tolist(), chunk.tolist(), mean.tolist()]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = dist.spawn(reduce, 3, timeout=60)
    with np.errstate(over="ignore"):
        want = (3 * big.astype(np.float32)).astype(np.float16)
    assert np.isinf(want).tolist() == [True, True, False, True]
    for ranks_result in got:
        assert ranks_result[0] == ranks_result[1] == want.tolist()
        assert ranks_result[2] == big.tolist()  # the mean: (3 * x) / 3 in float32, then cast


@pytest.mark.parametrize("ranks", [2, 3])
def test_all_gather_coalesced_of_an_input_inside_another_inputs_outputs(ranks: int) -> None:
    """An input of 64 KiB or more that lies in the memory where another input's outputs go
    (here rank ``r``'s second input is a slot of the first input's outputs): every input is
    what the rank held at the call, as if packed then (oracle: the values each rank put in).
    Received in place, the first input's message overwrote the second while it was sent."""
    from cupy_parallel._src.distributed.mpi import OWN_MESSAGE_BYTES

    n = OWN_MESSAGE_BYTES // 8

    def value(k: int, r: int) -> np.ndarray:
        return np.arange(n, dtype=np.float64) + 1000.0 * k + 1e6 * r

    def gather(rank: int) -> list[list[np.ndarray]]:
        whole = np.zeros((ranks, n))
        second = whole[ranks - 1 if rank != ranks - 1 else 0]  # another rank's slot
        second[...] = value(1, rank)
        outs = [[whole[r], np.zeros(n)] for r in range(ranks)]
        dist.all_gather_coalesced(outs, [value(0, rank), second])
        return outs

    for outs in dist.spawn(gather, ranks, timeout=60):
        for r in range(ranks):
            for k in range(2):
                assert np.array_equal(outs[r][k], value(k, r)), (r, k)


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_init_destroy_init_on_one_store(tmp_path: Path) -> None:
    """Three worlds on a user's store; stores opened from init_method close with their world."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result, _ = launch(2, "reinit", str(tmp_path), str(port))
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("rank 0: 24 checks passed") == 1, result.stdout
    assert not (tmp_path / "user").exists()  # the user closed their store at the end


@pytest.mark.slow
@VIA
def test_timeout_raises_then_aborts_the_job(via: str) -> None:
    result, seconds = launch(2, "timeout", timeout=60, via=via, group_timeout=3)
    assert result.returncode != 0
    assert seconds < 30
    assert (
        "CAUGHT TimeoutError: all_reduce on process group '0' did not complete within 3 s"
        in result.stderr
    )
    assert (
        "CAUGHT RuntimeError: process group '0' is unusable: all_reduce timed out" in result.stderr
    )
    assert ENDED[via] in result.stderr


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_rank_missing_at_init_times_out() -> None:
    result, seconds = launch(2, "init-timeout", timeout=60)
    assert result.returncode != 0
    assert seconds < 30
    assert (
        "CAUGHT TimeoutError: init_process_group (duplicating MPI.COMM_WORLD) on process group "
        "'0' did not complete within 2 s" in result.stderr
    )


@VIA
def test_dead_peer_ends_the_job_non_zero(via: str) -> None:
    """The peer dies: os._exit(3) in a process; sys.exit(3) on a thread rank (which ends its
    rank: the others' calls fail at once)."""
    result, seconds = launch(2, "die", timeout=60, via=via)
    assert result.returncode != 0
    assert seconds < 30


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_cupy_arrays_through_mpi() -> None:
    result, _ = launch(2, "cupy")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == 2, result.stdout


@pytest.mark.slow
@via_sizes([2, 3], mpiexec=2)
@pytest.mark.parametrize("aware", ["", "1"], ids=["mpi-not-cuda-aware", "forced-cuda-aware"])
def test_simulated_cupy_arrays_through_both_branches(ranks: int, aware: str, via: str) -> None:
    """Both paths for CuPy arrays run without a GPU: staged, and handed to a CUDA-aware MPI.

    The simulated CUDA's arrays must be recognised as device arrays; each result against NumPy.
    Not CUDA-aware: staged, and copied back in stream order. Forced CUDA-aware: the simulator
    plays a CUDA-aware MPI (simcuda/sim_mpi.py), which gets the arrays' memory itself and
    raises on any device work on it not finished at posting or queued before completion.
    On thread ranks the ranks share one simulation (entered here, two GPUs for the
    ``*_multigpu`` forms) and the staging note is counted here: once per staging rank.
    """
    if via == "threads":
        from cupy_parallel.testing import simulated_cuda

        with simulated_cuda(2), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result, _ = launch(
                ranks, "simulated-cupy", env={"CUPY_PARALLEL_MPI_CUDA_AWARE": aware}, via=via
            )
        notes = [w for w in caught if "copied through host memory" in str(w.message)]
        assert len(notes) == (0 if aware else ranks), [str(w.message) for w in caught]
    else:
        result, _ = launch(ranks, "simulated-cupy", env={"CUPY_PARALLEL_MPI_CUDA_AWARE": aware})
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


@pytest.mark.parametrize("simulated_streams", ["non-blocking", "per-thread"], indirect=True)
@pytest.mark.parametrize("aware", ["", "1"], ids=["mpi-not-cuda-aware", "forced-cuda-aware"])
def test_simulated_cupy_arrays_on_thread_ranks_off_the_legacy_stream(
    simulated_streams: str, aware: str
) -> None:
    """Both branches on two thread ranks whose threads are not on the shared legacy stream."""
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(2), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cupy_parallel MPI backend: .* copied through host")
        result, _ = launch(
            2, "simulated-cupy", env={"CUPY_PARALLEL_MPI_CUDA_AWARE": aware}, via="threads"
        )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == 2, result.stdout


def launch_edges(
    ranks: int, mode: str, via: str = "mpiexec"
) -> tuple[subprocess.CompletedProcess[str], float]:
    if via == "threads":
        ran = run_threads("edges_worker", ranks, mode, timeout=3)
        return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr), ran.seconds
    ran = run_mpiexec("edges_worker", ranks, mode, timeout=60)
    return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr), ran.seconds


@pytest.mark.slow
@via_sizes([2, 3])  # processes: the replay's edges-3ranks
def test_clear_errors_and_the_group_stays_usable(ranks: int, via: str) -> None:
    """wait(timeout=1), TAG_UB, truncation, a cancelled recv; MIN/MAX bits equal everywhere."""
    result, _ = launch_edges(ranks, "edges", via)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-3000:] + out[-3000:]
    assert (
        "CAUGHT DistTimeoutError: all_reduce on process group '0' did not complete within 1 s (the "
        "timeout given to wait()). It is still running and the process group stays usable"
    ) in out
    assert out.count("OK usable after wait(timeout=1)") == ranks
    assert out.count("CAUGHT CheckedValueError: tag must be at most ") == ranks
    assert (
        "CAUGHT ValueError: recv from group rank 0: the message is larger than tensor (32 bytes)"
    ) in out
    for source in ("group rank 0", "any rank"):
        assert (
            f"CAUGHT ValueError: recv from {source}: the message is smaller than tensor (16 bytes "
            "received, tensor has 24); pass a tensor of the size sent."
        ) in out
    assert out.count("OK usable after a short message") == ranks
    assert (
        "CAUGHT DistTimeoutError: recv from group rank 0 on process group '0' did not complete "
        "within 3 s (a peer did not join, died, or is far behind). It was cancelled; the process "
        "group stays usable."
    ) in out
    assert out.count("OK usable after a cancelled recv") == ranks
    assert "BAD" not in out
    for op in ("MIN", "MAX"):
        for dtype in ("float16", "float32", "float64"):
            assert out.count(f"OK {op} {dtype}") == ranks, out


@pytest.mark.slow
@VIA
def test_broadcast_size_mismatch_is_a_value_error(via: str) -> None:
    result, _ = launch_edges(2, "bcast-mismatch", via)
    assert (
        "CAUGHT ValueError: broadcast on process group '0': ranks [0, 1] disagree (no majority) "
        "in the array they passed (rank 0: float64, 8 elements, 1-d; rank 1: float64, 4 "
        "elements, 1-d)" in result.stdout
    ), result.stdout + result.stderr[-2000:]


@pytest.mark.slow
@via_sizes([3, 4], mpiexec=4)
def test_ranks_disagreeing_on_roots_or_sizes_raise_on_every_rank(ranks: int, via: str) -> None:
    """Without the debug mode. MPI would let one rank's array overwrite the root's, silently, and
    leave zeros where a receiver expects more than is sent; a rooted collective over arrays of
    another size, dtype or shape reduces garbage or leaves part of an array as it was. On 4 ranks
    an all_to_all's comparison used to be longer than another collective's, so that the ranks
    read each other's rows as garbage (an error naming the wrong cause). A barrier used to
    compare nothing, so that a barrier met by an all_reduce shifted the comparisons: on MPICH
    the all_reduce returned the rank's own array, or every rank timed out."""
    n = ranks
    result, seconds = launch_edges(n, "disagree", via)
    assert seconds < 30
    out = result.stdout
    last = n - 1
    assert "NO ERROR" not in out, out
    assert out.count(f"OK world after: [{n}.0, {n}.0]") == n, out + result.stderr[-2000:]
    roots = "; ".join(f"rank {r}: {int(r == last)}" for r in range(n))
    for name, number in (
        ("broadcast", 1),
        ("reduce", 2),
        ("gather", 3),
        ("scatter", 4),
        ("broadcast", 5),
    ):
        message = (
            f"CAUGHT ValueError: {name} on process group '{number}': ranks [{last}] differ from "
            f"the rest in the root they named (src/dst, as global ranks: {roots}). Every rank "
            "must pass the same root. The arrays' contents are undefined now"
        )
        assert out.count(message) == n, out
    same = "the same dtype and size: their shapes or byte orders differ; the debug mode "
    for name, number, layout, arrays in (
        ("broadcast", 8, "", ("float64, 4 elements, 1-d",) * last + ("float64, 2 elements, 1-d",)),
        ("reduce", 9, "", ("float32, 4 elements, 1-d",) * last + ("int32, 4 elements, 1-d",)),
        ("gather", 10, "", ("float64, 2 elements, 1-d",) * last + ("float64, 3 elements, 1-d",)),
        ("scatter", 11, same, ("float64, 2 elements, 2-d",) * n),
    ):
        passed = "; ".join(f"rank {r}: {a}" for r, a in enumerate(arrays))
        head = f"CAUGHT ValueError: {name} on process group '{number}': ranks [{last}] differ from "
        message = f"{head}the rest in the array they passed{' (' + layout if layout else ''}"
        assert out.count(message) == n, out
        assert out.count(f"({passed}). Every rank must pass an array of the same dtype") == n, out
    dtypes = "; ".join(f"rank {r}: {'float32' if r == last else 'int32'}" for r in range(n))
    message = (
        f"CAUGHT ValueError: all_to_all on process group '12': ranks [{last}] differ from the "
        f"rest in the dtype they exchange ({dtypes}). Every rank must pass arrays of one dtype."
    )
    assert out.count(message) == n, out
    for number, sent, expected in ((6, 16, 24), (7, 8, 16)):  # all_to_all, all_to_all_single
        message = (
            f"on process group '{number}': the ranks disagree on the sizes they exchange (global "
            f"ranks): rank 0 sends {sent} bytes to rank {last}, which expects {expected}. What "
            "rank r sends"
        )
        assert out.count(message) == n, out
    called = "; ".join(f"rank {r}: {'all_to_all' if r == last else 'all_reduce'}" for r in range(n))
    message = (
        f"on process group '13': ranks [{last}] differ from the rest in the collective they "
        f"called ({called}). Every rank must call a group's collectives in the same order."
    )
    assert out.count(message) == n, out
    called = "; ".join(f"rank {r}: {'barrier' if r == last else 'all_reduce'}" for r in range(n))
    message = (
        f"on process group '14': ranks [{last}] differ from the rest in the collective they "
        f"called ({called}). Every rank must call a group's collectives in the same order."
    )
    assert out.count(message) == n, out
    # The mismatched operations may never finish: the job is aborted at exit, not left hanging.
    assert result.returncode != 0
    assert ENDED[via] in result.stderr


@pytest.mark.slow
@VIA
def test_sizes_disagreeing_with_a_rank_that_waits_late_raise_on_every_rank(via: str) -> None:
    """Rank 0 waits on its all_to_all_single (whose sizes the last rank disagrees on) only after
    an all_reduce; the others, told by the rows that the sizes differ, wait for rank 0's sizes,
    which come only then. They used to time out ("the ranks telling each other what they
    disagree on ... did not complete"), naming nothing; now each says what it knows at the
    group's timeout (the pair, if rank 0's sizes came in time), and rank 0, which gets every
    other rank's sizes, names the pair."""
    result, seconds = launch_edges(3, "late-wait", via)
    out = result.stdout
    assert seconds < 30
    assert "NO ERROR" not in out, out
    head = (
        "CAUGHT ValueError: all_to_all on process group '1': the ranks disagree on the sizes they "
        "exchange (global ranks): "
    )
    unknown = f"{head}the sizes of rank 0 are unknown: it did not tell them within the group's"
    named = f"{head}rank 0 sends 8 bytes to rank 2, which expects 16. What rank r sends"
    assert out.count(head) == 3, out + result.stderr[-2000:]
    assert out.count(unknown) + out.count(named) == 3, out
    assert out.count(named) >= 1, out  # rank 0's
    assert out.count("CAUGHT DistTimeoutError: all_reduce on process group '1'") == 1, out
    assert result.returncode != 0
    assert ENDED[via] in result.stderr


@pytest.mark.slow
@VIA
def test_new_group_is_bounded_by_the_timeout(via: str) -> None:
    result, seconds = launch_edges(2, "new-group-timeout", via)
    assert seconds < 20
    assert (
        "CAUGHT DistTimeoutError: new_group([0, 1]) waiting for every world rank on process group "
        "'0' did not complete within 2 s" in result.stdout
    ), result.stdout + result.stderr[-2000:]


@pytest.mark.slow
@VIA
def test_a_barrier_where_the_others_make_a_group_is_a_value_error_on_every_rank(via: str) -> None:
    """new_group's handshake and a barrier's comparison are rows of one size on the world's
    control communicator: the ranks are told that they called different things."""
    result, seconds = launch_edges(2, "new-group-barrier", via)
    assert seconds < 20
    out = result.stdout
    said = (
        "ranks [0, 1] disagree (no majority) in the collective they called (rank 0: new_group; "
        "rank 1: barrier). Every rank must call a group's collectives in the same order."
    )
    assert out.count(f"CAUGHT ValueError: new_group([0, 1]): {said}") == 1, out + result.stderr
    assert out.count(f"CAUGHT ValueError: barrier on process group '0': {said}") == 1, out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_environment_disagreeing_with_mpi_is_an_error(tmp_path: Path) -> None:
    """`launch --backend nccl` (ranks started directly) with init_process_group('mpi'): each
    rank is a world of one; init refuses, names both."""
    script = tmp_path / "script.py"
    script.write_text(
        "from cupy_parallel import distributed as dist\ndist.init_process_group('mpi')\n"
    )
    launcher = "import sys; from cupy_parallel._tools.launch import main; sys.exit(main())"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            launcher,
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--grace-period",
            "1",
            "--backend",
            "nccl",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert re.search(
        r"RuntimeError: The environment says RANK=[01], WORLD_SIZE=2, but MPI.COMM_WORLD is rank 0 "
        r"of 1: these processes were not started by mpiexec together",
        result.stderr,
    ), result.stderr[-3000:]
    assert re.search(r"rank [01] exited with code 1; stopped the other ranks\.", result.stderr)


def launch_api(
    ranks: int, mode: str, via: str = "mpiexec", **env: str
) -> subprocess.CompletedProcess[str]:
    if via == "threads":
        timeout = 3 if mode == "monitored" else 30
        ran = run_threads("api_worker", ranks, mode, timeout=timeout, env=env)
        return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr)
    ran = run_mpiexec("api_worker", ranks, mode, timeout=120, env=env)
    return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr)


@pytest.mark.slow
@via_sizes([2, 3, 4])  # processes: the replay's api-3ranks
def test_pytorch2_api_matches_numpy(ranks: int, via: str) -> None:
    """into_tensor, all_to_all_single, objects, batch p2p, group queries, BAND/BOR/BXOR, futures."""
    result = launch_api(ranks, "api", via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


@pytest.mark.slow
@via_sizes([2, 3, 4])  # processes: the replay's local-4ranks
def test_local_synchronization_groups_need_only_their_members(ranks: int, via: str) -> None:
    """new_group(..., use_local_synchronization=True): each pair makes its own groups (two in a
    row), without the other ranks calling; sums equal NumPy's; a non-member caller gets
    NON_GROUP_MEMBER at once."""
    result = launch_api(ranks, "local", via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


@pytest.mark.slow
@via_sizes([2, 3], mpiexec=2)
def test_receives_and_broadcasts_into_recorded_arrays_make_the_gradient_raise(
    ranks: int, via: str
) -> None:
    """Issue 21 item 1 across processes: recv/irecv and a broadcast's non-roots write into a
    recorded array (gradient refused); the broadcast's root only reads (gradient 1 - tanh²)."""
    result = launch_api(ranks, "tape", via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


@pytest.mark.slow
@VIA
def test_debug_mode_names_the_differing_rank(via: str) -> None:
    result = launch_api(3, "debug", via, CUPY_PARALLEL_DISTRIBUTED_DEBUG="DETAIL")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == 3, result.stdout
    for what in ("shape", "dtype", "op", "root", "operation"):
        assert result.stdout.count(f"CAUGHT {what}: ") == 3, result.stdout  # on every rank
    assert (
        "CAUGHT shape: all_reduce: ranks [2] differ from the rest of process group '0' in the "
        "arguments they passed (the operation, shapes, dtypes, reduction and root must agree). "
        "Each passed (operation, arguments): rank 0: ('all_reduce', ['ReduceOp.SUM', "
        "'float64[4]']); rank 1: ('all_reduce', ['ReduceOp.SUM', 'float64[4]']); rank 2: "
        "('all_reduce', ['ReduceOp.SUM', 'float64[5]'])." in result.stdout
    )


@pytest.mark.slow
@VIA
def test_monitored_barrier_names_the_missing_rank(via: str) -> None:
    result = launch_api(3, "monitored", via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (
        "CAUGHT rank 0: monitored_barrier on process group '0': rank 2 did not arrive within "
        "1.5 s." in result.stdout
    )
    assert "CAUGHT rank 1: monitored_barrier on process group '0': rank 0 did not release" in (
        result.stdout
    )


@pytest.mark.slow
@via_sizes([2, 3], mpiexec=3)
def test_a_late_rank_does_not_let_the_next_monitored_barrier_pass_early(
    ranks: int, via: str
) -> None:
    result = launch_api(ranks, "late", via)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("checks passed") == ranks, result.stdout


def launch_agreement(
    ranks: int, mode: str, via: str = "mpiexec", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    if via == "threads":
        ran = run_threads("agreement_worker", ranks, mode, timeout=20, env=env)
        return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr)
    ran = run_mpiexec("agreement_worker", ranks, mode, timeout=120, env=env)
    return subprocess.CompletedProcess([], ran.returncode, ran.stdout, ran.stderr)


@pytest.mark.slow
@via_sizes([2, 3], mpiexec=2)
def test_threads_racing_on_one_group_raise_on_every_rank(ranks: int, via: str) -> None:
    """Two threads per rank, 2,000 all_reduce calls each, on one group: MPI pairs the k-th call
    of every rank, so rank 0's call from one thread summed with rank 1's from the other (before:
    3,998 of 4,000 results mixed on 2 ranks, no error). Now no result is wrong: the ranks compare
    the thread that issued each call, and the first mixed pair raises on every rank, naming the
    threads."""
    result = launch_agreement(ranks, "threads", via)
    out = result.stdout
    for rank in range(ranks):
        counts = re.search(rf"rank {rank}: RESULTS right=(\d+) wrong=(\d+)", out)
        assert counts is not None, out + result.stderr[-3000:]
        assert counts[2] == "0", out
        errors = re.findall(rf"rank {rank}: ERROR thread \d: (\w+): (.*)", out)
        named = [
            message
            for kind, message in errors
            if kind in ("ValueError", "RuntimeError")
            and "in the thread that issued it (rank 0: thread 'summer-" in message
            and "thread 'summer-0'" in message
            and "thread 'summer-1'" in message
        ]
        assert named, out  # every rank raised, naming both threads
    assert (
        "MPI pairs a group's collectives in the order each rank issues them, and threads issuing "
        "on one group at once issue in no set order across the ranks" in out
    )


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_threads_of_one_name_racing_on_one_group_raise_on_every_rank() -> None:
    """The ranks tell threads apart by name: two threads named alike racing on one group paired
    each other's calls with no error (before: 3,757 of rank 0's 4,000 results mixed on 2
    ranks). Now both are refused from their first call on every rank, naming the clash.
    Processes only: a thread rank cannot tell its threads from the other ranks', and covers a
    clash from the second thread's first call (see MPIBackend._new_caller)."""
    result = launch_agreement(2, "threads-one-name")
    out = result.stdout
    for rank in range(2):
        counts = re.search(rf"rank {rank}: RESULTS right=(\d+) wrong=(\d+)", out)
        assert counts is not None, out + result.stderr[-3000:]
        assert counts[2] == "0", out
        errors = re.findall(rf"rank {rank}: ERROR thread (\d): (\w+Error): (.*)", out)
        assert sorted(t for t, _, _ in errors) == ["0", "1"], out  # each raised at once
        # (the second thread's own call may come after the first ended: no clash, the group
        # unusable since)
        assert any("\"2 threads named 'summer', rank 0\"" in m for _, _, m in errors), out


def _one_name_in_turn(rank: int) -> list[float]:
    """Threads named alike, one after the other (each joined first): no clash."""
    sums: list[float] = []

    def work() -> None:
        for i in range(3):
            x = np.full(2, 10.0 * rank + i)
            dist.all_reduce(x)
            sums.append(float(x[0]))

    for _ in range(2):
        thread = threading.Thread(target=contextvars.copy_context().run, args=(work,), name="w")
        thread.start()
        thread.join()
    return sums


def test_threads_of_one_name_in_turn_are_no_clash() -> None:
    for sums in dist.spawn(_one_name_in_turn, 2, timeout=10):
        assert sums == [10.0 + 2 * i for i in range(3)] * 2


@VIA
def test_threads_racing_in_the_debug_mode_mix_no_result_silently(via: str) -> None:
    """Issue 34, row 11: two threads racing on one group in the debug mode left 2 of 4,000
    results mixed without an error (2 ranks; in 4 of 24 runs of 2,000 calls per thread, and in
    none of 24 without the debug mode). The worker makes the two interleavings behind it happen
    every time (see agreement_worker.py): ``async``, where thread a's second call met its first
    on the other rank, both comparisons alike (``a1``: ``WRONG 103.0 (want 203.0)``), and
    ``held``, where data started on one rank only and ``b0`` summed a0's data on both ranks
    (``WRONG 13.0 (want 23.0)``). Now every comparison carries how many collectives the rank had
    started on the group and a digest of the threads and operations of its earlier comparisons,
    and every one of these calls raises on both ranks."""
    result = launch_agreement(
        2, "debug-race", via, env={"CUPY_PARALLEL_DISTRIBUTED_DEBUG": "DETAIL"}
    )
    out = result.stdout
    assert "WRONG" not in out, out
    assert "right" not in out, out  # every call here met another: none may return
    calls = {0: ["async a0", "async a1", "async b0", "held a0", "held b0"]}
    calls[1] = ["async a0", "async a1", "async b0", "held b9", "held b0"]
    for rank, names in calls.items():
        for name in names:
            assert f"rank {rank}: {name}: ERROR ValueError: " in out, (name, out + result.stderr)
    debug = "ERROR ValueError: the debug mode's comparison: ranks [0, 1] disagree (no majority)"
    earlier = (
        f"{debug} in the calls they had issued on this group before this one (the threads and "
        "collectives of those calls, in order), so this call met another call"
    )
    assert f"rank 0: async a1: {earlier}" in out, out
    assert f"rank 1: async a0: {earlier}" in out, out
    started = (
        f"{debug} in how many collectives they had started on this group before this one "
        "(rank 0: 1; rank 1: 0), so MPI pairs this call's data with another call's"
    )
    assert f"rank 0: held b0: {started}" in out, out
    assert f"rank 1: held b0: {started}" in out, out
    assert f"rank 1: held b9: {debug} in the thread that issued it (rank 0: thread 'a'; " in out


def test_a_threads_second_async_call_meeting_its_first_raises_on_both_ranks() -> None:
    """Without the debug mode: thread a starts two all_reduce calls (async_op=True) and thread
    b one, b first on rank 1. a0 meets b0 (an error on both ranks), then a1 on rank 0 met a0
    on rank 1: the same thread and arrays, so their comparisons agreed, and both returned the
    other's sum (rank 0: ``WRONG 103.0 (want 203.0)``, rank 1: ``WRONG 103.0 (want 3.0)``), no
    error. Now the ranks' histories differ there (a, a against b, a) and both raise."""
    result = launch_agreement(2, "async-race", "threads")
    out = result.stdout
    assert "WRONG" not in out, out
    assert "right" not in out, out  # every call here met another: none may return
    history = (
        "ERROR ValueError: all_reduce on process group '1': ranks [0, 1] disagree (no majority) "
        "in the calls they had issued on this group before this one (the threads and "
        "collectives of those calls, in order), so this call met another call"
    )
    assert f"rank 0: async a1: {history}" in out, out + result.stderr[-3000:]
    assert f"rank 1: async a0: {history}" in out, out
    thread = "disagree (no majority) in the thread that issued it"
    assert out.count(thread) == 4, out  # a0 and b0 on rank 0, a1 and b0 on rank 1


@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"{n}ranks")
def test_a_thread_ended_and_made_again_under_its_name_on_one_rank_is_no_error(ranks: int) -> None:
    """The calls meet in the same order from threads of the same name on every rank, though on
    rank 0 each call comes from a new thread: a correct program (as under torch). The ranks used
    to compare how many calls each thread had made, and refused it ("thread 'w', its call 1"
    against "thread 'w', its call 2")."""

    def body(rank: int) -> list[list[float]]:
        sums: list[list[float]] = []

        def calls(k: int, n: int) -> None:
            for i in range(k, k + n):
                x = np.full(2, float(rank + 10 * i))
                dist.all_reduce(x)
                sums.append(x.tolist())

        # rank 0: a new thread for each call; the others: one thread for all three
        pieces = [(i, 1) for i in range(3)] if rank == 0 else [(0, 3)]
        for k, n in pieces:
            thread = threading.Thread(
                target=contextvars.copy_context().run, args=(calls, k, n), name="w"
            )
            thread.start()
            thread.join()
        return sums

    results = dist.spawn(body, ranks)
    expected = [[float(sum(r + 10 * i for r in range(ranks)))] * 2 for i in range(3)]
    assert results == [expected] * ranks


def test_new_group_where_the_others_compare_in_the_debug_mode_names_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL a collective first exchanges a digest of its
    call; it used to be 16 bytes against new_group's row, and MPI truncated: both ranks were
    told that "the ranks' arrays differ in size", and to set the debug mode they had set."""
    monkeypatch.setenv("CUPY_PARALLEL_DISTRIBUTED_DEBUG", "DETAIL")

    def body(rank: int) -> str:
        try:
            if rank == 1:
                dist.new_group([0, 1])
            else:
                dist.all_reduce(np.ones(2))
        except ValueError as error:
            return str(error)
        return "no error"

    said = dist.spawn(body, 2)
    called = "(rank 0: a collective in the debug mode; rank 1: new_group)"
    assert said[0].startswith("the debug mode's comparison: ranks [0, 1] disagree"), said
    assert said[1].startswith("new_group([0, 1]): ranks [0, 1] disagree"), said
    assert all(f"in the collective they called {called}" in message for message in said), said


@pytest.mark.slow
@VIA
def test_non_rooted_collectives_with_other_sizes_or_dtypes_raise_on_every_rank(via: str) -> None:
    """all_reduce of float32[4] with float64[4] on one rank (or int32[4], or float32[6]) gave
    garbage, stale pool bytes included, and exit code 0; as every non-rooted collective. Now
    every rank raises ValueError naming the rank that differs, as gloo refuses ("Received data
    size doesn't match"); the world group stays usable. Also a shape that differs after calls
    that agreed on the group (whose comparison the backend made once and keeps)."""
    result = launch_agreement(3, "mismatch", via)
    out = result.stdout
    assert "NO ERROR" not in out, out
    assert out.count("OK world after: [3.0, 3.0]") == 3, out + result.stderr[-3000:]

    def arrays(mine: str, theirs: str) -> str:
        return f"rank 0: {mine}; rank 1: {mine}; rank 2: {theirs}"

    f32, f64, i32 = (f"{d}, 4 elements, 1-d" for d in ("float32", "float64", "int32"))
    cases = [
        ("all_reduce", 1, arrays(f32, f64)),
        ("all_reduce", 2, arrays(f32, i32)),
        ("all_reduce", 3, arrays(f32, "float32, 6 elements, 1-d")),
        ("all_gather", 5, arrays(f64, "float64, 6 elements, 1-d")),
        ("all_gather", 6, arrays(f32, i32)),
        ("reduce_scatter", 7, arrays(f64, "float64, 6 elements, 1-d")),
        ("reduce_scatter", 8, arrays(f32, f64)),
        (
            "all_reduce_coalesced",
            9,
            arrays(
                "2 arrays, the first float64, 6 elements in all",
                "2 arrays, the first float64, 8 elements in all",
            ),
        ),
        ("all_gather_coalesced", 10, arrays(f32, i32)),
        ("all_reduce", 11, arrays(f32, "float32, 6 elements, 1-d")),  # async_op=True
    ]
    for name, number, passed in cases:
        message = (
            f"CAUGHT ValueError: {name} on process group '{number}': ranks [2] differ from the "
            f"rest in the array they passed ({passed}). Every rank must pass an array of the "
            "same dtype and shape. The arrays' contents are undefined now"
        )
        assert out.count(message) == 3, (message, out)
    shapes = arrays(*["float32, 6 elements, 2-d"] * 2)  # after agreeing calls on that group
    message = (
        "CAUGHT ValueError: all_reduce on process group '12': ranks [2] differ from the rest in "
        "the array they passed (the same dtype and size: their shapes or byte orders differ; the "
        f"debug mode CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL names the shapes) ({shapes})."
    )
    assert out.count(message) == 3, (message, out)
    message = (
        "CAUGHT ValueError: all_reduce on process group '4': ranks [2] differ from the rest in "
        "the reduction they passed (rank 0: ReduceOp.SUM; rank 1: ReduceOp.SUM; rank 2: "
        "ReduceOp.MAX). Every rank must pass the same op."
    )
    assert out.count(message) == 3, out
    # The mismatched operations may never finish: the job is aborted at exit, not left hanging.
    assert result.returncode != 0
    assert ENDED[via] in result.stderr


@pytest.mark.slow
@VIA
def test_rows_through_persistent_pairs_or_not_meet_call_by_call_on_two_ranks(via: str) -> None:
    """Issue 35: a group of two sends its comparison rows point to point, through a persistent
    pair (Send_init/Recv_init) where the rank has one free, else an Isend/Irecv, which MPI
    pairs message by message all the same, so the ranks need not agree on which. Rank 0 has
    no pair here, rank 1 its pool: 600 all_reduce calls (synchronous, the quick path without
    a Work, and async_op=True ones held six at a time) all sum right (oracle: the sum of the
    ranks' values), and the quick path still raises on both ranks when they differ in dtype,
    size, op or shape."""
    result = launch_agreement(2, "pairs", via)
    out = result.stdout
    assert out.count("PAIRS right=600 wrong=0") == 2, out + result.stderr[-3000:]
    assert "NO ERROR" not in out, out
    f32, f64 = (f"{d}, 4 elements, 1-d" for d in ("float32", "float64"))
    for number, what in [
        (1, f"in the array they passed (rank 0: {f32}; rank 1: {f64})"),
        (2, f"in the array they passed (rank 0: {f64}; rank 1: float64, 6 elements, 1-d)"),
        (3, "in the reduction they passed (rank 0: ReduceOp.SUM; rank 1: ReduceOp.MAX)"),
        (4, "in the array they passed (the same dtype and size: their shapes or byte orders"),
    ]:
        message = (
            f"CAUGHT ValueError: all_reduce on process group '{number}': ranks [0, 1] disagree "
            f"(no majority) {what}"
        )
        assert out.count(message) == 2, (message, out)
    assert out.count("OK world after: [2.0, 2.0]") == 2, out
    assert result.returncode != 0  # the mismatched collectives: the job is aborted at exit
    assert ENDED[via] in result.stderr


@pytest.mark.slow
@VIA
def test_a_small_all_reduce_of_two_ranks_sends_its_array_with_the_row(via: str) -> None:
    """Issue 35: a group of two sends a synchronous all_reduce's array (up to 16 KiB) with its
    comparison row, one message, and each rank reduces the pair itself in rank order.

    Every dtype, op and shape (16 KiB and one element more) gives NumPy's answer and MPI's own
    reduction of the same arrays bit for bit (an async call, which takes the Iallreduce); a
    float sum that overflows raises no warning, even under ``np.errstate(all="raise")``; NaN
    payloads and zeros' signs agree between the ranks; a rank that goes the general way
    (async, or no pair free) meets the other's one message; mismatched calls raise on both
    ranks. Then a thread that starts a collective while the carried call waits for a peer
    going the general way: every call still sums its own arrays."""
    result = launch_agreement(2, "carried", via)
    out = result.stdout
    for rank in (0, 1):
        assert f"rank {rank}: CARRIED checked=251 refused=109 wrong=[]" in out, out
        assert f"rank {rank}: QUIET [inf, inf, inf] [True]" in out, out
        assert f"rank {rank}: SAME BITS True True" in out, out
        assert f"rank {rank}: MIXED right=40 of 40" in out, out
    for what in [
        "in the collective they called (rank 0: all_reduce; rank 1: broadcast)",
        "(rank 0: float64, 4 elements, 1-d; rank 1: float64, 5000 elements, 1-d)",
        "in the collective they called (rank 0: all_reduce; rank 1: barrier)",
    ]:
        assert out.count(what) == 2, (what, out)
    assert "NO ERROR" not in out, out
    assert out.count("OK world after: [2.0, 2.0]") == 2, out
    assert ENDED[via] in result.stderr  # the mismatched groups: aborted at exit

    between = launch_agreement(2, "carried-thread-between", via)
    assert between.returncode == 0, between.stdout + between.stderr[-3000:]
    for rank in (0, 1):
        line = f"rank {rank}: THREAD BETWEEN T [2.0, 2.0, 2.0, 2.0] main [4.0, 4.0, 4.0, 4.0, 4.0"
        assert line in between.stdout, between.stdout


@pytest.mark.slow
@VIA
def test_the_carried_all_reduce_of_two_ranks_on_its_edge_cases(via: str) -> None:
    """Issue 35's carried all_reduce (a group of two processes), cases that went wrong.

    A 0-d float array's MIN/MAX with a NaN, zeros of both signs or equal values raised
    TypeError (NumPy's minimum of 0-d arrays is a scalar, which the total order's fix-ups
    wrote into) after the exchange, and kept the pair: now MPI's bits, no pair lost. Then the
    dtypes the ``carried`` test leaves out (uint8, int16, uint32, uint64, long double and its
    complex) with their extremes (limits, infinities, signed zeros, NaN, subnormals), 0-d to
    16 KiB, every op: the Iallreduce's bits (long double's padding aside). Last, a thread's
    first carried call made under a tape: the context the reduction runs in (a copy of the
    thread's, once) kept that tape, and every array it recorded, alive as long as the thread."""
    result = launch_agreement(2, "carried-edges", via)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: 0-D wrong=[] pairs 0 made, 1 free" in result.stdout, result.stdout
        assert f"rank {rank}: SPECIAL checked=85 wrong=[]" in result.stdout, result.stdout
        assert f"rank {rank}: TAPE KEPT [False]" in result.stdout, result.stdout


# One world size per worker mode (the thread-rank tests above run every size): each run
# starts a world of processes and its twin on thread ranks, seconds each.
SAME_OUTPUT = [
    ("collectives_worker", "all", 3, 120),
    ("api_worker", "api", 3, 30),
    ("api_worker", "local", 4, 30),
    ("edges_worker", "edges", 3, 3),
    ("edges_worker", "disagree", 3, 3),
    ("agreement_worker", "mismatch", 3, 20),
]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
@pytest.mark.parametrize(
    ("name", "mode", "ranks", "group_timeout"),
    SAME_OUTPUT,
    ids=[f"{name.split('_')[0]}-{mode}-{n}ranks" for name, mode, n, _ in SAME_OUTPUT],
)
def test_thread_ranks_print_what_mpi_processes_print(
    name: str, mode: str, ranks: int, group_timeout: float
) -> None:
    """Every line the workers print (checks passed and their number, each error message) is the
    same on thread ranks as on processes: the same calls, the same results, the same errors.

    With the thread-rank tests of each mode (every size), this is the mode's test on processes:
    what those assert of the printed lines holds for the processes' lines too.
    """
    processes = run_mpiexec(name, ranks, mode, timeout=300)
    threads = run_threads(name, ranks, mode, timeout=group_timeout)
    assert printed(threads.stdout) == printed(processes.stdout)
    assert (threads.returncode == 0) == (processes.returncode == 0)


# ---------------------------------------------------------------------------------------------
# The ranks' comparison of all_to_all sizes: fingerprints against the pairwise comparison


@pytest.mark.slow
@given(
    sizes=st.integers(1, 6).flatmap(
        lambda n: st.lists(
            st.lists(st.integers(0, 2**40), min_size=n, max_size=n), min_size=n, max_size=n
        )
    ),
    change=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 2**40)),
)
@settings(max_examples=200, deadline=None)
def test_all_to_all_fingerprints_agree_exactly_when_every_pair_does(
    sizes: list[list[int]], change: tuple[int, int, int]
) -> None:
    """``sizes[r][j]``: what rank r sends j. The oracle: rank j expects ``sizes[r][j]`` from r,
    then one expectation changed (or left alone, when ``change`` falls outside the world)."""
    n = len(sizes)
    expects = [[sizes[r][j] for r in range(n)] for j in range(n)]  # [j][r]
    j, r, delta = change
    if j < n and r < n:
        expects[j][r] += delta
    agree = all(sizes[r][j] == expects[j][r] for r in range(n) for j in range(n))
    caller, dtype = Caller("MainThread"), np.dtype(np.int8)
    comparisons = [
        compare_counts(caller, sizes[k], expects[k], dtype, range(n), rank=k) for k in range(n)
    ]
    rows = b"".join(stamp(row, 0, 0) for row, _ in comparisons)  # as the backend sends them
    every = np.frombuffer(rows, np.int64).reshape(n, -1)
    asked: list[np.ndarray] = []

    def exchange(mine: np.ndarray) -> np.ndarray:  # what every rank would send: the oracle's
        asked.append(mine)
        return np.array([[*sizes[k], *expects[k]] for k in range(n)], np.int64)

    problem = comparisons[0][1](every, exchange)
    assert (problem is None) == agree
    assert (asked == []) == agree  # the sizes themselves travel only when a pair disagrees
    if not agree:
        assert f"rank {r} sends {sizes[r][j]} bytes to rank {j}, which expects " in str(problem)
