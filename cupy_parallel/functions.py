"""Differentiable multi-device moves (torch's ``nn.parallel._functions``) as tape Functions."""

from cupy_parallel._src.exports import set_module
from cupy_parallel._src.moves import Broadcast, Gather, ReduceAddCoalesced, Scatter

__all__ = ["Broadcast", "Gather", "ReduceAddCoalesced", "Scatter"]

set_module(__name__, globals(), __all__)
