"""Differentiable multi-device moves (torch's ``nn.parallel._functions``) as tape Functions."""

from cupy_parallel._src.functions import Broadcast, Gather, ReduceAddCoalesced, Scatter

__all__ = ["Broadcast", "Gather", "ReduceAddCoalesced", "Scatter"]
