"""Muon's step against torch.optim.Muon and fused AdamW, and sharded against one process
(``scaleopt bench --muon``).

    python benchmarks/bench_muon.py --rounds 5               # one process, 2 threads
    python benchmarks/bench_muon.py --world 2 --rounds 5     # FSDP2, 2 x 1 thread, against 1 x 2
"""

import sys

from scaleopt.cli.bench import main

if __name__ == "__main__":
    main(["--muon", *sys.argv[1:]])
