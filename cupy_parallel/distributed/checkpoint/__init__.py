"""torch.distributed.checkpoint for NumPy, HostArray and CuPy arrays: sharded, resharding, atomic.

``save(state, path)`` on every rank writes that rank's rows of each sharded array (a
:class:`Shard`) and its share of the replicated arrays into a file of its own, plus one metadata
file; ``load(state, path)`` fills ``state`` in place on any number of ranks, reading only the
rows each rank needs. See :mod:`cupy_parallel._src.checkpoint.storage` for the layout.
``get_state_dict(model, optimizer)`` / ``set_state_dict`` (torch's
``torch.distributed.checkpoint.state_dict`` pair) turn a DDP or FSDP model and its optimizer
(plain or ZeRO) into dicts keyed by parameter names that ``save``/``load`` reshard.

Example:
    >>> import os, tempfile, numpy as np
    >>> from cupy_parallel.distributed import checkpoint as dcp
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> dcp.save({"w": np.ones(3)}, path)
    >>> state = {"w": np.zeros(3)}
    >>> dcp.load(state, path)
    >>> state["w"]
    array([1., 1., 1.])
"""

from cupy_parallel._src.checkpoint.shard import Shard
from cupy_parallel._src.checkpoint.storage import load, save
from cupy_parallel._src.exports import set_module
from cupy_parallel._src.sharded.state_dict import get_state_dict, set_state_dict

__all__ = [
    "Shard",
    "get_state_dict",
    "load",
    "save",
    "set_state_dict",
]

set_module(__name__, globals(), __all__)
