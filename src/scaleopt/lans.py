"""LANS: LAMB with normalised gradients and a Nesterov-style two-part update."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _ops, _native, _triton
from ._ops import by_value
from ._checks import check_bool
from ._dispatch import Impl, resolve
from ._group import GroupTensors, GroupOptions, TensorOptions, WholeUpdate, pick
from ._group import functional_tensors, w16_argument
from ._layerwise import LayerwiseAdam
from ._loading import ADAM_STATE
from ._params import NameRule
from ._sharding import Reduction, total, total_one

__all__ = ["LANS", "lans"]


class LANS(LayerwiseAdam):
    r"""LANS (Zheng et al., 2020): per-tensor normalised gradients, Adam moments, and two
    trust-ratio-scaled parts weighted :math:`\beta_1` and :math:`1-\beta_1`.

    For each tensor :math:`w` with gradient :math:`g` at step :math:`t`:

    .. math::
        \begin{aligned}
        \tilde g &= g / \lVert g \rVert \quad (0 \text{ when } \lVert g\rVert = 0) \\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1)\tilde g, \qquad
        v_t = \beta_2 v_{t-1} + (1-\beta_2)\tilde g^2 \\
        d_t &= \sqrt{v_t/(1-\beta_2^t)} + \epsilon, \qquad
        r_t = \frac{m_t/(1-\beta_1^t)}{d_t} + \lambda w, \qquad
        c_t = \frac{\tilde g}{d_t} + \lambda w \\
        w &\leftarrow w - \eta\beta_1 \frac{\phi(\lVert w\rVert)}{\lVert r_t\rVert} r_t
              - \eta(1-\beta_1) \frac{\phi(\lVert w\rVert)}{\lVert c_t\rVert} c_t
        \end{aligned}

    :math:`\phi` clamps :math:`\lVert w\rVert` to ``[lower_bound, upper_bound]``; a ratio whose
    norms are 0 (or that overflows) is 1. Both parts use the weight from before the step, as in
    the paper and MXNet's fused kernel. With ``decay_moved_weight=True`` the second part's decay
    uses the weight already moved by the first part, as MXNet's ``LANS.step()`` does (both ratios
    still use the pre-step :math:`\lVert w\rVert`).

    Unlike MXNet's ``step()``, an all-zero gradient does not divide 0 by 0: the tensor's
    normalised gradient is 0 and it stays finite. ``clip_grad_value`` applies to the normalised
    gradient (as in MXNet); ``rescale_grad`` and the norm-based clipping come before the
    normalisation (and so only matter for their sign and for non-finite values).

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float, default 1e-3): learning rate :math:`\eta`.
        betas (tuple[float, float], default (0.9, 0.999)): :math:`(\beta_1, \beta_2)`.
        eps (float, default 1e-6): :math:`\epsilon`, outside the square root.
        weight_decay (float, default 0.01): :math:`\lambda`.
        bias_correction (bool, default True): divide the moments by :math:`1-\beta^t`.
        always_adapt (bool, default True): trust ratios also for tensors whose decay is 0.
        lower_bound (float or None, default None), upper_bound (float or None, default None):
            clamp :math:`\lVert w\rVert`.
        decay_moved_weight (bool, default False): MXNet ``step()`` semantics, see above.
        max_grad_norm, clip_grad_value, clip_grad_norm_per_tensor, rescale_grad: as in
            :class:`scaleopt.LAMB` (see the note above).
        exclude_from_weight_decay, exclude_from_layer_adaptation (regex, list, callable or None):
            name rules, as in :class:`scaleopt.LAMB`.
        master_weights (bool, default False): float32 master weights for float16/bfloat16
            params, as in :class:`~scaleopt.LAMB` (split for bfloat16 where the kernels run).
        maximize (bool, default False): maximize the objective.
        foreach (bool or None, default None), fused (bool or None, default None),
        implementation (str or None, default None):
            which path runs the update, as in :class:`~scaleopt.LAMB` (on CUDA the Triton
            kernels, on the CPU the C kernels, by default). All give the same numbers up to
            float round-off.
        capturable (bool, default False): step counters and a tensor learning rate read on
            the device, for CUDA graphs, as in :class:`~scaleopt.LAMB`.
        nonfinite (``"propagate"`` or ``"skip"``, default ``"propagate"``): what a step does
            with an inf/NaN gradient (see :doc:`/robustness`): let it flow into the update, as
            torch's optimizers do, or skip the whole step, counted in ``skipped_steps``.
        state_dtype (``"float32"``, ``"bfloat16"`` or ``"int8"``, default ``"float32"``): how
            the moments are stored between steps, as in :class:`LAMB` (see :doc:`/state`).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LANS(model.named_parameters(), lr=1e-3, exclude_from_weight_decay="bias")
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()

    Paper: Shuai Zheng, Haibin Lin, Sheng Zha, Mu Li, "Accelerated Large Batch Optimization of
    BERT Pretraining in 54 minutes", 2020, https://arxiv.org/abs/2006.13484
    """

    _intake_options = {"value_clip": False}
    _state_spec = ADAM_STATE._replace(kind="lans")
    _own_options = ("clip_grad_value", "decay_moved_weight")  # of GroupOptions

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        always_adapt: bool = True,
        lower_bound: Optional[float] = None,
        upper_bound: Optional[float] = None,
        decay_moved_weight: bool = False,
        max_grad_norm: Optional[float] = None,
        clip_grad_value: Any = None,
        clip_grad_norm_per_tensor: Optional[float] = None,
        rescale_grad: float = 1.0,
        exclude_from_weight_decay: NameRule = None,
        exclude_from_layer_adaptation: NameRule = None,
        master_weights: bool = False,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        implementation: Optional[str] = None,
        capturable: bool = False,
        nonfinite: str = "propagate",
        state_dtype: str = "float32",
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            always_adapt=always_adapt,
            lower_bound=lower_bound, upper_bound=upper_bound,
            decay_moved_weight=decay_moved_weight,
            max_grad_norm=max_grad_norm,
            clip_grad_value=clip_grad_value,
            clip_grad_norm_per_tensor=clip_grad_norm_per_tensor,
            rescale_grad=rescale_grad,
            exclude_from_weight_decay=exclude_from_weight_decay,
            exclude_from_layer_adaptation=exclude_from_layer_adaptation,
            master_weights=master_weights,
            maximize=maximize,
            foreach=foreach, fused=fused, implementation=implementation,
            capturable=capturable, state_dtype=state_dtype,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_bool(self._arg("decay_moved_weight"), group["decay_moved_weight"])

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        with self._grad_source.stepping():
            plans = self._plan_step()  # the gradients in; each group's tensors and path
            updates = [_IMPLEMENTATIONS[p.impl](p.tensors, p.layer, p.options) for p in plans]
            # on local shards, each totalled in one all-reduce for all groups: the gradients'
            # sums of squares (where the intake's clipping did not give them), then the sums
            # of both trust ratios
            grad_totals = total([u.grad_sums() for u in updates])
            totals = total([u.sums(g) for u, g in zip(updates, grad_totals)])
            for update, group_totals in zip(updates, totals):
                update.apply(group_totals)
            self._finish_step(plans)
        return loss


def lans(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    *,
    lrs: Sequence[float],
    weight_decays: Sequence[float],
    adapt: Sequence[bool],
    beta1: float,
    beta2: float,
    eps: float,
    bias_correction: bool = True,
    lower_bound: Optional[float] = None,
    upper_bound: Optional[float] = None,
    clip_grad_value: Any = None,
    decay_moved_weight: bool = False,
    foreach: bool = True,
    implementation: Optional[str] = None,
    w16: Optional[List[Optional[Tensor]]] = None,
    grad_multipliers: Union[Sequence[float], Tensor, None] = None,
    sharded_as: Optional[Sequence[Tensor]] = None,
    grad_norms: Optional[Tensor] = None,
    low: Optional[List[Optional[Tensor]]] = None,
) -> None:
    """Functional LANS over lists of tensors; see :class:`LANS`. ``grads`` are read only.
    ``implementation``, ``w16``, ``grad_multipliers`` and ``sharded_as`` as in
    :func:`scaleopt.lamb.lamb`. ``grad_norms``: the norms of the gradients as the update takes
    them (times their multipliers; of the whole tensors, for local shards), not computed
    again when given."""
    t = functional_tensors(params, grads, exp_avgs, exp_avg_sqs, state_steps,
                           w16_argument(w16, low), grad_multipliers, sharded_as, grad_norms)
    o = GroupOptions(beta1, beta2, eps, bias_correction, lower_bound, upper_bound,
                     clip_grad_value=clip_grad_value, decay_moved_weight=decay_moved_weight)
    impl = resolve(implementation, foreach)
    update = _IMPLEMENTATIONS[impl](t if impl.fused else t.for_torch(),
                                    TensorOptions(lrs, weight_decays, adapt), o)
    update.apply(total_one(update.sums(total_one(update.grad_sums()))))


def _inverse_norms(norms: Tensor) -> Tensor:
    """``1/n``, and 0 where ``n`` is 0 (an all-zero gradient stays zero, not NaN); NaN where
    ``n`` is (a non-finite gradient propagates)."""
    zero = norms == 0
    return torch.where(zero, torch.zeros_like(norms),
                       1.0 / torch.where(zero, torch.ones_like(norms), norms))


def _single_tensor_lans(t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> None:
    """The reference path: one tensor at a time, the algorithm as written in the docstring."""
    lower, upper, beta1 = o.lower_bound, o.upper_bound, o.beta1
    for i, p in enumerate(t.weights):
        m, v, lr, wd = t.exp_avgs[i], t.exp_avg_sqs[i], layer.lrs[i], layer.weight_decays[i]
        t.steps[i] += 1
        g = t.grads[i] * _inverse_norms(_ops.norm_one(t.grads[i])).to(t.grads[i].dtype)
        (g,) = _ops.clip_by_value([g], o.clip_grad_value)
        _ops.adam_moments_one(m, v, g, beta1, o.beta2)
        (bc1,), (bc2_sqrt,) = _ops.step_bias_corrections(
            [t.steps[i]], beta1, o.beta2, o.bias_correction
        )
        denom = _ops.adam_denominator_one(v, bc2_sqrt, o.eps)
        r = _ops.adam_direction_one(m, bc1, denom)
        c = g / denom
        w_norm = _ops.norm_one(p)
        if wd != 0:
            r.add_(p, alpha=wd)
        if layer.adapt[i]:
            r.mul_(_ops.trust_ratio(w_norm, _ops.norm_one(r), lower, upper).to(r.dtype))
        if o.decay_moved_weight:
            _ops.add_scaled_one_(p, r, -lr * beta1)
        if wd != 0:
            c.add_(p, alpha=wd)
        if layer.adapt[i]:
            c.mul_(_ops.trust_ratio(w_norm, _ops.norm_one(c), lower, upper).to(c.dtype))
        if not o.decay_moved_weight:
            _ops.add_scaled_one_(p, r, -lr * beta1)
        _ops.add_scaled_one_(p, c, -lr * (1.0 - beta1))


class _MultiTensorLans:
    """The fast path: the same algorithm as a few multi-tensor kernels per group. On local
    shards, ``t.shard_sums`` totals the norms: the gradients' in one reduction, the weights'
    and both parts' in another (see :meth:`sums`)."""

    def __init__(self, t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> None:
        self.t, self.layer, self.o = t, layer, o

    def grad_sums(self) -> Optional[Reduction]:
        t = self.t
        if not t.weights or t.grad_norms is not None or t.shard_sums is None:
            return None
        return t.shard_sums.norms_request(t.grads)

    def sums(self, grad_totals: Optional[Tensor] = None) -> Optional[Reduction]:
        """The normalised gradients, the moments and both parts; on local shards, the sums
        their trust ratios need: ||w||^2, ||r||^2, ||c||^2 and, when the second part decays
        the moved weight, <c, r>, in one vector to total. (The moved weight's decay is
        ``c - wd*lr*beta1*ratio_r*r``, whose squared norm follows from those sums.)"""
        t, layer, o = self.t, self.layer, self.o
        params, grads, beta1 = t.weights, t.grads, o.beta1
        if not params:
            return None
        torch._foreach_add_(t.steps, 1)
        if t.grad_norms is not None:
            g_norms = t.grad_norms
        elif grad_totals is None:
            g_norms = _ops.norms(grads)
        else:
            g_norms = grad_totals
        g = _ops.clip_by_value(_ops.scale_each(grads, _inverse_norms(g_norms)),
                                  o.clip_grad_value)
        _ops.adam_moments(t.exp_avgs, t.exp_avg_sqs, g, beta1, o.beta2)
        bc1, bc2_sqrt = _ops.step_bias_corrections(t.steps, beta1, o.beta2,
                                                       o.bias_correction)
        denom = _ops.adam_denominators(t.exp_avg_sqs, bc2_sqrt, o.eps)
        self.r = r = _ops.adam_direction(t.exp_avgs, bc1, denom)
        self.c = c = torch._foreach_div(g, denom)
        self.decays = decays = [(wd, ids) for wd, ids in by_value(layer.weight_decays) if wd != 0]
        self.adapting = adapting = [i for i, a in enumerate(layer.adapt) if a]
        if t.shard_sums is None:
            return None
        for wd, ids in decays:  # both parts decay the weight from before the step here
            _ops.add_decay_to_update(pick(r, ids), pick(params, ids), wd)
            _ops.add_decay_to_update(pick(c, ids), pick(params, ids), wd)
        ws, rs, cs = (pick(xs, adapting) for xs in (params, r, c))
        parts = [_ops.sq_norms(ws), _ops.sq_norms(rs), _ops.sq_norms(cs)]
        if o.decay_moved_weight:
            parts.append(_ops.dots(cs, rs).to(parts[0].dtype))
        return t.shard_sums.request(torch.cat(parts), adapting * len(parts))

    def apply(self, totals: Optional[Tensor]) -> None:
        """Both parts scaled by their trust ratios (from ``totals`` on local shards), and the
        step."""
        if not self.t.weights:
            return
        if totals is None:
            self._apply_whole()
            return
        t, layer, o, r, c, adapting = self.t, self.layer, self.o, self.r, self.c, self.adapting
        params, lrs, weight_decays, beta1 = t.weights, layer.lrs, layer.weight_decays, o.beta1
        sums = totals.split(len(adapting))
        w_norms, r2, c2 = sums[0].sqrt(), sums[1], sums[2]
        ratio_r = _ops.trust_ratio(w_norms, r2.sqrt(), o.lower_bound, o.upper_bound)
        if o.decay_moved_weight:
            lr_wd = _ops.to_device([torch.tensor([lrs[i] * weight_decays[i] for i in adapting],
                                                    dtype=r2.dtype)], r2.device)[0]
            k = lr_wd * beta1 * ratio_r
            c2 = (c2 - 2.0 * k * sums[3] + k * k * r2).clamp(min=0.0)
        ratio_c = _ops.trust_ratio(w_norms, c2.sqrt(), o.lower_bound, o.upper_bound)
        _ops.scale_each_(pick(r, adapting), ratio_r)
        if o.decay_moved_weight:  # c = c - wd*lr*beta1*r: the decay of the weight moved by r
            for i, (lr, wd) in enumerate(zip(lrs, weight_decays)):
                if wd != 0:
                    c[i].add_(r[i], alpha=-wd * lr * beta1)
        _ops.scale_each_(pick(c, adapting), ratio_c)
        _ops.add_scaled_(params, r, [-lr * beta1 for lr in lrs])
        _ops.add_scaled_(params, c, [-lr * (1.0 - beta1) for lr in lrs])

    def _apply_whole(self) -> None:
        """:meth:`apply` on whole tensors: the norms taken here."""
        t, layer, o, r, c, adapting = self.t, self.layer, self.o, self.r, self.c, self.adapting
        params, lrs, beta1 = t.weights, layer.lrs, o.beta1
        w_norms = _ops.norms(pick(params, adapting))
        bounds = (o.lower_bound, o.upper_bound)
        for wd, ids in self.decays:
            _ops.add_decay_to_update(pick(r, ids), pick(params, ids), wd)
        _ops.apply_trust_ratio_(pick(r, adapting), w_norms, *bounds)
        if o.decay_moved_weight:
            _ops.add_scaled_(params, r, [-lr * beta1 for lr in lrs])
        for wd, ids in self.decays:
            _ops.add_decay_to_update(pick(c, ids), pick(params, ids), wd)
        _ops.apply_trust_ratio_(pick(c, adapting), w_norms, *bounds)
        if not o.decay_moved_weight:
            _ops.add_scaled_(params, r, [-lr * beta1 for lr in lrs])
        _ops.add_scaled_(params, c, [-lr * (1.0 - beta1) for lr in lrs])


#: LANS by implementation (see ``scaleopt._dispatch``).
_IMPLEMENTATIONS = {
    Impl.SINGLE: functools.partial(WholeUpdate, _single_tensor_lans),
    Impl.MULTI: _MultiTensorLans,
    Impl.NATIVE: _native.lans_kernel,
    Impl.TRITON: _triton.lans_triton,
}
