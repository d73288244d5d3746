"""A large-batch study's files: ``study.json`` (the protocol and every run), ``study.csv``,
``study.md`` (:func:`markdown`: the tables and the sentences of results, all made from the
JSON by :mod:`.analysis`) and ``study.png``."""

from __future__ import annotations

import csv
import json
import math
import pathlib
from typing import Any, Dict, List, Optional

from . import analysis, report

#: the file a study's folder keeps ``scaleopt study noise-scale``'s measurements in
NOISE_FILE = "noise_scale.json"


def write(study: Dict[str, Any], out: str) -> Dict[str, str]:
    """The study's files in ``out`` (its analysis added to ``study`` and the JSON); their
    paths."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "study.json", "csv": folder / "study.csv",
             "md": folder / "study.md", "png": folder / "study.png"}
    keys = ["optimizer", "batch_size", "lr", "seed", "steps", "tokens", "dev_loss", "test_loss",
            "dev_bits_per_byte", "test_bits_per_byte", "test_accuracy", "diverged", "time_s",
            "command"]
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(study["rows"])
    kept = folder / NOISE_FILE  # measured at checkpoints by ``study noise-scale``
    if kept.exists():
        study["noise_scale"] = json.loads(kept.read_text())
    a = study["analysis"] = analysis.analyse(study)
    files["json"].write_text(json.dumps(study, indent=1))
    files["md"].write_text(markdown(study, a))
    plt = report._plt()
    if plt is None:
        del files["png"]
    else:
        report.study_plot(plt, study["title"], a, f"test {_unit(a['score'])}", CLASSES,
                          files["png"])
    return {k: str(v) for k, v in files.items()}


def title(p: Any) -> str:
    """A study's title, from its protocol (:class:`.study.Protocol`)."""
    base, n = p.base, p.beta2_batches
    largest = "largest batch size" if n == 1 else f"{n} largest batch sizes"
    return (("QUICK FORM (one seed, few cells: not evidence): " if p.quick else "")
            + f"{base.dataset}, {base.train_size * base.epochs:,} examples per run, each "
            f"optimizer's rate tuned at each batch size, {p.seeds} seed"
            f"{'s' if p.seeds != 1 else ''} per chosen rate, warm-up {base.warmup:g}"
            + (f" (at the {p.warmup_batches} largest batch sizes tuned among "
               f"{', '.join(f'{w:g}' for w in p.warmups)})" if p.warmups else "")
            + (f", beta2 {base.betas[1]:g}" if base.betas else "")
            + (f" (at the {largest} tuned among "
               f"{', '.join(f'{b:g}' for b in p.beta2s)})" if p.beta2s else "")
            + f", {base.schedule} decay")


def _unit(key: str) -> str:
    return "bits per byte" if key == "test_bits_per_byte" else "loss"


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "unbounded"


def markdown(study: Dict[str, Any], a: Optional[Dict[str, Any]] = None) -> str:
    """The study's tables and its sentences of results, from its JSON alone."""
    a = a if a is not None else analysis.analyse(study)
    md = [study["title"], "", *_table(study, a),
          *_baseline(a, study["protocol"]["config"]), "", *_findings(study, a), "",
          *_rates(study, a), "", *_targets(study, a), "", _cost(study)]
    return "\n".join(md) + "\n"


def _table(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    proto, names = study["protocol"], study["protocol"]["optimizers"]
    lines = [f"test {_unit(a['score'])} of each optimizer's tuned rate: mean ± standard "
             f"deviation over the seeds (the rate; † where it lies on the edge of the rates "
             f"tried)", "",
             "| batch | steps | " + " | ".join(map(_n, names)) + " |",
             "|---:|---:|" + "---:|" * len(names)]
    for b in proto["batch_sizes"]:
        row, steps = [str(b)], "-"
        for n in names:
            c = a["cells"].get(n, {}).get(str(b))
            if c is None:
                row.append("-")
                continue
            steps = str(c["steps"])
            mark = "†" if c["edge"] else ""
            if len(c.get("warmups_tried", {})) > 1:  # the warm-up tuned too: the one chosen
                mark += f", warm-up {c['warmup']:g}"
            if len(c.get("beta2s_tried", {})) > 1:  # and beta2
                mark += f", beta2 {c['beta2']:g}"
            row.append(f"diverged (lr {c['lr']:.3g}{mark})" if "mean" not in c else
                       f"{c['mean']:.3f} ± {c['sd']:.3f} (lr {c['lr']:.3g}{mark})")
        lines.append("| " + " | ".join([row[0], steps] + row[1:]) + " |")
    return lines


def _baseline(a: Dict[str, Any], cfg: Dict[str, Any]) -> List[str]:
    """The unigram baseline of the study's test split (``cfg``: its runs' configuration; a
    text study recorded before the splits had names ran on the tail)."""
    if a["score"] != "test_bits_per_byte":
        return []
    from . import data

    source = data.corpus_of(cfg.get("dataset", "text"))
    return ["", f"The test split's unigram baseline (the bytes' frequencies alone): "
                f"{source.unigram_bits_per_byte('test', cfg.get('text_split', 'tail')):.3f} "
                f"bits per byte."]


def _listed(items: List[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


#: the optimizers as their classes are named (scaleopt.LAMB, ...)
CLASSES = {"lamb": "LAMB", "lans": "LANS", "adamw": "AdamW", "muon": "Muon",
           "momentum": "Momentum"}


def _n(name: str) -> str:
    return CLASSES.get(name, name)


def _scale(study: Dict[str, Any]) -> str:
    """The model and the budget: parameters (a gpt model's), tokens or examples, steps."""
    cfg, rows = study["protocol"]["config"], study["rows"]
    steps = {r["batch_size"]: r["steps"] for r in rows}
    small, large = min(steps), max(steps)
    what = f"{cfg['train_size']:,} examples once"
    if cfg.get("model") == "gpt":
        from . import models

        params = sum(p.numel() for p in models.GPT(cfg["width"], cfg["layers"],
                                                   cfg["context"]).parameters())
        tokens = cfg["train_size"] * cfg["context"]
        what = (f"a {params:,}-parameter transformer trained on {tokens:,} tokens once (about "
                f"{tokens / params:.1g} tokens per parameter)")
    return (f"{what}, in {steps[small]:,} steps at batch {small} to {steps[large]:,} at batch "
            f"{large}")


def headline(study: Dict[str, Any], a: Optional[Dict[str, Any]] = None) -> str:
    """The study's results in plain sentences (the README's): the scale and the budget, who
    is lowest, and where each optimizer is lower or higher than AdamW after the correction."""
    a = a if a is not None else analysis.analyse(study)
    batches = {b: r for b, r in a["batches"].items() if r["order"]}
    best = {b: r["order"][0] for b, r in batches.items()}
    seeds = study["protocol"]["seeds"]
    out = [f"on {_scale(study)}, each optimizer tuned at each batch size, {seeds} seed"
           f"{'s' if seeds > 1 else ''} per chosen rate:"]
    if len(set(best.values())) == 1:
        out.append(f"{_n(next(iter(best.values())))} has the lowest mean test "
                   f"{_unit(a['score'])} at every batch size.")
    else:
        out.append("the lowest mean test " + _unit(a["score"]) + ": "
                   + _listed([f"{_n(n)} at batch {b}" for b, n in best.items()]) + ".")
    said, none = [], []
    for n in study["protocol"]["optimizers"]:
        if n == "adamw":
            continue
        sides: Dict[str, List[str]] = {"lower": [], "higher": []}
        for b, r in batches.items():
            d = r["against_adamw"].get(n)
            if d is not None and d["clear"]:
                sides["lower" if d["mean"] < 0 else "higher"].append(b)
        parts = [f"{side} at batch{'es' if len(v) > 1 else ''} {_listed(v)}"
                 for side, v in sides.items() if v]
        if parts:
            said.append(f"{_n(n)} is " + " and ".join(parts))
        else:
            none.append(_n(n))
    if said or none:
        out.append(f"Against AdamW, after Holm's correction over the {a.get('comparisons', 0)} "
                   "comparisons: " + "; ".join(said + ([
                       f"{_listed(none)} {'is' if len(none) == 1 else 'are'} not told apart "
                       "from it at any batch size"] if none else [])) + ".")
    return " ".join(out)


def summary_table(study: Dict[str, Any], a: Optional[Dict[str, Any]] = None) -> List[str]:
    """The README's table: each cell's mean test score over the seeds, the lowest at each batch
    in bold, and against AdamW "lower" or "higher" where the correction keeps the difference
    (nothing where it does not)."""
    a = a if a is not None else analysis.analyse(study)
    names = [n for n in study["protocol"]["optimizers"] if n in a["cells"]]
    out = ["| batch (steps) | " + " | ".join(map(_n, names)) + " |",
           "|---|" + "---:|" * len(names)]
    for b, r in a["batches"].items():
        if not r["order"]:
            continue
        row = []
        for n in names:
            c = a["cells"][n].get(b, {})
            if "mean" not in c:
                row.append("-")
                continue
            d = r["against_adamw"].get(n)
            mark = (" (lower)" if d["mean"] < 0 else " (higher)") if d and d["clear"] else ""
            row.append((f"**{c['mean']:.3f}**" if n == r["order"][0] else f"{c['mean']:.3f}")
                       + mark)
        out.append(f"| {b} ({a['cells'][r['order'][0]][b]['steps']:,}) | " + " | ".join(row)
                   + " |")
    return out


def _findings(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Per batch: who is lowest, who is within the uncertainty, who is behind beyond it; LAMB
    against AdamW where both ran."""
    seeds = study["protocol"]["seeds"]
    out = ["In short: " + headline(study, a), "",
           "What the runs say (differences paired by seed, ± the half-width of their 95% "
           "interval; a difference is called only where Holm's correction over the report's "
           f"{a.get('comparisons', 0)} comparisons keeps it at a family-wise 5% and it exceeds "
           "both cells' tuning resolution):", ""]
    if seeds < 2:
        out += ["- One seed per cell: no difference can be told from noise, so none is "
                "called a win.", ""]
    for b, r in a["batches"].items():
        if not r["order"]:
            continue
        best, cell = r["order"][0], a["cells"][r["order"][0]][b]
        ties = [_n(n) for n, d in r["against_best"].items() if not d["clear"]]
        behind = [f"{_n(n)} (+{d['mean']:.3f} ± {d['half_width']:.3f})"
                  for n, d in r["against_best"].items() if d["clear"]]
        line = (f"- Batch {b} ({cell['steps']} steps): lowest {_n(best)} ({cell['mean']:.3f}); "
                + (f"not told apart from it: {', '.join(ties)}" if ties else
                   "no other within the uncertainty")
                + (f"; behind: {', '.join(behind)}" if behind else "") + ".")
        if r["diverged"]:
            line += f" Diverged at every rate kept: {', '.join(map(_n, r['diverged']))}."
        out.append(line)
    out += [""] + _against_adamw(study, a) + [""] + _growth(study, a)
    return out


def _against_adamw(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Each optimizer minus AdamW, both tuned at each batch, paired by seed."""
    names = [n for n in study["protocol"]["optimizers"]
             if any(n in r["against_adamw"] for r in a["batches"].values())]
    out = []
    for n in names:
        parts = []
        for b, r in a["batches"].items():
            d = r["against_adamw"].get(n)
            if d is None:
                continue
            verdict = ((f"{_n(n)} lower" if d["mean"] < 0 else "AdamW lower") if d["clear"]
                       else "not told apart")
            half = f" ± {d['half_width']:.3f}" if math.isfinite(d["half_width"]) else ""
            extra = (f", p {d['p']:.2g}, resolution {_g(d['resolution'])}"
                     if "resolution" in d else "")
            parts.append(f"batch {b}: {d['mean']:+.3f}{half}{extra} ({verdict})")
        out.append(f"- {_n(n)} minus AdamW, each tuned at each batch: " + "; ".join(parts) + ".")
    return out


def _growth(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """How much each optimizer's score worsens from the smallest to the largest batch (the
    same examples), paired by seed."""
    sizes = [str(b) for b in sorted(study["protocol"]["batch_sizes"])]
    parts = []
    for n in study["protocol"]["optimizers"]:
        ends = [a["cells"].get(n, {}).get(b, {}) for b in (sizes[0], sizes[-1])]
        if len(sizes) < 2 or not all("mean" in c for c in ends):
            continue
        d = analysis.paired(ends[1]["scores"], ends[0]["scores"])
        half = f" ± {d['half_width']:.3f}" if math.isfinite(d["half_width"]) else ""
        parts.append((d["mean"], f"{_n(n)} {d['mean']:+.3f}{half}"))
        steps = (ends[1]["steps"], ends[0]["steps"])
    if not parts:
        return []
    return [f"- From batch {sizes[0]} to batch {sizes[-1]} (the same examples in {steps[0]} "
            f"steps instead of {steps[1]}), the test {_unit(a['score'])} rose by, least first: "
            + ", ".join(p for _, p in sorted(parts)) + "."]


def _rates(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """The tuned rates against the batch size (the exponent beside the usual rule's), and
    every rate tried with its development loss."""
    rule = {"sqrt": 0.5, "linear": 1.0}
    out = ["Tuned rates against batch size (k in lr ~ B^k, by least squares over the batch "
           "sizes; the grid's points are a factor "
           f"{_grid_step(study):g} apart, so k is coarse, and each batch's grid is centred on "
           "the rule's scaling of the rate chosen at the batch before, so a k near the rule's "
           "is consistent with it, not found by tuning alone):", ""]
    for n, o in a["optimizers"].items():
        k = o["rate_exponent"]
        rates = ", ".join(f"{c['lr']:.3g}" for c in a["cells"][n].values())
        out.append(f"- {_n(n)}: {rates}" + (f"; k = {k:.2f} (its usual {o['scaling']} rule: "
                                        f"{rule[o['scaling']]:g})" if k is not None else ""))
    edges = [f"{_n(n)} at batch {b}" for n, cs in a["cells"].items()
             for b, c in cs.items() if c["edge"]]
    out += ["", "Rates on the edge of what was tried after the extensions: "
            + (", ".join(edges) if edges else "none") + ".", "",
            f"Every rate tried (seed 0; development {_unit(a['score'])}), and the tuning "
            "resolution: how far the chosen point lies above the minimum of the parabola in "
            "log(rate) through it and its neighbours:", ""]
    for n, cs in a["cells"].items():
        for b, c in cs.items():
            warm, beta2s = c.get("warmups_tried", {}), c.get("beta2s_tried", {})
            at = ([f"warm-up {c['warmup']:g}"] if len(warm) > 1 else []) + (
                [f"beta2 {c['beta2']:g}"] if len(beta2s) > 1 else [])
            best = [f"the best at each {what} tried: " + ", ".join(
                f"{w}: {d:.4f}" for w, d in tried.items())
                for what, tried in (("warm-up", warm), ("beta2", beta2s)) if len(tried) > 1]
            out.append(f"- {_n(n)}, batch {b}: " + ", ".join(
                f"{t[0]:.3g}: " + (f"{t[1]:.4f}" if math.isfinite(t[1]) else "diverged")
                for t in c["tried"])
                + (f" (at {' and '.join(at)}; {'; '.join(best)})" if at else "")
                + (f"; resolution {_g(c['resolution'])}" if "resolution" in c else ""))
    return out


def _grid_step(study: Dict[str, Any]) -> float:
    grid = sorted(study["protocol"]["grid"])
    return grid[-1] / grid[-2] if len(grid) > 1 else 2.0


def _targets(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Steps (and tokens) to each target, B_crit's fit and B_simple at the same loss."""
    if not study["protocol"]["targets"]:
        return []
    text = a["score"] == "test_bits_per_byte"
    per = study["protocol"]["config"]["context"] if text else 1
    unit = " sequences" if text else " examples"
    out = [f"Steps to a target loss in {_unit(a['score'])} (the mean over the seeds, where "
           f"every seed reached it after its warm-up" + ("; in brackets, tokens" if text else "")
           + "), and the fit S = S_min (1 + B_crit / B) over the batch sizes where they did, "
           "with its 95% residual-bootstrap interval and its lack-of-fit F test (the "
           "residuals beyond the seeds' scatter); a B_crit is given only where the test "
           "leaves the fit at 5% and no larger batch divides the steps by more than its own "
           "factor (a super-linear speed-up, which the model cannot give); elsewhere it is "
           "withdrawn. " + _b_simple_how(study)]
    names = [n for n in study["protocol"]["optimizers"] if n in a["optimizers"]]
    measured = noise_measured(study, a)
    for i, t in enumerate(study["protocol"]["targets"]):
        out += ["", f"target {t:g}:", "", "| batch | " + " | ".join(map(_n, names)) + " |",
                "|---:|" + "---:|" * len(names)]
        fits = {n: a["optimizers"][n]["targets"][i] for n in names}
        for b in study["protocol"]["batch_sizes"]:
            row = []
            for n in names:
                s = fits[n]["steps"].get(str(b))
                row.append("-" if s is None else f"{s:.0f}" + (f" ({s * b * per:,.0f})" if text else ""))
            out.append(f"| {b} | " + " | ".join(row) + " |")
        out.append("")
        out += [_fit_line(_n(n), f, unit) for n, f in fits.items()]
        out += [f"- {_n(m['optimizer'])}: {noise_line(m, unit)}" for m in measured
                if m["target"] == t]
    return out


def noise_measured(study: Dict[str, Any], a: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The measurements of ``study["noise_scale"]`` whose run is still its cell's choice."""
    noise = study.get("noise_scale") or {}
    out = []
    for m in noise.get("measurements", []):
        cell = a["cells"].get(m["optimizer"], {}).get(str(m["batch"]))
        if cell and (cell["lr"], cell.get("warmup"), cell.get("beta2")) == (
                m["lr"], m["warmup"], m.get("beta2", cell.get("beta2"))):
            out.append(m)
    return out


def noise_line(m: Dict[str, Any], unit: str) -> str:
    """One measurement as the report gives it."""
    if not m["reached"]:
        return f"not reached by its batch-{m['batch']} run"
    lo, hi = m["b_simple_95"]
    bound = f"{hi:.3g}" if math.isfinite(hi) else "unbounded"
    return (f"B_simple {m['b_simple']:.3g}{unit} [{lo:.3g}, {bound}] at step {m['step']} of "
            f"its batch-{m['batch']} run (test {m['test_at_step']:.3f} there), from "
            f"{m['batches'][0]:,} batches of {m['small']} and {m['batches'][1]:,} of "
            f"{m['large']}" + ("" if m["settled"] else
                               f"; |G|^2 not above zero after {m['rounds']} rounds")
            + _rerun(m))


def _rerun(m: Dict[str, Any]) -> str:
    """How the rerun to the checkpoint compares with the recorded run."""
    if m["reproduced"]:
        return (f"; the rerun's {m['evaluations_compared']} evaluations there equal the "
                "recorded ones")
    d = m.get("largest_difference", math.inf)
    return (f"; the rerun's {m['evaluations_compared']} evaluations there differ from the "
            f"recorded ones by at most {d:.2g}")


def _b_simple_how(study: Dict[str, Any]) -> str:
    """How B_simple was measured (under each target's fits), or why it is not given."""
    noise = study.get("noise_scale")
    if not noise:
        return ("B_simple is not given: it is measured at checkpoints by `scaleopt study "
                "noise-scale DIR`, which this study has not run.")
    return (f"B_simple (sequences) at the step where each optimizer's seed-0 run at batch "
            f"{noise['batch']} first reached the target: that run trained again to there "
            f"(its evaluations compared with the recorded ones) and checkpointed, and at the "
            f"checkpoint the squared gradient norms of independent batches of {noise['small']} "
            f"and {noise['large']} sequences drawn from the training windows "
            f"({noise['per_round']:,} sequences of each size per round, until |G|^2's 95% "
            f"interval lies above zero, at most {noise['rounds']} rounds), with a bootstrap "
            f"95% interval; one checkpoint per run and target, so no window of steps is "
            f"pooled.")


def _fit_line(name: str, t: Dict[str, Any], unit: str) -> str:
    fit = t["fit"]
    line = f"- {name}: "
    if fit is None:
        return line + "fewer than three batch sizes reached it after the warm-up: no fit"
    over = f"over batches {', '.join(map(str, fit['batches']))}"
    check = fit.get("lack_of_fit", {})
    p = check.get("p")
    test = f"lack of fit p {p:.2g}" if p is not None else "no degree of freedom to test its fit"
    if not fit.get("holds", True):
        why = ([f"a super-linear speed-up from batch {b1} to {b2}"
                for b1, b2 in check.get("superlinear", [])]
               + ([test] if p is not None and p < analysis.ALPHA else []))
        return line + f"the fit {over} does not hold ({'; '.join(why)}): B_crit withdrawn"
    lo, hi = fit["b_crit_95"]
    return line + (f"B_crit {_g(fit['b_crit'])}{unit} [{_g(lo)}, {_g(hi)}] {over}, S_min "
                   f"{fit['s_min']:.0f} steps, {test}")


def _cost(study: Dict[str, Any]) -> str:
    rows = study["rows"]
    jobs = study["protocol"]["jobs"]
    return (f"{len(rows)} runs in {study['time_s'] / 60:.0f} min ({jobs} at a time"
            + (", one thread each" if all(r.get("threads") == 1 for r in rows) else "") + ")"
            + ("" if study.get("complete", True) else "; INTERRUPTED: the runs finished so far")
            + ".")
