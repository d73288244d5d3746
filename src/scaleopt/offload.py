"""Optimizers whose state and update live in host memory while the model lives on a device.

:class:`OffloadAdam` is Adam/AdamW on the host pipeline (``scaleopt._host.HostPipeline``:
float32 master weights and optimizer state in host memory, pinned when the parameter is on an
accelerator; gradients copied to the host as soon as backward produces them; the update run on
the host; the weights copied back without blocking). :func:`offload` puts LAMB or LANS on it.

When a parameter already lives in host memory as a float32 tensor (a CPU model), it is its own
master: the step updates it in place and nothing is copied.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Type

import torch
from torch import Tensor

from . import _ops, _native
from ._adam import AdamFamily
from ._base import lr_number
from ._checks import check_bool, check_choice
from ._compile import eager
from ._host import HostPipeline, attach_host
from ._intake import Deferral, GroupGrads
from ._layerwise import LayerwiseAdam
from ._params import NameRule, param_label
from ._sharding import local

__all__ = ["OffloadAdam", "HostPipeline", "offload"]


class OffloadAdam(AdamFamily):
    r"""Adam / AdamW with float32 master weights and state in host memory.

    The parameters stay on their device in any float dtype; the update runs on the host (see
    ``scaleopt._host`` for the pipeline). The numbers are those of :class:`torch.optim.AdamW`
    (``decoupled=True``) or :class:`torch.optim.Adam` (``decoupled=False``):

    .. math::
        \begin{aligned}
        g &\leftarrow \pm\, c \cdot \nabla / s \quad (+\lambda w \text{ if not decoupled})\\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g,\qquad v_t = \beta_2 v_{t-1} + (1-\beta_2) g^2\\
        w &\leftarrow w\,(1-\eta\lambda)_{\text{decoupled}}
            - \frac{\eta}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}
        \end{aligned}

    where :math:`s` is the loss scale (``loss_scale`` times a :class:`torch.amp.GradScaler`'s
    scale) and :math:`c` the global-norm clipping factor, folded into one scalar that the host
    kernel applies while it reads the gradient: ``p.grad`` is never written. An inf/NaN
    reported by a GradScaler skips the step with no change of state, as torch's fused Adam
    does; other inf/NaN gradients are handled as ``nonfinite`` says.

    The state holds ``step``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad),
    as :class:`torch.optim.AdamW`, plus ``master_param`` for parameters that are not float32 host
    tensors: a ``state_dict`` loads into and from :class:`torch.optim.AdamW`.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float, default 1e-3), betas (default (0.9, 0.999)), eps (default 1e-8).
        weight_decay (float, default 0): :math:`\lambda`.
        decoupled (bool, default True): AdamW's decoupled decay; False adds :math:`\lambda w` to
            the gradient (Adam's L2).
        amsgrad (bool, default False), maximize (bool, default False): as in torch.
        nesterov (bool, default False): step along :math:`\beta_1 m_t + (1-\beta_1) g`
            instead of :math:`m_t` (MindSpore's ``use_nesterov``).
        eps_mode (``"standard"`` or ``"hat"``, default ``"standard"``): ``"hat"`` is the Adam
            paper's :math:`\hat\epsilon` form, :math:`w \leftarrow w - \eta
            \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\frac{m_t}{\sqrt{v_t}+\epsilon}` (MindSpore,
            TensorFlow's Adam).
        exclude_from_weight_decay (name rule, default None): names that get no decay.
        max_grad_norm (float or None, default None): clip by the global norm of all gradients.
        loss_scale (float, default 1): the gradients are divided by it.
        nonfinite (``"propagate"`` or ``"skip"``, default ``"propagate"``): what a step does
            with an inf/NaN gradient (see :doc:`/robustness`): let it flow into the update, as
            torch's optimizers do, or skip the whole step, counted in ``skipped_steps``.
        state_dtype (``"float32"``, ``"bfloat16"`` or ``"int8"``, default ``"float32"``): how
            the moments are stored between steps, as in :class:`LAMB` (see :doc:`/state`).
        check_finite (bool, default False): ``True`` is ``nonfinite="skip"`` (the name of
            earlier releases).
        num_threads (int or None, default None): intra-op threads of the host step (``None``:
            torch's setting).
        overlap (bool, default True): start the gradient copies from backward hooks. The
            step copies again a gradient changed after its copy by an operation that bumps
            its version counter (``clip_grad_norm_``, ``p.grad.mul_()``, ``unscale_``), not one
            changed through ``p.grad.data``: such loops pass ``overlap=False``.
        foreach (None or False), fused (bool or None, default None): the path, as in
            :mod:`torch.optim`: ``fused=True`` the host kernel for every parameter (an error
            where it cannot run), ``fused=False`` or ``foreach=False`` the per-tensor
            reference; there is no multi-tensor path (``foreach=True`` is an error).

    After a step, ``opt.skipped`` tells whether it was skipped for a non-finite gradient.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OffloadAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step(); opt.zero_grad()

    References: Kingma & Ba, "Adam", ICLR 2015; Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019; Ren et al., "ZeRO-Offload", USENIX ATC 2021.
    """

    _name_rule_keys = ("exclude_from_weight_decay",)
    _takes_amp_scale = True
    _multi_tensor = False  # the host kernel or the per-tensor reference
    _fused_kernels = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = True,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        nesterov: bool = False,
        eps_mode: str = "standard",
        exclude_from_weight_decay: NameRule = None,
        max_grad_norm: Optional[float] = None,
        loss_scale: float = 1.0,
        check_finite: bool = False,
        nonfinite: str = "propagate",
        num_threads: Optional[int] = None,
        overlap: bool = True,
        state_dtype: str = "float32",
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled,
            amsgrad=amsgrad,
            maximize=maximize,
            nesterov=nesterov,
            eps_mode=eps_mode,
            exclude_from_weight_decay=exclude_from_weight_decay,
            max_grad_norm=max_grad_norm,
            loss_scale=loss_scale,
            state_dtype=state_dtype,
            foreach=foreach,
            fused=fused,
        )
        check_bool("check_finite", check_finite)
        self.skipped = False
        super().__init__(params, defaults, nonfinite="skip" if check_finite else nonfinite)
        attach_host(self, overlap=overlap, num_threads=num_threads)

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (they are also inert once the optimizer is deleted)."""
        self.host.remove_hooks()

    def _computes_in_float32(self, group: Dict[str, Any], p: Tensor) -> bool:
        return p.dtype != torch.float64  # others have float32 masters on the host

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        a = self._arg
        self._validate_adam_group(group)
        check_bool(a("decoupled"), group["decoupled"])
        check_bool(a("amsgrad"), group["amsgrad"])
        check_bool(a("nesterov"), group["nesterov"])
        check_choice("eps_mode", group["eps_mode"], ("standard", "hat"))
        if group["fused"] and (group["amsgrad"] or not _native.available()):
            raise ValueError("fused=True runs the host kernel: " + (
                "it has no amsgrad" if group["amsgrad"] else _native.NOT_BUILT))
        if group["amsgrad"] and group["nesterov"]:
            raise ValueError("amsgrad=True and nesterov=True cannot be combined")
        for p in group["params"]:
            if not p.is_floating_point():
                raise TypeError(f"{type(self).__name__} optimizes floating-point tensors, got {p.dtype}")

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        with self.host.stepping() as threads:
            host_kernels = Deferral(None, _native.sums_of_squares,
                                    lambda g: _native.any_nonfinite(g, threads))
            intake = self._intake(defer=host_kernels, amp_skip=True)
            self.skipped = intake.skipped
            for item in intake:
                self._update_group(item, threads)
        if not self.skipped:
            self._after_step()
        return loss

    def _after_step(self) -> None:
        """Called at the end of every step taken (not a skipped one: a framework's step
        counter does not count it either). Front-ends override it."""

    def _step_scalars(self, group: Dict[str, Any], step: float) -> Tuple[float, float]:
        """``(step_size, d)`` of the update ``w -= step_size * m / (sqrt(v)/d + eps)`` at step
        ``step``: ``(lr/(1-b1^t), sqrt(1-b2^t))``, or ``(lr*sqrt(1-b2^t)/(1-b1^t), 1)`` in the
        epsilon-hat form."""
        beta1, beta2 = group["betas"]
        bc1 = 1 - beta1 ** step
        bc2_sqrt = math.sqrt(1 - beta2 ** step)
        if group["eps_mode"] == "hat":
            return lr_number(group) * bc2_sqrt / bc1, 1.0
        return lr_number(group) / bc1, bc2_sqrt

    def _one_minus_betas(self, group: Dict[str, Any]) -> Tuple[float, float]:
        """``(1-beta1, 1-beta2)`` as the update uses them (in double, as torch)."""
        beta1, beta2 = group["betas"]
        return 1.0 - beta1, 1.0 - beta2

    @eager
    def _update_group(self, item: GroupGrads, threads: int) -> None:
        """One group's Adam step: the kernel for the tensors it takes, the reference for the
        others (on float32 masters: split ones joined, then split again)."""
        group, params = item.group, item.params
        state = self._adam_state(group, params, amsgrad=group["amsgrad"])
        stored = state.stored or [None] * len(params)
        kernel = not group["amsgrad"] and _native.kernels_allowed(group)
        fast = [kernel and _native.adam_applies(*row, st) for row, st in zip(
            zip(*(local(xs) for xs in (state.view.weights, item.grads, state.exp_avgs,
                                      state.exp_avg_sqs, state.view.kernel_w16()))), stored)]
        slow = [k for k, f in enumerate(fast) if not f]
        if slow and group["fused"]:
            raise ValueError(f"fused=True: the host kernel cannot take parameter "
                             f"{param_label(group, item.idx[slow[0]])} (it takes contiguous "
                             f"float32 masters, moments and gradients)")
        state = state.decoded(slow)  # float32 working tensors for the reference's tensors
        no_decay = self._rule_flags(group, "exclude_from_weight_decay")
        # sharded parameters: the local shards (the gradients already are)
        rows = [_Row(*row) for row in zip(
            *(local(xs) for xs in (state.view.weights, state.view.kernel_w16(),
                                   state.exp_avgs, state.exp_avg_sqs)),
            item.grads, state.steps,
            [1.0] * len(params) if item.scalars is None else item.scalars.mults.tolist(),
            [0.0 if no_decay[i] else group["weight_decay"] for i in item.idx],
            self._steps_scalars(group, state.steps), state.stored or [None] * len(params))]
        vmaxes = local(state.max_exp_avg_sqs or [None] * len(params))
        slow_view = state.view.subset(slow)
        masters = self._master_weights.joined(slow_view)
        for k, master in zip(slow, local(masters)):
            self._reference_step(group, rows[k], master, vmaxes[k])
        self._master_weights.split_back(slow_view, masters)
        self._kernel_step(group, [row for row, f in zip(rows, fast) if f], threads)
        self._master_weights.commit(state.view, fast)
        self._store_moments(state)

    def _reference_step(self, group: Dict[str, Any], row: "_Row", master: Tensor,
                        vmax: Optional[Tensor]) -> None:
        """One tensor's step by :func:`_adam_reference` on its float32 ``master``."""
        row.step.add_(1)
        g = row.grad.to(torch.float32) if row.grad.dtype != master.dtype else row.grad
        beta1, beta2 = group["betas"]
        _adam_reference(master, g * row.mult if row.mult != 1.0 else g, row.exp_avg,
                        row.exp_avg_sq, vmax, lr=lr_number(group), beta1=beta1, beta2=beta2,
                        one_minus_betas=self._one_minus_betas(group),
                        step_size=row.scalars[0], bc2_sqrt=row.scalars[1], eps=group["eps"],
                        weight_decay=row.decay, decoupled=group["decoupled"],
                        nesterov=group["nesterov"])

    def _kernel_step(self, group: Dict[str, Any], rows: List["_Row"], threads: int) -> None:
        """The tensors of ``rows`` in one call of the host kernel."""
        decoupled, lr = group["decoupled"], lr_number(group)
        beta1, beta2 = group["betas"]
        _native.adam(
            [r.weight for r in rows], [r.grad for r in rows], [r.exp_avg for r in rows],
            [r.exp_avg_sq for r in rows], [r.w16 for r in rows], [r.step for r in rows],
            step_sizes=[r.scalars[0] for r in rows],
            bias_correction2_sqrts=[r.scalars[1] for r in rows],
            weight_decays_l2=[0.0 if decoupled else r.decay for r in rows],
            decays=[1.0 - lr * r.decay if decoupled else 1.0 for r in rows],
            beta1=beta1, beta2=beta2, eps=group["eps"], grad_multipliers=[r.mult for r in rows],
            nesterov=group["nesterov"], one_minus_betas=self._one_minus_betas(group),
            threads=threads, stored=[r.stored for r in rows])

    def _steps_scalars(self, group, steps: List[Tensor]) -> List[Tuple[float, float]]:
        """Per tensor, :meth:`_step_scalars` at the step about to be taken."""
        cache: Dict[float, Tuple[float, float]] = {}
        out = []
        for st in steps:
            step = st.item() + 1.0
            if step not in cache:
                cache[step] = self._step_scalars(group, step)
            out.append(cache[step])
        return out


class _Row(NamedTuple):
    """One tensor of an OffloadAdam step (local shards of sharded ones)."""

    weight: Tensor
    #: the kernel's second tensor (see ``MasterView.kernel_w16``)
    w16: Optional[Tensor]
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor
    step: Tensor
    #: the gradient's deferred multiplier, and the tensor's weight decay
    mult: float
    decay: float
    #: (step size, sqrt of the second bias correction) at the step about to be taken
    scalars: Tuple[float, float]
    #: how the moments are stored where the kernel updates them in bfloat16 or 8 bits
    stored: Any = None


def _adam_reference(w: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Optional[Tensor], *,
                    lr: float, beta1: float, beta2: float, one_minus_betas: Tuple[float, float],
                    step_size: float, bc2_sqrt: float, eps: float, weight_decay: float,
                    decoupled: bool, nesterov: bool) -> None:
    """Adam on one tensor with torch ops (any layout, dtype or device), for what the kernel does
    not take: torch's single-tensor Adam/AdamW (``vmax`` given: amsgrad), with the Nesterov
    numerator ``b1*m + (1-b1)*g`` when asked."""
    if weight_decay != 0:
        if decoupled:
            w.mul_(1 - lr * weight_decay)
        else:
            g = g.add(w, alpha=weight_decay)
    _ops.adam_moments_one(m, v, g, beta1, beta2, one_minus_betas)
    if vmax is not None:
        torch.maximum(vmax, v, out=vmax)
    denom = _ops.adam_denominator_one(v if vmax is None else vmax, bc2_sqrt, eps)
    num = m.mul(beta1).add_(g, alpha=one_minus_betas[0]) if nesterov else m
    w.addcdiv_(num, denom, value=-step_size)


def offload(optimizer_class: Type[LayerwiseAdam], params: Any, *, overlap: bool = True,
            num_threads: Optional[int] = None, **options: Any) -> LayerwiseAdam:
    """``optimizer_class`` (:class:`~scaleopt.LAMB`, :class:`~scaleopt.LANS` or
    :class:`~scaleopt.Muon`) on the host pipeline: float32 masters (split for bfloat16
    parameters) and moments in host memory, gradients to the host, the fused host kernels,
    weights back to the device. The result is an ``optimizer_class`` whose ``host`` is the
    pipeline.

    Muon's momentum (in its ``state_dtype``) and masters live in host memory and its AdamW part
    runs there; each matrix's Newton-Schulz iteration runs where the parameter is (on a GPU,
    on the GPU), one matrix at a time, so the device holds an update only while it is made.
    The update is :class:`~scaleopt.Muon`'s with ``master_weights=True``, bit for bit where
    both run on the host.

    >>> import scaleopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = offload(scaleopt.LAMB, model.named_parameters(), lr=1e-3)
    >>> model(torch.randn(8, 4)).square().mean().backward()
    >>> opt.step()
    """
    from .muon import Muon

    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, (LayerwiseAdam, Muon))):
        raise TypeError(
            f"offload() takes scaleopt.LAMB, scaleopt.LANS or scaleopt.Muon (or a subclass); "
            f"for Adam use scaleopt.OffloadAdam. Got {optimizer_class!r}"
        )
    if "master_weights" in options and not options["master_weights"]:
        raise ValueError("offloaded optimizers always keep float32 master weights (master_weights)")
    opt = optimizer_class(params, **dict(options, master_weights=True))  # as its groups say
    attach_host(opt, overlap=overlap, num_threads=num_threads)
    return opt
