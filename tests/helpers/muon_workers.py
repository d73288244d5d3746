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


def lamb_fsdp_tp(rank, world, tmp, steps=3):
    """LAMB on FSDP2 over torch's tensor parallelism (2 x 2: ``up`` row-wise, ``down``
    column-wise, whose rows FSDP2 cuts into interleaved blocks): the full matrices after
    ``steps`` steps, whose trust ratios need each matrix's whole norms."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = model_of()
    parallelize_module(model, mesh["tp"], {"up": RowwiseParallel(), "down": ColwiseParallel()})
    for m in (model.up, model.down):
        fully_shard(m, mesh=mesh["dp"])
    opt = scaleopt.LAMB([model.up.weight, model.down.weight], lr=0.01)
    for t in range(steps):
        give_grads(model, t)
        opt.step()
    return [model.up.weight.full_tensor().detach().clone(),
            model.down.weight.full_tensor().detach().clone()]


def measured_balance(rank, world, tmp, steps=4):
    """HSDP (2 replicas x 2 shards) with ``exchange_balance="measured"``: per rank, the full
    parameters after ``steps`` steps, each step's collectives, and the paces it holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard(model_of(), mesh)
    opt = scaleopt.Muon(list(model.named_parameters()), lr=0.02, adamw_lr=1e-2,
                        exchange_balance="measured", **EXCLUDED)
    counts = []
    for t in range(steps):
        give_grads(model, t)
        mode = CommDebugMode()
        with mode:
            opt.step()
        counts.append({str(k): v for k, v in mode.get_comm_counts().items()})
    paces = [timing["paces"] for timing in opt._paces.values()]
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return dict(full=full, collectives=counts, paces=paces)


def _counting_iterations():
    """The shapes of the matrices this process iterates, whichever path (the exchange's or a
    whole matrix's) iterates them."""
    from scaleopt import _orthogonal, muon

    iterated = []
    real = _orthogonal.newton_schulz_

    def counted(y, *args, **kwargs):
        iterated.append(tuple(y.shape))
        return real(y, *args, **kwargs)

    _orthogonal.newton_schulz_ = muon.newton_schulz_ = counted
    return iterated


def _layouts(world):
    """The placements of ``up`` and ``down`` by name, with the mesh's shape."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "tp": ((world,), [Shard(0)], [Shard(1)]),
        "hsdp-tp": ((2, 2), [Replicate(), Shard(1)], [Replicate(), Shard(1)]),
        "fsdp-tp": ((2, 2), [Shard(0), Shard(1)], [Shard(0), Shard(1)]),
        # FSDP2's rows of tensor parallelism's column-wise blocks: interleaved row blocks
        "fsdp-tp-strided": ((2, 2), [Shard(0), Shard(1)],
                            [_StridedShard(0, split_factor=2), Shard(0)]),
        "hsdp-fsdp-tp": ((2, 2, 2), [Replicate(), Shard(0), Shard(1)],
                         [Replicate(), _StridedShard(0, split_factor=2), Shard(0)]),
    }


def train_tensor_parallel(rank, world, tmp, name, steps, placements):
    """The matrices placed as :func:`_layouts` names them (``"fsdp2-tp"``: by torch's own
    tensor parallelism, row-wise ``up`` and column-wise ``down`` on the mesh's ``tp``
    dimension, and FSDP2 over its ``dp`` one), the other parameters plain tensors. Per rank:
    the full matrices after ``steps`` steps, the matrices' placements, the shapes it iterated
    (all steps) and the collectives of the last step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    iterated = _counting_iterations()
    model = model_of()
    if placements == "fsdp2-tp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # (column-wise the 96-row matrix: DTensor cuts interleaved blocks only evenly)
        parallelize_module(model, mesh["tp"], {"up": RowwiseParallel(),
                                               "down": ColwiseParallel()})
        for m in (model.up, model.down):
            fully_shard(m, mesh=mesh["dp"])
    else:
        shape, up, down = _layouts(world)[placements]
        mesh = init_device_mesh("cpu", shape)
        for key, where in (("up", up), ("down", down)):
            layer = getattr(model, key)
            layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, where))
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    for t in range(steps):
        give_grads(model, t)
        mode = CommDebugMode()
        with mode:
            opt.step()
    full = [model.up.weight.full_tensor().detach().clone(),
            model.down.weight.full_tensor().detach().clone()]
    return dict(full=full, iterated=iterated,
                placements=[str(p.placements) for p in (model.up.weight, model.down.weight)],
                collectives={str(k): v for k, v in mode.get_comm_counts().items()})


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


def refused_partial(rank, world, tmp):
    """A matrix placed as partial sums (``Partial()``): the error Muon's construction raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    partial = nn.Parameter(DTensor.from_local(torch.randn(16, 24), mesh, [Partial()]))
    try:
        scaleopt.Muon([("w", partial)], lr=0.02)
    except ValueError as e:
        return str(e)
    return None


def _stack_layouts():
    """Placements of a stack by name: the mesh's shape and the placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "ep": ((2,), [Shard(0)]),  # expert parallelism (or FSDP2) alone: whole experts
        "rows": ((2,), [Shard(1)]),  # each expert's rows cut
        "ep-fsdp": ((2, 2), [Shard(0), Shard(1)]),  # experts over EP, their rows over FSDP
        "ep-fsdp-experts": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
        "hsdp-ep": ((2, 2), [Replicate(), Shard(0)]),  # whole experts, two copies
        "fsdp-tp": ((2, 2), [Shard(1), Shard(2)]),  # each expert cut both ways
        "hsdp-ep-fsdp": ((2, 2, 2), [Replicate(), Shard(0), Shard(2)]),
    }


def stack_placed(rank, world, tmp, state_dtype, where="ep", shape=(8, 32, 48),
                 reading="stack", steps=3):
    """A stack of ``shape`` placed as :func:`_stack_layouts` names it, read as ``reading``:
    per rank, the full stack after ``steps`` steps, one process's stack after the same steps,
    the shapes this rank iterated, the last step's collectives and the momentum's dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh_shape, placements = _stack_layouts()[where]
    placements = [pl for pl in placements]
    if len(shape) > 3:  # the same cuts, one leading dimension further on
        from torch.distributed.tensor import Shard

        placements = [Shard(pl.dim + 1) if pl.is_shard() and type(pl) is Shard else pl
                      for pl in placements]
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    here = nn.Parameter(distribute_tensor(full.clone(), mesh, placements))
    alone = nn.Parameter(full.clone())
    opts = [scaleopt.Muon([p], lr=0.02, nd_params=reading, state_dtype=state_dtype)
            for p in (here, alone)]
    iterated = _counting_iterations()
    for t in range(steps):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(100 + t))
        here.grad = distribute_tensor(g.clone(), mesh, placements)
        alone.grad = g.clone()
        mode = CommDebugMode()
        with mode:
            opts[0].step()
        counted = len(iterated)
        opts[1].step()
        del iterated[counted:]  # one process's, not this rank's
    stored = opts[0].state[here]["momentum_buffer"]
    return dict(full=_full(here.detach()).clone(), alone=alone.detach().clone(),
                stored=getattr(stored, "_local_tensor", stored).dtype, iterated=iterated,
                collectives={str(k): v for k, v in mode.get_comm_counts().items()})


def stack_checkpointed(rank, world, tmp, state_dtype, where, first, steps, load=None):
    """A [8, 32, 48] stack of experts placed as :func:`_stack_layouts` names ``where`` (on a
    1-D mesh of ``world`` ranks), its DCP checkpoint loaded from ``load`` if given, stepped
    from step ``first`` for ``steps`` steps and saved under ``tmp``: the full stack."""
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    _, placements = _stack_layouts()[where]
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Module()
    full = torch.randn(8, 32, 48, generator=torch.Generator().manual_seed(1 if load else 0))
    model.experts = nn.Parameter(distribute_tensor(full, mesh, placements))
    opt = scaleopt.Muon(list(model.named_parameters()), lr=0.02, state_dtype=state_dtype)
    if load is not None:  # other weights: the checkpoint must bring them
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=os.path.join(load, "ckpt"))
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    for t in range(first, first + steps):
        g = torch.randn(8, 32, 48, generator=torch.Generator().manual_seed(100 + t))
        model.experts.grad = distribute_tensor(g, mesh, placements)
        opt.step()
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(tmp, "ckpt"))
    return _full(model.experts.detach()).clone()


def stack_alone(state_dtype, steps):
    """The [8, 32, 48] stack of :func:`stack_checkpointed` after ``steps`` steps in one
    process."""
    experts = nn.Parameter(torch.randn(8, 32, 48, generator=torch.Generator().manual_seed(0)))
    opt = scaleopt.Muon([experts], lr=0.02, state_dtype=state_dtype)
    for t in range(steps):
        experts.grad = torch.randn(8, 32, 48, generator=torch.Generator().manual_seed(100 + t))
        opt.step()
    return experts.detach().clone()
