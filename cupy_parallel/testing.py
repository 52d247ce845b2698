"""Hypothesis strategies and assertions for multi-device property tests; a simulated CUDA.

Needs hypothesis (a test dependency); ``import cupy_parallel`` does not import this module.
"""

from cupy_parallel._src.simcuda import RaceError, simulated_cuda
from cupy_parallel._src.testing import arrays, assert_tree_equal, devices, nested_structures

__all__ = [
    "RaceError",
    "arrays",
    "assert_tree_equal",
    "devices",
    "nested_structures",
    "simulated_cuda",
]
