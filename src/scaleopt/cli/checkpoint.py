"""Checkpoints of ``scaleopt train`` runs: torch.distributed.checkpoint (DCP) directories.

A run directory holds ``checkpoints/step-00000012/`` (the DCP files, written by every rank: each
saves its own shards, nothing is gathered on one rank, plus ``run.json``: the configuration, the
step, the history so far, the LR schedule's state, the optimizer's class and the parameters'
names and shapes) and ``checkpoints/latest`` (the name of the last complete one).

A checkpoint is written to ``checkpoints/.step-00000012.partial`` and renamed when every rank has
finished; only then does ``latest`` move (replaced atomically). A run killed while it saves
leaves the last complete checkpoint in place, and ``--resume`` continues from that one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist

CHECKPOINTS = "checkpoints"
META = "run.json"
LATEST = "latest"

#: options that a resumed run may change: where and how it runs, not what it trains
CHANGEABLE = frozenset({"workers", "shard", "offload", "threads", "device", "out", "progress",
                        "checkpoint_every", "stop_after", "resume"})


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed (missing, incomplete, or of another run); the message says
    why. Nothing in the checkpoint's directory has been changed."""


def _name(step: int) -> str:
    return f"step-{step:08d}"


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


def save(run_dir: str, step: int, model, opt, meta: Dict[str, Any], rank: int, world: int) -> str:
    """Write the checkpoint of ``step`` (every rank calls this); its directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = pathlib.Path(run_dir) / CHECKPOINTS
    final, partial = root / _name(step), root / f".{_name(step)}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
        partial.mkdir()
    _barrier(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    with _one_process_is_fine():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    if rank == 0:
        _write_atomically(partial / META, json.dumps(dict(meta, step=step), indent=1))
        if final.exists():  # complete, but written by a run killed before ``latest`` moved
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomically(root / LATEST, final.name + "\n")
    _barrier(world)
    return str(final)


def find(run_dir: str) -> pathlib.Path:
    """The last complete checkpoint of ``run_dir``; :class:`CheckpointError` if there is none."""
    run = pathlib.Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such directory")
    root = run / CHECKPOINTS
    latest = root / LATEST
    if not latest.is_file():
        partial = sorted(p.name for p in root.glob(".step-*.partial")) if root.is_dir() else []
        hint = (f" (only the incomplete {partial[-1]}, from a run stopped while it saved)"
                if partial else "; write them with --checkpoint-every K")
        raise CheckpointError(f"--resume {run_dir}: no complete checkpoint in {root}{hint}")
    path = root / latest.read_text().strip()
    missing = [f for f in (".metadata", META) if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"--resume {run_dir}: the checkpoint {path} is incomplete "
                              f"(no {' and no '.join(missing)}); it was not completely written")
    return path


def read_meta(path: pathlib.Path) -> Dict[str, Any]:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint {path} has an unreadable {META}: {exc}") from None


def check_resumable(meta: Dict[str, Any], given: Dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` if an option given for the resumed run differs from the
    checkpoint's and would train another model, with another optimizer or on other data."""
    saved = meta["config"]
    for key, value in given.items():
        if key in CHANGEABLE or key not in saved or saved[key] == value:
            continue
        what = ("another optimizer" if key in ("optimizer", "dgc") else
                "another model" if key in ("width", "dataset", "seed") else "another run")
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if type(opt).__name__ != meta["optimizer_class"]:
        raise CheckpointError(f"the checkpoint {path} holds the state of "
                              f"{meta['optimizer_class']}, not of {type(opt).__name__}: another "
                              f"optimizer")
    if shapes(model) != meta["parameters"]:
        raise CheckpointError(f"the checkpoint {path} holds another model (its parameters: "
                              f"{meta['parameters']})")
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def state_bytes(model, opt) -> Dict[str, int]:
    """Bytes of parameters and of optimizer state held by this rank, and what an unsharded
    replica holds."""
    from .._sharding import local_piece

    def sizes(tensors):
        here = full = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            here += local_piece(t).numel() * t.element_size()
            full += t.numel() * t.element_size()
        return here, full

    params = sizes(model.parameters())
    state = sizes(v for st in opt.state.values() for v in st.values())
    return {"param_bytes_per_rank": params[0], "unsharded_param_bytes": params[1],
            "optimizer_state_bytes_per_rank": state[0], "unsharded_optimizer_state_bytes": state[1]}


def resumed_config(run_dir: str, given: Dict[str, Any]) -> Dict[str, Any]:
    """The configuration of a run resumed from ``run_dir``'s last checkpoint: the checkpoint's,
    with the options ``given`` for the resumed run (where and how it runs; others must equal
    the checkpoint's). It writes into ``run_dir`` unless ``out`` is given."""
    meta = read_meta(find(run_dir))
    check_resumable(meta, given)
    values = dict(meta["config"], stop_after=None, out=run_dir)
    values.update({k: v for k, v in given.items() if k in CHANGEABLE})
    values["resume"] = run_dir
    if values["stop_after"] is not None and values["stop_after"] <= meta["step"]:
        raise CheckpointError(f"--stop-after {values['stop_after']}: the checkpoint is at step "
                              f"{meta['step']} already")
    return values
