"""Time to a target accuracy over shaped links: ``scaleopt train`` itself, 2 ranks on 2 nodes.

    sudo python benchmarks/bench_links_accuracy.py --link 100mbit 1gbit --targets 0.6 0.75
    python benchmarks/bench_links_accuracy.py --link 10mbit --rows powersgd dgc --out DIR
    python benchmarks/bench_links_accuracy.py --table A.json B.json --targets 0.4 0.75 --out DIR

For each link, a :class:`scaleopt.links.ShapedCluster` of ``--ranks`` nodes (one network
namespace each, the veth links shaped with tbf to the rate), and in it, one row after another,
the same ``scaleopt train`` run (the built-in ``topics`` data, ``--width 256``: 8.4M
parameters, 33.6 MB of float32 gradients; 2 epochs of batch 1024, 32 evaluations) with:

- ``dense``: momentum SGD over DDP's all-reduce;
- ``powersgd``: the same through torch's PowerSGD hook at rank 4 (``--powersgd 4``);
- ``dgc``: ``DGCMomentum`` (``--dgc``: the paper's sparsity warm-up over the first quarter,
  then 99.9%), and ``dgc-8`` the same over 8 epochs (more, cheaper steps);
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
from scaleopt.cli import options
from scaleopt.cli.config import new_folder

#: the rows: the options each adds to the common run
ROWS = {
    "dense": ["--optimizer", "momentum"],
    "powersgd": ["--optimizer", "momentum", "--powersgd", "4"],
    "dgc": ["--optimizer", "momentum", "--dgc"],
    "dgc-8": ["--optimizer", "momentum", "--dgc", "--epochs", "8"],
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
    codes = cluster.run(1, command, PORT, timeout)
    if codes != [0] * ranks:
        raise RuntimeError(f"{' '.join(argv)}: the ranks exited with {codes}")
    return json.loads((out / "result.json").read_text())


def merged(paths: List[str]) -> Dict[str, Any]:
    """The rows of several ``links_accuracy.json`` files in one result (by link, then row)."""
    result: Dict[str, Any] = {"links": {}}
    for p in paths:
        one = json.loads(pathlib.Path(p).read_text())
        result.update({k: v for k, v in one.items() if k != "links"})
        for rate, rows in one["links"].items():
            result["links"].setdefault(rate, {}).update(rows)
    return result


def table_and_plot(result: Dict[str, Any], targets: List[float], png: str) -> str:
    """A markdown table of each row's time to each target (and its final accuracy) by link,
    and ``png``: the time to the last target against the link rate (log-log; a row that did
    not reach it is left out at that rate)."""
    rates = sorted(result["links"], key=links.rate_bits)
    rows = [r for r in ROWS if any(r in result["links"][x] for x in rates)]
    head = "| row | " + " | ".join(rates) + " |"
    lines = [head, "|---|" + "---:|" * len(rates)]
    for row in rows:
        cells = []
        for rate in rates:
            got = result["links"][rate].get(row)
            if got is None:
                cells.append("not run")
                continue
            times = [time_to(got["history"], t) for t in targets]
            cells.append(" / ".join("-" if v is None else f"{v:,.1f}" for v in times)
                         + f" ({got['final_accuracy']:.3f})")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n".join(lines)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        pts = [(links.rate_bits(x) / 1e6, time_to(result["links"][x][row]["history"], targets[-1]))
               for x in rates if row in result["links"][x]]
        pts = [(r, t) for r, t in pts if t is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", label=row)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel(f"seconds to test accuracy {targets[-1]}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", nargs="+", metavar="RATE",
                    help="link rates, e.g. 10mbit 100mbit 1gbit 10gbit")
    ap.add_argument("--table", nargs="+", metavar="JSON",
                    help="instead of running: the table (and links_accuracy.png in --out) of "
                         "these links_accuracy.json files, at --targets")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--targets", nargs="+", type=float, default=[0.6, 0.75])
    ap.add_argument("--ranks", type=int, default=2, help="ranks, one per node (default: 2)")
    ap.add_argument("--train-size", type=int, help="a smaller training set (a quick look)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    options.add_output(ap, "links_accuracy.json and links_accuracy.png", "links-accuracy")
    args = ap.parse_args()
    args.out = args.out or new_folder(pathlib.Path("scaleopt-runs") / "links-accuracy")
    if args.table:
        os.makedirs(args.out, exist_ok=True)
        print(table_and_plot(merged(args.table), args.targets,
                             os.path.join(args.out, "links_accuracy.png")))
        return
    if not args.link:
        ap.error("--link RATE ... (or --table JSON ...)")
    if (pathlib.Path(args.out) / "links_accuracy.json").exists() and not args.overwrite:
        ap.error(f"--out {args.out} holds an earlier run's links_accuracy.json (--overwrite)")
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
