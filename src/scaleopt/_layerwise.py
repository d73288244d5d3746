"""What LAMB and LANS share: per-layer options, fp32 master weights, Adam state, the step loop."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _native
from ._base import (Deferral, GradScalars, GroupGrads, ScaleOptimizer, apply_grad_scalars,
                    check_bool, check_number)
from ._compile import eager
from ._dispatch import Impl, implementation
from ._masters import LocalPlacement, MasterView, MasterWeights
from ._sharding import Steps, local, settle_together


def pick(xs: Sequence[Tensor], idx: Sequence[int]) -> List[Tensor]:
    return [xs[i] for i in idx]


def check_bounds(lo: Any, hi: Any, lo_name: str = "lower_bound", hi_name: str = "upper_bound") -> None:
    check_number(lo_name, lo, low=0.0, low_open=True, allow_none=True)
    check_number(hi_name, hi, low=0.0, low_open=True, allow_none=True)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"Invalid {lo_name}/{hi_name}: {lo!r} > {hi!r}")


@dataclasses.dataclass
class GroupTensors:
    """What :meth:`LayerwiseAdam._init_group` gathers for one group's update."""

    view: MasterView
    #: the tensors the update reads (local shards of sharded ones)
    weights: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    #: per tensor, the kernels' second tensor (see :meth:`MasterView.kernel_low`)
    low: List[Optional[Tensor]]
    steps: List[Tensor]
    #: per-tensor learning rates, weight decays and adaptation flags
    layer: Tuple[List[float], List[float], List[bool]]


class LayerwiseAdam(ScaleOptimizer):
    """Base of the layer-wise adaptive optimizers (LAMB, LANS).

    Subclasses implement :meth:`_update`, which receives, for one group, the working tensors
    (fp32 masters where ``master_weights`` applies), the Adam state and per-parameter learning
    rates, weight decays and adaptation flags.

    With ``master_weights=True``, a float16/bfloat16 parameter keeps float32 master weights and
    float32 moments; the update runs in float32 on the master, which is then rounded into the
    parameter. :meth:`master` returns the master. Where the fused CPU kernels run (a contiguous
    bfloat16 CPU parameter), the master is kept *split*: the parameter itself holds its upper
    16 bits (rounded to nearest) and ``state["master_lo"]`` (int16) its lower 16 bits, so the
    master costs 2 extra bytes per parameter instead of 4 and the step moves fewer bytes than a
    float32 one. Elsewhere it is a float32 tensor, ``state["master_param"]``.
    :meth:`state_dict` always stores the master as float32 ``master_param``, and
    :meth:`load_state_dict` keeps it (and the moments) in float32, so a resumed run continues from
    the float32 master, not from the rounded weights.
    """

    _name_rule_keys = ("exclude_from_weight_decay", "exclude_from_layer_adaptation")

    def _attach(self) -> None:
        super()._attach()
        self._master_weights = MasterWeights(self, LocalPlacement())

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        self._validate_adam_group(group)
        a = self._arg
        check_bool(a("bias_correction"), group["bias_correction"])
        check_bool(a("always_adapt"), group["always_adapt"])
        check_bool(a("master_weights"), group["master_weights"])
        check_bounds(group["lower_bound"], group["upper_bound"], a("lower_bound"), a("upper_bound"))

    # -- per-parameter options ------------------------------------------------------------------

    def _param_multipliers(
        self, group: Dict[str, Any], idx: Sequence[int]
    ) -> Tuple[Optional[List[float]], Optional[List[float]]]:
        """Per-parameter (lr, weight-decay) multipliers; ``None`` means all 1. Front-ends override."""
        return None, None

    def _layer_options(
        self, group: Dict[str, Any], idx: Sequence[int]
    ) -> Tuple[List[float], List[float], List[bool]]:
        """Per parameter of ``idx``: learning rate, weight decay, and whether it takes the ratio.

        A parameter excluded from weight decay has decay 0. It takes the trust ratio unless it is
        excluded from layer adaptation, or its decay is 0 and ``always_adapt`` is off.
        """
        no_decay = self._rule_flags(group, "exclude_from_weight_decay")
        no_adapt = self._rule_flags(group, "exclude_from_layer_adaptation")
        lr_mult, wd_mult = self._param_multipliers(group, idx)
        lr, wd = group["lr"], group["weight_decay"]
        lrs = [lr] * len(idx) if lr_mult is None else [lr * m for m in lr_mult]
        wds = [0.0 if no_decay[i] else wd for i in idx]
        if wd_mult is not None:
            wds = [w * m for w, m in zip(wds, wd_mult)]
        adapt = [not no_adapt[i] and (w != 0 or group["always_adapt"]) for i, w in zip(idx, wds)]
        return lrs, wds, adapt

    # -- state -----------------------------------------------------------------------------------

    def master(self, p: Tensor) -> Tensor:
        """The float32 master weights of ``p``: a new tensor for a split master, the stored copy
        for another low-precision parameter with master weights, ``p`` itself otherwise."""
        return self._master_weights.master(p)

    def _adam_state(self, params: List[Tensor], view: MasterView):
        """Step counters and moments (float32 for a master, else the working tensor's dtype)."""
        ms, vs, steps = [], [], []
        for p, w, split in zip(params, view.weights, view.split):
            state = self.state[p]
            dtype = torch.float32 if split else w.dtype
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(w, dtype=dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(w, dtype=dtype,
                                                       memory_format=torch.preserve_format)
            for key in ("exp_avg", "exp_avg_sq"):
                if state[key].dtype != dtype:  # e.g. a checkpoint saved without master weights
                    state[key] = state[key].to(dtype)
            ms.append(state["exp_avg"])
            vs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return ms, vs, steps

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        with (contextlib.nullcontext() if self.host is None else self.host.stepping()):
            self._step_groups()
        return loss

    def _takes_grad_scalars(self, group: Dict[str, Any], params: List[Tensor]) -> bool:
        """Whether the fused kernels may take the group's step, so that the gradients' scalar
        transforms are left to them (``ScaleOptimizer._intake``'s deferral)."""
        return implementation(group, params, on_host=self.host is not None) is Impl.NATIVE

    def _init_group(self, item: GroupGrads) -> "GroupTensors":
        """A group's tensors for its update (state made where new): the masters' view, the
        moments and step counters, the per-layer options, and the local shards the update
        reads (the tensors themselves where nothing is sharded)."""
        view = self._master_weights.view(item.group, item.params)
        exp_avgs, exp_avg_sqs, steps = self._adam_state(item.params, view)
        return GroupTensors(view, *(local(xs) for xs in (view.weights, exp_avgs, exp_avg_sqs,
                                                          view.kernel_low())),
                            steps, self._layer_options(item.group, item.idx))

    def _step_groups(self) -> None:
        defer = Deferral(self._takes_grad_scalars, _native.sums_of_squares)
        intake = self._intake(defer=defer, **self._intake_options)
        # the groups in lockstep: the sums each asks to total travel in one reduction
        adapted = settle_together([self._group_steps(item) for item in intake])
        if adapted and not any(adapted):
            self._warn_no_trust_ratio()

    def _group_steps(self, item: GroupGrads) -> Steps:
        """One group's update, as steps (see ``scaleopt._sharding``); returns whether any of
        its tensors took the trust ratio."""
        group, t = item.group, self._init_group(item)
        sharded = {} if item.shard_sums is None else dict(
            shard_sums=item.shard_sums, grad_norms=item.grad_norms)
        impl = implementation(group, item.params, on_host=self.host is not None,
                              tensors=(t.weights, item.grads, t.exp_avgs, t.exp_avg_sqs, t.low))
        if impl is Impl.NATIVE:  # on the masters as stored, scalars applied as read
            yield from self._update(group, t.weights, item.grads, t.exp_avgs, t.exp_avg_sqs,
                                    t.steps, t.layer, impl, low=t.low, scalars=item.scalars,
                                    **sharded)
        else:  # on float32 masters (split ones joined, then split again)
            grads = apply_grad_scalars(item.grads, item.scalars)
            with self._master_weights.as_float32(t.view) as full:
                full = local(full)  # sharded: the local shards (the gradients already are)
                grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, full)]
                yield from self._update(group, full, grads, t.exp_avgs, t.exp_avg_sqs, t.steps,
                                        t.layer, impl, **sharded)
        self._master_weights.commit(t.view, rounded_written=impl is Impl.NATIVE)
        return any(t.layer[2])

    @eager
    def _warn_no_trust_ratio(self) -> None:
        """Once per optimizer: no tensor took the trust ratio, so the step was Adam's (e.g. a
        trainer that builds the groups with ``weight_decay=0``, the default of HF's
        ``TrainingArguments``)."""
        if self.__dict__.get("_warned_no_trust_ratio"):
            return
        self._warned_no_trust_ratio = True
        warnings.warn(
            f"{type(self).__name__}: no tensor takes the trust ratio, so the step is Adam's: "
            f"every tensor has weight_decay 0 with always_adapt=False, or is excluded from layer "
            f"adaptation. Give the tensors that should adapt a weight_decay > 0, or pass "
            f"always_adapt=True", UserWarning, stacklevel=4)

    #: Keyword arguments of :meth:`_intake` (LANS clips values itself).
    _intake_options: Dict[str, Any] = {}

    @staticmethod
    def _functional_options(group: Dict[str, Any]) -> Dict[str, Any]:
        """The keyword arguments LAMB's and LANS's functional forms share, read off a group."""
        beta1, beta2 = group["betas"]
        return dict(
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            bias_correction=group["bias_correction"],
            lower_bound=group["lower_bound"],
            upper_bound=group["upper_bound"],
        )

    def _update(self, group: Dict[str, Any], params: List[Tensor], grads: List[Tensor],
                exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor], steps: List[Tensor],
                layer: Tuple[List[float], List[float], List[bool]], impl: Impl,
                low: Optional[List[Optional[Tensor]]] = None,
                scalars: Optional[GradScalars] = None, shard_sums: Any = None,
                grad_norms: Optional[Tensor] = None) -> Steps:
        """One group's update by ``impl``: ``layer`` holds the per-tensor learning rates, weight
        decays and adaptation flags; for ``NATIVE``, ``low[i]`` is the split master's lower
        half or where the rounded weights of master ``params[i]`` go (or None), and
        ``scalars`` the gradients' deferred scalars; on local shards, ``shard_sums`` totals
        their norms, and ``grad_norms`` are the gradients' (whole) norms where known. Returns the
        update as steps, which yield the sums to total over the shards."""
        raise NotImplementedError
