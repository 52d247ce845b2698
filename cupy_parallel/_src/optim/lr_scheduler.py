"""Learning-rate schedules: torch.optim.lr_scheduler's StepLR, MultiStepLR, LinearLR, ...

Each scheduler sets ``optimizer.param_groups[i]["lr"]`` at construction and at every
:meth:`LRScheduler.step`, with torch's values to the bit: the same recursive formulas (each lr
computed from the group's current lr, as torch's ``get_lr``), the same closed forms where torch
uses them (a :class:`SequentialLR` milestone), the same ``last_epoch`` and ``_step_count``
bookkeeping, and a state dict with torch's keys (the scheduler's attributes but the optimizer).

Decided where torch differs: ``step()`` takes no ``epoch`` (torch deprecated it); no warning
when ``scheduler.step()`` comes before ``optimizer.step()`` (nothing here wraps the optimizer's
``step``); the optimizer may be any object with torch's ``param_groups`` (a list of dicts with
an ``"lr"``), so that optimizers built on ours (ZeRO) are scheduled too.
"""

from __future__ import annotations

import math
import types
from bisect import bisect_right
from collections import Counter
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arguments import read_int, read_real

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "CosineAnnealingLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "SequentialLR",
    "StepLR",
]


def _lrs(optimizer: Any) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


def _check_optimizer(optimizer: Any) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and "lr" in g for g in groups):
        raise TypeError(
            f"{type(optimizer).__name__} is not an Optimizer: a scheduler needs torch's "
            "param_groups (a list of dicts with an 'lr')."
        )


class LRScheduler:
    """Base class of the schedulers (``torch.optim.lr_scheduler.LRScheduler``).

    Construction records each group's ``initial_lr`` (kept if present, required when resuming
    with ``last_epoch >= 0``), :attr:`base_lrs`, and takes the first step (``last_epoch``
    becomes 0 and the lr its first value).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import StepLR
        >>> opt = SGD([np.zeros(1)], lr=1.0)
        >>> sched = StepLR(opt, step_size=2, gamma=0.5)
        >>> lrs = []
        >>> for _ in range(5):
        ...     lrs.append(sched.get_last_lr()[0])
        ...     sched.step()
        >>> lrs
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """

    _get_lr_called_within_step: bool = False
    _is_initial: bool = False

    def __init__(self, optimizer: Any, last_epoch: int = -1) -> None:
        _check_optimizer(optimizer)
        last_epoch = read_int(last_epoch, "last_epoch", minimum=-1)
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise KeyError(
                        f"param 'initial_lr' is not specified in param_groups[{i}] when resuming "
                        "a scheduler with last_epoch >= 0 (load the optimizer's state dict "
                        "first, or start with last_epoch=-1)."
                    )
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The next lrs from the current ones (torch's recursive form); ``step`` calls it."""
        raise NotImplementedError(f"{type(self).__name__} does not define get_lr")

    def get_last_lr(self) -> list[float]:
        """The lr of each group that the last :meth:`step` set."""
        return self._last_lr

    def step(self) -> None:
        """Advance one epoch (or iteration) and set every group's lr."""
        self._step_count += 1
        self._update_lr(None)

    def _update_lr(self, epoch: int | None) -> None:
        self._get_lr_called_within_step = True
        try:
            if epoch is None:
                self.last_epoch += 1
                values = self.get_lr()
            else:
                self.last_epoch = epoch
                closed = getattr(self, "_get_closed_form_lr", None)
                values = closed() if closed is not None else self.get_lr()
        finally:
            self._get_lr_called_within_step = False
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = lr
        self._last_lr: list[float] = _lrs(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """torch's: the scheduler's attributes but the optimizer."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s attributes (their names are checked)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}.")
        unknown = sorted(set(state_dict) - set(self.state_dict()))
        if unknown:
            raise ValueError(
                f"state_dict has entries {unknown} that a {type(self).__name__} does not have; "
                "was it saved from another scheduler?"
            )
        self.__dict__.update(state_dict)


class LambdaLR(LRScheduler):
    """``lr = initial_lr * lr_lambda(epoch)``, one function or one per group.

    As torch, the state dict saves a lambda's ``__dict__`` when it is a callable object and
    ``None`` when it is a plain function (functions are not saved).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import LambdaLR
        >>> opt = SGD([np.zeros(1)], lr=0.1)
        >>> sched = LambdaLR(opt, lambda epoch: 0.5**epoch)
        >>> sched.step(); sched.step()
        >>> sched.get_last_lr()
        [0.025]
    """

    def __init__(
        self,
        optimizer: Any,
        lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        count = len(optimizer.param_groups)
        if isinstance(lr_lambda, list | tuple):
            if len(lr_lambda) != count:
                raise ValueError(f"Expected {count} lr_lambdas, but got {len(lr_lambda)}")
            self.lr_lambdas = list(lr_lambda)
        else:
            self.lr_lambdas = [lr_lambda] * count
        for fn in self.lr_lambdas:
            if not callable(fn):
                raise TypeError(f"lr_lambda must be callable, got {type(fn).__name__}.")
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """torch's: a callable object's ``__dict__`` per lambda, ``None`` for a function."""
        state = {
            key: value
            for key, value in self.__dict__.items()
            if key not in ("optimizer", "lr_lambdas")
        }
        state["lr_lambdas"] = [
            None if isinstance(fn, types.FunctionType) else dict(fn.__dict__)
            for fn in self.lr_lambdas
        ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters, and the callable objects' ``__dict__`` where one was saved."""
        state = dict(state_dict)
        saved = state.pop("lr_lambdas", [None] * len(self.lr_lambdas))
        if len(saved) != len(self.lr_lambdas):
            raise ValueError(
                f"state_dict has {len(saved)} lr_lambdas, this scheduler {len(self.lr_lambdas)}."
            )
        state["lr_lambdas"] = self.lr_lambdas
        super().load_state_dict(state)
        for fn, attributes in zip(self.lr_lambdas, saved, strict=True):
            if attributes is not None:
                fn.__dict__.update(attributes)

    def get_lr(self) -> list[float]:
        return [
            base_lr * fn(self.last_epoch)
            for fn, base_lr in zip(self.lr_lambdas, self.base_lrs, strict=True)
        ]


class StepLR(LRScheduler):
    """Multiply the lr by ``gamma`` every ``step_size`` epochs.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import StepLR
        >>> sched = StepLR(SGD([np.zeros(1)], lr=1.0), step_size=1, gamma=0.5)
        >>> sched.step()
        >>> sched.get_last_lr()
        [0.5]
    """

    def __init__(
        self, optimizer: Any, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        self.step_size = read_int(step_size, "step_size", minimum=1)
        self.gamma = read_real(gamma, "gamma")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return _lrs(self.optimizer)
        return [lr * self.gamma for lr in _lrs(self.optimizer)]

    def _get_closed_form_lr(self) -> list[float]:
        return [
            base_lr * self.gamma ** (self.last_epoch // self.step_size) for base_lr in self.base_lrs
        ]


class MultiStepLR(LRScheduler):
    """Multiply the lr by ``gamma`` at each milestone (a milestone given twice: ``gamma**2``).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import MultiStepLR
        >>> sched = MultiStepLR(SGD([np.zeros(1)], lr=1.0), milestones=[1, 3], gamma=0.1)
        >>> lrs = []
        >>> for _ in range(4):
        ...     sched.step()
        ...     lrs.append(round(sched.get_last_lr()[0], 6))
        >>> lrs
        [0.1, 0.1, 0.01, 0.01]
    """

    def __init__(
        self, optimizer: Any, milestones: Iterable[int], gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        self.milestones = Counter(read_int(m, "milestones[i]") for m in milestones)
        self.gamma = read_real(gamma, "gamma")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch not in self.milestones:
            return _lrs(self.optimizer)
        factor = self.gamma ** self.milestones[self.last_epoch]
        return [lr * factor for lr in _lrs(self.optimizer)]

    def _get_closed_form_lr(self) -> list[float]:
        milestones = sorted(self.milestones.elements())
        return [
            base_lr * self.gamma ** bisect_right(milestones, self.last_epoch)
            for base_lr in self.base_lrs
        ]


class LinearLR(LRScheduler):
    """Scale the lr linearly from ``start_factor`` to ``end_factor`` over ``total_iters`` steps.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import LinearLR
        >>> sched = LinearLR(SGD([np.zeros(1)], lr=1.0), start_factor=0.5, total_iters=2)
        >>> lrs = [sched.get_last_lr()[0]]
        >>> for _ in range(3):
        ...     sched.step()
        ...     lrs.append(sched.get_last_lr()[0])
        >>> lrs
        [0.5, 0.75, 1.0, 1.0]
    """

    def __init__(
        self,
        optimizer: Any,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        start_factor = read_real(start_factor, "start_factor")
        end_factor = read_real(end_factor, "end_factor")
        if start_factor > 1.0 or start_factor <= 0:
            raise ValueError(
                "Starting multiplicative factor expected to be greater than 0 and less or equal "
                f"to 1, got start_factor={start_factor}."
            )
        if end_factor > 1.0 or end_factor < 0:
            raise ValueError(
                "Ending multiplicative factor expected to be between 0 and 1, got "
                f"end_factor={end_factor}."
            )
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = read_int(total_iters, "total_iters", minimum=1)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in _lrs(self.optimizer)]
        if self._is_initial or self.last_epoch > self.total_iters:
            return _lrs(self.optimizer)
        change = self.end_factor - self.start_factor
        factor = 1.0 + change / (
            self.total_iters * self.start_factor + (self.last_epoch - 1) * change
        )
        return [lr * factor for lr in _lrs(self.optimizer)]

    def _get_closed_form_lr(self) -> list[float]:
        change = self.end_factor - self.start_factor
        return [
            base_lr
            * (
                self.start_factor
                + change * min(self.total_iters, self.last_epoch) / self.total_iters
            )
            for base_lr in self.base_lrs
        ]


class CosineAnnealingLR(LRScheduler):
    r"""Cosine annealing from the initial lr to ``eta_min`` over ``T_max`` steps (and back).

    The lr follows torch's recursive formula
    ``lr_t = (1 + cos(pi t / T_max)) / (1 + cos(pi (t - 1) / T_max)) * (lr_{t-1} - eta_min)
    + eta_min`` (with torch's special step past each period's end), whose values differ from
    the closed form ``eta_min + (initial_lr - eta_min) (1 + cos(pi t / T_max)) / 2`` in the
    last bits; as torch's, it follows an lr changed by hand.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import CosineAnnealingLR
        >>> sched = CosineAnnealingLR(SGD([np.zeros(1)], lr=1.0), T_max=2)
        >>> lrs = []
        >>> for _ in range(4):
        ...     sched.step()
        ...     lrs.append(round(sched.get_last_lr()[0], 12))
        >>> lrs
        [0.5, 0.0, 0.5, 1.0]
    """

    def __init__(
        self,
        optimizer: Any,
        T_max: float,  # noqa: N803 - torch's name
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        self.T_max = read_real(T_max, "T_max")
        if not self.T_max > 0:
            raise ValueError(f"T_max must be > 0, got {T_max}.")
        self.eta_min = read_real(eta_min, "eta_min")
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:
            return _lrs(self.optimizer)
        lrs = _lrs(self.optimizer)
        if self._step_count == 1 and self.last_epoch > 0:
            cosine = 1 + math.cos(self.last_epoch * math.pi / self.T_max)
            return [self.eta_min + (base - self.eta_min) * cosine / 2 for base in self.base_lrs]
        if (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:
            rise = (1 - math.cos(math.pi / self.T_max)) / 2
            return [
                lr + (base - self.eta_min) * rise
                for base, lr in zip(self.base_lrs, lrs, strict=True)
            ]
        ratio = (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / (
            1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max)
        )
        return [ratio * (lr - self.eta_min) + self.eta_min for lr in lrs]

    def _get_closed_form_lr(self) -> list[float]:
        cosine = 1 + math.cos(math.pi * self.last_epoch / self.T_max)
        return [self.eta_min + (base - self.eta_min) * cosine / 2 for base in self.base_lrs]


class SequentialLR(LRScheduler):
    """Run ``schedulers`` one after another, switching at each of the ``milestones``.

    At a milestone the next scheduler starts from its epoch 0 in closed form (torch's
    ``_update_lr(0)``). The schedulers must share ``optimizer``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> from cupy_parallel.optim.lr_scheduler import LinearLR, SequentialLR, StepLR
        >>> opt = SGD([np.zeros(1)], lr=1.0)
        >>> warmup = LinearLR(opt, start_factor=0.5, total_iters=2)
        >>> decay = StepLR(opt, step_size=1, gamma=0.5)
        >>> sched = SequentialLR(opt, [warmup, decay], milestones=[2])
        >>> lrs = [sched.get_last_lr()[0]]
        >>> for _ in range(4):
        ...     sched.step()
        ...     lrs.append(sched.get_last_lr()[0])
        >>> lrs
        [0.5, 0.75, 1.0, 0.5, 0.25]
    """

    def __init__(
        self,
        optimizer: Any,
        schedulers: Sequence[LRScheduler],
        milestones: Sequence[int],
        last_epoch: int = -1,
    ) -> None:
        _check_optimizer(optimizer)
        if len(schedulers) < 1:
            raise ValueError("SequentialLR expects at least one scheduler, but got no scheduler.")
        for i, scheduler in enumerate(schedulers):
            if not isinstance(scheduler, LRScheduler):
                raise TypeError(
                    f"schedulers[{i}] must be an LRScheduler, got {type(scheduler).__name__}."
                )
            if scheduler.optimizer is not optimizer:
                raise ValueError(
                    "SequentialLR expects all schedulers to belong to the same optimizer, but "
                    f"schedulers[{i}] ({type(scheduler).__name__}) has another one."
                )
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(
                "Sequential Schedulers expects number of schedulers provided to be one more than "
                f"the number of milestone points, but got number of schedulers {len(schedulers)} "
                f"and the number of milestones to be equal to {len(milestones)}"
            )
        self._schedulers = list(schedulers)
        self._milestones = [read_int(m, "milestones[i]") for m in milestones]
        self.last_epoch = read_int(last_epoch, "last_epoch", minimum=-1) + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:  # the schedulers' constructors stepped it already
            group["lr"] = group["initial_lr"]
        self._undo(self)
        index = bisect_right(self._milestones, 0)
        self._schedulers[index]._initial_step()
        self._last_lr = self._schedulers[index].get_last_lr()

    def _undo(self, scheduler: LRScheduler) -> None:
        """Take back one epoch of every scheduler inside ``scheduler`` (torch's recursive_undo)."""
        if isinstance(scheduler, SequentialLR):
            for inner in scheduler._schedulers:
                self._undo(inner)
        else:
            scheduler.last_epoch -= 1

    def step(self) -> None:
        self.last_epoch += 1
        index = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[index]
        if index > 0 and self._milestones[index - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """torch's: the counters and each scheduler's state dict."""
        state = {
            key: value
            for key, value in self.__dict__.items()
            if key not in ("optimizer", "_schedulers")
        }
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters and each scheduler's state."""
        state = dict(state_dict)
        inner = state.pop("_schedulers", None)
        if not isinstance(inner, list) or len(inner) != len(self._schedulers):
            raise ValueError(
                f"state_dict['_schedulers'] must be a list of {len(self._schedulers)} state "
                f"dicts, got {inner!r:.80}."
            )
        state["_schedulers"] = self._schedulers
        super().load_state_dict(state)
        for scheduler, saved in zip(self._schedulers, inner, strict=True):
            scheduler.load_state_dict(saved)
