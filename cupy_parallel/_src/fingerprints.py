"""``Tape(check_writes=True)``: in-place writes into recorded NumPy and CuPy arrays, caught.

The library cannot see operations on NumPy and CuPy arrays (host arrays have version counters,
checked by the recording itself). With ``check_writes``, the tape's node list fingerprints
(CRC-32) every such array each recorded operation touched, and :meth:`Tape.gradient
<cupy_parallel.Tape.gradient>` verifies them before it runs.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.hostarray import HostArray
from cupy_parallel._src.recording import Node, op_name

__all__ = ["FingerprintedNodes"]


class FingerprintedNodes(list[Node]):
    """The node list of a ``Tape(check_writes=True)``: fingerprints what each node touched.

    Every NumPy and CuPy array among a node's inputs and outputs gets a CRC-32 of its bytes when
    the node is appended (host arrays have version counters instead); :meth:`verify` recomputes
    them. Recording appends through ``list.append``, so ordinary tapes pay nothing for this.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fingerprints: list[tuple[tuple[int, Any, int], ...]] = []

    def append(self, node: Node, /) -> None:
        arrays = (*node[1], *node[3])
        self.fingerprints.append(
            tuple((i, a, _fingerprint(a)) for i, a in enumerate(arrays) if _has_bytes(a))
        )
        super().append(node)

    def verify(self) -> None:
        """Raise ``RuntimeError`` naming the first node whose array's bytes changed."""
        for node, prints in zip(self, self.fingerprints, strict=True):
            for i, a, crc in prints:
                if _fingerprint(a) != crc:
                    count = len(node[1])
                    where = f"input {i}" if i < count else f"output {i - count}"
                    op = op_name(node[0], node[4])
                    raise RuntimeError(
                        f"Tape(check_writes=True): an array {op} recorded was modified in place: "
                        f"its {where} (shape {a.shape}, on {device_of(a)}) no longer holds the "
                        f"values {op} saw, so the gradient would be computed from other data. "
                        "Write into a copy, or compute a new array with cupy_parallel.ops."
                    )


def _has_bytes(x: Any) -> bool:
    """Whether ``x`` is an array ``check_writes`` fingerprints (NumPy or CuPy)."""
    return isinstance(x, np.ndarray) or (is_array(x) and type(x) is not HostArray)


def _fingerprint(x: Any) -> int:
    data = x if isinstance(x, np.ndarray) else x.get()
    return zlib.crc32(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
