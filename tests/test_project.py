"""The project's promises about itself: CI runs the README's command, the example runs."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", quick, flags=re.S)


def test_quickstart_is_two_commands_and_ci_runs_the_test_one():
    cmds = readme_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "pytest" in cmds[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmds[1] in ci


def test_constraints_pin_torch():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_example_trains(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_lamb.py"), "--steps", "200", "--batch-size", "512"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    acc = dict(re.findall(r"(LAMB|AdamW)\s+test accuracy ([0-9.]+)", out))
    assert set(acc) == {"LAMB", "AdamW"}
    assert float(acc["LAMB"]) > 0.65  # well above chance (0.5) after 200 steps
