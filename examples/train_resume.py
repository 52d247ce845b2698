r"""Train with DDP, Adam, a warm-up + cosine schedule and gradient clipping; resume after a kill.

Run on 2 ranks, allowing one restart::

    cupy-parallel launch --nproc-per-node 2 --max-restarts 1 examples/train_resume.py OUT \
        --kill-at 13

Every ``--every`` steps rank 0 saves the whole training state (parameters, optimizer, schedule,
step) with ``cupy_parallel.save``, atomically, to ``OUT/state.safetensors``. With ``--kill-at
S`` rank 1 kills itself (``SIGKILL``) at step ``S`` of the first start; the launcher stops rank
0 and starts the job again (``TORCHELASTIC_RESTART_COUNT=1``), which loads the last state and
goes on. The batches are a function of the step (not of how many steps this start ran), so the
resumed run computes exactly what an uninterrupted one does: ``OUT/final.safetensors`` holds the
same parameters, bit for bit (tests/test_examples.py checks it).
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.optim import Adam
from cupy_parallel.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

STEPS, BATCH, FEATURES, HIDDEN = 20, 32, 8, 16


def mlp(params, x):
    """A two-layer perceptron: the module function DDP replicates."""
    hidden = ops.tanh(ops.add(ops.matmul(x, params["w1"]), params["b1"]))
    return ops.add(ops.matmul(hidden, params["w2"]), params["b2"])


def initial_params():
    """The parameters of a fresh run (the same on every rank)."""
    rng = np.random.default_rng(0)
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": np.zeros(HIDDEN),
        "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": np.zeros(1),
    }


def batch(step, rank, world):
    """This rank's shard of step ``step``'s batch: a function of the step alone."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, FEATURES))
    y = np.sin(x.sum(axis=1, keepdims=True))
    share = BATCH // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def main():
    """One rank's training: resume if a state was saved, train, save the final parameters."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for state.safetensors and final.safetensors")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=-1, help="rank 1 dies at this step")
    args = parser.parse_args()
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(args.out, "state.safetensors")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    # Resume: the parameters first (the optimizer updates the arrays it is built on), then
    # the optimizer's and the schedule's state.
    state = cp.load(path) if os.path.exists(path) else None
    params = state["params"] if state is not None else initial_params()
    ddp = cp.DistributedDataParallel(mlp, params)
    opt = Adam(ddp.params, lr=1e-2, weight_decay=1e-4)
    warmup = LinearLR(opt, start_factor=0.1, total_iters=5)
    cosine = CosineAnnealingLR(opt, T_max=STEPS - 5)
    schedule = SequentialLR(opt, [warmup, cosine], milestones=[5])
    first = 0
    if state is not None:
        opt.load_state_dict(state["optim"])
        schedule.load_state_dict(state["schedule"])
        first = state["step"]
        print(f"rank {rank}: start {restart} resumed at step {first}", flush=True)

    for step in range(first, STEPS):
        if step == args.kill_at and restart == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no goodbye
        x, y = batch(step, rank, world)
        with cp.Tape() as tape:
            loss = ops.mean(ops.square(ops.subtract(ddp(x), y)))
        grads = tape.gradient(loss, ddp.params)
        grads, _norm = cp.clip_grad_norm(grads, max_norm=1.0)
        opt.step(grads)
        schedule.step()
        if (step + 1) % args.every == 0 and rank == 0:
            cp.save(
                {
                    "params": ddp.params,
                    "optim": opt.state_dict(),
                    "schedule": schedule.state_dict(),
                    "step": step + 1,
                },
                path,
            )
        dist.barrier()  # nobody runs ahead of a checkpoint being written
    if rank == 0:
        cp.save(ddp.params, os.path.join(args.out, "final.safetensors"))
        print(f"rank 0: done, loss {float(loss):.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
