"""What LAMB and LANS share: per-layer options, and each group's plan for a step."""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from . import _native
from ._adam import AdamFamily, AdamState
from ._checks import check_bool, check_bounds
from ._compile import eager
from ._dispatch import Impl, check_implementation, confirmed, implementation
from ._dispatch import takes as takes_tensors
from ._group import _DTYPE, _PLAIN, GroupOptions, GroupTensors, TensorOptions
from ._intake import Deferral, GroupGrads
from ._sharding import local


class LayerwiseAdam(AdamFamily):
    """Base of the layer-wise adaptive optimizers (LAMB, LANS).

    A subclass's ``step`` reads top to bottom: :meth:`_plan_step` (the gradients in, and per
    group a :class:`GroupPlan`: its tensors, :class:`~scaleopt._group.GroupTensors`, their
    per-layer options, :class:`~scaleopt._group.TensorOptions`, and the implementation), the
    update of each group as its functional form gives it (a :class:`~scaleopt._group.Update`)
    in phases, the sums of all groups totalled between them, then :meth:`_finish_step`.

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

    #: the group's options of a subclass's own in its :class:`~scaleopt._group.GroupOptions`
    _own_options: Tuple[str, ...] = ()
    #: per group (by id), the last step's :class:`GroupPlan`: the optimizer's own, not copied
    _not_pickled = AdamFamily._not_pickled + ("_plans",)
    #: Keyword arguments of :meth:`_intake` (LANS clips values itself).
    _intake_options: Dict[str, Any] = {}
    #: A GradScaler hands the step its scale and inf flag: the scale goes into the gradients'
    #: multipliers (on the device for the Triton kernels); an inf skips the step (decided on
    #: the device where every group is ``capturable``)
    _takes_amp_scale = True
    _fused_kernels = True  # the C kernels in host memory, the Triton kernels on CUDA

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        self._validate_adam_group(group)
        a = self._arg
        check_bool(a("bias_correction"), group["bias_correction"])
        check_bool(a("always_adapt"), group["always_adapt"])
        check_bool(a("master_weights"), group["master_weights"])
        check_bounds(group["lower_bound"], group["upper_bound"], a("lower_bound"), a("upper_bound"))
        check_implementation(group)
        if group["fused"]:  # the kernels are there for the group's device (ValueError if not)
            implementation(group, group["params"], on_host=self._grad_source.on_host)
        check_bool(a("capturable"), group["capturable"])
        if group["capturable"] and group["implementation"] not in (None, "triton"):
            raise ValueError(f"capturable=True runs on the Triton kernels, not "
                             f"implementation={group['implementation']!r}")

    # -- per-parameter options ------------------------------------------------------------------

    def _param_multipliers(
        self, group: Dict[str, Any], idx: Sequence[int]
    ) -> Tuple[Optional[List[float]], Optional[List[float]]]:
        """Per-parameter (lr, weight-decay) multipliers; ``None`` means all 1. Front-ends override."""
        return None, None

    def _layer_options(self, group: Dict[str, Any], idx: Sequence[int],
                       multipliers: Optional[Tuple[Optional[List[float]],
                                                   Optional[List[float]]]] = None
                       ) -> TensorOptions:
        """Per parameter of ``idx``: learning rate, weight decay, and whether it takes the ratio;
        ``multipliers``: :meth:`_param_multipliers`'s, where the caller has them already.

        A parameter excluded from weight decay has decay 0. It takes the trust ratio unless it is
        excluded from layer adaptation, or its decay is 0 and ``always_adapt`` is off.
        """
        no_decay = self._rule_flags(group, "exclude_from_weight_decay")
        no_adapt = self._rule_flags(group, "exclude_from_layer_adaptation")
        lr_mult, wd_mult = multipliers or self._param_multipliers(group, idx)
        lr, wd = group["lr"], group["weight_decay"]
        lrs = _rates(lr, lr_mult, len(idx))
        wds = [0.0 if no_decay[i] else wd for i in idx]
        if wd_mult is not None:
            wds = [w * m for w, m in zip(wds, wd_mult)]
        adapt = [not no_adapt[i] and (w != 0 or group["always_adapt"]) for i, w in zip(idx, wds)]
        return TensorOptions(lrs, wds, adapt)

    # -- the step --------------------------------------------------------------------------------

    @eager  # host bookkeeping: under torch.compile the updates are traced, not this
    def _plan_step(self) -> List["GroupPlan"]:
        """Nothing on a step that a GradScaler skips (on the host). Otherwise each group's
        implementation (the last step's plan's while the group's options and parameters are the
        same objects, else chosen before the group's state exists), the gradients in
        (``scaleopt._intake``: their scalar transforms left to the fused kernels, for the
        groups that chose them), then each group's :class:`GroupPlan`: the last step's again
        with this step's gradients where nothing it is made of changed (:meth:`_kept_plan`),
        else a new one (:meth:`_new_plan`)."""
        found = getattr(self, "found_inf", None)  # a GradScaler's, during its step
        if found is not None and not all([g.get("capturable") for g in self.param_groups]) \
                and float(found) != 0.0:
            return []  # skipped on the host (every group capturable: on the device)
        skip_if = found.reshape(()) if found is not None else None
        on_host = self._grad_source.on_host
        kept: Dict[int, GroupPlan] = self.__dict__.setdefault("_plans", {})
        chosen, fused = {}, []
        for group in self.param_groups:
            plan = kept.get(id(group))
            if plan is not None and not plan.holds_options(group):
                del kept[id(group)]  # another group, or its options changed
                plan = None
            impl = chosen[id(group)] = (plan.first if plan is not None else
                                        implementation(group, group["params"], on_host=on_host))
            if impl.fused:
                fused.append(id(group))  # its gradients' scalars deferred to the kernels
        intake = self._intake(defer=Deferral(fused, _native.sums_of_squares),
                              **self._intake_options)
        plans = []
        for item in intake:
            group = item.group
            step_skip = skip_if if group.get("capturable") else None
            plan = self._kept_plan(kept.get(id(group)), item, step_skip)
            if plan is None:
                plan = self._new_plan(item, chosen[id(group)], step_skip, on_host)
                if plan.impl.fused and not plan.state.pending:
                    kept[id(group)] = plan  # (the PyTorch paths: made again each step)
            plans.append(plan)
        return plans

    def _kept_plan(self, plan: Optional["GroupPlan"], item: GroupGrads,
                   skip_if: Optional[Tensor]) -> Optional["GroupPlan"]:
        """The last step's plan of the group with this step's gradients, where its options,
        the parameters that have a gradient, their state (the same objects:
        :meth:`_adam_state`) and the gradients' dtypes, sizes, devices and layout are as they
        were; else None. What the kernels keep in ``tensors.cache`` is checked by the kernels
        against the addresses it was made for."""
        if (plan is None or item.idx != plan.idx
                or not plan.holds_options(item.group)):  # (a front-end's schedule, say)
            return None
        grads = item.grads
        if not (all(map(operator.is_, item.params, plan.state.view.params))
                and list(map(_DTYPE, grads)) == plan.grad_dtypes
                and list(map(Tensor.numel, grads)) == plan.numels
                and list(map(Tensor.get_device, grads)) == plan.grad_devices
                and set(map(type, grads)) <= _PLAIN and all(map(Tensor.is_contiguous, grads))
                and self._adam_state(item.group, item.params) is plan.state):
            return None
        group = item.group
        layer = plan.layer
        if group["lr"] is not plan.lr:  # a schedule's new rate
            plan.lr = group["lr"]
            layer = plan.layer = layer._replace(lrs=_rates(plan.lr, plan.lr_mult, len(grads)))
        if item.shard_sums is None:  # (the plan's own object: no update holds it now)
            t = plan.tensors
            t.grads, t.grad_scalars, t.skip_if = grads, item.scalars, skip_if
        else:  # local shards: taken again (a shard may have moved), what is kept kept
            plan.tensors = dataclasses.replace(self._tensors(plan.state, item, skip_if),
                                               cache=plan.tensors.cache)
        return plan

    def _new_plan(self, item: GroupGrads, first: Impl, skip_if: Optional[Tensor],
                  on_host: bool) -> "GroupPlan":
        """A group's plan made anew: its state (made where new), tensors, options, and the
        implementation ``first`` confirmed with the tensors."""
        group = item.group
        state = self._adam_state(group, item.params)
        t = self._tensors(state, item, skip_if)
        takes = first.fused and takes_tensors(first, t)
        if t.stored and not takes:
            state = state.decoded()  # float32 working tensors for the other paths
            t = self._tensors(state, item, t.skip_if)
        impl = first if takes else confirmed(first, group, item.params, t, on_host=on_host)
        if group.get("capturable") and impl is not Impl.TRITON:
            raise ValueError(f"capturable=True needs the Triton kernels (CUDA tensors and "
                             f"Triton installed), and this group's step runs on "
                             f"{impl.value!r}")
        joined = None
        if not impl.fused:  # the PyTorch paths: on float32 masters, split ones joined
            joined = self._master_weights.joined(state.view)
            t = dataclasses.replace(t, weights=local(joined)).for_torch()
        else:
            t = dataclasses.replace(t, cache={})
        view = state.view
        grads = item.grads
        multipliers = self._param_multipliers(group, item.idx)
        layer = self._layer_options(group, item.idx, multipliers)  # (tuples: Triton keeps them)
        layer = layer._replace(weight_decays=tuple(layer.weight_decays), adapt=tuple(layer.adapt))
        return GroupPlan(
            group, impl, t, layer,
            GroupOptions.of(group, **{key: group[key] for key in self._own_options}), state,
            joined, first=first, values=list(group.values()), lr_at=list(group).index("lr"),
            idx=list(item.idx), lr=group["lr"],
            lr_mult=multipliers[0],
            masters=not all(map(operator.is_, view.params, view.weights)),
            grad_dtypes=list(map(_DTYPE, grads)), numels=list(map(Tensor.numel, grads)),
            grad_devices=list(map(Tensor.get_device, grads)))

    def _finish_step(self, plans: List["GroupPlan"]) -> None:
        """After the updates: split masters split again, the parameters brought up to date
        with their masters, moments stored back in bfloat16 or 8 bits, and the plans let go of
        the step's gradients."""
        adapted = False
        for plan in plans:
            view = plan.state.view
            if plan.joined is not None:
                self._master_weights.split_back(view, plan.joined)
            if plan.masters:
                self._master_weights.commit(view, rounded_written=plan.impl.fused)
            if plan.state.pending:
                self._store_moments(plan.state)
            adapted = adapted or any(plan.layer.adapt)
            # a kept plan holds no tensor of the step: gradients set to None are freed
            t = plan.tensors
            t.grads, t.grad_scalars, t.shard_sums, t.grad_norms, t.skip_if = \
                [], None, None, None, None
        if plans and not adapted:
            self._warn_no_trust_ratio()

    @staticmethod
    def _tensors(state: AdamState, item: GroupGrads, skip_if: Optional[Tensor]) -> GroupTensors:
        """A group's tensors for its update (local shards of sharded ones)."""
        view = state.view
        stored = state.stored if state.stored and any(state.stored) else None
        return GroupTensors(local(view.weights), item.grads, local(state.exp_avgs),
                            local(state.exp_avg_sqs), state.steps, local(view.kernel_w16()),
                            item.scalars, item.shard_sums, item.grad_norms, skip_if, stored)

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


@dataclasses.dataclass
class GroupPlan:
    """One group's step, as :meth:`LayerwiseAdam._plan_step` makes it."""

    group: Dict[str, Any]
    #: the implementation that runs the update
    impl: Impl
    #: the tensors the update works on (``scaleopt._group``), as its implementation takes
    #: them (:meth:`~scaleopt._group.GroupTensors.for_torch` for the PyTorch paths)
    tensors: GroupTensors
    #: their learning rates, decays and adapt flags
    layer: TensorOptions
    #: the group's options
    options: GroupOptions
    state: AdamState
    #: for the PyTorch paths: the float32 masters the update works on, split ones joined
    joined: Optional[List[Tensor]] = None
    #: what the plan was made of, to find it again at the next step
    #: (:meth:`LayerwiseAdam._kept_plan`): the implementation chosen before the state existed,
    #: the group's values, the positions of the parameters that had a gradient, the learning
    #: rate and its per-tensor multipliers
    first: Impl = Impl.SINGLE
    values: List[Any] = dataclasses.field(default_factory=list)
    lr_at: int = 0
    idx: List[int] = dataclasses.field(default_factory=list)
    lr: Any = None
    lr_mult: Optional[List[float]] = None
    #: whether any parameter has a master (else nothing to bring up to date)
    masters: bool = True
    #: the gradients' dtypes, sizes and devices (``Tensor.get_device``: -1 for the CPU)
    grad_dtypes: List[Any] = dataclasses.field(default_factory=list)
    numels: List[int] = dataclasses.field(default_factory=list)
    grad_devices: List[int] = dataclasses.field(default_factory=list)

    def holds_options(self, group: Dict[str, Any]) -> bool:
        """Whether ``group`` is the plan's, holding the same objects as its values but for
        the learning rate (which a schedule changes every step:
        :meth:`LayerwiseAdam._kept_plan`)."""
        if self.group is not group or len(group) != len(self.values):
            return False
        same = list(map(operator.is_, group.values(), self.values))
        same[self.lr_at] = True
        return all(same)


def _rates(lr: Any, multipliers: Optional[Sequence[float]], count: int) -> List[Any]:
    """Each tensor's learning rate: the group's, times its multiplier where there are any."""
    return [lr] * count if multipliers is None else [lr * m for m in multipliers]
