"""torch.distributed.nn for cupy_parallel: the differentiable collectives (``functional``).

Example:
    >>> from cupy_parallel.distributed.nn import functional
    >>> functional.all_reduce.__module__
    'cupy_parallel.distributed.nn.functional'
"""

from cupy_parallel.distributed.nn import functional

__all__ = ["functional"]
