"""Worker functions for the sharded-checkpoint tests (torch.distributed.checkpoint on FSDP2)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import sharded_workers as S


def _train(model, opt, steps, rank, world, first=0):
    for t in range(first, first + steps):
        opt.zero_grad()
        S.backward(model, t, rank, world, sharded=True)
        opt.step()


def _fresh(name):
    model = S.shard(S.model_of(name))
    return model, S.OPTIMIZERS[name](list(model.named_parameters()))


def save_after(rank, world, tmp, names, steps, path):
    """Train each of ``names`` ``steps`` steps and save model and optimizer with DCP (one
    checkpoint per name under ``path``); the keys of each one's first saved state."""
    keys = {}
    for name in names:
        model, opt = _fresh(name)
        _train(model, opt, steps, rank, world)
        osd = get_optimizer_state_dict(model, opt)
        dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=_path(path, name))
        keys[name] = sorted(next(iter(osd["state"].values())))
    return keys if rank == 0 else None


def resume_from(rank, world, tmp, names, first, steps, path):
    """Load each of ``names``' DCP checkpoints (saved at any world size) and train ``steps``
    more steps; the full parameters and the full optimizer state (to compare bit for bit)."""
    out = {}
    for name in names:
        model, opt = _fresh(name)
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=_path(path, name))
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        _train(model, opt, steps, rank, world, first)
        out[name] = _result(model, opt)
    return out if rank == 0 else None


def _trained(names, steps, rank, world, result):
    """Each of ``names`` trained ``steps`` steps sharded from the start: ``result(model, opt)``
    by name, on rank 0."""
    out = {}
    for name in names:
        model, opt = _fresh(name)
        _train(model, opt, steps, rank, world)
        out[name] = result(model, opt)
    return out if rank == 0 else None


def straight(rank, world, tmp, names, steps):
    """Train each of ``names`` ``steps`` steps without a checkpoint; as :func:`resume_from`."""
    return _trained(names, steps, rank, world, _result)


def _result(model, opt):
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"params": [p.full_tensor() for p in model.parameters()], "optim": full}


def folder(name):
    """The checkpoint folder of ``name`` under a test's checkpoint path."""
    return "".join(c if c.isalnum() else "_" for c in name)


def _path(path, name):
    return f"{path}/{folder(name)}"


def _full(model, opt):
    """The full (unsharded) model and optimizer state dicts, on the CPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, opt, options=options))


def save_full_after(rank, world, tmp, names, steps):
    """Train each of ``names`` ``steps`` steps sharded; the full model and optimizer state
    dicts (``full_state_dict=True``), as rank 0 has them."""
    return _trained(names, steps, rank, world, _full)


def resume_from_full(rank, world, tmp, names, first, steps, path):
    """Load each of ``names``' full state dicts (saved by one process with ``torch.save``) into
    a sharded run and train ``steps`` more steps; as :func:`resume_from`."""
    full = torch.load(path, weights_only=True)
    options = StateDictOptions(full_state_dict=True)
    out = {}
    for name in names:
        model, opt = _fresh(name)
        msd, osd = full[name]
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
        _train(model, opt, steps, rank, world, first)
        out[name] = _result(model, opt)
    return out if rank == 0 else None
