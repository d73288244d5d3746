"""Worker functions for the multi-process DGC tests (spawned, gloo on 127.0.0.1)."""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn

import scaleopt
from scaleopt.dgc import DGCHookState, ddp_comm_hook


#: every worker's intra-op thread count. A one-process reference that a test compares with the
#: workers' bits runs at the same count (``as_a_worker``): a float32 matrix product's last bits
#: depend on the thread count on some CPUs and BLAS paths (MKL on AVX-512 Xeons, or under
#: MKL_CBWR=COMPATIBLE), and so do torch's parallel reductions over large tensors
THREADS = 1


def as_a_worker():
    """A context in which this process computes at the workers' thread count."""
    from scaleopt._host import threads

    return threads(THREADS)


def run_workers(fn, world: int, tmp, *args, timeout: float = 60.0):
    """Run ``fn(rank, world, tmp, *args)`` in ``world`` processes; return each rank's result
    (what it saved), or raise with the failing rank's traceback."""
    import torch.multiprocessing as mp

    from scaleopt.cli.launch import free_port

    port = free_port()
    os.makedirs(str(tmp), exist_ok=True)
    # a fork server that has imported torch and scaleopt once starts each worker in a fraction
    # of a fresh interpreter's time (nothing in it has started a thread)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "scaleopt", "dgc_workers"])
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp), args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].kill()
    errors = {r: open(e).read() for r in range(world)
              if os.path.exists(e := os.path.join(str(tmp), f"rank{r}.err"))}
    if alive:  # the others' errors (a lost peer) follow from it
        raise AssertionError(f"rank(s) {alive} still running after {timeout} s and killed; the "
                             f"others' errors: {errors}")
    died = [r for r, p in enumerate(procs) if p.exitcode and r not in errors]
    if died:  # ended by a signal (a crash) before writing an error
        raise AssertionError(f"rank(s) {died} ended with exit codes "
                             f"{[procs[r].exitcode for r in died]}; the others' errors: {errors}")
    if errors:
        r = min(errors)
        raise AssertionError(f"rank {r} failed:\n{errors[r]}")
    results = []
    for r in range(world):
        path = os.path.join(str(tmp), f"rank{r}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return results


def _entry(fn, rank, world, port, tmp, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(THREADS)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        out = fn(rank, world, tmp, *args)
        if out is not None:
            torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def model_of(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 64), nn.Linear(64, 4))


def batch(rank, t, n=16):
    g = torch.Generator().manual_seed(1000 * t + rank)
    return torch.randn(n, 64, generator=g), torch.randn(n, 4, generator=g)


OPTIONS = dict(lr=0.05, momentum=0.9, sparsity=[0.9, 0.99], rampup_begin_step=1, rampup_step=2,
               min_numel=4096, selection="topk")


def every_rank(params, world):
    """Every rank's parameters, flattened into one vector each (an all-gather)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    return everyone


def step_adding_up_u(model, opt, u_sum, m, rank, t):
    """One DGC step on ``batch(rank, t)``; adds to ``u_sum`` the u that the step adds to v
    (``m * u_prev + g``, from the gradient: for the conservation checks)."""
    x, y = batch(rank, t)
    opt.zero_grad()
    (model(x) - y).square().mean().backward()
    u_prev = [opt.state[p]["u"].clone() if "u" in opt.state[p] else torch.zeros_like(p)
              for p in model.parameters()]
    opt.step()
    for s, up, p in zip(u_sum, u_prev, model.parameters()):
        s += m * up + p.grad


def train_dgc(rank, world, tmp, steps, options):
    """Train with DGCMomentum; return the parameters of every rank after every step, the
    telemetry, the final state, and the sum over steps of the u added to v (m * u_prev + g,
    computed here from the gradient, for the conservation check)."""
    model = model_of()
    opt = scaleopt.DGCMomentum(model.parameters(), **options)
    m = options.get("momentum", 0.9)
    u_sum = [torch.zeros_like(p) for p in model.parameters()]
    history, tels = [], []
    for t in range(steps):
        step_adding_up_u(model, opt, u_sum, m, rank, t)
        tels.append(dict(opt.telemetry))
        history.append(every_rank(model.parameters(), world))
    return {"history": history, "telemetry": tels, "u_sum": u_sum,
            "v": [opt.state[p]["v"].clone() for p in model.parameters()],
            "numels": [p.numel() for p in model.parameters()]}


def train_hook(rank, world, tmp, steps, options, bucket_cap_mb):
    """The same training through DDP with the DGC hook and plain SGD."""
    model = model_of()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    opts = {k: v for k, v in options.items() if k != "lr"}
    state = DGCHookState(ddp, **opts)
    ddp.register_comm_hook(state, ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=options["lr"])
    history = []
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"history": history, "telemetry": state.telemetry}


def train_with_a_branch_only_rank_0_uses(rank, world, tmp, steps, options, explicit_zero):
    """A model with a branch that only rank 0 runs: its parameters have gradients there and
    none on the other ranks (zeros with ``explicit_zero``). Returns every rank's parameters
    after every step."""
    model = model_of()
    branch = nn.Linear(64, 4)
    params = list(model.parameters()) + list(branch.parameters())
    opt = scaleopt.DGCMomentum(params, **options)
    history = []
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        out = model(x) + (branch(x) if rank == 0 else 0)
        (out - y).square().mean().backward()
        if explicit_zero and rank != 0:
            for p in branch.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
        history.append(every_rank(params, world))
    return {"history": history}


class _WithBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.branch = model_of(), nn.Linear(64, 4)

    def forward(self, x, use_branch: bool):
        return self.body(x) + (self.branch(x) if use_branch else 0)


def train_hook_with_a_branch_only_rank_0_uses(rank, world, tmp, steps, options):
    """The branch model through DDP (find_unused_parameters) with the DGC hook and plain SGD;
    returns every rank's parameters (in the optimizer-path order) after every step."""
    torch.manual_seed(0)
    model = _WithBranch()
    model.body.load_state_dict(model_of().state_dict())
    torch.manual_seed(0)
    model_of()  # the optimizer path built its branch after model_of(): the same random state
    model.branch.load_state_dict(nn.Linear(64, 4).state_dict())
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opts = {k: v for k, v in options.items() if k != "lr"}
    state = DGCHookState(ddp, **opts)
    ddp.register_comm_hook(state, ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=options["lr"])
    params = list(model.body.parameters()) + list(model.branch.parameters())
    history = []
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        (ddp(x, rank == 0) - y).square().mean().backward()
        opt.step()
        history.append(every_rank(params, world))
    return {"history": history}


def die_after_one_step(rank, world, tmp):
    model = model_of()
    opt = scaleopt.DGCMomentum(model.parameters(), lr=0.1, sparsity=[0.99], min_numel=4096)
    for t in range(3):
        x, y = batch(rank, t)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        if rank == 1 and t == 1:
            os._exit(0)  # this worker dies without a word
        import time

        start = time.monotonic()
        try:
            opt.step()
        except scaleopt.dgc.comm.PeerFailure as exc:
            return {"error": str(exc), "after_s": time.monotonic() - start}
    return {"error": None}


def train_hook_resumed(rank, world, tmp, options, first, then, path):
    """DDP with the DGC hook and SGD with momentum: ``first`` steps, then every rank saves the
    model, the optimizer and its own hook state and a new model, optimizer and hook state load
    them and train ``then`` steps (``first == 0``: no break). Every parameter after the run."""
    def make():
        model = model_of()
        ddp = nn.parallel.DistributedDataParallel(model)
        state = DGCHookState(ddp, **{k: v for k, v in options.items() if k != "lr"})
        ddp.register_comm_hook(state, ddp_comm_hook)
        return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=options["lr"], momentum=0.5)

    def train(ddp, opt, steps, start):
        for t in range(start, start + steps):
            x, y = batch(rank, t)
            opt.zero_grad()
            (ddp(x) - y).square().mean().backward()
            opt.step()

    model, ddp, state, opt = make()
    train(ddp, opt, first, 0)
    if first:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "dgc": state.state_dict()}, os.path.join(path, f"rank{rank}.ckpt"))
        model, ddp, state, opt = make()
        saved = torch.load(os.path.join(path, f"rank{rank}.ckpt"), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["dgc"])
    train(ddp, opt, then, first)
    return [p.detach().clone() for p in model.parameters()]


def skip_on_one_rank(rank, world, tmp):
    """DGC under ``nonfinite="skip"`` with a NaN in one rank's gradient at step 2 of 4: per
    rank, the skips counted, whether that step left weights and residuals alone, and the
    parameters at the end (equal on every rank)."""
    from scaleopt.dgc import DGCMomentum

    model = model_of()
    opt = DGCMomentum(model.parameters(), nonfinite="skip", **OPTIONS)
    kept = None
    for t in range(4):
        x, y = batch(rank, t)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        if t == 2 and rank == world - 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
        opt.step()
        if t == 2:
            kept = (all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                    and all(torch.equal(st[k], opt.state[p][k])
                            for st, p in zip(state, model.parameters()) for k in st))
    flat = every_rank(model.parameters(), world)
    same = all(torch.equal(flat[0], f) for f in flat)
    return (opt.skipped_steps, kept, same, bool(torch.isfinite(flat[0]).all()))


def hook_feeding(rank, world, tmp, optimizer, sparsity, steps=4, value_dtype=None):
    """DDP with the DGC hook at momentum 0 (top-k with error feedback) feeding ``optimizer``
    (a scaleopt class name): per step the gradient the optimizer was given, the mean over the
    ranks of their own gradients (computed apart), and at the end the mean of the ranks'
    residuals v, the parameters and the telemetry."""
    model = model_of()
    ddp = nn.parallel.DistributedDataParallel(model)
    state = DGCHookState(ddp, momentum=0.0, sparsity=[sparsity], min_numel=4096,
                         selection="topk", value_dtype=value_dtype)
    ddp.register_comm_hook(state, ddp_comm_hook)
    named = list(model.named_parameters())
    opt = getattr(scaleopt, optimizer)(named, lr=1e-3)
    given, dense = [], []
    for t in range(steps):
        x, y = batch(rank, t)
        own = torch.autograd.grad((model(x) - y).square().mean(), [p for _, p in named])
        for g in own:
            dist.all_reduce(g)
            g /= world
        dense.append([g.clone() for g in own])
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        given.append([p.grad.clone() for _, p in named])
        opt.step()
    residual = []
    for name, p in named:
        v = state.residuals[name]["v"].clone() if name in state.residuals else torch.zeros_like(p)
        dist.all_reduce(v)
        residual.append(v / world)
    return {"given": given, "dense": dense, "residual": residual,
            "params": [p.detach().clone() for _, p in named], "telemetry": dict(state.telemetry)}


def dense_feeding(rank, world, tmp, optimizer, steps=4):
    """The same training through DDP's own all-reduce: the parameters."""
    model = model_of()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = getattr(scaleopt, optimizer)(list(model.named_parameters()), lr=1e-3)
    for t in range(steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()]}
