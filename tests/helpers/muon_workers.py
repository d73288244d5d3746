"""Worker functions for Muon's sharded tests (FSDP2 on gloo, spawned on 127.0.0.1)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import scaleopt

EXCLUDED = dict(exclude_from_muon=r"embed|head", exclude_from_weight_decay=r"bias|norm")

#: configurations by name: make(named_params)
OPTIMIZERS = {
    "Muon": lambda ps: scaleopt.Muon(ps, lr=0.02, adamw_lr=1e-2, **EXCLUDED),
    "Muon(match_rms_adamw, plain momentum, clipping)": lambda ps: scaleopt.Muon(
        ps, lr=1e-2, adjust_lr_fn="match_rms_adamw", nesterov=False, max_grad_norm=0.5,
        weight_decay=0.05, **EXCLUDED),
    "Muon(float32 iteration)": lambda ps: scaleopt.Muon(ps, lr=0.02, ns_dtype="float32",
                                                        **EXCLUDED),
    "Muon(int8 state)": lambda ps: scaleopt.Muon(ps, lr=0.02, state_dtype="int8", **EXCLUDED),
    "Muon(bfloat16 state)": lambda ps: scaleopt.Muon(ps, lr=0.02, state_dtype="bfloat16",
                                                     **EXCLUDED),
    "Muon(polar_express)": lambda ps: scaleopt.Muon(ps, lr=0.02, ns_coefficients="polar_express",
                                                    **EXCLUDED),
    "Muon(exchange_buckets=2)": lambda ps: scaleopt.Muon(ps, lr=0.02, exchange_buckets=2,
                                                         **EXCLUDED),
    # FSDP2's host shards (CPUOffloadPolicy's place) on the host pipeline: the same bits
    "offload(Muon, int8 state)": lambda ps: scaleopt.offload(scaleopt.Muon, ps, lr=0.02,
                                                             state_dtype="int8", **EXCLUDED),
}


class Tiny(nn.Module):
    """Every kind of parameter: an embedding and a head (AdamW by name), matrices of 63 and 96
    rows (uneven over 2 and 3 ranks; above int8 state's size), a norm and biases."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 96)
        self.up = nn.Linear(96, 63)
        self.down = nn.Linear(63, 96, bias=False)
        self.norm = nn.LayerNorm(96)
        self.head = nn.Linear(96, 40, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(self.norm(x + self.down(torch.tanh(self.up(x)))))


def model_of(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def shard(model, mesh=None):
    from torch.distributed.fsdp import fully_shard

    for m in (model.embed, model.up, model.down, model.norm, model.head):
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_grads(model, t):
    """Step ``t``'s gradients: a full tensor per parameter, the same on every rank."""
    g = torch.Generator().manual_seed(3000 + t)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def give_grads(model, t):
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, g in zip(model.parameters(), full_grads(model, t)):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(
            p, DTensor) else g


def train_reference(name, steps, first=0, model=None, opt=None):
    if model is None:
        model = model_of()
        opt = OPTIMIZERS[name](list(model.named_parameters()))
    for t in range(first, first + steps):
        give_grads(model, t)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _full(t):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    return t.float().full_tensor().to(t.dtype)  # gloo gathers no 8-bit tensors


def train_sharded(rank, world, tmp, names, steps):
    """Each configuration on an FSDP2 model for ``steps`` steps: the full parameters and
    state, and the collectives of the last step by kind."""
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    for name in names:
        model = shard(model_of())
        opt = OPTIMIZERS[name](list(model.named_parameters()))
        for t in range(steps):
            give_grads(model, t)
            mode = CommDebugMode()
            with mode:
                opt.step()
        out[name] = [p.full_tensor().detach().clone() for p in model.parameters()]
        out[name + " state"] = [{k: _full(v) for k, v in opt.state[p].items()}
                                for p in model.parameters()]
        out[name + " collectives"] = {str(k): v for k, v in mode.get_comm_counts().items()}
    return out if rank == 0 else None


def train_hsdp(rank, world, tmp, name, steps):
    """HSDP: 2 replicas of 2 shards. Per rank: the full parameters, the shapes of the matrices
    it iterated (all steps), and the collectives of the last step by kind."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from scaleopt import _orthogonal

    iterated = []
    real = _orthogonal.newton_schulz

    def counted(x, *args, **kwargs):
        iterated.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    _orthogonal.newton_schulz = counted
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard(model_of(), mesh)
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    for t in range(steps):
        give_grads(model, t)
        mode = CommDebugMode()
        with mode:
            opt.step()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]  # every rank takes part
    return dict(full=full, iterated=iterated,
                collectives={str(k): v for k, v in mode.get_comm_counts().items()})


def train_tensor_parallel(rank, world, tmp, name, steps, placements):
    """The matrices as tensor parallelism places them on a mesh of ``world`` ranks (``"tp"``:
    1-D, ``up`` column-wise ``Shard(0)``, ``down`` row-wise ``Shard(1)``; ``"hsdp-tp"``: 2 x 2,
    ``(Replicate(), Shard(1))`` for both; ``"fsdp-tp"``: 2 x 2, ``(Shard(0), Shard(1))``), the
    other parameters plain tensors. Per rank: the full matrices after ``steps`` steps and the
    collectives of the last step, or the error the step raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,) if placements == "tp" else (2, world // 2))
    layout = {"tp": {"up": [Shard(0)], "down": [Shard(1)]},
              "hsdp-tp": {"up": [Replicate(), Shard(1)], "down": [Replicate(), Shard(1)]},
              "fsdp-tp": {"up": [Shard(0), Shard(1)], "down": [Shard(0), Shard(1)]}}[placements]
    model = model_of()
    for key, where in layout.items():
        layer = getattr(model, key)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, where))
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    try:
        for t in range(steps):
            give_grads(model, t)
            mode = CommDebugMode()
            with mode:
                opt.step()
    except NotImplementedError as e:
        return dict(error=str(e))
    full = [model.up.weight.full_tensor().detach().clone(),
            model.down.weight.full_tensor().detach().clone()]
    return dict(full=full, collectives={str(k): v for k, v in mode.get_comm_counts().items()})


def _checkpoint(model, opt):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}


def save_after(rank, world, tmp, name, steps):
    """``steps`` steps, then a DCP checkpoint of model and optimizer under ``tmp``."""
    model = shard(model_of())
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    train_reference(name, steps, model=model, opt=opt)
    dcp.save(_checkpoint(model, opt), checkpoint_id=os.path.join(tmp, "ckpt"))
    dist.barrier()


def resume(rank, world, tmp, name, first, steps, path):
    """The checkpoint of :func:`save_after` (saved at any world size) loaded, and ``steps``
    more steps; the full parameters."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model = shard(model_of(seed=1))  # other weights: the checkpoint must bring them
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    state = _checkpoint(model, opt)
    dcp.load(state, checkpoint_id=os.path.join(path, "ckpt"))
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    train_reference(name, steps, first, model=model, opt=opt)
    full = [p.full_tensor().detach().clone() for p in model.parameters()]  # every rank takes part
    return full if rank == 0 else None


def skip_on_one_rank(rank, world, tmp):
    """A NaN in the last rank's rows of one matrix, under nonfinite="skip": every rank skips
    the step (none enters the exchange alone); the full weights before and after, and each
    rank's count of skipped steps."""
    model = shard(model_of())
    opt = scaleopt.Muon(list(model.named_parameters()), lr=0.02, nonfinite="skip", **EXCLUDED)
    train_reference("Muon", 1, model=model, opt=opt)
    before = [p.full_tensor().detach().clone() for p in model.parameters()]
    give_grads(model, 1)
    if rank == world - 1:
        model.up.weight.grad.to_local()[0, 0] = float("nan")
    opt.step()
    after = [p.full_tensor().detach().clone() for p in model.parameters()]
    counts = [None] * world
    dist.all_gather_object(counts, opt.skipped_steps)
    return (before, after, counts) if rank == 0 else None


def stack_split(rank, world, tmp):
    """A stack of 8 matrices whose matrices are cut over the ranks (``Shard(1)``: their rows),
    read as a stack or flattened: the error each construction raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    experts = nn.Parameter(distribute_tensor(torch.randn(8, 16, 24), mesh, [Shard(1)]))
    errors = []
    for reading in ("stack", "flatten"):
        try:
            scaleopt.Muon([("experts", experts)], lr=0.02, nd_params=reading)
        except ValueError as e:
            errors.append(str(e))
    kept = scaleopt.Muon([("experts", experts)], lr=0.02)  # the default: AdamW's
    return dict(errors=errors, algorithms=[g["algorithm"] for g in kept.param_groups])


def stack_over_experts(rank, world, tmp, state_dtype, steps=3):
    """A [8, 32, 48] stack cut over the ranks by its experts (``Shard(0)``, as expert
    parallelism and FSDP2 place it), read as a stack: per rank, the full stack after ``steps``
    steps, one process's stack after the same steps, and the last step's collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(8, 32, 48, generator=torch.Generator().manual_seed(0))
    here = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    alone = nn.Parameter(full.clone())
    opts = [scaleopt.Muon([p], lr=0.02, nd_params="stack", state_dtype=state_dtype)
            for p in (here, alone)]
    for t in range(steps):
        g = torch.randn(8, 32, 48, generator=torch.Generator().manual_seed(100 + t))
        here.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        alone.grad = g.clone()
        mode = CommDebugMode()
        with mode:
            opts[0].step()
        opts[1].step()
    stored = opts[0].state[here]["momentum_buffer"]
    return dict(full=here.full_tensor().detach().clone(), alone=alone.detach().clone(),
                stored=getattr(stored, "_local_tensor", stored).dtype,
                collectives={str(k): v for k, v in mode.get_comm_counts().items()})
