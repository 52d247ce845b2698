"""Run by ``mpiexec -n N python ddp_worker.py``: DistributedDataParallel against one process.

Every ``check_*`` function is a plain function of the default process group (it reads only
``dist.get_rank()``/``dist.get_world_size()``, no process-wide state), so the same checks can
run on thread ranks. Each rank computes the one-process oracle itself, with a plain Tape on the
whole batch, and the DDP gradient from its shard; a failure raises ``AssertionError``.
``main()`` runs them all under MPI, prints ``rank r: N checks passed`` and exits 1 on a failure.
"""

from __future__ import annotations

import itertools
import sys
import traceback
from typing import Any

import numpy as np

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks

N = 36  # samples: divides evenly over 2, 3 and 4 ranks
SIZES = [7, 13, 5, 11, 1]  # uneven layers
TINY_CAP = 400 / 2**20  # ~400 bytes: several buckets for this small model


def make_params(seed: int = 0, to_host: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    layers = [
        {"w": rng.normal(size=(a, b)) / np.sqrt(a), "b": rng.normal(size=b)}
        for a, b in itertools.pairwise(SIZES)
    ]
    params: dict[str, Any] = {
        "layers": layers,
        "unused": rng.normal(size=(3, 4)),
        "extra": rng.normal(size=SIZES[0]),
        "act": "tanh",
    }
    if to_host:
        return cp._src.tree.tree_map(
            lambda a: cp.to_device(a, "host:0") if cp.is_array(a) else a, params
        )
    return params


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, SIZES[0])), rng.normal(size=(N, 1))


def mlp(params: dict[str, Any], x: Any, *, extra: bool = False) -> Any:
    h = x
    layers = params["layers"]
    for k, layer in enumerate(layers):
        h = ops.add(ops.matmul(h, layer["w"]), layer["b"])
        if k < len(layers) - 1:
            h = ops.tanh(h)
    if extra:  # a parameter only some ranks' steps use
        h = ops.add(h, ops.sum(ops.multiply(x, params["extra"]), axis=1, keepdims=True))
    return h


def loss_of(params: dict[str, Any], x: Any, y: Any, *, extra: bool = False) -> Any:
    return ops.mean(ops.square(ops.subtract(mlp(params, x, extra=extra), y)))


def shard(x: Any, rank: int | None = None, world: int | None = None) -> Any:
    return x[dist.shard_indices(len(x), rank=rank, world_size=world, seed=3)]


def oracle(params: dict[str, Any], *, extra_on: tuple[int, ...] = ()) -> Any:
    """The one-process gradient: the whole batch, or the mean of the ranks' shard losses."""
    x, y = data()
    world = dist.get_world_size()
    with cp.Tape() as tape:
        tape.watch(params)
        if not extra_on:
            loss = loss_of(params, x, y)
        else:
            losses = [
                loss_of(params, shard(x, r, world), shard(y, r, world), extra=r in extra_on)
                for r in range(world)
            ]
            loss = ops.divide(ops.sum(ops.stack(losses)), float(world))
    return tape.gradient(loss, params)


def numpy_of(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else cp.to_device(a, "cpu")


def close(actual: Any, expected: Any, what: str, tol: float = 1e-12) -> None:
    a_leaves = cp._src.tree.leaves(actual)
    e_leaves = cp._src.tree.leaves(expected)
    assert len(a_leaves) == len(e_leaves), what
    for k, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if not cp.is_array(e):
            assert a == e, f"{what}: leaf {k} is {a!r}, expected {e!r}"
            continue
        got, want = numpy_of(a), numpy_of(e)
        assert got.shape == want.shape, f"{what}: leaf {k} shape {got.shape} vs {want.shape}"
        error = np.max(np.abs(got - want), initial=0.0)
        assert error <= tol * max(1.0, np.max(np.abs(want), initial=0.0)), (
            f"{what}: leaf {k} differs by {error:g}"
        )


def equal_on_every_rank(tree: Any, what: str) -> None:
    mine = [numpy_of(a) for a in cp._src.tree.leaves(tree) if cp.is_array(a)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, theirs in enumerate(gathered):
        for a, b in zip(mine, theirs, strict=True):
            assert np.array_equal(a, b), f"{what}: rank {rank} differs"


def raises_everywhere(error: type[Exception], match: str, call: Any) -> str:
    try:
        call()
    except error as caught:
        message = str(caught)
    else:
        raise AssertionError(f"no {error.__name__} ({match!r})")
    assert match in message, f"{message!r} lacks {match!r}"
    return message


# --------------------------------------------------------------------------------------------
# The checks


def check_broadcast_at_construction() -> None:
    rank = dist.get_rank()
    params = make_params(seed=rank)  # every rank starts different
    leaf = params["layers"][0]["w"]
    ddp = cp.DistributedDataParallel(mlp, params)
    assert ddp.params is params  # in place
    assert params["layers"][0]["w"] is leaf
    close(params, make_params(seed=0), "params after construction", tol=0.0)
    mine = make_params(seed=rank)
    cp.DistributedDataParallel(mlp, mine, broadcast_params=False)
    close(mine, make_params(seed=rank), "broadcast_params=False", tol=0.0)


def _ddp_gradient(ddp: Any, *, extra_on: tuple[int, ...] = (), to_host: bool = False) -> Any:
    x, y = data()
    if to_host:
        x, y = cp.to_device(x, "host:0"), cp.to_device(y, "host:0")
    rank = dist.get_rank()
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(shard(x), extra=rank in extra_on), shard(y))))
    return tape.gradient(loss, ddp.params)


def check_gradient_equals_one_process(to_host: bool = False) -> None:
    params = make_params(to_host=to_host)
    ddp = cp.DistributedDataParallel(mlp, params, bucket_cap_mb=TINY_CAP)
    assert len(ddp._buckets) >= 4, ddp._buckets
    grads = _ddp_gradient(ddp, to_host=to_host)
    expected = oracle(make_params())
    close(grads, expected, f"DDP gradient ({'host' if to_host else 'numpy'} arrays)")
    assert not np.any(numpy_of(grads["unused"])), "an unused parameter gets zeros"
    if to_host:
        assert all(type(g) is cp.HostArray for g in cp._src.tree.leaves(grads) if g is not None), (
            "host gradients for host parameters"
        )
    equal_on_every_rank(grads, "DDP gradient")


def check_rank_dependent_unused_parameter() -> None:
    ddp = cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=TINY_CAP)
    grads = _ddp_gradient(ddp, extra_on=(0,))  # only rank 0's step uses params["extra"]
    close(grads, oracle(make_params(), extra_on=(0,)), "gradient of a rank-0-only parameter")
    assert np.any(grads["extra"]), "rank 0's gradient reaches every rank"


def check_default_bucket_cap_and_several_steps() -> None:
    """One bucket (25 MiB): two steps; the first step's gradients stay as they were."""
    ddp = cp.DistributedDataParallel(mlp, make_params())
    assert len(ddp._buckets) == 1
    first = _ddp_gradient(ddp)
    kept = cp._src.tree.tree_map(lambda g: g.copy() if g is not None else None, first)
    second = _ddp_gradient(ddp)
    close(second, oracle(make_params()), "second step")
    close(first, kept, "a gradient kept from step one", tol=0.0)


def check_persistent_tape_and_two_forwards() -> None:
    ddp = cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=TINY_CAP)
    x, y = data()
    xs, ys = shard(x), shard(y)
    half = len(xs) // 2
    with cp.Tape(persistent=True) as tape:  # two forward calls, one loss, one reduction
        a = ops.sum(ops.square(ops.subtract(ddp(xs[:half]), ys[:half])))
        b = ops.sum(ops.square(ops.subtract(ddp(xs[half:]), ys[half:])))
        loss = ops.divide(ops.add(a, b), float(len(xs)))
    expected = oracle(make_params())
    close(tape.gradient(loss, ddp.params), expected, "two forwards, persistent tape, pass 1")
    close(tape.gradient(loss, ddp.params), expected, "persistent tape, pass 2")


def check_functional_update_training() -> None:
    """Three SGD steps with ddp.params replaced each step equal three one-process steps."""
    lr = 0.1
    ddp = cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=TINY_CAP)
    reference = make_params()

    def step(p: Any, g: Any) -> Any:
        return cp._src.tree.tree_map(lambda a: a, p) | {
            "layers": [
                {k: layer[k] - lr * gl[k] for k in layer}
                for layer, gl in zip(p["layers"], g["layers"], strict=True)
            ],
            "extra": p["extra"] - lr * g["extra"],
            "unused": p["unused"] - lr * g["unused"],
        }

    for _ in range(3):
        ddp.params = step(ddp.params, _ddp_gradient(ddp))
        reference = step(reference, oracle(reference))
    close(ddp.params, reference, "params after three steps", tol=1e-11)


def check_no_sync_accumulation() -> None:
    k = 3
    ddp = cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=TINY_CAP)
    x, y = data()
    xs, ys = shard(x), shard(y)
    total = None
    with ddp.no_sync():
        for chunk in range(k):
            part = slice(chunk * len(xs) // k, (chunk + 1) * len(xs) // k)
            with cp.Tape() as tape:
                loss = ops.mean(ops.square(ops.subtract(ddp(xs[part]), ys[part])))
            g = tape.gradient(loss, ddp.params)
            total = g if total is None else _add(total, g)
    local = _scale(total, 1.0 / k)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, np.asarray(local["layers"][0]["w"]))
    assert not all(np.array_equal(gathered[0], g) for g in gathered[1:]), "no_sync is local"
    reduced = ddp.reduce_gradients(local)
    close(reduced, oracle(make_params()), "no_sync accumulation + reduce_gradients")
    close(local, _scale(total, 1.0 / k), "reduce_gradients leaves its input alone", tol=0.0)


def _add(a: Any, b: Any) -> Any:
    return _zip_map(lambda u, v: u + v, a, b)


def _scale(a: Any, s: float) -> Any:
    return _zip_map(lambda u, _: u * s, a, a)


def _zip_map(f: Any, a: Any, b: Any) -> Any:
    _, la, spec = cp._src.tree.flatten(a)
    lb = cp._src.tree.leaves(b)
    return spec.unflatten([f(u, v) if u is not None else None for u, v in zip(la, lb, strict=True)])


def check_first_bucket_starts_during_backward() -> None:
    events: list[str] = []

    class Probe(cp.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.copy()

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            events.append("probe")  # runs before the first layer's gradients are final
            return g

    def logged(state: Any, bucket: Any) -> Any:
        events.append(f"start {bucket.index()}")
        return default_hooks.allreduce_hook(state, bucket)

    def probed(params: Any, x: Any) -> Any:
        first = params["layers"][0]
        h = ops.tanh(Probe.apply(ops.add(ops.matmul(x, first["w"]), first["b"])))
        return mlp({"layers": params["layers"][1:]}, h)

    ddp = cp.DistributedDataParallel(probed, make_params(), bucket_cap_mb=TINY_CAP)
    ddp.register_comm_hook(None, logged)
    x, y = data()
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(shard(x)), shard(y))))
    events.append("forward done")
    grads = tape.gradient(loss, ddp.params)
    events.append("gradient returned")
    close(grads, oracle(make_params()), "gradient with a logging comm hook")
    count = len(ddp._buckets)
    assert events[0] == "forward done", events
    assert events.index("start 0") < events.index("probe"), events
    assert events.index("probe") < events.index(f"start {count - 1}"), events
    assert [e for e in events if e.startswith("start")] == [f"start {k}" for k in range(count)]
    raises_everywhere(
        RuntimeError, "only be called once", lambda: ddp.register_comm_hook(None, logged)
    )


def check_comm_hooks() -> None:
    world = dist.get_world_size()
    expected = oracle(make_params())
    ddp = cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=TINY_CAP)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    grads = _ddp_gradient(ddp)
    close(grads, expected, "fp16_compress_hook", tol=2e-3)
    equal_on_every_rank(grads, "fp16_compress_hook")
    raises_everywhere(
        RuntimeError, "only be called once", lambda: ddp.register_comm_hook(None, print)
    )
    used = cp.DistributedDataParallel(mlp, make_params())
    _ddp_gradient(used)
    raises_everywhere(
        RuntimeError, "before the first backward", lambda: used.register_comm_hook(None, print)
    )

    def threaded(state: Any, bucket: Any) -> Any:  # Work.get_future(): a helper thread waits
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda f: f.value()[0] / world)

    ddp = cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=TINY_CAP)
    ddp.register_comm_hook("state", threaded)
    close(_ddp_gradient(ddp), expected, "a hook returning Work.get_future()")

    ddp = cp.DistributedDataParallel(mlp, make_params())
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        raises_everywhere(
            RuntimeError,
            "install ml_dtypes",
            lambda: ddp.register_comm_hook(None, default_hooks.bf16_compress_hook),
        )


def check_mismatched_params_raise_on_every_rank() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = world - 1  # the last rank differs
    params = make_params()
    if rank == odd:
        params["layers"][1]["w"] = np.zeros((13, 6))
    message = raises_everywhere(
        ValueError, "differ across the ranks", lambda: cp.DistributedDataParallel(mlp, params)
    )
    assert f"rank {odd}" in message, message
    assert "['w']" in message, message
    params = make_params()
    if rank == odd:
        params["extra"] = np.arange(7)
    message = raises_everywhere(
        TypeError, "floating-point", lambda: cp.DistributedDataParallel(mlp, params)
    )
    assert f"On rank {odd}" in message, message
    ddp = cp.DistributedDataParallel(mlp, make_params())
    grads = oracle(make_params())
    if rank == odd:
        grads["layers"][2]["b"] = np.zeros(3)
    message = raises_everywhere(
        ValueError, "grads['layers'][2]['b']", lambda: ddp.reduce_gradients(grads)
    )
    assert f"On rank {odd}" in message, message
    cap = TINY_CAP if rank == odd else 25.0
    raises_everywhere(
        ValueError,
        "differ across the ranks",
        lambda: cp.DistributedDataParallel(mlp, make_params(), bucket_cap_mb=cap),
    )


def check_second_derivative_refused() -> None:
    ddp = cp.DistributedDataParallel(mlp, make_params())
    x, y = data()
    with cp.Tape() as outer:
        with cp.Tape() as inner:
            loss = ops.mean(ops.square(ops.subtract(ddp(shard(x)), shard(y))))
        raises_everywhere(
            NotImplementedError, "differentiated again", lambda: inner.gradient(loss, ddp.params)
        )
    del outer
    # the DDP is still usable: the next step's tape reduces as before
    close(_ddp_gradient(ddp), oracle(make_params()), "a step after the refused pass")


def check_mixed_dtypes_one_bucket_each() -> None:
    rng = np.random.default_rng(5)

    def make() -> dict[str, Any]:
        return {
            "a": rng.normal(size=(SIZES[0], 3)).astype(np.float32),
            "b": np.random.default_rng(6).normal(size=(3, 1)),
        }

    def fn(p: dict[str, Any], x: Any) -> Any:
        return ops.matmul(ops.tanh(ops.matmul(x.astype(np.float32), p["a"])), p["b"])

    rng = np.random.default_rng(5)
    ddp = cp.DistributedDataParallel(fn, make())
    assert sorted(str(b.dtype) for b in ddp._buckets) == ["float32", "float64"]
    x, y = data()
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(shard(x)), shard(y))))
    grads = tape.gradient(loss, ddp.params)
    rng = np.random.default_rng(5)
    reference = make()
    with cp.Tape() as tape:
        tape.watch(reference)
        loss = ops.mean(ops.square(ops.subtract(fn(reference, x), y)))
    expected = tape.gradient(loss, reference)
    assert grads["a"].dtype == np.float32
    assert grads["b"].dtype == np.float64
    close(grads, expected, "mixed float32/float64 parameters", tol=1e-5)


def check_one_array_at_two_leaves() -> None:
    """Tied weights: the same array twice in params gets its total gradient, averaged once."""
    w = np.random.default_rng(7).normal(size=(SIZES[0], SIZES[0])) / 3

    def fn(p: dict[str, Any], x: Any) -> Any:
        return ops.matmul(ops.tanh(ops.matmul(x, p["a"])), p["b"])

    ddp = cp.DistributedDataParallel(fn, {"a": w, "b": w}, bucket_cap_mb=TINY_CAP)
    x, _ = data()
    with cp.Tape() as tape:
        loss = ops.mean(ops.sum(ops.square(ops.subtract(ddp(shard(x)), shard(x))), axis=1))
    grads = tape.gradient(loss, ddp.params)
    with cp.Tape() as tape:
        tape.watch(w)
        loss = ops.mean(ops.sum(ops.square(ops.subtract(fn({"a": w, "b": w}, x), x)), axis=1))
    expected = tape.gradient(loss, w)
    close(grads, {"a": expected, "b": expected}, "one array at two leaves")


CHECKS = [
    check_broadcast_at_construction,
    check_gradient_equals_one_process,
    lambda: check_gradient_equals_one_process(to_host=True),
    check_rank_dependent_unused_parameter,
    check_default_bucket_cap_and_several_steps,
    check_persistent_tape_and_two_forwards,
    check_functional_update_training,
    check_no_sync_accumulation,
    check_first_bucket_starts_during_backward,
    check_comm_hooks,
    check_mismatched_params_raise_on_every_rank,
    check_second_derivative_refused,
    check_mixed_dtypes_one_bucket_each,
    check_one_array_at_two_leaves,
]


def main() -> int:
    dist.init_process_group("mpi")
    rank = dist.get_rank()
    failed = 0
    for check in CHECKS:
        try:
            check()
        except Exception:  # noqa: BLE001, PERF203 - each check reported, the exit status says so
            failed += 1
            print(f"rank {rank}: FAILED {check.__name__}\n{traceback.format_exc()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        return 1
    print(f"rank {rank}: {len(CHECKS)} checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
