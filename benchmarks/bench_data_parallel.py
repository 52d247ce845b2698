"""Data-parallel MLP train step on 4 devices vs the same step on one device.

``train_step_benchmark(quick)`` times one SGD step (forward, loss, ``Tape.gradient``, update) of a
two-layer tanh MLP, once with :func:`cupy_parallel.data_parallel` over 4 devices (4 host devices
on the host platform, up to 4 GPUs on CUDA) and once on a single device with a plain tape, and
checks that both give the same gradients. ``benchmarks/bench_tape.py`` reports it as its part (b);
run it alone with ``python benchmarks/bench_data_parallel.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import optree

from cupy_parallel._src import ops
from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.devices import devices, platform, set_host_device_count
from cupy_parallel._src.parallel import data_parallel
from cupy_parallel._src.tape import Tape

NS = "cupy_parallel"
DEVICES = 4
# (batch, features, hidden, outputs, timed repeats)
QUICK = (512, 32, 64, 8, 5)
FULL = (4096, 64, 256, 16, 10)


def _mlp(params: dict[str, Any], x: Any) -> Any:
    hidden = ops.tanh(ops.add(ops.matmul(x, params["w1"]), params["b1"]))
    return ops.add(ops.matmul(hidden, params["w2"]), params["b2"])


def _mse(prediction: Any, target: Any) -> Any:
    return ops.mean(ops.square(ops.subtract(prediction, target)))


def _step(forward: Any, params: dict[str, Any], x: Any, y: Any, lr: float = 0.05) -> Any:
    with Tape() as tape:
        tape.watch(params)
        loss = _mse(forward(params, x), y)
    grads = tape.gradient(loss, params)
    updated = {k: params[k] - lr * grads[k] for k in params}
    return loss, grads, updated


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm-up: memory pools, thread start-up, BLAS
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_step_benchmark(quick: bool) -> dict[str, Any]:
    """Median seconds of one data-parallel train step on 4 devices and on one device.

    Returns a dict with ``platform``, ``devices`` (the data-parallel device names), ``batch``,
    ``sizes`` (features, hidden, outputs), ``dtype``, ``repeats``, ``one_device_s``,
    ``data_parallel_s``, ``ratio`` (``data_parallel_s / one_device_s``: below 1 means the
    data-parallel step is faster), ``max_grad_diff`` (largest absolute gradient difference
    between the two steps, a correctness check) and ``loss``.
    """
    batch, features, hidden, outputs, repeats = QUICK if quick else FULL
    previous = len(devices()) if platform() == "host" else None
    if previous is not None and previous < DEVICES:
        set_host_device_count(DEVICES)
    try:
        ids = devices()[:DEVICES]
        first = ids[0]
        rng = np.random.default_rng(0)
        params = {
            "w1": rng.standard_normal((features, hidden)) / np.sqrt(features),
            "b1": np.zeros(hidden),
            "w2": rng.standard_normal((hidden, outputs)) / np.sqrt(hidden),
            "b2": np.zeros(outputs),
        }
        params = optree.tree_map(lambda a: to_device(a, first), params, namespace=NS)
        x = to_device(rng.standard_normal((batch, features)), first)
        y = to_device(rng.standard_normal((batch, outputs)), first)

        def parallel_forward(p: Any, xb: Any) -> Any:
            return data_parallel(_mlp, p, (xb,), ids)

        loss, grads_dp, _ = _step(parallel_forward, params, x, y)
        _, grads_one, _ = _step(_mlp, params, x, y)
        max_diff = max(
            float(
                np.max(
                    np.abs(
                        np.asarray(to_device(grads_dp[k], "cpu"))
                        - np.asarray(to_device(grads_one[k], "cpu"))
                    )
                )
            )
            for k in params
        )
        one_s = _median_seconds(lambda: _step(_mlp, params, x, y), repeats)
        dp_s = _median_seconds(lambda: _step(parallel_forward, params, x, y), repeats)
    finally:
        if previous is not None and previous < DEVICES:
            set_host_device_count(previous)
    return {
        "platform": first.kind,
        "devices": [str(d) for d in ids],
        "batch": batch,
        "sizes": [features, hidden, outputs],
        "dtype": "float64",
        "repeats": repeats,
        "one_device_s": one_s,
        "data_parallel_s": dp_s,
        "ratio": dp_s / one_s,
        "max_grad_diff": max_diff,
        "loss": float(np.asarray(to_device(loss, "cpu"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    print(json.dumps(train_step_benchmark(args.quick), indent=2))


if __name__ == "__main__":
    main()
