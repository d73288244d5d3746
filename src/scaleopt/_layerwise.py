"""What LAMB and LANS share: per-layer options, fp32 master weights, Adam state, the step loop."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _blocks, _native
from ._base import ScaleOptimizer, check_bool, check_number, use_foreach

LOW_PRECISION = (torch.float16, torch.bfloat16)


def pick(xs: Sequence[Tensor], idx: Sequence[int]) -> List[Tensor]:
    return [xs[i] for i in idx]


def check_bounds(lo: Any, hi: Any, lo_name: str = "lower_bound", hi_name: str = "upper_bound") -> None:
    check_number(lo_name, lo, low=0.0, low_open=True, allow_none=True)
    check_number(hi_name, hi, low=0.0, low_open=True, allow_none=True)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"Invalid {lo_name}/{hi_name}: {lo!r} > {hi!r}")


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

    @staticmethod
    def _splits(group: Dict[str, Any], p: Tensor) -> bool:
        """Whether ``p``'s master is to be kept split (the fused kernels' storage, see the class
        doc): decided when its state is created or loaded; an explicit ``foreach`` keeps float32
        masters for the PyTorch paths."""
        return (group["master_weights"] and group.get("foreach") is None
                and p.dtype == torch.bfloat16 and p.device.type == "cpu" and p.is_contiguous()
                and _native.available())

    def master(self, p: Tensor) -> Tensor:
        """The float32 master weights of ``p``: a new tensor for a split master, the stored copy
        for another low-precision parameter with master weights, ``p`` itself otherwise."""
        state = self.state.get(p, {})
        if "master_lo" in state:
            return _native.split_join(p.detach(), state["master_lo"])
        return state.get("master_param", p)

    def _masters(self, group: Dict[str, Any], params: List[Tensor]) -> List[Tensor]:
        """The tensors the update runs on: the float32 master of a float16/bfloat16 parameter
        when ``master_weights`` is on (the parameter itself for a split master, whose lower
        halves :meth:`_low_targets` gives), the parameter itself otherwise."""
        if not group["master_weights"]:
            return params
        work = []
        for p in params:
            if p.dtype in LOW_PRECISION:
                state = self.state[p]
                master = state.get("master_param")
                if "master_lo" in state or (master is None and self._splits(group, p)):
                    if "master_lo" not in state:  # the master starts equal to the parameter
                        state["master_lo"] = torch.zeros(p.shape, dtype=torch.int16)
                    work.append(p)
                    continue
                if master is None:
                    master = state["master_param"] = p.detach().to(torch.float32, copy=True)
                work.append(master)
            else:
                work.append(p)
        return work

    def _adam_state(self, params: List[Tensor], work: List[Tensor]):
        ms, vs, steps = [], [], []
        for p, w in zip(params, work):
            state = self.state[p]
            dtype = torch.float32 if "master_lo" in state else w.dtype
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

    def state_dict(self) -> Dict[str, Any]:
        return joined_masters(self, super().state_dict())

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved_groups = state_dict["param_groups"]
        fp32: Dict[int, Dict[str, Tensor]] = {}
        for sg, g in zip(saved_groups, self.param_groups):
            for pid, p in zip(sg["params"], g["params"]):
                st = state_dict["state"].get(pid, {})
                if "master_param" in st and p.dtype in LOW_PRECISION:
                    fp32[id(p)] = {
                        k: v.to(device=p.device, dtype=torch.float32, copy=True)
                        for k, v in st.items()
                        if k != "step" and torch.is_tensor(v) and v.is_floating_point()
                    }
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                st.pop("master_lo", None)
                if id(p) in fp32:
                    st.update(fp32[id(p)])
                    if self._splits(g, p):
                        st["master_lo"] = torch.zeros(p.shape, dtype=torch.int16)
                        _native.split_(st.pop("master_param"), p.detach(), st["master_lo"])
                elif p.dtype not in LOW_PRECISION:
                    st.pop("master_param", None)  # a float32 parameter is its own master

    # -- the step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        with self._step_context():
            self._step_groups()
        return loss

    def _step_context(self):
        """A context manager around the update (the offloaded variants set threads and buffers)."""
        return contextlib.nullcontext()

    def _kernels_may_run(self, group: Dict[str, Any], params: List[Tensor]) -> bool:
        """Whether the fused CPU kernels may take the group's step, so that the gradients'
        scalar transforms can be left to them (``ScaleOptimizer._intake``'s ``defer``)."""
        return (group.get("foreach") is None and _native.available()
                and all(p.device.type == "cpu" for p in params))

    def _step_groups(self) -> None:
        for group, idx, params, grads, scalars in self._intake(defer=self._kernels_may_run,
                                                               **self._intake_options):
            work = self._masters(group, params)
            ms, vs, steps = self._adam_state(params, work)
            lrs, wds, adapt = self._layer_options(group, idx)
            low = self._low_targets(params, work)
            # a split master's upper half (work) is written by the kernels or split_ below, and
            # its lower half is no parameter: ``written`` is about bfloat16 copies only
            split = ["master_lo" in self.state[p] for p in params]
            if group.get("foreach") is None and _native.applies(work, grads, ms, vs, low):
                self._update(group, work, grads, ms, vs, steps, lrs, wds, adapt, low=low,
                             scalars=scalars)
                self._write_back(params, work, low, [not s for s in split])
                continue
            if scalars is not None:  # deferred scalars the kernels did not take after all
                grads = _blocks.clip_by_value(torch._foreach_mul(grads, scalars.mults),
                                              scalars.clamp)
            # the PyTorch path runs on float32 masters: split ones are joined, then split again
            full = [_native.split_join(w.detach(), lp) if s else w
                    for w, lp, s in zip(work, low, split)]
            work_g = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, full)]
            self._update(group, full, work_g, ms, vs, steps, lrs, wds, adapt)
            for w, f, lp, s in zip(work, full, low, split):
                if s:
                    _native.split_(f, w.detach(), lp)
            self._write_back(params, work, low, [False] * len(params))

    def _low_targets(self, params: List[Tensor], work: List[Tensor]) -> List[Optional[Tensor]]:
        """Per parameter: the lower halves of a split master; for another parameter with a
        master, the low-precision tensor the fused kernels may write the rounded weights into in
        their pass (:meth:`_low_target`); None for a parameter that is its own master."""
        return [self.state[p]["master_lo"] if "master_lo" in self.state[p]
                else (None if p is w else self._low_target(p)) for p, w in zip(params, work)]

    def _low_target(self, p: Tensor) -> Optional[Tensor]:
        """Where the rounded weights of ``p``'s master go: ``p`` itself."""
        return p

    def _write_back(self, params: List[Tensor], work: List[Tensor], low: List[Optional[Tensor]],
                    written: List[bool]) -> None:
        """Round each master into its parameter, unless the kernels did (``written[i]``)."""
        back = [(p, w) for p, w, lp, done in zip(params, work, low, written)
                if p is not w and not (done and lp is p)]
        if back:
            torch._foreach_copy_([p for p, _ in back], [w for _, w in back])

    _intake_options: Dict[str, Any] = {}

    @staticmethod
    def _functional_options(group: Dict[str, Any], params: List[Tensor]) -> Dict[str, Any]:
        """The keyword arguments LAMB's and LANS's functional forms share, read off a group."""
        beta1, beta2 = group["betas"]
        return dict(
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            bias_correction=group["bias_correction"],
            lower_bound=group["lower_bound"],
            upper_bound=group["upper_bound"],
            foreach=use_foreach(group, params),
        )

    def _update(self, group, params, grads, exp_avgs, exp_avg_sqs, steps, lrs, wds, adapt,
                low=None, scalars=None) -> None:
        """One group's update. ``low`` is given when the fused CPU kernels take the group: then
        ``low[i]`` is the bfloat16 parameter of master ``params[i]`` (or None), to be written
        in the same pass, and ``scalars`` the gradients' :class:`~scaleopt._base.GradScalars`
        (or None)."""
        raise NotImplementedError


def joined_masters(opt: Any, sd: Dict[str, Any]) -> Dict[str, Any]:
    """``sd`` (``opt``'s state dict) with each split master stored as a float32 ``master_param``
    (from ``opt.master(p)``) instead of its ``master_lo`` halves."""
    index = 0
    for g in opt.param_groups:
        for p in g["params"]:
            st = sd["state"].get(index)
            if st is not None and "master_lo" in st:
                st = {k: v for k, v in st.items() if k != "master_lo"}
                st["master_param"] = opt.master(p)
                sd["state"][index] = st
            index += 1
    return sd
