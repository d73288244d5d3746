"""Optimizer step time on a BERT-like parameter set, as ratios to torch.optim.AdamW(fused=True).

    python benchmarks/bench_step.py                    # 29M parameters (hidden 512, 4 layers)
    python benchmarks/bench_step.py --size base        # 110M parameters (BERT-base shapes)
    python benchmarks/bench_step.py --threads 2 --rounds 15 --json out.json

The same as ``scaleopt bench`` (src/scaleopt/cli/bench.py).
"""

from scaleopt.cli.bench import main

if __name__ == "__main__":
    main()
