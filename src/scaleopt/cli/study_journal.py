"""A large-batch study's journal: each finished run's row appended to ``runs.jsonl`` in the
study's folder as it finishes, and a stopped or killed study resumed from it (``scaleopt study
large-batch --resume DIR``): the runs recorded are not run again."""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any, Dict, List, Tuple

from . import analysis


def run_key(row: Any) -> Tuple[Any, ...]:
    """What names a study's run: optimizer, batch size, rate, seed, warm-up and beta2 (of a
    row or a Config)."""
    if isinstance(row, dict):
        get, beta2 = row.get, analysis.beta2_of(row)
    else:
        get, beta2 = (lambda k: getattr(row, k)), (float(row.betas[1]) if row.betas else None)
    return (get("optimizer"), get("batch_size"), float(get("lr")), get("seed"), get("warmup"),
            beta2)


def finished(p: Any, row: Dict[str, Any]) -> None:
    """A run's row, appended to the study's journal (flushed to disk: a killed study loses
    only the runs in flight) with the study's wall time so far (``study_s``, its earlier
    sittings' included)."""
    if p.journal is None or run_key(row) in p.known:
        return
    with open(p.journal, "a") as f:
        f.write(json.dumps({**row, "study_s": time.perf_counter() - p.started}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def recorded(out: str) -> Tuple[Dict[str, Any], Dict[Tuple[Any, ...], Dict[str, Any]], float]:
    """A study folder's protocol, its journal's rows by :func:`run_key` (a last line cut off by
    a kill is skipped) and the wall time of its sittings so far (its report's, or the last
    run's journalled, whichever is later: a killed study writes no report)."""
    folder = pathlib.Path(out)
    try:
        protocol = json.loads((folder / "protocol.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"--resume {out}: no study there (no protocol.json)") from None
    rows: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    times = [0.0]
    for line in _whole_lines(folder / "runs.jsonl"):
        row = json.loads(line)
        times.append(row.pop("study_s", 0.0))
        rows[run_key(row)] = row
    done = folder / "study.json"
    if done.exists():
        times.append(json.loads(done.read_text()).get("time_s", 0.0))
    return protocol, rows, max(times)


def _whole_lines(journal: pathlib.Path) -> List[str]:
    """The journal's lines that hold a whole row (a kill can cut its last one off)."""
    out = []
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append(line)
    return out


#: what a resumed study may change: how many runs at once, where and how it prints, and the
#: loss targets (read from the curves after the runs, they change no run)
_FREE = ("jobs", "threads", "out", "progress", "targets")


def resumed(p: Any, out: str) -> float:
    """``p`` given the runs the study in ``out`` recorded (refused if its protocol is
    another, but for :data:`_FREE` and warm-ups or beta2s added to those it tried: its runs
    are kept, the new settings' run, and each cell's choice is made again over all); the wall
    time of the sittings before."""
    saved, p.known, before = recorded(out)
    journal = pathlib.Path(out) / "runs.jsonl"
    journal.write_text("".join(line + "\n" for line in _whole_lines(journal)))
    now = p.describe()
    if saved.get("warmups") and set(saved["warmups"]) <= set(now["warmups"]):
        saved["warmups"] = now["warmups"]  # widened: the axis tried further
    base_beta2 = saved["config"].get("betas", [None, None])[1]
    if now.get("beta2s") and set(saved.get("beta2s") or [base_beta2]) <= set(now["beta2s"]):
        saved["beta2s"], saved["beta2_batches"] = now["beta2s"], now["beta2_batches"]
    for d in (saved, now):
        for k in _FREE:
            d.pop(k, None)
            d["config"].pop(k, None)
    if saved != now:
        keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if "config" in keys:
            keys.remove("config")
            keys += sorted(k for k in set(saved["config"]) | set(now["config"])
                           if saved["config"].get(k) != now["config"].get(k))
        raise ValueError(f"--resume {out}: the study there was started with other options "
                         f"({', '.join(keys)}): give the options it was started with")
    return before
