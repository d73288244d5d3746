"""OffloadAdam's host step against torch.optim.AdamW(fused=True), paired round by round.

    python benchmarks/bench_offload.py                 # 29M parameters, 2 threads, 41 rounds
    python benchmarks/bench_offload.py --size base --rounds 15
    python benchmarks/bench_offload.py --device cuda   # the full pipeline: GPU model, host state

Each round times every candidate once, in a fixed order, on its own copy of the same parameters
and gradients. Besides the median step time, the table gives the median over rounds of each
candidate's time divided by fused AdamW's time in the same round: pairing cancels most of the
drift of a shared machine. With ``--device cuda`` the parameters and gradients live on the GPU
and the time includes the copies to and from the host (the gradients are copied at step() here,
since no backward runs to start them early).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import scaleopt
from scaleopt.benchmarking import SIZES, bert_shapes, make_params, sync
from scaleopt.cli import options


def candidates(device: str):
    c = {
        "torch.AdamW(fused=True), fp32": (torch.float32, lambda ps: torch.optim.AdamW(
            ps, lr=1e-3, weight_decay=0.01, fused=True)),
        "scaleopt.OffloadAdam, fp32": (torch.float32, lambda ps: scaleopt.OffloadAdam(
            ps, lr=1e-3, weight_decay=0.01)),
        "scaleopt.OffloadAdam, bf16 params": (torch.bfloat16, lambda ps: scaleopt.OffloadAdam(
            ps, lr=1e-3, weight_decay=0.01)),
    }
    if device == "cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            c["deepspeed.DeepSpeedCPUAdam, fp32"] = (torch.float32, lambda ps: DeepSpeedCPUAdam(
                ps, lr=1e-3, weight_decay=0.01))
        except Exception:
            pass
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_size(ap, SIZES, default="small", help="the parameter set (default: small)")
    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    options.add_rounds(ap, 41)
    options.add_device(ap, "cpu or cuda (default: cpu)", default="cpu")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = bert_shapes(*SIZES[args.size])
    nparams = sum(torch.Size(s).numel() for _, s in shapes)
    opts = {}
    for name, (dtype, make) in candidates(args.device).items():
        params = [p for _, p in make_params(shapes, dtype, args.device)]
        opts[name] = make(params)
        opts[name].step()
    base = "torch.AdamW(fused=True), fp32"
    times = {k: [] for k in opts}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            sync(args.device)
            t = time.perf_counter()
            opt.step()
            sync(args.device)
            times[name].append(time.perf_counter() - t)
    print(f"BERT-like '{args.size}' set: {nparams / 1e6:.1f}M parameters in {len(shapes)} tensors; "
          f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds, {args.device}")
    print(f"{'optimizer':40s} {'median ms':>10s} {'paired x fused AdamW':>21s} {'range (10-90%)':>16s}")
    rows = []
    for name, ts in times.items():
        ratios = sorted(t / b for t, b in zip(ts, times[base]))
        lo, hi = ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]
        med = statistics.median(ratios)
        rows.append({"optimizer": name, "median_s": statistics.median(ts), "paired_ratio": med,
                     "ratio_p10": lo, "ratio_p90": hi})
        print(f"{name:40s} {statistics.median(ts) * 1e3:10.1f} {med:21.3f} {lo:7.2f} - {hi:.2f}")
    fp32, bf16 = times["scaleopt.OffloadAdam, fp32"], times["scaleopt.OffloadAdam, bf16 params"]
    print(f"OffloadAdam bf16 / fp32, paired: {statistics.median(b / a for a, b in zip(fp32, bf16)):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "params": nparams, "threads": args.threads,
                       "device": args.device, "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
