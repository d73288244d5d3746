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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .._sharding import any_dtensor, local_piece
from . import replicas
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
        for key in ("model", "process_group", "mesh", "_names", "_generator"):
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
        world, rank = self._place()
        return {"step": self.step, "residuals": self.residuals,
                "generator": self._generator.get_state(), "world_size": world, "rank": rank}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of the same rank. Saved at another world size or by
        another rank, the residuals do not belong here: they are dropped (with a warning) and
        the step and the generator are kept."""
        world, rank = self._place()
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

    def _place(self) -> Tuple[int, int]:
        """(world size, rank) the residuals belong to."""
        return comm.world_of(self.process_group), _rank(self.process_group)

    def residuals_of(self, named: Sequence[Tuple[str, torch.Tensor]]
                     ) -> List[Dict[str, torch.Tensor]]:
        """The residuals (``u``, ``v``) of each (name, local tensor), made at zero the first
        time."""
        states = []
        for name, p in named:
            st = self.residuals.get(name)
            if st is None:
                st = self.residuals[name] = {
                    k: torch.zeros_like(p, memory_format=torch.contiguous_format) for k in "uv"}
            states.append(st)
        return states

    def attach(self, model: nn.Module, process_group: Optional[Any] = None) -> "DGCHookState":
        """Set the model (and group) again, e.g. after unpickling."""
        self.model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        self.process_group = process_group
        self._names = {}
        return self

    def finish_step(self) -> None:
        """Count the step and publish its telemetry."""
        self.step += 1
        finish_telemetry(self._tel)
        self.telemetry, self._tel = self._tel, new_telemetry()

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
    states = state.residuals_of([(state.name_of(p), p) for p in params])
    updates = dgc_updates(grads, states, opts, state.step, world, state.process_group,
                          state.value_dtype, state._generator, state._tel)
    buffer = bucket.buffer()
    out = torch.zeros_like(buffer)
    for view, upd in zip(bucket.gradients(), updates):
        at = (view.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        out[at:at + view.numel()].copy_(upd.reshape(-1))
    if bucket.is_last():
        state.finish_step()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)
    return fut


class ReplicaCompression(DGCHookState):
    """Top-k with error feedback between HSDP replicas, feeding any optimizer.

    On a 2-D ``(replicate, shard)`` mesh, the model ``fully_shard``-ed on ``mesh["shard"]``
    reduce-scatters each gradient inside its replica (the fast links) and nothing crosses the
    replicas. :meth:`exchange`, called between ``backward()`` and ``opt.step()``, does that
    exchange over the replicate dimension as the DDP hook does: each rank adds its local
    shard's gradient to its residual, sends the top-k (with DGC's warm-up, ``min_numel`` of
    the whole parameter, ``value_dtype``) to the ranks holding the same shard in the other
    replicas, keeps the rest, and leaves in ``p.grad`` the replicas' mean of what was sent::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        compress = ReplicaCompression(model, mesh, momentum=0.0, sparsity=[0.999])
        opt = scaleopt.AdamW(model.parameters(), lr=1e-3)
        loss.backward(); compress.exchange(); opt.step()

    The options are :class:`DGCHookState`'s; ``momentum=0`` (the default here) is plain top-k
    with error feedback, for adaptive optimizers. Each rank's residuals are its own: save
    :meth:`state_dict` per rank; loaded on another mesh or rank they are reset with a warning.
    """

    def __init__(self, model: nn.Module, mesh: Any, momentum: float = 0.0, **options: Any) -> None:
        mesh = replicas.check_mesh(mesh, options.pop("process_group", None))
        if mesh is None:
            raise TypeError("ReplicaCompression needs mesh=, a 2-D (replicate, shard) DeviceMesh")
        replicas.check_params(list(model.parameters()), mesh)
        super().__init__(None, momentum=momentum, process_group=mesh.get_group(0), **options)
        self.model, self.mesh = model, mesh

    def _place(self) -> Tuple[int, int]:
        """The residuals are those of this rank's shard: the global world size and rank."""
        return dist.get_world_size(), dist.get_rank()

    def attach(self, model: nn.Module, process_group: Optional[Any] = None,
               mesh: Optional[Any] = None) -> "ReplicaCompression":
        """Set the model and mesh again, e.g. after unpickling."""
        self.model, self.mesh, self._names = model, mesh, {}
        self.process_group = mesh.get_group(0) if mesh is not None else process_group
        return self

    @torch.no_grad()
    def exchange(self) -> None:
        """Replace each parameter's local gradient by the replicas' mean of the selected
        entries (the rest stays in this rank's residual)."""
        if self.model is None or self.mesh is None:
            raise RuntimeError("ReplicaCompression has no model or mesh: call attach(model, "
                               "mesh=mesh)")
        named = list(self.model.named_parameters())
        device = named[0][1].device if named else torch.device("cpu")
        # a parameter with a gradient on one replica takes part everywhere (zero elsewhere)
        used = comm.any_rank([p.grad is not None for _, p in named], self.process_group, device)
        named = [(n, p) for (n, p), u in zip(named, used) if u]
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pieces = [local_piece(p.grad) for _, p in named]
        world = comm.world_of(self.process_group)
        grads = local_gradients(pieces, [local_piece(p) for _, p in named], self.options, world,
                                norms=replicas.whole_norms(self.mesh))
        states = self.residuals_of([(n, local_piece(p.detach())) for n, p in named])
        updates = dgc_updates(grads, states, self.options, self.step, world,
                              self.process_group, self.value_dtype, self._generator, self._tel,
                              [p.numel() for _, p in named])
        for piece, upd in zip(pieces, updates):
            piece.copy_(upd.view_as(piece))
        self.finish_step()
