"""torch.optim for pytrees of NumPy, HostArray and CuPy arrays: SGD, Adam, AdamW, schedules.

The optimizers update the parameter arrays in place with torch.optim's math, given the
gradients the tape returns (``opt.step(grads)``); ``lr_scheduler`` changes their learning rate
by epoch or step as torch's schedulers do.

Example:
    >>> import numpy as np
    >>> import cupy_parallel as cp
    >>> from cupy_parallel.optim import Adam
    >>> params = {"w": np.array([1.0, -1.0])}
    >>> opt = Adam(params, lr=0.1)
    >>> for _ in range(3):
    ...     grads = cp.grad(lambda p: cp.ops.sum(cp.ops.multiply(p["w"], p["w"])))(params)
    ...     opt.step(grads)
    >>> params["w"].round(4)
    array([ 0.7016, -0.7016])
"""

from cupy_parallel._src.exports import set_module
from cupy_parallel._src.optim.adam import Adam, AdamW
from cupy_parallel._src.optim.optimizer import Optimizer
from cupy_parallel._src.optim.sgd import SGD
from cupy_parallel.optim import lr_scheduler

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler"]

set_module(__name__, globals(), __all__)
