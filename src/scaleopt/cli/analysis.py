"""What a large-batch study's runs say (:func:`analyse`): each cell's tuned rate and its seeds'
mean and spread, the differences between optimizers paired by seed, how the tuned rate grows
with the batch, the steps to a target loss with McCandlish et al.'s fit
S = S_min (1 + B_crit / B), and the gradient noise scale B_simple at the same loss. Pure
Python over the study's JSON, so that the sentences of results can always be made again from it.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: two-sided 95% quantiles of Student's t, by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}
#: measurements of the noise scale taken around a run's crossing of a target (the nearest)
NOISE_NEAR = 10
#: bootstrap resamples, and the generator's seed (the analysis is the same every time)
RESAMPLES, BOOT_SEED = 400, 0


def score_key(rows: Sequence[Dict[str, Any]]) -> str:
    """The reported score: bits per byte for text, else the test loss (lower is better)."""
    return "test_bits_per_byte" if any("tokens" in r for r in rows) else "test_loss"


def _per_unit(rows: Sequence[Dict[str, Any]]) -> float:
    """A curve's losses (nats) in the score's unit."""
    return math.log(2) if score_key(rows) == "test_bits_per_byte" else 1.0


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _dev(row: Dict[str, Any]) -> float:
    return row["dev_loss"] if _finite(row.get("dev_loss")) else math.inf


def mean_sd(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired(a: Sequence[float], b: Sequence[float]) -> Dict[str, Any]:
    """The difference a - b paired by seed: its mean, the half-width of its 95% interval
    (Student's t; none for one seed), and whether the interval excludes 0."""
    d = [x - y for x, y in zip(a, b)]
    m, sd = mean_sd(d)
    half = T95.get(len(d) - 1, 1.96) * sd / math.sqrt(len(d)) if len(d) > 1 else math.inf
    return {"mean": m, "half_width": half, "n": len(d), "clear": abs(m) > half}


def cells(study: Dict[str, Any]) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """optimizer -> batch -> the cell: the rates tried (seed 0), the chosen rate (lowest
    development loss), whether it lies on the edge of what was tried, and the chosen rate's
    runs by seed with their scores' mean and spread. ``tried``: (rate, development loss,
    test score), the losses in the score's unit."""
    rows, key = study["rows"], score_key(study["rows"])
    unit = _per_unit(rows)
    out: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for name in study["protocol"]["optimizers"]:
        for b in study["protocol"]["batch_sizes"]:
            mine = [r for r in rows if r["optimizer"] == name and r["batch_size"] == b]
            tried = sorted((r for r in mine if r["seed"] == 0), key=lambda r: r["lr"])
            if not tried:
                continue
            best = min(tried, key=_dev)
            runs = sorted((r for r in mine if r["lr"] == best["lr"]), key=lambda r: r["seed"])
            scores = [r[key] if _finite(r.get(key)) else math.inf for r in runs]
            finite = all(math.isfinite(s) for s in scores)
            cell = {"tried": [[r["lr"], _dev(r) / unit, r.get(key, math.nan)] for r in tried],
                    "lr": best["lr"], "runs": runs, "scores": scores,
                    "steps": best["steps"], "tokens": best.get("tokens"),
                    "edge": (len(tried) > 1 and math.isfinite(_dev(best))
                             and best["lr"] in (tried[0]["lr"], tried[-1]["lr"]))}
            if finite:
                cell["mean"], cell["sd"] = mean_sd(scores)
            out.setdefault(name, {})[b] = cell
    return out


def crossing(curve: Sequence[Sequence[float]], target: float, unit: float) -> Optional[float]:
    """The step at which a curve of (step, loss) first reaches ``target`` (in the score's
    unit), read between the evaluations around it linearly in log(step) (loss curves are
    closer to straight there); None if it never does, or already had at the first evaluation
    (the step is then only bounded)."""
    prev = None
    for step, loss in curve:
        value = loss / unit
        if value <= target:
            if prev is None:
                return None
            s0, v0 = prev
            share = (v0 - target) / (v0 - value)
            return math.exp(math.log(s0) + share * (math.log(step) - math.log(s0)))
        prev = (step, value)
    return None


def fit_bcrit(points: Sequence[Tuple[int, float]]) -> Tuple[float, float]:
    """McCandlish et al.'s S = S_min (1 + B_crit / B) fitted to (B, S) points by least squares
    on log S: (S_min, B_crit). B_crit is searched over a wide log range; a value at the range's
    end means the points do not bound it."""
    lo, hi = math.log(min(b for b, _ in points) / 1e3), math.log(max(b for b, _ in points) * 1e3)

    def residual(log_bc: float) -> Tuple[float, float]:
        bc = math.exp(log_bc)
        logs = [math.log(s) - math.log1p(bc / b) for b, s in points]
        log_smin = statistics.fmean(logs)
        return sum((x - log_smin) ** 2 for x in logs), log_smin

    for _ in range(80):  # ternary search: the residual is unimodal in log B_crit
        m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if residual(m1)[0] <= residual(m2)[0]:
            hi = m2
        else:
            lo = m1
    log_bc = (lo + hi) / 2
    return math.exp(residual(log_bc)[1]), math.exp(log_bc)


def _interval(values: List[float]) -> Tuple[float, float]:
    values = sorted(values)
    return values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))]


def _seed_steps(cell_of: Dict[int, Dict[str, Any]], target: float,
                unit: float) -> Dict[int, List[float]]:
    """batch -> each seed's steps to ``target``, at the batch sizes where every seed has one."""
    steps: Dict[int, List[float]] = {}
    for b, c in sorted(cell_of.items()):
        s = [crossing(r.get("curve", ()), target, unit) for r in c["runs"]]
        if s and all(x is not None for x in s):
            steps[b] = s
    return steps


def steps_to(cell_of: Dict[int, Dict[str, Any]], target: float, unit: float) -> Dict[str, float]:
    """batch (as a string) -> the seeds' mean steps to ``target``, where every seed has one."""
    return {str(b): statistics.fmean(s) for b, s in _seed_steps(cell_of, target, unit).items()}


def bcrit(cell_of: Dict[int, Dict[str, Any]], target: float, unit: float) -> Optional[Dict[str, Any]]:
    """The fit over the batch sizes whose every seed reached ``target``, with a bootstrap 95%
    interval (seeds resampled within each batch size); None with fewer than three such
    batch sizes."""
    steps = _seed_steps(cell_of, target, unit)
    if len(steps) < 3:
        return None
    smin, bc = fit_bcrit([(b, x) for b, s in steps.items() for x in s])
    rng, boots = random.Random(BOOT_SEED), []
    for _ in range(RESAMPLES):
        boots.append(fit_bcrit([(b, rng.choice(s)) for b, s in steps.items() for _ in s])[1])
    return {"target": target, "s_min": smin, "b_crit": bc, "b_crit_95": _interval(boots),
            "batches": list(steps), "steps": {b: statistics.fmean(s) for b, s in steps.items()}}


def b_simple(runs: Sequence[Dict[str, Any]], target: float, unit: float) -> Optional[Dict[str, Any]]:
    """B_simple = tr(Sigma) / |G|^2 at ``target``: from each run's ``NOISE_NEAR`` measurements
    nearest the step where it reached the target, pooled over the runs (seeds), the ratio of
    the means; a bootstrap 95% interval over the measurements. None where no run measured and
    reached it."""
    near: List[Tuple[float, float]] = []
    for r in runs:
        at = crossing(r.get("curve", ()), target, unit)
        if at is None or not r.get("noise"):
            continue
        nearest = sorted(r["noise"], key=lambda m: abs(m[0] - at))[:NOISE_NEAR]
        near += [(g2, trace) for _, g2, trace in nearest]
    if not near:
        return None

    def ratio(ms: Sequence[Tuple[float, float]]) -> float:
        g2 = statistics.fmean(m[0] for m in ms)
        return statistics.fmean(m[1] for m in ms) / g2 if g2 > 0 else math.inf

    rng = random.Random(BOOT_SEED)
    boots = [ratio([rng.choice(near) for _ in near]) for _ in range(RESAMPLES)]
    return {"target": target, "b_simple": ratio(near), "b_simple_95": _interval(boots),
            "measurements": len(near)}


def rate_exponent(cell_of: Dict[int, Dict[str, Any]]) -> Optional[float]:
    """k in lr ~ B^k: the least-squares slope of log(tuned rate) against log(batch)."""
    pts = [(math.log(b), math.log(c["lr"])) for b, c in cell_of.items()]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    return (sum((x - mx) * (y - my) for x, y in pts)
            / sum((x - mx) ** 2 for x, _ in pts))


def analyse(study: Dict[str, Any]) -> Dict[str, Any]:
    """The study's numbers: per optimizer and batch, the cell; per batch, the ranking and the
    paired differences; per optimizer, the rates' exponent and, per target, B_crit and
    B_simple. Keys are strings (the JSON's)."""
    rows, proto = study["rows"], study["protocol"]
    unit, by = _per_unit(rows), cells(study)
    out: Dict[str, Any] = {"score": score_key(rows), "cells": {}, "batches": {}, "optimizers": {}}
    for name, cell_of in by.items():
        out["cells"][name] = {str(b): {k: v for k, v in c.items() if k != "runs"}
                              for b, c in cell_of.items()}
        smallest = cell_of.get(min(cell_of)) if cell_of else None
        out["optimizers"][name] = {
            "rate_exponent": rate_exponent(cell_of), "scaling": proto["scaling"][name],
            "targets": [{"fit": bcrit(cell_of, t, unit), "steps": steps_to(cell_of, t, unit),
                         "noise": b_simple(smallest["runs"], t, unit) if smallest else None,
                         "noise_batch": min(cell_of) if cell_of else None, "target": t}
                        for t in proto["targets"]]}
    for b in proto["batch_sizes"]:
        out["batches"][str(b)] = _ranking(by, b)
    return out


def _ranking(by: Dict[str, Dict[int, Dict[str, Any]]], b: int) -> Dict[str, Any]:
    """At batch ``b``: the optimizers by mean score, and each one's difference from the best
    (paired by seed)."""
    done = {n: c[b] for n, c in by.items() if b in c and "mean" in c[b]}
    order = sorted(done, key=lambda n: done[n]["mean"])
    if not order:  # (an interrupted study: nothing finished at this batch)
        return {"order": [], "against_best": {}, "against_adamw": {}, "diverged": []}
    best = done[order[0]]
    against = {}
    for n in order[1:]:
        k = min(len(done[n]["scores"]), len(best["scores"]))
        against[n] = paired(done[n]["scores"][:k], best["scores"][:k])
    against_adamw = {n: paired(done[n]["scores"], done["adamw"]["scores"])
                     for n in order if n != "adamw" and "adamw" in done
                     and len(done[n]["scores"]) == len(done["adamw"]["scores"])}
    return {"order": order, "against_best": against, "against_adamw": against_adamw,
            "diverged": sorted(n for n, c in by.items() if b in c and "mean" not in c[b])}
