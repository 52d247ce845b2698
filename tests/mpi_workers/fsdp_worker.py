"""Run by ``mpiexec -n N python fsdp_worker.py``: FSDP against DDP and one process.

Every ``check_*`` function is a plain function of the default process group, so the same checks
run on thread ranks (``rank_main``, see tests/thread_ranks.py), MPI or NCCL. The oracles: the
same model trained by :class:`~cupy_parallel.DistributedDataParallel` with the same optimizer
(the full parameters, step for step, to 1e-12 in float64), and a one-process run on the whole
batch with a plain Tape and the same optimizer. The model has the edges: rows not divisible by
the world size, a unit whose first dimension is smaller than it (a bias of one row), a 0-d
parameter, a zero-size one, a unit no rank reads, a unit read twice, and (in float64) a float32
parameter beside float64 ones.

``rank_main(rank, [mode])`` runs the checks of ``mode`` and prints ``rank r: N checks passed``
(1 on a failure): ``all`` (NumPy and host arrays), ``cupy`` (CuPy arrays on the rank's GPU:
NCCL thread ranks under ``simulated_cuda``). ``main()`` is ``rank_main`` under ``mpiexec``.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np
from common import run_checks  # this directory: the worker runs as a script

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.tree import tree_map
from cupy_parallel.optim import SGD, Adam

N = 24  # samples: divides evenly over 2, 3 and 4 ranks


class Setting(NamedTuple):
    kind: str = "cpu"  # cpu (NumPy), host (host:0) or cupy (the current GPU)
    dtype: str = "float64"

    def put(self, tree: Any) -> Any:
        return tree_map(lambda a: self._put(a) if cp.is_array(a) else a, tree)

    def _put(self, a: Any) -> Any:
        a = np.asarray(a, dtype=a.dtype if a.dtype == np.float32 else self.dtype)
        if self.kind == "cpu":
            return a
        if self.kind == "host":
            return cp.to_device(a, "host:0")
        from cupy_parallel._src.devices import cupy_module

        return cp.to_device(a, f"cuda:{cupy_module().cuda.Device().id}")

    @property
    def tol(self) -> float:
        return 1e-12 if self.dtype == "float64" else 2e-5

    def __str__(self) -> str:
        return f"{self.kind}/{self.dtype}"


F64 = Setting()


def raw_params(seed: int = 0, *, mixed: bool = True) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    params = {
        "l0": {"w": rng.normal(size=(5, 7)), "b": rng.normal(size=7), "act": "tanh"},
        "l1": {"w": rng.normal(size=(7, 3)), "b": rng.normal(size=3), "scale": np.array(1.5)},
        "l2": {"w": rng.normal(size=(3, 1)), "b": rng.normal(size=1), "z": np.zeros((0, 2))},
        "unused": {"w": rng.normal(size=(4, 2))},
    }
    if mixed:
        params["l1"]["b"] = params["l1"]["b"].astype(np.float32)
    return params


def model(units: Any, x: Any) -> Any:
    """Reads l0, l1, l2, then l0 again (a unit used twice); never reads "unused"."""
    l0 = units["l0"]
    h = ops.tanh(ops.add(ops.matmul(x, l0["w"]), l0["b"]))
    del l0
    l1 = units["l1"]
    h = ops.multiply(ops.tanh(ops.add(ops.matmul(h, l1["w"]), l1["b"])), l1["scale"])
    del l1
    l2 = units["l2"]
    out = ops.add(ops.add(ops.matmul(h, l2["w"]), l2["b"]), ops.sum(l2["z"]))
    del l2
    again = units["l0"]["b"]  # l0 read again, after other units
    return ops.add(out, ops.multiply(ops.sum(again), 0.01))


def plain_model(params: Any, x: Any) -> Any:
    return model(params, x)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.normal(size=(N, 5)), rng.normal(size=(N, 1))


def shard(x: Any) -> Any:
    r, w = dist.get_rank(), dist.get_world_size()
    return x[r * len(x) // w : (r + 1) * len(x) // w]


def loss_of(out: Any, y: Any) -> Any:
    return ops.mean(ops.square(ops.subtract(out, y)))


def numpy_of(a: Any) -> np.ndarray:
    """A NumPy copy of ``a`` (never a view: the parameters change in place later)."""
    return np.array(a.get() if hasattr(a, "get") else a, copy=True)


def close(actual: Any, expected: Any, what: str, tol: float) -> None:
    from cupy_parallel._src.tree import flatten_with_names

    names, got, _ = flatten_with_names(actual, what)
    _, want, _ = flatten_with_names(expected, what)
    for name, leaf_a, leaf_b in zip(names, got, want, strict=True):
        if not cp.is_array(leaf_b):
            assert leaf_a == leaf_b, (name, leaf_a, leaf_b)
            continue
        a, b = numpy_of(leaf_a), numpy_of(leaf_b)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        limit = max(tol, 2e-5) if np.float32 in (a.dtype, b.dtype) else tol  # mixed: float32
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        err = float(np.abs(a.astype(np.float64) - b).max(initial=0.0)) / scale
        assert err <= limit, f"{name}: relative error {err:.3g} > {limit:g}"


def train(
    make: str, s: Setting, optimizer: Any, steps: int, reshard: bool = True, *, mixed: bool = True
) -> list[Any]:
    """The full parameters after each of ``steps`` steps: ``fsdp``, ``ddp`` or ``one`` process.

    ``mixed``: one float32 parameter among float64 ones. Its gradient is rounded to float32 on
    each rank before the average (on the whole batch's gradient in one process), which moves
    the other parameters by ~1e-9 after a step: the one-process comparisons are all float64.
    """
    x, y = data()
    params = s.put(raw_params(mixed=mixed))
    if make == "one":
        xs, ys = s.put(x), s.put(y)
        arrays = params
        opt = optimizer(arrays)
        history = []
        for _ in range(steps):
            with cp.Tape() as tape:
                tape.watch(arrays)
                loss = loss_of(plain_model(arrays, xs), ys)
            opt.step(tape.gradient(loss, arrays))
            history.append(tree_map(lambda a: numpy_of(a) if cp.is_array(a) else a, arrays))
        return history
    xs, ys = s.put(shard(x)), s.put(shard(y))
    if make == "ddp":
        module: Any = cp.DistributedDataParallel(plain_model, params)
    else:
        module = cp.FullyShardedDataParallel(model, params, reshard_after_forward=reshard)
    opt = optimizer(module.params)
    history = []
    for _ in range(steps):
        with cp.Tape() as tape:
            loss = loss_of(module(xs), ys)
        opt.step(tape.gradient(loss, module.params))
        full = module.full_params() if make == "fsdp" else module.params
        history.append(tree_map(lambda a: numpy_of(a) if cp.is_array(a) else a, full))
    return history


class PlainSGD:
    """``p -= lr * g`` in place, written here (the update of the CuPy checks: optim's fused
    kernels are CuPy ElementwiseKernel objects, which ``simulated_cuda`` does not have)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        self.params, self.lr = params, lr

    def step(self, grads: Any) -> None:
        for unit, tree in self.params.items():  # the model's dict of dicts
            for name, p in tree.items():
                if cp.is_array(p):
                    p[...] = p - self.lr * grads[unit][name]


def check_plain_sgd_equals_ddp_and_one_process(s: Setting = F64) -> None:
    """A hand-written SGD update on the shards, 3 steps, both oracles (CuPy too)."""
    ddp = train("ddp", s, PlainSGD, 3, mixed=False)
    one = train("one", s, PlainSGD, 3, mixed=False)
    for reshard in (True, False):
        fsdp = train("fsdp", s, PlainSGD, 3, reshard, mixed=False)
        for step, (a, b, c) in enumerate(zip(fsdp, ddp, one, strict=True)):
            close(a, b, f"plain sgd(reshard={reshard}) vs ddp, step {step}", s.tol)
            close(a, c, f"plain sgd(reshard={reshard}) vs one process, step {step}", s.tol)


def _adam(params: Any) -> Any:
    return Adam(params, lr=0.05)


def _sgd(params: Any) -> Any:
    return SGD(params, lr=0.1, momentum=0.9)


def raises_everywhere(error: type[Exception], match: str, call: Any) -> str:
    try:
        call()
    except error as caught:
        message = str(caught)
    else:
        raise AssertionError(f"no {error.__name__} ({match!r})")
    assert match in message, f"{message!r} lacks {match!r}"
    return message


def check_equals_ddp_and_one_process_step_for_step(s: Setting = F64) -> None:
    """FSDP (both reshard modes) + Adam, 3 steps: DDP + Adam's parameters, one process's.

    Against DDP to ``s.tol`` (1e-12 in float64); against the one-process run on the whole batch
    to 1e-9: the batch mean is summed in another order there (1e-16), which Adam's
    ``m / sqrt(v)`` amplifies where a gradient is small (measured: 5.6e-11 after two steps, for
    DDP as for FSDP). SGD's check holds the one-process run to ``s.tol``. The one-process runs
    are all float64 (see :func:`train`).
    """
    ddp = train("ddp", s, _adam, 3)
    one = train("one", s, _adam, 3, mixed=False)
    for reshard in (True, False):
        fsdp = train("fsdp", s, _adam, 3, reshard)
        for step, (a, b) in enumerate(zip(fsdp, ddp, strict=True)):
            close(a, b, f"fsdp(reshard={reshard}) vs ddp, step {step}", s.tol)
        fsdp = train("fsdp", s, _adam, 3, reshard, mixed=False)
        for step, (a, c) in enumerate(zip(fsdp, one, strict=True)):
            close(a, c, f"fsdp(reshard={reshard}) vs one process, step {step}", max(s.tol, 1e-9))


def check_sgd_momentum_equals_ddp_and_one_process(s: Setting = F64) -> None:
    """Another optimizer, unchanged on shards: SGD with momentum, 3 steps, both oracles."""
    ddp, one = train("ddp", s, _sgd, 3, mixed=False), train("one", s, _sgd, 3, mixed=False)
    for reshard in (True, False):
        fsdp = train("fsdp", s, _sgd, 3, reshard, mixed=False)
        for step, (a, b, c) in enumerate(zip(fsdp, ddp, one, strict=True)):
            close(a, b, f"sgd(reshard={reshard}) vs ddp, step {step}", s.tol)
            close(a, c, f"sgd(reshard={reshard}) vs one process, step {step}", s.tol)


def check_gradient_shards_are_ddp_rows(s: Setting = F64) -> None:
    """tape.gradient(loss, fsdp.params): this rank's rows of DDP's averaged gradient, padded."""
    x, y = data()
    xs, ys = s.put(shard(x)), s.put(shard(y))
    ddp = cp.DistributedDataParallel(plain_model, s.put(raw_params()))
    with cp.Tape() as tape:
        loss = loss_of(ddp(xs), ys)
    full = tape.gradient(loss, ddp.params)
    fsdp = cp.FullyShardedDataParallel(model, s.put(raw_params()))
    with cp.Tape() as tape:
        loss = loss_of(fsdp(xs), ys)
    grads = tape.gradient(loss, fsdp.params, unconnected_gradients="none")
    r, w = dist.get_rank(), dist.get_world_size()
    for unit, tree in grads.items():
        for name, g in tree.items():
            if not cp.is_array(g):
                continue
            want = numpy_of(full[unit][name]).reshape(-1, *numpy_of(full[unit][name]).shape[1:])
            if want.ndim == 0:
                want = want.reshape(1)
            c = -(-len(want) // w)
            rows = np.zeros((c, *want.shape[1:]))
            part = want[r * c : (r + 1) * c]
            rows[: len(part)] = part
            assert numpy_of(g).shape == rows.shape, (unit, name, g.shape, rows.shape)
            assert type(g) is type(fsdp.params[unit][name]), (unit, name, type(g))
            close(g, rows, f"grad {unit}.{name}", s.tol)


def check_clip_grad_norm_over_the_shards(s: Setting = F64) -> None:
    """clip_grad_norm(process_group=) of the gradient shards: DDP's whole gradients' norm.

    For p > 0 and inf (the padding rows are zero gradients, which add nothing).
    """
    x, y = data()
    xs, ys = s.put(shard(x)), s.put(shard(y))
    ddp = cp.DistributedDataParallel(plain_model, s.put(raw_params(mixed=False)))
    with cp.Tape() as tape:
        loss = loss_of(ddp(xs), ys)
    whole = tape.gradient(loss, ddp.params)
    fsdp = cp.FullyShardedDataParallel(model, s.put(raw_params(mixed=False)))
    with cp.Tape() as tape:
        loss = loss_of(fsdp(xs), ys)
    shards = tape.gradient(loss, fsdp.params)
    group = dist.group.WORLD
    for p in (2.0, 1.0, float("inf")):
        _, want = cp.clip_grad_norm(whole, 0.5, p)
        clipped, total = cp.clip_grad_norm(shards, 0.5, p, process_group=group)
        close(total, want, f"total {p}-norm", s.tol)
        r, w = dist.get_rank(), dist.get_world_size()
        c = -(-5 // w)
        rows = np.zeros((c, 7))
        scale = min(1.0, 0.5 / (float(want) + 1e-6))
        part = numpy_of(whole["l0"]["w"])[r * c : (r + 1) * c] * scale
        rows[: len(part)] = part
        close(clipped["l0"]["w"], rows, f"clipped l0.w ({p})", s.tol)


class _Logged(cp.Function):
    """The identity, logging when its backward runs (the unit's backward computation)."""

    @staticmethod
    def forward(ctx: Any, x: Any, log: list[Any], tag: Any) -> Any:
        ctx.log, ctx.tag = log, tag
        log.append(("forward compute", tag))
        return x.copy()

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        ctx.log.append(("backward compute", ctx.tag))
        return g, None, None


def check_order_of_events(s: Setting = F64) -> None:
    """Forward: unit k+1's all-gather issued before unit k computes (prefetch). Backward: unit
    k's reduce-scatter issued as soon as its gradients are summed, and waited while the pass goes
    on (unit k-1's backward computation, here a Function logging it, runs first); with
    FULL_SHARD it is waited once unit k-1's all-gather is issued, before that unit's arrays are
    unpacked (so the pass holds two units' buffers at most).
    """
    log: list[Any] = []

    def chain(units: Any, x: Any) -> Any:
        h = x
        for i in range(4):
            h = _Logged.apply(ops.matmul(h, units[i]), log, i)
        return h

    rng = np.random.default_rng(3)
    units = [s.put(rng.normal(size=(3, 3))) for _ in range(4)]
    for reshard in (True, False):
        fsdp = cp.FullyShardedDataParallel(chain, units, reshard_after_forward=reshard)
        log.clear()
        fsdp._trace = log
        with cp.Tape() as tape:
            loss = ops.sum(fsdp(s.put(np.ones((2, 3)))))
        tape.gradient(loss, fsdp.params)
        at = {e: i for i, e in enumerate(log)}
        assert at[("all_gather issued", 0)] < at[("prefetch issued", 1)], log
        for k in range(3):
            assert at[("prefetch issued", k + 1)] < at[("forward compute", k)], log
            assert at[("backward compute", k + 1)] < at[("reduce_scatter issued", k + 1)], log
            assert at[("reduce_scatter issued", k + 1)] < at[("reduce_scatter waited", k + 1)], log
            assert at[("backward compute", k)] < at[("reduce_scatter waited", k + 1)], log
            if reshard:  # waited when unit k is gathered again, before its arrays are unpacked
                assert at[("regather issued", k)] < at[("reduce_scatter waited", k + 1)], log
                assert at[("reduce_scatter waited", k + 1)] < at[("reduce_scatter issued", k)]
        regathers = [e for e in log if e[0] == "regather issued"]
        assert regathers == ([("regather issued", k) for k in (3, 2, 1, 0)] if reshard else []), log


def check_resharding_frees_memory(s: Setting = F64) -> None:
    """Host arrays: after the forward pass FULL_SHARD holds the shards, SHARD_GRAD_OP the units.

    Measured with the host memory pool, which a process's thread ranks share: each figure is
    the bytes the ranks hold together (barriers around the forward pass).
    """
    if s.kind != "host":
        return
    pool = cp.get_host_memory_pool()
    rng = np.random.default_rng(4)
    raw = [rng.normal(size=(256, 256)) for _ in range(4)]  # 512 KiB a unit (pooled)

    def chain(units: Any, x: Any) -> Any:
        h = x
        for i in range(len(raw)):
            h = ops.tanh(ops.matmul(h, units[i]))
        return h

    held = {}
    for reshard in (True, False):
        units = [s.put(a) for a in raw]
        fsdp = cp.FullyShardedDataParallel(chain, units, reshard_after_forward=reshard)
        del units
        x = s.put(rng.normal(size=(2, 256)))
        dist.barrier()
        before = pool.used_bytes()
        dist.barrier()
        with cp.Tape() as tape:
            loss = ops.sum(fsdp(x))
        dist.barrier()
        held[reshard] = pool.used_bytes() - before
        dist.barrier()
        tape.gradient(loss, fsdp.params)
        del tape, loss, fsdp
    unit_bytes = 256 * 256 * 8
    assert held[True] < unit_bytes // 4, held  # no unit (the activations are not pooled)
    assert held[False] >= len(raw) * unit_bytes, held  # every unit (of every thread rank)


def check_a_unit_fn_keeps_stays_gathered(s: Setting = F64) -> None:
    """A gathered array fn returns (or keeps) is not swapped out: its later use is recorded."""
    rng = np.random.default_rng(5)
    raw = [rng.normal(size=(3, 3)) for _ in range(3)]
    kept: list[Any] = []

    def fn(units: Any, x: Any) -> Any:
        h = ops.matmul(x, units[0])
        kept.append(units[1])
        h = ops.matmul(h, units[1])
        return ops.matmul(h, units[2]), units[2]

    x = np.ones((2, 3))
    fsdp = cp.FullyShardedDataParallel(fn, [s.put(a) for a in raw])
    with cp.Tape() as tape:
        out, w2 = fsdp(s.put(x))
        loss = ops.add(ops.sum(out), ops.sum(ops.square(w2)))
        loss = ops.add(loss, ops.sum(kept[0]))
    grads = tape.gradient(loss, fsdp.params)
    full = [np.asarray(a) for a in raw]
    params = [a.copy() for a in full]
    with cp.Tape() as t:
        t.watch(params)
        h = ops.matmul(ops.matmul(x, params[0]), params[1])
        one = ops.add(ops.sum(ops.matmul(h, params[2])), ops.sum(ops.square(params[2])))
        one = ops.add(one, ops.sum(params[1]))
    want = t.gradient(one, params)
    r, w = dist.get_rank(), dist.get_world_size()
    c = -(-3 // w)
    for g, full_g in zip(grads, want, strict=True):
        rows = np.zeros((c, 3))
        part = full_g[r * c : (r + 1) * c]
        rows[: len(part)] = part
        close(g, rows, "kept unit", s.tol)


def check_full_params_and_sharded_params(s: Setting = F64) -> None:
    params = s.put(raw_params())
    fsdp = cp.FullyShardedDataParallel(model, params)
    want = tree_map(lambda a: numpy_of(a) if cp.is_array(a) else a, s.put(raw_params()))
    close(fsdp.full_params(), want, "full_params", 0.0)
    got = fsdp.full_params(to=dist.get_world_size() - 1)
    if dist.get_rank() == dist.get_world_size() - 1:
        close(got, want, "full_params(to=last)", 0.0)
    else:
        assert got is None, got
    sharded = fsdp.sharded_params()
    w_shard = sharded["l0"]["w"]
    assert w_shard.global_shape == (5, 7), w_shard
    assert sharded["l1"]["scale"].global_shape == (1,), sharded["l1"]["scale"]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (w_shard.offset, numpy_of(w_shard.local)))
    rows = np.concatenate([local for _, local in sorted(gathered, key=lambda t: t[0])])
    close(rows, want["l0"]["w"], "sharded_params rows", 0.0)


def check_every_dtype_and_shape_round_trips_bit_exactly(s: Setting = F64) -> None:
    """full_params and sharded_params give back the values passed, bit for bit.

    float16/32/64 and complex64/128; 0-d, zero-size, fewer rows than ranks, rows not divisible.
    """
    rng = np.random.default_rng(9)
    shapes = [(), (0,), (1,), (3,), (7, 2), (5, 0), (2, 3, 4)]
    dtypes = ["float16", "float32", "float64", "complex64", "complex128"]
    params = {}
    for d in dtypes:
        for k, shape in enumerate(shapes):
            a = rng.normal(size=shape) + (1j * rng.normal(size=shape) if "complex" in d else 0)
            params[f"{d}_{k}"] = {"a": np.asarray(a).astype(d)}
    placed = tree_map(lambda a: a if s.kind == "cpu" else _keep_dtype(a, s), params)
    fsdp = cp.FullyShardedDataParallel(lambda u, x: x, placed)
    full = fsdp.full_params()
    sharded = fsdp.sharded_params()
    for name, unit in params.items():
        got = numpy_of(full[name]["a"])
        want = unit["a"]
        assert got.dtype == want.dtype, (name, got.dtype)
        assert got.shape == want.shape, (name, got.shape)
        assert got.tobytes() == want.tobytes(), name
        piece = sharded[name]["a"]
        rows = numpy_of(piece.local)
        flat = want.reshape(1) if want.ndim == 0 else want
        assert rows.tobytes() == flat[piece.offset : piece.offset + len(rows)].tobytes(), name


def _keep_dtype(a: np.ndarray, s: Setting) -> Any:
    if s.kind == "host":
        return cp.to_device(a, "host:0")
    from cupy_parallel._src.devices import cupy_module

    return cp.to_device(a, f"cuda:{cupy_module().cuda.Device().id}")


def check_complex_parameters_equal_ddp(s: Setting = F64) -> None:
    """A complex128 weight: its gradient shards are DDP's rows (PyTorch's convention)."""
    rng = np.random.default_rng(10)
    w = (rng.normal(size=(5, 3)) + 1j * rng.normal(size=(5, 3))).astype(np.complex128)
    x = shard(rng.normal(size=(N, 5)))

    def fn(units: Any, x: Any) -> Any:
        return ops.sum(ops.abs(ops.matmul(x, units["c"]["w"])))

    ddp = cp.DistributedDataParallel(fn, {"c": {"w": w.copy()}})
    with cp.Tape() as tape:
        loss = ddp(x)
    whole = numpy_of(tape.gradient(loss, ddp.params)["c"]["w"])
    fsdp = cp.FullyShardedDataParallel(fn, {"c": {"w": w.copy()}})
    with cp.Tape() as tape:
        loss = fsdp(x)
    got = numpy_of(tape.gradient(loss, fsdp.params)["c"]["w"])
    r, world = dist.get_rank(), dist.get_world_size()
    c = -(-5 // world)
    rows = np.zeros((c, 3), np.complex128)
    part = whole[r * c : (r + 1) * c]
    rows[: len(part)] = part
    np.testing.assert_allclose(got, rows, rtol=1e-12, atol=1e-14)


def check_on_a_subgroup(s: Setting = F64) -> None:
    """FSDP over ``new_group([1, 2])`` (group ranks differ from world ranks): DDP's parameters
    on the same group, after two SGD steps; full_params(to=2) reaches world rank 2 only."""
    if dist.get_world_size() < 3:
        return
    group = dist.new_group([1, 2])
    if dist.get_rank() not in (1, 2):
        return
    x, y = data()
    r = dist.get_rank() - 1
    xs, ys = s.put(x[r * N // 2 : (r + 1) * N // 2]), s.put(y[r * N // 2 : (r + 1) * N // 2])
    ddp = cp.DistributedDataParallel(plain_model, s.put(raw_params()), process_group=group)
    fsdp = cp.FullyShardedDataParallel(model, s.put(raw_params()), process_group=group)
    for module in (ddp, fsdp):
        optimizer = PlainSGD(module.params)
        for _ in range(2):
            with cp.Tape() as tape:
                loss = loss_of(module(xs), ys)
            optimizer.step(tape.gradient(loss, module.params))
    close(fsdp.full_params(), ddp.params, "subgroup", s.tol)
    to_two = fsdp.full_params(to=2)
    if dist.get_rank() == 2:
        close(to_two, ddp.params, "subgroup, to=2", s.tol)
    else:
        assert to_two is None, to_two


def check_mismatched_params_raise_on_every_rank(s: Setting = F64) -> None:
    params = s.put(raw_params())
    if dist.get_rank() == 1:
        params["l2"]["w"] = s.put(np.zeros((4, 1)))
    raises_everywhere(
        ValueError,
        "rank 1's differ from rank 0's (params['l2']['w']: shape (3, 1)",
        lambda: cp.FullyShardedDataParallel(model, params),
    )


def check_second_derivative_refused(s: Setting = F64) -> None:
    fsdp = cp.FullyShardedDataParallel(
        lambda u, x: ops.sum(ops.square(ops.matmul(x, u[0]))), [s.put(np.ones((2, 2)))]
    )
    with cp.Tape() as outer:
        outer.watch(fsdp.params)
        with cp.Tape() as inner:
            loss = fsdp(s.put(np.ones((1, 2))))
        raises_everywhere(
            NotImplementedError,
            "cannot be differentiated again",
            lambda: inner.gradient(loss, fsdp.params),
        )


def check_large_shards_beside_small_ones_equal_ddp_and_one_process(s: Setting = F64) -> None:
    """A unit whose weight's shard is 64 KiB or more (on 2 to 4 ranks), beside a bias and a
    padded parameter (33 rows), and a unit of one parameter: the MPI backend receives the large
    shard in its own message straight into the gathered buffer, the small ones packed. FSDP
    (both reshard modes) + SGD with momentum, 2 steps: DDP's parameters and one process's."""
    rng = np.random.default_rng(11)
    raw = {
        "a": {
            "w": rng.normal(size=(64, 512)) / 8,
            "b": rng.normal(size=512),
            "v": rng.normal(size=(33, 5)),
        },
        "head": {"w": rng.normal(size=(512, 1)) / 20},
    }
    x, y = rng.normal(size=(N, 64)), rng.normal(size=(N, 1))

    def net(units: Any, x: Any) -> Any:
        a = units["a"]
        h = ops.tanh(ops.add(ops.matmul(x, a["w"]), a["b"]))
        h = ops.multiply(h, ops.mean(a["v"]))
        del a
        return ops.matmul(h, units["head"]["w"])

    def run(make: str, reshard: bool = True) -> list[Any]:
        params = s.put(tree_map(np.copy, raw))
        xs, ys = (s.put(x), s.put(y)) if make == "one" else (s.put(shard(x)), s.put(shard(y)))
        if make == "one":
            module: Any = None
        elif make == "ddp":
            module = cp.DistributedDataParallel(net, params)
        else:
            module = cp.FullyShardedDataParallel(net, params, reshard_after_forward=reshard)
        trained = params if module is None else module.params
        opt = _sgd(trained)
        history = []
        for _ in range(2):
            with cp.Tape() as tape:
                if module is None:
                    tape.watch(trained)
                    loss = loss_of(net(trained, xs), ys)
                else:
                    loss = loss_of(module(xs), ys)
            opt.step(tape.gradient(loss, trained))
            full = module.full_params() if make == "fsdp" else trained
            history.append(tree_map(numpy_of, full))
        return history

    ddp, one = run("ddp"), run("one")
    for reshard in (True, False):
        for step, (a, b, c) in enumerate(zip(run("fsdp", reshard), ddp, one, strict=True)):
            close(a, b, f"large shards (reshard={reshard}) vs ddp, step {step}", s.tol)
            close(a, c, f"large shards (reshard={reshard}) vs one process, step {step}", s.tol)


CHECKS: list[tuple[Any, Setting]] = [
    (check_equals_ddp_and_one_process_step_for_step, F64),
    (check_equals_ddp_and_one_process_step_for_step, Setting("host")),
    (check_equals_ddp_and_one_process_step_for_step, Setting("cpu", "float32")),
    (check_sgd_momentum_equals_ddp_and_one_process, F64),
    (check_plain_sgd_equals_ddp_and_one_process, Setting("host")),
    (check_gradient_shards_are_ddp_rows, F64),
    (check_clip_grad_norm_over_the_shards, F64),
    (check_gradient_shards_are_ddp_rows, Setting("host")),
    (check_order_of_events, F64),
    (check_resharding_frees_memory, Setting("host")),
    (check_a_unit_fn_keeps_stays_gathered, F64),
    (check_full_params_and_sharded_params, F64),
    (check_full_params_and_sharded_params, Setting("host")),
    (check_every_dtype_and_shape_round_trips_bit_exactly, F64),
    (check_every_dtype_and_shape_round_trips_bit_exactly, Setting("host")),
    (check_complex_parameters_equal_ddp, F64),
    (check_on_a_subgroup, F64),
    (check_mismatched_params_raise_on_every_rank, F64),
    (check_second_derivative_refused, F64),
    (check_large_shards_beside_small_ones_equal_ddp_and_one_process, F64),
    (check_large_shards_beside_small_ones_equal_ddp_and_one_process, Setting("host")),
]
CUPY_CHECKS: list[tuple[Any, Setting]] = [
    # optim's fused kernels (cupy.ElementwiseKernel) have no simulated_cuda counterpart
    (check_plain_sgd_equals_ddp_and_one_process, Setting("cupy")),
    (check_gradient_shards_are_ddp_rows, Setting("cupy")),
    (check_order_of_events, Setting("cupy")),
    (check_full_params_and_sharded_params, Setting("cupy")),
    (check_every_dtype_and_shape_round_trips_bit_exactly, Setting("cupy")),
]


def main() -> int:
    return rank_main(-1, sys.argv[1:])


def rank_main(rank: int, argv: list[str]) -> int:
    """One rank's program (``rank`` is unused: the world says); see the module."""
    mode = argv[0] if argv else "all"
    return run_checks(lambda: [(c, (s,)) for c, s in (CHECKS if mode == "all" else CUPY_CHECKS)])


if __name__ == "__main__":
    sys.exit(main())
