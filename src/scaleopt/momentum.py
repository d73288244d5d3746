"""Heavy-ball momentum SGD with L2 or L1 regularisation (the Paddle ``Momentum`` semantics)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import _ops
from ._base import ScaleOptimizer, lr_of
from ._checks import check_bool, check_choice, check_number
from ._loading import StateSpec
from ._params import NameRule
from ._dispatch import Impl, implementation
from ._sharding import local

__all__ = ["Momentum"]


class Momentum(ScaleOptimizer):
    r"""Heavy-ball momentum SGD.

    .. math::
        \begin{aligned}
        g &\leftarrow g + \lambda w \ \ (\text{"l2"}) \quad\text{or}\quad
            g \leftarrow g + \lambda\,\mathrm{sign}(w) \ \ (\text{"l1"})\\
        v_t &= \mu v_{t-1} + g, \qquad
        w_t = w_{t-1} - \eta\, v_t \quad(\text{Nesterov: } w_t = w_{t-1} - \eta(g + \mu v_t))
        \end{aligned}

    The same numbers as :class:`torch.optim.SGD` with ``dampening=0``, plus L1 regularisation
    and decay exclusion by name. The buffer is kept as ``momentum_buffer`` like torch's.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float, default 1e-3): learning rate :math:`\eta`.
        momentum (float, default 0.9): :math:`\mu`.
        nesterov (bool, default False): Nesterov momentum.
        weight_decay (float, default 0.0): :math:`\lambda`.
        weight_decay_mode (str, default ``"l2"``): ``"l2"`` or ``"l1"``.
        exclude_from_weight_decay (regex, list of regexes, callable(name) or None): no decay
            for the matching names.
        max_grad_norm, clip_grad_value, clip_grad_norm_per_tensor, rescale_grad, maximize, foreach:
            as in :class:`scaleopt.LAMB`.
        fused (None or False, default None): there are no fused kernels for this update
            (``fused=True`` is an error, as for torch's SGD on a device without them).
        nonfinite (``"propagate"`` or ``"skip"``, default ``"propagate"``): what a step does
            with an inf/NaN gradient (see :doc:`/robustness`): let it flow into the update, as
            torch's optimizers do, or skip the whole step, counted in ``skipped_steps``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Momentum(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
    """

    _name_rule_keys = ("exclude_from_weight_decay",)
    _state_spec = StateSpec("momentum", ("momentum_buffer",), ("momentum_buffer",),
                            may_be_none=("momentum_buffer",))

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        *,
        weight_decay_mode: str = "l2",
        exclude_from_weight_decay: NameRule = None,
        max_grad_norm: Optional[float] = None,
        clip_grad_value: Any = None,
        clip_grad_norm_per_tensor: Optional[float] = None,
        rescale_grad: float = 1.0,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        nonfinite: str = "propagate",
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode,
            exclude_from_weight_decay=exclude_from_weight_decay,
            max_grad_norm=max_grad_norm,
            clip_grad_value=clip_grad_value,
            clip_grad_norm_per_tensor=clip_grad_norm_per_tensor,
            rescale_grad=rescale_grad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        a = self._arg
        check_number(a("momentum"), group["momentum"], high=1.0, high_open=False)
        check_bool(a("nesterov"), group["nesterov"])
        check_number(a("weight_decay"), group["weight_decay"])
        check_choice("weight_decay_mode", group["weight_decay_mode"], ("l2", "l1"))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        for item in self._intake():
            group, idx, params, grads = item.group, item.idx, item.params, item.grads
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state or state["momentum_buffer"] is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            no_decay = self._rule_flags(group, "exclude_from_weight_decay")
            decay = [not no_decay[i] for i in idx]
            momentum_sgd(
                local(params),  # sharded: the local shards (the gradients already are)
                grads,
                local(bufs),
                decay=decay,
                lr=lr_of(group),
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                weight_decay=group["weight_decay"],
                weight_decay_mode=group["weight_decay_mode"],
                foreach=implementation(group, params, kernels=False) is Impl.MULTI,
            )
        return loss


def momentum_sgd(params, grads, bufs, *, decay, lr, momentum, nesterov, weight_decay,
                 weight_decay_mode="l2", foreach=True) -> None:
    """Functional heavy-ball momentum over lists of tensors; ``grads`` are read only."""
    if not foreach:
        for p, g, b, d in zip(params, grads, bufs, decay):
            _momentum_lists([p], [g], [b], d, lr, momentum, nesterov, weight_decay, weight_decay_mode)
        return
    on = [i for i, d in enumerate(decay) if d]
    off = [i for i, d in enumerate(decay) if not d]
    for sel, d in ((on, True), (off, False)):
        if sel:
            _momentum_lists([params[i] for i in sel], [grads[i] for i in sel], [bufs[i] for i in sel],
                            d, lr, momentum, nesterov, weight_decay, weight_decay_mode)


def _momentum_lists(params, grads, bufs, decayed, lr, momentum, nesterov, weight_decay, mode) -> None:
    if decayed and weight_decay != 0:
        add = _ops.add_l2_to_grad if mode == "l2" else _ops.add_l1_to_grad
        grads = add(grads, params, weight_decay)
    direction = _ops.heavy_ball_(bufs, grads, momentum, nesterov)
    _ops.add_scaled_(params, direction, [-lr] * len(params))
