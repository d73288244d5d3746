"""A large-batch study's files: ``study.json`` (the protocol and every run), ``study.csv``,
``study.md`` (:func:`markdown`: the tables and the sentences of results, all made from the
JSON by :mod:`.analysis`) and ``study.png``."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import textwrap
from typing import Any, Dict, List

from . import analysis, report


def write(study: Dict[str, Any], out: str) -> Dict[str, str]:
    """The study's files in ``out``; their paths."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "study.json", "csv": folder / "study.csv",
             "md": folder / "study.md", "png": folder / "study.png"}
    files["json"].write_text(json.dumps(study, indent=1))
    keys = ["optimizer", "batch_size", "lr", "seed", "steps", "tokens", "dev_loss", "test_loss",
            "dev_bits_per_byte", "test_bits_per_byte", "test_accuracy", "diverged", "time_s",
            "command"]
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(study["rows"])
    files["md"].write_text(markdown(study))
    plt = report._plt()
    if plt is None:
        del files["png"]
    else:
        _plot(plt, study, files["png"])
    return {k: str(v) for k, v in files.items()}


def _unit(key: str) -> str:
    return "bits per byte" if key == "test_bits_per_byte" else "loss"


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "unbounded"


def markdown(study: Dict[str, Any]) -> str:
    """The study's tables and its sentences of results, from its JSON alone."""
    a = analysis.analyse(study)
    md = [study["title"], "", *_table(study, a), *_baseline(a), "", *_findings(study, a), "",
          *_rates(study, a), "", *_targets(study, a), "", _cost(study)]
    return "\n".join(md) + "\n"


def _table(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    proto, names = study["protocol"], study["protocol"]["optimizers"]
    lines = [f"test {_unit(a['score'])} of each optimizer's tuned rate: mean ± standard "
             f"deviation over the seeds (the rate; † where it lies on the edge of the rates "
             f"tried)", "",
             "| batch | steps | " + " | ".join(names) + " |",
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
            row.append(f"diverged (lr {c['lr']:.3g}{mark})" if "mean" not in c else
                       f"{c['mean']:.3f} ± {c['sd']:.3f} (lr {c['lr']:.3g}{mark})")
        lines.append("| " + " | ".join([row[0], steps] + row[1:]) + " |")
    return lines


def _baseline(a: Dict[str, Any]) -> List[str]:
    if a["score"] != "test_bits_per_byte":
        return []
    from . import text

    return ["", f"The test split's unigram baseline (the bytes' frequencies alone): "
                f"{text.unigram_bits_per_byte('test'):.3f} bits per byte."]


def _findings(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Per batch: who is lowest, who is within the uncertainty, who is behind beyond it; LAMB
    against AdamW where both ran."""
    seeds = study["protocol"]["seeds"]
    out = ["What the runs say (differences paired by seed, ± the half-width of their 95% "
           "interval; a difference counts only where it exceeds it):", ""]
    if seeds < 2:
        out += ["- One seed per cell: no difference can be told from noise, so none is "
                "called a win.", ""]
    for b, r in a["batches"].items():
        if not r["order"]:
            continue
        best, cell = r["order"][0], a["cells"][r["order"][0]][b]
        ties = [n for n, d in r["against_best"].items() if not d["clear"]]
        behind = [f"{n} (+{d['mean']:.3f} ± {d['half_width']:.3f})"
                  for n, d in r["against_best"].items() if d["clear"]]
        line = (f"- Batch {b} ({cell['steps']} steps): lowest {best} ({cell['mean']:.3f}); "
                + (f"not told apart from it: {', '.join(ties)}" if ties else
                   "no other within the uncertainty")
                + (f"; behind: {', '.join(behind)}" if behind else "") + ".")
        if r["diverged"]:
            line += f" Diverged at every rate kept: {', '.join(r['diverged'])}."
        out.append(line)
    out += [""] + _against_adamw(a)
    return out


def _against_adamw(a: Dict[str, Any]) -> List[str]:
    """Each optimizer minus AdamW, both tuned at each batch, paired by seed."""
    names = list(dict.fromkeys(n for r in a["batches"].values() for n in r["against_adamw"]))
    out = []
    for n in names:
        parts = []
        for b, r in a["batches"].items():
            d = r["against_adamw"].get(n)
            if d is None:
                continue
            verdict = ((f"{n} lower" if d["mean"] < 0 else "AdamW lower") if d["clear"]
                       else "not told apart")
            half = f" ± {d['half_width']:.3f}" if math.isfinite(d["half_width"]) else ""
            parts.append(f"batch {b}: {d['mean']:+.3f}{half} ({verdict})")
        out.append(f"- {n} minus AdamW, each tuned at each batch: " + "; ".join(parts) + ".")
    return out


def _rates(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """The tuned rates against the batch size (the exponent beside the usual rule's), and
    every rate tried with its development loss."""
    rule = {"sqrt": 0.5, "linear": 1.0}
    out = ["Tuned rates against batch size (k in lr ~ B^k, by least squares over the batch "
           "sizes; the grid's points are a factor "
           f"{_grid_step(study):g} apart, so k is coarse):", ""]
    for n, o in a["optimizers"].items():
        k = o["rate_exponent"]
        rates = ", ".join(f"{c['lr']:.3g}" for c in a["cells"][n].values())
        out.append(f"- {n}: {rates}" + (f"; k = {k:.2f} (its usual {o['scaling']} rule: "
                                        f"{rule[o['scaling']]:g})" if k is not None else ""))
    edges = [f"{n} at batch {b}" for n, cs in a["cells"].items() for b, c in cs.items() if c["edge"]]
    out += ["", "Rates on the edge of what was tried after the extensions: "
            + (", ".join(edges) if edges else "none") + ".", "",
            f"Every rate tried (seed 0; development {_unit(a['score'])}):", ""]
    for n, cs in a["cells"].items():
        for b, c in cs.items():
            out.append(f"- {n}, batch {b}: " + ", ".join(
                f"{lr:.3g}: " + (f"{dev:.4f}" if math.isfinite(dev) else "diverged")
                for lr, dev, _ in c["tried"]))
    return out


def _grid_step(study: Dict[str, Any]) -> float:
    grid = sorted(study["protocol"]["grid"])
    return grid[-1] / grid[-2] if len(grid) > 1 else 2.0


def _targets(study: Dict[str, Any], a: Dict[str, Any]) -> List[str]:
    """Steps to each target, B_crit's fit and B_simple at the same loss."""
    if not study["protocol"]["targets"]:
        return []
    text = a["score"] == "test_bits_per_byte"
    per = study["protocol"]["config"]["context"] if text else 1
    unit = " sequences" if text else " examples"
    out = [f"Steps to a target (mean over the seeds, all of which reached it) and the fit "
           f"S = S_min (1 + B_crit / B) over the batch sizes that reached it (95% bootstrap "
           f"interval over seeds); B_simple at the same {_unit(a['score'])} from the "
           f"smallest batch's runs ({analysis.NOISE_NEAR} measurements nearest the crossing "
           f"per run, 95% bootstrap interval):", ""]
    for n, o in a["optimizers"].items():
        for t in o["targets"]:
            fit, noise = t["fit"], t["noise"]
            line = f"- {n}, target {t['target']:g}: "
            if fit is None:
                line += "fewer than three batch sizes reached it: no fit"
            else:
                lo, hi = fit["b_crit_95"]
                line += ("steps " + ", ".join(f"{s:.0f} at {b}" for b, s in fit["steps"].items())
                         + f"; B_crit {_g(fit['b_crit'])}{unit} [{_g(lo)}, {_g(hi)}], "
                         f"S_min {fit['s_min']:.0f} steps")
            if noise is not None:
                lo, hi = noise["b_simple_95"]
                line += (f"; B_simple {_g(noise['b_simple'])}{unit} [{_g(lo)}, {_g(hi)}]"
                         + (f" ({noise['b_simple'] * per:,.0f} tokens)"
                            if text and math.isfinite(noise["b_simple"]) else ""))
            out.append(line)
    return out


def _cost(study: Dict[str, Any]) -> str:
    rows = study["rows"]
    jobs = study["protocol"]["jobs"]
    return (f"{len(rows)} runs in {study['time_s'] / 60:.0f} min ({jobs} at a time"
            + (", one thread each" if all(r.get("threads") == 1 for r in rows) else "") + ")"
            + ("" if study.get("complete", True) else "; INTERRUPTED: the runs finished so far")
            + ".")


def _plot(plt: Any, study: Dict[str, Any], path: pathlib.Path) -> None:
    """Left: each optimizer's mean test score against batch size (bars: its seeds' standard
    deviation); right: its tuned rate against batch size, beside the square-root rule."""
    a = analysis.analyse(study)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (n, cs) in enumerate(a["cells"].items()):
        pts = [(int(b), c["mean"], c["sd"]) for b, c in cs.items() if "mean" in c]
        left.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                      marker="o", capsize=3, label=n, color=f"C{i}")
        rates = [(int(b), c["lr"]) for b, c in cs.items()]
        right.plot([r[0] for r in rates], [r[1] / rates[0][1] for r in rates], marker="o",
                   label=n, color=f"C{i}")
    batches = sorted(int(b) for b in a["batches"])
    right.plot(batches, [(b / batches[0]) ** 0.5 for b in batches], "k--", label="square root")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (same examples; each rate tuned at each batch)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel(f"test {_unit(a['score'])}")
    right.set_yscale("log", base=2)
    right.set_ylabel("tuned rate / tuned rate at the smallest batch")
    fig.suptitle(textwrap.fill(study["title"], 120), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
