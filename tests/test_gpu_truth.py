"""GPU truth, third pass: what real CUDA would show, caught by the simulator (issue 37).

Each test places work where only a real GPU would go wrong (parameters off the current GPU, a
caller's stream that is not the legacy null stream, device buffers handed to an MPI library, a
batch of sends and receives that must progress together) and runs under ``simulated_cuda`` with
its race checker on, so the unordered, wrongly placed or deadlocking schedule raises there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupy_parallel import distributed as dist
from cupy_parallel.testing import simulated_cuda

# ---------------------------------------------------------------------------------------------
# batch_isend_irecv over NCCL: one group for the whole list


def _exchange(cupy: Any, rank: int, peers: list[tuple[str, int]]) -> list[np.ndarray]:
    """Rank ``rank`` sends ``10 * rank + peer`` to each send peer and receives from the others."""
    ops, received = [], []
    for kind, peer in peers:
        if kind == "send":
            payload = cupy.full(3 + peer, 10 * rank + peer, np.int32)
            ops.append(dist.P2POp(dist.isend, payload, peer))
        else:
            buffer = cupy.zeros(3 + rank, np.int32)
            received.append((peer, buffer))
            ops.append(dist.P2POp(dist.irecv, buffer, peer))
    works = dist.batch_isend_irecv(ops)
    assert len(works) == len(ops)
    for work in works:
        work.wait()
    return [cupy.asnumpy(buffer) for _, buffer in received]


def _expected(rank: int, peers: list[tuple[str, int]]) -> list[np.ndarray]:
    return [np.full(3 + rank, 10 * p + rank, np.int32) for kind, p in peers if kind == "recv"]


def _pairwise(rank: int, size: int) -> list[tuple[str, int]]:
    peer = 1 - rank
    return [("send", peer), ("recv", peer)]


def _ring(rank: int, size: int) -> list[tuple[str, int]]:
    return [("send", (rank + 1) % size), ("recv", (rank - 1) % size)]


def _mixed(rank: int, size: int) -> list[tuple[str, int]]:
    # every rank receives from all others first, then sends to all others (reverse order)
    others = [r for r in range(size) if r != rank]
    return [("recv", r) for r in others] + [("send", r) for r in reversed(others)]


@pytest.mark.parametrize(
    ("pattern", "size"),
    [(_pairwise, 2), (_ring, 2), (_ring, 3), (_ring, 4), (_mixed, 3)],
    ids=["pairwise-2", "ring-2", "ring-3", "ring-4", "mixed-3"],
)
def test_sim_batch_isend_irecv_over_nccl_launches_one_group(pattern: Any, size: int) -> None:
    with simulated_cuda(size) as cupy:

        def program(rank: int) -> list[np.ndarray]:
            return _exchange(cupy, rank, pattern(rank, size))

        results = dist.spawn(program, size, backend="nccl", timeout=5)
    for rank, got in enumerate(results):
        want = _expected(rank, pattern(rank, size))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_sim_nccl_groups_are_no_stricter_than_nccl() -> None:
    """Separate sends and receives posted in matching order complete, as NCCL's do."""
    with simulated_cuda(2) as cupy:

        def program(rank: int) -> np.ndarray:
            mine = cupy.full(4, rank + 1, np.float32)
            theirs = cupy.zeros(4, np.float32)
            if rank == 0:  # send first, then receive; rank 1 the reverse: each call matches
                dist.isend(mine, 1).wait()
                dist.irecv(theirs, 1).wait()
            else:
                dist.irecv(theirs, 0).wait()
                dist.isend(mine, 0).wait()
            return cupy.asnumpy(theirs)

        results = dist.spawn(program, 2, backend="nccl", timeout=5)
    np.testing.assert_array_equal(results[0], np.full(4, 2, np.float32))
    np.testing.assert_array_equal(results[1], np.full(4, 1, np.float32))


def test_sim_batch_over_nccl_refuses_tensors_on_two_gpus() -> None:
    with simulated_cuda(2) as cupy:

        def program(rank: int) -> str:
            with cupy.cuda.Device(1 - rank):
                other = cupy.zeros(2, np.float32)
            ops = [
                dist.P2POp(dist.isend, cupy.zeros(2, np.float32), 1 - rank),
                dist.P2POp(dist.irecv, other, 1 - rank),
            ]
            with pytest.raises(ValueError, match="one NCCL group on one GPU") as refused:
                dist.batch_isend_irecv(ops)
            return str(refused.value)

        messages = dist.spawn(program, 2, backend="nccl", timeout=5)
    assert messages[0] == (
        "batch_isend_irecv over NCCL issues its operations in one NCCL group on one GPU: "
        "p2p_op_list[1].tensor is on GPU 1, p2p_op_list[0].tensor on GPU 0."
    )
