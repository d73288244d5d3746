"""The `scaleopt` command: each subcommand on a tiny configuration, its outputs and its errors."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleopt.cli import EXIT_DIVERGED, EXIT_USAGE, main

TINY = ["--train-size", "2048", "--batch-size", "256", "--width", "32", "--no-progress"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_train_writes_results_history_and_a_plot(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--epochs", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 3 * 2048 // 256
    assert result["config"]["optimizer"] == "lamb" and result["lr"] == 1e-2
    assert 0.0 <= result["test_accuracy"] <= 1.0 and math.isfinite(result["test_loss"])
    assert f"test accuracy {result['test_accuracy']:.4f}" in printed
    assert "steps/s" in printed and "samples/s" in printed
    rows = list(csv.DictReader((out / "history.csv").open()))
    assert rows and int(rows[-1]["step"]) == result["steps"]
    assert float(rows[-1]["test_accuracy"]) == pytest.approx(result["test_accuracy"])
    # the learning rate warmed up and decayed to 0 (cosine)
    assert float(rows[-1]["lr"]) == pytest.approx(0.0, abs=1e-9)
    assert (out / "curves.png").read_bytes().startswith(PNG)


def test_the_default_run_learns_the_task(tmp_path):
    # the README's main job, shortened: LAMB on the default data gets well above chance (0.2)
    out = tmp_path / "run"
    assert main(["train", "--epochs", "2", "--no-progress", "--out", str(out)]) == 0
    assert json.loads((out / "result.json").read_text())["test_accuracy"] > 0.9


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_topics_data_is_learned_by_the_bag_of_words_model(tmp_path):
    from scaleopt.cli import data

    x, y, xt, yt, classes = data.load("topics", 4096, test_size=1024)
    assert x.shape == (4096, 32) and x.dtype == torch.int64 and classes == 5
    assert 0 <= int(x.min()) and int(x.max()) < data.TOPICS["vocab"]
    assert torch.equal(xt, data.load("topics", 4096, test_size=1024)[2])  # generated, repeatable
    out = tmp_path / "run"
    assert main(["train", "--dataset", "topics", "--width", "32", "--train-size", "65536",
                 "--epochs", "4", "--batch-size", "512", "--optimizer", "momentum",
                 "--no-progress", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    # nearly all of the model is the embedding table; 0.89 is the best possible accuracy
    assert result["parameters"] == 32768 * 32 + 32 * 5 + 5
    assert result["test_accuracy"] > 0.8


@pytest.mark.parametrize("optimizer, extra", [
    ("lans", []), ("adamw", ["--offload"]), ("lamb", ["--offload"]), ("offload-adam", []),
    ("momentum", []), ("torch-adamw", []), ("torch-sgd", ["--schedule", "linear"]),
    ("muon", []), ("muon", ["--state-dtype", "int8"]),
    ("adamw", ["--schedule", "constant", "--warmup", "0"]),
])
def test_every_optimizer_trains(tmp_path, optimizer, extra):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "40", "--optimizer", optimizer, *extra,
                 "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    first = result["train_curve"][0][1]
    assert result["steps"] == 40 and result["train_loss"] < first


def test_two_workers_compute_what_one_process_computes(tmp_path):
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        assert main(["train", *TINY, "--steps", "12", "--workers", str(workers), "--threads", "1",
                     "--out", str(out)]) == 0
        runs[workers] = json.loads((out / "result.json").read_text())
    assert runs[2]["workers"] == 2
    assert runs[2]["allreduce_bytes_per_step"] == 4 * runs[2]["parameters"]
    assert runs[2]["test_loss"] == pytest.approx(runs[1]["test_loss"], rel=1e-4)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_muon_on_two_sharded_workers_computes_what_one_process_computes(tmp_path):
    """Each hidden matrix orthogonalized whole by one rank: the same run as one process (the
    gradients, averaged over the ranks, differ in their last bits)."""
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        extra = ["--shard"] if workers > 1 else []
        assert main(["train", *TINY, "--steps", "12", "--optimizer", "muon", "--workers",
                     str(workers), "--threads", "1", *extra, "--out", str(out)]) == 0
        runs[workers] = json.loads((out / "result.json").read_text())
    assert runs[2]["test_loss"] == pytest.approx(runs[1]["test_loss"], rel=1e-3)


@pytest.mark.slow
def test_bench_muon_times_muon_against_torch_muon_and_sharded_against_one_process(tmp_path):
    small = ["--hidden", "32", "--layers", "1", "--vocab", "500", "--rounds", "2"]
    out = tmp_path / "one.json"
    assert main(["bench", "--muon", *small, "--json", str(out), "--out", str(tmp_path / "a")]) == 0
    rows = {r["optimizer"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["torch.optim.Muon + torch.AdamW(fused)"]["ratio_to_torch_muon"] == 1.0
    assert rows["scaleopt.Muon"]["ratio_to_torch_muon"] > 0
    # int8 momentum and moments: a byte per element and the scales, against 4 per moment
    assert (rows["scaleopt.Muon(state_dtype=int8)"]["state_bytes_per_param"]
            < rows["scaleopt.Muon"]["state_bytes_per_param"] / 2.5)
    out = tmp_path / "two.json"
    assert main(["bench", "--muon", "--world", "2", *small, "--json", str(out),
                 "--out", str(tmp_path / "b")]) == 0
    result = json.loads(out.read_text())
    assert result["rows"]["scaleopt.Muon"]["collectives"] == 2  # one exchange each way
    assert result["one_process_threads"] == 2 and result["sharded_over_one_process"] > 0
    assert 0 < result["exchange_share"] < 1
    # the exchange in runs: two collectives per run, and a share of its wait hidden (any)
    assert result["rows"]["scaleopt.Muon(exchange_buckets=4)"]["collectives"] > 2
    assert result["exchange_hidden"] < 1 and result["buckets_step_ratio"] > 0
    out = tmp_path / "hsdp.json"
    assert main(["bench", "--muon", "--world", "4", "--replicas", "2", *small, "--json", str(out),
                 "--out", str(tmp_path / "c")]) == 0
    result = json.loads(out.read_text())
    assert result["replicas"] == 2
    assert result["rows"]["scaleopt.Muon"]["collectives"] == 3  # and the replicas' all-gather
    assert result["rows"]["scaleopt.Muon, every replica iterating"]["collectives"] == 2
    assert result["iteration_ratio"] > 0 and result["step_ratio_to_every_replica"] > 0
    # owners by measured pace: the same exchange, and at the third step (the last of a warm-up
    # round and 2 rounds) the two all-gathers that share the paces
    assert result["rows"]["scaleopt.Muon(exchange_balance=measured)"]["collectives"] == 3 + 2
    assert result["balance_step_ratio"] > 0


def test_the_bench_splits_a_wait_into_waiting_for_ranks_and_waiting_for_bytes():
    """A rank's wait on a collective is the other ranks' lateness until the last has issued it,
    then the transfer; one group's collectives are matched by their order on each rank."""
    from scaleopt.cli.bench_fsdp import issued, split_waits

    pair, alone = (0, 1), (0,)
    # rank 0: a blocking all-reduce from 1.0 to 3.0 (rank 1 issued it at 2.5); an asynchronous
    # all-to-all issued at 4.0 and waited on from 6.0 to 6.25 (rank 1 issued at 4.5: all bytes);
    # another collective in a group of its own (no one to wait for); a wait over before the
    # last rank's issue time (clocks a little apart) counts as waiting for ranks, never negative
    calls = [[pair, 1.0, 1.0, 3.0], [pair, 4.0, 6.0, 6.25], [alone, 7.0, 7.0, 7.5],
             [pair, 8.0, 8.0, 8.5]]
    other = [((pair, 0), 2.5), ((pair, 1), 4.5), ((pair, 2), 9.0)]
    peers, transfer = split_waits(calls, [issued(calls), other])
    assert peers == pytest.approx(1.5 + 0.0 + 0.0 + 0.5)
    assert transfer == pytest.approx(0.5 + 0.25 + 0.5 + 0.0)


def test_study_large_batch_on_the_mlp_writes_a_table_and_a_plot(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["study", "large-batch", *[a for a in TINY if a not in ("--batch-size", "256")],
                 "--batch-sizes", "128", "512", "--optimizers", "lamb", "adamw", "--epochs", "1",
                 "--grid", "1", "--extensions", "0", "--seeds", "1", "--jobs", "1",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "study.json").read_text())["rows"]
    assert {(r["optimizer"], r["batch_size"]) for r in rows} == {
        ("lamb", 128), ("lamb", 512), ("adamw", 128), ("adamw", 512)}
    lamb = {r["batch_size"]: r for r in rows if r["optimizer"] == "lamb"}
    assert lamb[128]["lr"] == pytest.approx(1e-2 * (128 / 1024) ** 0.5)  # sqrt from the default
    assert lamb[512]["lr"] == pytest.approx(lamb[128]["lr"] * 2)  # and from batch 128's choice
    assert lamb[128]["steps"] == 4 * lamb[512]["steps"]  # same epochs
    assert all(math.isfinite(r["dev_loss"]) and math.isfinite(r["test_accuracy"]) for r in rows)
    table = (out / "study.md").read_text()
    assert "| 128 |" in table and "| 512 |" in table and "One seed per cell" in table
    assert (out / "study.png").read_bytes().startswith(PNG)
    assert "| 512 |" in capsys.readouterr().out


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_bench_times_the_optimizers(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--hidden", "32", "--layers", "1", "--vocab", "500", "--rounds", "2",
                 "--only", "LAMB", "OffloadAdam", "--json", str(out),
                 "--out", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    assert json.loads((tmp_path / "run" / "bench.json").read_text()) == result
    assert result["memory_estimate_bytes"] > 0
    rows = {r["optimizer"]: r for r in result["rows"]}
    names = list(rows)
    assert names[0] == "torch.AdamW(fused=True)" and result["rows"][0]["ratio"] == 1.0
    assert "scaleopt.LAMB" in names and "scaleopt.OffloadAdam" in names
    assert all(r["median_s"] > 0 for r in result["rows"])
    # each bf16 row is set against its float32 row, round by round
    bf16 = rows["scaleopt.LAMB(bf16 params, master_weights)"]
    assert bf16["fp32_row"] == "scaleopt.LAMB" and bf16["ratio_to_fp32"] > 0
    assert rows["scaleopt.OffloadAdam(bf16 params)"]["fp32_row"] == "scaleopt.OffloadAdam"
    assert "ratio_to_fp32" not in rows["scaleopt.LAMB"]
    # bytes per parameter held between steps: a float32 weight and gradient (8) or bfloat16 (4);
    # two float32 moments (8, and the per-tensor step counters), and a bfloat16 row's split
    # master its low 16 bits (2)
    steps = result["tensors"] * 8 / result["params"]  # at most 8 bytes of step per tensor
    for name, model, state in [("torch.AdamW(fused=True)", 8, 8), ("scaleopt.LAMB", 8, 8),
                               ("scaleopt.LAMB(bf16 params, master_weights)", 4, 10),
                               ("scaleopt.OffloadAdam(bf16 params)", 4, 10)]:
        assert rows[name]["model_bytes_per_param"] == model, name
        assert state <= rows[name]["state_bytes_per_param"] <= state + steps, name
    assert (tmp_path / "run" / "bench.png").read_bytes().startswith(PNG)
    printed = capsys.readouterr().out
    assert "x fused AdamW" in printed and "x fp32 row" in printed and "in-place p += g" in printed
    assert "state B/param" in printed and "bench.png" in printed
    # a second benchmark into the same folder is refused, not written over the first
    assert main(["bench", "--hidden", "32", "--layers", "1", "--vocab", "500", "--rounds", "1",
                 "--out", str(tmp_path / "run")]) == EXIT_USAGE
    assert "holds an earlier run" in capsys.readouterr().err


@pytest.mark.parametrize("optimizer, layout", [
    ("adamw", []), pytest.param("muon", [], marks=pytest.mark.slow),
    pytest.param("lans", ["--shard", "--replicas", "2"], marks=pytest.mark.slow)])
def test_dgc_feeds_an_adaptive_optimizer_through_the_hook_and_reports_its_traffic(
        optimizer, layout, tmp_path):
    """``--dgc`` with another optimizer than momentum: DDP with the DGC hook at momentum 0
    (top-k with error feedback), or with ``--shard --replicas 2`` ReplicaCompression between
    the replicas, and the optimizer itself; the run trains, sends a fraction of the dense
    bytes, and stopped and resumed from its checkpoint it is the same run."""
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", "--workers", "2", "--threads", "1", *layout,
                 "--optimizer", optimizer, "--dgc", "--dgc-sparsity", "0.99",
                 "--dgc-min-numel", "1000", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    tel = result["dgc_final_telemetry"]
    assert result["workers"] == 2 and result["config"]["optimizer"] == optimizer
    assert 0 < tel["density"] < 0.5 and tel["bytes_sent"] < tel["dense_bytes"] / 2
    assert result["history"][-1]["test_loss"] < result["history"][0]["test_loss"]
    # stopped after step 4 with a checkpoint (each rank's hook residuals in its own file) and
    # resumed: the run of the whole
    run = tmp_path / "stopped"
    assert main(["train", *TINY, "--steps", "8", "--workers", "2", "--threads", "1", *layout,
                 "--optimizer", optimizer, "--dgc", "--dgc-sparsity", "0.99",
                 "--dgc-min-numel", "1000", "--checkpoint-every", "2", "--stop-after", "4",
                 "--out", str(run)]) == 0
    names = {f.name for f in (run / "checkpoints" / "step-00000004").iterdir()}
    assert {"dgc-hook-rank0.pt", "dgc-hook-rank1.pt"} <= names
    assert main(["train", "--resume", str(run)]) == 0
    assert _curve(json.loads((run / "result.json").read_text())) == _curve(result)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_powersgd_trains_through_torchs_hook(tmp_path, capsys):
    """``--powersgd 1``: DDP's all-reduce replaced by torch's PowerSGD hook; the run trains,
    and differs from the dense run (the hook ran) while starting from the same point."""
    runs = {}
    for name, extra in (("dense", []), ("powersgd", ["--powersgd", "1"])):
        assert main(["train", *TINY, "--steps", "8", "--workers", "2", "--threads", "1",
                     "--optimizer", "momentum", *extra, "--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "result.json").read_text())
    low, dense = runs["powersgd"]["history"], runs["dense"]["history"]
    assert low[-1]["test_loss"] < low[0]["test_loss"]
    assert low[-1]["test_loss"] != dense[-1]["test_loss"]
    assert runs["powersgd"]["config"]["powersgd"] == 1
    assert "PowerSGD rank 1, 2 workers" in capsys.readouterr().out


def test_dgc_on_two_workers_reports_its_traffic(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", "--workers", "2", "--threads", "1",
                 "--optimizer", "momentum", "--dgc", "--dgc-sparsity", "0.9", "0.99",
                 "--dgc-rampup-steps", "4", "--dgc-min-numel", "1000", "--dgc-value-dtype",
                 "float16", "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    tel = result["dgc_final_telemetry"]
    # the sparsity warmed up from 0.9 to 0.99: the last step is sparser than the average
    assert result["workers"] == 2 and 0 < tel["density"] < result["dgc_density"] < 1
    assert tel["bytes_sent"] < tel["dense_bytes"] / 2
    # this rank's message: float16 values + int32 indices for the tensors of >= 1000 elements,
    # the float32 values of the others; against the float32 gradient
    from scaleopt.cli.models import mlp as make_model
    from scaleopt.dgc.select import k_of

    numels = [p.numel() for p in make_model(2, 5, 32).parameters()]
    ks = [k_of(n, 0.99) for n in numels if n >= 1000]
    assert tel["payload_bytes"] == 6 * sum(ks) + 4 * sum(n for n in numels if n < 1000)
    assert tel["dense_payload_bytes"] == 4 * sum(numels) == 4 * result["parameters"]
    assert result["dgc_payload_bytes_per_rank_per_step"] > tel["payload_bytes"]
    printed = capsys.readouterr().out
    assert "DGC between 2 workers" in printed and "payload" in printed


HSDP_DGC = ["train", *TINY, "--steps", "12", "--threads", "1", "--optimizer", "momentum",
            "--workers", "4", "--shard", "--replicas", "2", "--dgc", "--dgc-sparsity", "0.9",
            "0.99", "--dgc-rampup-steps", "4", "--dgc-min-numel", "100"]


@pytest.fixture(scope="module")
def hsdp_whole(tmp_path_factory):
    """An uninterrupted run of HSDP_DGC on 4 workers started here: its result."""
    out = tmp_path_factory.mktemp("hsdp") / "whole"
    assert main([*HSDP_DGC, "--out", str(out)]) == 0
    return json.loads((out / "result.json").read_text())


def _curve(result):
    return [{k: v for k, v in h.items() if k != "time_s"} for h in result["history"]]


@pytest.mark.slow
def test_dgc_between_hsdp_replicas_trains_resumes_bit_for_bit_and_reports_its_traffic(
        tmp_path, hsdp_whole):
    whole = hsdp_whole
    assert whole["config"]["replicas"] == 2 and whole["workers"] == 4
    assert whole["dgc_between"] == "2 replicas of 2 shards"
    # the bytes counted from the buffers sent, far below a dense all-reduce of the same shards
    sent = whole["dgc_bytes_sent_measured_per_rank_per_step"]
    assert 0 < sent < whole["dense_bytes_sent_per_rank_per_step"] / 2
    # stopped after step 6 with a checkpoint (each rank's residuals in its own file) and resumed
    run = tmp_path / "run"
    assert main([*HSDP_DGC, "--checkpoint-every", "3", "--stop-after", "6", "--out", str(run)]) == 0
    names = {f.name for f in (run / "checkpoints" / "step-00000006").iterdir()}
    assert {f"optimizer-rank{r}.pt" for r in range(4)} <= names
    assert main(["train", "--resume", str(run)]) == 0
    assert _curve(json.loads((run / "result.json").read_text())) == _curve(whole)


@pytest.mark.parametrize("argv, message", [
    (["train", "--dgc"], "--workers 2 or more"),
    (["train", "--dgc", "--shard", "--workers", "4"], "give --replicas 2 or more"),
    (["train", "--powersgd", "4"], "--workers 2 or more"),
    (["train", "--powersgd", "4", "--workers", "2", "--dgc"], "without --shard, --dgc"),
    (["train", "--powersgd", "4", "--workers", "2", "--checkpoint-every", "2"],
     "not checkpointed"),
    (["train", "--optimizer", "momentum", "--dgc", "--dgc-sparsity", "1.0", "--workers", "2"],
     "--dgc-sparsity"),
    (["train", "--optimizer", "momentum", "--dgc"], "--workers 2 or more"),
    (["train", "--replicas", "2", "--workers", "4"], "use it with --shard"),
    (["train", "--shard", "--workers", "4", "--replicas", "3"], "must divide the 4 workers"),
    (["train", "--batch-size", "4096", "--train-size", "1024"], "larger than the training set"),
    (["train", "--optimizer", "torch-sgd", "--offload"], "--offload applies"),
    (["train", "--optimizer", "momentum", "--state-dtype", "int8"], "--state-dtype int8 applies"),
    (["train", "--lr", "-1"], "--lr must be a positive"),
    (["train", "--weight-decay", "-0.1"], "--weight-decay"),
    (["train", "--batch-size", "1000", "--workers", "3"], "multiple of --workers"),
    (["train", "--device", "tpu"], "--device"),
    (["study", "large-batch", "--optimizers", "lamb", "sgd9"], "unknown optimizer"),
    (["study", "large-batch", "--grid", "1", "-2"], "--grid factors must be positive"),
    (["study", "large-batch", "--jobs", "2", "--workers", "2"], "use it without --workers"),
    (["train", "--max-grad-norm", "0"], "--max-grad-norm must be a positive"),
    (["train", "--optimizer", "momentum", "--betas", "0.9", "0.95"], "--betas applies"),
    (["train", "--betas", "0.9", "1.5"], "--betas takes two numbers in [0, 1)"),
    (["bench", "--rounds", "0"], "--rounds"),
    (["bench", "--link", "100mbit,x"], "RATE[,DELAY_MS]"),
    (["bench", "--link", "fast"], "rate 'fast'"),
    (["bench", "--link", "1gbit", "--world", "3", "--per-node", "2"], "multiple of the ranks"),
    (["bench", "--replicas", "2", "--world", "4"], "--replicas 2: HSDP for --muon"),
    (["bench", "--muon", "--replicas", "2", "--world", "3"], "a multiple of the replicas"),
    (["bench", "--only", "LAMB", "Lamb2000"], "--only Lamb2000: no optimizer's name contains it"),
    # far more than any machine has: refused before anything is allocated
    (["bench", "--hidden", "65536", "--layers", "64"], "choose a smaller --size"),
])
def test_bad_values_are_clear_errors_with_exit_code_2(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["train", "--optimizer", "nope"], ["train", "--batch-size", "0"], ["train", "--epochs", "x"],
    ["study"], ["frobnicate"], [],
])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage: scaleopt" in capsys.readouterr().err


def test_state_dtype_stores_the_moments_in_fewer_bytes_and_says_how_many(tmp_path, capsys):
    per_param = {}
    for form in ("float32", "int8"):
        out = tmp_path / form
        assert main(["train", *TINY, "--width", "128", "--steps", "4", "--optimizer", "adamw",
                     "--state-dtype", form, "--out", str(out)]) == 0
        r = json.loads((out / "result.json").read_text())
        assert r["config"]["state_dtype"] == form
        per_param[form] = r["unsharded_optimizer_state_bytes"] / r["parameters"]
        assert f"bytes per parameter, state_dtype {form}" in capsys.readouterr().out
    assert per_param["float32"] == pytest.approx(8.0, abs=0.01)  # and the step counters
    assert per_param["int8"] < 0.5 * per_param["float32"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_divergence_exits_3(tmp_path, capsys, workers):
    """In one process, and in workers: a worker's divergence reaches the command by the record
    it writes (its error's class), not by the restarts meant for a worker that died."""
    assert main(["train", *TINY, "--lr", "1e6", "--steps", "30", "--workers", workers,
                 "--out", str(tmp_path)]) == EXIT_DIVERGED
    err = capsys.readouterr().err
    assert "training diverged: the training loss is" in err and "lower --lr" in err
    assert "restart" not in err


def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_help_explains_every_option(capsys):
    from scaleopt.cli import build_parser

    subs = list(_subparsers(build_parser()))
    assert {s.prog for s in subs} >= {"scaleopt train", "scaleopt study large-batch", "scaleopt bench"}
    for sub in subs:
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (sub.prog, action.option_strings)
    for argv in (["train", "--help"], ["study", "large-batch", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert "default" in text and "``" not in text  # no raw reStructuredText
    train = next(s for s in subs if s.prog == "scaleopt train")
    groups = {a.dest: g.title for g in train._action_groups for a in g._group_actions}
    assert groups["out"] == groups["no_progress"] == groups["overwrite"] == "output"


def test_the_console_script_is_installed():
    """``scaleopt`` is installed beside the interpreter that runs the suite (found there, not
    on PATH, so that a venv that is not activated is tested as it is)."""
    exe = Path(sys.executable).with_name("scaleopt")
    assert exe.exists(), f"no console script at {exe}"
    done = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "train" in done.stdout and "bench" in done.stdout


@pytest.mark.slow
def test_a_torchrun_launch_trains_as_one_job(tmp_path):
    """``torchrun`` (as ``python -m torch.distributed.run``, torchrun's own module, so that a
    venv that is not activated runs it too) starts two ranks that train as one job."""
    from scaleopt.cli.launch import free_port

    port = free_port()
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "scaleopt", "train", *TINY, "--steps", "6", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["workers"] == 2 and result["steps"] == 6


def test_without_the_cli_extra_the_command_trains_without_bar_and_plots(tmp_path, capsys,
                                                                       monkeypatch):
    """`pip install scaleopt` brings only torch: without matplotlib and tqdm (the `cli` extra)
    the command still trains and writes its tables, and says how to get the plots."""
    for name in ("matplotlib", "matplotlib.pyplot", "tqdm"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with_bar = [a for a in TINY if a != "--no-progress"]
    assert main(["train", *with_bar, "--steps", "4", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.csv", "result.json"]
    assert "pip install 'scaleopt[cli]'" in capsys.readouterr().out


def test_output_folders_are_checked_before_training_and_never_overwritten(tmp_path, capsys,
                                                                         monkeypatch):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    assert main(["train", *TINY, "--out", str(afile)]) == EXIT_USAGE
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["train", *TINY, "--out", str(afile / "below")]) == EXIT_USAGE
    assert "cannot create the folder" in capsys.readouterr().err
    done = tmp_path / "done"
    assert main(["train", *TINY, "--steps", "2", "--out", str(done)]) == 0
    before = (done / "result.json").read_bytes()
    assert main(["train", *TINY, "--steps", "3", "--out", str(done)]) == EXIT_USAGE
    assert "holds an earlier run" in capsys.readouterr().err
    assert (done / "result.json").read_bytes() == before
    assert main(["train", *TINY, "--steps", "3", "--out", str(done), "--overwrite"]) == 0
    assert json.loads((done / "result.json").read_text())["steps"] == 3
    # default folders: named by the run, numbered rather than overwritten
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["train", *TINY, "--steps", "2", "--optimizer", "LANS"]) == 0
    runs = sorted(p.name for p in (tmp_path / "scaleopt-runs").iterdir())
    assert runs == ["train-lans-spirals-b256", "train-lans-spirals-b256-2"]


def test_version(capsys):
    from scaleopt import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"scaleopt {__version__}"


def test_summaries_and_plot_titles_say_how_the_run_trained():
    from scaleopt.cli.report import describe

    assert describe({"dgc": True}, 4) == "DGC, 4 workers"
    assert describe({"offload": True, "shard": True}, 2) == "offloaded, sharded, 2 workers"
    assert describe({}, 1) == ""
    assert (describe({"shard": True, "dgc": True, "replicas": 2}, 4)
            == "sharded, DGC, 4 workers in 2 replicas")


@pytest.mark.slow
def test_two_torchrun_launches_train_dgc_between_their_nodes_as_one_machine_does(tmp_path,
                                                                                 hsdp_whole):
    """2 nodes x 2 processes, a c10d rendezvous on 127.0.0.1: --replicas 2 puts one replica on
    each node (DGC between the nodes, FSDP2 inside each), and the run equals the same command's
    4 workers started on one machine."""
    import os
    import signal

    from scaleopt.cli.launch import free_port

    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
              "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{free_port()}", "--rdzv-id", "scaleopt-test", "-m", "scaleopt",
              *HSDP_DGC, "--out", str(tmp_path / "nodes")]
    nodes = [subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=tmp_path, start_new_session=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:  # whatever happened, no launch or worker is left behind
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], outs
    printed = "".join(outs)
    assert "DGC between 2 replicas of 2 shards" in printed and "counted from the buffers" in printed
    nodes_run = json.loads((tmp_path / "nodes" / "result.json").read_text())
    assert nodes_run["workers"] == 4 and nodes_run["config"]["replicas"] == 2
    assert _curve(nodes_run) == _curve(hsdp_whole)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_a_reader_that_leaves_early_is_not_an_error(tmp_path):
    """``scaleopt train | head -1``: the summary's later lines meet a closed pipe; the command
    ends quietly with the run's exit code, not a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "scaleopt", "train", *TINY, "--steps", "3",
                             "--out", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the run prints anything
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "BrokenPipeError" not in err and "Traceback" not in err
    assert (tmp_path / "run" / "result.json").is_file()
