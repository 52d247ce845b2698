"""Array-level multi-device primitives, as ``torch.cuda.comm`` / ``torch.nn.parallel.comm``.

``broadcast``, ``broadcast_coalesced``, ``reduce_add``, ``reduce_add_coalesced``, ``scatter`` and
``gather`` move NumPy, host-device and CuPy arrays between devices; see each function's
docstring for the decisions where torch's behaviour needed pinning down.
"""

from cupy_parallel._src.comm import (
    DEFAULT_BUFFER_SIZE,
    broadcast,
    broadcast_coalesced,
    gather,
    reduce_add,
    reduce_add_coalesced,
    scatter,
)
from cupy_parallel._src.exports import set_module

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "broadcast",
    "broadcast_coalesced",
    "gather",
    "reduce_add",
    "reduce_add_coalesced",
    "scatter",
]

set_module(__name__, globals(), __all__)
