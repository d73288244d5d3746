"""The measured peak memory of a whole training step (forward, backward, step), in bytes per
parameter, for each optimizer and mode (``scaleopt bench --memory``; see docs/memory.md).

    python benchmarks/bench_memory.py                      # 24 matrices of 1024 x 1024, CPU
    python benchmarks/bench_memory.py llama                # a llama-like stack, 85M parameters
    python benchmarks/bench_memory.py --only Muon          # the rows whose name holds "Muon"
"""

import sys

from scaleopt.cli.bench import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    model = [argv.pop(0)] if argv and argv[0] in ("matrices", "llama") else []
    main(["--memory", *model, *argv])
