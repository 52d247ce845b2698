"""Run by ``mpiexec -n N python ddp_worker.py``: DistributedDataParallel against one process.

Every ``check_*`` function is a plain function of the default process group (it reads only
``dist.get_rank()``/``dist.get_world_size()``, no process-wide state), so the same checks run
on thread ranks (``rank_main``, see tests/thread_ranks.py), MPI or NCCL. Each rank computes the
one-process oracle itself, with a plain Tape on the whole batch in float64 NumPy, and the DDP
gradient from its shard; a failure raises ``AssertionError``. A check takes a :class:`Setting`:
the kind of arrays (``cpu`` NumPy, ``host`` arrays, ``cupy`` on the rank's current GPU) and the
parameters' dtype (the oracle gets the same values, rounded to that dtype, in float64).

``rank_main(rank, [mode])`` runs the checks of ``mode`` and prints ``rank r: N checks passed``
(1 on a failure): ``all`` (NumPy and host arrays in float64, then the float32 and float16
checks), ``cupy`` (CuPy arrays, every dtype, in the running world: NCCL thread ranks under
``simulated_cuda``). ``main()`` is ``rank_main`` under ``mpiexec``.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, NamedTuple

import numpy as np
from common import run_checks  # this directory: the worker runs as a script

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks

N = 36  # samples: divides evenly over 2, 3 and 4 ranks
SIZES = [7, 13, 5, 11, 1]  # uneven layers
TINY_CAP = 400 / 2**20  # ~400 bytes: several buckets for this small model


class Setting(NamedTuple):
    """Where the checks' arrays live and the parameters' dtype."""

    kind: str = "cpu"  # cpu (NumPy), host (host:0) or cupy (the current GPU)
    dtype: str = "float64"

    def put(self, a: Any) -> Any:
        """A NumPy array (or a tree of them) as this setting's arrays."""
        return cp._src.tree.tree_map(lambda x: self._put(x) if cp.is_array(x) else x, a)

    def _put(self, a: Any) -> Any:
        a = np.asarray(a, dtype=self.dtype)
        if self.kind == "cpu":
            return a
        if self.kind == "host":
            return cp.to_device(a, "host:0")
        from cupy_parallel._src.devices import cupy_module

        return cp.to_device(a, f"cuda:{cupy_module().cuda.Device().id}")

    def exact(self, a: Any) -> Any:
        """NumPy float64 arrays holding the values ``put`` gives (rounded to the dtype)."""
        return cp._src.tree.tree_map(
            lambda x: np.asarray(x, self.dtype).astype(np.float64) if cp.is_array(x) else x, a
        )

    @property
    def cap(self) -> float:
        """A bucket cap giving the model several buckets (as ``TINY_CAP`` in float64)."""
        return TINY_CAP * np.dtype(self.dtype).itemsize / 8

    @property
    def tol(self) -> float:
        """The relative tolerance of a gradient against the float64 oracle.

        float64: the issue's 1e-12. float32 and float16: 8 units of the dtype's epsilon (1.2e-7
        and 9.8e-4): the MLP's passes round at every step; measured at 2 and 3 thread ranks,
        relative to the largest gradient: 1.3e-7 (float32) and 7.9e-4 (float16), ~1 eps.
        """
        return {"float64": 1e-12, "float32": 1e-6, "float16": 8e-3}[self.dtype]

    def __str__(self) -> str:
        return f"{self.kind}/{self.dtype}"


F64 = Setting()


def raw_params(seed: int = 0) -> dict[str, Any]:
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
    return params


def make_params(seed: int = 0, s: Setting = F64) -> dict[str, Any]:
    """The model's parameters as ``s``'s arrays."""
    return s.put(raw_params(seed))  # type: ignore[no-any-return]


def data(s: Setting = F64) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch, NumPy float64, holding values of ``s``'s dtype."""
    rng = np.random.default_rng(1)
    return s.exact(rng.normal(size=(N, SIZES[0]))), s.exact(rng.normal(size=(N, 1)))


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


def oracle(params: dict[str, Any], *, extra_on: tuple[int, ...] = (), s: Setting = F64) -> Any:
    """The one-process gradient: the whole batch, or the mean of the ranks' shard losses.

    In float64 NumPy, from ``params`` and the batch rounded to ``s``'s dtype.
    """
    x, y = data(s)
    params = s.exact(params) if s.dtype != "float64" else params
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


def check_broadcast_at_construction(s: Setting = F64) -> None:
    rank = dist.get_rank()
    params = make_params(seed=rank, s=s)  # every rank starts different
    leaf = params["layers"][0]["w"]
    ddp = cp.DistributedDataParallel(mlp, params)
    assert ddp.params is params  # in place
    assert params["layers"][0]["w"] is leaf
    close(params, make_params(seed=0, s=s), "params after construction", tol=0.0)
    mine = make_params(seed=rank, s=s)
    cp.DistributedDataParallel(mlp, mine, broadcast_params=False)
    close(mine, make_params(seed=rank, s=s), "broadcast_params=False", tol=0.0)


def _ddp_gradient(ddp: Any, *, extra_on: tuple[int, ...] = (), s: Setting = F64) -> Any:
    x, y = data(s)
    rank = dist.get_rank()
    with cp.Tape() as tape:
        out = ddp(s.put(shard(x)), extra=rank in extra_on)
        loss = ops.mean(ops.square(ops.subtract(out, s.put(shard(y)))))
    return tape.gradient(loss, ddp.params)


def check_gradient_equals_one_process(s: Setting = F64) -> None:
    params = make_params(s=s)
    ddp = cp.DistributedDataParallel(mlp, params, bucket_cap_mb=s.cap)
    assert len(ddp._buckets) >= 4, ddp._buckets
    grads = _ddp_gradient(ddp, s=s)
    expected = oracle(make_params(), s=s)
    close(grads, expected, f"DDP gradient ({s} arrays)", tol=s.tol)
    assert not np.any(numpy_of(grads["unused"])), "an unused parameter gets zeros"
    arrays = [p for p in cp._src.tree.leaves(params) if cp.is_array(p)]
    grad_arrays = [g for g in cp._src.tree.leaves(grads) if g is not None]
    for g, p in zip(grad_arrays, arrays, strict=True):
        assert type(g) is type(p), f"{type(g).__name__} gradient of a {type(p).__name__}"
        assert g.dtype == p.dtype, f"{g.dtype} gradient of a {p.dtype} parameter"
        assert str(cp.device_of(g)) == str(cp.device_of(p)), "the parameter's device"
    equal_on_every_rank(grads, "DDP gradient")


def check_rank_dependent_unused_parameter(s: Setting = F64) -> None:
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    grads = _ddp_gradient(ddp, extra_on=(0,), s=s)  # only rank 0's step uses params["extra"]
    expected = oracle(make_params(), extra_on=(0,), s=s)
    close(grads, expected, "gradient of a rank-0-only parameter", tol=s.tol)
    assert np.any(numpy_of(grads["extra"])), "rank 0's gradient reaches every rank"


def check_default_bucket_cap_and_several_steps(s: Setting = F64) -> None:
    """One bucket (25 MiB): two steps; the first step's gradients stay as they were."""
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s))
    assert len(ddp._buckets) == 1
    first = _ddp_gradient(ddp, s=s)
    kept = cp._src.tree.tree_map(lambda g: g.copy() if g is not None else None, first)
    second = _ddp_gradient(ddp, s=s)
    close(second, oracle(make_params(), s=s), "second step", tol=s.tol)
    close(first, kept, "a gradient kept from step one", tol=0.0)


def check_persistent_tape_and_two_forwards(s: Setting = F64) -> None:
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    x, y = data(s)
    xs, ys = s.put(shard(x)), s.put(shard(y))
    half = len(xs) // 2
    with cp.Tape(persistent=True) as tape:  # two forward calls, one loss, one reduction
        a = ops.sum(ops.square(ops.subtract(ddp(xs[:half]), ys[:half])))
        b = ops.sum(ops.square(ops.subtract(ddp(xs[half:]), ys[half:])))
        loss = ops.divide(ops.add(a, b), float(len(xs)))
    expected = oracle(make_params(), s=s)
    first = tape.gradient(loss, ddp.params)
    close(first, expected, "two forwards, persistent tape, pass 1", tol=s.tol)
    close(tape.gradient(loss, ddp.params), first, "persistent tape, pass 2", tol=0.0)


def check_functional_update_training(s: Setting = F64) -> None:
    """Three SGD steps with ddp.params replaced each step equal three one-process steps."""
    lr = 0.1
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    reference = s.exact(make_params())

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
        ddp.params = step(ddp.params, _ddp_gradient(ddp, s=s))
        reference = step(reference, oracle(reference, s=s))
    close(ddp.params, reference, "params after three steps", tol=max(s.tol, 1e-11))


def check_no_sync_accumulation(s: Setting = F64) -> None:
    k = 3
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    x, y = data(s)
    xs, ys = s.put(shard(x)), s.put(shard(y))
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
    dist.all_gather_object(gathered, numpy_of(local["layers"][0]["w"]))
    assert not all(np.array_equal(gathered[0], g) for g in gathered[1:]), "no_sync is local"
    reduced = ddp.reduce_gradients(local)
    expected = oracle(make_params(), s=s)
    close(reduced, expected, "no_sync accumulation + reduce_gradients", tol=s.tol)
    close(local, _scale(total, 1.0 / k), "reduce_gradients leaves its input alone", tol=0.0)


def _add(a: Any, b: Any) -> Any:
    return _zip_map(lambda u, v: u + v, a, b)


def _scale(a: Any, s: float) -> Any:
    return _zip_map(lambda u, _: u * s, a, a)


def _zip_map(f: Any, a: Any, b: Any) -> Any:
    _, la, spec = cp._src.tree.flatten(a)
    lb = cp._src.tree.leaves(b)
    return spec.unflatten([f(u, v) if u is not None else None for u, v in zip(la, lb, strict=True)])


def check_first_bucket_starts_during_backward(s: Setting = F64) -> None:
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

    ddp = cp.DistributedDataParallel(probed, make_params(s=s), bucket_cap_mb=s.cap)
    ddp.register_comm_hook(None, logged)
    x, y = data(s)
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(s.put(shard(x))), s.put(shard(y)))))
    events.append("forward done")
    grads = tape.gradient(loss, ddp.params)
    events.append("gradient returned")
    close(grads, oracle(make_params(), s=s), "gradient with a logging comm hook", tol=s.tol)
    count = len(ddp._buckets)
    assert events[0] == "forward done", events
    assert events.index("start 0") < events.index("probe"), events
    assert events.index("probe") < events.index(f"start {count - 1}"), events
    assert [e for e in events if e.startswith("start")] == [f"start {k}" for k in range(count)]
    raises_everywhere(
        RuntimeError, "only be called once", lambda: ddp.register_comm_hook(None, logged)
    )


def check_comm_hooks(s: Setting = F64) -> None:
    world = dist.get_world_size()
    expected = oracle(make_params(), s=s)
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    grads = _ddp_gradient(ddp, s=s)
    close(grads, expected, "fp16_compress_hook", tol=max(s.tol, 2e-3))
    equal_on_every_rank(grads, "fp16_compress_hook")
    raises_everywhere(
        RuntimeError, "only be called once", lambda: ddp.register_comm_hook(None, print)
    )
    used = cp.DistributedDataParallel(mlp, make_params(s=s))
    _ddp_gradient(used, s=s)
    raises_everywhere(
        RuntimeError, "before the first backward", lambda: used.register_comm_hook(None, print)
    )

    def threaded(state: Any, bucket: Any) -> Any:  # Work.get_future(): a helper thread waits
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda f: f.value()[0] / world)

    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    ddp.register_comm_hook("state", threaded)
    close(_ddp_gradient(ddp, s=s), expected, "a hook returning Work.get_future()", tol=s.tol)

    ddp = cp.DistributedDataParallel(mlp, make_params(s=s))
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        raises_everywhere(
            RuntimeError,
            "install ml_dtypes",
            lambda: ddp.register_comm_hook(None, default_hooks.bf16_compress_hook),
        )


def check_mismatched_params_raise_on_every_rank(s: Setting = F64) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = world - 1  # the last rank differs
    params = make_params(s=s)
    if rank == odd:
        params["layers"][1]["w"] = s.put(np.zeros((13, 6)))
    message = raises_everywhere(
        ValueError, "differ across the ranks", lambda: cp.DistributedDataParallel(mlp, params)
    )
    assert f"rank {odd}" in message, message
    assert "['w']" in message, message
    params = make_params(s=s)
    if rank == odd:
        params["extra"] = s.put(np.arange(7.0)).astype(np.int64)
    message = raises_everywhere(
        TypeError, "floating-point", lambda: cp.DistributedDataParallel(mlp, params)
    )
    assert f"On rank {odd}" in message, message
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s))
    grads = s.put(oracle(make_params()))
    if rank == odd:
        grads["layers"][2]["b"] = s.put(np.zeros(3))
    message = raises_everywhere(
        ValueError, "grads['layers'][2]['b']", lambda: ddp.reduce_gradients(grads)
    )
    assert f"On rank {odd}" in message, message
    cap = TINY_CAP if rank == odd else 25.0
    raises_everywhere(
        ValueError,
        "differ across the ranks",
        lambda: cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=cap),
    )


def check_second_derivative_refused(s: Setting = F64) -> None:
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s))
    x, y = data(s)
    with cp.Tape() as outer:
        with cp.Tape() as inner:
            loss = ops.mean(ops.square(ops.subtract(ddp(s.put(shard(x))), s.put(shard(y)))))
        raises_everywhere(
            NotImplementedError, "differentiated again", lambda: inner.gradient(loss, ddp.params)
        )
    del outer
    # the DDP is still usable: the next step's tape reduces as before
    expected = oracle(make_params(), s=s)
    close(_ddp_gradient(ddp, s=s), expected, "a step after the refused pass", tol=s.tol)


def check_mixed_dtypes_one_bucket_each(s: Setting = F64) -> None:
    rng = np.random.default_rng(5)

    def make() -> dict[str, Any]:
        return {
            "a": rng.normal(size=(SIZES[0], 3)).astype(np.float32),
            "b": np.random.default_rng(6).normal(size=(3, 1)),
        }

    def fn(p: dict[str, Any], x: Any) -> Any:
        return ops.matmul(ops.tanh(ops.matmul(x.astype(np.float32), p["a"])), p["b"])

    rng = np.random.default_rng(5)
    ddp = cp.DistributedDataParallel(
        fn, cp._src.tree.tree_map(lambda a: s.put(a).astype(a.dtype), make())
    )
    assert sorted(str(b.dtype) for b in ddp._buckets) == ["float32", "float64"]
    x, y = data()
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(s.put(shard(x))), s.put(shard(y)))))
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


def check_one_array_at_two_leaves(s: Setting = F64) -> None:
    """Tied weights: the same array twice in params gets its total gradient, averaged once."""
    w = np.random.default_rng(7).normal(size=(SIZES[0], SIZES[0])) / 3
    tied = s.put(w)

    def fn(p: dict[str, Any], x: Any) -> Any:
        return ops.matmul(ops.tanh(ops.matmul(x, p["a"])), p["b"])

    ddp = cp.DistributedDataParallel(fn, {"a": tied, "b": tied}, bucket_cap_mb=s.cap)
    x, _ = data()
    xs = s.put(shard(x))
    with cp.Tape() as tape:
        loss = ops.mean(ops.sum(ops.square(ops.subtract(ddp(xs), xs)), axis=1))
    grads = tape.gradient(loss, ddp.params)
    with cp.Tape() as tape:
        tape.watch(w)
        loss = ops.mean(ops.sum(ops.square(ops.subtract(fn({"a": w, "b": w}, x), x)), axis=1))
    expected = tape.gradient(loss, w)
    close(grads, {"a": expected, "b": expected}, "one array at two leaves")


def check_average_is_the_reduction_model(s: Setting = F64) -> None:
    """DDP's average, to the bit, against a model of its reduction (and torch's allreduce_hook).

    Each rank's gradient ``g_r`` (its shard's, computed under ``no_sync``) is divided by the
    group's size in the parameters' dtype (one rounding, as ``allreduce_hook``'s ``div_``),
    then summed over the ranks as the backend sums: the MPI backend in rank order, float16 in
    float32 rounded once; NCCL rank after rank in the dtype. Under ``mpiexec`` MPICH chooses its
    own order of the sum: there the model holds to a few units in the last place.
    """
    world = dist.get_world_size()
    x, y = data(s)
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    with ddp.no_sync(), cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(s.put(shard(x))), s.put(shard(y)))))
    local = tape.gradient(loss, ddp.params)
    mine = [numpy_of(g) for g in cp._src.tree.leaves(local) if g is not None]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    dtype = np.dtype(s.dtype)
    work = np.float32 if dtype == np.float16 and dist.get_backend() != "nccl" else dtype
    expected = []
    for parts in zip(*everyone, strict=True):
        total = (parts[0] / dtype.type(world)).astype(work)
        for part in parts[1:]:
            total = (total + (part / dtype.type(world)).astype(work)).astype(work)
        expected.append(total.astype(dtype))
    # a DDP of its own: after the local pass above, ddp would warn of local gradients that
    # nothing averaged (right for an accumulation, which that pass is not)
    ddp = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(s.put(shard(x))), s.put(shard(y)))))
    fused = [
        numpy_of(g) for g in cp._src.tree.leaves(tape.gradient(loss, ddp.params)) if g is not None
    ]
    hooked = cp.DistributedDataParallel(mlp, make_params(s=s), bucket_cap_mb=s.cap)
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(hooked(s.put(shard(x))), s.put(shard(y)))))
    by_hook = [
        numpy_of(g)
        for g in cp._src.tree.leaves(tape.gradient(loss, hooked.params))
        if g is not None
    ]
    exact = dist.get_backend() == "nccl" or _on_thread_rank()
    for k, (got, hook, want) in enumerate(zip(fused, by_hook, expected, strict=True)):
        assert got.dtype == dtype, got.dtype
        if exact:
            assert np.array_equal(got, want), (
                f"{s} leaf {k}: the fused average differs from the model by "
                f"{np.max(np.abs(got - want)):g} ({np.sum(got != want)} of {got.size} values)"
            )
        else:
            close(got, want, f"{s} leaf {k} against the model", tol=8 * float(np.finfo(dtype).eps))
        assert np.array_equal(got, hook), (
            f"{s} leaf {k}: the fused average differs from allreduce_hook's by "
            f"{np.max(np.abs(got - hook)):g}"
        )


def check_complex_parameters(s: Setting = F64) -> None:
    """Complex parameters (complex128 and complex64 beside a real one) against NumPy's gradient.

    The model ``Re(Xc @ w + 1j * b) + X @ v`` with a complex batch ``Xc``; for the mean square
    loss with residual ``r`` the gradients in PyTorch's convention (``dL/dRe + i dL/dIm``) are
    ``conj(Xc).T @ g``, ``-1j * sum(g)`` and ``X.T @ g`` with ``g = 2 r / N``.
    """
    rng = np.random.default_rng(5)
    k = SIZES[0]
    xc = rng.normal(size=(N, k)) + 1j * rng.normal(size=(N, k))
    x, y = data()

    def put(a: Any, dtype: str) -> Any:
        return Setting(s.kind, dtype)._put(a)

    def make() -> dict[str, Any]:
        r = np.random.default_rng(6)
        return {
            "w": put(r.normal(size=(k, 1)) + 1j * r.normal(size=(k, 1)), "complex128"),
            "b": put(r.normal(size=1) + 1j * r.normal(size=1), "complex64"),
            "v": put(r.normal(size=(k, 1)), "float64"),
        }

    def model(p: dict[str, Any], xc: Any, x: Any) -> Any:
        shifted = ops.add(ops.matmul(xc, p["w"]), ops.multiply(p["b"], 1j))
        return ops.add(ops.real(shifted), ops.matmul(x, p["v"]))

    start = {name: numpy_of(a) for name, a in make().items()}
    residual = (xc @ start["w"] + 1j * start["b"].astype(np.complex128)).real + x @ start["v"] - y
    g = 2 * residual / N
    expected = {"b": -1j * g.sum(axis=0), "v": x.T @ g, "w": xc.conj().T @ g}

    def gradient(ddp: Any) -> Any:
        with cp.Tape() as tape:
            out = ddp(put(shard(xc), "complex128"), put(shard(x), "float64"))
            loss = ops.mean(ops.square(ops.subtract(out, put(shard(y), "float64"))))
        return tape.gradient(loss, ddp.params)

    ddp = cp.DistributedDataParallel(model, make())
    assert sorted(str(b.dtype) for b in ddp._buckets) == ["complex128", "complex64", "float64"]
    grads = gradient(ddp)
    for name, want in expected.items():
        got = grads[name]
        assert got.dtype == ddp.params[name].dtype, f"{got.dtype} gradient of {name}"
        assert type(got) is type(ddp.params[name]), f"{type(got).__name__} gradient of {name}"
        tol = 1e-6 if got.dtype == np.complex64 else 1e-12
        close(got, want, f"{s} complex DDP gradient of {name}", tol=tol)
    equal_on_every_rank(grads, "complex DDP gradient")

    compressed = cp.DistributedDataParallel(model, make())
    compressed.register_comm_hook(None, default_hooks.fp16_compress_hook)
    grads = gradient(compressed)
    for name, want in expected.items():  # both parts arrive, each rounded to float16
        close(grads[name], want, f"{s} fp16_compress_hook on complex {name}", tol=2e-3)
        assert np.any(numpy_of(grads[name]).imag != 0) == np.any(want.imag != 0), name


def _on_thread_rank() -> bool:
    from cupy_parallel._src.distributed.mpi_job import thread_rank

    return thread_rank() is not None


# (check, settings) for mode "all" (MPI: NumPy and host arrays)
CPU32, CPU16 = Setting("cpu", "float32"), Setting("cpu", "float16")
HOST = Setting("host")
EVERY_DTYPE = [F64, CPU32, CPU16]
LOW_PRECISION = [
    check_broadcast_at_construction,
    check_gradient_equals_one_process,
    check_rank_dependent_unused_parameter,
    check_default_bucket_cap_and_several_steps,
    check_persistent_tape_and_two_forwards,
    check_functional_update_training,
    check_no_sync_accumulation,
    check_first_bucket_starts_during_backward,
    check_comm_hooks,
    check_average_is_the_reduction_model,
]
FLOAT64_ONLY = [
    check_mismatched_params_raise_on_every_rank,
    check_second_derivative_refused,
    check_mixed_dtypes_one_bucket_each,
    check_one_array_at_two_leaves,
    check_complex_parameters,
]
CHECKS: list[tuple[Any, Setting]] = [
    *[(check, F64) for check in LOW_PRECISION],
    *[(check, F64) for check in FLOAT64_ONLY],
    (check_gradient_equals_one_process, HOST),
    (check_no_sync_accumulation, HOST),
    (check_first_bucket_starts_during_backward, HOST),
    (check_average_is_the_reduction_model, HOST),
    (check_complex_parameters, HOST),
    *[(check, setting) for setting in (CPU32, CPU16) for check in LOW_PRECISION],
]


def cupy_checks() -> list[tuple[Any, Setting]]:
    """Mode "cupy": every check with CuPy arrays (float32/float16: those of every dtype)."""
    settings = [Setting("cupy", dtype) for dtype in ("float64", "float32", "float16")]
    return [(check, settings[0]) for check in [*LOW_PRECISION, *FLOAT64_ONLY]] + [
        (check, setting) for setting in settings[1:] for check in LOW_PRECISION
    ]


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(rank: int, argv: list[str]) -> int:
    """One rank's program (``rank`` is unused: the world says); see the module."""
    mode = argv[0] if argv else "all"
    return run_checks(lambda: [(c, (s,)) for c, s in (CHECKS if mode == "all" else cupy_checks())])


if __name__ == "__main__":
    sys.exit(main())
