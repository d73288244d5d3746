"""Checkpoints of ``scaleopt train`` runs: torch.distributed.checkpoint (DCP) directories.

A run directory holds ``checkpoints/step-00000012/`` (the DCP files, written by every rank: each
saves its own shards, nothing is gathered on one rank, plus ``run.json``: the configuration, the
step, the history so far, the LR schedule's state, the optimizer's class and the parameters'
names and shapes, and ``manifest.json``: the size and SHA-256 digest of every other file) and
``checkpoints/latest`` (the name of the last complete one).

A checkpoint is written to ``checkpoints/.step-00000012.partial`` and renamed when every rank has
finished; only then does ``latest`` move (replaced atomically), and the oldest checkpoints
beyond ``keep`` are removed. A run killed while it saves leaves the last complete checkpoint in
place. ``--resume`` verifies a checkpoint against its manifest and its ``run.json`` against the
folder before it loads anything; a checkpoint that fails is reported by path and the newest
one before it that passes is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import scaleopt

CHECKPOINTS = "checkpoints"
META = "run.json"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_NAME = re.compile(r"^step-(\d{8})$")

#: options that a resumed run may change: where and how it runs, not what it trains
CHANGEABLE = frozenset({"workers", "shard", "replicas", "offload", "threads", "device", "out",
                        "progress", "checkpoint_every", "stop_after", "resume",
                        "keep_checkpoints", "state_dtype", "max_restarts"})


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed (missing, damaged, or of another run), or the run's
    checkpoints could not be written where it is asked to (a folder it cannot write, too little
    free space); the message says why. Nothing in the run's folder has been changed."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a folder that became read-only); the
    partial checkpoint is removed and the complete ones are kept."""


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _note(message: str) -> None:
    print(f"scaleopt train: {message}", file=sys.stderr)


# -- before training: can the checkpoints be written? ------------------------------------------


def check_writable(folder: str) -> None:
    """:class:`CheckpointError` unless a file can be written in ``folder`` and in its
    checkpoints (tried, not inferred from permissions, which do not bind every user)."""
    for path in (pathlib.Path(folder), pathlib.Path(folder) / CHECKPOINTS):
        if not path.is_dir():
            continue
        probe = path / f".write-test-{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"0")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise CheckpointError(f"{path}: this process cannot write there "
                                  f"({exc.strerror or exc})") from None
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()


def estimated_bytes(model) -> int:
    """About the bytes of one checkpoint of ``model`` and its optimizer: the weights, two
    moments and a master, in float32 (an upper bound for every optimizer of the command)."""
    return sum(p.numel() for p in model.parameters()) * 4 * 4


def check_space(folder: str, needed: int) -> None:
    """:class:`CheckpointError` unless ``folder``'s file system has ``needed`` bytes free."""
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise CheckpointError(
            f"{folder}: {free / 2**20:,.1f} MiB free, and the run's checkpoints need about "
            f"{needed / 2**20:,.1f} MiB (two of about {needed / 2**21:,.1f} MiB: the next one "
            f"is written before an older one is removed); free some space, write the run "
            f"elsewhere (--out), or lower --keep-checkpoints")


# -- the manifest --------------------------------------------------------------------------------


def _digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: pathlib.Path) -> List[pathlib.Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: pathlib.Path) -> None:
    """``manifest.json``: the size and SHA-256 of every file of the checkpoint ``folder``."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _digest(p)}
             for p in _files(folder)}
    _write_atomically(folder / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1))


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


# -- finding the checkpoint to resume ------------------------------------------------------------


def _complete(root: pathlib.Path) -> List[pathlib.Path]:
    """The checkpoint folders of ``root`` (renamed from partial, so written to the end),
    oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_NAME.match(p.name)),
                  key=lambda p: p.name)


def _candidates(root: pathlib.Path) -> List[pathlib.Path]:
    """The checkpoints of ``root``, the one ``latest`` names first, then newest first."""
    named = _complete(root)[::-1]
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


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


@contextlib.contextmanager
def _one_process_is_fine():
    """DCP warns when it saves or loads without a process group; a one-process run does that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_atomically(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(run_dir: str, step: int, model, opt, meta: Dict[str, Any], rank: int, world: int,
         keep: Optional[int] = None) -> str:
    """Write the checkpoint of ``step`` (every rank calls this) and keep the newest ``keep``
    (all with None); its directory. :class:`CheckpointWriteError` on every rank if any could
    not write its part (the partial checkpoint removed, the complete ones kept)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    root = pathlib.Path(run_dir) / CHECKPOINTS
    final, partial = root / _name(step), root / f".{_name(step)}.partial"
    error = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
            partial.mkdir()
    except OSError as exc:
        error = exc
    if not _failed_anywhere(error, world):
        try:
            with _one_process_is_fine():
                if _per_rank(opt):
                    torch.save(opt.state_dict(), _rank_file(partial, rank))
                dcp.save(_dcp_part(model, opt), checkpoint_id=str(partial))
            if rank == 0:
                _write_atomically(partial / META, json.dumps(dict(meta, step=step), indent=1))
                write_manifest(partial)
        except (Exception, CheckpointException) as exc:  # an OSError, or DCP's wrapper of one
            error = exc
    if _failed_anywhere(error, world):
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointWriteError(
            f"cannot write the checkpoint of step {step} into {root}: "
            f"{_first_line(error) if error else 'another rank could not write its part'}")
    if rank == 0:
        if final.exists():  # complete, but written by a run killed before ``latest`` moved
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomically(root / LATEST, final.name + "\n")
        if keep is not None:
            prune(root, keep)
    _barrier(world)
    return str(final)


def _per_rank(opt) -> bool:
    """Whether ``opt``'s state is each rank's own (DGC's residuals: they differ between the
    ranks that hold the same parameters, which DCP would save once)."""
    from ..dgc import DGCMomentum

    return isinstance(opt, DGCMomentum)


def _rank_file(folder: pathlib.Path, rank: int) -> pathlib.Path:
    return folder / f"optimizer-rank{rank}.pt"


def _dcp_part(model, opt) -> Dict[str, Any]:
    """What DCP saves and loads: the model, and the optimizer unless its state is per rank
    (each rank's then has a file of its own, :func:`_rank_file`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if _per_rank(opt):
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _load_per_rank(path: pathlib.Path, opt) -> None:
    """This rank's optimizer file (rank 0's where this rank had none: another number of
    workers, whose residuals the optimizer resets with a warning)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    own = _rank_file(path, rank)
    opt.load_state_dict(torch.load(own if own.exists() else _rank_file(path, 0),
                                   weights_only=True))


def prune(root: pathlib.Path, keep: int) -> List[str]:
    """Remove all but the newest ``keep`` complete checkpoints of ``root``; their names."""
    done = _complete(root)
    old = done[:-keep] if keep > 0 else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in old]


def _failed_anywhere(error: Optional[BaseException], world: int) -> bool:
    """Whether any rank has an ``error`` (every rank calls this)."""
    from .._sharding import on_any_rank

    return on_any_rank(error is not None) if world > 1 else error is not None


def _first_line(error: BaseException) -> str:
    """The cause in ``error``'s text: an OSError's line where DCP wrapped one (with each rank's
    traceback), else the last line of the text (the innermost exception)."""
    text = str(error).strip() or type(error).__name__
    errno_line = re.search(r"\[Errno \d+\][^\n]*", text)
    lines = [line for line in text.splitlines() if line.strip()]
    return errno_line.group(0) if errno_line else lines[-1].strip()


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
        what = ("another optimizer" if key in ("optimizer", "dgc") else
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


def shapes(model) -> Dict[str, list]:
    return {n: list(p.shape) for n, p in model.named_parameters()}


def load(path: pathlib.Path, meta: Dict[str, Any], model, opt) -> None:
    """Load the model and optimizer state of the checkpoint at ``path`` (every rank calls this),
    whatever the world size and layout it was saved at."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if type(opt).__name__ != meta["optimizer_class"]:
        raise CheckpointError(f"the checkpoint {path} holds the state of "
                              f"{meta['optimizer_class']}, not of {type(opt).__name__}: another "
                              f"optimizer")
    if shapes(model) != meta["parameters"]:
        raise CheckpointError(f"the checkpoint {path} holds another model (its parameters: "
                              f"{meta['parameters']})")
    state = _dcp_part(model, opt)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from .. import dcp as data_only

    try:
        with _one_process_is_fine():
            data_only.load(state, path)  # read as data, never run (scaleopt.dcp)
    except (Exception, CheckpointException) as exc:  # an unverified checkpoint's damage
        raise CheckpointError(f"the checkpoint {path} cannot be read: {_first_line(exc)}") \
            from None
    try:
        if "optim" not in state:
            set_model_state_dict(model, state["model"])
            _load_per_rank(path, opt)
        else:
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
    except ValueError as exc:  # the optimizer's checks of its state (scaleopt._loading)
        raise CheckpointError(f"the checkpoint {path} holds optimizer state that does not fit: "
                              f"{exc}") from None
    from .._sharding import local_piece

    bad = [n for n, p in model.named_parameters()
           if not bool(torch.isfinite(local_piece(p.detach())).all())]
    if bad:
        raise CheckpointError(f"the checkpoint {path} holds inf/NaN weights ({', '.join(bad)}): "
                              f"it was written after the run diverged; resume from an earlier "
                              f"one (--resume {path.parent}/step-...)")


def state_bytes(model, opt) -> Dict[str, int]:
    """Bytes of parameters and of optimizer state (:func:`scaleopt.state_bytes`) held by this
    rank, and what an unsharded replica holds."""
    from .._sharding import local_piece

    params = list(model.parameters())
    held = scaleopt.state_bytes(opt)
    return {"param_bytes_per_rank": sum(local_piece(p).numel() * p.element_size() for p in params),
            "unsharded_param_bytes": sum(p.numel() * p.element_size() for p in params),
            "optimizer_state_bytes_per_rank": held.per_rank,
            "unsharded_optimizer_state_bytes": held.unsharded}


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
