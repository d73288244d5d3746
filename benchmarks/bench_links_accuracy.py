"""Time to a target accuracy over shaped links: ``scaleopt train`` itself, 2 ranks on 2 nodes.

    sudo python benchmarks/bench_links_accuracy.py --link 100mbit 1gbit --targets 0.6 0.75
    python benchmarks/bench_links_accuracy.py --link 10mbit --rows powersgd dgc --out DIR

For each link, a :class:`scaleopt.links.ShapedCluster` of ``--ranks`` nodes (one network
namespace each, the veth links shaped with tbf to the rate), and in it, one row after another,
the same ``scaleopt train`` run (the built-in ``topics`` data, ``--width 256``: 8.4M
parameters, 33.6 MB of float32 gradients; 2 epochs of batch 1024, 32 evaluations) with:

- ``dense``: momentum SGD over DDP's all-reduce;
- ``powersgd``: the same through torch's PowerSGD hook at rank 4 (``--powersgd 4``);
- ``dgc``: ``DGCMomentum`` (``--dgc``: the paper's sparsity warm-up over the first quarter,
  then 99.9%);
- ``adamw`` and ``adamw-dgc``: AdamW over DDP's all-reduce, and fed by the DGC hook at
  momentum 0 (top-k with error feedback), over 1 epoch (AdamW gets there sooner).

Each row's time to a target is the run's wall-clock time (``time_s`` of its history: the steps
and the evaluations before it, on rank 0) at its first evaluation at or above the target;
``None`` where the run never reached it. The evaluations are the same in every row. Writes
``links_accuracy.json`` (every row's whole history) into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from scaleopt import links

#: the rows: the options each adds to the common run
ROWS = {
    "dense": ["--optimizer", "momentum"],
    "powersgd": ["--optimizer", "momentum", "--powersgd", "4"],
    "dgc": ["--optimizer", "momentum", "--dgc"],
    "adamw": ["--optimizer", "adamw", "--epochs", "1"],
    "adamw-dgc": ["--optimizer", "adamw", "--dgc", "--epochs", "1"],
}
RUN = ["--dataset", "topics", "--width", "256", "--epochs", "2", "--batch-size", "1024",
       "--evals", "32", "--threads", "1", "--seed", "0", "--no-progress"]
PORT = 29530


def time_to(history: List[Dict[str, Any]], target: float) -> Optional[float]:
    """The ``time_s`` of the first evaluation at or above ``target`` (None: never)."""
    return next((h["time_s"] for h in history if h["test_accuracy"] >= target), None)


def one_run(cluster: links.ShapedCluster, ranks: int, argv: List[str], out: pathlib.Path,
            timeout: float) -> Dict[str, Any]:
    """``scaleopt train argv --out out``, rank r on node r; its result.json."""
    command = [sys.executable, "-m", "scaleopt", "train", *argv, "--out", str(out)]
    procs = cluster.launch(1, command, PORT)
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if codes != [0] * ranks:
        raise RuntimeError(f"{' '.join(argv)}: the ranks exited with {codes}")
    return json.loads((out / "result.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", nargs="+", required=True, metavar="RATE",
                    help="link rates, e.g. 10mbit 100mbit 1gbit 10gbit")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--targets", nargs="+", type=float, default=[0.6, 0.75])
    ap.add_argument("--ranks", type=int, default=2, help="ranks, one per node (default: 2)")
    ap.add_argument("--train-size", type=int, help="a smaller training set (a quick look)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    ap.add_argument("--out", default=".", help="folder for links_accuracy.json")
    args = ap.parse_args()
    for rate in args.link:
        links.rate_bits(rate)
    reason = links.unavailable()
    if reason is not None:
        sys.exit(f"bench_links_accuracy: needs network namespaces: {reason}")
    run = RUN + (["--train-size", str(args.train_size)] if args.train_size else [])
    result: Dict[str, Any] = {"run": run, "ranks": args.ranks, "targets": args.targets,
                              "links": {}}
    path = pathlib.Path(args.out) / "links_accuracy.json"
    for rate in args.link:
        result["links"][rate] = {}
        for row in args.rows:
            with tempfile.TemporaryDirectory() as tmp, links.ShapedCluster(
                    nodes=args.ranks, rate=rate) as cluster:
                t0 = time.perf_counter()
                got = one_run(cluster, args.ranks, [*run, *ROWS[row]],
                              pathlib.Path(tmp) / "run", args.timeout)
                wall = time.perf_counter() - t0
            history = got["history"]
            result["links"][rate][row] = {
                "options": ROWS[row], "time_to": {str(t): time_to(history, t)
                                                  for t in args.targets},
                "final_accuracy": history[-1]["test_accuracy"], "run_s": got["time_s"],
                "launch_s": wall, "history": history}
            print(f"{rate:>8} {row:10} final {history[-1]['test_accuracy']:.4f} in "
                  f"{got['time_s']:8.1f} s; " + ", ".join(
                      f"{t}: {'-' if v is None else f'{v:.1f} s'}"
                      for t, v in result["links"][rate][row]["time_to"].items()), flush=True)
            os.makedirs(args.out, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
