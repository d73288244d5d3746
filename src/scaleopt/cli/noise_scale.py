"""The gradient noise scale at saved checkpoints: ``scaleopt study noise-scale DIR``.

For each optimizer of a finished large-batch study, the seed-0 run of its chosen rate at one
batch size (the smallest by default) is trained again, with a checkpoint at each step where
its recorded test curve reached a target loss; the rerun's evaluations up to there are
compared with the recorded ones (equal bit for bit on a machine of the kind that recorded them,
within ``--within`` bits per byte elsewhere, or the command fails). At each checkpoint the squared norms of the gradients of independent
batches of two sizes far apart (4 and 256 sequences by default, drawn with replacement from the
run's training windows) give unbiased estimates of |G|^2 and tr(Sigma) (McCandlish et al.
2018, appendix A.1)::

    |G|^2     ~  (B mean|G_B|^2 - b mean|G_b|^2) / (B - b)
    tr(Sigma) ~  (mean|G_b|^2 - mean|G_B|^2) / (1/b - 1/B)

and B_simple = tr(Sigma) / |G|^2, each with a bootstrap 95% interval over the batches. The
batches come in rounds (as many sequences of each size per round) until |G|^2's interval lies
above zero, at least two rounds and at most ``--rounds``; a measurement that ran out of rounds
says so and gives B_simple no upper bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shlex
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import analysis, config, options, study_report, train, trainer

#: the two batch sizes (sequences) and the sequences of each drawn per round
SMALL, LARGE, PER_ROUND = 4, 256, 1024
#: how far (bits per byte) a rerun's evaluations may lie from the recorded ones: another CPU's
#: arithmetic moves them in the last digits, a different run by far more
WITHIN = 1e-3
#: rounds at least and at most per checkpoint
MIN_ROUNDS, ROUNDS = 2, 16
#: bootstrap resamples of the measurements, and the generators' seeds
RESAMPLES, SEED = 2000, 0


def squared_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, size: int,
                  count: int, generator: torch.Generator) -> List[float]:
    """``count`` squared norms of the gradient of the mean training loss over ``size``
    sequences drawn with replacement from ``(x, y)``, at the model's weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for _ in range(count):
        idx = torch.randint(0, len(x), (size,), generator=generator)
        model.zero_grad(set_to_none=True)
        trainer._loss(model(x[idx]), y[idx]).backward()
        out.append(float(sum(p.grad.double().square().sum() for p in params
                             if p.grad is not None)))
    model.zero_grad(set_to_none=True)
    return out


def estimate(small: Sequence[float], large: Sequence[float], b: int, big: int,
             resamples: int = RESAMPLES, seed: int = SEED) -> Dict[str, Any]:
    """|G|^2, tr(Sigma) and B_simple from squared norms at batch sizes ``b < big``, each with a
    percentile-bootstrap 95% interval (the measurements of each size resampled on their own);
    B_simple is inf where |G|^2 is not positive, so an interval reaching there is unbounded."""
    if not 0 < b < big:
        raise ValueError(f"the small batch must be positive and below the large one, got {b}, {big}")
    if len(small) < 2 or len(large) < 2:
        raise ValueError("at least two measurements of each batch size are needed")

    def parts(ms: torch.Tensor, ml: torch.Tensor) -> Dict[str, torch.Tensor]:
        g2 = (big * ml - b * ms) / (big - b)
        trace = (ms - ml) / (1 / b - 1 / big)
        ratio = torch.where(g2 > 0, trace / g2.clamp_min(1e-300),
                            torch.full_like(g2, math.inf))
        return {"g2": g2, "trace": trace, "b_simple": ratio}

    s = torch.tensor(small, dtype=torch.float64)
    l_ = torch.tensor(large, dtype=torch.float64)
    point = parts(s.mean(), l_.mean())
    g = torch.Generator().manual_seed(seed)
    boot = parts(s[torch.randint(0, len(s), (resamples, len(s)), generator=g)].mean(1),
                 l_[torch.randint(0, len(l_), (resamples, len(l_)), generator=g)].mean(1))
    out: Dict[str, Any] = {"small": b, "large": big, "batches": [len(small), len(large)]}
    for k, v in point.items():
        out[k] = float(v)
        out[k + "_95"] = list(analysis._interval(boot[k].tolist()))
    return out


def measure(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, small: int = SMALL,
            large: int = LARGE, per_round: int = PER_ROUND, min_rounds: int = MIN_ROUNDS,
            rounds: int = ROUNDS, seed: int = SEED) -> Dict[str, Any]:
    """The estimate at the model's weights, in rounds of ``per_round`` sequences of each size
    until |G|^2's 95% interval lies above zero (``settled``) or ``rounds`` are spent."""
    g = torch.Generator().manual_seed(seed)
    norms_small: List[float] = []
    norms_large: List[float] = []
    for done in range(1, rounds + 1):
        norms_small += squared_norms(model, x, y, small, max(1, per_round // small), g)
        norms_large += squared_norms(model, x, y, large, max(1, per_round // large), g)
        e = estimate(norms_small, norms_large, small, large)
        if done >= min_rounds and e["g2_95"][0] > 0:
            break
    e.update(rounds=done, settled=e["g2_95"][0] > 0)
    return e


def _config(command: str, out: str) -> config.Config:
    """The Config of a recorded run's ``scaleopt train`` command, writing into ``out``."""
    parser = argparse.ArgumentParser(prog="scaleopt")
    train.add_parser(parser.add_subparsers())
    args = parser.parse_args(shlex.split(command)[1:])
    cfg = config.configured(args, options.given(args), config.GPT_DEFAULTS)
    return dataclasses.replace(cfg, out=out, progress=False, checkpoint_every=None,
                               keep_checkpoints=1)


def at_checkpoints(folder: str, batch: Optional[int] = None,
                   names: Optional[Sequence[str]] = None, threads: Optional[int] = None,
                   **how: Any) -> Dict[str, Any]:
    """B_simple for each optimizer of the study in ``folder`` (its ``study.json``) and each
    target its chosen cell's seed-0 run at ``batch`` reached: that run trained again to the
    crossing's step (with its own thread count), checkpointed, and measured there
    (:func:`measure` with ``how``, on ``threads`` threads: default, every core)."""
    study = json.loads((pathlib.Path(folder) / "study.json").read_text())
    proto, unit = study["protocol"], analysis._per_unit(study["rows"])
    batch = batch or min(proto["batch_sizes"])
    if batch not in proto["batch_sizes"]:
        raise ValueError(f"--batch {batch}: the study ran batches {proto['batch_sizes']}")
    unknown = [n for n in names or () if n not in proto["optimizers"]]
    if unknown:
        raise ValueError(f"--optimizers {unknown}: the study ran {proto['optimizers']}")
    cells, start, found = analysis.cells(study), time.perf_counter(), []
    for name in names or proto["optimizers"]:
        cell = cells.get(name, {}).get(batch)
        row = next((r for r in (cell or {}).get("runs", []) if r["seed"] == 0), None)
        if row is None or not analysis._finite(row.get("test_loss")):
            continue
        at = {t: analysis.crossing(row["curve"], t, unit) for t in proto["targets"]}
        for t, s in at.items():
            if s is None:
                found.append({"optimizer": name, "batch": batch, "lr": row["lr"],
                              "warmup": row["warmup"], "beta2": analysis.beta2_of(row),
                              "target": t, "reached": False})
        found += _measured_run(row, {t: s for t, s in at.items() if s is not None}, unit,
                               threads or os.cpu_count() or 1, how)
    return {"batch": batch, "measurements": found, "time_s": time.perf_counter() - start,
            "threads": threads or os.cpu_count() or 1,
            **{k: how.get(k, v) for k, v in (("small", SMALL), ("large", LARGE),
                                              ("per_round", PER_ROUND),
                                              ("min_rounds", MIN_ROUNDS), ("rounds", ROUNDS))}}


def _measured_run(row: Dict[str, Any], crossings: Dict[float, float], unit: float,
                  threads: int, how: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``row``'s run trained again, stopping (with a checkpoint) at each crossing's step in
    turn and measured there."""
    found = []
    recorded = {int(s): loss for s, loss in row["curve"]}
    with tempfile.TemporaryDirectory(prefix="scaleopt-noise-") as tmp:
        cfg = _config(row["command"], tmp)
        resumed = False
        for target, s in sorted(crossings.items(), key=lambda kv: kv[1]):
            step = max(1, round(s))
            r = trainer.run(dataclasses.replace(cfg, stop_after=step,
                                                resume=tmp if resumed else None))
            resumed = True
            again = {h["step"]: h["test_loss"] for h in r["history"] if h["step"] in recorded}
            t = trainer.build(dataclasses.replace(cfg, resume=tmp), 0, 1)
            test = trainer._evaluate(t.model, t.data[2], t.data[3])[0] / unit
            print(f"{row['optimizer']:8s} batch {row['batch_size']:5d}  target {target:g}  "
                  f"step {step}", file=sys.stderr, flush=True)
            torch.set_num_threads(threads)
            e = measure(t.model, t.data[0], t.data[1], **how)
            found.append({"optimizer": row["optimizer"], "batch": row["batch_size"],
                          "lr": row["lr"], "warmup": row["warmup"],
                          "beta2": analysis.beta2_of(row), "seed": row["seed"],
                          "target": target, "reached": True, "crossing": s, "step": step,
                          "test_at_step": test,
                          "reproduced": all(recorded[k] == v for k, v in again.items()),
                          "largest_difference": max(abs(recorded[k] - v) / unit
                                                    for k, v in again.items()),
                          "evaluations_compared": len(again), **e})
    return found


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------


def add_parser(studies: Any) -> argparse.ArgumentParser:
    s = studies.add_parser(
        "noise-scale", help="B_simple at checkpoints of a large-batch study's runs",
        description=options.plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("dir", metavar="DIR", help="a finished large-batch study's folder")
    s.add_argument("--batch", type=options.positive_int,
                   help="the batch size whose chosen runs are measured (default: the smallest)")
    options.add_optimizers(s, "the optimizers measured (default: the study's)")
    s.add_argument("--small", type=options.positive_int, default=SMALL,
                   help=f"the small batch, in sequences (default: {SMALL})")
    s.add_argument("--large", type=options.positive_int, default=LARGE,
                   help=f"the large batch, in sequences (default: {LARGE})")
    s.add_argument("--per-round", type=options.positive_int, default=PER_ROUND,
                   help=f"sequences of each size per round (default: {PER_ROUND})")
    options.add_rounds(s, ROUNDS, "rounds at most per checkpoint")
    options.add_threads(s, "threads of the measurement (the runs are trained again with their "
                           "own; default: every core)")
    s.add_argument("--within", type=float, default=WITHIN,
                   help="how far (bits per byte) a rerun's evaluations may lie from the recorded "
                        f"ones before the command fails (default: {WITHIN})")
    s.set_defaults(func=command)
    return s


def command(args: argparse.Namespace) -> int:
    folder = pathlib.Path(args.dir)
    if not (folder / "study.json").exists():
        raise ValueError(f"{args.dir}: no finished study there (no study.json)")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    if not args.within >= 0:
        raise ValueError(f"--within must be at least 0, got {args.within}")
    if not args.small < args.large:
        raise ValueError(f"--small ({args.small}) must be below --large ({args.large})")
    result = at_checkpoints(args.dir, args.batch, args.optimizers, small=args.small,
                            threads=args.threads, large=args.large, per_round=args.per_round,
                            rounds=args.rounds)
    result["within"] = args.within
    (folder / study_report.NOISE_FILE).write_text(json.dumps(result, indent=1))
    study = json.loads((folder / "study.json").read_text())
    study_report.write(study, str(folder))
    for m in result["measurements"]:
        line = study_report.noise_line(m, " sequences")
        print(f"{m['optimizer']}, target {m['target']:g}: {line}")
    print(f"written: {folder / study_report.NOISE_FILE}, and the study's report again")
    same = all(m.get("largest_difference", 0.0) <= args.within for m in result["measurements"])
    return options.EXIT_OK if same else options.EXIT_FAILED
