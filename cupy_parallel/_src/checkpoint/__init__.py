"""Distributed checkpoints: each rank writes its own slices; a load reshards them (torch DCP)."""
