"""torch's ``ddp_comm_hooks.default_hooks``: average a bucket, in full or compressed precision.

Each is ``hook(process_group, bucket)`` (``process_group`` ``None``: the default group) and
returns a future of the reduced bucket buffer, for
``DistributedDataParallel.register_comm_hook(process_group, hook)``.

Example:
    >>> from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks
    >>> sorted(default_hooks.__all__)
    ['allreduce_hook', 'bf16_compress_hook', 'fp16_compress_hook']
"""

from cupy_parallel._src.distributed.comm_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from cupy_parallel._src.exports import set_module

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]

set_module(__name__, globals(), __all__)
