"""cupy_parallel: PyTorch's multi-device layer for CuPy and NumPy arrays, without torch.

The whole public API is re-exported here and in the public submodules ``comm``, ``functions``,
``ops``, ``distributed``, ``optim`` and ``testing``; the code lives in ``cupy_parallel._src``, in
layers that import one way (its docstring lists them).
``distributed``, ``optim`` and ``testing`` are imported on first access, and so is
``DistributedDataParallel`` (it imports ``distributed``, never ``mpi4py``); ``testing`` is not in
``__all__`` (its strategies need hypothesis, an extra), so ``from cupy_parallel import *`` never
imports it.

Example:
    >>> import cupy_parallel as cp
    >>> import numpy as np, cupy_parallel as cp
    >>> cp.set_host_device_count(2)
    >>> chunks = cp.scatter({"x": np.arange(6.0)}, ["host:0", "host:1"])
    >>> [str(cp.device_of(c["x"])) for c in chunks]
    ['host:0', 'host:1']
    >>> cp.gather(chunks, "cpu")
    {'x': array([0., 1., 2., 3., 4., 5.])}
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cupy_parallel import comm, functions, ops
from cupy_parallel._src.arrays import Array, array_namespace, device_of, empty, is_array
from cupy_parallel._src.devices import Device, as_device, devices, platform, set_host_device_count
from cupy_parallel._src.exports import set_module
from cupy_parallel._src.function import Function, FunctionContext
from cupy_parallel._src.functional import grad, value_and_grad
from cupy_parallel._src.gradcheck import GradcheckError, gradcheck
from cupy_parallel._src.hostarray import HostArray
from cupy_parallel._src.memory import HostMemoryPool, get_host_memory_pool
from cupy_parallel._src.moves import to_device
from cupy_parallel._src.nested import gather, scatter, scatter_kwargs
from cupy_parallel._src.optim.clip import clip_grad_norm
from cupy_parallel._src.parallel import DataParallel, data_parallel, parallel_apply, replicate
from cupy_parallel._src.serialization import load, save
from cupy_parallel._src.tape import Tape, stop_gradient

if TYPE_CHECKING:
    from types import ModuleType

    from cupy_parallel import distributed, optim
    from cupy_parallel import testing as testing
    from cupy_parallel._src.ddp import DistributedDataParallel as DistributedDataParallel
    from cupy_parallel._src.sharded.fsdp import (
        FullyShardedDataParallel as FullyShardedDataParallel,
    )

__version__ = "0.1.0"

__all__ = [
    "Array",
    "DataParallel",
    "Device",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "Function",
    "FunctionContext",
    "GradcheckError",
    "HostArray",
    "HostMemoryPool",
    "Tape",
    "__version__",
    "array_namespace",
    "as_device",
    "clip_grad_norm",
    "comm",
    "data_parallel",
    "device_of",
    "devices",
    "distributed",
    "empty",
    "functions",
    "gather",
    "get_host_memory_pool",
    "grad",
    "gradcheck",
    "is_array",
    "load",
    "ops",
    "optim",
    "parallel_apply",
    "platform",
    "replicate",
    "save",
    "scatter",
    "scatter_kwargs",
    "set_host_device_count",
    "stop_gradient",
    "to_device",
    "value_and_grad",
]

set_module(__name__, globals(), __all__)

_LAZY_SUBMODULES = ("distributed", "optim", "testing")


def __getattr__(name: str) -> ModuleType | type:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"cupy_parallel.{name}")
    if name == "DistributedDataParallel":  # imports distributed: on first use
        from cupy_parallel._src.ddp import DistributedDataParallel

        set_module(__name__, {name: DistributedDataParallel}, [name])
        globals()[name] = DistributedDataParallel
        return DistributedDataParallel
    if name == "FullyShardedDataParallel":  # imports distributed: on first use
        from cupy_parallel._src.sharded.fsdp import FullyShardedDataParallel

        set_module(__name__, {name: FullyShardedDataParallel}, [name])
        globals()[name] = FullyShardedDataParallel
        return FullyShardedDataParallel
    raise AttributeError(f"module 'cupy_parallel' has no attribute {name!r}")
