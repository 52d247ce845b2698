"""torch.optim.lr_scheduler's schedules, with torch's arguments and values, for our optimizers."""

from cupy_parallel._src.exports import set_module
from cupy_parallel._src.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    LRScheduler,
    MultiStepLR,
    SequentialLR,
    StepLR,
)

__all__ = [
    "CosineAnnealingLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "SequentialLR",
    "StepLR",
]

set_module(__name__, globals(), __all__)
