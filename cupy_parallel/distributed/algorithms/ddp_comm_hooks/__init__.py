"""DDP communication hooks, at torch's path: ``GradBucket`` and ``default_hooks``.

``DistributedDataParallel.register_comm_hook(state, hook)`` takes them; see
:mod:`cupy_parallel.distributed.algorithms.ddp_comm_hooks.default_hooks`.

Example:
    >>> from cupy_parallel.distributed.algorithms.ddp_comm_hooks import GradBucket
    >>> GradBucket.__module__
    'cupy_parallel.distributed.algorithms.ddp_comm_hooks'
"""

from cupy_parallel._src.distributed.comm_hooks import GradBucket
from cupy_parallel._src.exports import set_module
from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["GradBucket", "default_hooks"]

set_module(__name__, globals(), __all__)
