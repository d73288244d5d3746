"""The C kernels' compact-state loops on the CPU: the portable ones against the AVX-512 ones,
each as a ratio to the same optimizer with float32 state.

    python benchmarks/bench_lanes.py                      # 28.8M parameters, 2 threads
    python benchmarks/bench_lanes.py --optimizers LAMB AdamW --rounds 15

Three optimizers per name, each with its own copy of the same BERT-like parameters and
gradients (``scaleopt bench``'s 'small' set): float32 state, int8 state on the portable loops,
int8 state on the AVX-512 loops (``scaleopt._native.compact_simd``). They are timed once per
round in that order; the table gives median steps and the median over rounds of each int8
step divided by the float32 step of the same round. On a CPU without AVX-512 both int8 rows
run the portable loops.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch

import scaleopt
from scaleopt import _native
from scaleopt.benchmarking import cpu_options, cpu_shapes, make_params, paired_ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", nargs="+", default=["LAMB", "LANS", "AdamW", "OffloadAdam"])
    ap.add_argument("--state-dtype", default="int8", choices=["bfloat16", "int8"])
    cpu_options(ap, rounds=11)
    args = ap.parse_args()
    shapes = cpu_shapes(args, native=True)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    was = _native.compact_simd()
    avx512 = _native.compact_simd(True)
    print(f"BERT-like set: {numel / 1e6:.1f}M parameters, {args.threads} threads, "
          f"{args.rounds} rounds; AVX-512 loops available: {avx512}")
    print(f"{'optimizer':14s} {'float32 ms':>10s} {'portable ms':>11s} {'avx512 ms':>9s} "
          f"{'portable x':>10s} {'avx512 x':>8s}")
    try:
        for name in args.optimizers:
            def make(state_dtype: str) -> torch.optim.Optimizer:
                named = make_params(shapes, torch.float32)
                opt = getattr(scaleopt, name)([p for _, p in named], lr=1e-3,
                                              state_dtype=state_dtype)
                opt.step()  # allocate the state
                return opt

            opts = {"float32": make("float32"), "portable": make(args.state_dtype),
                    "avx512": make(args.state_dtype)}
            times: Dict[str, List[float]] = {k: [] for k in opts}
            for _ in range(args.rounds):
                for lanes, opt in opts.items():
                    _native.compact_simd(lanes == "avx512")
                    start = time.perf_counter()
                    opt.step()
                    times[lanes].append(time.perf_counter() - start)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{name:14s} {med['float32']:10.1f} {med['portable']:11.1f} "
                  f"{med['avx512']:9.1f} {paired_ratio(times['portable'], times['float32']):10.2f} "
                  f"{paired_ratio(times['avx512'], times['float32']):8.2f}", flush=True)
            del opts
    finally:
        _native.compact_simd(was)


if __name__ == "__main__":
    main()
