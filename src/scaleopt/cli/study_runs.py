"""One run of a large-batch study: its row (scores, curve, noise measurements) and the
``scaleopt train`` command that repeats it."""

from __future__ import annotations

import math
import shlex
import sys
from typing import Any, Dict, Optional

from . import data
from .config import Config
from .trainer import Diverged, run


def cell(cfg: Config) -> Optional[Dict[str, Any]]:
    """One run's row, or None if the study was interrupted during it."""
    print(f"{cfg.optimizer:8s} batch {cfg.batch_size:5d}  lr {cfg.lr:.4g}  seed {cfg.seed}  "
          f"{cfg.total_steps()} steps", file=sys.stderr, flush=True)
    row: Dict[str, Any] = {"optimizer": cfg.optimizer, "batch_size": cfg.batch_size,
                           "lr": cfg.lr, "seed": cfg.seed, "warmup": cfg.warmup,
                           "steps": cfg.total_steps(), "command": command_line(cfg)}
    if cfg.betas:
        row["betas"] = list(cfg.betas)
    if cfg.dataset in data.TEXTS:
        row["tokens"] = cfg.total_steps() * cfg.batch_size * cfg.context
    try:
        r = _train(cfg)
    except Diverged:
        row.update(diverged=True, dev_loss=math.nan, test_loss=math.nan)
        return row
    if r["interrupted"]:
        return None  # the interrupted run's partial result is not a study point
    keys = ("dev_loss", "test_loss", "dev_bits_per_byte", "test_bits_per_byte", "test_accuracy",
            "time_s", "threads", "torch", "cpu")  # a run's last bits depend on the last three
    row.update({k: r[k] for k in keys if k in r})
    row["curve"] = [[h["step"], h["test_loss"]] for h in r["history"]]
    score = (f"test bits per byte {r['test_bits_per_byte']:.4f}" if "test_bits_per_byte" in r
             else f"test accuracy {r['test_accuracy']:.4f}")
    print(f"{cfg.optimizer:8s} batch {cfg.batch_size:5d}  lr {cfg.lr:.4g}  seed {cfg.seed}  "
          f"{score}", file=sys.stderr, flush=True)
    if "noise_scale" in r:
        row["noise"] = [[m["step"], m["g2"], m["trace"]] for m in r["noise_scale"]["history"]]
    return row


def _train(cfg: Config) -> Dict[str, Any]:
    """One run: in this process, or in ``cfg.workers`` processes started here."""
    if cfg.workers == 1:
        return run(cfg)
    from .launch import workers

    return workers(cfg)


#: the options of ``scaleopt train`` that a study's run sets, by Config field
_OPTIONS = ("model", "dataset", "optimizer", "lr", "batch_size", "train_size", "epochs",
            "width", "layers", "context", "text_split", "evals", "eval_spacing", "weight_decay", "warmup", "schedule", "seed",
            "max_grad_norm", "betas", "state_dtype", "workers", "threads")


def command_line(cfg: Config) -> str:
    """The ``scaleopt train`` command that repeats ``cfg``'s run by hand."""
    args = ["scaleopt", "train"]
    for name in _OPTIONS:
        value = getattr(cfg, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        args += [flag, *map(repr, value)] if isinstance(value, (list, tuple)) else [flag, str(
            repr(value) if isinstance(value, float) else value)]
    for name in ("measure_noise", "dev_split", "shard"):
        if getattr(cfg, name):
            args.append("--" + name.replace("_", "-"))
    return shlex.join(args)
