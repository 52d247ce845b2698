"""DistributedDataParallel's training step on 2 MPI ranks, against torch DDP (gloo), same run.

One MLP (float32, layers 512-1024-1024-1024-1024-512-16, 4.2 M parameters, 16.8 MB of
gradients), 64 samples per rank, a mean squared error. A *step* is a forward pass recorded on
a tape and ``tape.gradient`` of the loss (torch: ``zero_grad``, forward, ``backward``); the
variants are timed round by round, alternating, each round's figure the slowest rank's:

- ``ddp``: ``cupy_parallel.DistributedDataParallel`` (buckets all-reduced during the backward
  pass; ``bucket_cap_mb=4`` for both DDPs, about 5 buckets: with the default 25 MiB this model
  would be a 1 MiB bucket and one bucket holding the rest, whose all-reduce can only start
  once the backward pass ends, in both libraries);
- ``torch``: ``torch.nn.parallel.DistributedDataParallel`` over gloo on the same model, weights
  and data (when torch is installed; torch pinned to one thread, as BLAS is);
- ``ddp find_unused``: the same DDP with ``find_unused_parameters=True``, which exchanges
  which parameters each rank used (one all-reduce of ``len(params) + 1`` int32 per pass,
  after the buckets: what lets a parameter no rank used get ``None``), as torch's does;
- ``serial``: our backward pass, then one ``all_reduce`` of all gradients flattened in one
  buffer (no overlap);
- ``local``: our backward pass with no communication (and ``torch local``, torch's, for
  telling a difference in computing from one in communicating).

The communication a step costs is ``serial - local``; what DDP leaves exposed is
``ddp - local``; the fraction hidden behind the backward pass is ``(serial - ddp) / (serial -
local)``. Target: the DDP step at most 1.0x torch DDP's (the ``ratio`` of the first row); the
other rows report. Run ``python benchmarks/bench_ddp.py [--quick]``: it starts ``mpiexec -n 2``
itself (or, under ``mpiexec``, measures that world); with torch installed in another
environment, run it with that environment's Python.
"""

from __future__ import annotations

import itertools
import socket
import time
from typing import Any

import numpy as np

from cupy_parallel._tools.benchmarking import (
    Timing,
    mpi_script_main,
    result,
    run_ranks,
)

SIZES = [512, 1024, 1024, 1024, 1024, 512, 16]
BATCH = 64  # per rank
RANKS = 2
BUCKET_CAP_MB = 4.0  # both DDPs: about 5 buckets, so that most all-reduces can overlap


def _weights() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            (0.1 * rng.standard_normal(b)).astype(np.float32),
        )
        for a, b in itertools.pairwise(SIZES)
    ]


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1 + rank)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    return x, rng.standard_normal((BATCH, SIZES[-1])).astype(np.float32)


def _mlp(params: list[dict[str, Any]], x: Any) -> Any:
    from cupy_parallel import ops

    h = x
    for k, layer in enumerate(params):
        h = ops.add(ops.matmul(h, layer["w"]), layer["b"])
        if k < len(params) - 1:
            h = ops.relu(h)
    return h


def _ours(rank: int) -> dict[str, Any]:
    """The three variants of our step, as functions returning the gradients."""
    import cupy_parallel as cp
    from cupy_parallel import distributed as dist
    from cupy_parallel import ops

    x, y = _data(rank)
    world = dist.get_world_size()
    params = [{"w": w.copy(), "b": b.copy()} for w, b in _weights()]
    ddp = cp.DistributedDataParallel(_mlp, params, bucket_cap_mb=BUCKET_CAP_MB)
    find_params = [{"w": w.copy(), "b": b.copy()} for w, b in _weights()]
    find = cp.DistributedDataParallel(
        _mlp, find_params, bucket_cap_mb=BUCKET_CAP_MB, find_unused_parameters=True
    )
    local_params = [{"w": w.copy(), "b": b.copy()} for w, b in _weights()]

    def loss(out: Any) -> Any:
        return ops.mean(ops.square(ops.subtract(out, y)))

    def ddp_step() -> Any:
        with cp.Tape() as tape:
            value = loss(ddp(x))
        return tape.gradient(value, ddp.params)

    def find_unused_step() -> Any:
        with cp.Tape() as tape:
            value = loss(find(x))
        return tape.gradient(value, find.params, unconnected_gradients="none")

    def local_grads() -> Any:
        with cp.Tape() as tape:
            tape.watch(local_params)
            value = loss(_mlp(local_params, x))
        return tape.gradient(value, local_params)

    def serial_step() -> Any:
        grads = local_grads()
        flat = [g for layer in grads for g in (layer["w"], layer["b"])]
        buffer = np.concatenate([g.ravel() for g in flat])
        dist.all_reduce(buffer)
        buffer /= world
        return buffer

    return {
        "ddp": ddp_step,
        "ddp find_unused": find_unused_step,
        "serial": serial_step,
        "local": local_grads,
    }


def _torch_step(rank: int, port: int) -> Any:
    """torch DDP over gloo on the same model and data, or ``None`` without torch."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None
    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS
    )
    layers: list[Any] = []
    for k, (w, b) in enumerate(_weights()):
        linear = torch.nn.Linear(w.shape[0], w.shape[1])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
        layers.append(linear)
        if k < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    local = torch.nn.Sequential(*layers)
    model = torch.nn.parallel.DistributedDataParallel(local, bucket_cap_mb=BUCKET_CAP_MB)
    x, y = (torch.from_numpy(a) for a in _data(rank))

    def stepper(module: Any) -> Any:
        def step() -> Any:
            module.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(module(x), y).backward()
            return module

        return step

    step, local_step = stepper(model), stepper(local)
    step.check = lambda: [p.grad.numpy() for p in model.parameters()]  # type: ignore[attr-defined]
    step.local = local_step  # type: ignore[attr-defined]
    return step


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _measure(quick: bool) -> list[dict[str, Any]]:
    """Every rank runs this; rank 0 returns the rows."""
    from mpi4py import MPI

    from cupy_parallel import distributed as dist
    from cupy_parallel._tools.benchmarking import pinned_blas_threads

    comm = MPI.COMM_WORLD.Dup()
    rank, ranks = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(_free_port() if rank == 0 else None)
    with pinned_blas_threads():
        dist.init_process_group("mpi")
        steps = _ours(rank)
        torch_step = _torch_step(rank, port)
        if torch_step is not None:
            steps["torch"] = torch_step
            steps["torch local"] = torch_step.local
            _check_same_gradients(steps, torch_step)
        rounds, iters = (5, 2) if quick else (25, 4)
        names = list(steps)
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # warm up
            steps[n]()
        for _ in range(rounds):
            for n in names:
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    steps[n]()
                elapsed = (time.perf_counter() - start) / iters
                times[n].append(comm.allreduce(elapsed, op=MPI.MAX))
        dist.destroy_process_group()
    comm.Free()
    if rank != 0:
        return []
    return _rows(times, ranks)


def _check_same_gradients(steps: dict[str, Any], torch_step: Any) -> None:
    """Both DDPs average the same gradients (float32: to 1e-4 relative)."""
    ours = steps["ddp"]()
    torch_step()
    theirs = torch_step.check()
    for layer, (tw, tb) in zip(ours, zip(theirs[::2], theirs[1::2], strict=True), strict=True):
        for a, b in ((layer["w"], tw.T), (layer["b"], tb)):
            scale = float(np.max(np.abs(b))) or 1.0
            if float(np.max(np.abs(a - b))) > 1e-4 * scale:
                raise AssertionError("our DDP and torch DDP disagree on the gradients")


def _rows(times: dict[str, list[float]], ranks: int) -> list[dict[str, Any]]:
    median = {n: float(np.median(t)) for n, t in times.items()}
    communication = median["serial"] - median["local"]
    exposed = median["ddp"] - median["local"]
    hidden = (median["serial"] - median["ddp"]) / communication if communication > 0 else 0.0
    params = sum(w.size + b.size for w, b in _weights())
    common = {"ranks": ranks, "parameters": params, "bytes": 4 * params}
    rows = []
    find_unused = Timing.of(times["ddp find_unused"], times["ddp"])
    if "torch" in median:
        timing = Timing.of(times["ddp"], times["torch"])
        rows.append(
            {
                **result(
                    f"DDP step vs torch DDP (gloo), {ranks} ranks",
                    median["ddp"],
                    median["torch"],
                    1.0,
                ),
                "goal": "<= 1.0x torch DDP over gloo",
                "spread": timing.spread,
                "paired_median_ratio": timing.ratio,
                **common,
            }
        )
    if "torch" in median:
        torch_exposed = median["torch"] - median["torch local"]
        rows.append(
            {
                **result(
                    f"torch DDP step vs torch local step, {ranks} ranks",
                    median["torch"],
                    median["torch local"],
                    None,
                ),
                "goal": (
                    f"reported: communication exposed, torch {torch_exposed * 1e3:.1f} ms, "
                    f"ours {exposed * 1e3:.1f} ms"
                ),
                "exposed_seconds": torch_exposed,
                **common,
            }
        )
    rows.append(
        {
            **result(
                f"DDP step with find_unused_parameters=True vs without, {ranks} ranks",
                median["ddp find_unused"],
                median["ddp"],
                None,
            ),
            "goal": "reported: the cost of exchanging which parameters each rank used",
            "paired_median_ratio": find_unused.ratio,
            "spread": find_unused.spread,
            **common,
        }
    )
    rows.append(
        {
            **result(
                f"DDP step vs backward + one all_reduce, {ranks} ranks",
                median["ddp"],
                median["serial"],
                None,
            ),
            "goal": "reported: overlap against none",
            "hidden_fraction": hidden,
            "communication_seconds": communication,
            "exposed_seconds": exposed,
            **common,
        }
    )
    rows.append(
        {
            **result(
                f"DDP step vs local step (no communication), {ranks} ranks",
                median["ddp"],
                median["local"],
                None,
            ),
            "goal": f"reported: {hidden:.0%} of the communication hidden behind the backward pass",
            "hidden_fraction": hidden,
            **common,
        }
    )
    return rows


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Measure on 2 ranks (launching mpiexec) and return the rows."""
    return run_ranks(__file__, RANKS, quick=quick, timeout=600)


def main() -> None:
    mpi_script_main(_measure, run, "bench_ddp", __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
