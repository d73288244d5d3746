"""Worker functions for the steps in backward on FSDP2 (gloo, spawned on 127.0.0.1): every rank
trains on the same micro-batches, so the reduce-scattered gradient is one process's gradient
(the sum of two equal gradients, halved: exact) and the weights can be compared with one
process's bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import scaleopt
from scaleopt.benchmarking import collectives
from muon_workers import EXCLUDED, _full, model_of, shard

#: configurations by name: (make(named_params), step_in_backward's keywords)
OPTIMIZERS = {
    "LAMB": (lambda ps: scaleopt.LAMB(ps, lr=1e-2, weight_decay=0.1,
                                      exclude_from_weight_decay="bias"), {}),
    "LANS(clipping, exact)": (lambda ps: scaleopt.LANS(ps, lr=1e-2, max_grad_norm=0.05),
                              {"clip": "exact"}),
    "AdamW(one tensor a piece)": (lambda ps: scaleopt.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  {"bucket_bytes": 0}),
    "Muon": (lambda ps: scaleopt.Muon(ps, lr=0.02, adamw_lr=1e-2, **EXCLUDED), {}),
    "Muon(int8 state, one tensor a piece)": (
        lambda ps: scaleopt.Muon(ps, lr=0.02, state_dtype="int8", **EXCLUDED),
        {"bucket_bytes": 0}),
    "offload(LAMB, clipping, exact)": (
        lambda ps: scaleopt.offload(scaleopt.LAMB, ps, lr=1e-2, max_grad_norm=0.05),
        {"clip": "exact"}),
    "offload(Muon)": (lambda ps: scaleopt.offload(scaleopt.Muon, ps, lr=0.02, **EXCLUDED), {}),
    "LAMB(one tensor a piece)": (lambda ps: scaleopt.LAMB(ps, lr=1e-2), {"bucket_bytes": 0}),
    "LANS(one tensor a piece)": (lambda ps: scaleopt.LANS(ps, lr=1e-2), {"bucket_bytes": 0}),
}

MICRO = 2  # micro-batches per step


def batches(t):
    """Step ``t``'s micro-batches of tokens and targets (the same on every rank)."""
    g = torch.Generator().manual_seed(500 + t)
    return [(torch.randint(0, 40, (4, 6), generator=g), torch.randint(0, 40, (4, 6), generator=g))
            for _ in range(MICRO)]


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train_reference(name, steps):
    """One process, the ordinary step: the weights after ``steps`` steps."""
    make, _ = OPTIMIZERS[name]
    model = model_of()
    opt = make(list(model.named_parameters()))
    for t in range(steps):
        for tokens, targets in batches(t):
            loss_of(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _counts(counts):
    return {"c10d." + name: n for name, n in counts.items()}


def _mesh(shape):
    if shape is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def train_sharded(rank, world, tmp, names, steps, mesh_shape=None):
    """Each configuration on an FSDP2 model (HSDP with a 2-D ``mesh_shape``), twice: with its
    steps in backward, and with the ordinary step. For each: the full weights; for the steps in
    backward also the gradients left after the last step, the pieces it stepped in, and the
    collectives of the last step (forward, backward, step) beside the ordinary step's."""
    out = {}
    for name in names:
        make, keywords = OPTIMIZERS[name]
        for in_backward in (True, False):
            model = shard(model_of(), _mesh(mesh_shape))
            opt = make(list(model.named_parameters()))
            steps_ = scaleopt.step_in_backward(opt, **keywords) if in_backward else None
            for t in range(steps):
                *first, (tokens, targets) = batches(t)
                if in_backward:
                    with steps_.accumulating():
                        for x, y in first:
                            loss_of(model, x, y).backward()
                    with collectives() as mode:
                        steps_.backward(lambda: loss_of(model, tokens, targets))
                else:
                    for x, y in first:
                        loss_of(model, x, y).backward()
                    with collectives() as mode:
                        loss_of(model, tokens, targets).backward()
                        opt.step()
                    opt.zero_grad()
            key = name if in_backward else name + " ordinary"
            out[key] = [_full(p.detach()).clone() for p in model.parameters()]
            out[key + " collectives"] = _counts(mode)
            if in_backward:
                out[name + " grads left"] = sum(p.grad is not None for p in model.parameters())
                out[name + " pieces"] = steps_.pieces
    return out if rank == 0 else None


def _ddp(model, cap_mb):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb)


def rank_batches(rank, t):
    """Step ``t``'s micro-batches on ``rank`` (each rank its own, as under DDP)."""
    g = torch.Generator().manual_seed(700 + 10 * t + rank)
    return [(torch.randint(0, 40, (4, 6), generator=g), torch.randint(0, 40, (4, 6), generator=g))
            for _ in range(MICRO)]


def train_ddp(rank, world, tmp, names, steps, no_sync=False, cap_mb=0.01):
    """Each configuration under DDP (``bucket_cap_mb=cap_mb``: several buckets), twice: steps
    in backward (``ddp=``) and the ordinary step; the micro-batches before the last accumulate
    (inside ``no_sync()`` with ``no_sync``). The weights of each and the collectives of its
    last step; for the steps in backward the gradients left and the pieces."""
    import contextlib

    out = {}
    for name in names:
        make, keywords = OPTIMIZERS[name]
        for in_backward in (True, False):
            model = _ddp(model_of(), cap_mb)
            opt = make(list(model.module.named_parameters()))
            steps_ = (scaleopt.step_in_backward(opt, ddp=model, **keywords) if in_backward
                      else None)
            for t in range(steps):
                *first, (tokens, targets) = rank_batches(rank, t)
                quiet = model.no_sync() if no_sync else contextlib.nullcontext()
                with quiet, (steps_.accumulating() if in_backward else contextlib.nullcontext()):
                    for x, y in first:
                        loss_of(model, x, y).backward()
                with collectives() as mode:
                    if in_backward:
                        steps_.backward(lambda: loss_of(model, tokens, targets))
                    else:
                        loss_of(model, tokens, targets).backward()
                        opt.step()
                if not in_backward:
                    opt.zero_grad()
            key = name if in_backward else name + " ordinary"
            out[key] = [p.detach().clone() for p in model.module.parameters()]
            out[key + " collectives"] = _counts(mode)
            if in_backward:
                out[name + " grads left"] = sum(p.grad is not None
                                                for p in model.module.parameters())
                out[name + " pieces"] = steps_.pieces
    return out if rank == 0 else None


def ddp_refusals(rank, world, tmp):
    """What step_in_backward says under DDP set up wrongly: the messages, by case."""
    import warnings

    from torch import nn

    out = {}
    model = model_of()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scaleopt.step_in_backward(opt).remove()  # several ranks, no ddp=
    out["no ddp="] = [str(w.message) for w in seen]
    plain = nn.parallel.DistributedDataParallel(model_of())  # gradient_as_bucket_view=False
    cases = {"not DDP": (model, scaleopt.LAMB(model.parameters(), lr=1e-2)),
             "copies": (plain, scaleopt.LAMB(plain.parameters(), lr=1e-2)),
             "outside": (_ddp(model_of(), 25), scaleopt.LAMB(model.parameters(), lr=1e-2))}
    for case, (ddp, opt) in cases.items():
        try:
            scaleopt.step_in_backward(opt, ddp=ddp)
            out[case] = None
        except (TypeError, ValueError) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
    return out if rank == 0 else None


def _train_in_backward(model, steps_, ts):
    for t in ts:
        *first, (tokens, targets) = batches(t)
        with steps_.accumulating():
            for x, y in first:
                loss_of(model, x, y).backward()
        steps_.backward(lambda: loss_of(model, tokens, targets))


def resumed_from_dcp(rank, world, tmp, name, steps, stop):
    """``steps`` steps in backward on FSDP2 straight through, and the same run stopped after
    ``stop`` steps, saved with DCP and resumed in a new model and optimizer whose steps in
    backward were set up before the checkpoint was loaded into them: both runs' weights."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    make, keywords = OPTIMIZERS[name]

    def fresh(seed):
        model = shard(model_of(seed))
        opt = make(list(model.named_parameters()))
        return model, opt, scaleopt.step_in_backward(opt, **keywords)

    def state(model, opt):
        return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}

    model, opt, steps_ = fresh(0)
    _train_in_backward(model, steps_, range(steps))
    straight = [_full(p.detach()).clone() for p in model.parameters()]
    model, opt, steps_ = fresh(0)
    _train_in_backward(model, steps_, range(stop))
    path = os.path.join(tmp, "ckpt")
    dcp.save(state(model, opt), checkpoint_id=path)
    model, opt, steps_ = fresh(1)  # other weights: the checkpoint must bring them
    loaded = state(model, opt)  # DCP makes the new optimizer's state with a zero step first
    dcp.load(loaded, checkpoint_id=path)
    model.load_state_dict(loaded["model"])
    set_optimizer_state_dict(model, opt, loaded["optim"])
    _train_in_backward(model, steps_, range(stop, steps))
    resumed = [_full(p.detach()).clone() for p in model.parameters()]
    return {"straight": straight, "resumed": resumed} if rank == 0 else None
