"""A whole training step (forward, backward, step) with the steps inside backward against the
ordinary one, paired round by round in one process (see docs/memory.md).

    python benchmarks/bench_in_backward.py                   # 24 matrices of 1024 x 1024
    python benchmarks/bench_in_backward.py --model llama --rounds 10

Each optimizer runs on its own copy of the same model; each round times one step of every
row in turn, and the table gives each row's median step time and the median over rounds of
its ratio to the ordinary step of the same optimizer in the same round (``x ordinary``). The
exact clipping row (two passes) is set against the ordinary clipped step.
"""

from __future__ import annotations

import argparse
import copy
import platform

import torch

import scaleopt
from scaleopt.benchmarking import interleaved, paired_cells
from scaleopt.cli import options
from scaleopt.cli.bench_memory import MODELS, build_model

OPTIMIZERS = {
    "LAMB": lambda n, **kw: scaleopt.LAMB(n, lr=1e-3, **kw),
    "LANS": lambda n, **kw: scaleopt.LANS(n, lr=1e-3, **kw),
    "AdamW": lambda n, **kw: scaleopt.AdamW(n, lr=1e-3, **kw),
    "Muon": lambda n, **kw: scaleopt.Muon(n, lr=0.02, **kw),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="matrices")
    options.add_rounds(ap, 10, "timed steps per row, interleaved")
    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--only", nargs="*", help="optimizers by name (default: all)")
    ap.add_argument("--buckets", nargs="*", type=int, default=[],
                    help="more rows in backward, one per bucket_bytes given (0: a tensor a "
                         "piece), beside the default 4 MiB")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    base = build_model(args.model, False, dtype)
    batch = base.batch(dtype)
    params = sum(p.numel() for p in base.parameters())
    steps, pairs = {}, {}
    extra = {"master_weights": True} if dtype == torch.bfloat16 else {}
    for name, make in OPTIMIZERS.items():
        if args.only and name not in args.only:
            continue
        modes = {"ordinary": None, "in backward": 4 << 20}
        modes.update({f"in backward, bucket {b}": b for b in args.buckets})
        modes.update({"ordinary, clipped": None, "in backward, exact clip": 4 << 20})
        for mode, bucket in modes.items():
            model = copy.deepcopy(base)
            clip = {"max_grad_norm": 1.0} if "clip" in mode else {}
            opt = make(list(model.named_parameters()), **clip, **extra)
            row = f"{name}, {mode}"
            if bucket is not None:
                stepper = scaleopt.step_in_backward(opt, clip="exact" if clip else None,
                                                    bucket_bytes=bucket)

                def step(model=model, stepper=stepper):
                    stepper.backward(lambda: model(batch))
            else:
                def step(model=model, opt=opt):
                    model(batch).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            steps[row] = step
            pairs[row] = f"{name}, ordinary" + (", clipped" if clip else "")
    times = interleaved(steps, args.rounds, warmup=2)
    print(f"training step, in backward against ordinary ({params:,} parameters, model "
          f"{args.model}, {args.dtype}, {args.threads} threads, torch {torch.__version__}, "
          f"{platform.machine()}, {args.rounds} rounds)")
    print(f"{'row':<40} {'median ms':>10} {'x ordinary':>11} {'spread':>15}")
    for row, ts in times.items():
        print(f"{row:<40} {paired_cells(ts, times[pairs[row]])}")


if __name__ == "__main__":
    main()
