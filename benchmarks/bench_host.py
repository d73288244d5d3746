"""Host time of a Triton step: the Python work of ``opt.step()`` around the kernel launches,
with the launches stubbed out, on about 400 tensors (a BERT-like set of 25 layers, 407
tensors, small shapes: the tensors' sizes do not matter to the host).

    python benchmarks/bench_host.py                   # every variant, 50 steps each
    python benchmarks/bench_host.py --steps 200 --json out.json

The kernels run on the CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), but
no launch runs: ``scaleopt._triton._run`` (every launch goes through it) is replaced by a
function that does nothing, so what is timed is what the host does per step on a GPU machine
before the launches: the intake of the gradients, the state, the dispatch, the address tables,
the step table and the counters. Variants: LAMB and LANS; float32 parameters, bfloat16 ones
with split float32 masters, int8 state; the learning rate a float or a tensor;
``capturable=True`` (what a CUDA graph captures: its replay costs none of this; the GPU check,
tools/gpu_check.py, measures a replay). Prints the median and the 10th-90th percentiles in
milliseconds, per variant, with the thread count and torch version.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: CPU tensors take the path

import torch  # noqa: E402

import scaleopt  # noqa: E402
from scaleopt import _triton  # noqa: E402
from scaleopt.cli.paramsets import NO_DECAY, bert_shapes, make_params  # noqa: E402

SHAPES = bert_shapes(64, 25, 1000, 256)  # 407 tensors


def variants():
    def make(cls, dtype=torch.float32, tensor_lr=False, **options):
        def build():
            named = make_params(SHAPES, dtype)
            lr = torch.tensor(1e-3) if tensor_lr else 1e-3
            return cls(named, lr=lr, exclude_from_weight_decay=NO_DECAY,
                       implementation="triton", **options)
        return build

    out = {}
    for cls in (scaleopt.LAMB, scaleopt.LANS):
        name = cls.__name__
        out[f"{name} float32"] = make(cls)
        out[f"{name} bf16 split masters"] = make(cls, torch.bfloat16, master_weights=True)
        out[f"{name} int8 state"] = make(cls, state_dtype="int8")
        out[f"{name} tensor lr"] = make(cls, tensor_lr=True)
        out[f"{name} capturable"] = make(cls, tensor_lr=True, capturable=True)
    return out


def time_steps(build, steps):
    opt = build()
    for _ in range(5):  # state made, tables built
        opt.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    _triton._run = lambda *a, **k: None
    print(f"host time of a step, launches stubbed: {len(SHAPES)} tensors; torch "
          f"{torch.__version__}, {args.threads} thread(s), {platform.machine()}, "
          f"{args.steps} steps")
    print(f"{'variant':28s} {'median ms':>10s} {'p10':>7s} {'p90':>7s}")
    rows = []
    for name, build in variants().items():
        times = sorted(time_steps(build, args.steps))
        row = {"variant": name, "median_ms": 1e3 * statistics.median(times),
               "p10_ms": 1e3 * times[len(times) // 10], "p90_ms": 1e3 * times[9 * len(times) // 10]}
        rows.append(row)
        print(f"{name:28s} {row['median_ms']:10.2f} {row['p10_ms']:7.2f} {row['p90_ms']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(SHAPES), "torch": torch.__version__,
                       "threads": args.threads, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
