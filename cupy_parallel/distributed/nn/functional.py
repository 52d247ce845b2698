"""Differentiable collectives, torch.distributed.nn.functional's: out of place, on the tape.

A rank's gradient is the gradient, with respect to that rank's inputs, of the sum over the
ranks of the ranks' losses (torch's and JAX's convention); every rank of the group must take
part in the backward pass (see :mod:`cupy_parallel._src.distributed.nn_functional`).

Example:
    >>> import numpy as np
    >>> from cupy_parallel import distributed as dist
    >>> from cupy_parallel.distributed.nn import functional as F
    >>> dist.init_process_group("mpi")  # under `mpiexec -n N` every rank runs this
    >>> F.all_gather(np.array([1.0, 2.0]))  # one array per rank (a world of one here)
    (array([1., 2.]),)
    >>> dist.destroy_process_group()
"""

from cupy_parallel._src.distributed.nn_functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from cupy_parallel._src.exports import set_module

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]

set_module(__name__, globals(), __all__)
