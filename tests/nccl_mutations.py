"""Mutation check of the NCCL code's ordering calls and locks against the simulated CUDA.

Run ``python tests/nccl_mutations.py`` from the repository root (about a minute). It reuses the
harness of ``tests/simcuda_mutations.py`` (copy the tree, remove one call, run the tests, list the
failures) on the NCCL code: every ``wait_event``/``record``/``synchronize`` of the NCCL backend
and the three locks that serialise grouped calls and communicator set-up. The simulated NCCL
tests run with ``-x``: without a synchronisation every barrier would wait out its group's
timeout. Not collected by pytest.
"""

from __future__ import annotations

import simcuda_mutations as harness

BACKEND = "cupy_parallel/_src/distributed/nccl.py"
COMM = "cupy_parallel/_src/cuda/nccl.py"

harness.TESTS = ["-x", "-k", "sim", "tests/test_nccl.py"]
harness.MUTATIONS = [
    (BACKEND, "                    done.event.synchronize()", "                    pass"),
    (
        BACKEND,
        "                    cupy.cuda.get_current_stream().wait_event(event.event)",
        "                    pass",
    ),
    (BACKEND, "                stream.wait_event(event.event)", "                pass"),
    (
        BACKEND,
        "            wait_stream(stream, device, current_stream(device), device)",
        "            pass",
    ),
    (
        BACKEND,
        "            events.append(_Done(record_event(stream, device), device))",
        "            events.append(_Done(cupy.cuda.Event(disable_timing=True), device))",
    ),
    (
        BACKEND,
        "            with self._group_lock:  # threads never interleave their calls",
        "            with contextlib.nullcontext():",
    ),
    (
        BACKEND,
        "        with self._setup_lock:  # two threads of this rank make one set, not two",
        "        with contextlib.nullcontext():",
    ),
    (COMM, "    with _group_lock:  # until groupEnd", "    with contextlib.nullcontext():"),
]

if __name__ == "__main__":
    raise SystemExit(harness.main())
