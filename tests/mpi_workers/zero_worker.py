"""Run by ``mpiexec -n N python zero_worker.py``: ZeroRedundancyOptimizer against DDP + optimizer.

Every ``check_*`` function is a plain function of the default process group, so the same checks
run on thread ranks (``rank_main``, see tests/thread_ranks.py), MPI or NCCL. The oracles, every
rank computing them itself: ``DistributedDataParallel`` with the unsharded optimizer on its own
copy of the parameters (the same gradients: the parameters must agree to 1e-12 in float64,
step for step), and a one-process run on the whole batch (a plain Tape, the same optimizer).

``rank_main(rank, [mode])`` runs the checks of ``mode`` and prints ``rank r: N checks passed``
(1 on a failure): ``all`` (NumPy and host arrays), ``cupy`` (CuPy arrays in the running world:
NCCL thread ranks under ``simulated_cuda``). ``main()`` is ``rank_main`` under ``mpiexec``.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np
from common import run_checks  # this directory: the worker runs as a script
from ddp_worker import (
    F64,
    Setting,
    close,
    data,
    loss_of,
    make_params,
    mlp,
    numpy_of,
    raises_everywhere,
    shard,
)

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
from cupy_parallel.optim import SGD, Adam, AdamW

STEPS = 4


def _copy(params: Any, s: Setting) -> Any:
    """A copy of ``params`` as ``s``'s arrays (fresh arrays, the same values)."""
    return s.put(
        cp._src.tree.tree_map(lambda a: numpy_of(a).copy() if cp.is_array(a) else a, params)
    )


def _groups(params: dict[str, Any]) -> list[dict[str, Any]]:
    """Two param groups: the layers with weight decay, the rest without (torch's usual split)."""
    return [
        {"params": params["layers"], "weight_decay": 0.1},
        {"params": {"extra": params["extra"], "unused": params["unused"]}, "weight_decay": 0.0},
    ]


def _grouped(grads: dict[str, Any]) -> list[Any]:
    return [grads["layers"], {"extra": grads["extra"], "unused": grads["unused"]}]


OPTIMIZERS: dict[str, tuple[type, dict[str, Any], bool]] = {
    # name: (class, hyper-parameters, with param groups)
    "adamw-groups": (AdamW, {"lr": 0.01, "amsgrad": True}, True),
    "adam": (Adam, {"lr": 0.02, "weight_decay": 0.01}, False),
    "sgd-nesterov": (SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, False),
}


def _build(name: str, params: dict[str, Any], *, zero: bool, sync: str = "broadcast") -> Any:
    cls, hyper, grouped = OPTIMIZERS[name]
    tree = _groups(params) if grouped else params
    if zero:
        return ZeroRedundancyOptimizer(tree, cls, param_sync=sync, **hyper)
    return cls(tree, **hyper)


def _ddp_grads(ddp: Any, grouped: bool, step: int, s: Setting) -> Any:
    x, y = data()
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = s.put(shard(x, rank, world)), s.put(shard(y, rank, world))
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ops.subtract(ddp(xs, extra=step % 2 == 1), ys)))
    grads = tape.gradient(loss, ddp.params)
    if step == 2:  # a parameter without a gradient this step: skipped, its state untouched
        grads = {**grads, "extra": None}
    return _grouped(grads) if grouped else grads


def _one_process_grads(params: dict[str, Any], grouped: bool, step: int) -> Any:
    x, y = data()
    with cp.Tape() as tape:
        tape.watch(params)
        loss = loss_of(params, x, y, extra=step % 2 == 1)
    grads = tape.gradient(loss, params)
    if step == 2:
        grads = {**grads, "extra": None}
    return _grouped(grads) if grouped else grads


def check_equals_ddp_and_one_process(s: Setting, name: str, sync: str) -> None:
    """ZeRO-1 == DDP + the optimizer (1e-12, every step) == one process on the whole batch."""
    grouped = OPTIMIZERS[name][2]
    start = make_params(s=F64)
    zp, rp, op = _copy(start, s), _copy(start, s), _copy(start, F64)
    zddp, rddp = cp.DistributedDataParallel(mlp, zp), cp.DistributedDataParallel(mlp, rp)
    zero = _build(name, zp, zero=True, sync=sync)
    ref, one = _build(name, rp, zero=False), _build(name, op, zero=False)
    for step in range(STEPS):
        zero.step(_ddp_grads(zddp, grouped, step, s))
        ref.step(_ddp_grads(rddp, grouped, step, s))
        one.step(_one_process_grads(op, grouped, step))
        close(zp, rp, f"{name}/{sync} step {step}: ZeRO vs DDP")
        close(zp, op, f"{name}/{sync} step {step}: ZeRO vs one process")
    # the state is partitioned: this rank's local optimizer holds its own parameters' only,
    # each parameter owned once; the state's elements are the partition's times the arrays
    # per parameter (AdamW amsgrad 3, Adam 2, SGD 1), where DDP's optimizer holds all of them
    size = sum(int(p.size) for g in zero.optim.param_groups for p in g["params"])
    owned: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(owned, size)
    total = sum(int(p.size) for g in zero.param_groups for p in g["params"])
    assert sum(owned) == total, (owned, total)
    per = {"adamw-groups": 3, "adam": 2, "sgd-nesterov": 1}[name]

    def elements(opt: Any) -> int:
        return sum(int(v.size) for e in opt.state.values() for v in e.values() if cp.is_array(v))

    assert elements(zero.optim) == per * size, (elements(zero.optim), per, size)
    assert elements(ref) == per * total


def check_consolidated_state_dict_is_the_unsharded_one(s: Setting = F64) -> None:
    start = make_params(s=F64)
    zp, rp = _copy(start, s), _copy(start, s)
    zddp, rddp = cp.DistributedDataParallel(mlp, zp), cp.DistributedDataParallel(mlp, rp)
    zero, ref = _build("adamw-groups", zp, zero=True), _build("adamw-groups", rp, zero=False)
    for step in range(STEPS):
        zero.step(_ddp_grads(zddp, True, step, s))
        ref.step(_ddp_grads(rddp, True, step, s))
    world, rank = dist.get_world_size(), dist.get_rank()
    to = world - 1
    zero.consolidate_state_dict(to=to)
    if rank != to:
        raises_everywhere(RuntimeError, f"consolidate_state_dict(to={rank})", zero.state_dict)
        return
    got, want = zero.state_dict(), ref.state_dict()
    assert got["param_groups"] == want["param_groups"], (got["param_groups"], want["param_groups"])
    assert sorted(got["state"]) == sorted(want["state"]), (
        sorted(got["state"]),
        sorted(want["state"]),
    )
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            if cp.is_array(value):
                assert isinstance(got["state"][index][key], np.ndarray)
                close(got["state"][index][key], value, f"state {index} {key}")
            else:
                assert got["state"][index][key] == value, (index, key)


def check_load_state_dict_of_any_world_size_continues_alike(s: Setting = F64) -> None:
    """An unsharded optimizer's state dict (a world of one's) loads, and training continues."""
    start = make_params(s=F64)
    op = _copy(start, F64)
    one = _build("adamw-groups", op, zero=False)
    for step in range(STEPS):
        one.step(_one_process_grads(op, True, step))
    saved = copy.deepcopy(one.state_dict())
    saved["param_groups"][0]["lr"] = 0.005  # hyper-parameters come from the state dict too
    one.load_state_dict(saved)
    zp = _copy(op, s)
    zddp = cp.DistributedDataParallel(mlp, zp)
    zero = _build("adamw-groups", zp, zero=True)
    zero.load_state_dict(saved)
    assert zero.param_groups[0]["lr"] == 0.005
    assert zero.optim.param_groups[0]["lr"] == 0.005
    for step in range(STEPS, 2 * STEPS):
        zero.step(_ddp_grads(zddp, True, step, s))
        one.step(_one_process_grads(op, True, step))
        close(zp, op, f"resumed step {step}")
    # and a consolidated ZeRO state dict round-trips through load_state_dict on every rank
    zero.consolidate_state_dict(to=0)
    whole = [zero.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(whole, src=0)
    again = _build("adamw-groups", _copy(zp, s), zero=True)
    again.load_state_dict(whole[0])
    again.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        for index, entry in whole[0]["state"].items():
            close(again.state_dict()["state"][index], entry, f"reloaded state {index}")


def check_scheduler_lr_reaches_the_local_optimizer(s: Setting = F64) -> None:
    from cupy_parallel.optim.lr_scheduler import StepLR

    start = make_params(s=F64)
    zp, rp = _copy(start, s), _copy(start, s)
    zddp, rddp = cp.DistributedDataParallel(mlp, zp), cp.DistributedDataParallel(mlp, rp)
    zero, ref = _build("adam", zp, zero=True), _build("adam", rp, zero=False)
    zs, rs = StepLR(zero, step_size=1, gamma=0.5), StepLR(ref, step_size=1, gamma=0.5)
    for step in range(STEPS):
        zero.step(_ddp_grads(zddp, False, step, s))
        ref.step(_ddp_grads(rddp, False, step, s))
        zs.step()
        rs.step()
        close(zp, rp, f"scheduled step {step}")
    assert zero.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 0.02 * 0.5**STEPS


def check_differing_parameters_raise_on_every_rank(s: Setting = F64) -> None:
    params = make_params(s=s)
    if dist.get_rank() == dist.get_world_size() - 1:
        params["extra"] = s.put(np.zeros(4))
    raises_everywhere(
        ValueError,
        "shapes, dtypes and devices differ",
        lambda: ZeroRedundancyOptimizer(params, Adam),
    )


def checks() -> list[tuple[Any, tuple[Any, ...]]]:
    out: list[tuple[Any, tuple[Any, ...]]] = []
    for kind in ("cpu", "host"):
        s = Setting(kind)
        for name in OPTIMIZERS:
            for sync in ("all_gather", "broadcast", "broadcast_packed"):
                if kind == "host" and name != "adamw-groups":
                    continue
                out.append((check_equals_ddp_and_one_process, (s, name, sync)))
    out += [
        (check_consolidated_state_dict_is_the_unsharded_one, (F64,)),
        (check_consolidated_state_dict_is_the_unsharded_one, (Setting("host"),)),
        (check_load_state_dict_of_any_world_size_continues_alike, (F64,)),
        (check_scheduler_lr_reaches_the_local_optimizer, (F64,)),
        (check_differing_parameters_raise_on_every_rank, (F64,)),
    ]
    return out


def cupy_checks() -> list[tuple[Any, tuple[Any, ...]]]:
    s = Setting("cupy")
    return [
        (check_equals_ddp_and_one_process, (s, "adamw-groups", "all_gather")),
        (check_equals_ddp_and_one_process, (s, "sgd-nesterov", "broadcast")),
        (check_equals_ddp_and_one_process, (s, "adam", "broadcast_packed")),
        (check_consolidated_state_dict_is_the_unsharded_one, (s,)),
        (check_load_state_dict_of_any_world_size_continues_alike, (s,)),
    ]


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(rank: int, argv: list[str]) -> int:
    """One rank's program (``rank`` is unused: the world says); see the module."""
    mode = argv[0] if argv else "all"
    return run_checks(checks if mode == "all" else cupy_checks)


if __name__ == "__main__":
    sys.exit(main())
