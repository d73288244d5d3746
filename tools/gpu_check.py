"""The GPU check: everything scaleopt can only show on a CUDA GPU, in one command that fits
8 minutes on an H100, with ``pip install --no-deps --no-build-isolation -e .`` as its only
install (no package index there; the install builds the C kernels the offloaded optimizers
run on, which the report says).

    python tools/gpu_check.py OUT_DIR [--budget SECONDS] [--parts tests-first,graph,...]
    python tools/gpu_check.py OUT_DIR --jobs 16 --parts compile:150,tests-bits:90,sweep:200

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
4. ``compile``: every launch configuration's kernels compiled into Triton's cache in
   ``--jobs`` processes (the sweep does it first where this part has not); ``sweep``:
   ``tools/triton_sweep.py``, every launch configuration of the Triton kernels timed, the
   fastest written to OUT_DIR/sweep/triton_launch.json (if time is left, or alone: ``--parts
   sweep --budget 330``); ``bench-chosen``: ``bench-float32`` again with the table the sweep
   chose;
5. ``offload``: ``tools/gpu_offload.py``, OffloadAdam, ``offload(LAMB)`` and
   ``offload(Muon)``, ordinary and stepping in backward, on a model whose float32 AdamW state
   does not fit a device-memory cap: peak device bytes per parameter and step time; their time
   against the on-device fused AdamW where both fit; how much of the copies the host's work
   hides (if time is left, or alone: ``--parts offload``).

``--parts`` runs the parts named in the order named; ``--jobs N`` runs the test parts in N
pytest-xdist workers where that is installed (the compiles of a fresh machine in parallel).

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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import triton_sweep  # (tools/, beside this file)

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = 3
#: the tests run before all else (pytest -k): the int8 codes against the CPU's bit for bit,
#: two runs equal bit for bit, the fast paths against the reference loop, the Triton AdamW
#: against the CPU's kernels, compact moments against the CPU's
BITS = ("int8_codes or same_bits or fast_path_equals or steps_of_the_cpu_kernels "
        "or compact_moments_as_the_cpu")
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
    ("compile", 150, True),
    ("sweep", 330, True),
    ("bench-chosen", 60, True),
    ("offload", 120, True),
]
BUDGET = 480


def commands(part: str, scratch: Path, seconds: float = 330, jobs: int = 1) -> List[str]:
    """The command of a part that may take ``seconds``, with ``jobs`` processes where it
    can use them (pytest-xdist's workers, the sweep's compiling processes)."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "tests/test_cuda.py", "-v", "-p", "no:cacheprovider", "-rs",
              "-p", "pytest_failures_now"]  # (tools/, on the parts' PYTHONPATH)
    if jobs > 1 and _has_xdist():
        pytest += ["-n", str(jobs)]
    bench = [py, "-c", "import sys; from scaleopt.cli import main; sys.exit(main(sys.argv[1:]))",
             "bench", "--device", "cuda", "--rounds", "10", "--overwrite"]
    sweep = [py, str(ROOT / "tools" / "triton_sweep.py"), "--jobs", str(max(jobs, 1))]
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
    if part == "offload":
        return [py, str(ROOT / "tools" / "gpu_offload.py"), str(scratch / "offload.json")]
    if part == "compile":  # (what it compiled in its time stays in Triton's cache)
        return sweep + [str(scratch / "compile"), "--compile-only", "--budget",
                        str(max(10, round(seconds - 15)))]
    if part == "sweep":  # (its own budget: what is left after its start and before its report)
        return sweep + [str(scratch / "sweep"), "--budget", str(max(10, round(seconds - 40)))]
    out = ["--out", str(scratch / part), "--json", str(scratch / f"{part}.json")]
    if part == "bench-float32":
        return bench + ["--size", "base", "--only", "(triton"] + out
    if part == "bench-chosen":  # bench-float32 with the table the sweep chose
        launch = "import os, sys; os.environ['SCALEOPT_TRITON_LAUNCH'] = sys.argv.pop(1); "
        return ([py, "-c", launch + bench[2], str(scratch / "sweep" / "triton_launch.json")]
                + bench[3:] + ["--size", "base", "--only", "(triton"] + out)
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

_OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_PYTEST_LINE = re.compile(rf"^(\S+::.*?) ({_OUTCOMES})\b", re.M)
#: pytest-xdist's ``-v`` line: the worker, the progress, the outcome, then the test's id
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_OUTCOMES}) (\S+::.*?)\s*$", re.M)


def parse_pytest(text: str) -> Dict[str, str]:
    """{test id: outcome} from pytest's ``-v`` output (with pytest-xdist's workers too), also
    of a run stopped part way (each test's line is printed as it ends)."""
    found = _PYTEST_LINE.findall(text) + [(n, o) for o, n in _XDIST_LINE.findall(text)]
    return {name.split("tests/test_cuda.py::", 1)[-1]: outcome for name, outcome in found}


def _has_xdist() -> bool:
    """Whether pytest-xdist (the test parts' workers) is installed."""
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


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
        if result.get("kind") == "offload":
            lines += offload_table(result)
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


def offload_table(result: Dict[str, Any]) -> List[str]:
    """The offload part's tables: under the cap, and where both fit."""
    cap = result.get("cap_bytes", 0)
    lines = ["", f"## offload: {result.get('params', 0) / 1e6:.0f}M bfloat16 parameters under a "
                 f"{cap / 2**30:.1f} GiB cap", "",
             "| row | fits | step ms | peak device B/param |", "|---|---|---|---|"]
    for r in result.get("capped", []):
        peak = r.get("peak_device_bytes_per_param")
        lines.append(f"| {r['row']} | {'yes' if r['fits'] else 'no'} | "
                     f"{1e3 * r['step_s']:.1f} | {peak:.2f} |" if r["fits"] else
                     f"| {r['row']} | no | - | - |")
    both = result.get("both_fit", {})
    lines += ["", f"Where both fit ({both.get('params', 0) / 1e6:.0f}M parameters):", "",
              "| row | step ms | x fused AdamW on the device |", "|---|---|---|"]
    for r in both.get("rows", []):
        if r.get("fits"):
            lines.append(f"| {r['row']} | {1e3 * r['step_s']:.1f} | "
                         f"{r.get('x_device_adamw', float('nan')):.2f} |")
    hidden = result.get("hidden")
    if hidden:
        lines += ["", f"OffloadAdam's copies hidden by the host's work: "
                      f"{100 * hidden['hidden']:.0f}% (step {1e3 * hidden['step_s']:.1f} ms, "
                      f"forward and backward {1e3 * hidden['forward_backward_s']:.1f} ms, host "
                      f"step {1e3 * hidden['host_step_s']:.1f} ms, copies "
                      f"{1e3 * hidden['copies_s']:.1f} ms)."]
    return lines


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


def run_part(part: str, limit: float, scratch: Path, log, jobs: int = 1) -> Dict[str, Any]:
    """Run one part within ``limit`` seconds; its output goes to the log. A part stopped at
    its limit is stopped with every process it started (pytest's workers, the sweep's
    compiling processes), so that none runs on beside the next part."""
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tools"),
                                                      env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile("w+") as sink:
        proc = subprocess.Popen(commands(part, scratch, limit, jobs), cwd=ROOT, env=env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
            status = "done" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            status = f"stopped at its {limit:.0f} s"
        try:  # the part's process group: its children too, also after a clean exit
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        sink.seek(0)
        output = sink.read()
    log.write(f"\n===== {part} ({status}) =====\n{output}")
    log.flush()
    return {"part": part, "status": status, "seconds": time.perf_counter() - started,
            "output": output}


def write(report: Dict[str, Any], out: Path, outcomes: Dict[str, str],
          started: float) -> None:
    """The report so far (its time and the tests' summary brought up to date) to ``out``."""
    report["seconds"] = time.perf_counter() - started
    report["tests"] = summarise_tests(outcomes) if outcomes else None
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for gpu_check.json, gpu_check.md, gpu_check.log")
    ap.add_argument("--budget", type=float, default=BUDGET,
                    help=f"seconds for all parts together (default: {BUDGET})")
    ap.add_argument("--parts", help="comma-separated parts to run, in the order named, "
                    "sharing the budget in proportion to their own; PART:SECONDS gives one "
                    "its seconds (default: all, in the plan's order; "
                    + ", ".join(p for p, _, _ in PLAN) + ")")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes for the test parts (pytest-xdist, where installed) and "
                    "the sweep's compiles (default: 1)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    own = {p: s for p, s, _ in PLAN}
    asked = [] if not args.parts else [(name, float(sec[0]) if sec else None) for name, *sec in
                                       (x.split(":", 1) for x in args.parts.split(","))]
    unknown = {p for p, _ in asked} - set(own)
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
    plan = list(PLAN)
    if asked:  # the parts asked for run (none only "if time is left") and share the budget,
        # each at least its own; one given its seconds gets those
        given = sum(s for _, s in asked if s is not None)
        rest = sum(own[p] for p, s in asked if s is None)
        more = max(1.0, (args.budget - given) / rest) if rest else 1.0
        plan = [(p, round(s if s is not None else own[p] * more), False) for p, s in asked]
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
            if part == "bench-chosen" and not (scratch / "sweep" / "triton_launch.json").exists():
                report["parts"].append({"part": part, "budget": budget, "seconds": 0,
                                        "status": "skipped: no table from the sweep"})
                continue
            done = run_part(part, min(budget, left), scratch, log, jobs=args.jobs)
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
            # after every part: a check stopped from outside keeps what it measured
            write(report, out, outcomes, started)
    write(report, out, outcomes, started)
    print(markdown(report))
    return 1 if report["tests"] and report["tests"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
