"""torch.distributed.optim for cupy_parallel: ``ZeroRedundancyOptimizer`` (ZeRO-1).

Example:
    >>> from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
    >>> ZeroRedundancyOptimizer.__module__
    'cupy_parallel.distributed.optim'
"""

from cupy_parallel._src.exports import set_module
from cupy_parallel._src.sharded.zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]

set_module(__name__, globals(), __all__)
