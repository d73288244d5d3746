"""Which checkpoint a run resumes from, and with which options: the newest one of a run folder
that verifies (its files against its manifest, its ``run.json`` against its folder, its DCP
files read as data), and the run's configuration from it with the options given at resume."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Dict, List, Optional, Tuple

from .checkpoint import (CHANGEABLE, CHECKPOINTS, LATEST, MANIFEST, META, _STEP_NAME,
                         CheckpointError, _digest, _note, complete)


def verify(path: pathlib.Path) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be trusted, or None: its files against its
    manifest, then its ``run.json`` against the folder."""
    missing = [f for f in (".metadata", META) if not (path / f).is_file()]
    if missing:
        return (f"incomplete (no {' and no '.join(missing)}): it was not completely written")
    files: Dict[str, Any] = {}
    if (path / MANIFEST).is_file():
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"its {MANIFEST} is unreadable ({exc})"
    else:  # written by a release before manifests: its files cannot be checked
        _note(f"warning: the checkpoint {path} has no {MANIFEST} (an earlier release wrote "
              f"it): its files are not verified")
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, {want['bytes']} were written"
        if _digest(f) != want["sha256"]:
            return f"{name} is not what was written (its SHA-256 differs)"
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        return f"its {META} is unreadable ({exc})"
    return _meta_mismatch(path, meta) or _not_data(path)


def _not_data(path: pathlib.Path) -> Optional[str]:
    """Why the checkpoint's DCP files do not read as data (a ``.metadata`` or an entry made to
    run code when unpickled: :mod:`scaleopt.dcp`), or None. Nothing in them runs."""
    from .. import dcp

    try:
        dcp.check(path)
    except dcp.RefusedCheckpoint as exc:
        return f"refused, as code rather than data: {exc}" if exc.asks_for_code else str(exc)
    except OSError as exc:
        return f"unreadable ({exc})"
    return None


def _meta_mismatch(path: pathlib.Path, meta: Any) -> Optional[str]:
    """Why ``meta`` does not describe the checkpoint folder ``path``, or None."""
    m = _STEP_NAME.match(path.name)
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or m is None:
        return f"its {META} names no step"
    step = meta["step"]
    if step != int(m.group(1)):
        return f"its {META} says step {step}, the folder holds step {int(m.group(1))}"
    last_epoch = (meta.get("scheduler") or {}).get("last_epoch")
    if last_epoch is not None and last_epoch != step:
        return f"its {META} says step {step}, its LR schedule is at step {last_epoch}"
    if any(h.get("step", 0) > step for h in meta.get("history", [])):
        return f"its {META} has history after its step {step}"
    return None


def _candidates(root: pathlib.Path) -> List[pathlib.Path]:
    """The checkpoints of ``root``, the one ``latest`` names first, then newest first."""
    named = complete(root)[::-1]
    latest = root / LATEST
    if latest.is_file():
        target = latest.read_text().strip()
        if _STEP_NAME.match(target) and (root / target).is_dir():
            named = [root / target] + [p for p in named if p.name != target]
        else:
            _note(f"warning: {latest} names {target!r}, not a checkpoint of this run's "
                  f"{root}: ignored")
    return named


def _is_checkpoint(path: pathlib.Path) -> bool:
    return _STEP_NAME.match(path.name) is not None and path.parent.name == CHECKPOINTS


def run_of(resume: str) -> str:
    """The run folder of ``--resume``'s value: a run folder, or one of its checkpoints."""
    path = pathlib.Path(resume)
    return str(path.parent.parent) if _is_checkpoint(path) else resume


def find(resume: str) -> pathlib.Path:
    """The checkpoint ``--resume`` names: the given checkpoint folder, or the newest checkpoint
    of the run folder that verifies (those before it that do not are reported by path);
    :class:`CheckpointError` if there is none."""
    path = pathlib.Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such directory")
    if _is_checkpoint(path):
        reason = verify(path)
        if reason is not None:
            raise CheckpointError(f"--resume {resume}: the checkpoint is {_as_reason(reason)}")
        return path
    root = path / CHECKPOINTS
    failed: List[Tuple[pathlib.Path, str]] = []
    for candidate in _candidates(root):
        reason = verify(candidate)
        if reason is None:
            for bad, why in failed:
                _note(f"warning: the checkpoint {bad} is {_as_reason(why)}; resuming from "
                      f"{candidate.name} instead")
            return candidate
        failed.append((candidate, reason))
    if failed:
        raise CheckpointError(f"--resume {resume}: no checkpoint verifies: " + "; ".join(
            f"{bad} is {_as_reason(why)}" for bad, why in failed))
    partial = sorted(p.name for p in root.glob(".step-*.partial")) if root.is_dir() else []
    hint = (f" (only the incomplete {partial[-1]}, from a run stopped while it saved)"
            if partial else "; write them with --checkpoint-every K")
    raise CheckpointError(f"--resume {resume}: no complete checkpoint in {root}{hint}")


def chosen(resume: str) -> pathlib.Path:
    """The checkpoint a resumed run loads: the checkpoint folder :func:`resumed_config` chose
    and verified (``resume`` is then that folder), else the one :func:`find` chooses. Each rank
    calls this; the files are digested once, where the configuration was made."""
    path = pathlib.Path(resume)
    return path if _is_checkpoint(path) and path.is_dir() else find(resume)


def _as_reason(why: str) -> str:
    return why if why.startswith(("incomplete", "refused")) else f"damaged: {why}"


def read_meta(path: pathlib.Path) -> Dict[str, Any]:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint {path} has an unreadable {META}: {exc}") from None


def check_resumable(meta: Dict[str, Any], given: Dict[str, Any],
                    effective: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
                    ) -> None:
    """Raise :class:`CheckpointError` if an option given for the resumed run differs from the
    checkpoint's and would train another model, with another optimizer or on other data.
    ``effective(config)``: the values that options left at their default (None) took in the
    checkpoint's run (e.g. the optimizer's learning rate), compared with a given value instead
    of None."""
    saved = dict(meta["config"])
    for key, value in (effective(saved) if effective else {}).items():
        if saved.get(key) is None:
            saved[key] = value
    for key, value in given.items():
        if key in CHANGEABLE or key not in saved or saved[key] == value:
            continue
        what = ("another optimizer" if key in ("optimizer", "dgc", "powersgd") else
                "another model" if key in ("width", "dataset", "seed", "model", "layers", "context")
                else "another run")
        raise CheckpointError(
            f"--{key.replace('_', '-')} {_show(value)} is {what} than the checkpoint's "
            f"(--{key.replace('_', '-')} {_show(saved[key])}); resume with the same value or "
            f"leave it out")
    if meta["step"] >= meta["total_steps"]:
        raise CheckpointError(f"the run is complete (step {meta['step']} of "
                              f"{meta['total_steps']}): nothing to resume")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def resumed_config(resume: str, given: Dict[str, Any],
                   effective: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
                   ) -> Dict[str, Any]:
    """The configuration of a run resumed from ``resume`` (a run folder's last checkpoint that
    verifies, or a checkpoint folder): the checkpoint's, with the options ``given`` for the
    resumed run (where and how it runs; others must equal the checkpoint's, ``effective``
    values included: see :func:`check_resumable`). It writes into the run folder unless
    ``out`` is given; ``resume`` becomes the checkpoint chosen."""
    path = find(resume)
    meta = read_meta(path)
    check_resumable(meta, given, effective)
    values = dict(meta["config"], stop_after=None, out=run_of(resume))
    values.setdefault("keep_checkpoints", 3)  # checkpoints of earlier releases
    values.update({k: v for k, v in given.items() if k in CHANGEABLE})
    values["resume"] = str(path)
    if values["stop_after"] is not None and values["stop_after"] <= meta["step"]:
        raise CheckpointError(f"--stop-after {values['stop_after']}: the checkpoint is at step "
                              f"{meta['step']} already")
    return values
