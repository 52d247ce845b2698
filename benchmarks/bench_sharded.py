"""Sharded data parallelism on 2 and 4 MPI ranks: memory and step time, DDP vs ZeRO-1 vs FSDP.

One model: an MLP of 8 units (each a ``D x D`` float32 weight and a bias, tanh between; D = 512,
8.4 MB of parameters), 32 samples per rank, a mean squared error, Adam (lr 1e-3). A *step* is
the forward pass recorded on a tape, ``tape.gradient`` and the optimizer's ``step``. Variants:

- ``ddp``: :class:`~cupy_parallel.DistributedDataParallel` + ``optim.Adam`` (the baseline);
- ``zero1``: DDP + ``distributed.optim.ZeroRedundancyOptimizer(Adam)`` (when that class exists
  in this checkout), its parameters synchronised by one all-gather of padded flat buffers
  (``param_sync="all_gather"``: its memory row is reported without a target, since that sync
  holds a gathered copy of the model by design); ``zero1 broadcast``: by a broadcast of each
  parameter from its owner, in place (the default, which the ZeRO-1 targets are for);
- ``fsdp``: :class:`~cupy_parallel.FullyShardedDataParallel` (FULL_SHARD) + ``optim.Adam`` on
  its shards; ``fsdp grad_op``: the same with ``reshard_after_forward=False`` (SHARD_GRAD_OP).

**Memory per rank** (rows ``memory ...``; their ``seconds`` columns hold bytes, which the table
shows as bytes, their ``ratio`` the variant's bytes over DDP's): the peak, during a step after a
first one (Adam's state exists), of the bytes the host memory pool hands out on the rank: the
parameters, the gradient buffers (DDP's buckets, FSDP's reduce-scatter buffers), the optimizer
state and the gathered units, the pool's blocks (arrays of 128 KiB or more) and the smaller arrays
it takes from NumPy alike (a bias, its gradient and its Adam state: the probe counts those itself,
:class:`_Peak`); the activations and the tape's intermediate gradients are NumPy's results, not
the pool's, and are not counted. DDP's peak is then exactly its 4 copies of the parameters.
Targets (the issue's, with DDP's 4 copies as the unit): ZeRO-1 at most ``(2 + 2/N) / 4`` of DDP's;
FSDP at most ``(4/N) / 4`` of DDP's plus two units (one gathered, one prefetched). ZeRO-1's
parameters, gradients and state come to exactly ``(2 + 2/N) / 4``, and its default sync needs
no buffer (``param_sync="broadcast_packed"`` adds the buffers that carry each owner's biases
while its broadcasts are in flight, 16 KiB here; ``"all_gather"`` a whole gathered copy).

**Step time** (rows ``step ...``): the median over rounds of the slowest rank's step, the
variants alternating within each round; ratio against ``ddp``; targets ZeRO-1 1.1x, FSDP 1.2x.
The losses of the first steps agree across the variants (checked, 1e-5 relative: float32).

**Floor** (rows ``raw comm ...`` and ``step floor ...``): the same bytes moved by mpi4py alone,
no library code (non-blocking calls on NumPy buffers, polled with ``Test`` and ``sched_yield``
as the library's MPI backend polls): DDP's one all-reduce of the gradients against FSDP's
all-gather per unit (two per unit with FULL_SHARD: forward and backward) and reduce-scatter per
unit, in the order and overlap of FSDP's schedule (a gather ahead in the forward pass; one
reduce-scatter in flight while the next unit is gathered again), and ZeRO-1's all-reduce plus
a broadcast per unit from its owner (or one all-gather of every rank's partition). ``raw comm``
rows: those times and their ratio to DDP's. ``step floor`` rows: ``(ddp step - ddp raw comm +
variant raw comm) / ddp step``, the ratio a variant would reach if everything but its
communication cost what DDP's step does (it leaves out the optimizer work sharding saves and the
copies into and out of flat buffers it adds): a step ratio near its floor is set by the
collectives, not by the library; a floor above the target means the target is out of reach on
this machine (with more ranks than cores, every collective waits for ranks that share a core).

The machine's other load moves all of these: each row's figures come from rounds that time the
variants back to back, and repeated runs (medians) are what to compare.

Run ``python benchmarks/bench_sharded.py [--quick] [--ranks N ...]``: it starts ``mpiexec -n N``
for each ``N`` (default 2 and 4: one rank per core of a 2-core machine, and two per core) and
names each row with its world size; under ``mpiexec`` it measures that world.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import weakref
from typing import Any

import numpy as np

from cupy_parallel._tools.benchmarking import (
    Timing,
    mpi_script_main,
    polled_as_the_backend_polls,
    run_ranks,
)

D = 512
UNITS = 8
BATCH = 32  # per rank
RANKS = (2, 4)  # worlds measured by default (--ranks N ... chooses)
LR = 1e-3


def _params() -> dict[str, Any]:
    """The model's parameters, pooled arrays (``cupy_parallel.empty``) filled from a seed."""
    import cupy_parallel as cp

    rng = np.random.default_rng(0)
    params = {}
    for k in range(UNITS):
        w = cp.empty((D, D), np.float32, "cpu")
        w[...] = rng.standard_normal((D, D)) / np.sqrt(D)
        b = cp.empty((D,), np.float32, "cpu")
        b[...] = 0.1 * rng.standard_normal(D)
        params[f"layer{k}"] = {"w": w, "b": b}
    return params


def layer(p: Any, h: Any) -> Any:
    from cupy_parallel import ops

    return ops.tanh(ops.add(ops.matmul(h, p["w"]), p["b"]))


def model(units: Any, x: Any) -> Any:
    """The units read one by one, none kept once the next is read (FSDP frees it then)."""
    h = x
    for k in range(UNITS):
        h = layer(units[f"layer{k}"], h)
    return h


def _data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((BATCH, D)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()


class _Peak:
    """The most bytes live in arrays the host pool handed out since :meth:`reset`.

    Read at each allocation: the pool's ``used_bytes`` (its blocks, of 128 KiB or more) plus
    the smaller arrays, which the pool takes from NumPy and does not count (its ``used_bytes``
    did not grow); those are counted here from their allocation until they are freed
    (``weakref.finalize``). So every parameter, gradient and state array the library makes
    counts, whatever its size (a bias of 2 KiB as a weight of 1 MiB).
    """

    def __init__(self) -> None:
        import cupy_parallel as cp

        self.pool = cp.get_host_memory_pool()
        self.peak = 0
        self.small = 0
        allocate = self.pool.empty

        def empty(*args: Any, **kwargs: Any) -> Any:
            before = self.pool.used_bytes()
            array = allocate(*args, **kwargs)
            used = self.pool.used_bytes()
            if used == before and array.nbytes:  # from NumPy: counted here
                self.small += array.nbytes
                weakref.finalize(array, self._freed, array.nbytes)
            self.peak = max(self.peak, used + self.small)
            return array

        self.pool.empty = empty  # type: ignore[method-assign]  # the benchmark's probe

    def _freed(self, nbytes: int) -> None:
        self.small -= nbytes

    def reset(self) -> None:
        self.peak = self.pool.used_bytes() + self.small


def _variants() -> dict[str, Any]:
    """name -> a function making (module, optimizer) for this rank."""
    import cupy_parallel as cp
    from cupy_parallel.optim import Adam

    def ddp() -> Any:
        module = cp.DistributedDataParallel(model, _params())
        return module, Adam(module.params, lr=LR)

    def fsdp(*, reshard: bool) -> Any:
        module = cp.FullyShardedDataParallel(model, _params(), reshard_after_forward=reshard)
        return module, Adam(module.params, lr=LR)

    variants: dict[str, Any] = {
        "ddp": ddp,
        "fsdp": lambda: fsdp(reshard=True),
        "fsdp grad_op": lambda: fsdp(reshard=False),
    }
    try:
        from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:
        return variants

    def zero1(sync: str) -> Any:
        module = cp.DistributedDataParallel(model, _params())
        return module, ZeroRedundancyOptimizer(module.params, Adam, lr=LR, param_sync=sync)

    return {
        "ddp": ddp,
        "zero1": lambda: zero1("all_gather"),
        "zero1 broadcast": lambda: zero1("broadcast"),
        **{k: v for k, v in variants.items() if k != "ddp"},
    }


def _step(module: Any, optimizer: Any, x: Any, y: Any) -> float:
    import cupy_parallel as cp
    from cupy_parallel import ops

    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(module(x), y)))
    grads = tape.gradient(loss, module.params)
    optimizer.step(grads)
    del grads, tape
    return float(loss)


def _raw_patterns(world: int) -> dict[str, Any]:
    """name -> a function moving a variant's bytes with mpi4py alone (see the module's Floor)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    unit = D * D + D
    shard = -(-D // world) * (D + 1)  # a rank's flat shard of a unit: ceil(D / W) rows of w, b
    grads = np.ones(UNITS * unit, np.float32)
    full = np.zeros(world * shard, np.float32)
    mine = np.ones(shard, np.float32)
    partition = np.ones(-(-UNITS * unit // world), np.float32)
    everything = np.zeros(world * partition.size, np.float32)

    wait = polled_as_the_backend_polls(world)

    def ddp() -> None:
        wait(comm.Iallreduce(MPI.IN_PLACE, grads))

    def fsdp(gathers: int) -> None:
        """FSDP's schedule without its compute: the next gather (or the reduce-scatter in
        flight) runs while the one needed now is waited for, as its prefetch does."""
        fulls = [np.zeros_like(full) for _ in range(2)]
        ahead = comm.Iallgather(mine, fulls[0])
        for k in range(UNITS):  # forward: unit k + 1's gather issued before k's is waited
            current, ahead = ahead, None
            if k + 1 < UNITS:
                ahead = comm.Iallgather(mine, fulls[(k + 1) % 2])
            wait(current)
        scattering = None
        for k in range(UNITS):  # backward: regather (FULL_SHARD), then the reduce-scatter
            if gathers == 2:
                regather = comm.Iallgather(mine, fulls[k % 2])
                if scattering is not None:
                    wait(scattering)
                    scattering = None
                wait(regather)
            sending = comm.Ireduce_scatter_block(fulls[k % 2], mine)
            if scattering is not None:
                wait(scattering)
            scattering = sending
        wait(scattering)

    def zero(broadcast: bool) -> None:
        ddp()
        if broadcast:
            for k in range(UNITS):
                wait(comm.Ibcast(grads[k * unit : (k + 1) * unit], k % world))
        else:
            wait(comm.Iallgather(partition, everything))

    return {
        "ddp": ddp,
        "zero1": lambda: zero(broadcast=False),
        "zero1 broadcast": lambda: zero(broadcast=True),
        "fsdp": lambda: fsdp(2),
        "fsdp grad_op": lambda: fsdp(1),
    }


def _raw_times(world: int, rounds: int) -> dict[str, list[float]]:
    """Each raw pattern's slowest-rank seconds, round by round (the patterns alternating)."""
    from cupy_parallel import distributed as dist

    patterns = _raw_patterns(world)
    times: dict[str, list[float]] = {name: [] for name in patterns}
    for _ in range(1 + rounds):  # the first round warms up
        for name, pattern in patterns.items():
            dist.barrier()
            start = time.perf_counter()
            pattern()
            elapsed = np.array([time.perf_counter() - start])
            dist.all_reduce(elapsed, dist.ReduceOp.MAX)
            times[name].append(float(elapsed[0]))
    return {name: t[1:] for name, t in times.items()}


def _step_times(x: Any, y: Any, rounds: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every variant built, alternating within each round: losses and slowest-rank seconds."""
    from cupy_parallel import distributed as dist

    made = {name: make() for name, make in _variants().items()}
    losses: dict[str, list[float]] = {name: [] for name in made}
    times: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(1 + rounds):  # the first round warms up (Adam's state made)
        for name, (module, optimizer) in made.items():
            dist.barrier()
            start = time.perf_counter()
            losses[name].append(_step(module, optimizer, x, y))
            elapsed = np.array([time.perf_counter() - start])
            dist.all_reduce(elapsed, dist.ReduceOp.MAX)  # the slowest rank's step
            times[name].append(float(elapsed[0]))
    return losses, {name: t[1:] for name, t in times.items()}


def _step_rows(times: dict[str, Any], raw: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The rows ``step``, ``raw comm`` and ``step floor`` of each variant against DDP."""
    step_targets = {"zero1": 1.1, "zero1 broadcast": 1.1, "fsdp": 1.2, "fsdp grad_op": 1.2}
    ddp_step = statistics.median(times["ddp"])
    ddp_comm = statistics.median(raw["ddp"])
    rows = []
    for name, seconds in times.items():
        if name == "ddp":
            continue
        timing = Timing.of(seconds, times["ddp"])
        rows.append(timing.row(f"step {name} / ddp+adam", step_targets[name], ranks=n))
        comm = Timing.of(raw[name], raw["ddp"])
        rows.append(comm.row(f"raw comm {name} / ddp", None, ranks=n))
        floor = ddp_step - ddp_comm + comm.seconds
        rows.append(
            {
                "name": f"step floor {name} / ddp+adam",
                "seconds": floor,
                "baseline_seconds": ddp_step,
                "ratio": floor / ddp_step,
                "target": None,
                "ranks": n,
                "note": "ddp step - ddp raw comm + this variant's raw comm",
            }
        )
    return rows


def _measure(quick: bool) -> list[dict[str, Any]]:
    from cupy_parallel import distributed as dist

    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(rank)
    losses, times = _step_times(x, y, 3 if quick else 10)
    raw = _raw_times(world, 5 if quick else 15)
    peak = _Peak()  # (after the timings, which its bookkeeping would slow)
    # memory: each variant alone (the others' arrays gone), its second step's peak
    memory: dict[str, int] = {}
    for name, make in _variants().items():
        module, optimizer = make()
        _step(module, optimizer, x, y)
        gc.collect()  # what the first step left in reference cycles, for every variant alike
        dist.barrier()
        peak.reset()
        _step(module, optimizer, x, y)
        memory[name] = peak.peak
        del module, optimizer
        dist.barrier()
    first = losses["ddp"][:3]
    for name, history in losses.items():
        np.testing.assert_allclose(history[:3], first, rtol=1e-5, err_msg=name)
    peaks = np.array([memory[name] for name in memory], dtype=np.float64)
    dist.all_reduce(peaks, dist.ReduceOp.MAX)  # the rank holding most
    memory = {name: int(v) for name, v in zip(memory, peaks, strict=True)}
    dist.destroy_process_group()
    if rank != 0:
        return []
    n = world
    param_bytes = UNITS * (D * D + D) * 4
    unit_bytes = (D * D + D) * 4
    ddp_model = 4 * param_bytes
    targets = {
        # param_sync="all_gather" holds a gathered copy by design (reported, not targeted)
        "zero1": None,
        "zero1 broadcast": (2 + 2 / n) / 4,
        "fsdp": (4 / n) / 4 + 2 * unit_bytes / ddp_model,
        "fsdp grad_op": None,
    }
    rows = []
    for name in memory:
        if name == "ddp":
            continue
        rows.append(
            {
                "name": f"memory {name} / ddp",
                "seconds": memory[name],
                "baseline_seconds": memory["ddp"],
                "ratio": memory[name] / memory["ddp"],
                "target": targets[name],
                "bytes": memory[name],
                "baseline_bytes": memory["ddp"],
                "unit": "bytes",  # the table shows the seconds columns as bytes
                "parameter_bytes": param_bytes,
                "unit_bytes": unit_bytes,
                "ranks": n,
            }
        )
    rows.extend(_step_rows(times, raw, n))
    rows.append(
        {
            "name": "memory ddp (bytes per rank)",
            "seconds": memory["ddp"],
            "baseline_seconds": ddp_model,
            "ratio": memory["ddp"] / ddp_model,
            "target": None,
            "unit": "bytes",
            "note": "baseline: 4 copies of the parameters (params, grads, Adam's 2)",
        }
    )
    rows.append(
        {
            "name": "losses (first steps, every variant)",
            "seconds": float("nan"),
            "baseline_seconds": float("nan"),
            "ratio": float("nan"),
            "target": None,
            "losses": losses,
        }
    )
    for row in rows:  # one run measures several worlds: each row says which
        row["name"] = f"{row['name']} ({n} ranks)"
    return rows


def run(quick: bool = False, ranks: tuple[int, ...] = RANKS) -> list[dict[str, Any]]:
    """Measure on each world size of ``ranks`` (launching mpiexec) and return the rows."""
    rows: list[dict[str, Any]] = []
    for n in ranks:
        rows.extend(run_ranks(__file__, n, quick=quick, timeout=900))
    return rows


def _take_ranks(argv: list[str]) -> tuple[int, ...]:
    """The world sizes of ``--ranks N [N ...]`` (removed from ``argv``), else :data:`RANKS`."""
    if "--ranks" not in argv:
        return RANKS
    at = argv.index("--ranks")
    values = []
    while at + 1 < len(argv) and argv[at + 1].isdigit():
        values.append(int(argv.pop(at + 1)))
    argv.pop(at)
    if not values or min(values) < 1:
        raise SystemExit("--ranks takes one or more world sizes (positive integers)")
    return tuple(values)


def main() -> None:
    ranks = _take_ranks(sys.argv)
    mpi_script_main(
        _measure,
        lambda quick: run(quick, ranks),
        "bench_sharded",
        __doc__.splitlines()[0],
    )


if __name__ == "__main__":
    main()
