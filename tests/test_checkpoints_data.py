"""A checkpoint is data, never code: DCP's ``.metadata`` and its non-tensor entries are read
with unpicklers that build only what checkpoints are made of (``scaleopt.dcp``), so a
checkpoint crafted to run a command when it is read is refused, nothing in it runs, and
``scaleopt train --resume`` falls back to the newest earlier checkpoint; every kind of
checkpoint the command writes still reads and resumes."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

import scaleopt.dcp
from scaleopt.cli import EXIT_OK, checkpoint, main
from runs import copied as _copy

SMALL = ["--train-size", "3072", "--batch-size", "384", "--width", "32", "--no-progress",
         "--threads", "1", "--steps", "8"]


def _train(out, *argv):
    assert main(["train", *SMALL, *argv, "--out", str(out)]) == EXIT_OK
    return json.loads((pathlib.Path(out) / "result.json").read_text())


class _RunsACommand:
    """Unpickled, it creates the file ``marker`` (what a crafted checkpoint could do with any
    command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted_metadata(ckpt, marker):
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    checkpoint.write_manifest(ckpt)  # whoever writes the files writes the digests too


def _whole(ckpt, tmp_path):
    """Every entry of the checkpoint, read by torch's own converter (which unpickles them)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(tmp_path / "whole.pt"))
    return torch.load(tmp_path / "whole.pt", weights_only=True)


def _blank(x):
    """A state dict shaped like ``x`` for DCP to load into: zeros for tensors, None for the
    rest."""
    if isinstance(x, dict):
        return {k: _blank(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_blank(v) for v in x]
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else None


def _crafted_entry(ckpt, marker):
    """The checkpoint written again with its learning rate replaced by an object that runs a
    command when unpickled (a non-tensor entry: DCP's default planner unpickles those whole)."""
    state = _whole(ckpt, ckpt.parent)
    (ckpt.parent / "whole.pt").unlink()
    state["optim"]["param_groups"][0]["lr"] = _RunsACommand(marker)
    for f in ckpt.glob("*.distcp"):
        f.unlink()
    torch_dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    checkpoint.write_manifest(ckpt)


@pytest.mark.parametrize("craft, where", [(_crafted_metadata, ".metadata asks to load posix.system"),
                                          (_crafted_entry, "'optim.param_groups.0.lr'")])
def test_a_crafted_checkpoint_is_refused_nothing_runs_and_the_one_before_resumes(
        stopped, tmp_path, craft, where, capsys):
    run = _copy(stopped, tmp_path)
    latest, marker = run / "checkpoints" / "step-00000004", tmp_path / "ran"
    craft(latest, marker)
    assert not marker.exists()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == EXIT_OK
    err = capsys.readouterr().err
    assert not marker.exists()  # nothing in the file ran
    assert (f"the checkpoint {latest} is refused, as code rather than data" in err
            and where in err and "resuming from step-00000002" in err), err
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["resumed_at"] == 2 and resumed["complete"]


def test_the_library_reads_checkpoints_as_data_and_refuses_code(stopped, tmp_path):
    ckpt = stopped / "checkpoints" / "step-00000004"
    theirs = _whole(ckpt, tmp_path)
    ours = _blank(theirs)
    scaleopt.dcp.load(ours, ckpt)
    assert ours.keys() == theirs.keys() == {"model", "optim"}
    assert ours["optim"]["param_groups"] == theirs["optim"]["param_groups"]
    for part in ("model", "optim"):
        flat = torch.utils._pytree.tree_leaves(ours[part])
        for a, b in zip(flat, torch.utils._pytree.tree_leaves(theirs[part])):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert scaleopt.dcp.check(ckpt).state_dict_metadata.keys() == \
        torch_dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.keys()

    bad, marker = tmp_path / "bad", tmp_path / "ran"
    shutil.copytree(ckpt, bad)
    _crafted_metadata(bad, marker)
    with pytest.raises(scaleopt.dcp.RefusedCheckpoint, match=r"bad/\.metadata asks to load "
                                                             r"posix\.system") as info:
        scaleopt.dcp.load({}, bad)
    assert info.value.asks_for_code and not marker.exists()

    shutil.rmtree(bad)
    shutil.copytree(ckpt, bad)
    _crafted_entry(bad, marker)
    with pytest.raises(scaleopt.dcp.RefusedCheckpoint, match="param_groups.0.lr"):
        scaleopt.dcp.check(bad)
    with pytest.raises(scaleopt.dcp.RefusedCheckpoint, match="param_groups.0.lr") as info:
        scaleopt.dcp.load(_blank(_whole(ckpt, tmp_path)), bad)  # the planner's refusal
    assert info.value.asks_for_code
    assert not marker.exists()


@pytest.mark.parametrize("craft", ["truncated", "not-metadata"])
def test_a_damaged_metadata_file_is_damage_not_code(stopped, tmp_path, craft, capsys):
    run = _copy(stopped, tmp_path)
    latest = run / "checkpoints" / "step-00000004"
    data = (latest / ".metadata").read_bytes()
    (latest / ".metadata").write_bytes(data[:len(data) // 2] if craft == "truncated"
                                       else pickle.dumps({"a": 1}))
    checkpoint.write_manifest(latest)
    assert main(["train", "--resume", str(run), "--no-progress"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "is not checkpoint metadata" in err and "as code" not in err
    assert json.loads((run / "result.json").read_text())["resumed_at"] == 2


KINDS = {
    "one worker, float32": [],
    "bfloat16 state": ["--state-dtype", "bfloat16"],
    "int8 state": ["--state-dtype", "int8"],
    "offload": ["--offload"],
    "offload-adam, int8 state": ["--optimizer", "offload-adam", "--state-dtype", "int8"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_checkpoint_reads_as_data_and_resumes_exactly(tmp_path, kind):
    argv = KINDS[kind]
    whole = _train(tmp_path / "whole", *argv)
    run = tmp_path / "run"
    _train(run, *argv, "--checkpoint-every", "2", "--stop-after", "4")
    scaleopt.dcp.check(run / "checkpoints" / "step-00000004")
    assert main(["train", "--resume", str(run), "--no-progress"]) == EXIT_OK
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["resumed_at"] == 4 and _numbers(resumed) == _numbers(whole)


def _numbers(result):
    """A run's history without its times."""
    return [{k: v for k, v in h.items() if k != "time_s"} for h in result["history"]]


def test_a_sharded_int8_checkpoint_reads_as_data_and_resumes_in_one_process(tmp_path):
    whole = _train(tmp_path / "whole", "--state-dtype", "int8")
    run = tmp_path / "run"
    _train(run, "--workers", "2", "--shard", "--state-dtype", "int8", "--checkpoint-every", "4",
           "--stop-after", "4")
    scaleopt.dcp.check(run / "checkpoints" / "step-00000004")
    assert main(["train", "--resume", str(run), "--workers", "1", "--no-shard",
                 "--no-progress"]) == EXIT_OK
    resumed = json.loads((run / "result.json").read_text())
    assert resumed["resumed_at"] == 4
    for a, b in zip(resumed["history"], whole["history"]):
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-3)
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-3)
