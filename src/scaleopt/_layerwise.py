"""What LAMB and LANS share: per-layer options, and each group's plan for a step."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from . import _native
from ._adam import AdamFamily, AdamState
from ._foreach import compiling
from ._checks import check_bool, check_bounds
from ._compile import eager
from ._dispatch import Impl, check_implementation, confirmed, implementation
from ._dispatch import takes as takes_tensors
from ._group import GroupOptions, GroupTensors, TensorOptions
from ._intake import Deferral, GroupGrads
from ._sharding import any_dtensor, local


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

    def _layer_options(self, group: Dict[str, Any], idx: Sequence[int]) -> TensorOptions:
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
        return TensorOptions(lrs, wds, adapt)

    def _step_layer_options(self, group: Dict[str, Any], idx: Sequence[int]) -> TensorOptions:
        """:meth:`_layer_options`, whose decays and flags are made again only when what they
        are made of changed (eagerly: the same tuples are given again otherwise, by which the
        Triton path keeps its table columns)."""
        if compiling():
            return self._layer_options(group, idx)
        lr, wd = group["lr"], group["weight_decay"]
        made_of = (self._rule_flags(group, "exclude_from_weight_decay"),
                   self._rule_flags(group, "exclude_from_layer_adaptation"),
                   self._param_multipliers(group, idx), lr, wd, group["always_adapt"], list(idx))
        memo = self.__dict__.setdefault("_layer_memo", {})
        last = memo.get(id(group))
        if last is None or last[0] != made_of:
            layer = self._layer_options(group, idx)
            last = memo[id(group)] = (made_of, layer._replace(
                weight_decays=tuple(layer.weight_decays), adapt=tuple(layer.adapt)))
        return last[1]

    # -- the step --------------------------------------------------------------------------------

    @eager  # host bookkeeping: under torch.compile the updates are traced, not this
    def _plan_step(self) -> List["GroupPlan"]:
        """Nothing on a step that a GradScaler skips (on the host). Otherwise each group's
        implementation chosen (before its state exists), the gradients in
        (``scaleopt._intake``: their scalar transforms left to the fused kernels, for the
        groups that chose them), then each group's :class:`GroupPlan`: its tensors (state made
        where new), their options, and the implementation confirmed with the tensors."""
        found = getattr(self, "found_inf", None)  # a GradScaler's, during its step
        if found is not None and not all([g.get("capturable") for g in self.param_groups]) \
                and float(found) != 0.0:
            return []  # skipped on the host (every group capturable: on the device)
        skip_if = found.reshape(()) if found is not None else None
        on_host = self._grad_source.on_host
        chosen = {id(group): implementation(group, group["params"], on_host=on_host)
                  for group in self.param_groups}
        fused = [key for key, impl in chosen.items() if impl.fused]  # their scalars deferred
        intake = self._intake(defer=Deferral(fused, _native.sums_of_squares),
                              **self._intake_options)
        plans = []
        for item in intake:
            group = item.group
            first = chosen[id(group)]
            state = self._adam_state(group, item.params)
            t = self._tensors(state, item, skip_if if group.get("capturable") else None)
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
                # (plain lists: torch.compile traces a list subclass as an object of its own)
                t = dataclasses.replace(t, weights=local(joined), exp_avgs=list(t.exp_avgs),
                                        exp_avg_sqs=list(t.exp_avg_sqs),
                                        steps=list(t.steps)).for_torch()
            options = GroupOptions.of(group, **{key: group[key] for key in self._own_options})
            plans.append(GroupPlan(group, impl, t, self._step_layer_options(group, item.idx),
                                   options, state, joined))
        return plans

    def _finish_step(self, plans: List["GroupPlan"]) -> None:
        """After the updates: split masters split again, the parameters brought up to date
        with their masters, moments stored back in bfloat16 or 8 bits."""
        adapted = False
        for plan in plans:
            view = plan.state.view
            if plan.joined is not None:
                self._master_weights.split_back(view, plan.joined)
            self._master_weights.commit(view, rounded_written=plan.impl.fused)
            self._store_moments(plan.state)
            adapted = adapted or any(plan.layer.adapt)
        if plans and not adapted:
            self._warn_no_trust_ratio()

    @staticmethod
    def _tensors(state: AdamState, item: GroupGrads, skip_if: Optional[Tensor]) -> GroupTensors:
        """A group's tensors for its update (local shards of sharded ones)."""
        view = state.view
        stored = state.stored if state.stored and any(state.stored) else None
        # eagerly the state's own lists, which the Triton path keeps; copies (plain lists)
        # under torch.compile, which would trace a list subclass as an object of its own
        moments = [xs if not compiling() and not any_dtensor(xs) else local(xs)
                   for xs in (state.exp_avgs, state.exp_avg_sqs)]
        return GroupTensors(local(view.weights), item.grads, *moments, state.steps,
                            local(view.kernel_w16()), item.scalars, item.shard_sums,
                            item.grad_norms, skip_if, stored)

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
