"""`scaleopt train --shard`, `--checkpoint-every`, `--stop-after` and `--resume`: sharded runs
equal to DDP runs, runs resumed at another world size equal to uninterrupted ones, checkpoints
that survive a run killed while it saves, and the errors of a resume that cannot be done."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import time
import sys

import pytest

from scaleopt.cli import EXIT_USAGE, main
# 384 = 2 x 192 = 3 x 128: a global batch that 1, 2 and 3 workers split; 8 steps an epoch
from runs import SMALL, train as _train


def _same_history(a, b, rel=1e-4):
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):
        for key in ("train_loss", "test_loss", "test_accuracy", "lr"):
            assert x[key] == pytest.approx(y[key], rel=rel, abs=1e-6), (x["step"], key)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted run of SMALL in one process."""
    return _train(tmp_path_factory.mktemp("one") / "run")


@pytest.mark.parametrize("optimizer", [["--optimizer", "lamb"], pytest.param(
    ["--optimizer", "lans", "--offload"], marks=pytest.mark.slow)])
def test_a_sharded_run_equals_the_ddp_run_and_holds_half_the_state(tmp_path, optimizer):
    ddp = _train(tmp_path / "ddp", "--workers", "2", *optimizer)
    fsdp = _train(tmp_path / "fsdp", "--workers", "2", "--shard", *optimizer)
    assert fsdp["sharded"] and not ddp["sharded"] and fsdp["workers"] == 2
    _same_history(fsdp["history"], ddp["history"])
    # each rank holds about half (the first rank the larger part of an odd row count; the
    # 5-row output layer splits 3 + 2)
    for kind in ("param_bytes", "optimizer_state_bytes"):
        full = ddp[f"{kind}_per_rank"]
        assert fsdp[f"unsharded_{kind}"] == full > 0
        assert full / 2 <= fsdp[f"{kind}_per_rank"] <= 0.55 * full, kind


@pytest.mark.parametrize("name", ["lans", "adamw"] + [  # the rest in the slow run
    pytest.param(n, marks=pytest.mark.slow) for n in ("muon", "offload-adam", "momentum",
                                                       "torch-adamw", "torch-sgd")])
def test_every_optimizer_trains_sharded_as_in_one_process(tmp_path, name):
    short = ["--optimizer", name, "--steps", "4"]
    fsdp = _train(tmp_path / "fsdp", "--workers", "2", "--shard", *short)
    one = _train(tmp_path / "one", *short)
    assert fsdp["sharded"] and fsdp["steps"] == 4
    _same_history(fsdp["history"], one["history"])
    assert fsdp["optimizer_state_bytes_per_rank"] < 0.55 * one["optimizer_state_bytes_per_rank"]


@pytest.mark.slow
def test_a_run_stopped_and_resumed_at_another_world_size_continues_the_run(tmp_path, one_process,
                                                                          capsys):
    run = tmp_path / "run"
    first = _train(run, "--workers", "2", "--shard", "--checkpoint-every", "3",
                   "--stop-after", "6")
    assert not first["complete"] and first["steps"] == 6
    assert "continue with --resume" in capsys.readouterr().out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000006"
    with open(run / "history.csv") as f:
        before = list(csv.DictReader(f))
    # three workers, unsharded (DDP), from the checkpoint two sharded workers wrote
    assert main(["train", "--resume", str(run), "--workers", "3", "--no-shard",
                 "--no-progress"]) == 0
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["complete"] and resumed["resumed_at"] == 6 and resumed["workers"] == 3
    assert not resumed["sharded"] and resumed["config"]["checkpoint_every"] == 3
    _same_history(resumed["history"], one_process["history"])
    with open(run / "history.csv") as f:
        after = list(csv.DictReader(f))
    assert after[:len(before)] == before and len(after) == len(one_process["history"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [  # the newest 3 kept
        "latest", "step-00000006", "step-00000009", "step-00000012"]


DIE_ON_SECOND_SAVE = """
import os, sys
import torch.distributed.checkpoint as dcp
from scaleopt.cli import main

real, calls = dcp.save, []


def save(state, checkpoint_id=None, **kw):
    calls.append(checkpoint_id)
    if len(calls) == 2:  # killed while it writes: some files there, the rest never comes
        real(state, checkpoint_id=checkpoint_id, **kw)
        os.remove(os.path.join(checkpoint_id, ".metadata"))
        os._exit(9)
    return real(state, checkpoint_id=checkpoint_id, **kw)


dcp.save = save
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_while_it_saves_keeps_the_last_complete_checkpoint(tmp_path, one_process):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", DIE_ON_SECOND_SAVE, "train", *SMALL, "--checkpoint-every", "4",
         "--out", str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step-00000008.partial", "latest",
                                                       "step-00000004"]
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["resumed_at"] == 4
    _same_history(resumed["history"], one_process["history"], rel=1e-6)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000004",
                                                       "step-00000008", "step-00000012"]


def _snapshot(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """LAMB and AdamW runs stopped at step 4 of 12 (LAMB's with checkpoints at 2 and 4), one
    finished with a checkpoint and one without checkpoints."""
    root = tmp_path_factory.mktemp("stopped")
    _train(root / "lamb", "--checkpoint-every", "2", "--stop-after", "4")
    _train(root / "adamw", "--optimizer", "adamw", "--stop-after", "4")
    _train(root / "done", "--checkpoint-every", "12")
    _train(root / "none")
    return root


def _only_partial(root):
    run = root / "partial"
    if not run.exists():
        shutil.copytree(root / "lamb", run)
        os.remove(run / "checkpoints" / "latest")
        for p in (run / "checkpoints").iterdir():
            p.rename(p.with_name(f".{p.name}.partial"))
    return run


@pytest.mark.parametrize("make, argv, message", [
    (lambda r: r / "lamb", ["--optimizer", "lans"],
     "--optimizer lans is another optimizer than the checkpoint's (--optimizer lamb)"),
    (lambda r: r / "lamb", ["--width", "64"], "--width 64 is another model than the checkpoint's"),
    (lambda r: r / "lamb", ["--dataset", "spirals2"], "another model"),
    (lambda r: r / "lamb", ["--batch-size", "768"], "--batch-size 768 is another run"),
    (lambda r: r / "lamb", ["--offload", "--workers", "2", "--shard", "--dgc"], "--dgc"),
    (lambda r: r / "adamw", ["--offload"], "holds the state of AdamW, not of OffloadAdam"),
    (lambda r: r / "done", [], "the run is complete (step 12 of 12)"),
    (lambda r: r / "none", [], "no complete checkpoint"),
    (lambda r: r / "missing", [], "no such directory"),
    (_only_partial, [], "only the incomplete .step-00000004.partial"),
    (lambda r: r / "lamb", ["--stop-after", "3"], "at step 4 already"),
])
def test_a_resume_that_cannot_be_done_is_a_clear_error(stopped, make, argv, message, capsys):
    run = make(stopped)
    before = _snapshot(run) if run.exists() else None
    assert main(["train", "--resume", str(run), "--no-progress", *argv]) == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert (_snapshot(run) if run.exists() else None) == before


def test_shard_with_dgc_or_one_worker_is_an_error(capsys):
    assert main(["train", "--optimizer", "momentum", "--dgc", "--workers", "2", "--shard"]) == EXIT_USAGE
    assert "--shard with --dgc" in capsys.readouterr().err
    assert main(["train", "--shard"]) == EXIT_USAGE
    assert "--workers 2 or more" in capsys.readouterr().err


def _signalled_after_a_checkpoint(run, workers, send):
    """A long ``scaleopt train --workers WORKERS`` into ``run``, in a process group of its own,
    and ``send(pid)`` once it has written its first checkpoint; the process, its output and
    its errors."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from scaleopt.cli import main; sys.exit(main())",
         "train", *SMALL, "--steps", "1000000", "--workers", workers, "--checkpoint-every", "5",
         "--out", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 180  # a safety net, not a timing assumption
        while not (run / "checkpoints" / "latest").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.1)
        send(proc.pid)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, out, err


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_ctrl_c_stops_cleanly_writes_the_results_so_far_and_leaves_no_process(tmp_path, workers):
    """SIGINT to the command's process group, as Ctrl-C in a terminal sends it, once the run
    has written its first checkpoint: it stops after its current step, writes the history and a
    result marked interrupted (and a checkpoint to resume from), exits 130, and no worker
    process is left."""
    run = tmp_path / "run"
    proc, out, err = _signalled_after_a_checkpoint(run, workers,
                                                   lambda pid: os.killpg(pid, signal.SIGINT))
    assert proc.returncode == 130, err
    assert "interrupted at step" in out and "--resume" in out
    result = json.loads((run / "result.json").read_text())
    assert result["interrupted"] and not result["complete"] and 5 <= result["steps"] < 1000000
    with open(run / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["step"]) == result["steps"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{result['steps']:08d}"
    with pytest.raises(ProcessLookupError):  # nothing left in the command's process group
        for _ in range(50):  # exiting processes may take a moment to be reaped
            os.killpg(proc.pid, 0)
            time.sleep(0.1)


@pytest.mark.parametrize("workers, group", [("1", False),
                                             pytest.param("2", False, marks=pytest.mark.slow),
                                             pytest.param("2", True, marks=pytest.mark.slow)])
def test_sigterm_stops_as_ctrl_c_does_and_the_run_resumes(tmp_path, workers, group):
    """SIGTERM, as a cluster sends before it ends a job (to the command's pid, or to every
    process of the job), once the run has written its first checkpoint: the run stops after its
    current step with a checkpoint there, says how to continue, exits 130 (not 143); resumed,
    it goes on from that step."""
    run = tmp_path / "run"
    proc, out, err = _signalled_after_a_checkpoint(
        run, workers, lambda pid: (os.killpg if group else os.kill)(pid, signal.SIGTERM))
    assert proc.returncode == 130, err
    assert "SIGTERM: stopping after this step" in err
    assert "interrupted at step" in out and f"--resume {run}" in out
    stopped = json.loads((run / "result.json").read_text())["steps"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"
    assert main(["train", "--resume", str(run), "--stop-after", str(stopped + 5)]) == 0
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["resumed_at"] == stopped and resumed["steps"] == stopped + 5


def _study_interrupted(args, after: str):
    """``scaleopt study large-batch ARGS`` in a process group of its own, Ctrl-C (SIGINT to the
    group) once its stderr shows a line containing ``after``; the process and what it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from scaleopt.cli import main; sys.exit(main())",
         "study", "large-batch", *args, "--no-progress"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stderr:  # a run's result line
            if after in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        printed, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, printed


@pytest.mark.slow
def test_ctrl_c_in_a_study_writes_the_finished_runs(tmp_path):
    """The study's first run finishes (2,000 steps of batch 4096, seed 0), Ctrl-C comes during
    the second (seed 1): the table holds the first, the command exits 130."""
    out = tmp_path / "study"
    proc, printed = _study_interrupted(
        ["--batch-sizes", "4096", "--optimizers", "lamb", "--grid", "1", "--extensions", "0",
         "--seeds", "2", "--jobs", "1", "--train-size", "4096", "--width", "16", "--epochs",
         "2000", "--threads", "1", "--out", str(out)], after="test accuracy")
    assert proc.returncode == 130
    assert "interrupted after 1 run;" in printed and "INTERRUPTED" in printed
    rows = json.loads((out / "study.json").read_text())["rows"]
    assert [(r["optimizer"], r["batch_size"]) for r in rows] == [("lamb", 4096)]


@pytest.mark.slow
def test_ctrl_c_in_a_study_of_parallel_runs_writes_the_finished_ones_and_leaves_no_process(tmp_path):
    """With --jobs 2 the runs go in processes of their own: Ctrl-C after the first has finished
    ends the others at once, writes the finished runs, and leaves no process behind."""
    out = tmp_path / "study"
    proc, printed = _study_interrupted(
        ["--model", "gpt", "--width", "32", "--layers", "1", "--context", "16", "--train-size",
         "1024", "--batch-sizes", "8", "32", "--optimizers", "lamb", "adamw", "--jobs", "2",
         "--out", str(out)], after="bits per byte")
    assert proc.returncode == 130 and "INTERRUPTED" in printed
    study = json.loads((out / "study.json").read_text())
    assert not study["complete"] and 1 <= len(study["rows"]) < 8
    assert all(r["seed"] == 0 and r["batch_size"] == 8 for r in study["rows"])
    with pytest.raises(ProcessLookupError):  # the pool's processes are gone too
        for _ in range(50):
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
