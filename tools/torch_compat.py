"""Does scaleopt work with a torch release? One command makes a venv with that release, installs
scaleopt and its test extra beside it, runs the suite there and prints a one-line verdict.

    python tools/torch_compat.py 2.15.0                      # venv in ./.compat/torch-2.15.0
    python tools/torch_compat.py 2.14.1 --venv /tmp/t214 -- -x -k triton
    python tools/torch_compat.py 2.15.0 --dry-run            # print the commands only

The venv is kept (a second run reuses it while its torch is the release asked for). torch is
installed first, on its own (``pip install torch==X``: PyPI's build for the platform, a CUDA
build of several GB on Linux x86-64; pass pip's own options through the environment, e.g.
``PIP_INDEX_URL`` for PyTorch's CPU index), then ``pip install -e ".[test]"`` with no
constraints, so that the test extra installs beside that torch (Triton: whichever the release
brings, else the newest the extra admits). The suite runs with the venv's interpreter, not
activated. The verdict line::

    torch 2.15.0 (triton 3.9.0, Python 3.11.7): 2202 passed, 132 skipped, 0 failed in 13m53s: OK

Exit status: 0 when nothing failed, 1 when a test failed or errored, 2 when the install failed.
The suite's whole output is in ``<venv>/suite.log``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
INSTALL_FAILED = 2

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def summary_counts(text: str) -> Dict[str, int]:
    """The counts of pytest's last summary line (``== 3 failed, 10 passed in 1.2s ==`` or
    ``-q``'s ``3 failed, 10 passed in 1.2s``); ``error`` and ``errors`` both as ``errors``."""
    for line in reversed(text.strip().splitlines()):
        if re.search(r"\b(passed|failed|errors?|skipped)\b", line) and re.search(r" in [\d.]+s", line):
            counts: Dict[str, int] = {}
            for n, what in _COUNT.findall(line):
                key = "errors" if what.startswith("error") else what
                counts[key] = counts.get(key, 0) + int(n)
            return counts
    return {}


def passed(counts: Dict[str, int]) -> bool:
    """Whether a suite's counts say it passed: tests passed, none failed or errored."""
    return counts.get("passed", 0) > 0 and not (counts.get("failed") or counts.get("errors"))


def verdict(torch_version: str, triton_version: Optional[str], python: str,
            counts: Dict[str, int], seconds: float) -> str:
    """The one line: versions, counts and OK or FAILED."""
    minutes, secs = divmod(int(round(seconds)), 60)
    parts = [f"{counts.get('passed', 0)} passed", f"{counts.get('skipped', 0)} skipped",
             f"{counts.get('failed', 0)} failed"]
    if counts.get("errors"):
        parts.append(f"{counts['errors']} errors")
    status = "OK" if passed(counts) else "FAILED"
    return (f"torch {torch_version} (triton {triton_version or 'not installed'}, Python "
            f"{python}): {', '.join(parts)} in {minutes}m{secs:02d}s: {status}")


def commands(version: str, venv: Path, pytest_args: List[str]) -> List[List[str]]:
    """The commands, in order: the venv, torch, scaleopt with its test extra, the suite."""
    py = str(venv / "bin" / "python")
    return [[sys.executable, "-m", "venv", str(venv)],
            [py, "-m", "pip", "install", "-q", f"torch=={version}"],
            [py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"],
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]]


def _installed(py: Path, module: str) -> Optional[str]:
    done = subprocess.run([str(py), "-c", f"import {module}; print({module}.__version__)"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("torch", help="the torch release, e.g. 2.15.0")
    ap.add_argument("--venv", type=Path, help="where the venv goes (default: .compat/torch-X)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = ap.parse_args(argv)
    venv = args.venv or ROOT / ".compat" / f"torch-{args.torch}"
    steps = commands(args.torch, venv, args.pytest_args)
    if args.dry_run:
        for cmd in steps:
            print(" ".join(cmd))
        return 0
    py = venv / "bin" / "python"
    have = _installed(py, "torch") if py.exists() else None
    if have is None or have.split("+")[0] != args.torch:
        for cmd in steps[:2]:
            if subprocess.run(cmd).returncode != 0:
                print(f"torch {args.torch}: the install failed ({' '.join(cmd)})")
                return INSTALL_FAILED
    if subprocess.run(steps[2], cwd=ROOT).returncode != 0:
        print(f"torch {args.torch}: scaleopt's test extra did not install beside it")
        return INSTALL_FAILED
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "TRITON_INTERPRET")}
    with open(venv / "suite.log", "w") as log:  # written as the suite runs (tail -f)
        subprocess.run(steps[3], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    counts = summary_counts((venv / "suite.log").read_text())
    python = subprocess.run([str(py), "-c", "import platform; print(platform.python_version())"],
                            capture_output=True, text=True).stdout.strip()
    print(verdict(_installed(py, "torch") or args.torch, _installed(py, "triton"), python,
                  counts, time.perf_counter() - started))
    return 0 if passed(counts) else 1


if __name__ == "__main__":
    sys.exit(main())
