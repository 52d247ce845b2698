"""torch.distributed's process-group API for NumPy, HostArray and CuPy arrays.

Backends: ``"mpi"`` (mpi4py; any host array, CuPy arrays too) and ``"nccl"`` (CuPy arrays).
torch 1.5's API plus PyTorch 2's additions (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_to_all_single``, the ``*_object`` collectives, ``batch_isend_irecv``, ``monitored_barrier``,
``get_process_group_ranks``/``get_global_rank``/``get_group_rank``, ``ReduceOp.BAND/BOR/BXOR``).
``CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL`` makes the ranks compare every collective's arguments.
Collectives work in place on their arguments, as in torch; ``async_op=True`` returns a
:class:`Work`. Stores (:class:`TCPStore`, :class:`FileStore`, :class:`PrefixStore`) let NCCL ranks
meet (``init_method`` ``env://``, ``tcp://host:port``, ``file:///path``). :func:`spawn` runs a
distributed function on ranks that are threads of this process (notebooks, tests).

Example:
    >>> import numpy as np
    >>> from cupy_parallel import distributed as dist
    >>> dist.init_process_group("mpi")  # under `mpiexec -n N` every rank runs this
    >>> x = np.full(2, float(dist.get_rank() + 1))
    >>> dist.all_reduce(x)
    >>> x  # the sum over the world (a world of one here)
    array([1., 1.])
    >>> dist.destroy_process_group()
"""

from cupy_parallel._src.distributed.barriers import barrier, monitored_barrier
from cupy_parallel._src.distributed.exchanges import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_to_all,
    all_to_all_single,
)
from cupy_parallel._src.distributed.groups import (
    GroupMember,
    ProcessGroup,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    new_group,
)
from cupy_parallel._src.distributed.multigpu import (
    all_gather_multigpu,
    all_reduce_multigpu,
    broadcast_multigpu,
    reduce_multigpu,
    reduce_scatter_multigpu,
)
from cupy_parallel._src.distributed.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from cupy_parallel._src.distributed.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from cupy_parallel._src.distributed.reductions import (
    all_reduce,
    all_reduce_coalesced,
    reduce_scatter,
    reduce_scatter_tensor,
)
from cupy_parallel._src.distributed.rooted import broadcast, gather, reduce, scatter
from cupy_parallel._src.distributed.sampling import shard_indices
from cupy_parallel._src.distributed.spawn import spawn
from cupy_parallel._src.distributed.store import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    FileStore,
    HashStore,
    PrefixStore,
    QueueEmptyError,
    Store,
    TCPStore,
)
from cupy_parallel._src.distributed.work import Work
from cupy_parallel._src.enums import Backend, ReduceOp
from cupy_parallel._src.exports import set_module

__all__ = [
    "Backend",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "QueueEmptyError",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_multigpu",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_multigpu",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_multigpu",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "shard_indices",
    "spawn",
]

set_module(__name__, globals(), __all__)
