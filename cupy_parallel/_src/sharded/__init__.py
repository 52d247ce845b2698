"""Sharded data parallelism on the tape: ZeRO-1 (ZeroRedundancyOptimizer) and FSDP (ZeRO-3)."""
