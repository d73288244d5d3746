"""What LAMB and LANS share: per-layer options, the step over the groups in lockstep."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from . import _native, _triton
from ._adam import AdamFamily, AdamState
from ._foreach import compiling
from ._checks import check_bool, check_bounds
from ._compile import eager
from ._dispatch import Impl, check_implementation, implementation
from ._group import GroupTensors, TensorOptions
from ._intake import Deferral, GroupGrads
from ._sharding import Phased, any_dtensor, local, run_lockstep


class LayerwiseAdam(AdamFamily):
    """Base of the layer-wise adaptive optimizers (LAMB, LANS).

    A subclass's ``step`` is :meth:`_step_in_lockstep` with its functional form, which it
    calls once per group with the group's tensors (:class:`~scaleopt._group.GroupTensors`),
    their per-layer options (:class:`~scaleopt._group.TensorOptions`) and the implementation
    that :func:`scaleopt._dispatch.implementation` picks.

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

    def _step_in_lockstep(self, closure: Any, update: Callable[..., Phased]) -> Any:
        """A step: the gradients in, then each group's ``update(group, tensors, layer,
        implementation)`` (the optimizer's functional form), the groups in lockstep, so that the
        sums they ask to total over the shards travel in one reduction."""
        loss = self._closure_loss(closure)
        found = getattr(self, "found_inf", None)  # a GradScaler's, during its step
        on_device = all(group.get("capturable") for group in self.param_groups)
        if found is not None and not on_device and float(found) != 0.0:
            return loss  # skipped, as a GradScaler skips any optimizer's step
        skip_if = found.reshape(()) if found is not None else None
        with self._grad_source.stepping():
            defer = Deferral(self._kernels_may_take, _native.sums_of_squares)
            intake = self._intake(defer=defer, **self._intake_options)
            adapted = run_lockstep([self._group_update(item, update, skip_if)
                                    for item in intake])
        if adapted and not any(adapted):
            self._warn_no_trust_ratio()
        return loss

    def _kernels_may_take(self, group: Dict[str, Any], params: List[Tensor]) -> bool:
        """Whether kernels that apply the gradients' scalar transforms as they read them (the C
        or Triton kernels) may take the group's step, so that those transforms are left to them
        (the intake's deferral: per-tensor multipliers made where the gradients are)."""
        return implementation(group, params, on_host=self._grad_source.on_host).fused

    def _group_update(self, item: GroupGrads, update: Callable[..., Phased],
                      skip_if: Optional[Tensor] = None) -> Phased:
        """One group's update, in phases: its tensors (state made where new), the
        implementation picked for them, the update on the masters as that implementation takes
        them (split ones joined into float32 for the PyTorch paths, split again after), and
        the parameters brought up to date. Returns whether any tensor took the trust ratio."""
        group = item.group
        state = self._adam_state(group, item.params)
        t = self._tensors(state, item, skip_if if group.get("capturable") else None)
        if t.stored and not self._kernels_take_stored(group, item.params, t):
            state = state.decoded()  # float32 working tensors for the other paths
            t = self._tensors(state, item, t.skip_if)
        view = state.view
        layer = self._step_layer_options(group, item.idx)
        impl = implementation(group, item.params, on_host=self._grad_source.on_host, tensors=t)
        if group.get("capturable") and impl is not Impl.TRITON:
            raise ValueError(f"capturable=True needs the Triton kernels (CUDA tensors and Triton "
                             f"installed), and this group's step runs on {impl.value!r}")
        if impl.fused:
            yield from update(group, t, layer, impl)
        else:
            with self._master_weights.as_float32(view) as full:
                yield from update(group, dataclasses.replace(t, weights=local(full)), layer, impl)
        self._master_weights.commit(view, rounded_written=impl.fused)
        self._store_moments(state)
        return any(layer.adapt)

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

    def _kernels_take_stored(self, group: Dict[str, Any], params: List[Tensor],
                             t: GroupTensors) -> bool:
        """Whether the group's update runs on kernels that update moments stored in bfloat16 or
        8 bits in place, block by block, with no float32 copies: the C kernels, or the Triton
        kernels."""
        impl = implementation(group, params, on_host=self._grad_source.on_host)
        return ((impl is Impl.NATIVE and _native.applies(t))
                or (impl is Impl.TRITON and _triton.applies(t)))

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
