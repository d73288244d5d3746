"""``scaleopt study large-batch``: the same model at several batch sizes, with LAMB, LANS, AdamW
and the other optimizers.

Every run trains on the same examples for the same number of epochs, so a batch 8x larger takes
8x fewer steps. The learning rate grows with the batch size from a base rate at
``--base-batch`` (square-root scaling, as in the LAMB paper, or linear) and warms up over the
first ``--warmup`` of the steps. With ``--sweep``, each optimizer's base rate is first tuned at
the smallest batch: its default rate (scaled to that batch) times each factor, the best final
test loss wins, and the sweep's runs are recorded too. The claim under test: layer-wise trust
ratios keep large batches trainable with less loss than Adam(W).

On the transformer (``--model gpt``: bytes of real text) the score is the validation loss in
bits per byte, and every run also measures the gradient noise scale B_simple (McCandlish et
al., 2018), the batch size past which larger batches stop paying off.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Dict, List, Optional, Sequence

from . import launch, report
from .train import Config, Diverged, run

#: ``--model gpt``'s study: 16,384 windows of 64 bytes (1M tokens, one epoch) for each cell,
#: on a 3-block model; batch sizes over a 64x range; each base rate tuned at the smallest
GPT_STUDY = dict(train_size=16384, epochs=1, width=128, layers=3, context=64, evals=4,
                 measure_noise=True)
GPT_BATCH_SIZES = [8, 32, 128, 512]
GPT_OPTIMIZERS = ["lamb", "lans", "adamw", "muon", "momentum"]
GPT_SWEEP = [1 / 3, 1.0, 3.0]


def scaled_lr(base_lr: float, batch: int, base_batch: int, rule: str) -> float:
    ratio = batch / base_batch
    return base_lr * (ratio ** 0.5 if rule == "sqrt" else ratio)


@dataclasses.dataclass
class Plan:
    """What a study runs: each optimizer at each batch size, its rate from ``base_batch`` by
    ``rule``; ``sweep``: factors of each optimizer's default rate tried at the smallest batch."""

    batch_sizes: Sequence[int]
    names: Sequence[str]
    base: Config
    base_batch: int
    rule: str
    sweep: Sequence[float] = ()

    def default_lr(self, name: str) -> float:
        """``name``'s default rate, at ``base_batch``."""
        return dataclasses.replace(self.base, optimizer=name, lr=None).resolved_lr()


def large_batch(plan: Plan, out: Optional[str] = None) -> List[Dict[str, Any]]:
    """Every cell's row (``sweep`` rows too, marked); written into ``out`` if given."""
    rows: List[Dict[str, Any]] = []
    launch.STOP.clear()
    with launch.interruptible(launch.STOP):  # Ctrl-C: the runs so far are written
        for name in plan.names:
            if not _optimizer_runs(rows, plan, name):
                break
    if out:
        base = plan.base
        title = (f"{base.dataset}, {base.epochs} epoch{'s' if base.epochs != 1 else ''}, "
                 f"{plan.rule} LR scaling"
                 + (f" from the rate tuned at batch {min(plan.batch_sizes)}" if plan.sweep
                    else f" from batch {plan.base_batch}")
                 + f", warm-up {base.warmup:g}, {base.schedule} decay")
        report.write_study(rows, out, title, summary(rows))
    return rows


def _optimizer_runs(rows: List[Dict[str, Any]], plan: Plan, name: str) -> bool:
    """``name``'s cells (after its sweep); False if interrupted."""
    smallest, base_lr, base_batch = min(plan.batch_sizes), plan.default_lr(name), plan.base_batch
    done: Dict[int, Dict[str, Any]] = {}
    if plan.sweep:
        tried = []
        for factor in plan.sweep:
            row = _cell(plan, name, smallest, factor * scaled_lr(base_lr, smallest, base_batch,
                                                                  plan.rule))
            if row is None:
                return False
            tried.append(dict(row, sweep=True, factor=factor))
            rows.append(tried[-1])
        best = min(tried, key=_score)
        base_lr, base_batch = best["lr"], smallest
        done[smallest] = dict(best, sweep=False, chosen_from=[r["lr"] for r in tried])
        rows.append(done[smallest])
    for b in plan.batch_sizes:
        if b in done:
            continue
        row = _cell(plan, name, b, scaled_lr(base_lr, b, base_batch, plan.rule))
        if row is None:
            return False
        rows.append(row)
    return True


def _score(row: Dict[str, Any]) -> float:
    """Lower is better: the final test loss (inf where the run diverged)."""
    loss = row["test_loss"]
    return loss if math.isfinite(loss) else math.inf


def _cell(plan: Plan, name: str, batch: int, lr: float) -> Optional[Dict[str, Any]]:
    """One run's row, or None if the study was interrupted during it."""
    cfg = dataclasses.replace(plan.base, optimizer=name, batch_size=batch, out=None, lr=lr)
    print(f"{name:8s} batch {batch:5d}  lr {cfg.lr:.4g}  {cfg.total_steps()} steps",
          file=sys.stderr, flush=True)
    keys = ("lr", "steps", "test_accuracy", "test_loss", "time_s", "tokens", "test_bits_per_byte")
    try:
        r = _train(cfg)
        if r["interrupted"]:
            return None  # the interrupted run's partial result is not a study point
        row = {k: r[k] for k in keys if k in r}
        if "noise_scale" in r:
            noise = r["noise_scale"]
            row["b_simple"], row["b_simple_tokens"] = noise["b_simple"], noise["b_simple_tokens"]
            row["b_simple_mid"] = noise["history"][len(noise["history"]) // 2]["b_simple"]
    except Diverged:
        row = {"lr": cfg.lr, "steps": cfg.total_steps(), "test_accuracy": math.nan,
               "test_loss": math.nan, "time_s": math.nan, "diverged": True}
        if cfg.dataset == "text":
            row["tokens"], row["test_bits_per_byte"] = cfg.total_steps() * batch * cfg.context, math.nan
    row = {"optimizer": name, "batch_size": batch, **row}
    score = (f"bits per byte {row['test_bits_per_byte']:.4f}" if "test_bits_per_byte" in row
             else f"test accuracy {row['test_accuracy']:.4f}")
    print(f"          {score}", file=sys.stderr, flush=True)
    return row


def _train(cfg: Config) -> Dict[str, Any]:
    """One cell's run: in this process, or in ``cfg.workers`` processes started here."""
    if cfg.workers == 1:
        return run(cfg)
    from .train import _workers

    return _workers(cfg)


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per optimizer: the largest batch whose score is within ``report.BEND_SHARE`` of its best
    (its curve bends after it), and the gradient noise scale halfway through and at the end of
    its smallest-batch run (where it has the most measurements), where measured."""
    out: Dict[str, Any] = {}
    cells = [r for r in rows if not r.get("sweep")]
    for name in dict.fromkeys(r["optimizer"] for r in cells):
        mine = sorted((r for r in cells if r["optimizer"] == name), key=lambda r: r["batch_size"])
        key = "test_bits_per_byte" if "test_bits_per_byte" in mine[0] else "test_loss"
        finite = [r for r in mine if math.isfinite(r[key])]
        entry: Dict[str, Any] = {}
        if finite:
            best = min(r[key] for r in finite)
            bound = best * (1 + report.BEND_SHARE)
            within = [r["batch_size"] for r in finite if r[key] <= bound]
            entry["bends_after"] = max(within)
        if "b_simple" in mine[0]:
            for key in ("b_simple", "b_simple_tokens", "b_simple_mid"):
                entry[key] = mine[0][key]
        out[name] = entry
    return out
