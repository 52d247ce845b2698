"""The types the public API promises, pinned with ``assert_type`` (checked by mypy, never run).

tests/test_typing.py runs ``mypy --strict`` on this file: each ``assert_type`` fails if a return
type regresses (to ``Any``, say), and each ``# type: ignore[code]`` marks a call the checker must
refuse (``--strict`` reports an ignore that is no longer needed). Everything is inside functions,
so importing the module (pytest's doctest collection does) runs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops

if TYPE_CHECKING:
    from typing_extensions import assert_type  # noqa: TC004 - this module is never run

Params = dict[str, cp.Array]


def model(params: Params, x: cp.Array) -> cp.Array:
    return ops.matmul(x, params["w"])


def loss(params: Params, x: cp.Array) -> cp.Array:
    return ops.sum(model(params, x))


def arrays(x: cp.Array, h: cp.HostArray, devices: list[cp.Device]) -> None:
    assert_type(cp.comm.scatter(x, devices), tuple[cp.Array, ...])
    assert_type(cp.comm.scatter(x, out=[h, h]), tuple[cp.Array, ...])
    assert_type(cp.comm.gather([x, h], destination="cpu"), cp.Array)
    assert_type(cp.comm.broadcast(x, devices), tuple[cp.Array, ...])
    assert_type(cp.comm.broadcast_coalesced([x, h], devices), tuple[tuple[cp.Array, ...], ...])
    assert_type(cp.comm.reduce_add([x, h]), cp.Array)
    assert_type(cp.comm.reduce_add_coalesced([[x], [h]]), tuple[cp.Array, ...])
    assert_type(cp.to_device(x, "cpu"), NDArray[Any])
    assert_type(cp.to_device(x, -1), NDArray[Any])
    assert_type(cp.to_device(x, devices[0]), cp.Array)
    assert_type(cp.empty((2, 3), np.float32, "host:0"), cp.Array)
    assert_type(cp.device_of(x), cp.Device)
    assert_type(cp.stop_gradient(x), cp.Array)


def host_arrays(h: cp.HostArray) -> None:
    assert_type(h + 1, cp.HostArray)
    assert_type(2.0 * h, cp.HostArray)
    assert_type(h @ h, cp.HostArray)
    assert_type(-h, cp.HostArray)
    assert_type(h > 0, cp.HostArray)
    assert_type(h[0], cp.HostArray)
    assert_type(h.device, cp.Device)
    assert_type(h.get(), NDArray[Any])
    assert_type(h.sum(), cp.HostArray)
    assert_type(h.reshape(-1), cp.HostArray)
    assert_type(h.nonzero(), tuple[cp.HostArray, ...])
    assert_type(h.to_device("host:1"), cp.Array)


def differentiable_ops(x: cp.Array, labels: cp.Array) -> None:
    assert_type(ops.add(x, 1.0), cp.Array)
    assert_type(ops.multiply(2, x), cp.Array)
    assert_type(ops.tanh(x), cp.Array)
    assert_type(ops.sum(x, axis=0), cp.Array)
    assert_type(ops.clip(x, 0.0), cp.Array)
    assert_type(ops.where(x > 0, x, 0.0), cp.Array)
    assert_type(ops.getitem(x, (slice(None), 0)), cp.Array)
    assert_type(ops.split(x, 2), list[cp.Array])
    assert_type(ops.softmax_cross_entropy(x, labels), cp.Array)


def pytrees(p: Params, x: cp.Array, devices: list[cp.Device]) -> None:
    assert_type(cp.scatter(p, devices), list[Params])
    assert_type(cp.scatter((x, p), devices), list[tuple[cp.Array, Params]])
    assert_type(cp.gather([p, p], "cpu"), Params)
    assert_type(cp.replicate(p, devices), list[Params])
    assert_type(cp.stop_gradient(p), Params)
    with cp.Tape() as tape:
        tape.watch(p)
        y = loss(p, x)
    assert_type(tape, cp.Tape)
    assert_type(tape.gradient(y, p), Params)
    assert_type(tape.gradient(y, (p, x)), tuple[Params, cp.Array])


def functional(p: Params, x: cp.Array) -> None:
    gradient_fn = cp.grad(loss)
    assert_type(gradient_fn(p, x), Params)
    assert_type(cp.value_and_grad(loss)(p, x), tuple[cp.Array, Params])
    assert_type(cp.grad(loss, has_aux=True)(p, x), tuple[Params, Any])
    cp.grad(loss)(p)  # type: ignore[call-arg]  # the gradient function takes fn's arguments
    assert_type(cp.grad(loss, argnums=1)(p, x), Any)
    assert_type(cp.grad(loss, argnums=(0, 1))(p, x), Any)


def data_parallel(p: Params, x: cp.Array, devices: list[cp.Device]) -> None:
    dp = cp.DataParallel(model, p, device_ids=devices)
    assert_type(dp, cp.DataParallel[Params, cp.Array])
    assert_type(dp(x), cp.Array)
    assert_type(dp.params, Params)
    assert_type(cp.data_parallel(model, p, (x,), devices), cp.Array)
    assert_type(cp.parallel_apply([model, model], [(p, x), (p, x)]), list[cp.Array])


def distributed(x: NDArray[np.float64], flag: bool) -> None:
    assert_type(dist.all_reduce(x), None)
    assert_type(dist.all_reduce(x, async_op=True), dist.Work)
    assert_type(dist.all_reduce(x, dist.ReduceOp.MAX, None, True), dist.Work)
    assert_type(dist.all_reduce(x, async_op=flag), dist.Work | None)
    assert_type(dist.broadcast(x, 0), None)
    assert_type(dist.broadcast(x, 0, async_op=True), dist.Work)
    assert_type(dist.barrier(async_op=True), dist.Work)
    assert_type(dist.all_gather_into_tensor(x, x, async_op=True), dist.Work)
    assert_type(dist.reduce_scatter_tensor(x, x), None)
    assert_type(dist.all_to_all_single(x, x, async_op=True), dist.Work)
    assert_type(dist.all_reduce_coalesced([x], async_op=True), dist.Work)
    assert_type(dist.broadcast_multigpu([x], 0, async_op=True), dist.Work)
    assert_type(dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 0)]), list[dist.Work])
    assert_type(dist.isend(x, 0), dist.Work | None)
    assert_type(dist.recv(x), int)
    assert_type(dist.get_rank(), int)


def stores(path: str) -> None:
    store = dist.FileStore(path, 1)
    assert_type(store.get("k"), bytes)
    assert_type(store.add("n", 1), int)
    assert_type(store.compare_set("k", "a", "b"), bytes)
    assert_type(store.multi_get(["k"]), list[bytes])
    assert_type(store.check(["k"]), bool)
    assert_type(store.queue_pop("q"), bytes)
    assert_type(store.clone(), dist.FileStore)
    prefixed = dist.PrefixStore("p/", store)
    assert_type(prefixed.underlying_store, dist.Store)
    prefixed.set("k", 1)  # type: ignore[arg-type]


def refused(x: cp.Array, p: Params, devices: list[cp.Device]) -> None:
    """Calls a type checker must reject (each ignore is checked to be needed)."""
    cp.comm.scatter([1.0, 2.0], devices)  # type: ignore[arg-type]
    cp.comm.gather(x)  # type: ignore[arg-type]
    ops.add("1", x)  # type: ignore[arg-type]
    ops.matmul(x, 2.0)  # type: ignore[arg-type]
    cp.to_device([1.0], "cpu")  # type: ignore[call-overload]
    cp.DataParallel(model, [x])  # type: ignore[arg-type]
    dist.all_reduce(x).wait()  # type: ignore[attr-defined]  # all_reduce(x) returns None
