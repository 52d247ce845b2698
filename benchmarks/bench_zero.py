"""ZeroRedundancyOptimizer on 2 MPI ranks: its parameter sync two ways, its step against DDP.

One MLP (float32, layers 512-1024-1024-1024-1024-512-16, 4.2 M parameters in 12 arrays), 64
samples per rank, a mean squared error, Adam. Timed round by round, alternating, each round's
figure the slowest rank's:

- ``all_gather`` / ``broadcast``: the sync after the local update alone (every rank receives
  every updated parameter): one ``all_gather_into_tensor`` of flat buffers padded to the largest
  partition, against a broadcast of each parameter in place from its owner (the faster here,
  and no buffers: the default);
- ``small packed`` / ``small broadcast``: ``ZeroRedundancyOptimizer(Adam).step`` alone (the
  local update and the sync, the same gradients each time) on a second model of many small
  parameters (96 units of a 64 x 64 weight and three 64-vectors: 288 of the 384 arrays under
  ``IN_PLACE_BYTES``), ``param_sync="broadcast_packed"`` against the default: what packing an
  owner's small parameters into one broadcast saves where collectives, not bytes, dominate;
- ``zero step`` / ``ddp step``: a training step, forward, backward (DDP's averaged gradients)
  and ``ZeroRedundancyOptimizer(Adam).step`` (its default sync) against the same with an
  unsharded ``Adam`` on every rank (issue 33's target: at most 1.1x).

The rows also report the optimizer state a rank holds (bytes) with each. Run ``python
benchmarks/bench_zero.py [--quick]``: it starts ``mpiexec -n 2`` itself (or, under ``mpiexec``,
measures that world).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import numpy as np

from cupy_parallel._tools.benchmarking import Timing, mpi_script_main, run_ranks

SIZES = [512, 1024, 1024, 1024, 1024, 512, 16]
BATCH = 64  # per rank
RANKS = 2


def _params() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    return [
        {
            "w": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            "b": (0.1 * rng.standard_normal(b)).astype(np.float32),
        }
        for a, b in itertools.pairwise(SIZES)
    ]


def _mlp(params: list[dict[str, Any]], x: Any) -> Any:
    from cupy_parallel import ops

    h = x
    for k, layer in enumerate(params):
        h = ops.add(ops.matmul(h, layer["w"]), layer["b"])
        if k < len(params) - 1:
            h = ops.relu(h)
    return h


SMALL_UNITS, SMALL_D = 96, 64


def _small_params() -> list[dict[str, Any]]:
    """Many small parameters: each unit a ``D x D`` weight and three ``D``-vectors."""
    rng = np.random.default_rng(2)
    return [
        {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        for shapes in [{"w": (SMALL_D, SMALL_D), "b": SMALL_D, "g": SMALL_D, "beta": SMALL_D}]
        * SMALL_UNITS
    ]


def _state_bytes(optimizer: Any) -> int:
    return sum(
        int(v.nbytes)
        for entry in optimizer.state.values()
        for v in entry.values()
        if hasattr(v, "nbytes")
    )


def _steps(rank: int) -> tuple[dict[str, Any], dict[str, int]]:
    import cupy_parallel as cp
    from cupy_parallel import ops
    from cupy_parallel._src.sharded.zero import _sync_all_gather, _sync_broadcast
    from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
    from cupy_parallel.optim import Adam

    rng = np.random.default_rng(1 + rank)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.standard_normal((BATCH, SIZES[-1])).astype(np.float32)
    zddp = cp.DistributedDataParallel(_mlp, _params(), bucket_cap_mb=4.0)
    rddp = cp.DistributedDataParallel(_mlp, _params(), bucket_cap_mb=4.0)
    zero = ZeroRedundancyOptimizer(zddp.params, Adam, lr=1e-5)
    adam = Adam(rddp.params, lr=1e-5)

    def train(ddp: Any, optimizer: Any) -> Any:
        def step() -> None:
            with cp.Tape() as tape:
                loss = ops.mean(ops.square(ops.subtract(ddp(x), y)))
            optimizer.step(tape.gradient(loss, ddp.params))

        return step

    def small(param_sync: str) -> Any:
        params = _small_params()
        grads = [{n: np.full_like(a, 1e-3) for n, a in unit.items()} for unit in params]
        return functools.partial(
            ZeroRedundancyOptimizer(params, Adam, lr=1e-5, param_sync=param_sync).step, grads
        )

    steps = {
        "all_gather": lambda: _sync_all_gather(zero),
        "broadcast": lambda: _sync_broadcast(zero),
        "zero step": train(zddp, zero),
        "ddp step": train(rddp, adam),
        "small packed": small("broadcast_packed"),
        "small broadcast": small("broadcast"),
    }
    steps["zero step"]()
    steps["ddp step"]()
    memory = {"zero": _state_bytes(zero.optim), "adam": _state_bytes(adam)}
    return steps, memory


def _measure(quick: bool) -> list[dict[str, Any]]:
    """Every rank runs this; rank 0 returns the rows."""
    from mpi4py import MPI

    from cupy_parallel import distributed as dist
    from cupy_parallel._tools.benchmarking import pinned_blas_threads

    comm = MPI.COMM_WORLD.Dup()
    rank, ranks = comm.Get_rank(), comm.Get_size()
    with pinned_blas_threads():
        dist.init_process_group("mpi")
        steps, memory = _steps(rank)
        rounds, iters = (5, 2) if quick else (21, 4)
        times: dict[str, list[float]] = {n: [] for n in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    step()
                elapsed = (time.perf_counter() - start) / iters
                times[name].append(comm.allreduce(elapsed, op=MPI.MAX))
        memories = comm.gather(memory)
        dist.destroy_process_group()
    comm.Free()
    if rank != 0:
        return []
    assert memories is not None
    params = sum(a.size for layer in _params() for a in layer.values())
    common = {"ranks": ranks, "parameters": params, "bytes": 4 * params}
    sync = Timing.of(times["all_gather"], times["broadcast"])
    step = Timing.of(times["zero step"], times["ddp step"])
    small = Timing.of(times["small packed"], times["small broadcast"])
    small_params = sum(a.size for unit in _small_params() for a in unit.values())
    return [
        sync.row(
            f"ZeRO parameter sync: one all_gather vs broadcasts from the owners, {ranks} ranks",
            None,
            goal="reported: picks param_sync's default (the faster: broadcast when ratio > 1)",
            **common,
        ),
        step.row(
            f"ZeRO-1 + Adam training step vs DDP + Adam, {ranks} ranks",
            1.1,
            goal="<= 1.1x DDP + Adam (issue 33)",
            state_bytes_per_rank=[m["zero"] for m in memories],
            ddp_state_bytes_per_rank=[m["adam"] for m in memories],
            **common,
        ),
        small.row(
            f"ZeRO step, 288 small parameters: broadcast_packed vs broadcast, {ranks} ranks",
            None,
            goal="reported: what param_sync='broadcast_packed' saves (ratio < 1: faster)",
            ranks=ranks,
            parameters=small_params,
            arrays=4 * SMALL_UNITS,
        ),
    ]


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure on 2 ranks (launching mpiexec) and return the rows."""
    return run_ranks(__file__, RANKS, quick=quick, timeout=600)


def main() -> None:
    mpi_script_main(_measure, run, "bench_zero", __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
