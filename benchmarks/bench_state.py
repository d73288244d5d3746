"""Compact optimizer state side by side with its peers on the CPU: scaleopt's ``state_dtype``
against torchao's and bitsandbytes' 8-bit AdamW (where they are installed), on the same
parameters: bytes of state per parameter, step time, and test accuracy of the built-in task.

    python benchmarks/bench_state.py                      # 28.8M parameters, 2 threads
    python benchmarks/bench_state.py --rounds 15 --json state.json

Step times: every candidate has its own copy of the same BERT-like parameters and gradients
(``scaleopt bench``'s 'small' set) and is timed once per round, in a fixed order; the table
gives the median step and the median over rounds of its time divided by
``torch.optim.AdamW(fused=True)``'s in the same round (pairing cancels most of a shared
machine's drift). State bytes are counted from the tensors each optimizer holds (codes,
scales, quantization maps, step counters). Accuracy: ``scaleopt train``'s run (spirals, width
256, 1,024 steps of batch 1024, cosine schedule with warm-up, lr 0.003, weight decay 0.01 on
the matrices) with the candidate in place of the command's optimizer.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from typing import Any, Callable, Dict, List

import torch

import scaleopt
from scaleopt.cli import config, optimizers, trainer
from scaleopt.benchmarking import SIZES, make_params, shapes_of, size_options
from scaleopt.cli import options

LR, WD = 3e-3, 0.01


def candidates() -> Dict[str, Callable[[Any], torch.optim.Optimizer]]:
    """name -> a function of params (or param groups) making the optimizer."""
    c: Dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "torch.AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD,
                                                                fused=True),
        "scaleopt.AdamW": lambda ps: scaleopt.AdamW(ps, lr=LR, weight_decay=WD),
    }
    for form in ("bfloat16", "int8"):
        c[f"scaleopt.AdamW(state_dtype={form})"] = (
            lambda ps, form=form: scaleopt.AdamW(ps, lr=LR, weight_decay=WD, state_dtype=form))
    c["scaleopt.LAMB(state_dtype=int8)"] = lambda ps: scaleopt.LAMB(
        ps, lr=LR, weight_decay=WD, state_dtype="int8")
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        c["torchao.AdamW8bit"] = lambda ps: AdamW8bit(ps, lr=LR, weight_decay=WD)
        c["torchao.AdamW4bit"] = lambda ps: AdamW4bit(ps, lr=LR, weight_decay=WD)
    except Exception:  # not installed, or not for this torch
        pass
    try:
        import bitsandbytes as bnb

        c["bitsandbytes.AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=LR, weight_decay=WD)
    except Exception:
        pass
    return c


def _tensors(x: Any) -> List[torch.Tensor]:
    """The plain tensors that hold ``x``'s data (a tensor subclass's inner tensors)."""
    if not torch.is_tensor(x):
        return []
    if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
        names, _ = x.__tensor_flatten__()
        return [t for name in names for t in _tensors(getattr(x, name))]
    return [x]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for v in st.values()
               for t in _tensors(v))


def step_times(names: List[str], rounds: int, shapes: Any) -> Dict[str, Dict[str, float]]:
    make = candidates()
    runs = {}
    for name in names:
        params = [p for _, p in make_params(shapes, torch.float32, "cpu")]
        runs[name] = make[name](params)
        for _ in range(3):  # state made, kernels compiled (torchao)
            runs[name].step()
    numel = sum(p.numel() for p in runs[names[0]].param_groups[0]["params"])
    times: Dict[str, List[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            start = time.perf_counter()
            runs[name].step()
            times[name].append(time.perf_counter() - start)
    base = times[names[0]]
    return {name: {"ms": 1e3 * statistics.median(ts),
                   "ratio": statistics.median(t / b for t, b in zip(ts, base)),
                   "state_bytes_per_param": state_bytes(runs[name]) / numel}
            for name, ts in times.items()}


def accuracy(name: str, steps: int) -> float:
    """Test accuracy of ``scaleopt train``'s run with the candidate as its optimizer."""
    cfg = config.Config(optimizer="adamw", steps=steps, lr=LR, weight_decay=WD, progress=False)
    t = trainer.build(cfg, 0, 1)
    t.opt = candidates()[name](scaleopt.param_groups(t.model, weight_decay=WD))
    t.sched = torch.optim.lr_scheduler.LambdaLR(t.opt, optimizers.schedule(
        cfg.schedule, cfg.total_steps(), cfg.warmup_steps()))
    trainer.loop(t, threading.Event())
    return t.history[-1]["test_accuracy"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_size(ap, SIZES, default="small", help="the parameter set (default: small)")
    size_options(ap)
    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    options.add_rounds(ap, 9)
    ap.add_argument("--steps", type=int, default=1024, help="training steps for the accuracy")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = list(candidates())
    shapes = shapes_of(args)
    times = step_times(names, args.rounds, shapes)
    numel = sum(math.prod(shape) for _, shape in shapes)
    print(f"BERT-like set: {numel / 1e6:.1f}M parameters, {args.threads} threads, "
          f"{args.rounds} rounds, torch {torch.__version__}")
    print(f"{'optimizer':40s} {'state B/param':>13s} {'step ms':>8s} {'x fused':>8s} "
          f"{'accuracy':>9s}")
    for name in names:
        times[name]["test_accuracy"] = accuracy(name, args.steps)
        r = times[name]
        print(f"{name:40s} {r['state_bytes_per_param']:13.2f} {r['ms']:8.1f} "
              f"{r['ratio']:8.2f} {r['test_accuracy']:9.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "threads": args.threads, "rounds": args.rounds,
                       "torch": torch.__version__, "results": times}, f, indent=1)


if __name__ == "__main__":
    main()
