"""DGC as a ``DistributedDataParallel`` communication hook.

    state = DGCHookState(model, momentum=0.9, sparsity=[0.999], min_numel=16384)
    ddp.register_comm_hook(state, ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)   # no momentum: it lives in the state

The hook replaces DDP's all-reduce of a bucket: it adds weight decay, clips, runs the momentum
correction and selection per parameter, all-gathers exactly k (index, value) pairs per tensor and
returns, for each parameter, the update DGC applies; plain SGD then does ``w -= lr * update``.
This equals :class:`DGCMomentum`. The residuals are keyed by parameter name, not by bucket, so
DDP's bucket rebuild after the first iteration does not disturb them; the state pickles without
its model and process group (set them again after loading), like torch's PowerSGD state.
"""

import warnings
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .._sharding import any_dtensor
from .replicas import SHARDED_ERROR
from .optimizer import (dgc_updates, finish_telemetry, local_gradients,
                        new_telemetry)
from .schedule import PAPER_SPARSITY


class DGCHookState:
    """Options and per-parameter residuals (``u``, ``v``) of :func:`ddp_comm_hook`."""

    def __init__(self, model: nn.Module, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, sparsity: Sequence[float] = PAPER_SPARSITY,
                 rampup_begin_step: int = 0, rampup_step: int = 1,
                 local_grad_clip_norm: Optional[float] = None, min_numel: int = 16384, *,
                 weight_decay_mode: str = "l2", momentum_masking: bool = True,
                 selection: str = "sample", value_dtype: Optional[torch.dtype] = None,
                 process_group: Optional[Any] = None) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if model is not None and any_dtensor(list(model.parameters())):
            raise TypeError(SHARDED_ERROR)
        self.model: Optional[nn.Module] = model
        self.process_group = process_group
        self.options = dict(momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                            weight_decay_mode=weight_decay_mode, sparsity=list(sparsity),
                            rampup_begin_step=rampup_begin_step, rampup_step=rampup_step,
                            local_grad_clip_norm=local_grad_clip_norm, min_numel=min_numel,
                            momentum_masking=momentum_masking, selection=selection)
        from .optimizer import DGCMomentum

        DGCMomentum([nn.Parameter(torch.zeros(1))], lr=0.0, **{  # the same checks
            k: v for k, v in self.options.items()}, value_dtype=value_dtype)
        self.value_dtype = value_dtype
        self.step = 0
        self.residuals: Dict[str, Dict[str, torch.Tensor]] = {}
        self.telemetry: Dict[str, float] = {}
        self._tel = new_telemetry()
        self._generator = torch.Generator().manual_seed(0)
        self._names: Dict[int, str] = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("model", "process_group", "_names", "_generator"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.model, self.process_group, self._names = None, None, {}
        self._generator = torch.Generator().manual_seed(0)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals (``u``, ``v`` by parameter name), the step and the sampling
        generator's state. The residuals differ from rank to rank: every rank saves its own
        (e.g. ``torch.save(state.state_dict(), f"dgc-rank{rank}.pt")``), not rank 0 alone."""
        return {"step": self.step, "residuals": self.residuals,
                "generator": self._generator.get_state(),
                "world_size": comm.world_of(self.process_group), "rank": _rank(self.process_group)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of the same rank. Saved at another world size or by
        another rank, the residuals do not belong here: they are dropped (with a warning) and
        the step and the generator are kept."""
        world, rank = comm.world_of(self.process_group), _rank(self.process_group)
        self.step = int(state_dict["step"])
        self._generator.set_state(state_dict["generator"])
        saved = (state_dict.get("world_size", world), state_dict.get("rank", rank))
        if saved != (world, rank):
            warnings.warn(f"DGCHookState: residuals saved by rank {saved[1]} of {saved[0]} loaded "
                          f"on rank {rank} of {world}; they belong to the old ranks and are reset",
                          stacklevel=2)
            self.residuals = {}
            return
        self.residuals = {n: {k: v.clone() for k, v in st.items()}
                          for n, st in state_dict["residuals"].items()}

    def attach(self, model: nn.Module, process_group: Optional[Any] = None) -> "DGCHookState":
        """Set the model (and group) again, e.g. after unpickling."""
        self.model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.process_group = process_group
        self._names = {}
        return self

    def name_of(self, p: torch.Tensor) -> str:
        if not self._names:
            if self.model is None:
                raise RuntimeError("DGCHookState has no model: call state.attach(model)")
            self._names = {id(q): n for n, q in self.model.named_parameters()}
        return self._names[id(p)]


def _rank(group: Optional[Any]) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def ddp_comm_hook(state: "DGCHookState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: returns the bucket's DGC updates (see the module doc)."""
    params = bucket.parameters()
    grads = [g.detach() for g in bucket.gradients()]
    world = comm.world_of(state.process_group)
    opts = state.options
    grads = local_gradients(grads, params, opts, world)
    states = []
    for p in params:
        name = state.name_of(p)
        st = state.residuals.get(name)
        if st is None:
            st = state.residuals[name] = {"u": torch.zeros_like(p, memory_format=torch.contiguous_format),
                                          "v": torch.zeros_like(p, memory_format=torch.contiguous_format)}
        states.append(st)
    updates = dgc_updates(grads, states, opts, state.step, world, state.process_group,
                          state.value_dtype, state._generator, state._tel)
    buffer = bucket.buffer()
    out = torch.zeros_like(buffer)
    for view, upd in zip(bucket.gradients(), updates):
        at = (view.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        out[at:at + view.numel()].copy_(upd.reshape(-1))
    if bucket.is_last():
        state.step += 1
        finish_telemetry(state._tel)
        state.telemetry, state._tel = state._tel, new_telemetry()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)
    return fut
