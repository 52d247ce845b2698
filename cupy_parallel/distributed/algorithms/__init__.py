"""torch.distributed.algorithms' path: ``ddp_comm_hooks`` for DistributedDataParallel.

Example:
    >>> from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks
    >>> default_hooks.allreduce_hook.__name__
    'allreduce_hook'
"""

from cupy_parallel.distributed.algorithms import ddp_comm_hooks

__all__ = ["ddp_comm_hooks"]
