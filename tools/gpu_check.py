"""The GPU check: everything scaleopt can only show on a CUDA GPU, in one command that fits
8 minutes on an H100, with ``pip install --no-deps --no-build-isolation -e .`` as its only
install (no package index there; the install builds the C kernels the offloaded optimizers
run on, which the report says).

    python tools/gpu_check.py OUT_DIR [--budget SECONDS] [--parts tests-first,graph,...]

Parts, in order, each with its own time budget (printed at the start; a part that would not
fit in what is left is skipped, and says so):

1. ``tests-bits``: the CUDA tests that matter most (tests/test_cuda.py), first: the int8
   codes against the CPU's bit for bit, two runs equal bit for bit, the fast paths against the
   reference loop; ``tests-first``: the Triton kernels against the reference, CUDA-graph
   replay, no host sync (its compiles take minutes on a fresh machine); ``tests-rest``: the rest of tests/test_cuda.py
   but the compiled steps, ``tests-compiled``: those (each test's failure is printed as it
   happens, so a part stopped at its limit still says why);
2. ``graph``: a LAMB step over 400 tensors captured in a CUDA graph and replayed, against the
   eager step: host time and GPU time of each;
3. ``bench-float32``, ``bench-bfloat16``: ``scaleopt bench --device cuda`` on BERT-base shapes
   (109.5M parameters), the Triton rows, float32 and bfloat16 with split masters;
   ``bench-muon``: Muon against torch.optim.Muon (``scaleopt bench --muon``);
   ``bench-peers``: torch's multi-tensor ops, compiled and not; ``bench-1b``: the 1b
   set (1.02B parameters) in bfloat16, if time is left;
4. ``sweep``: ``tools/triton_sweep.py``, every launch configuration of the Triton kernels
   timed, the fastest written to OUT_DIR/sweep/triton_launch.json (if time is left, or alone:
   ``--parts sweep --budget 330``).

Writes ``gpu_check.json`` (every number), ``gpu_check.md`` (the summary for docs/gpu.md) and
``gpu_check.log`` (every part's output) to OUT_DIR. Exits 0 when every test that ran passed,
1 when one failed, and 3 at once, having written nothing, where there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import triton_sweep  # (tools/, beside this file)

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = 3
#: the tests run before all else (pytest -k): the int8 codes against the CPU's bit for bit,
#: two runs equal bit for bit, the fast paths against the reference loop
BITS = "int8_codes or same_bits or fast_path_equals"
#: the tests of the next part: the Triton kernels, CUDA-graph replay, no host sync
FIRST = "triton or graph or never_synchronises"
#: the tests that compile a step with torch.compile (seconds each): a part of their own, last
COMPILED = "compiled_step"
#: (part, seconds it may take at most, whether it is run only if time is left after the rest)
PLAN = [
    ("tests-bits", 60, False),
    ("tests-first", 120, False),
    ("graph", 30, False),
    ("bench-float32", 60, False),
    ("bench-bfloat16", 60, False),
    ("tests-rest", 60, True),
    ("tests-compiled", 90, True),
    ("bench-muon", 40, True),
    ("bench-peers", 40, True),
    ("bench-1b", 50, True),
    ("sweep", 330, True),
]
BUDGET = 480


def commands(part: str, scratch: Path) -> Optional[List[str]]:
    """The command of a part (None: run in this file, ``--part``)."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "tests/test_cuda.py", "-v", "-p", "no:cacheprovider", "-rs",
              "-p", "pytest_failures_now"]  # (tools/, on the parts' PYTHONPATH)
    bench = [py, "-c", "import sys; from scaleopt.cli import main; sys.exit(main(sys.argv[1:]))",
             "bench", "--device", "cuda", "--rounds", "10", "--overwrite"]
    if part == "tests-bits":
        return pytest + ["-k", BITS]
    if part == "tests-first":
        return pytest + ["-k", f"({FIRST}) and not ({BITS})"]
    if part == "tests-rest":
        return pytest + ["-k", f"not ({BITS}) and not ({FIRST}) and not {COMPILED}"]
    if part == "tests-compiled":
        return pytest + ["-k", f"{COMPILED} and not ({BITS}) and not ({FIRST})"]
    if part == "graph":
        return [py, __file__, "--part", "graph", str(scratch)]
    if part == "sweep":
        return [py, str(ROOT / "tools" / "triton_sweep.py"), str(scratch / "sweep"),
                "--budget", "290"]
    out = ["--out", str(scratch / part), "--json", str(scratch / f"{part}.json")]
    if part == "bench-float32":
        return bench + ["--size", "base", "--only", "(triton"] + out
    if part == "bench-bfloat16":
        return bench + ["--size", "base", "--dtype", "bfloat16", "--only", "(triton"] + out
    if part == "bench-muon":
        return bench + ["--size", "base", "--muon"] + out
    if part == "bench-peers":
        return bench + ["--size", "base", "--only", "multi-tensor"] + out
    if part == "bench-1b":
        return bench + ["--size", "1b", "--dtype", "bfloat16", "--only", "(triton)"] + out
    raise ValueError(f"no part {part!r}")


# -- reading what the parts print ------------------------------------------------------------

_PYTEST_LINE = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def parse_pytest(text: str) -> Dict[str, str]:
    """{test id: outcome} from pytest's ``-v`` output, also of a run stopped part way (each
    test's line is printed as it ends)."""
    return {name.split("tests/test_cuda.py::", 1)[-1]: outcome
            for name, outcome in _PYTEST_LINE.findall(text)}


def summarise_tests(outcomes: Dict[str, str]) -> Dict[str, Any]:
    """Counts per outcome, the failures, and the checks the report names: the int8 codes
    against the CPU's, and two runs equal bit for bit."""
    counts: Dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1

    def check(pattern: str) -> str:
        got = [o for name, o in outcomes.items() if re.search(pattern, name)]
        if not got:
            return "not run"
        return "passed" if all(o == "PASSED" for o in got) else "FAILED"

    return {"counts": counts,
            "failed": sorted(n for n, o in outcomes.items() if o in ("FAILED", "ERROR")),
            "int8 codes equal the CPU's": check(r"int8_codes_of_the_cpu"),
            "two runs equal bit for bit": check(r"two_runs_give_the_same_bits"),
            "CUDA-graph replay": check(r"graph_replays"),
            "no host sync": check(r"never_synchronises")}


def bench_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The rows of a ``scaleopt bench --device cuda`` result, as the report gives them."""
    return [{"optimizer": r["optimizer"], "ms": 1e3 * r["median_s"], "x_fused_adamw": r["ratio"],
             "host_ms": 1e3 * r["host_s"], "gb_per_s": r["gb_per_s"],
             "fraction_of_copy": r["fraction_of_copy"],
             "state_bytes_per_param": r["state_bytes_per_param"]}
            for r in result.get("rows", [])]


def markdown(report: Dict[str, Any]) -> str:
    """The summary: the machine, each part's time, the checks, the host times and the bench
    tables."""
    env = report.get("environment", {})
    lines = [f"# GPU check: {env.get('gpu', '?')}", "",
             f"torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, CUDA "
             f"{env.get('cuda', '?')}, Python {env.get('python', '?')}, C kernels "
             f"{'built' if env.get('c_kernels') else 'NOT built (offload runs on torch ops)'}; "
             f"{report.get('seconds', 0):.0f} s of a {report.get('budget', BUDGET)} s budget.", "",
             "| part | budget s | took s | status |", "|---|---|---|---|"]
    for p in report.get("parts", []):
        lines.append(f"| {p['part']} | {p['budget']} | {p.get('seconds', 0):.0f} | {p['status']} |")
    tests = report.get("tests")
    if tests:
        lines += ["", "| check | result |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in tests.items() if k not in ("counts", "failed")]
        lines += ["", "Tests: " + ", ".join(f"{n} {k.lower()}" for k, n in
                                            sorted(tests["counts"].items()))]
        if tests["failed"]:
            lines += ["", "Failed: " + ", ".join(f"`{n}`" for n in tests["failed"])]
    graph = report.get("graph")
    if graph:
        lines += ["", f"LAMB over {graph['tensors']} tensors ({graph['params'] / 1e6:.1f}M "
                      f"parameters): eager step {graph['eager_host_ms']:.2f} ms of host time, "
                      f"{graph['eager_gpu_ms']:.2f} ms on the GPU; CUDA-graph replay "
                      f"{graph['graph_host_ms']:.3f} ms of host time, "
                      f"{graph['graph_gpu_ms']:.2f} ms on the GPU; the replay's weights equal "
                      f"the eager step's: {graph['equal']}."]
    for part, result in report.get("bench", {}).items():
        if result.get("kind") == "muon":
            lines += muon_table(part, result)
            continue
        lines += ["", f"## {part}: {result.get('params', 0) / 1e6:.1f}M parameters, "
                      f"{result.get('dtype')}, copy {result.get('copy_bytes_per_s', 0) / 1e9:.0f} GB/s",
                  "", "| optimizer | ms | x fused AdamW | host ms | GB/s | % of copy | state B/param |",
                  "|---|---|---|---|---|---|---|"]
        for r in bench_rows(result):
            lines.append(f"| {r['optimizer']} | {r['ms']:.2f} | {r['x_fused_adamw']:.2f} | "
                         f"{r['host_ms']:.2f} | {r['gb_per_s']:.0f} | "
                         f"{100 * r['fraction_of_copy']:.0f}% | {r['state_bytes_per_param']:.2f} |")
    sweep = report.get("sweep")
    if sweep:
        lines += ["", f"## sweep: the Triton launch table ({sweep['seconds']:.0f} s, "
                      f"{sweep['skipped']} runs skipped for time; sweep/triton_launch.json)", ""]
        lines += triton_sweep.comparison(sweep["before"], sweep["after"])
    return "\n".join(lines) + "\n"


def muon_table(part: str, result: Dict[str, Any]) -> List[str]:
    """The rows of ``scaleopt bench --muon``: each step against the fused AdamW and against
    torch.optim.Muon with torch's fused AdamW for the rest."""
    lines = ["", f"## {part}: {result.get('params', 0) / 1e6:.1f}M parameters, float32", "",
             "| optimizer | ms | x fused AdamW | x torch Muon | state B/param |",
             "|---|---|---|---|---|"]
    for r in result.get("rows", []):
        lines.append(f"| {r['optimizer']} | {1e3 * r['median_s']:.2f} | {r['ratio']:.2f} | "
                     f"{r['ratio_to_torch_muon']:.2f} | {r['state_bytes_per_param']:.2f} |")
    return lines


# -- the parts -------------------------------------------------------------------------------


def environment() -> Dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from scaleopt import _native

    return {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version(), "c_kernels": _native.available()}


def graph_part(scratch: Path) -> Dict[str, Any]:
    """LAMB (Triton, ``capturable=True``) over 400 tensors of BERT-like shapes: the eager
    step's host and GPU time, and a CUDA graph's replay's; and whether the graph's weights equal
    an eager twin's after the same steps."""
    import statistics

    import torch

    import scaleopt
    from scaleopt.cli.bench_gpu import _timed
    from scaleopt.benchmarking import NO_DECAY, bert_shapes, make_params

    shapes = bert_shapes(256, 25, 8192, 1024)  # 407 tensors
    twins = []
    for _ in range(2):
        named = make_params(shapes, torch.float32, "cuda")
        lr = torch.tensor(1e-3, device="cuda")
        twins.append((named, scaleopt.LAMB(named, lr=lr, exclude_from_weight_decay=NO_DECAY,
                                           capturable=True), lr))
    (named, eager, _), (named_g, captured, lr_g) = twins
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            captured.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.step()

    for _ in range(3):
        eager.step()
    eager_times = [_timed(eager.step, "cuda") for _ in range(10)]  # (GPU, host) seconds
    graph_times = [_timed(graph.replay, "cuda") for _ in range(10)]
    # both have taken 13 steps: the captured optimizer 3 before the capture (which runs
    # nothing) and 10 replays, the eager one 3 + 10
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for (_, a), (_, b) in zip(named, named_g))
    return {"tensors": len(shapes), "params": sum(p.numel() for _, p in named),
            "eager_host_ms": 1e3 * statistics.median(h for _, h in eager_times),
            "eager_gpu_ms": 1e3 * statistics.median(g for g, _ in eager_times),
            "graph_host_ms": 1e3 * statistics.median(h for _, h in graph_times),
            "graph_gpu_ms": 1e3 * statistics.median(g for g, _ in graph_times),
            "equal": equal}


def run_part(part: str, limit: float, scratch: Path, log) -> Dict[str, Any]:
    """Run one part within ``limit`` seconds; its output goes to the log."""
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tools"),
                                                      env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(commands(part, scratch), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=limit)
        output, status = done.stdout + done.stderr, "done" if done.returncode == 0 else \
            f"exit {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                         for x in (exc.stdout, exc.stderr))
        status = f"stopped at its {limit:.0f} s"
    log.write(f"\n===== {part} ({status}) =====\n{output}")
    log.flush()
    return {"part": part, "status": status, "seconds": time.perf_counter() - started,
            "output": output}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for gpu_check.json, gpu_check.md, gpu_check.log")
    ap.add_argument("--budget", type=float, default=BUDGET,
                    help=f"seconds for all parts together (default: {BUDGET})")
    ap.add_argument("--parts", help="comma-separated parts to run, in the plan's order, "
                    "sharing the budget in proportion to their own (default: all; "
                    + ", ".join(p for p, _, _ in PLAN) + ")")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    chosen = [p for p, _, _ in PLAN] if not args.parts else args.parts.split(",")
    unknown = set(chosen) - {p for p, _, _ in PLAN}
    if unknown:
        ap.error(f"no part {', '.join(sorted(unknown))}")
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); the GPU "
              "check runs on a machine with an NVIDIA GPU. Nothing was run or written.",
              file=sys.stderr)
        return NO_CUDA
    if args.part == "graph":
        print(json.dumps(graph_part(Path(args.out))))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(p, s, late) for p, s, late in PLAN if p in chosen]
    if args.parts:  # the parts asked for run (none only "if time is left") and share the
        more = max(1.0, args.budget / sum(s for _, s, _ in plan))  # budget, each at least its own
        plan = [(p, round(s * more), False) for p, s, _ in plan]
    print("gpu_check budget: " + ", ".join(f"{p} {s} s{' (if time is left)' if late else ''}"
                                           for p, s, late in plan) + f"; {args.budget:.0f} s in all")
    report: Dict[str, Any] = {"environment": environment(), "budget": args.budget, "parts": [],
                              "bench": {}}
    started = time.perf_counter()
    outcomes: Dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp, open(out / "gpu_check.log", "w") as log:
        scratch = Path(tmp)
        for part, budget, late in plan:
            left = args.budget - (time.perf_counter() - started)
            if left < (budget if late else min(budget, 20)):
                report["parts"].append({"part": part, "budget": budget, "seconds": 0,
                                        "status": f"skipped: {left:.0f} s left"})
                continue
            done = run_part(part, min(budget, left), scratch, log)
            output = done.pop("output")
            done["budget"] = budget
            report["parts"].append(done)
            print(f"{part}: {done['status']} in {done['seconds']:.0f} s", flush=True)
            if part.startswith("tests"):
                outcomes.update(parse_pytest(output))
            elif part == "graph" and done["status"] == "done":
                report["graph"] = json.loads(output.strip().splitlines()[-1])
            elif part == "sweep" and (scratch / "sweep" / "sweep.json").exists():
                (out / "sweep").mkdir(exist_ok=True)
                for name in ("sweep.json", "triton_launch.json"):
                    (out / "sweep" / name).write_bytes((scratch / "sweep" / name).read_bytes())
                sweep = json.loads((scratch / "sweep" / "sweep.json").read_text())
                report["sweep"] = {k: sweep[k] for k in ("before", "after", "copy_gb_s",
                                                         "table", "seconds", "skipped")}
            elif (scratch / f"{part}.json").exists():
                report["bench"][part] = json.loads((scratch / f"{part}.json").read_text())
    report["seconds"] = time.perf_counter() - started
    report["tests"] = summarise_tests(outcomes) if outcomes else None
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if report["tests"] and report["tests"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
