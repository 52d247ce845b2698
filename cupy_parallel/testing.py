"""Tools for testing multi-device code: hypothesis strategies, tree checks, a simulated CUDA.

:func:`simulated_cuda` is a stand-in CUDA whose streams, events, pools and NCCL follow CUDA's
ordering rules and report every race (:class:`RaceError`).

The strategies (``arrays``, ``devices``, ``nested_structures``, ``rank_arrays``),
``assert_tree_equal`` and ``assert_distributed_matches`` (a distributed function on thread ranks
against a one-process oracle) need hypothesis, which ``pip install 'cupy-parallel[hypothesis]'``
brings; they are imported on first use, so ``import cupy_parallel.testing`` (and
:func:`simulated_cuda`) works without it and names the extra when one is used.

Example:
    >>> import numpy as np
    >>> import cupy_parallel.testing as cpt
    >>> cpt.assert_tree_equal({"x": np.arange(3)}, {"x": np.arange(3)})
    >>> cpt.assert_tree_equal({"x": np.arange(3)}, {"x": np.zeros(3)})
    Traceback (most recent call last):
    ...
    AssertionError: ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.exports import set_module
from cupy_parallel._src.simcuda import RaceError, simulated_cuda

if TYPE_CHECKING:
    from cupy_parallel._src.distributed_testing import assert_distributed_matches, rank_arrays
    from cupy_parallel._src.testing import (
        arrays,
        assert_tree_equal,
        devices,
        nested_structures,
    )

__all__ = [
    "RaceError",
    "arrays",
    "assert_distributed_matches",
    "assert_tree_equal",
    "devices",
    "nested_structures",
    "rank_arrays",
    "simulated_cuda",
]

set_module(__name__, globals(), __all__)

# The names that need hypothesis -> the module defining them (imported on first use).
_NEEDS_HYPOTHESIS = {
    "arrays": "cupy_parallel._src.testing",
    "assert_tree_equal": "cupy_parallel._src.testing",
    "devices": "cupy_parallel._src.testing",
    "nested_structures": "cupy_parallel._src.testing",
    "assert_distributed_matches": "cupy_parallel._src.distributed_testing",
    "rank_arrays": "cupy_parallel._src.distributed_testing",
}


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_HYPOTHESIS:
        raise AttributeError(f"module 'cupy_parallel.testing' has no attribute {name!r}")
    try:
        module = importlib.import_module(_NEEDS_HYPOTHESIS[name])
    except ModuleNotFoundError as error:
        if error.name != "hypothesis":
            raise
        raise ModuleNotFoundError(
            f"cupy_parallel.testing.{name} needs hypothesis, which is not installed; install it "
            "with: pip install 'cupy-parallel[hypothesis]'",
            name="hypothesis",
        ) from error
    value = getattr(module, name)
    set_module(__name__, {name: value}, [name])
    globals()[name] = value
    return value
