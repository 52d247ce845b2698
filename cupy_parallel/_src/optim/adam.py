"""Adam and AdamW (torch's Adam, with L2 or decoupled weight decay, AMSGrad, maximize)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_real
from cupy_parallel._src.optim.optimizer import Optimizer, check_nonnegative, zeros_like
from cupy_parallel._src.optim.updates import apply, elementwise_kernel, opmath

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Adam", "AdamW"]


def _adam_numpy(
    p: Any,
    g: Any,
    states: list[Any],
    t1: Any,
    t2: Any,
    *,
    weight_decay: float,
    decay: float,
    decoupled: bool,
    maximize: bool,
    weight: float,
    beta2: float,
    bias_correction2_sqrt: float,
    eps: float,
    step_size: float,
) -> None:
    exp_avg, exp_avg_sq = states[0], states[1]
    d = g
    if maximize:
        d = np.negative(g, out=t1)
    if weight_decay != 0:
        if decoupled:
            np.multiply(p, decay, out=p)  # param * (1 - lr * weight_decay)
        else:
            np.multiply(p, weight_decay, out=t2)
            d = np.add(d, t2, out=t1)  # grad + weight_decay * param
    # exp_avg.lerp_(grad, 1 - beta1), torch's two formulas around weight 0.5
    np.subtract(d, exp_avg, out=t2)
    if weight < 0.5:
        np.multiply(t2, weight, out=t2)
        np.add(exp_avg, t2, out=exp_avg)
    else:
        np.multiply(t2, 1 - weight, out=t2)
        np.subtract(d, t2, out=exp_avg)
    # exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    np.multiply(exp_avg_sq, beta2, out=exp_avg_sq)
    np.multiply(d, 1 - beta2, out=t2)
    np.multiply(t2, d, out=t2)
    np.add(exp_avg_sq, t2, out=exp_avg_sq)
    second = exp_avg_sq
    if len(states) > 2:  # amsgrad
        second = np.maximum(states[2], exp_avg_sq, out=states[2])
    # denom = sqrt(second) / sqrt(bias_correction2) + eps; param - step_size * exp_avg / denom
    np.sqrt(second, out=t2)
    np.divide(t2, bias_correction2_sqrt, out=t2)
    np.add(t2, eps, out=t2)
    np.divide(exp_avg, t2, out=t2)
    np.multiply(t2, -step_size, out=t2)
    np.add(p, t2, out=p)


def _adam_cuda(
    p: Any,
    g: Any,
    states: list[Any],
    *,
    weight_decay: float,
    decay: float,
    decoupled: bool,
    maximize: bool,
    weight: float,
    beta2: float,
    bias_correction2_sqrt: float,
    eps: float,
    step_size: float,
) -> None:
    amsgrad = len(states) > 2
    # O (the opmath type) holds every intermediate and the new values; the arrays are written
    # once at the end, so float16 arrays are rounded once per step, as on the NumPy path
    lines = ["O d = -g;" if maximize else "O d = g;", "O q = p;"]
    if weight_decay != 0:
        lines.append("q = q * decay;" if decoupled else "d = d + weight_decay * q;")
    if weight < 0.5:
        lines.append("O m = exp_avg + weight * (d - exp_avg);")
    else:
        lines.append("O m = d - (d - exp_avg) * one_minus_weight;")
    lines.append("O v = exp_avg_sq * beta2 + one_minus_beta2 * d * d;")
    second = "v"
    if amsgrad:  # torch.maximum: a NaN in either wins
        lines.append("O top = (isnan(v) || v > max_exp_avg_sq) ? v : max_exp_avg_sq;")
        lines.append("max_exp_avg_sq = top;")
        second = "top"
    lines.append(f"O denom = sqrt({second}) / bias_correction2_sqrt + eps;")
    lines.append("p = q + neg_step_size * (m / denom);")
    lines.append("exp_avg = m;")
    lines.append("exp_avg_sq = v;")
    kernel = elementwise_kernel(
        "T g, O weight_decay, O decay, O weight, O one_minus_weight, O beta2, "
        "O one_minus_beta2, O bias_correction2_sqrt, O eps, O neg_step_size",
        "T p, T exp_avg, T exp_avg_sq" + (", T max_exp_avg_sq" if amsgrad else ""),
        "\n".join(lines),
        "cupy_parallel_adam",
    )
    o = opmath(p.dtype).type  # the scalars' type binds O
    kernel(
        g,
        o(weight_decay),
        o(decay),
        o(weight),
        o(1 - weight),
        o(beta2),
        o(1 - beta2),
        o(bias_correction2_sqrt),
        o(eps),
        o(-step_size),
        p,
        *states,
    )


def _check_betas(betas: Any) -> tuple[float, float]:
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of floats (beta1, beta2), got {betas!r}.")
    pair = (read_real(betas[0], "betas[0]"), read_real(betas[1], "betas[1]"))
    for i, beta in enumerate(pair):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
    return pair


class Adam(Optimizer):
    r"""Adam: ``torch.optim.Adam``'s math, with AMSGrad, maximize and either kind of weight decay.

    For each parameter ``p`` with gradient ``g``, at step ``t`` (1, 2, ...), in torch's order::

        g = -g                                   if maximize
        p = p * (1 - lr * weight_decay)          if decoupled_weight_decay (AdamW)
        g = g + weight_decay * p                 otherwise, if weight_decay != 0
        exp_avg = lerp(exp_avg, g, 1 - beta1)
        exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g
        max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq)       if amsgrad (used below)
        denom = sqrt(exp_avg_sq) / sqrt(1 - beta2**t) + eps
        p = p - lr / (1 - beta1**t) * (exp_avg / denom)

    (``lerp`` as torch computes it: ``a + w * (b - a)`` for ``w < 0.5``, else
    ``b - (b - a) * (1 - w)``; the bias corrections are Python floats.)
    State: ``step`` (a float), ``exp_avg``, ``exp_avg_sq`` and, with amsgrad,
    ``max_exp_avg_sq``. See :class:`~cupy_parallel.optim.Optimizer` for ``params``,
    ``step(grads)`` (no ``zero_grad``: gradients are returned, not stored) and the state dict.

    Raises:
        ValueError: ``lr``, ``eps`` or ``weight_decay`` below 0, a beta outside [0, 1)
            (torch's messages).
        TypeError: a hyper-parameter that is not a number, ``betas`` not a pair.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import Adam
        >>> w = np.array([1.0, -2.0])
        >>> opt = Adam([w], lr=0.1)
        >>> opt.step([2 * w])
        >>> w                                  # the first step moves each entry by lr
        array([ 0.9, -1.9])
        >>> opt.state_dict()["state"][0]["step"]
        1.0
    """

    _hyper: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "lr": lambda v: check_nonnegative(v, "learning rate"),
        "betas": _check_betas,
        "eps": lambda v: check_nonnegative(v, "epsilon value"),
        "weight_decay": lambda v: check_nonnegative(v, "weight_decay value"),
        "amsgrad": lambda v: read_bool(v, "amsgrad"),
        "maximize": lambda v: read_bool(v, "maximize"),
        "decoupled_weight_decay": lambda v: read_bool(v, "decoupled_weight_decay"),
    }

    def __init__(  # noqa: PLR0917 - torch's signature
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, {key: check(defaults[key]) for key, check in self._hyper.items()})

    def _state_keys(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        keys = ("step", "exp_avg", "exp_avg_sq")
        return (*keys, "max_exp_avg_sq") if hyper["amsgrad"] else keys

    def _update(self, param: Any, grad: Any, state: dict[str, Any], hyper: dict[str, Any]) -> None:
        if not state:
            state["step"] = 0.0
            state["exp_avg"] = zeros_like(param)
            state["exp_avg_sq"] = zeros_like(param)
            if hyper["amsgrad"]:
                state["max_exp_avg_sq"] = zeros_like(param)
        step = state["step"] + 1.0
        lr = hyper["lr"]
        beta1, beta2 = hyper["betas"]
        states = [state["exp_avg"], state["exp_avg_sq"]]
        if hyper["amsgrad"]:
            states.append(state["max_exp_avg_sq"])
        apply(
            _adam_numpy,
            _adam_cuda,
            param,
            grad,
            states=states,
            workspace=self._workspace,
            weight_decay=hyper["weight_decay"],
            decay=1 - lr * hyper["weight_decay"],
            decoupled=hyper["decoupled_weight_decay"],
            maximize=hyper["maximize"],
            weight=1 - beta1,
            beta2=beta2,
            bias_correction2_sqrt=(1 - beta2**step) ** 0.5,
            eps=hyper["eps"],
            step_size=lr / (1 - beta1**step),
        )
        state["step"] = step


class AdamW(Adam):
    r"""AdamW: :class:`Adam` with decoupled weight decay (``torch.optim.AdamW``), decay ``1e-2``.

    The parameter is first scaled by ``1 - lr * weight_decay``, then Adam's update follows
    (torch 2.x's AdamW is Adam with ``decoupled_weight_decay=True``, and so is this one).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import AdamW
        >>> w = np.array([1.0, -2.0])
        >>> AdamW([w], lr=0.1, weight_decay=0.5).step([np.zeros(2)])
        >>> w                                  # decay only: a zero gradient moves nothing else
        array([ 0.95, -1.9 ])
    """

    def __init__(  # noqa: PLR0917 - torch's signature
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            decoupled_weight_decay=True,
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`Optimizer.load_state_dict`, the decay kept decoupled (as torch's AdamW keeps it).

        A state dict saved by :class:`Adam` (``decoupled_weight_decay=False``) would otherwise
        turn this AdamW into Adam with L2 decay.
        """
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True
