"""The command's checkpoints verified, recovered and pruned; a run folder that cannot take them
refused before training; a disk that fills during the run ending it cleanly; and the smaller
defects of `scaleopt train` and `bench` (stopping before an evaluation, resume hints, option
comparison by effective value, `--only` in any case, the thread hint)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from scaleopt.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, bench, checkpoint, launch, main
from scaleopt.cli.report import how_to_continue as _how_to_continue
from runs import SMALL, copied as _copy, train as _train


def _data_file(ckpt):
    return next(p for p in ckpt.iterdir() if p.suffix == ".distcp")


def _truncate(ckpt):
    f = _data_file(ckpt)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _empty(ckpt):
    _data_file(ckpt).write_bytes(b"")


def _flip_a_byte(ckpt):
    f = _data_file(ckpt)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))


def _no_metadata(ckpt):
    os.remove(ckpt / ".metadata")


def _other_step_in_run_json(ckpt, regenerate_manifest=False):
    meta = json.loads((ckpt / "run.json").read_text())
    meta["step"] = 10
    (ckpt / "run.json").write_text(json.dumps(meta))
    if regenerate_manifest:  # as if the manifest had been written for the altered file
        checkpoint.write_manifest(ckpt)


DAMAGE = {
    "truncated": (_truncate, "bytes, "),
    "emptied": (_empty, "has 0 bytes"),
    "byte-flipped": (_flip_a_byte, "SHA-256 differs"),
    "half-written": (_no_metadata, "incomplete (no .metadata)"),
    "run.json-altered": (_other_step_in_run_json, "damaged: run.json"),
    "run.json-and-manifest-altered": (lambda c: _other_step_in_run_json(c, True),
                                      "run.json says step 10, the folder holds step 4"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_reported_and_the_one_before_resumes(
        stopped, tmp_path, damage, capsys):
    run = _copy(stopped, tmp_path)
    latest = run / "checkpoints" / "step-00000004"
    change, words = DAMAGE[damage]
    change(latest)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == EXIT_OK
    err = capsys.readouterr().err
    assert str(latest) in err and words in err and "resuming from step-00000002" in err
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["resumed_at"] == 2 and resumed["complete"]


def test_when_no_checkpoint_verifies_each_is_named_and_nothing_changes(stopped, tmp_path, capsys):
    run = _copy(stopped, tmp_path)
    for name in ("step-00000002", "step-00000004"):
        _flip_a_byte(run / "checkpoints" / name)
    before = sorted((p.name, p.stat().st_size) for p in run.rglob("*") if p.is_file())
    assert main(["train", "--resume", str(run), "--no-progress"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no checkpoint verifies" in err and "step-00000002" in err and "step-00000004" in err
    assert sorted((p.name, p.stat().st_size) for p in run.rglob("*") if p.is_file()) == before


def test_a_checkpoint_of_an_earlier_release_without_manifest_resumes_with_a_warning(
        stopped, tmp_path, capsys):
    run = _copy(stopped, tmp_path)
    for name in ("step-00000002", "step-00000004"):
        os.remove(run / "checkpoints" / name / "manifest.json")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress", "--stop-after", "6"]) == EXIT_OK
    assert "has no manifest.json" in capsys.readouterr().err
    # damage that no digest shows is still found where a file does not read (an emptied data
    # file: its entries cannot be unpickled), and the newest checkpoint before it resumes
    os.remove(run / "checkpoints" / "step-00000006" / "manifest.json")
    _empty(run / "checkpoints" / "step-00000006")
    assert main(["train", "--resume", str(run), "--no-progress", "--stop-after", "8"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "step-00000006 is damaged" in err and "cannot be read (EOFError" in err
    assert "resuming from step-00000004" in err and "Traceback" not in err
    assert json.loads((run / "result.json").read_text())["resumed_at"] == 4
    # a data file whose tensors are gone but whose entries read: DCP's load fails, a clear error
    os.remove(run / "checkpoints" / "step-00000008" / "manifest.json")
    data = run / "checkpoints" / "step-00000008" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-64])
    assert main(["train", "--resume", str(run / "checkpoints" / "step-00000008"),
                 "--no-progress"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "step-00000008 cannot be read" in err and "Traceback" not in err


def test_a_checkpoint_folder_can_be_named_and_is_verified(stopped, tmp_path, capsys):
    run = _copy(stopped, tmp_path)
    assert main(["train", "--resume", str(run / "checkpoints" / "step-00000002"),
                 "--no-progress", "--stop-after", "3"]) == EXIT_OK
    assert json.loads((run / "result.json").read_text())["resumed_at"] == 2
    _flip_a_byte(run / "checkpoints" / "step-00000004")
    assert main(["train", "--resume", str(run / "checkpoints" / "step-00000004"),
                 "--no-progress"]) == EXIT_USAGE
    assert "damaged" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["../../elsewhere", "/etc", "step-00000004/../../.."])
def test_latest_never_leads_out_of_the_run(stopped, tmp_path, target, capsys):
    run = _copy(stopped, tmp_path)
    (run / "checkpoints" / "latest").write_text(target + "\n")
    assert main(["train", "--resume", str(run), "--no-progress", "--stop-after", "5"]) == EXIT_OK
    assert "not a checkpoint of this run" in capsys.readouterr().err
    assert json.loads((run / "result.json").read_text())["resumed_at"] == 4


def test_inf_weights_in_a_verified_checkpoint_name_the_cause(tmp_path, capsys):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    run = tmp_path / "run"
    _train(run, "--checkpoint-every", "2", "--stop-after", "2")
    ckpt = run / "checkpoints" / "step-00000002"
    dcp_to_torch_save(str(ckpt), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    state["model"]["0.weight"].fill_(float("inf"))  # written after a divergence, say
    torch.save(state, tmp_path / "state.pt")
    os.remove(ckpt / ".metadata")
    os.remove(next(p for p in ckpt.iterdir() if p.suffix == ".distcp"))
    torch_save_to_dcp(str(tmp_path / "state.pt"), str(ckpt))
    checkpoint.write_manifest(ckpt)  # verified: the files are as written
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == EXIT_USAGE
    assert "holds inf/NaN weights (0.weight)" in capsys.readouterr().err


def test_checkpoints_are_pruned_to_the_newest_n(tmp_path):
    run = tmp_path / "run"
    r = _train(run, "--checkpoint-every", "1", "--keep-checkpoints", "2")
    assert len(r["checkpoints"]) == 12
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest", "step-00000011", "step-00000012"]
    with pytest.raises(SystemExit) as exit_:
        main(["train", *SMALL, "--keep-checkpoints", "0", "--out", str(tmp_path / "x")])
    assert exit_.value.code == EXIT_USAGE


def _limited(argv, limit, cwd):
    """``scaleopt`` in a process that cannot write a file past ``limit`` bytes (writes beyond
    it fail with EFBIG, as on a full disk)."""
    # the limit starts after the imports: importing torch may write (where dill is installed,
    # torch imports it, and dill probes the temporary folder with a file)
    code = ("import resource, signal, sys\n"
            "from scaleopt.cli import main\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "sys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_a_folder_that_cannot_be_written_is_refused_before_training(stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    proc = _limited(["train", "--resume", str(run), "--no-progress"], 0, tmp_path)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "cannot write there" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "checkpoints" / "step-00000006").exists()


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_a_disk_that_fills_during_the_run_ends_it_with_its_results(tmp_path):
    run = tmp_path / "run"
    proc = _limited(["train", *SMALL, "--checkpoint-every", "4", "--out", str(run)], 16384,
                    tmp_path)
    assert proc.returncode == EXIT_FAILED, proc.stderr
    assert "cannot write the checkpoint of step 4" in proc.stderr
    assert "Traceback" not in proc.stderr
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 4 and result["history"][-1]["step"] == 4
    assert result["checkpoint_error"] and not result["complete"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == []  # no partial left


def test_too_little_free_space_is_refused(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(checkpoint.CheckpointError, match="MiB free"):
        checkpoint.check_space(str(tmp_path), free * 2 + 2**30)
    checkpoint.check_space(str(tmp_path), 1)


def test_options_are_compared_by_the_values_the_run_used(stopped, tmp_path, capsys):
    run = _copy(stopped, tmp_path)  # the run left --lr at LAMB's default, 0.01
    assert main(["train", "--resume", str(run), "--no-progress", "--lr", "0.02"]) == EXIT_USAGE
    assert "--lr 0.02 is another run than the checkpoint's (--lr 0.01)" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--no-progress", "--lr", "0.01",
                 "--steps", "12"]) == EXIT_OK


def test_stopping_before_the_first_evaluation_writes_the_results(tmp_path):
    r = _train(tmp_path / "run", "--steps", "160", "--stop-after", "5")  # evaluations every 10
    assert r["steps"] == 5 and r["history"][-1]["step"] == 5 and not r["complete"]
    assert (tmp_path / "run" / "history.csv").is_file()


def test_a_stopped_run_says_how_to_continue_only_where_it_can(tmp_path, stopped, capsys):
    assert "continue with --resume" in _how_to_continue(str(stopped))
    assert "cannot be resumed (pass --checkpoint-every K)" in _how_to_continue(str(tmp_path))
    capsys.readouterr()
    _train(tmp_path / "one", "--threads", "1", "--steps", "2")
    assert "parameters, 1 thread\n" in capsys.readouterr().out


def test_bench_only_takes_names_in_any_case():
    names = ["torch.AdamW(fused)", "scaleopt.LAMB", "scaleopt.LANS", "apex.FusedLAMB"]
    assert bench.selected(names, ["lamb"]) == ["torch.AdamW(fused)", "scaleopt.LAMB",
                                               "apex.FusedLAMB"]
    assert bench.selected(names, ["LANS"]) == ["torch.AdamW(fused)", "scaleopt.LANS"]


@pytest.mark.parametrize("load, cores, threads, workers, hint", [
    (0.2, 2, None, 1, None),  # an idle machine
    (3.0, 2, None, 1, "--threads 1"),  # two threads on a busy pair of cores
    (3.0, 2, 1, 1, None),  # one thread: nothing fewer to try
    (6.0, 8, 8, 1, "--threads 2"),
    (6.0, 8, 2, 1, None),  # fits in what is free
])
def test_the_thread_hint(load, cores, threads, workers, hint):
    got = launch.busy_cores_hint(threads, workers, load=load, cores=cores)
    assert (got is None) == (hint is None)
    if hint:
        assert hint in got and f"load average is {load:.1f} on {cores} cores" in got
