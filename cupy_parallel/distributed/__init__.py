"""torch.distributed's process-group API for NumPy, HostArray and CuPy arrays.

Backends: ``"mpi"`` (mpi4py; any host array, CuPy arrays too) and ``"nccl"`` (CuPy arrays).
Collectives work in place on their arguments, as in torch; ``async_op=True`` returns a
:class:`Work`. Stores (:class:`TCPStore`, :class:`FileStore`, :class:`PrefixStore`) let NCCL ranks
meet (``init_method`` ``env://``, ``tcp://host:port``, ``file:///path``).

Example:
    >>> from cupy_parallel import distributed as dist
    >>> dist.init_process_group("mpi")  # under `mpiexec -n N` every rank runs this
    >>> x = np.full(2, float(dist.get_rank() + 1))
    >>> dist.all_reduce(x)
    >>> x  # the sum over the world (a world of one here)
    array([1., 1.])
    >>> dist.destroy_process_group()
"""

from cupy_parallel._src.distributed.collectives import (
    all_gather,
    all_gather_coalesced,
    all_gather_multigpu,
    all_reduce,
    all_reduce_coalesced,
    all_reduce_multigpu,
    all_to_all,
    barrier,
    broadcast,
    broadcast_multigpu,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_multigpu,
    reduce_scatter,
    reduce_scatter_multigpu,
    scatter,
    send,
)
from cupy_parallel._src.distributed.enums import Backend, ReduceOp
from cupy_parallel._src.distributed.groups import (
    GroupMember,
    ProcessGroup,
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    new_group,
)
from cupy_parallel._src.distributed.store import (
    DistError,
    DistNetworkError,
    DistStoreError,
    FileStore,
    HashStore,
    PrefixStore,
    QueueEmptyError,
    Store,
    TCPStore,
)
from cupy_parallel._src.distributed.work import Work

__all__ = [
    "Backend",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "PrefixStore",
    "ProcessGroup",
    "QueueEmptyError",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_multigpu",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_multigpu",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "isend",
    "new_group",
    "recv",
    "reduce",
    "reduce_multigpu",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "scatter",
    "send",
]
