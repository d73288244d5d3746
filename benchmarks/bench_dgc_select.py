"""DGC's top-k selection against torch.topk, on one large tensor.

    python benchmarks/bench_dgc_select.py                 # 25M elements, density 0.1%, 2 threads
    python benchmarks/bench_dgc_select.py --numel 100000000 --density 0.001 --rounds 7

Times ``scaleopt.dgc.topk_sampled`` (a threshold estimated from a ~1% sample, one pass to collect
the candidates, the exact top-k of those) and ``torch.topk(v.abs(), k)``, interleaved, and checks
that both select the same indices.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scaleopt.dgc import k_of, topk_exact, topk_sampled
from scaleopt.cli import options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--density", type=float, default=0.001)
    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    options.add_rounds(ap, 7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(args.numel, generator=g)
    k = k_of(args.numel, 1.0 - args.density)
    same = set(topk_sampled(v, k, generator=g).tolist()) == set(topk_exact(v, k).tolist())
    times = {"torch.topk": [], "scaleopt.dgc.topk_sampled": []}
    for _ in range(args.rounds):
        for name, fn in (("torch.topk", lambda: topk_exact(v, k)),
                         ("scaleopt.dgc.topk_sampled", lambda: topk_sampled(v, k, generator=g))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["torch.topk"])
    print(f"{args.numel:,} float32 elements, k = {k:,} (density {args.density:g}), "
          f"{args.threads} threads, torch {torch.__version__}, same indices: {same}")
    for name, ts in times.items():
        print(f"{name:28s} {statistics.median(ts) * 1e3:9.1f} ms  {statistics.median(ts) / base:6.3f}x")


if __name__ == "__main__":
    main()
