"""Mutation check of the NCCL code's ordering calls and locks against the simulated CUDA.

Run ``python tests/nccl_mutations.py`` from the repository root (about a minute). It reuses the
harness of ``tests/simcuda_mutations.py`` (copy the tree, remove one call, run the tests, list the
failures) on the NCCL code: every ``wait_event``/``record``/``synchronize`` of the NCCL backend
and the three locks that serialise grouped calls and communicator set-up (each user's lock
given to its :class:`~cupy_parallel._src.cuda.nccl_runtime.Communicators`). The simulated NCCL
tests run with ``-x``: without a synchronisation every barrier would wait out its group's
timeout. Not collected by pytest.
"""

from __future__ import annotations

import simcuda_mutations as harness

BACKEND = "cupy_parallel/_src/distributed/nccl_backend.py"
COMM = "cupy_parallel/_src/cuda/nccl_comm.py"
RUNTIME = "cupy_parallel/_src/cuda/nccl_runtime.py"
WORK = "cupy_parallel/_src/distributed/work.py"

harness.TESTS = ["-x", "-k", "sim", "tests/test_nccl.py", "tests/test_gpu_truth.py"]
harness.MUTATIONS = [
    (BACKEND, "                    done.synchronize()", "                    pass"),
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
        "            launch_lock=threading.Lock(),  # held from groupStart to groupEnd",
        "            launch_lock=contextlib.nullcontext(),",
    ),
    (
        BACKEND,
        "            setup_lock=threading.Lock(),  # two threads of this rank make one set",
        "            setup_lock=contextlib.nullcontext(),",
    ),
    (
        COMM,
        "    launch_lock=_lock,  # held from groupStart to groupEnd (torch's AutoNcclGroup)",
        "    launch_lock=__import__('contextlib').nullcontext(),",
    ),
    # batch_isend_irecv's one group: without it each operation is a launch of its own.
    (
        BACKEND,
        (
            "    def batch_p2p(self, ops: Sequence[tuple[bool, Any, int | None, int, str]], /) "
            "-> list[Work]:"
        ),
        "    def _unused_batch_p2p(self, ops: Any, /) -> list[Work]:",
    ),
    # DDP's hooks, polls and waits on the bucket's GPU (not the thread's current one).
    (
        "cupy_parallel/_src/ddp.py",
        "    device = cuda_device(plain_buffer(buffer))",
        "    device = None",
    ),
    # Work.get_future(): the helper on the caller's streams, events for the value, waits on them.
    (WORK, "                current_stream(device).wait_event(event)", "                pass"),
    (WORK, "                self._order_current()", "                pass"),
    (
        WORK,
        "                    child._record_ready(tuple(device for device, _ in self._ready))",
        "                    pass",
    ),
    (
        WORK,
        "                        on_streams.enter_context(handoff)",
        "                        pass",
    ),
    (
        WORK,
        "                                    current_stream(device).synchronize()",
        "                                    pass",
    ),
    (WORK, "                        future._record_ready(devices)", "                        pass"),
    # The shared mechanism itself (what every user's lock above goes through).
    (RUNTIME, "        with self._launch_lock:  # until groupEnd", "        if True:"),
    (
        RUNTIME,
        "        with self._setup_lock:  # two threads make one set, not two",
        "        if True:",
    ),
]

if __name__ == "__main__":
    raise SystemExit(harness.main())
