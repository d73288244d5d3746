"""Worker functions for the multi-process FSDP2 tests (spawned, gloo on 127.0.0.1)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import scaleopt
from scaleopt.compat import keras, mindspore, mxnet, paddle, tf1
from steps import on_loss

def two_groups(ps):
    """HF Trainer's groups: decayed weights, and undecayed biases at another learning rate."""
    return [{"params": [p for n, p in ps if not n.endswith("bias")], "weight_decay": 0.1},
            {"params": [p for n, p in ps if n.endswith("bias")], "weight_decay": 0.0,
             "lr": 5e-3}]


#: optimizer configurations by name: (make(named_params), takes names)
OPTIMIZERS = {
    "LAMB": lambda ps: scaleopt.LAMB(ps, lr=1e-2, weight_decay=0.1,
                                     exclude_from_weight_decay="bias"),
    "LAMB(bounds, always_adapt, decoupled)": lambda ps: scaleopt.LAMB(
        ps, lr=1e-2, weight_decay=0.1, lower_bound=0.5, upper_bound=3.0, always_adapt=True,
        weight_decay_mode="decoupled"),
    "LAMB(clipping)": lambda ps: scaleopt.LAMB(
        ps, lr=1e-2, max_grad_norm=0.05, clip_grad_norm_per_tensor=0.03, clip_grad_value=0.02),
    "LAMB(two groups)": lambda ps: scaleopt.LAMB(two_groups(ps), lr=1e-2),
    "LANS": lambda ps: scaleopt.LANS(ps, lr=1e-2, exclude_from_weight_decay=["bias"]),
    "LANS(two groups, clipping)": lambda ps: scaleopt.LANS(two_groups(ps), lr=1e-2,
                                                           max_grad_norm=0.05),
    "LANS(decay_moved_weight, bounds)": lambda ps: scaleopt.LANS(
        ps, lr=1e-2, weight_decay=0.1, decay_moved_weight=True, lower_bound=0.5,
        upper_bound=3.0),
    "LANS(foreach=False)": lambda ps: scaleopt.LANS(ps, lr=1e-2, foreach=False),
    "OffloadAdam": lambda ps: scaleopt.OffloadAdam(ps, lr=1e-2, weight_decay=0.1,
                                                   max_grad_norm=0.05),
    "offload(LAMB)": lambda ps: scaleopt.offload(scaleopt.LAMB, ps, lr=1e-2, max_grad_norm=0.05),
    "offload(LANS)": lambda ps: scaleopt.offload(scaleopt.LANS, ps, lr=1e-2),
    "LAMB(bf16, master_weights)": lambda ps: scaleopt.LAMB(ps, lr=1e-2, master_weights=True),
    "LANS(bf16, master_weights)": lambda ps: scaleopt.LANS(ps, lr=1e-2, master_weights=True),
    "LANS(clipping)": lambda ps: scaleopt.LANS(ps, lr=1e-2, max_grad_norm=0.05,
                                               clip_grad_norm_per_tensor=0.03),
    "AdamW": lambda ps: scaleopt.AdamW(ps, lr=1e-2, exclude_from_weight_decay="bias"),
    "Momentum": lambda ps: scaleopt.Momentum(ps, lr=1e-2, momentum=0.9),
    "paddle.Lamb": lambda ps: paddle.Lamb(learning_rate=1e-2, parameters=ps,
                                          lamb_weight_decay=0.05),
    "paddle.Lamb(ClipGradByGlobalNorm)": lambda ps: paddle.Lamb(
        learning_rate=1e-2, parameters=ps, grad_clip=paddle.ClipGradByGlobalNorm(0.05)),
    "paddle.Lamb(ClipGradByNorm)": lambda ps: paddle.Lamb(
        learning_rate=1e-2, parameters=ps, grad_clip=paddle.ClipGradByNorm(0.03)),
    "mxnet.LANS": lambda ps: mxnet.LANS(ps, learning_rate=1e-2, wd=0.05),
    "keras.Lamb": lambda ps: keras.Lamb(ps, learning_rate=1e-2, weight_decay=0.01),
    "tf1.LAMBOptimizer": lambda ps: tf1.LAMBOptimizer(ps, learning_rate=1e-2),
    "mindspore.AdamOffload": lambda ps: mindspore.AdamOffload([p for _, p in ps],
                                                              learning_rate=1e-2,
                                                              weight_decay=0.01),
    # state in bfloat16 and 8 bits: a (63, 300) weight (rows of two blocks, 256 and 44)
    "LAMB(int8 state)": lambda ps: scaleopt.LAMB(ps, lr=1e-2, weight_decay=0.1,
                                                 exclude_from_weight_decay="bias",
                                                 state_dtype="int8"),
    "LAMB(bfloat16 state)": lambda ps: scaleopt.LAMB(ps, lr=1e-2, state_dtype="bfloat16"),
    "LANS(int8 state)": lambda ps: scaleopt.LANS(ps, lr=1e-2, max_grad_norm=0.05,
                                                 state_dtype="int8"),
    "LANS(bfloat16 state)": lambda ps: scaleopt.LANS(ps, lr=1e-2, state_dtype="bfloat16"),
    "AdamW(int8 state)": lambda ps: scaleopt.AdamW(ps, lr=1e-2, state_dtype="int8"),
    "AdamW(bfloat16 state)": lambda ps: scaleopt.AdamW(ps, lr=1e-2, state_dtype="bfloat16"),
    # AdamW on the C kernel and on the Triton one (the interpreter on CPU tensors)
    "AdamW(native)": lambda ps: scaleopt.AdamW(ps, lr=1e-2, exclude_from_weight_decay="bias",
                                               implementation="native"),
    "AdamW(triton, int8 state)": lambda ps: scaleopt.AdamW(ps, lr=1e-2, state_dtype="int8",
                                                           implementation="triton"),
    "OffloadAdam(int8 state)": lambda ps: scaleopt.OffloadAdam(ps, lr=1e-2, weight_decay=0.1,
                                                               state_dtype="int8"),
    "LAMB(bf16, master_weights, int8 state)": lambda ps: scaleopt.LAMB(
        ps, lr=1e-2, master_weights=True, state_dtype="int8"),
    # AdamW's masters: joined around torch's fused step, and on the Triton kernel
    "AdamW(bf16, master_weights)": lambda ps: scaleopt.AdamW(ps, lr=1e-2, master_weights=True),
    "AdamW(bf16, master_weights, triton)": lambda ps: scaleopt.AdamW(
        ps, lr=1e-2, master_weights=True, implementation="triton"),
}


def model_of(name="", seed=0):
    """63 rows (uneven over 2 and 3 ranks) and a 2-element bias (an empty shard over 3);
    bfloat16 for a configuration named so."""
    torch.manual_seed(seed)
    inputs = 300 if "state)" in name else 8  # compact state: a weight above MIN_NUMEL
    model = nn.Sequential(nn.Linear(inputs, 63), nn.Tanh(), nn.LayerNorm(63), nn.Linear(63, 2))
    model.name, model.inputs = name, inputs
    return model.to(torch.bfloat16) if "bf16" in name else model


def batch(t, n=24, inputs=8):
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(n, inputs, generator=g), torch.randn(n, 2, generator=g)


def loss_of(model, x, y):
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)) - y.to(dtype)).float().square().mean()


def given_grads(model, t):
    """Gradients drawn for step ``t``, the same full tensors everywhere (for bfloat16 models,
    whose backward in one process and in shards round differently)."""
    g = torch.Generator().manual_seed(2000 + t)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def backward(model, t, rank=0, world=1, sharded=False):
    """Step ``t``'s gradients: from each rank's slice of the batch (float32 models), or given."""
    if "bf16" in model.name:
        for p, g in zip(model.parameters(), given_grads(model, t)):
            if sharded:
                from torch.distributed.tensor import distribute_tensor

                g = distribute_tensor(g, p.device_mesh, p.placements)
            p.grad = g
        return
    x, y = batch(t, inputs=model.inputs)
    per = x.shape[0] // world
    loss_of(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()


def assert_same_run(got, want, name, exact=(1e-5, 1e-6)):
    """Weights of a sharded run against one process's: equal to round-off (``exact``); within
    one rounding for bfloat16 weights (a master on a rounding boundary may round either way);
    for compact state, the rare moment that round-off puts on the other side of a rounding
    boundary moves its weight by up to a step (lr = 1e-2), and all others agree."""
    compact = "state)" in name
    rtol, atol = (1e-2, 1e-2) if "bf16" in name else (1e-3, 1e-2) if compact else exact
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)
        if compact and "bf16" not in name:
            assert ((a.float() - b.float()).abs() > 1e-5).float().mean() < 0.01, name


def train_reference(name, steps):
    """The optimizer in one process on the full tensors and the full batch."""
    model = model_of(name)
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    on_loss(opt, range(steps), lambda t: backward(model, t))
    return [p.detach().clone() for p in model.parameters()], (
        [opt.master(p).clone() for p in model.parameters()] if hasattr(opt, "master") else []), (
        [dict(opt.state[p]) for p in model.parameters()])


def shard(model, mesh=None):
    """FSDP2 on each layer with parameters, then the whole model (over the world, or on
    ``mesh``)."""
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_sharded(rank, world, tmp, names, steps):
    """Each optimizer of ``names`` on an FSDP2 model, each rank its slice of the batch; the full
    parameters after ``steps`` steps."""
    out = {}
    for name in names:
        model = shard(model_of(name))
        opt = OPTIMIZERS[name](list(model.named_parameters()))
        on_loss(opt, range(steps), lambda t: backward(model, t, rank, world, sharded=True))
        out[name] = [p.full_tensor().detach().clone() for p in model.parameters()]
        out[name + " masters"] = [opt.master(p).full_tensor().clone()
                                  for p in model.parameters()] if hasattr(opt, "master") else []
        out[name + " split"] = ["master_lo" in opt.state[p] for p in model.parameters()]
        out[name + " state dict"] = opt.state_dict()["state"]
        out[name + " state"] = [{k: whole(v) for k, v in opt.state[p].items()}
                                for p in model.parameters()]
    return out if rank == 0 else None


def whole(t):
    """A DTensor's full tensor (gathered as float32: gloo gathers no 8-bit tensors)."""
    if not isinstance(t, DTensor):
        return t
    return t.float().full_tensor().to(t.dtype)


def count_collectives(rank, world, tmp, name):
    """The collectives of one step (after a first one, which makes the state)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from scaleopt import _native

    ran = []
    real = _native.LayerwiseKernel.sums

    def recorded(kernel, grad_totals=None):
        ran.append((kernel.name, kernel.t.shard_sums is not None))
        return real(kernel, grad_totals)

    _native.LayerwiseKernel.sums = recorded
    model = shard(model_of(name))
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    counts = []
    for t in range(2):
        opt.zero_grad()
        loss_of(model, *batch(t, inputs=model.inputs)).backward()
        mode = CommDebugMode()
        with mode:
            opt.step()
        counts.append({str(k): v for k, v in mode.get_comm_counts().items()})
    dist.barrier()
    return (counts, sorted(set(ran))) if rank == 0 else None


def dgc_refuses_sharded(rank, world, tmp):
    """The error messages of DGCMomentum and the DDP hook state on an FSDP2 model."""
    from scaleopt.dgc import DGCHookState, DGCMomentum

    model = shard(model_of())
    messages = []
    for make in (lambda: DGCMomentum(model.parameters(), lr=0.1),
                 lambda: DGCHookState(model)):
        try:
            make()
            messages.append(None)
        except TypeError as exc:
            messages.append(str(exc))
    dist.barrier()
    return messages if rank == 0 else None


def train_hsdp(rank, world, tmp, names, steps):
    """HSDP: each optimizer on a 2x2 mesh (replicate x shard); every rank's local shards and
    its place on the mesh, and rank 0's full parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {"coordinate": mesh.get_coordinate()}
    for name in names:
        model = shard(model_of(name), mesh)
        opt = OPTIMIZERS[name](list(model.named_parameters()))
        on_loss(opt, range(steps), lambda t: backward(model, t, rank, world, sharded=True))
        out[name] = [p.to_local().detach().clone() for p in model.parameters()]
        out[name + " full"] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out


def train_given(name, shape, steps, place=lambda i, t: t):
    """``name`` on four parameters of ``shape`` and given gradients for ``steps`` steps, each
    tensor laid out by ``place(i, tensor)`` (as it is: in one process); the full parameters."""
    def drawn(seed):
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    params = [nn.Parameter(place(i, drawn(i))) for i in range(4)]
    opt = OPTIMIZERS[name]([(f"w{i}", p) for i, p in enumerate(params)])
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = place(i, drawn(100 * t + i))
        opt.step()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


def train_tensor_parallel(rank, world, tmp, name, steps):
    """Parameters split by columns (``Shard(1)``), replicated (``Replicate()``) and by rows,
    mixed with a plain tensor in one group (:func:`train_given`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    placements = [Shard(1), Replicate(), Shard(0), None]
    out = train_given(name, (7, 10), steps, lambda i, t: t if placements[i] is None
                      else distribute_tensor(t, mesh, [placements[i]]))
    return out if rank == 0 else None


def allocations_of_a_step(rank, world, tmp, name):
    """Bytes allocated by one step on the shards (after a first, which makes the state) of
    4 tensors of 512 x 1024, and the parameters' bytes per rank."""
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 512, bias=False) for _ in range(4)])
    fully_shard(model)
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3  # a DTensor laid out like the parameter
    opt.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
    dist.barrier()
    return (allocated, sum(p.to_local().numel() * 4 for p in model.parameters())) \
        if rank == 0 else None


def train_on_two_meshes(rank, world, tmp, name, steps):
    """One group with parameters on two different meshes (two mesh objects over the world, one
    sharding rows, the other columns; :func:`train_given`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    meshes = [DeviceMesh("cpu", list(range(world))), DeviceMesh("cpu", list(range(world)))]
    out = train_given(name, (9, 5), steps,
                      lambda i, t: distribute_tensor(t, meshes[i % 2], [Shard(i % 2)]))
    return out if rank == 0 else None


def host_reads_of_a_step(rank, world, tmp, name):
    """The tensor values a step on the local shards reads back to Python (the path GPU shards
    take: foreach=True), but the step counters, which live on the CPU as in torch.optim."""
    model = shard(model_of(name))
    opt = OPTIMIZERS[name](list(model.named_parameters()))
    for group in opt.param_groups:
        group["foreach"] = True
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the state is made
    steps = {id(s["step"]) for s in opt.state.values() if "step" in s}
    from test_matrix import HOST_READS

    reads = []
    originals = {name_: getattr(torch.Tensor, name_) for name_ in HOST_READS}

    def guarded(name_):
        def read(self, *args, **kwargs):
            if id(self) not in steps:
                reads.append(f"Tensor.{name_} on a {tuple(self.shape)} tensor")
            return originals[name_](self, *args, **kwargs)
        return read

    for name_ in HOST_READS:
        setattr(torch.Tensor, name_, guarded(name_))
    try:
        opt.step()
    finally:
        for name_, fn in originals.items():
            setattr(torch.Tensor, name_, fn)
    dist.barrier()
    return reads if rank == 0 else None


def train_sharded_triton(rank, world, tmp, names, steps):
    """As :func:`train_sharded`, each optimizer asked for the Triton kernels (run by Triton's
    interpreter on the CPU shards), which update compact moments in place (a float32 copy of
    one is an error); also the kernel launches and the collectives of the last step."""
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    from torch.distributed.tensor.debug import CommDebugMode

    from scaleopt import _compact, _triton

    def no_copies(*args, **kwargs):
        raise AssertionError("a float32 copy of a compact moment was made")

    _compact.working = no_copies

    out = {}
    for name in names:
        model = shard(model_of(name))
        opt = OPTIMIZERS[name](list(model.named_parameters()))
        for group in opt.param_groups:
            group["implementation"] = "triton"
        for t in range(steps):
            opt.zero_grad()
            backward(model, t, rank, world, sharded=True)
            before = dict(_triton.LAUNCHES)
            mode = CommDebugMode()
            with mode:
                opt.step()
        out[name] = [p.full_tensor().detach().clone() for p in model.parameters()]
        out[name + " masters"] = [opt.master(p).full_tensor().clone() for p in model.parameters()]
        out[name + " launches"] = {k: v - before.get(k, 0) for k, v in _triton.LAUNCHES.items()
                                   if v != before.get(k, 0)}
        out[name + " collectives"] = sum(mode.get_comm_counts().values())
    return out if rank == 0 else None


def skip_on_one_rank(rank, world, tmp, names):
    """Under ``nonfinite="skip"``, a NaN in the local shard of one rank's gradient: for each
    optimizer of ``names``, whether every rank kept its shards and counted the skip, and the
    full parameters after a good step that follows."""
    out = {}
    for name in names:
        model = shard(model_of(name))
        opt = OPTIMIZERS[name](list(model.named_parameters()))
        opt.nonfinite = "skip"
        opt.zero_grad()
        backward(model, 0, rank, world, sharded=True)
        opt.step()
        opt.zero_grad()
        backward(model, 1, rank, world, sharded=True)
        if rank == world - 1:  # the bad value on the last rank's shard only
            g = next(p for p in model.parameters() if p.grad.to_local().numel()).grad
            g.to_local().view(-1)[0] = float("nan")
        before = [p.to_local().detach().clone() for p in model.parameters()]
        opt.step()
        kept = all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
        out[name] = (kept, opt.skipped_steps)
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    return everyone if rank == 0 else None
