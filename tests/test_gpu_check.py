"""tools/gpu_check.py, the one-command GPU check, where there is no GPU: it exits at once with
its message, its plan fits its budget, and what it reads from the parts' output and writes as
its summary is right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import gpu_check as G  # noqa: E402

sys.path.remove(str(TOOLS))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the check would run")
def test_without_cuda_it_exits_at_once_with_a_clear_message(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == G.NO_CUDA
    assert "no CUDA device" in done.stderr and not out.exists()


def test_the_plan_fits_eight_minutes_and_every_part_has_a_command(tmp_path):
    """The parts that always run take at most their budgets, which leave room in 480 s for
    the parts run only if time is left; each part names a real command."""
    assert G.BUDGET <= 480
    assert sum(s for _, s, late in G.PLAN if not late) <= G.BUDGET
    for part, _, _ in G.PLAN:
        command = G.commands(part, tmp_path)
        assert command and command[0] == sys.executable, part
    assert G.PLAN[0][0] == "tests-bits"  # what a user relies on most, before any part can stop
    assert G.commands("tests-bits", tmp_path)[-1] == G.BITS
    assert G.commands("tests-first", tmp_path)[-1] == f"({G.FIRST}) and not ({G.BITS})"
    assert (G.commands("tests-rest", tmp_path)[-1]
            == f"not ({G.BITS}) and not ({G.FIRST}) and not {G.COMPILED}")
    assert (G.commands("tests-compiled", tmp_path)[-1]
            == f"{G.COMPILED} and not ({G.BITS}) and not ({G.FIRST})")


def test_bench_parts_ask_for_rows_that_exist():
    """Each bench part's --only selects at least one of the GPU benchmark's rows (an unknown
    name is a usage error there, which would cost a part)."""
    from scaleopt.cli import bench_gpu

    for part, dtype in (("bench-float32", torch.float32), ("bench-bfloat16", torch.bfloat16),
                        ("bench-peers", torch.float32), ("bench-1b", torch.bfloat16)):
        command = G.commands(part, Path("scratch"))
        only = command[command.index("--only") + 1:command.index("--out")]
        names = list(bench_gpu.candidates(dtype))
        for o in only:
            assert any(o.casefold() in n.casefold() for n in names), (part, o)


PYTEST_OUTPUT = """\
============================= test session starts ==============================
tests/test_cuda.py::test_cuda_kernels_store_the_int8_codes_of_the_cpu[exp_avg] PASSED [  1%]
tests/test_cuda.py::test_cuda_kernels_store_the_int8_codes_of_the_cpu[exp_avg_sq] FAILED [  2%]
tests/test_cuda.py::test_cuda_two_runs_give_the_same_bits[float32-LAMB] PASSED [  3%]
tests/test_cuda.py::test_cuda_two_runs_give_the_same_bits[int8 state-LANS] PASSED [  4%]
tests/test_cuda.py::test_cuda_offload_checkpoint_from_a_cpu_run_stays_on_the_host SKIPPED (no) [ 5%]
tests/test_cuda.py::test_cuda_graph_replays_the_triton_step_with_a_changed_lr[LAMB] ERROR [ 6%]
tests/test_cuda.py::test_cuda_step_never_synchronises[LAMB]
"""


XDIST_OUTPUT = """\
created: 16/16 workers
tests/test_cuda.py::test_cuda_two_runs_give_the_same_bits[int8 state-LANS] 
tests/test_cuda.py::test_cuda_kernels_store_the_int8_codes_of_the_cpu[exp_avg] 
[gw3] [  4%] PASSED tests/test_cuda.py::test_cuda_two_runs_give_the_same_bits[int8 state-LANS] 
[gw0] [ 12%] FAILED tests/test_cuda.py::test_cuda_kernels_store_the_int8_codes_of_the_cpu[exp_avg] 
[gw1] [100%] SKIPPED tests/test_cuda.py::test_cuda_graph_replays_the_triton_step_with_a_changed_lr[LAMB] 
"""


def test_pytest_xdist_output_is_read_as_well(monkeypatch):
    """The test parts with ``--jobs``: pytest-xdist's lines (worker, progress, outcome, id;
    a test's id is printed first when it starts) give the same outcomes; its workers are
    asked for where it is installed, and not where it is not."""
    assert G.parse_pytest(XDIST_OUTPUT) == {
        "test_cuda_two_runs_give_the_same_bits[int8 state-LANS]": "PASSED",
        "test_cuda_kernels_store_the_int8_codes_of_the_cpu[exp_avg]": "FAILED",
        "test_cuda_graph_replays_the_triton_step_with_a_changed_lr[LAMB]": "SKIPPED"}
    for installed in (True, False):
        monkeypatch.setattr(G, "_has_xdist", lambda: installed)
        command = G.commands("tests-bits", Path("s"), jobs=16)
        assert (command[command.index("-n") + 1] == "16") if installed else "-n" not in command
        assert "-n" not in G.commands("tests-bits", Path("s"), jobs=1)


def test_pytest_output_is_read_test_by_test_also_when_a_part_was_stopped():
    outcomes = G.parse_pytest(PYTEST_OUTPUT)  # the last test never finished: not counted
    assert len(outcomes) == 6
    assert outcomes["test_cuda_two_runs_give_the_same_bits[int8 state-LANS]"] == "PASSED"
    tests = G.summarise_tests(outcomes)
    assert tests["counts"] == {"PASSED": 3, "FAILED": 1, "SKIPPED": 1, "ERROR": 1}
    assert tests["int8 codes equal the CPU's"] == "FAILED"
    assert tests["two runs equal bit for bit"] == "passed"
    assert tests["CUDA-graph replay"] == "FAILED"
    assert tests["no host sync"] == "not run"
    assert tests["failed"] == [
        "test_cuda_graph_replays_the_triton_step_with_a_changed_lr[LAMB]",
        "test_cuda_kernels_store_the_int8_codes_of_the_cpu[exp_avg_sq]"]


def test_the_summary_gives_every_number_of_the_report():
    bench = {"params": 109_500_000, "dtype": "float32", "copy_bytes_per_s": 2.9e12, "rows": [
        {"optimizer": "scaleopt.LAMB(triton)", "median_s": 0.00215, "ratio": 1.31,
         "host_s": 0.00042, "gb_per_s": 2037.0, "fraction_of_copy": 0.70,
         "state_bytes_per_param": 8.0}]}
    report = {"environment": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130",
                              "triton": "3.6.0", "cuda": "13.0", "python": "3.12.3"},
              "budget": 480, "seconds": 401.0,
              "parts": [{"part": "tests-first", "budget": 150, "seconds": 97.2, "status": "done"},
                        {"part": "bench-1b", "budget": 50, "seconds": 0,
                         "status": "skipped: 31 s left"}],
              "tests": G.summarise_tests(G.parse_pytest(PYTEST_OUTPUT)),
              "graph": {"tensors": 407, "params": 21_800_000, "eager_host_ms": 0.91,
                        "eager_gpu_ms": 0.52, "graph_host_ms": 0.012, "graph_gpu_ms": 0.40,
                        "equal": True},
              "bench": {"bench-float32": bench},
              "sweep": {"seconds": 212.0, "skipped": 0, "before": {"1b": {
                  "lamb_apply float32": {"ms": 5.1, "of_copy": 0.61}}}, "after": {"1b": {
                      "lamb_apply float32": {"ms": 4.2, "of_copy": 0.74}}}}}
    md = G.markdown(report)
    for text in ("NVIDIA H100 80GB HBM3", "torch 2.11.0+cu130", "Triton 3.6.0",
                 "401 s of a 480 s budget", "| tests-first | 150 | 97 | done |",
                 "skipped: 31 s left", "| two runs equal bit for bit | passed |",
                 "| int8 codes equal the CPU's | FAILED |", "3 passed", "1 failed",
                 "eager step 0.91 ms of host time", "replay 0.012 ms of host time",
                 "equal the eager step's: True", "109.5M parameters, float32, copy 2900 GB/s",
                 "| scaleopt.LAMB(triton) | 2.15 | 1.31 | 0.42 | 2037 | 70% | 8.00 |",
                 "the Triton launch table (212 s, 0 runs skipped",
                 "| 1b | lamb_apply float32 | 5.100 | 61% | 4.200 | 74% |"):
        assert text in md, text


def test_a_whole_check_writes_its_report_from_the_parts_output(tmp_path, monkeypatch, capsys):
    """main() with each part's command replaced by one that prints what the real one prints
    (pytest's lines, the graph part's JSON, a bench result file; one part overruns its time):
    the report, its summary and the log, and the exit status of a failed test."""
    bench = {"params": 1000, "dtype": "float32", "copy_bytes_per_s": 1e12, "rows": [
        {"optimizer": "scaleopt.LAMB(triton)", "median_s": 0.001, "ratio": 1.2, "host_s": 0.0003,
         "gb_per_s": 40.0, "fraction_of_copy": 0.5, "state_bytes_per_param": 8.0}]}
    muon = {"kind": "muon", "params": 1000, "rows": [
        {"optimizer": "scaleopt.Muon", "median_s": 0.002, "ratio": 3.0,
         "ratio_to_torch_muon": 0.9, "state_bytes_per_param": 6.2}]}
    graph = {"tensors": 407, "params": 10, "eager_host_ms": 1.0, "eager_gpu_ms": 0.5,
             "graph_host_ms": 0.01, "graph_gpu_ms": 0.4, "equal": True}
    offload = {"kind": "offload", "params": 1000, "cap_bytes": 7000, "capped": [
        {"row": "torch.AdamW(fused, float32 masters)", "fits": False},
        {"row": "OffloadAdam, in backward", "fits": True, "step_s": 0.01,
         "peak_device_bytes_per_param": 2.4}],
        "both_fit": {"params": 100, "rows": [{"row": "OffloadAdam", "fits": True,
                                              "step_s": 0.002, "x_device_adamw": 1.3}]},
        "hidden": {"hidden": 0.75, "step_s": 0.01, "forward_backward_s": 0.005,
                   "host_step_s": 0.004, "copies_s": 0.004}}

    def fake(part, scratch, seconds=330, jobs=1):
        if part == "sweep":  # the table a sweep writes, then read by bench-chosen
            table = scratch / "sweep" / "triton_launch.json"
            return [sys.executable, "-c", f"import os; os.makedirs({str(table.parent)!r}); "
                    f"open({str(table)!r}, 'w').write('{{}}')"]
        if part.startswith("tests") or part == "compile":
            code = f"print({PYTEST_OUTPUT!r})" if part == "tests-first" else "print('')"
        elif part == "graph":
            code = f"print('warming up'); print({json.dumps(json.dumps(graph))})"
        elif part == "bench-peers":
            code = "import time; time.sleep(30)"
        elif part in ("bench-muon", "offload"):
            result = muon if part == "bench-muon" else offload
            code = (f"open({str(scratch / (part + '.json'))!r}, 'w').write("
                    f"{json.dumps(json.dumps(result))})")
        else:
            code = (f"open({str(scratch / (part + '.json'))!r}, 'w').write("
                    f"{json.dumps(json.dumps(bench))})")
        return [sys.executable, "-c", code]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(G, "environment", lambda: {"gpu": "a GPU", "torch": "t"})
    monkeypatch.setattr(G, "commands", fake)
    monkeypatch.setattr(G, "PLAN", [(p, 2 if p == "bench-peers" else s, late)
                                    for p, s, late in G.PLAN])
    assert G.main([str(tmp_path), "--budget", "300"]) == 1  # a test failed
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {p["part"]: p["status"] for p in report["parts"]}
    assert status["bench-peers"] == "stopped at its 2 s" and status["graph"] == "done"
    assert report["graph"] == graph
    assert set(report["bench"]) == {"bench-float32", "bench-bfloat16", "bench-muon", "bench-1b",
                                    "offload"}
    # the sweep (330 s) did not fit in what was left, and so the table it chose is not timed
    assert status["sweep"].startswith("skipped") and status["bench-chosen"].startswith("skipped")
    assert report["tests"]["two runs equal bit for bit"] == "passed"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "# GPU check: a GPU" in md and "| scaleopt.LAMB(triton) | 1.00 | 1.20 |" in md
    assert "| scaleopt.Muon | 2.00 | 3.00 | 0.90 | 6.20 |" in md
    assert "| OffloadAdam, in backward | yes | 10.0 | 2.40 |" in md
    assert "| torch.AdamW(fused, float32 masters) | no | - | - |" in md
    assert "copies hidden by the host's work: 75%" in md
    assert "===== tests-first (done) =====" in (tmp_path / "gpu_check.log").read_text()
    assert "gpu_check budget: tests-bits 60 s, tests-first 120 s" in capsys.readouterr().out
    # parts named with their seconds run in the order named; bench-chosen times the sweep's
    # table, and is skipped where the sweep wrote none
    assert G.main([str(tmp_path / "b"), "--parts", "sweep:20,bench-chosen:20,compile:20",
                   "--jobs", "4"]) == 0
    report = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    assert [(p["part"], p["budget"], p["status"]) for p in report["parts"]] == [
        ("sweep", 20, "done"), ("bench-chosen", 20, "done"), ("compile", 20, "done")]
    assert set(report["bench"]) == {"bench-chosen"}
    G.main([str(tmp_path / "c"), "--parts", "bench-chosen"])
    report = json.loads((tmp_path / "c" / "gpu_check.json").read_text())
    assert report["parts"][0]["status"] == "skipped: no table from the sweep"


def test_parts_asked_for_share_the_whole_budget(tmp_path, monkeypatch):
    """``--parts tests-compiled --budget 480`` gives that part the 480 s (a part's own budget
    is for the whole check, where it shares the time with the others), and runs it although it is
    a part run only if time is left; two parts share it in proportion to their own; a budget
    under a part's own gives it what is left, as in the whole check."""
    given = {}

    def run_part(part, seconds, scratch, log, jobs=1):
        given[part] = seconds
        return {"part": part, "status": "done", "seconds": 0.0, "output": ""}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(G, "environment", lambda: {"gpu": "a GPU", "torch": "t"})
    monkeypatch.setattr(G, "run_part", run_part)
    own = dict((p, s) for p, s, _ in G.PLAN)
    assert G.main([str(tmp_path / "a"), "--parts", "tests-compiled", "--budget", "480"]) == 0
    assert given == {"tests-compiled": pytest.approx(480, abs=1)}
    given.clear()
    G.main([str(tmp_path / "b"), "--parts", "tests-bits,tests-first", "--budget", "360"])
    assert given == {"tests-bits": 2 * own["tests-bits"],
                     "tests-first": pytest.approx(2 * own["tests-first"], abs=1)}
    given.clear()
    G.main([str(tmp_path / "c"), "--parts", "tests-rest", "--budget", "30"])
    assert given == {"tests-rest": pytest.approx(30, abs=1)}  # what is left, as for every part


def test_a_part_stopped_at_its_limit_stops_every_process_it_started(tmp_path, monkeypatch):
    """A part whose command started processes of its own (pytest-xdist's workers, the sweep's
    compiling processes) and overran: none of them runs on beside the next part, and the
    check does not wait for them."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); "
            "time.sleep(120)")
    monkeypatch.setattr(G, "commands", lambda *a, **k: [sys.executable, "-c", code])
    with open(tmp_path / "log", "w") as log:
        done = G.run_part("tests-bits", 3, tmp_path, log)
    assert done["status"] == "stopped at its 3 s" and "started" in done["output"]
    child = int(pid_file.read_text())
    for _ in range(100):  # killed at once; reaped by init in its own time
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the part's child process still runs")


def test_the_offload_part_runs_every_row_in_a_dry_run_and_is_summarised():
    """``tools/gpu_offload.py --dry-run``: every row of the offload part (the offloaded
    optimizers, ordinary and in backward, and the copies' share) on tiny CPU models; the
    summary gives each row."""
    sys.path.insert(0, str(TOOLS))
    try:
        import gpu_offload
    finally:
        sys.path.remove(str(TOOLS))
    report = gpu_offload.run("cpu", dry=True, rounds=1)
    rows = [r["row"] for r in report["capped"]][:7]  # (then the peers that are installed)
    assert rows == ["torch.AdamW(fused, float32 masters)", "OffloadAdam",
                    "OffloadAdam, in backward", "offload(LAMB, int8)",
                    "offload(LAMB, int8), in backward", "offload(Muon, int8)",
                    "offload(Muon, int8), in backward"]
    assert all(r["fits"] and r["step_s"] > 0 for r in report["capped"])
    assert 0.0 <= report["hidden"]["hidden"] <= 1.0
    for r in report["capped"]:
        r["peak_device_bytes_per_param"] = 2.5  # what a GPU run adds
    md = G.offload_table(dict(report, cap_bytes=7 * report["params"]))
    assert all(any(line.startswith(f"| {row} | yes |") for line in md) for row in rows)
    assert any("copies hidden by the host's work" in line for line in md)
    assert "offload" in [p for p, _, _ in G.PLAN]
