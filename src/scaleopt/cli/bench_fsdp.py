"""LAMB and LANS on FSDP2 shards: step time as paired ratios to torch.optim.AdamW(fused=True).

    scaleopt bench --world 2                             # 2 processes x 1 thread, 28.8M set
    python benchmarks/bench_fsdp.py --world 2 --threads 1 --rounds 15 [--size base]

Every rank holds 1/world of the BERT-like parameter set of ``scaleopt bench`` (``fully_shard``,
gloo on 127.0.0.1) with gradients on its shards. Each optimizer steps in turn, round after round;
a step's time is the slowest rank's (the ranks start together after a barrier). The baseline is
``torch.optim.AdamW(fused=True)`` on the same local shards (plain tensors: no collective at all);
the table gives the median step time and the median over rounds of the paired ratio, and, per
step, the collectives and the time spent in them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import scaleopt
from scaleopt.cli import options
from scaleopt.cli.launch import free_port
from scaleopt.cli.world import TIMEOUT, end_group
from scaleopt.benchmarking import NO_DECAY, SIZES, bert_shapes, interleaved, muon, paired_ratio


def sharded_params(shapes, world):
    """The parameter set as one FSDP2 module: DTensors sharded on dim 0, with gradients."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    module = nn.Module()
    g = torch.Generator().manual_seed(0)
    names = []
    for name, shape in shapes:
        key = name.replace(".", "_")
        module.register_parameter(key, nn.Parameter(torch.randn(shape, generator=g) * 0.02))
        names.append(key)
    fully_shard(module)
    named = [(n, getattr(module, n)) for n in names]
    for _, p in named:
        local = torch.randn(p.to_local().shape, generator=g) * 1e-3
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride())
    return named


def candidates(kind: str = "layerwise"):
    """The timed optimizers: LAMB, LANS and AdamW (``layerwise``), or Muon's rows (``muon``);
    each with the fused AdamW baseline on the local shards."""
    def local_fused_adamw(named):
        ps = []
        for _, p in named:
            q = nn.Parameter(p.to_local().detach().clone())
            q.grad = p.grad.to_local().clone()
            ps.append(q)
        return torch.optim.AdamW(ps, lr=1e-3, fused=True)

    if kind == "muon":
        return {"torch.AdamW(fused=True), local shards": local_fused_adamw,
                "scaleopt.Muon": muon,
                "scaleopt.Muon(state_dtype=int8)": lambda n: muon(n, state_dtype="int8")}
    return {
        "torch.AdamW(fused=True), local shards": local_fused_adamw,
        "scaleopt.AdamW": lambda n: scaleopt.AdamW(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB": lambda n: scaleopt.LAMB(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LANS": lambda n: scaleopt.LANS(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB(max_grad_norm=1.0)": lambda n: scaleopt.LAMB(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, max_grad_norm=1.0),
    }


class CollectiveClock:
    """Counts the collectives scaleopt issues (the norms' all-reduces, Muon's all-to-alls) and
    the time spent in them."""

    NAMES = ("all_reduce", "all_to_all_single")

    def __init__(self):
        self.real = {name: getattr(dist, name) for name in self.NAMES}
        self.count, self.seconds = 0, 0.0

    def _timed(self, real):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = real(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.count += 1
            return out
        return timed

    def __enter__(self):
        self.count, self.seconds = 0, 0.0
        for name, real in self.real.items():
            setattr(dist, name, self._timed(real))
        return self

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(dist, name, real)


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _slowest_rank(step):
    """(the slowest rank's seconds of one step, the ranks' started together; (its collectives'
    count, the slowest rank's seconds in them))."""
    dist.barrier()
    with CollectiveClock() as clock:
        t0 = time.perf_counter()
        step()
        elapsed = time.perf_counter() - t0
    return slowest(elapsed), (clock.count, slowest(clock.seconds))


def worker(rank, world, port, shapes, threads, rounds, queue, kind="layerwise"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    opts = {name: make(sharded_params(shapes, world))
            for name, make in candidates(kind).items()}
    measured = interleaved({name: opt.step for name, opt in opts.items()}, rounds, warmup=1,
                           timer=_slowest_rank)  # (the first round makes the state)
    times = {name: [seconds for seconds, _ in m] for name, m in measured.items()}
    comms = {name: m[-1][1] for name, m in measured.items()}
    if rank == 0:
        queue.put((times, comms))
    dist.barrier()
    del opts  # what holds the group goes first
    end_group()


def run(shapes, world: int, threads: int, rounds: int, label: str,
        kind: str = "layerwise") -> dict:
    """Time the candidates (of ``kind``, see :func:`candidates`) on ``world`` processes; print
    the table; return the results."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, shapes, threads, rounds, queue, kind))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        times, comms = queue.get(timeout=1800)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    base = times["torch.AdamW(fused=True), local shards"]
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    print(f"BERT-like {label} set: {numel / 1e6:.1f}M parameters in {len(shapes)} tensors, "
          f"FSDP2 over {world} processes x {threads} thread(s) (gloo), "
          f"torch {torch.__version__}, {rounds} rounds")
    print(f"{'optimizer':40s} {'median ms':>9s} {'x fused AdamW':>14s} {'collectives':>12s} "
          f"{'in them ms':>11s}")
    rows = {}
    for name, ts in times.items():
        count, seconds = comms[name]
        rows[name] = dict(median_ms=statistics.median(ts) * 1e3,
                          ratio=paired_ratio(ts, base), collectives=count,
                          collective_ms=seconds * 1e3)
        print(f"{name:40s} {rows[name]['median_ms']:9.1f} {rows[name]['ratio']:14.2f} "
              f"{count:12d} {rows[name]['collective_ms']:11.2f}")
    return dict(parameters=numel, tensors=len(shapes), world=world, threads=threads,
                rounds=rounds, torch=torch.__version__, rows=rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_world(ap, 2, "processes (default: 2)")
    options.add_threads(ap, "intra-op threads per process (default: 1)", default=1)
    options.add_rounds(ap, 10)
    options.add_size(ap, SIZES, default="small", help="the parameter set (default: small)")
    args = ap.parse_args(argv)
    run(bert_shapes(*SIZES[args.size]), args.world, args.threads, args.rounds, repr(args.size))


if __name__ == "__main__":
    main()
