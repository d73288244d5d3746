"""tools/torch_compat.py, the check of a torch release, without making a venv: the commands it
runs (torch on its own, then the test extra with no constraints, then the suite with the venv's
interpreter) and the verdict it reads from pytest's summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import torch_compat as C  # noqa: E402

sys.path.remove(str(TOOLS))


def test_the_commands_install_torch_first_then_the_test_extra_without_constraints(tmp_path):
    venv = tmp_path / "v"
    make, torch_, extra, suite = C.commands("2.15.0", venv, ["-x"])
    assert make[-1] == str(venv)
    assert torch_[0] == extra[0] == suite[0] == str(venv / "bin" / "python")
    assert torch_[-1] == "torch==2.15.0"
    assert extra[-1].endswith("[test]") and "-c" not in extra  # beside that torch, as it is
    assert suite[1:3] == ["-m", "pytest"] and suite[-1] == "-x"


def test_a_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    venv = tmp_path / "v"
    done = subprocess.run([sys.executable, str(TOOLS / "torch_compat.py"), "2.14.1", "--venv",
                           str(venv), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "torch==2.14.1" in done.stdout and "pytest" in done.stdout and not venv.exists()


def test_the_verdict_reads_pytests_summary_line():
    text = "....F..s\n=== FAILURES ===\nstuff in 3.0s\n" \
           "1 failed, 2202 passed, 132 skipped, 2 errors in 833.10s (0:13:53)\n"
    counts = C.summary_counts(text)
    assert counts == {"failed": 1, "passed": 2202, "skipped": 132, "errors": 2}
    line = C.verdict("2.15.0+cu132", "3.9.0", "3.11.7", counts, 833.1)
    assert line == ("torch 2.15.0+cu132 (triton 3.9.0, Python 3.11.7): 2202 passed, 132 skipped, "
                    "1 failed, 2 errors in 13m53s: FAILED")
    ok = C.summary_counts("===== 2230 passed, 126 skipped in 700.00s =====")
    assert C.verdict("2.14.1", None, "3.11.7", ok, 700).endswith("in 11m40s: OK")
    assert C.summary_counts("ERROR: not a summary") == {}
