"""A user's training script, checked by ``mypy --strict`` in tests/test_typing.py and run there.

It is written as a user would write it against the public API only, with annotations where a
user would put them, and no ``cast`` or ``type: ignore``: if the library's types were ``Any`` or
wrong, ``mypy --strict`` would reject it (returning ``Any``, untyped calls) or the reveal checks in
tests/test_typing.py would fail. Run on two host devices: ``python tests/typing/user_script.py``.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops

if TYPE_CHECKING:
    from numpy.typing import NDArray

Params = dict[str, cp.Array]


class Batch(NamedTuple):
    x: cp.Array
    y: cp.Array


def init_params(rng: np.random.Generator, device: cp.Device) -> Params:
    w = rng.standard_normal((3, 1))
    return {"w": cp.to_device(w, device), "b": cp.to_device(np.zeros(1), device)}


def model(params: Params, x: cp.Array) -> cp.Array:
    return ops.add(ops.matmul(x, params["w"]), params["b"])


def loss_fn(params: Params, x: cp.Array, y: cp.Array) -> cp.Array:
    return ops.mean(ops.square(ops.subtract(model(params, x), y)))


def sgd(params: Params, grads: Params, lr: float) -> Params:
    return {k: ops.subtract(v, ops.multiply(grads[k], lr)) for k, v in params.items()}


class Cube(cp.Function):
    """x ** 3 with a hand-written backward (the documented way to add a differentiable op)."""

    @staticmethod
    def forward(ctx: cp.FunctionContext, x: cp.Array) -> cp.Array:
        ctx.save_for_backward(x)
        return ops.multiply(ops.square(x), x)

    @staticmethod
    def backward(ctx: cp.FunctionContext, g: cp.Array) -> tuple[cp.Array]:
        (x,) = ctx.saved_arrays
        return (ops.multiply(g, ops.multiply(ops.square(x), 3.0)),)


def cube_gradient(x: cp.Array) -> cp.Array:
    with cp.Tape() as tape:
        tape.watch(x)
        y: cp.Array = Cube.apply(x)
        total = ops.sum(y)
    return tape.gradient(total, x)


def host(x: cp.Array) -> NDArray[np.float64]:
    out: NDArray[np.float64] = cp.to_device(x, "cpu")
    return out


def comm_round_trip(x: NDArray[np.float64], devices: list[cp.Device]) -> None:
    parts = cp.comm.scatter(x, devices)
    sizes = [p.shape[0] for p in parts]
    back = cp.comm.gather(parts, destination="cpu")
    copies = cp.comm.broadcast(x, devices)
    total = cp.comm.reduce_add(copies, destination=devices[0])
    np.testing.assert_array_equal(host(back), x)
    np.testing.assert_array_equal(host(total), len(devices) * x)
    assert sum(sizes) == x.shape[0]


def nested_round_trip(batch: Batch, devices: list[cp.Device]) -> Batch:
    replicas: list[Batch] = cp.scatter(batch, devices)
    assert all(cp.device_of(r.x) == d for r, d in zip(replicas, devices, strict=True))
    whole: Batch = cp.gather(replicas, "cpu")
    return whole


def train(devices: list[cp.Device], steps: int) -> list[float]:
    rng = np.random.default_rng(0)
    params = init_params(rng, devices[0])
    data = Batch(rng.standard_normal((8, 3)), rng.standard_normal((8, 1)))
    dp = cp.DataParallel(model, params, device_ids=devices, output_device=devices[0])
    losses: list[float] = []
    for _ in range(steps):
        x = cp.to_device(data.x, devices[0])
        y = cp.to_device(data.y, devices[0])
        with cp.Tape() as tape:
            tape.watch(params)
            prediction = dp(x)
            loss = ops.mean(ops.square(ops.subtract(prediction, y)))
        grads = tape.gradient(loss, params)
        params = sgd(params, grads, 0.1)
        dp.params = params
        losses.append(float(host(loss)))
    # the functional form agrees with the tape
    x, y = cp.to_device(data.x, devices[0]), cp.to_device(data.y, devices[0])
    value, grads = cp.value_and_grad(loss_fn)(params, x, y)
    gradient_fn = cp.grad(loss_fn)
    assert float(host(value)) >= 0.0
    assert set(gradient_fn(params, x, y)) == set(grads) == {"w", "b"}
    return losses


def replicate_and_apply(params: Params, devices: list[cp.Device]) -> list[cp.Array]:
    replicas = cp.replicate(params, devices)
    inputs = cp.scatter((np.ones((len(devices), 3)),), devices)
    args = [(r, *i) for r, i in zip(replicas, inputs, strict=True)]
    return cp.parallel_apply([model] * len(replicas), args)


def distributed_step(tmp: Path) -> float:
    store = dist.FileStore(str(tmp / "store"), 1)
    store.set("greeting", "hello")
    assert store.get("greeting") == b"hello"
    assert store.add("counter", 2) == 2
    dist.init_process_group("mpi", timeout=timedelta(seconds=30))
    try:
        x = np.full(4, float(dist.get_rank() + 1))
        dist.all_reduce(x)
        work = dist.all_reduce(x, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        assert work.is_completed()
        gathered = [np.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, x)
        dist.broadcast(x, src=0)
        dist.barrier()
        return float(x[0])
    finally:
        dist.destroy_process_group()


def main() -> None:
    cp.set_host_device_count(2)
    devices = cp.devices()
    comm_round_trip(np.arange(10.0), devices)
    batch = Batch(np.arange(12.0).reshape(4, 3), np.arange(4.0))
    whole = nested_round_trip(batch, devices)
    np.testing.assert_array_equal(host(whole.x), batch.x)
    losses = train(devices, steps=5)
    assert losses[-1] < losses[0], losses
    outputs = replicate_and_apply(init_params(np.random.default_rng(1), devices[0]), devices)
    assert [cp.device_of(o) for o in outputs] == devices
    assert cp.gradcheck(lambda w: ops.sum(ops.tanh(w)), [np.linspace(-1.0, 1.0, 5)])
    w = np.array([1.0, -2.0])
    np.testing.assert_allclose(host(cube_gradient(cp.to_device(w, devices[1]))), 3.0 * w**2)
    with tempfile.TemporaryDirectory() as tmp:
        assert distributed_step(Path(tmp)) == 1.0
    print("ok", losses[0], losses[-1])


if __name__ == "__main__":
    main()
