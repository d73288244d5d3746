"""LAMB: layer-wise adaptive moments for large-batch training."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _ops, _format, _native, _triton
from ._ops import by_value
from ._checks import check_choice
from ._dispatch import Impl, resolve
from ._group import GroupTensors, GroupOptions, TensorOptions, WholeUpdate, pick
from ._group import functional_tensors, w16_argument
from ._layerwise import LayerwiseAdam
from ._loading import ADAM_STATE
from ._params import NameRule
from ._sharding import Reduction, total, total_one

__all__ = ["LAMB", "lamb"]

WEIGHT_DECAY_MODES = tuple(_format.WEIGHT_DECAY_MODES)


class LAMB(LayerwiseAdam):
    r"""LAMB (You et al., 2020): Adam moments with a layer-wise trust ratio.

    For each parameter tensor :math:`w` with gradient :math:`g` at step :math:`t`:

    .. math::
        \begin{aligned}
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
        \hat m_t &= m_t / (1-\beta_1^t), \qquad \hat v_t = v_t / (1-\beta_2^t)
            \quad\text{(identity when bias_correction=False)}\\
        u_t &= \frac{\hat m_t}{\sqrt{\hat v_t} + \epsilon} + \lambda w_{t-1}
            \quad\text{(weight_decay_mode="update")}\\
        r_t &= \frac{\phi(\lVert w_{t-1}\rVert)}{\lVert u_t \rVert},
            \quad \phi(x) = \min(\max(x, \text{lower_bound}), \text{upper_bound})\\
        r_t &= 1 \text{ if } \phi(\lVert w_{t-1}\rVert) = 0 \text{ or } \lVert u_t\rVert = 0\\
        w_t &= w_{t-1} - \eta\, r_t\, u_t
        \end{aligned}

    With ``weight_decay_mode="decoupled"`` the decay is :math:`w \leftarrow w - \eta\lambda w`
    before the step, outside the ratio (Keras); with ``"l2"`` it is added to the gradient
    (:math:`g \leftarrow g + \lambda w`) before the moments. A tensor whose decay is 0 (because
    ``weight_decay=0`` or it is excluded) takes the trust ratio only if ``always_adapt=True``;
    otherwise its step is the plain Adam step :math:`\eta u_t` (Paddle, timm and apex default).
    A tensor excluded from layer adaptation never takes the ratio.

    Args:
        params: tensors, ``(name, tensor)`` pairs such as ``model.named_parameters()``, or
            param-group dicts. Name rules need names.
        lr (float, default 1e-3): learning rate :math:`\eta`.
        betas (tuple[float, float], default (0.9, 0.999)): :math:`(\beta_1, \beta_2)`.
        eps (float, default 1e-6): :math:`\epsilon`, added outside the square root.
        weight_decay (float, default 0.01): :math:`\lambda`.
        weight_decay_mode (str, default ``"update"``): where the decay enters: ``"update"``
            (added to the update before the trust ratio: LAMB paper, Paddle, MXNet, TF1),
            ``"decoupled"`` (``w -= lr*wd*w`` before the step: Keras) or ``"l2"`` (added to
            the gradient).
        bias_correction (bool, default True): divide the moments by :math:`1-\beta^t`.
        always_adapt (bool, default False): apply the trust ratio also to tensors whose decay
            is 0 (Paddle ``always_adapt``, apex ``use_nvlamb``).
        lower_bound (float or None, default None): lower clamp on :math:`\lVert w\rVert`.
        upper_bound (float or None, default None): upper clamp on :math:`\lVert w\rVert`.
        max_grad_norm (float or None, default None): clip gradients by their global norm
            (over every parameter of the optimizer): :math:`g \leftarrow g\,c/\max(\lVert
            g\rVert, c)`. ``None`` is off; 0 is rejected.
        clip_grad_value (float, (min, max) or None, default None): clamp each gradient element.
        clip_grad_norm_per_tensor (float or None, default None): clip each tensor's gradient
            by its own norm.
        rescale_grad (float, default 1.0): multiply gradients first (e.g. 1/loss scale).
        exclude_from_weight_decay (regex, list of regexes, callable(name) or None): names
            that get no decay (``re.search``).
        exclude_from_layer_adaptation (regex, list of regexes, callable(name) or None): names
            that never take the trust ratio.
        master_weights (bool, default False): keep float32 master weights and float32 moments for
            float16/bfloat16 parameters (Paddle's and MXNet's ``multi_precision``); the update
            runs in float32 and is rounded into the parameter. ``opt.master(p)`` returns the
            master; where the fused C kernels run, a bfloat16 parameter's master is kept split
            (the parameter + ``state["master_lo"]``, its low 16 bits). Saved in ``state_dict``
            as float32 ``master_param``.
        maximize (bool, default False): maximize the objective.
        foreach (bool or None, default None): ``True`` runs the multi-tensor path, ``False``
            the reference single-tensor loop; ``None`` picks, on CUDA, the Triton kernels
            where Triton is installed (the multi-tensor path otherwise) and, on the CPU, the
            fused C kernels for contiguous float32 tensors and bfloat16 ones with master
            weights (the loop otherwise). All give the same numbers up to float round-off.
        fused (bool or None, default None): ``True`` runs the fused kernels (the C kernels in
            host memory, the Triton kernels on CUDA; an error where they are not installed or
            cannot take the group's tensors), ``False`` leaves them out of ``None``'s choice.
            ``foreach`` and ``fused`` mean what they mean in :mod:`torch.optim` (see
            :doc:`/migrating`).
        implementation (str or None, default None): the path by name, instead of ``foreach``
            and ``fused``:
            ``"single"``, ``"multi"``, ``"native"`` (the C kernels) or ``"triton"`` (the
            Triton kernels, also on CPU tensors under ``TRITON_INTERPRET=1``); an error where
            it cannot take the tensors.
        capturable (bool, default False): keep the step counters on the parameters' device and
            read them, and the learning rate when it is a tensor on that device, there: the
            step reads nothing on the host and can be captured in a CUDA graph (change ``lr``
            between replays in place, ``group["lr"].fill_(...)``). The Triton kernels only.
        nonfinite (``"propagate"`` or ``"skip"``, default ``"propagate"``): what a step does
            with an inf/NaN gradient (see :doc:`/robustness`): let it flow into the update, as
            torch's optimizers do, or skip the whole step, counted in ``skipped_steps``.
        state_dtype (``"float32"``, ``"bfloat16"`` or ``"int8"``, default ``"float32"``): how
            the moments are stored between steps: as float32 (8 B/param), as bfloat16 rounded
            stochastically (4 B/param), or as 8-bit codes with a float32 scale per block of
            256 elements (about 2 B/param). The update computes in float32 either way. Tensors
            under 4096 elements, and one-dimensional ones for ``"int8"``, keep float32 state.
            See :doc:`/state`.

    Gradients go through ``rescale_grad``, ``clip_grad_value``, ``clip_grad_norm_per_tensor``
    and ``max_grad_norm`` in that order; ``p.grad`` is never modified.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LAMB(model.named_parameters(), lr=1e-3, weight_decay=0.01,
        ...            exclude_from_weight_decay=["bias"])
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()

    Paper: Yang You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes", ICLR 2020, https://arxiv.org/abs/1904.00962
    """

    _name_rule_keys = ("exclude_from_weight_decay", "exclude_from_layer_adaptation")
    _state_spec = ADAM_STATE._replace(kind="lamb")
    _own_options = ("weight_decay_mode",)  # of GroupOptions

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        weight_decay_mode: str = "update",
        bias_correction: bool = True,
        always_adapt: bool = False,
        lower_bound: Optional[float] = None,
        upper_bound: Optional[float] = None,
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
            weight_decay_mode=weight_decay_mode,
            bias_correction=bias_correction,
            always_adapt=always_adapt,
            lower_bound=lower_bound, upper_bound=upper_bound,
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
        check_choice(self._arg("weight_decay_mode"), group["weight_decay_mode"], WEIGHT_DECAY_MODES)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        with self._grad_source.stepping():
            plans = self._plan_step()  # the gradients in; each group's tensors and path
            updates = [_IMPLEMENTATIONS[p.impl](p.tensors, p.layer, p.options) for p in plans]
            # on local shards: the trust ratios' sums of all groups totalled in one all-reduce
            totals = total([u.sums() for u in updates])
            for update, group_totals in zip(updates, totals):
                update.apply(group_totals)
            self._finish_step(plans)
        return loss


def lamb(
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
    weight_decay_mode: str = "update",
    bias_correction: bool = True,
    lower_bound: Optional[float] = None,
    upper_bound: Optional[float] = None,
    foreach: bool = True,
    implementation: Optional[str] = None,
    w16: Optional[List[Optional[Tensor]]] = None,
    grad_multipliers: Union[Sequence[float], Tensor, None] = None,
    sharded_as: Optional[Sequence[Tensor]] = None,
    low: Optional[List[Optional[Tensor]]] = None,
) -> None:
    """Functional LAMB over lists of tensors; see :class:`LAMB`.

    ``lrs``, ``weight_decays`` and ``adapt`` are per tensor. ``grads`` are read, never written.
    ``implementation``: ``"single"`` (the reference loop), ``"multi"`` (multi-tensor ops) or
    ``"native"`` (the fused CPU kernels); by default ``foreach`` picks multi or single. ``w16``:
    the kernels' 16-bit tensor per weight, or None (the lower halves of a split master, or
    where a float32 master's rounded bfloat16 weights go; ``low``, its former name, still
    works, with a ``FutureWarning``). ``grad_multipliers``: a number per tensor that its
    gradient is taken times (the fused kernels as they read it, the others before). For lists
    of local shards (multi-tensor and kernels), ``sharded_as``: the DTensors whose local shards
    they are, over which the trust ratios' norms are totalled (one all-reduce per mesh
    dimension that shards them).
    """
    t = functional_tensors(params, grads, exp_avgs, exp_avg_sqs, state_steps,
                           w16_argument(w16, low), grad_multipliers, sharded_as)
    o = GroupOptions(beta1, beta2, eps, bias_correction, lower_bound, upper_bound,
                     weight_decay_mode)
    impl = resolve(implementation, foreach)
    update = _IMPLEMENTATIONS[impl](t if impl.fused else t.for_torch(),
                                    TensorOptions(lrs, weight_decays, adapt), o)
    update.apply(total_one(update.sums()))


def _single_tensor_lamb(t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> None:
    """The reference path: one tensor at a time, the algorithm as written in the docstring."""
    mode = o.weight_decay_mode
    for i, p in enumerate(t.weights):
        g, m, v, lr, wd = t.grads[i], t.exp_avgs[i], t.exp_avg_sqs[i], layer.lrs[i], layer.weight_decays[i]
        t.steps[i] += 1
        if mode == "l2" and wd != 0:
            g = g.add(p, alpha=wd)
        _ops.adam_moments_one(m, v, g, o.beta1, o.beta2)
        (bc1,), (bc2_sqrt,) = _ops.step_bias_corrections(
            [t.steps[i]], o.beta1, o.beta2, o.bias_correction
        )
        u = _ops.adam_direction_one(m, bc1, _ops.adam_denominator_one(v, bc2_sqrt, o.eps))
        if mode == "update" and wd != 0:
            u.add_(p, alpha=wd)
        elif mode == "decoupled" and wd != 0:
            p.mul_(1.0 - lr * wd)
        if layer.adapt[i]:
            ratio = _ops.trust_ratio(
                _ops.norm_one(p), _ops.norm_one(u), o.lower_bound, o.upper_bound
            )
            u.mul_(ratio.to(u.dtype))
        _ops.add_scaled_one_(p, u, -lr)


class _MultiTensorLamb:
    """The fast path: the same algorithm as a few multi-tensor kernels per group. On local
    shards, ``t.shard_sums`` totals the norms (the one reduction :meth:`sums` asks for)."""

    def __init__(self, t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> None:
        self.t, self.layer, self.o = t, layer, o

    def grad_sums(self) -> None:
        return None

    def sums(self, grad_totals: Optional[Tensor] = None) -> Optional[Reduction]:
        """The Adam directions plus decay; on local shards, ||w||^2 and ||u||^2 of the tensors
        that take the trust ratio, in one vector to total."""
        t, layer, o = self.t, self.layer, self.o
        params, lrs, weight_decays = t.weights, layer.lrs, layer.weight_decays
        if not params:
            return None
        torch._foreach_add_(t.steps, 1)
        decays = [(wd, ids) for wd, ids in by_value(weight_decays) if wd != 0]
        grads = t.grads
        if o.weight_decay_mode == "l2" and decays:
            grads = list(grads)
            for wd, ids in decays:
                for i, g in zip(ids, _ops.add_l2_to_grad(pick(grads, ids), pick(params, ids),
                                                            wd)):
                    grads[i] = g
        _ops.adam_moments(t.exp_avgs, t.exp_avg_sqs, grads, o.beta1, o.beta2)
        bc1, bc2_sqrt = _ops.step_bias_corrections(t.steps, o.beta1, o.beta2,
                                                       o.bias_correction)
        self.updates = updates = _ops.adam_direction(
            t.exp_avgs, bc1, _ops.adam_denominators(t.exp_avg_sqs, bc2_sqrt, o.eps))
        if o.weight_decay_mode == "update":
            for wd, ids in decays:
                _ops.add_decay_to_update(pick(updates, ids), pick(params, ids), wd)
        elif o.weight_decay_mode == "decoupled" and decays:
            _decoupled_decay(params, lrs, weight_decays)
        adapting = [i for i, a in enumerate(layer.adapt) if a]
        self.adapting = (pick(params, adapting), pick(updates, adapting))
        if t.shard_sums is None:
            return None
        sums = _ops.sq_norms(self.adapting[0] + self.adapting[1])
        return t.shard_sums.request(sums, adapting * 2)

    def apply(self, totals: Optional[Tensor]) -> None:
        """The trust ratios (of the whole tensors' norms: ``totals`` on local shards) and the
        step."""
        t, o = self.t, self.o
        if not t.weights:
            return
        weights, updates = self.adapting  # of the tensors that take the trust ratio
        if totals is None:
            _ops.apply_trust_ratio_(updates, _ops.norms(weights), o.lower_bound,
                                       o.upper_bound)
        else:
            w_norms, u_norms = totals.sqrt().split(len(weights))
            _ops.apply_trust_ratio_(updates, w_norms, o.lower_bound, o.upper_bound,
                                       u_norms=u_norms)
        _ops.add_scaled_(t.weights, self.updates, [-lr for lr in self.layer.lrs])


def _decoupled_decay(params: List[Tensor], lrs: Sequence[float],
                     weight_decays: Sequence[float]) -> None:
    """``w *= 1 - lr*wd`` (Keras' decay, before the step)."""
    if _ops.compiling():  # per tensor, the rate as a tensor's factor: an input of the
        for p, lr, wd in zip(params, lrs, weight_decays):  # graph, not a constant (add_scaled_)
            p.add_(p * lr, alpha=-wd)
    else:
        for (lr, wd), ids in by_value(list(zip(lrs, weight_decays))):
            _ops.decoupled_decay_(pick(params, ids), lr, wd)


#: LAMB by implementation (see ``scaleopt._dispatch``).
_IMPLEMENTATIONS = {
    Impl.SINGLE: functools.partial(WholeUpdate, _single_tensor_lamb),
    Impl.MULTI: _MultiTensorLamb,
    Impl.NATIVE: _native.lamb_kernel,
    Impl.TRITON: _triton.lamb_triton,
}
