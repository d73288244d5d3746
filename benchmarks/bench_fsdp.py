"""LAMB and LANS on FSDP2 shards, as ratios to fused AdamW (``scaleopt bench --world N``).

    python benchmarks/bench_fsdp.py --world 2 --threads 1 --rounds 15 [--size base]
"""

from scaleopt.cli.bench_fsdp import main

if __name__ == "__main__":
    main()
