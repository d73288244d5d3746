"""Steps in backward on FSDP2 and under DDP against the ordinary step: a whole training step
(forward, backward, step) on ``--world`` processes (gloo on 127.0.0.1), paired round by round
(see docs/memory.md).

    python benchmarks/bench_in_backward_dist.py --world 2 --threads 1 --rounds 15

The model is ``--layers`` blocks of a ``--width`` x ``--width`` linear layer and tanh, each block
its own FSDP2 module (``fully_shard``) or, under DDP, one DDP model (``gradient_as_bucket_view``,
25 MB buckets). Every row trains its own copy; each round times one step of every row in
turn, a step's time being the slowest rank's (the ranks start together after a barrier). The
table gives each row's median step time, the median over rounds of its ratio to the ordinary
step of the same optimizer and wrapper in the same round, the interquartile range of that
ratio, and the collectives of one step by kind (counted at the dispatcher).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import scaleopt
from scaleopt.benchmarking import collectives, interleaved, paired_cells
from scaleopt.cli import options
from scaleopt.cli.launch import free_port

OPTIMIZERS = {
    "LAMB": lambda ps: scaleopt.LAMB(ps, lr=1e-3),
    "LANS": lambda ps: scaleopt.LANS(ps, lr=1e-3),
    "AdamW": lambda ps: scaleopt.AdamW(ps, lr=1e-3),
}
#: the ways to step: (step_in_backward's keywords, or None for the ordinary step)
MODES = {"ordinary": None, "in backward": {}, "in backward, a module a piece": {"bucket_bytes": 0}}


def model_of(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)])


def wrapped(base: nn.Module, wrapper: str) -> nn.Module:
    model = copy.deepcopy(base)
    if wrapper == "DDP":
        return nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    from torch.distributed.fsdp import fully_shard

    for block in model:
        fully_shard(block)
    return fully_shard(model)


def counted(step):
    """The collectives ``step()`` issues, by op."""
    with collectives() as counts:
        step()
    return {name.strip("_"): n for name, n in counts.items()}


def rows(base: nn.Module, batch: torch.Tensor, wrapper: str):
    """Each row's step, and the ordinary row it is set against."""
    steps, pairs = {}, {}
    for name, make in OPTIMIZERS.items():
        for mode, keywords in MODES.items():
            if wrapper == "DDP" and mode.endswith("piece"):
                continue  # a piece is a DDP bucket
            model = wrapped(base, wrapper)
            opt = make(list(model.parameters()))
            row = f"{wrapper}, {name}, {mode}"
            if keywords is None:
                def step(model=model, opt=opt):
                    model(batch).square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            else:
                extra = {"ddp": model} if wrapper == "DDP" else {}
                steps_ = scaleopt.step_in_backward(opt, **keywords, **extra)

                def step(model=model, steps_=steps_):
                    steps_.backward(lambda: model(batch).square().mean())
            steps[row] = step
            pairs[row] = f"{wrapper}, {name}, ordinary"
    return steps, pairs


def slowest_rank(step) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    step()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        base = model_of(args.layers, args.width)
        batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
        steps, pairs, counts = {}, {}, {}
        for wrapper in ("FSDP2", "DDP"):
            s, p = rows(base, batch, wrapper)
            steps.update(s)
            pairs.update(p)
        for row, step in steps.items():
            step()  # state made, buckets rebuilt
            counts[row] = counted(step)
        times = interleaved(steps, args.rounds, warmup=1, timer=slowest_rank)
        if rank == 0:
            torch.save((times, pairs, counts), out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_world(ap, 2, "processes (default: 2)")
    options.add_threads(ap, "intra-op threads per process (default: 1)", default=1)
    options.add_rounds(ap, 15, "timed steps per row, interleaved")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_in_backward_dist.{os.getpid()}")
    mp.start_processes(worker, args=(args.world, free_port(), args, out), nprocs=args.world,
                       start_method="spawn")
    times, pairs, counts = torch.load(out, weights_only=False)
    os.remove(out)
    params = args.layers * (args.width * args.width + args.width)
    print(f"training step on {args.world} ranks, in backward against ordinary ({params:,} "
          f"parameters, {args.layers} blocks, batch {args.batch}, {args.threads} thread(s) per "
          f"rank, gloo, torch {torch.__version__}, {platform.machine()}, {args.rounds} rounds)")
    print(f"{'row':<45} {'median ms':>10} {'x ordinary':>11} {'spread':>13}  collectives")
    for row, ts in times.items():
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts[row].items()))
        print(f"{row:<45} {paired_cells(ts, times[pairs[row]], 2, 13)}  {shown}")


if __name__ == "__main__":
    main()
