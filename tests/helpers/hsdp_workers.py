"""Workers for DGC between HSDP replicas: a (replicate, shard) mesh on real gloo process groups,
the model fully_shard-ed on the shard dimension, DGCMomentum(mesh=) exchanging between the
replicas (run by dgc_workers.run_workers)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import scaleopt

#: rows that split unevenly over 2 shards (32 + 31) and a one-row matrix whose second shard is
#: empty; the large matrices go sparse at min_numel=4096, the rest dense
SIZES = [(64, 512), (512, 63), (63, 1)]


def model_of(seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(SIZES):
        layers += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(SIZES) - 1 else [])
    return nn.Sequential(*layers)


def batch(rank, t, n=8):
    g = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(n, SIZES[0][0], generator=g), torch.randn(n, SIZES[-1][1], generator=g)


def loss_of(model, rank, t):
    x, y = batch(rank, t)
    return (model(x) - y).square().mean()


def mesh_of(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))


def sharded(model, mesh):
    """fully_shard on ``mesh`` (a sub-mesh: the shard dimension; the 2-D mesh: plain HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def pieces(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def train(rank, world, tmp, shape, steps, options, resume_at=None):
    """DGC between the replicas; each step's local shards, the final full parameters and the
    last telemetry. With ``resume_at``, the run is checkpointed there (each rank its own
    optimizer state and local shards, torch.save) and continued by a new model and optimizer."""
    mesh = mesh_of(shape)
    model = sharded(model_of(), mesh["shard"])
    opt = scaleopt.DGCMomentum(model.parameters(), mesh=mesh, **options)
    history = []
    for t in range(steps):
        if t == resume_at:
            model, opt = _resumed(model, opt, mesh, options, os.path.join(tmp, f"ck{rank}.pt"))
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
        history.append(pieces(model))
    full = [p.full_tensor().detach() for p in model.parameters()]
    return {"coordinate": mesh.get_coordinate(), "history": history, "full": full,
            "telemetry": dict(opt.telemetry), "step": opt.dgc_step}


def _resumed(model, opt, mesh, options, path):
    torch.save({"model": pieces(model), "optim": opt.state_dict()}, path)
    fresh = sharded(model_of(seed=1), mesh["shard"])  # other weights: the load must replace them
    saved = torch.load(path, weights_only=True)
    with torch.no_grad():
        for p, piece in zip(fresh.parameters(), saved["model"]):
            p.to_local().copy_(piece)
    new = scaleopt.DGCMomentum(fresh.parameters(), mesh=mesh, **options)
    new.load_state_dict(saved["optim"])
    return fresh, new


def dense_three_ways(rank, world, tmp, shape, steps, lr, momentum, min_numel):
    """The full parameters after ``steps`` of DGC at density 1.0, of DGC before its warm-up
    ends, and of plain HSDP (fully_shard on the 2-D mesh) with torch's momentum SGD."""
    mesh = mesh_of(shape)
    out = {}
    for name, extra in (("density 1.0", dict(sparsity=[0.0])),
                        ("before the warm-up", dict(rampup_begin_step=100))):
        out[name] = train_on(mesh, steps, dict(lr=lr, momentum=momentum, min_numel=min_numel,
                                               **extra), rank)
    model = sharded(model_of(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
    out["plain HSDP"] = [p.full_tensor().detach() for p in model.parameters()]
    return out


def train_on(mesh, steps, options, rank):
    model = sharded(model_of(), mesh["shard"])
    opt = scaleopt.DGCMomentum(model.parameters(), mesh=mesh, **options)
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
    return [p.full_tensor().detach() for p in model.parameters()]


def refusals(rank, world, tmp, options):
    """The errors of DGCMomentum on layouts it cannot compress; then a state dict of one mesh
    loaded on another (:func:`resumed_on_another_mesh`)."""
    out = {}
    mesh = mesh_of((2, 2))
    flat = mesh_of((1, world))
    for name, make in {
        "plain HSDP": lambda: scaleopt.DGCMomentum(sharded(model_of(), mesh).parameters(),
                                                   lr=0.1, mesh=mesh),
        "one replica": lambda: scaleopt.DGCMomentum(
            sharded(model_of(), flat["shard"]).parameters(), lr=0.1, mesh=flat),
        "no mesh": lambda: scaleopt.DGCMomentum(
            sharded(model_of(), mesh["shard"]).parameters(), lr=0.1),
        "mesh and group": lambda: scaleopt.DGCMomentum(
            sharded(model_of(), mesh["shard"]).parameters(), lr=0.1, mesh=mesh,
            process_group=dist.group.WORLD),
        "plain tensors": lambda: scaleopt.DGCMomentum(model_of().parameters(), lr=0.1, mesh=mesh),
        "a 1-D mesh": lambda: scaleopt.DGCMomentum(
            sharded(model_of(), mesh["shard"]).parameters(), lr=0.1, mesh=mesh["shard"]),
    }.items():
        try:
            make()
            out[name] = None
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    out["another mesh"] = resumed_on_another_mesh(rank, world, tmp, options)
    return out


def resumed_on_another_mesh(rank, world, tmp, options):
    """A state dict saved on a (2, 2) mesh loaded on a (4, 1) one: the warning."""
    import warnings

    big = mesh_of((2, 2))
    model = sharded(model_of(), big["shard"])
    opt = scaleopt.DGCMomentum(model.parameters(), mesh=big, **options)
    opt.zero_grad()
    loss_of(model, rank, 0).backward()
    opt.step()
    saved = opt.state_dict()
    other = mesh_of((4, 1))
    model2 = sharded(model_of(), other["shard"])
    opt2 = scaleopt.DGCMomentum(model2.parameters(), mesh=other, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(saved)
    absent = all(float(opt2.state[p][k].abs().sum()) == 0 for p in model2.parameters()
                 for k in ("u", "v"))
    opt2.zero_grad()
    loss_of(model2, rank, 1).backward()
    opt2.step()  # and it trains on
    return {"warnings": [str(w.message) for w in caught], "reset": absent,
            "step": opt2.dgc_step, "finite": all(bool(torch.isfinite(p.to_local()).all())
                                                 for p in model2.parameters())}


def die_after_one_step(rank, world, tmp):
    """Rank 3 dies before its second step: its replica peer (rank 1) gets PeerFailure, not a
    hang; the others meet the death in their own collectives and end too."""
    mesh = mesh_of((2, 2))
    model = sharded(model_of(), mesh["shard"])
    opt = scaleopt.DGCMomentum(model.parameters(), mesh=mesh, lr=0.1, sparsity=[0.99],
                               min_numel=4096)
    for t in range(3):
        try:
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            if rank == 3 and t == 1:
                os._exit(0)  # this worker dies without a word
            opt.step()
        except scaleopt.dgc.comm.PeerFailure as exc:
            return {"error": str(exc), "peer_failure": True}
        except RuntimeError as exc:  # FSDP2's own collectives inside a replica
            return {"error": str(exc), "peer_failure": False}
    return {"error": None}


def _full(piece, p):
    """The whole tensor of which ``piece`` is this rank's shard (shaped and sharded as ``p``)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(piece, p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride()).full_tensor()


def replica_feeding(rank, world, tmp, shape, optimizer, sparsity, steps=4, resume_at=None):
    """ReplicaCompression feeding ``optimizer`` (a scaleopt class name) on the model sharded
    in each replica: per step the whole gradient the optimizer was given and the mean over
    every rank of their own gradients (an unsharded copy, computed apart); at the end the
    replicas' mean residual v (whole), the whole parameters and the telemetry. With
    ``resume_at``, both are saved there and continued by new objects from their state dicts."""
    mesh = mesh_of(shape)
    replicate = mesh.get_group(0)
    options = dict(sparsity=[sparsity], min_numel=4096, selection="topk")

    def made(model):
        return (scaleopt.dgc.ReplicaCompression(model, mesh, **options),
                getattr(scaleopt, optimizer)(model.parameters(), lr=1e-3))

    model = sharded(model_of(), mesh["shard"])
    compress, opt = made(model)
    given, dense = [], []
    for t in range(steps):
        if t == resume_at:
            saved = {"compress": compress.state_dict(), "opt": opt.state_dict(),
                     "model": pieces(model)}
            torch.save(saved, os.path.join(tmp, f"ck{rank}.pt"))
            model = sharded(model_of(seed=1), mesh["shard"])
            saved = torch.load(os.path.join(tmp, f"ck{rank}.pt"), weights_only=True)
            with torch.no_grad():
                for p, piece in zip(model.parameters(), saved["model"]):
                    p.to_local().copy_(piece)
            compress, opt = made(model)
            compress.load_state_dict(saved["compress"])
            opt.load_state_dict(saved["opt"])
        whole = model_of()
        with torch.no_grad():
            for q, p in zip(whole.parameters(), model.parameters()):
                q.copy_(p.full_tensor())
        own = torch.autograd.grad(loss_of(whole, rank, t), list(whole.parameters()))
        for g in own:
            dist.all_reduce(g)
            g /= world
        dense.append([g.clone() for g in own])
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        compress.exchange()
        given.append([p.grad.full_tensor().clone() for p in model.parameters()])
        opt.step()
    residual = []
    for name, p in model.named_parameters():
        v = _full(compress.residuals[name]["v"], p)
        dist.all_reduce(v, group=replicate)
        residual.append(v / mesh.size(0))
    return {"given": given, "dense": dense, "residual": residual,
            "full": [p.full_tensor().detach() for p in model.parameters()],
            "telemetry": dict(compress.telemetry)}


def plain_hsdp(rank, world, tmp, shape, optimizer, steps=4):
    """The same training on plain HSDP (fully_shard on the 2-D mesh: a dense all-reduce
    between the replicas): the whole parameters."""
    mesh = mesh_of(shape)
    model = sharded(model_of(), mesh)
    opt = getattr(scaleopt, optimizer)(model.parameters(), lr=1e-3)
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
    return {"full": [p.full_tensor().detach() for p in model.parameters()]}
