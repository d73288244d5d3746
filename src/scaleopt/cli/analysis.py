"""What a large-batch study's runs say (:func:`analyse`): each cell's tuned rate, its seeds'
mean and spread and its tuning resolution, the differences between optimizers paired by seed
and called only where Holm's correction over the page's comparisons and the cells' tuning
resolution leave them, how the tuned rate grows with the batch, the steps to a target loss
(crossings after the warm-up) with McCandlish et al.'s fit S = S_min (1 + B_crit / B) and its
lack-of-fit test, and the gradient noise scale B_simple at the same loss. Pure Python over the
study's JSON, so that the sentences of results can always be made again from it.
"""

from __future__ import annotations

import math
import random
import shlex
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: two-sided 95% quantiles of Student's t, by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228}
#: measurements of the noise scale taken around a run's crossing of a target (the nearest)
NOISE_NEAR = 10
#: bootstrap resamples, and the generator's seed (the analysis is the same every time)
RESAMPLES, BOOT_SEED = 400, 0
#: the family-wise error rate of the page's comparisons (Holm), and the level of the fit's
#: lack-of-fit test
ALPHA = 0.05


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if not math.isfinite(t):
        return 0.0 if not math.isnan(t) else 1.0
    return beta_inc(df / 2, 0.5, df / (df + t * t))


def f_upper(f: float, d1: int, d2: int) -> float:
    """P(F >= f) for Fisher's F with (``d1``, ``d2``) degrees of freedom."""
    if f <= 0:
        return 1.0
    return beta_inc(d2 / 2, d1 / 2, d2 / (d2 + d1 * f))


def holm(pvalues: Dict[Any, float], alpha: float = ALPHA) -> Dict[Any, bool]:
    """Holm's step-down correction: which hypotheses are rejected with family-wise error rate
    ``alpha`` (the smallest p against alpha / m, the next against alpha / (m - 1), ... until
    one is not)."""
    order = sorted(pvalues, key=lambda k: (pvalues[k], str(k)))
    out, going = {}, True
    for i, k in enumerate(order):
        going = going and pvalues[k] <= alpha / (len(order) - i)
        out[k] = going
    return out


def score_key(rows: Sequence[Dict[str, Any]]) -> str:
    """The reported score: bits per byte for text, else the test loss (lower is better)."""
    return "test_bits_per_byte" if any("tokens" in r for r in rows) else "test_loss"


def _per_unit(rows: Sequence[Dict[str, Any]]) -> float:
    """A curve's losses (nats) in the score's unit."""
    return math.log(2) if score_key(rows) == "test_bits_per_byte" else 1.0


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def beta2_of(row: Dict[str, Any]) -> Optional[float]:
    """A run's beta2 (None for an optimizer without betas): its row's ``betas``, or for rows
    recorded before they were kept there, its command's ``--betas``."""
    if row.get("betas"):
        return float(row["betas"][1])
    args = shlex.split(row.get("command", ""))
    return float(args[args.index("--betas") + 2]) if "--betas" in args else None


def setting(row: Dict[str, Any]) -> Tuple[Any, Optional[float]]:
    """What a cell tunes beside the rate: the run's (warm-up, beta2)."""
    return row.get("warmup"), beta2_of(row)


def _dev(row: Dict[str, Any]) -> float:
    return row["dev_loss"] if _finite(row.get("dev_loss")) else math.inf


def mean_sd(values: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired(a: Sequence[float], b: Sequence[float]) -> Dict[str, Any]:
    """The difference a - b paired by seed: its mean, the half-width of its 95% interval
    (Student's t; none for one seed), the two-sided p of the paired t-test, and whether the
    interval excludes 0 (``clear``; :func:`analyse` then corrects it for the family)."""
    d = [x - y for x, y in zip(a, b)]
    m, sd = mean_sd(d)
    half = T95.get(len(d) - 1, 1.96) * sd / math.sqrt(len(d)) if len(d) > 1 else math.inf
    if len(d) < 2:
        p = 1.0
    else:
        p = t_two_sided(m / (sd / math.sqrt(len(d))) if sd > 0 else math.copysign(math.inf, m)
                        if m else math.nan, len(d) - 1)
    return {"mean": m, "half_width": half, "n": len(d), "p": p, "clear": abs(m) > half}


def resolution(tried: Sequence[Sequence[float]], lr: float) -> float:
    """How far the grid's chosen point may lie above the best rate between its neighbours:
    the chosen development loss minus the minimum of the parabola in log(rate) through it and
    its two neighbours (0 where that parabola opens downwards); inf on the grid's edge or next
    to a diverged rate (the chosen point is then not bracketed)."""
    rates = [t[0] for t in tried]
    i = rates.index(lr)
    if i == 0 or i == len(rates) - 1:
        return math.inf
    (x0, y0), (x1, y1), (x2, y2) = [(math.log(tried[j][0]), tried[j][1]) for j in (i - 1, i, i + 1)]
    if not all(map(math.isfinite, (y0, y1, y2))):
        return math.inf
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    if a <= 0:
        return 0.0
    c = y1 - a * x1 * x1 - b * x1
    return max(0.0, y1 - (c - b * b / (4 * a)))


def cells(study: Dict[str, Any]) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """optimizer -> batch -> the cell: the rates (and warm-ups) tried (seed 0), the chosen
    rate and warm-up (lowest development loss), whether the rate lies on the edge of what was
    tried at that warm-up, and the chosen setting's runs by seed with their scores' mean and
    spread. ``tried``: (rate, development loss, test score, warm-up) at the chosen warm-up
    and beta2, ``warmups_tried`` and ``beta2s_tried``: each one tried -> its best development
    loss; losses in the score's unit."""
    rows, key = study["rows"], score_key(study["rows"])
    unit = _per_unit(rows)
    out: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for name in study["protocol"]["optimizers"]:
        for b in study["protocol"]["batch_sizes"]:
            mine = [r for r in rows if r["optimizer"] == name and r["batch_size"] == b]
            everything = [r for r in mine if r["seed"] == 0]
            if not everything:
                continue
            best = min(everything, key=_dev)
            warm, beta2 = chosen = setting(best)
            tried = sorted((r for r in everything if setting(r) == chosen),
                           key=lambda r: r["lr"])
            runs = sorted((r for r in mine if r["lr"] == best["lr"] and setting(r) == chosen),
                          key=lambda r: r["seed"])
            warmups: Dict[str, float] = {}
            beta2s: Dict[str, float] = {}
            for r in everything:
                for by, k in ((warmups, r.get("warmup")), (beta2s, beta2_of(r))):
                    by[str(k)] = min(by.get(str(k), math.inf), _dev(r) / unit)
            scores = [r[key] if _finite(r.get(key)) else math.inf for r in runs]
            finite = all(math.isfinite(s) for s in scores)
            cell = {"tried": [[r["lr"], _dev(r) / unit, r.get(key, math.nan), r.get("warmup")]
                              for r in tried],
                    "lr": best["lr"], "warmup": warm, "warmups_tried": warmups,
                    "beta2": beta2, "beta2s_tried": beta2s,
                    "runs": runs, "scores": scores,
                    "steps": best["steps"], "tokens": best.get("tokens"),
                    "edge": (len(tried) > 1 and math.isfinite(_dev(best))
                             and best["lr"] in (tried[0]["lr"], tried[-1]["lr"]))}
            if finite:
                cell["mean"], cell["sd"] = mean_sd(scores)
            cell["resolution"] = resolution(cell["tried"], best["lr"])
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


def _seed_steps(cell_of: Dict[int, Dict[str, Any]], target: float, unit: float,
                warmup: float = 0.0) -> Dict[int, List[float]]:
    """batch -> each seed's steps to ``target``, at the batch sizes where every seed has one
    after its warm-up (``warmup``: the share of a run's steps, or a number of steps)."""
    steps: Dict[int, List[float]] = {}
    for b, c in sorted(cell_of.items()):
        s = [crossing(r.get("curve", ()), target, unit) for r in c["runs"]]
        shares = [r.get("warmup", warmup) or 0.0 for r in c["runs"]]
        ends = [int(w * r["steps"]) if w < 1 else int(w) for w, r in zip(shares, c["runs"])]
        if s and all(x is not None and x > end for x, end in zip(s, ends)):
            steps[b] = s
    return steps


def steps_to(cell_of: Dict[int, Dict[str, Any]], target: float, unit: float,
             warmup: float = 0.0) -> Dict[str, float]:
    """batch (as a string) -> the seeds' mean steps to ``target``, where every seed has one
    after the warm-up."""
    return {str(b): statistics.fmean(s)
            for b, s in _seed_steps(cell_of, target, unit, warmup).items()}


def lack_of_fit(steps: Dict[int, List[float]], s_min: float, b_crit: float) -> Dict[str, Any]:
    """The fit's lack-of-fit F test on log S: the residuals beyond the seeds' own scatter
    (pure error) against that scatter; its p (None with no degree of freedom left), the
    residuals of the batch means, and whether a larger batch divides the steps by more than
    its own factor (a super-linear speed-up, which the model cannot give)."""
    logs = {b: [math.log(x) for x in s] for b, s in steps.items()}
    fitted = {b: math.log(s_min) + math.log1p(b_crit / b) for b in steps}
    ss_res = sum((x - fitted[b]) ** 2 for b, xs in logs.items() for x in xs)
    ss_pe = sum((x - statistics.fmean(xs)) ** 2 for xs in logs.values() for x in xs)
    df_lof, df_pe = len(steps) - 2, sum(map(len, logs.values())) - len(steps)
    p = None
    if df_lof > 0 and df_pe > 0 and ss_pe > 0:
        p = f_upper(((ss_res - ss_pe) / df_lof) / (ss_pe / df_pe), df_lof, df_pe)
    sizes = sorted(steps)
    means = {b: statistics.fmean(steps[b]) for b in sizes}
    superlinear = [[b1, b2] for b1, b2 in zip(sizes, sizes[1:]) if means[b1] / means[b2] > b2 / b1]
    return {"p": p, "residuals": {str(b): statistics.fmean(logs[b]) - fitted[b] for b in sizes},
            "superlinear": superlinear}


def bcrit(cell_of: Dict[int, Dict[str, Any]], target: float, unit: float,
          warmup: float = 0.0) -> Optional[Dict[str, Any]]:
    """The fit over the batch sizes whose every seed reached ``target`` after the warm-up, its
    lack of fit (:func:`lack_of_fit`; ``holds`` only where the test leaves it and no speed-up
    is super-linear), and a residual-bootstrap 95% interval (the fit's residuals resampled onto
    its fitted values, so that the lack of fit widens it); None with fewer than three such
    batch sizes."""
    steps = _seed_steps(cell_of, target, unit, warmup)
    if len(steps) < 3:
        return None
    points = [(b, x) for b, s in steps.items() for x in s]
    smin, bc = fit_bcrit(points)
    fitted = [math.log(smin) + math.log1p(bc / b) for b, _ in points]
    residuals = [math.log(x) - f for (_, x), f in zip(points, fitted)]
    rng, boots = random.Random(BOOT_SEED), []
    for _ in range(RESAMPLES):
        boots.append(fit_bcrit([(b, math.exp(f + rng.choice(residuals)))
                                for (b, _), f in zip(points, fitted)])[1])
    check = lack_of_fit(steps, smin, bc)
    holds = (check["p"] is None or check["p"] >= ALPHA) and not check["superlinear"]
    return {"target": target, "s_min": smin, "b_crit": bc, "b_crit_95": _interval(boots),
            "batches": list(steps), "steps": {b: statistics.fmean(s) for b, s in steps.items()},
            "lack_of_fit": check, "holds": holds}


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
    warmup = proto.get("config", {}).get("warmup", 0.0) or 0.0
    out: Dict[str, Any] = {"score": score_key(rows), "cells": {}, "batches": {}, "optimizers": {}}
    for name, cell_of in by.items():
        out["cells"][name] = {str(b): {k: v for k, v in c.items() if k != "runs"}
                              for b, c in cell_of.items()}
        smallest = cell_of.get(min(cell_of)) if cell_of else None
        out["optimizers"][name] = {
            "rate_exponent": rate_exponent(cell_of), "scaling": proto["scaling"][name],
            "targets": [{"fit": bcrit(cell_of, t, unit, warmup),
                         "steps": steps_to(cell_of, t, unit, warmup),
                         "noise": b_simple(smallest["runs"], t, unit) if smallest else None,
                         "noise_batch": min(cell_of) if cell_of else None, "target": t}
                        for t in proto["targets"]]}
    for b in proto["batch_sizes"]:
        out["batches"][str(b)] = _ranking(by, b)
    _call(out, by)
    return out


def _call(out: Dict[str, Any], by: Dict[str, Dict[int, Dict[str, Any]]]) -> None:
    """Which differences are called: Holm's correction over every comparison the report makes
    (each optimizer against the lowest and against AdamW, at every batch size), and then only
    where the difference also exceeds both cells' tuning resolution (either tuned rate could
    lie that much better between the grid's points). Each difference keeps its uncorrected
    ``p``, ``holm`` and ``resolution``; ``clear`` is the call."""
    family = {(b, kind, n): d["p"] for b, r in out["batches"].items()
              for kind in ("against_best", "against_adamw") for n, d in r[kind].items()}
    kept = holm(family)
    for (b, kind, n), ok in kept.items():
        r = out["batches"][b]
        d = r[kind][n]
        other = r["order"][0] if kind == "against_best" else "adamw"
        res = by[n][int(b)]["resolution"] + by[other][int(b)]["resolution"]
        d.update(holm=ok, resolution=res, clear=ok and abs(d["mean"]) > res)
    out["comparisons"] = len(family)


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
