"""LAMB and LANS step time by tensor size, as paired ratios to torch.optim.AdamW(fused=True).

    python benchmarks/bench_sizes.py                       # 16M parameters per row, 2 threads
    python benchmarks/bench_sizes.py --threads 2 --rounds 15 --total 16000000

Each row holds about ``--total`` parameters in tensors of one size. Small tensors stay in the
caches between the kernels' passes; tensors much larger than the last-level cache pay for every
pass in memory traffic (LAMB's floor 40/28 = 1.43x, LANS's 48/28 = 1.71x fused AdamW).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import scaleopt
from scaleopt.benchmarking import paired_ratio
from scaleopt.cli import options


def tensors(numel: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(numel, generator=g) * 0.02) for _ in range(count)]
    for p in ps:
        p.grad = torch.randn(numel, generator=g) * 1e-3
    return ps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+",
                    default=[65536, 262144, 1048576, 2359296, 4194304, 15627264])
    ap.add_argument("--total", type=int, default=16_000_000, help="parameters per row")
    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    options.add_rounds(ap, 15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds, paired ratios")
    print(f"{'tensor size':>12s} {'tensors':>8s} {'AdamW ms':>9s} {'LAMB':>6s} {'LANS':>6s}")
    for numel in args.sizes:
        count = max(1, args.total // numel)
        opts = {
            "adamw": torch.optim.AdamW(tensors(numel, count, 0), lr=1e-3, fused=True),
            "lamb": scaleopt.LAMB(tensors(numel, count, 0), lr=1e-3),
            "lans": scaleopt.LANS(tensors(numel, count, 0), lr=1e-3),
        }
        for opt in opts.values():
            opt.step()  # state allocated
        times = {k: [] for k in opts}
        for _ in range(args.rounds):
            for k, opt in opts.items():
                t = time.perf_counter()
                opt.step()
                times[k].append(time.perf_counter() - t)
        base = times["adamw"]
        print(f"{numel:12,d} {count:8d} {statistics.median(base) * 1e3:9.3g} "
              f"{paired_ratio(times['lamb'], base):6.2f} {paired_ratio(times['lans'], base):6.2f}")


if __name__ == "__main__":
    main()
