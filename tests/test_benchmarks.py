"""The scripts in benchmarks/ run (on tiny sizes) and print what their docs promise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

#: the benchmark scripts run whole: the slow run (pytest -m slow)
pytestmark = pytest.mark.slow

#: Muon's default iteration multiplies bfloat16 matrices; torch does that with oneDNN where the
#: CPU has AVX-512 (``_is_mkldnn_bf16_supported``), and otherwise in scalar loops, about 80
#: times slower than float32 (a 1024 x 1024 product 2.3 s against 0.027 s on one core of an AVX2
#: EPYC): one step of 24 such matrices then takes over ten minutes, the measurement six steps
needs_bf16_products = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="Muon's bfloat16 iteration on 25.2M parameters: this CPU multiplies bfloat16 "
           "matrices without a vectorized kernel (no AVX-512), over an hour a measurement")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=900, cwd=tempfile.mkdtemp())
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_sizes_gives_a_row_per_size():
    out = run("bench_sizes.py", "--sizes", "1000", "5000", "--total", "10000", "--rounds", "2",
              "--threads", "1")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1,000", "5,000"]
    assert [r[1] for r in rows] == ["10", "2"]
    # times and ratios are numbers; how large depends on the machine, so only their form is held
    for r in rows:
        assert float(r[2]) >= 0 and all(float(x) > 0 for x in r[3:]), r


def test_bench_dgc_select_finds_the_same_indices_as_topk():
    out = run("bench_dgc_select.py", "--numel", "100000", "--rounds", "1", "--threads", "1")
    assert "same indices: True" in out and "scaleopt.dgc.topk_sampled" in out


def test_bench_state_gives_each_optimizers_state_bytes_time_and_accuracy():
    out = run("bench_state.py", "--hidden", "64", "--layers", "1", "--vocab", "1000",
              "--rounds", "2", "--steps", "300", "--threads", "1")
    rows = {line[:40].strip(): line[40:].split() for line in out.splitlines()
            if line.startswith(("torch.", "scaleopt.", "torchao.", "bitsandbytes."))}
    assert {"torch.AdamW(fused=True)", "scaleopt.AdamW(state_dtype=int8)",
            "scaleopt.LAMB(state_dtype=int8)"} <= set(rows)
    state = {name: float(r[0]) for name, r in rows.items()}
    assert state["torch.AdamW(fused=True)"] == pytest.approx(8.0, abs=0.01)  # + step counters
    assert state["scaleopt.AdamW(state_dtype=bfloat16)"] < 4.5
    assert state["scaleopt.AdamW(state_dtype=int8)"] < 3.0  # 64-wide biases keep float32
    accuracy = {name: float(r[3]) for name, r in rows.items()}  # a short run of spirals
    assert all(0.5 < a <= 1.0 for a in accuracy.values()), accuracy
    for form in ("bfloat16", "int8"):  # compact state trains as float32 state does
        assert accuracy[f"scaleopt.AdamW(state_dtype={form})"] == pytest.approx(
            accuracy["torch.AdamW(fused=True)"], abs=0.01)


def test_bench_lanes_times_both_loops_of_each_optimizer():
    out = run("bench_lanes.py", "--hidden", "64", "--layers", "1", "--vocab", "1000",
              "--rounds", "2", "--threads", "1", "--optimizers", "LAMB", "AdamW")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("LAMB ", "AdamW "))}
    assert set(rows) == {"LAMB", "AdamW"}
    for r in rows.values():  # three steps and two ratios, all positive numbers
        assert len(r) == 5 and all(float(x) > 0 for x in r), r


def test_bench_builds_finds_a_build_and_its_copy_give_the_same_bits_and_times_both(tmp_path):
    """Two builds of the C kernels in one process: a copy of this checkout's build against it,
    each case bit for bit, then a time per build and their paired ratio."""
    from scaleopt import _kernels, _native

    if not _native.available():
        pytest.skip("the C kernels are not built")
    copy = tmp_path / "copy.so"
    copy.write_bytes(open(_kernels.__file__, "rb").read())
    out = run("bench_builds.py", str(copy), "--bits", "--hidden", "64", "--layers", "1",
              "--vocab", "1000", "--rounds", "2", "--threads", "1", "--cases", "LAMB", "LANS")
    bits = [line for line in out.splitlines() if line.endswith("bits")]
    assert len(bits) == 8 and all(line.endswith("same bits") for line in bits), out
    times = [line.split() for line in out.splitlines() if line.startswith("LAMB ")
             and not line.endswith("bits")]
    assert len(times) == 4 and all(float(x) > 0 for row in times for x in row[-3:]), out


@pytest.mark.parametrize("script", ["bench_step.py", "bench_offload.py", "bench_fsdp.py",
                                    "bench_muon.py", "bench_memory.py",
                                    "bench_in_backward.py", "bench_in_backward_dist.py",
                                    "bench_links_accuracy.py"])
def test_bench_scripts_answer_help(script):
    assert "usage" in run(script, "--help")


def test_scaleopt_bench_world_times_every_optimizer_on_fsdp2_shards(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from scaleopt.cli import console; sys.argv[0] = "
         "'scaleopt'; console()", "bench", "--world", "2", "--rounds", "1", "--hidden", "64",
         "--layers", "1", "--vocab", "1000", "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {line[:40].strip(): line[40:].split() for line in out.stdout.splitlines()[2:]
            if line.strip()}
    assert set(rows) >= {"torch.AdamW(fused=True), local shards", "scaleopt.LAMB", "scaleopt.LANS"}
    assert rows["torch.AdamW(fused=True), local shards"][2] == "0"  # local: no collective
    assert int(rows["scaleopt.LAMB"][2]) == 1 and int(rows["scaleopt.LANS"][2]) == 2
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["world"] == 2 and result["rows"]["scaleopt.LAMB"]["collectives"] == 1
    plot = tmp_path / "scaleopt-runs" / "bench-custom-world2" / "bench.png"
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bench_in_backward_dist_times_each_row_and_counts_its_collectives():
    """2 ranks, 3 blocks of 32: on FSDP2 LAMB in backward makes one all-reduce per module (the
    ordinary step one in all), LANS two; under DDP the steps in backward add no collective."""
    out = run("bench_in_backward_dist.py", "--rounds", "1", "--layers", "3", "--width", "32",
              "--batch", "4")
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[2:] if line.strip()]
    assert len(cells) == 15, out
    for row, ms, *_ in cells:
        assert float(ms) > 0, row
    counts = {row: dict(kv.rsplit(" ", 1) for kv in cell[-1].split(", "))
              for row, *cell in cells}
    assert counts["FSDP2, LAMB, ordinary"]["allreduce"] == "1"
    assert counts["FSDP2, LAMB, in backward, a module a piece"]["allreduce"] == "3"
    assert counts["FSDP2, LANS, in backward, a module a piece"]["allreduce"] == "6"
    for name in ("LAMB", "LANS", "AdamW"):
        assert counts[f"DDP, {name}, in backward"] == counts[f"DDP, {name}, ordinary"]


def test_bench_soak_reports_each_optimizers_steady_state_in_one_process_and_sharded(tmp_path):
    out = run("bench_soak.py", "--only", "AdamW", "--steps", "40", "--warm", "10", "--world", "2",
              "--json", str(tmp_path / "soak.json"))
    report = json.loads((tmp_path / "soak.json").read_text())
    want = {"AdamW", "AdamW int8 state", "torch.optim.AdamW (baseline)"}
    assert set(report["one_process"]) == want and set(report["sharded"]) == want
    for row in [*report["one_process"].values(), *report["sharded"].values()]:
        assert row["tensors_end"] == row["tensors_start"] > 0 and row["rss_end"] > 0
        assert row["ms_start"] > 0 and row["ms_end"] > 0
    assert "one process" in out and "FSDP2, 2 ranks" in out and "of 6 steady" in out


def test_polar_factors_gives_each_iteration_on_each_matrix_and_polar_express_is_nearer():
    out = run("polar_factors.py")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and ("quintic" in line or "polar_express" in line)]
    assert len(rows) == 4 * 2 * 2  # matrices x iterations x dtypes
    distance = {(r[0], r[2], r[3]): float(r[6]) for r in rows}
    for (matrix, method, dtype), d in distance.items():
        if method == "polar_express":
            assert d < distance[matrix, "quintic", dtype], (matrix, dtype)


def test_muon_share_gives_each_optimizers_share_of_a_training_step():
    out = run("muon_share.py", "--batch", "1", "--seq", "16", "--rounds", "1", "--threads", "1")
    shares = {line.split()[0]: float(line.split("ms:")[1].split("%")[0]) for line in
              out.splitlines() if "% of a training step" in line}
    assert set(shares) == {"torch.AdamW(fused=True)", "scaleopt.Muon"}
    assert all(0 < s < 100 for s in shares.values()), shares


def test_the_memory_method_reads_a_float32_model_alone_as_4_bytes_per_parameter():
    """The check of ``scaleopt bench --memory``'s measure (the process's resident set with the
    mmap threshold fixed, docs/memory.md): 25.2M float32 parameters read as 4.00 bytes each,
    their gradients as 4.00 more."""
    from scaleopt.cli import bench_memory

    r = bench_memory.run_one("model alone (float32)", "matrices", "cpu", 1)
    assert 3.98 <= r["weights"] / r["params"] <= 4.02, r
    assert 3.98 <= r["grads"] / r["params"] <= 4.12, r


def _measured(names):
    """``scaleopt bench --memory``'s rows of ``names`` on the ``matrices`` model, by name."""
    from scaleopt.cli import bench_memory

    return {r["name"]: r for r in bench_memory.rows(
        [bench_memory.run_one(n, "matrices", "cpu", 1) for n in names])}


@pytest.mark.slow
@needs_bf16_products
def test_measured_muon_steps_peak_within_their_bounds():
    """Muon's step peaks at most 0.5 bytes per parameter above what it holds plus the
    gradients, below fused AdamW's peak."""
    names = ["model alone (float32)", "torch.AdamW(fused=True)", "scaleopt.Muon",
             "scaleopt.Muon(state_dtype=int8)"]
    rows = _measured(names)
    adamw = rows["torch.AdamW(fused=True)"]["peak"]
    for name in names[2:]:
        r = rows[name]
        assert r["peak"] <= r["held"] + r["grads"] + 0.5 and r["peak"] < adamw, r


@pytest.mark.slow
def test_measured_in_backward_steps_peak_within_what_they_hold():
    """LAMB in backward (bfloat16, split masters, int8 state) peaks at most 0.5 bytes per
    parameter above what it holds, and holds no gradients."""
    names = ["model alone (float32)",
             "scaleopt.LAMB(master_weights, state_dtype=int8), bf16 params, in backward"]
    rows = _measured(names)
    r = rows[names[-1]]
    assert r["peak"] <= r["held"] + 0.5 and r["grads"] < 0.1, r


@pytest.mark.slow
@needs_bf16_products
def test_scaleopt_bench_memory_writes_its_table_and_json(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from scaleopt.cli import console; sys.argv[0] = "
         "'scaleopt'; console()", "bench", "--memory", "--threads", "1", "--only",
         "scaleopt.Muon(state_dtype=int8), in backward", "--json", str(tmp_path / "m.json")],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "bytes per parameter (25,190,400 parameters, model matrices" in out.stdout
    report = json.loads((tmp_path / "m.json").read_text())
    names = [r["name"] for r in report["rows"]]
    assert names == ["model alone (float32)", "model alone (bfloat16)",
                     "scaleopt.Muon(state_dtype=int8), in backward"]
    row = report["rows"][-1]
    assert row["grads"] < 0.1 and row["peak"] <= row["held"] + 0.5  # no gradients held at once
    assert (tmp_path / "scaleopt-runs" / "bench-memory-matrices" / "memory.json").exists()
