"""Small runs of ``scaleopt train`` that several test files share (the run ``stopped`` at step
4, a fixture of conftest.py, is one)."""

from __future__ import annotations

import json
import pathlib
import shutil

from scaleopt.cli import EXIT_OK, main

#: a run of 12 steps of 384 examples on a width-32 MLP, one thread: about a second
SMALL = ["--train-size", "3072", "--batch-size", "384", "--width", "32", "--no-progress",
         "--threads", "1", "--steps", "12"]


def train(out, *argv) -> dict:
    """``scaleopt train SMALL ARGV --out OUT``, which must succeed; its result.json."""
    assert main(["train", *SMALL, *argv, "--out", str(out)]) == EXIT_OK
    return json.loads((pathlib.Path(out) / "result.json").read_text())


def copied(run: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the run folder ``run`` in ``tmp_path`` (a test may damage it)."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"
