"""The Adam family (LAMB, LANS, OffloadAdam): master weights and Adam state, made in one place."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from . import _compact
from ._base import ScaleOptimizer
from ._loading import ADAM_STATE
from ._masters import LocalPlacement, MasterView, MasterWeights

_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamState(NamedTuple):
    """A group's tensors as the update reaches them: the masters' view, and per tensor its step
    counter and moments (``max_exp_avg_sqs`` with amsgrad, else None)."""

    view: MasterView
    steps: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    max_exp_avg_sqs: Optional[List[Tensor]] = None
    #: moments stored in bfloat16 or 8 bits, read into the float32 working tensors above: to
    #: store back once the update has run (:meth:`AdamFamily._store_moments`)
    pending: Optional[List[_compact.Pending]] = None


class AdamFamily(ScaleOptimizer):
    """Base of the optimizers with Adam moments and float32 master weights.

    Per parameter, the state holds ``step`` (a float32 CPU scalar, as in :mod:`torch.optim`; on
    the parameter's device where the group says ``capturable``),
    ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), shaped and laid out as
    the tensor the update runs on, in its dtype (float32 for a split master), and where the
    parameter has one, its master (``scaleopt._masters``).
    """

    _state_spec = ADAM_STATE

    def _attach(self) -> None:
        super()._attach()
        self._master_weights = MasterWeights(self, LocalPlacement())  # an offload's: the host's

    def master(self, p: Tensor) -> Tensor:
        """The float32 master weights of ``p``: a new tensor for a split master, the stored copy
        for another low-precision parameter with master weights, ``p`` itself otherwise."""
        return self._master_weights.master(p)

    def _adam_state(self, group: Dict[str, Any], params: List[Tensor],
                    amsgrad: bool = False) -> AdamState:
        """The masters' view of ``params`` and their Adam state, made where new (masters equal
        to the parameters, moments zero); a step counter moved to where it belongs as float32
        (e.g. from a fused CUDA Adam's checkpoint) and moments cast to the working dtype (e.g.
        from a checkpoint saved without master weights)."""
        view = self._master_weights.view(group, params)
        keys = _MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())
        on_device = group.get("capturable", False)  # the step counters where the weights are
        cpu, f32 = torch.device("cpu"), torch.float32
        steps: List[Tensor] = []
        moments: List[List[Tensor]] = [[] for _ in keys]
        pending: List[_compact.Pending] = []
        for p, w, split in zip(params, view.weights, view.split):
            state = self.state[p]
            step = state.get("step")
            device = w.device if on_device else cpu
            if step is None or step.dtype != f32 or (step.device != device if on_device
                                                     else not step.is_cpu):
                step = state["step"] = (torch.zeros((), dtype=f32, device=device) if step is None
                                        else step.to(device, f32))
            steps.append(step)
            dtype = f32 if split else w.dtype
            form = _compact.form_for(group["state_dtype"], self._state_shape(p))
            _compact.convert(state, form, w, dtype)  # another form: a group changed its option
            for key, out in zip(keys, moments):
                if form != "float32":
                    out.append(_compact.working(state, key, form, w, dtype, pending))
                    continue
                x = state.get(key)
                if x is None:
                    x = state[key] = torch.zeros_like(w, dtype=dtype,
                                                      memory_format=torch.preserve_format)
                elif x.dtype != dtype:  # e.g. a checkpoint saved without master weights
                    x = state[key] = x.to(dtype)
                out.append(x)
        return AdamState(view, steps, moments[0], moments[1],
                         moments[2] if amsgrad else None, pending)

    def _store_moments(self, state: AdamState) -> None:
        """Store the moments read from bfloat16 or 8 bits back, after the update."""
        if state.pending:
            _compact.store(state.pending)
