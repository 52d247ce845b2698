"""The description of one rank's rows of an array sharded along dim 0.

Sharded training (ZeRO, FSDP) and the distributed checkpoint meet here: a sharded state dict holds a
:class:`Shard` where a replicated one holds an array, and the checkpoint writes and reshards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Shard"]


@dataclass(frozen=True)
class Shard:
    """This rank's rows ``offset : offset + len(local)`` of an array of ``global_shape``.

    ``local`` holds only real rows (no padding): a rank past the end of a short array holds zero
    rows. Every other dimension of ``local`` equals that of ``global_shape``; ``local`` is
    written in place when a checkpoint is loaded into it.

    Example:
        >>> import numpy as np
        >>> s = Shard(np.zeros((2, 3)), offset=4, global_shape=(6, 3))
        >>> s.rows
        range(4, 6)
    """

    local: Any
    offset: int
    global_shape: tuple[int, ...]

    @property
    def rows(self) -> range:
        """The rows of the global array that ``local`` holds."""
        return range(self.offset, self.offset + int(self.local.shape[0]))
