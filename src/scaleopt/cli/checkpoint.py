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
from typing import Any, Dict, List, Optional

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


# -- finding the checkpoint to resume ------------------------------------------------------------


def complete(root: pathlib.Path) -> List[pathlib.Path]:
    """The checkpoint folders of ``root`` (renamed from partial, so written to the end),
    oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_NAME.match(p.name)),
                  key=lambda p: p.name)


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
         keep: Optional[int] = None, hook: Any = None) -> str:
    """Write the checkpoint of ``step`` (every rank calls this) and keep the newest ``keep``
    (all with None); its directory. ``hook``: a DGC hook's state, each rank's in a file of its
    own. :class:`CheckpointWriteError` on every rank if any could
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
                if hook is not None:
                    torch.save(hook.state_dict(), _rank_file(partial, rank, HOOK))
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


#: the name of the DGC hook's per-rank files in a checkpoint
HOOK = "dgc-hook"


def _rank_file(folder: pathlib.Path, rank: int, what: str = "optimizer") -> pathlib.Path:
    return folder / f"{what}-rank{rank}.pt"


def _dcp_part(model, opt) -> Dict[str, Any]:
    """What DCP saves and loads: the model, and the optimizer unless its state is per rank
    (each rank's then has a file of its own, :func:`_rank_file`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if _per_rank(opt):
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _load_per_rank(path: pathlib.Path, opt, what: str = "optimizer") -> None:
    """This rank's file of ``opt`` (an optimizer or a DGC hook's state) in the checkpoint
    (rank 0's where this rank had none: another number of workers, whose residuals ``opt``
    resets with a warning)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    own = _rank_file(path, rank, what)
    opt.load_state_dict(torch.load(own if own.exists() else _rank_file(path, 0, what),
                                   weights_only=True))


def prune(root: pathlib.Path, keep: int) -> List[str]:
    """Remove all but the newest ``keep`` complete checkpoints of ``root``; their names."""
    done = complete(root)
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


def shapes(model) -> Dict[str, list]:
    return {n: list(p.shape) for n, p in model.named_parameters()}


def load(path: pathlib.Path, meta: Dict[str, Any], model, opt, hook: Any = None) -> None:
    """Load the model and optimizer state of the checkpoint at ``path`` (every rank calls this),
    whatever the world size and layout it was saved at (and a DGC hook's state into
    ``hook``)."""
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
        if hook is not None:
            if not _rank_file(path, 0, HOOK).exists():
                raise CheckpointError(f"the checkpoint {path} holds no DGC hook state: it was "
                                      f"written by a run without --dgc")
            _load_per_rank(path, hook, HOOK)
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
