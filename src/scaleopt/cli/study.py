"""``scaleopt study large-batch``: the same model at several batch sizes, with LAMB, LANS and AdamW.

Every run trains for the same number of epochs, so a batch 8x larger takes 8x fewer steps. The
learning rate grows with the batch size from a base rate at ``--base-batch`` (square-root
scaling, as in the LAMB paper, or linear) and warms up over the first ``--warmup`` of the steps.
The claim under test: layer-wise trust ratios keep large batches trainable with less loss of
accuracy than Adam(W).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import launch, optimizers, report
from .train import Config, Diverged, run


def scaled_lr(base_lr: float, batch: int, base_batch: int, rule: str) -> float:
    ratio = batch / base_batch
    return base_lr * (ratio ** 0.5 if rule == "sqrt" else ratio)


def large_batch(batch_sizes: Sequence[int], names: Sequence[str], base: Config, base_batch: int,
                rule: str, base_lrs: Optional[Dict[str, float]] = None,
                out: Optional[str] = None) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    launch.STOP.clear()
    with launch.interruptible(launch.STOP):  # Ctrl-C: the runs so far are written
        _runs(rows, batch_sizes, names, base, base_batch, rule, base_lrs)
    if out:
        title = (f"{base.dataset}, {base.epochs} epochs, {rule} LR scaling from batch {base_batch}, "
                 f"warm-up {base.warmup:g}, {base.schedule} decay")
        report.write_study(rows, out, title)
    return rows


def _runs(rows, batch_sizes, names, base, base_batch, rule, base_lrs) -> None:
    for name in names:
        for b in batch_sizes:
            base_lr = (base_lrs or {}).get(name, optimizers.OPTIMIZERS[name].lr)
            cfg = dataclasses.replace(base, optimizer=name, batch_size=b, out=None,
                                      lr=scaled_lr(base_lr, b, base_batch, rule))
            print(f"{name:6s} batch {b:5d}  lr {cfg.lr:.4g}  {cfg.total_steps()} steps",
                  file=sys.stderr, flush=True)
            try:
                r = run(cfg)
                if r["interrupted"]:
                    return  # the interrupted run's partial result is not a study point
                row = {k: r[k] for k in ("lr", "steps", "test_accuracy", "test_loss", "time_s")}
            except Diverged:
                row = {"lr": cfg.lr, "steps": cfg.total_steps(), "test_accuracy": float("nan"),
                       "test_loss": float("nan"), "time_s": float("nan"), "diverged": True}
            rows.append({"optimizer": name, "batch_size": b, **row})
            print(f"        test accuracy {row['test_accuracy']:.4f}", file=sys.stderr, flush=True)
