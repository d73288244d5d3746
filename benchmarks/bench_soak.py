"""The steady state of a long run: each optimizer for thousands of steps, in one process and on
FSDP2 shards (DTensor parameters, gloo, 2 ranks on 127.0.0.1), with the live tensors, the
resident memory and the host time per step measured after a warm-up and at the end. None may
grow: an optimizer that keeps a tensor, a cache entry or a graph per step shows it here long
before it ends a real run (torch's fused optimizers did, on DTensor parameters).

    python benchmarks/bench_soak.py                         # 2000 steps each, then FSDP2 x 2
    python benchmarks/bench_soak.py --steps 5000 --world 2 --json soak.json
    python benchmarks/bench_soak.py --only LAMB --world 1

What is held, per optimizer (the verdict column):

- live tensors (every ``torch.Tensor`` object the garbage collector tracks, after a
  collection): exactly the same number at the end as after the warm-up. Nothing per step may
  stay alive; bounded caches fill during the warm-up.
- resident memory (``/proc/self/statm``): at most 2 MiB + 2% more at the end. The allocator
  keeps freed pages and fragments: a few pages of drift is not a leak; a leak of one
  gradient-sized buffer per step is 1000x that over a run.
- host time per step (the median over a window of steps): at most 1.5x the warm-up window's.
  Timings on a shared machine vary by tens of percent between windows; an O(steps) cost (a
  list that grows, a cache that misses more and more) doubles and more.

The model is a small MLP with norms (weights, biases, norm parameters: every kind of tensor
an optimizer groups); sizes do not matter here, the number of steps does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import scaleopt
from scaleopt.cli import options

NO_DECAY = ["bias", r"\.2\.", r"\.5\."]  # biases and the two LayerNorms

#: the tolerances of the verdict (see the module's text)
RSS_SLACK_BYTES, RSS_SLACK, TIME_SLACK = 2 * 2**20, 0.02, 1.5


def optimizers(sharded: bool = False) -> Dict[str, Callable[[List], torch.optim.Optimizer]]:
    """Every optimizer of the library, in the forms a long run uses (DGC only in one process:
    on shards it runs between HSDP replicas)."""
    out = {
        "LAMB": lambda ps: scaleopt.LAMB(ps, lr=1e-3, weight_decay=0.01,
                                         exclude_from_weight_decay=NO_DECAY),
        "LAMB max_grad_norm": lambda ps: scaleopt.LAMB(ps, lr=1e-3, max_grad_norm=1.0),
        "LAMB int8 state": lambda ps: scaleopt.LAMB(ps, lr=1e-3, state_dtype="int8"),
        "LANS": lambda ps: scaleopt.LANS(ps, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "LANS bfloat16 state": lambda ps: scaleopt.LANS(ps, lr=1e-3, state_dtype="bfloat16"),
        "AdamW": lambda ps: scaleopt.AdamW(ps, lr=1e-3),
        "AdamW int8 state": lambda ps: scaleopt.AdamW(ps, lr=1e-3, state_dtype="int8"),
        "Momentum": lambda ps: scaleopt.Momentum(ps, lr=1e-2, momentum=0.9),
        "OffloadAdam": lambda ps: scaleopt.OffloadAdam(ps, lr=1e-3, weight_decay=0.01),
        "offload(LAMB)": lambda ps: scaleopt.offload(scaleopt.LAMB, ps, lr=1e-3),
        "torch.optim.AdamW (baseline)": lambda ps: torch.optim.AdamW([p for _, p in ps],
                                                                     lr=1e-3),
    }
    if not sharded:
        out["DGCMomentum"] = lambda ps: scaleopt.DGCMomentum(ps, lr=1e-2, sparsity=[0.99],
                                                             min_numel=256)
    return out


def model_of(seed: int = 0, width: int = 128) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.LayerNorm(width),
                         nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width),
                         nn.Linear(width, 4))


def mlp_backward(model: nn.Module, rank: int = 0, world: int = 1) -> Callable[[int], None]:
    """Step ``t``'s gradients of ``model``: this rank's slice of a batch drawn for ``t``."""
    def backward(t: int) -> None:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)
        per = 64 // world
        piece = slice(rank * per, (rank + 1) * per)
        (model(x[piece]) - y[piece]).square().mean().backward()
    return backward


def live_tensors() -> int:
    """The ``torch.Tensor`` objects alive in this process (after a collection)."""
    gc.collect()  # (by type: isinstance would ask some objects for a deprecated __class__)
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; elsewhere its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


#: the consecutive steps after which the live tensors are counted (the fewest is taken)
COUNTS = 3


def soak(make: Callable[[List], torch.optim.Optimizer], model: nn.Module,
         backward: Callable[[int], None], steps: int, warm: int,
         window: Optional[int] = None) -> Dict[str, Any]:
    """``steps`` steps of ``make(model.named_parameters())``: the live tensors and resident
    bytes after ``warm`` steps and at the end, and the median host time of a step (``step()``
    alone, in ms) over the ``window`` steps after the warm-up and the last ``window``. The live
    tensors are the fewest counted after each of ``COUNTS`` consecutive steps: a tensor that a
    collective in flight holds for a moment is not held per step (a tensor held per step
    shows in every count)."""
    window = window or max(1, min(200, (steps - warm) // 4))
    opt = make(list(model.named_parameters()))
    times: List[float] = []
    start: Dict[str, int] = {}
    counts: List[int] = []
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        backward(t)
        began = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - began)
        if warm <= t + 1 < warm + COUNTS or t + 1 > steps - COUNTS:
            counts.append(live_tensors())
        if t + 1 == warm:
            start = {"rss": resident_bytes()}
        if t + 1 == warm + COUNTS - 1:
            start["tensors"], counts = min(counts), []
    end = {"tensors": min(counts), "rss": resident_bytes()}
    return {"steps": steps, "warm": warm, "window": window,
            "tensors_start": start["tensors"], "tensors_end": end["tensors"],
            "rss_start": start["rss"], "rss_end": end["rss"],
            "ms_start": 1e3 * statistics.median(times[warm:warm + window]),
            "ms_end": 1e3 * statistics.median(times[-window:])}


def holds(row: Dict[str, Any]) -> List[str]:
    """What grew in a row of :func:`soak` beyond the tolerances (empty: the steady state held)."""
    grew = []
    if row["tensors_end"] != row["tensors_start"]:
        grew.append(f"tensors {row['tensors_start']} -> {row['tensors_end']}")
    if row["rss_end"] > row["rss_start"] * (1 + RSS_SLACK) + RSS_SLACK_BYTES:
        grew.append(f"RSS +{(row['rss_end'] - row['rss_start']) / 2**20:.1f} MiB")
    if row["ms_end"] > TIME_SLACK * row["ms_start"]:
        grew.append(f"time x{row['ms_end'] / row['ms_start']:.2f}")
    return grew


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m)
    return fully_shard(model)


def _sharded_worker(rank: int, world: int, port: int, names: List[str], steps: int, warm: int,
                    out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = {}
        makes = optimizers(sharded=True)
        for name in names:
            model = shard(model_of())
            rows[name] = soak(makes[name], model, mlp_backward(model, rank, world), steps, warm)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(rows, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_sharded(names: List[str], steps: int, warm: int, world: int,
                timeout: float) -> Dict[str, Dict[str, Any]]:
    """:func:`soak` of each optimizer on FSDP2 shards over ``world`` processes; per optimizer,
    rank 0's row with the largest growth of tensors and memory over the ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_sharded_worker, args=(r, world, port, names, steps, warm,
                                                           out)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a sharded soak worker failed or ran past {timeout:.0f} s "
                               f"(exit codes {[p.exitcode for p in procs]})")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    rows = {}
    for name in names:
        row = dict(ranks[0][name])
        worst = max(ranks, key=lambda r: abs(r[name]["tensors_end"] - r[name]["tensors_start"]))
        row["tensors_start"], row["tensors_end"] = (worst[name]["tensors_start"],
                                                    worst[name]["tensors_end"])
        rows[name] = row
    return rows


def _print(title: str, rows: Dict[str, Dict[str, Any]]) -> None:
    print(title)
    print(f"{'optimizer':30s} {'tensors':>15s} {'RSS MiB':>15s} {'ms/step':>13s}  verdict")
    for name, r in rows.items():
        grew = holds(r)
        print(f"{name:30s} {r['tensors_start']:>7d}->{r['tensors_end']:<7d} "
              f"{r['rss_start'] / 2**20:>7.1f}->{r['rss_end'] / 2**20:<7.1f} "
              f"{r['ms_start']:>6.3f}->{r['ms_end']:<6.3f}  "
              f"{'steady' if not grew else 'GREW: ' + ', '.join(grew)}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=200, help="steps before the first measurement")
    options.add_world(ap, 2, "ranks of the FSDP2 soak (1: only the one-process soak) (default: 2)")
    options.add_threads(ap, "intra-op threads (default: 1)", default=1)
    ap.add_argument("--only", action="append", default=[],
                    help="the optimizers whose name contains this (repeatable)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds the sharded soak may take before its workers are killed")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--strict", action="store_true",
                    help="exit with status 1 when anything grew beyond its tolerance")
    args = ap.parse_args(argv)
    if args.warm >= args.steps:
        ap.error("--warm must be below --steps")
    torch.set_num_threads(args.threads)

    def chosen(sharded):
        return [n for n in optimizers(sharded) if not args.only or any(o in n for o in args.only)]

    print(f"soak: {args.steps} steps each ({args.warm} to warm up); torch {torch.__version__}, "
          f"scaleopt {scaleopt.__version__}, {args.threads} thread(s), "
          f"{sum(p.numel() for p in model_of().parameters()):,} parameters")
    report: Dict[str, Any] = {"steps": args.steps, "warm": args.warm, "threads": args.threads,
                              "torch": torch.__version__, "one_process": {}, "sharded": {}}
    for name in chosen(False):
        model = model_of()
        report["one_process"][name] = soak(optimizers()[name], model, mlp_backward(model),
                                           args.steps, args.warm)
    _print("one process", report["one_process"])
    if args.world > 1 and chosen(True):
        report["sharded"] = run_sharded(chosen(True), args.steps, args.warm, args.world,
                                        args.timeout)
        _print(f"FSDP2, {args.world} ranks (tensors: the rank with the largest change)",
               report["sharded"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    rows = list(report["one_process"].values()) + list(report["sharded"].values())
    grew = sum(1 for r in rows if holds(r))
    print(f"{len(rows) - grew} of {len(rows)} steady" + (
        "" if not grew else f"; {grew} grew (with --strict the exit status is 1)"))
    return 1 if grew and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
