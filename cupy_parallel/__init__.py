"""cupy_parallel: PyTorch's multi-device layer for CuPy and NumPy arrays, without torch."""

from cupy_parallel._src.devices import (
    Device,
    HostArray,
    array_namespace,
    as_device,
    device_of,
    devices,
    empty,
    is_array,
    platform,
    set_host_device_count,
    to_device,
)
from cupy_parallel._src.memory import HostMemoryPool, get_host_memory_pool

__version__ = "0.1.0"

__all__ = [
    "Device",
    "HostArray",
    "HostMemoryPool",
    "__version__",
    "array_namespace",
    "as_device",
    "device_of",
    "devices",
    "empty",
    "get_host_memory_pool",
    "is_array",
    "platform",
    "set_host_device_count",
    "to_device",
]
