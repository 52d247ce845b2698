"""Hypothesis strategies and assertions for property tests of multi-device code.

Needs hypothesis (a test dependency); ``import cupy_parallel`` does not import this module.
"""

from cupy_parallel._src.testing import arrays, assert_tree_equal, devices, nested_structures

__all__ = ["arrays", "assert_tree_equal", "devices", "nested_structures"]
