"""Host time of a Triton step: the Python work of ``opt.step()`` around the kernel launches,
with the launches stubbed out, on about 400 tensors (a BERT-like set of 25 layers, 407
tensors, small shapes: the tensors' sizes do not matter to the host).

    python benchmarks/bench_host.py                   # every variant, 50 steps each
    python benchmarks/bench_host.py --steps 200 --json out.json
    python benchmarks/bench_host.py --device cuda --only "LAMB float32" --profile

The kernels run on the CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), but
no launch runs: ``scaleopt._triton._run`` (every launch goes through it) is replaced by a
function that does nothing, so what is timed is what the host does per step on a GPU machine
before the launches: the intake of the gradients, the state, the dispatch, the address tables,
the step table and the counters. Variants: LAMB and LANS; float32 parameters, bfloat16 ones
with split float32 masters, int8 state; the learning rate a float or a tensor;
``capturable=True`` (what a CUDA graph captures: its replay costs none of this; the GPU check,
tools/gpu_check.py, measures a replay); AdamW on the Triton kernel (float32 and int8 state,
capturable). Prints the median and the 10th-90th percentiles in
milliseconds, per variant, with the thread count and torch version; and the median again with
the gradients in new storage at each step (as a backward that allocates them anew may put
them: copied between the timed steps, the last step's kept alive so that no address is handed
out again), which the Triton path meets with a new table of the gradients' addresses.

``--device cuda``: the same on CUDA tensors with the kernels launched (the host time of a
step until ``step()`` returns, its launches queued; the GPU is waited for between steps,
outside the timing). ``--profile``: the functions the timed steps spent their host time in
(cProfile, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import time


def _device_option(parser):
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: launches stubbed (default); cuda: launched")
    return parser


#: ``--device``, read before torch and Triton are imported
DEVICE = _device_option(argparse.ArgumentParser(add_help=False)).parse_known_args()[0].device
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: CPU tensors take the path

import torch  # noqa: E402

import scaleopt  # noqa: E402
from scaleopt import _triton  # noqa: E402
from scaleopt.benchmarking import NO_DECAY, bert_shapes, make_params  # noqa: E402
from scaleopt.cli import options  # noqa: E402

SHAPES = bert_shapes(64, 25, 1000, 256)  # 407 tensors


def variants():
    def make(cls, dtype=torch.float32, tensor_lr=False, **options):
        def build():
            named = make_params(SHAPES, dtype, DEVICE)
            lr = torch.tensor(1e-3, device=DEVICE) if tensor_lr else 1e-3
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
    out["AdamW float32"] = make(scaleopt.AdamW)
    out["AdamW int8 state"] = make(scaleopt.AdamW, state_dtype="int8")
    out["AdamW capturable"] = make(scaleopt.AdamW, tensor_lr=True, capturable=True)
    return out


def _wait():
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _move_gradients(opt):
    """Each gradient copied into new storage (the old ones returned, to be kept alive)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    old = [p.grad for p in params]
    for p in params:
        p.grad = p.grad.clone()
    return old


def time_steps(build, steps, profile=None, new_grads=False):
    """The host times of ``steps`` steps (``new_grads``: the gradients in new storage at each
    one); then, with ``profile``, as many steps profiled (the profiler's own cost kept out of
    the times)."""
    opt = build()
    for _ in range(5):  # state made, tables built, kernels compiled
        opt.step()
    times, kept = [], None
    for _ in range(steps):
        kept = _move_gradients(opt) if new_grads else kept
        _wait()
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    for _ in range(steps if profile is not None else 0):
        _wait()
        profile.enable()
        opt.step()
        profile.disable()
    _wait()
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    options.add_threads(ap, "intra-op threads (default: 1)", default=1)
    ap.add_argument("--json", metavar="FILE")
    _device_option(ap)
    ap.add_argument("--only", action="append", default=[],
                    help="the variants whose name contains this (repeatable)")
    ap.add_argument("--profile", action="store_true",
                    help="print where each variant's host time goes (cProfile)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if DEVICE == "cpu":
        _triton._run = lambda *a, **k: None
    what = "launches stubbed" if DEVICE == "cpu" else f"launched on {torch.cuda.get_device_name()}"
    print(f"host time of a step, {what}: {len(SHAPES)} tensors; torch "
          f"{torch.__version__}, {args.threads} thread(s), {platform.machine()}, "
          f"{args.steps} steps")
    print(f"{'variant':28s} {'median ms':>10s} {'p10':>7s} {'p90':>7s} {'new grads':>10s}")
    rows = []
    for name, build in variants().items():
        if args.only and not any(o in name for o in args.only):
            continue
        profile = cProfile.Profile() if args.profile else None
        times = sorted(time_steps(build, args.steps, profile))
        moved = time_steps(build, args.steps, new_grads=True)
        row = {"variant": name, "median_ms": 1e3 * statistics.median(times),
               "p10_ms": 1e3 * times[len(times) // 10], "p90_ms": 1e3 * times[9 * len(times) // 10],
               "new_grads_median_ms": 1e3 * statistics.median(moved)}
        rows.append(row)
        print(f"{name:28s} {row['median_ms']:10.2f} {row['p10_ms']:7.2f} {row['p90_ms']:7.2f} "
              f"{row['new_grads_median_ms']:10.2f}")
        if profile is not None:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": len(SHAPES), "torch": torch.__version__, "device": DEVICE,
                       "threads": args.threads, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
