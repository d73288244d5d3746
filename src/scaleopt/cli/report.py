"""Writing results: JSON, CSV and PNG plots (matplotlib, without a display)."""

from __future__ import annotations

import csv
import json
import pathlib
import textwrap
from typing import Any, Dict, List

from .checkpoint import CHECKPOINTS, LATEST


NO_PLOTS = "no plots: matplotlib is not installed (pip install 'scaleopt[cli]')"


def _plt():
    """matplotlib's pyplot without a display, or None where matplotlib is not installed (the
    ``cli`` extra brings it); the tables and JSON are written either way."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def results_line(folder: str, names: List[str], plot: str) -> str:
    """The summary's last line: the files written into ``folder``, the plot among them where
    matplotlib is installed."""
    if _plt() is None:
        return f"results: {folder}/{', '.join(names)} ({NO_PLOTS})"
    return f"results: {folder}/{', '.join(names + [plot])}"


def describe(config: Dict[str, Any], workers: int) -> str:
    """How a run trained, for titles and summaries: e.g. "DGC, 4 workers" or "offloaded,
    sharded, 2 workers" ("" for one plain process)."""
    parts = [w for w, on in (("offloaded", config.get("offload")), ("sharded", config.get("shard")),
                             ("DGC", config.get("dgc")),
                             (f"PowerSGD rank {config.get('powersgd')}", config.get("powersgd")))
             if on]
    if workers > 1:
        replicas = config.get("replicas") or 1
        parts.append(f"{workers} workers" + (f" in {replicas} replicas" if replicas > 1 else ""))
    return ", ".join(parts)


def write_run(result: Dict[str, Any], out: str) -> Dict[str, str]:
    """``result.json``, ``history.csv`` and ``curves.png`` (loss and accuracy against steps)."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "result.json", "csv": folder / "history.csv",
             "png": folder / "curves.png"}
    files["json"].write_text(json.dumps(result, indent=2))
    history: List[Dict[str, Any]] = result["history"]
    with files["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for h in history for k in h)))
        w.writeheader()
        w.writerows(history)
    plt = _plt()
    if plt is None:
        del files["png"]
        return {k: str(v) for k, v in files.items()}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in history]
    curve = result.get("train_curve") or [(h["step"], h["train_loss"]) for h in history]
    a.plot([c[0] for c in curve], [c[1] for c in curve], label="train (batch)", alpha=0.8)
    a.plot(steps, [h["test_loss"] for h in history], marker="o", label="test")
    a.set_xlabel("step")
    a.set_ylabel("cross-entropy")
    a.set_yscale("log")
    a.legend()
    text = "test_bits_per_byte" in result
    b.plot(steps, [h["test_accuracy"] for h in history], marker="o", color="C2")
    b.set_xlabel("step")
    b.set_ylabel("next-byte accuracy (validation)" if text else "test accuracy")
    cfg = result["config"]
    how = describe(cfg, result.get("workers", 1))
    score = (f"validation {result['test_bits_per_byte']:.3f} bits per byte (unigram "
             f"{result['unigram_bits_per_byte']:.3f})" if text
             else f"test accuracy {result['test_accuracy']:.3f}")
    fig.suptitle(f"{cfg['optimizer']}{f' ({how})' if how else ''} on {cfg['dataset']}, "
                 f"batch {cfg['batch_size']}, lr {result['lr']:g}: {score}")
    fig.tight_layout()
    fig.savefig(files["png"], dpi=100)
    plt.close(fig)
    return {k: str(v) for k, v in files.items()}


def _bench_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The rows of any ``scaleopt bench`` result as a list (the sharded run keys them by name)."""
    rows = result["rows"]
    return [dict(r, optimizer=k) for k, r in rows.items()] if isinstance(rows, dict) else rows


def _bench_colour(name: str) -> str:
    return "C0" if name.startswith("scaleopt") else "0.6" if name.startswith("torch.") else "C1"


def bench_title(result: Dict[str, Any]) -> str:
    """What was timed, where: parameters, tensors, dtype, threads or processes, machine, torch."""
    params = result.get("params", result.get("parameters", 0))
    how = [f"{params / 1e6:.1f}M parameters in {result['tensors']} tensors",
           result.get("dtype", "float32")]
    if "world" in result:
        how.append(f"FSDP2 over {result['world']} processes x {result['threads']} thread(s)")
    elif "threads" in result:
        how.append(f"{result['threads']} threads")
    how += [str(result.get("machine") or result.get("device", "")), f"torch {result['torch']}",
            f"{result['rounds']} rounds"]
    return ", ".join(h for h in how if h)


def write_bench_plot(result: Dict[str, Any], path: str):
    """``bench.png``: each optimizer's step time as the paired ratio to fused AdamW's and, where
    measured, the bytes per parameter held (weights and gradients; optimizer state). Returns
    the path, or None where matplotlib is not installed."""
    plt = _plt()
    if plt is None:
        return None
    rows = _bench_rows(result)
    memory = all("state_bytes_per_param" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if memory else 1, squeeze=False,
                             figsize=(12 if memory else 7, 1.4 + 0.38 * len(rows)),
                             gridspec_kw={"width_ratios": [3, 2]} if memory else None)
    names = [r["optimizer"] for r in rows]
    y = list(range(len(rows)))[::-1]
    a = axes[0][0]
    ratios = [r["ratio"] for r in rows]
    a.barh(y, ratios, color=[_bench_colour(n) for n in names])
    a.axvline(1.0, color="k", lw=0.8)
    for yi, v in zip(y, ratios):
        a.text(v, yi, f" {v:.2f}x", va="center", fontsize=8)
    a.set_yticks(y, names, fontsize=8)
    a.set_xlim(0, max(ratios) * 1.15)
    a.set_xlabel("step time / torch.optim.AdamW(fused=True)'s, same round (median)")
    from matplotlib.patches import Patch

    families = [("scaleopt", "C0"), ("torch", "0.6"), ("other libraries", "C1")]
    a.legend(handles=[Patch(color=c, label=f) for f, c in families
                      if any(_bench_colour(n) == c for n in names)],
             fontsize=8, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if memory:
        b = axes[0][1]
        model = [r["model_bytes_per_param"] for r in rows]
        state = [r["state_bytes_per_param"] for r in rows]
        b.barh(y, model, color="0.85")
        b.barh(y, state, left=model, color=[_bench_colour(n) for n in names])
        for yi, m, s in zip(y, model, state):
            b.text(m / 2, yi, f"{m:.0f}", va="center", ha="center", fontsize=8)
            b.text(m + s, yi, f" {m + s:.0f} B", va="center", fontsize=8)
        b.set_yticks(y, [""] * len(y))
        b.set_xlim(0, max(m + s for m, s in zip(model, state)) * 1.15)
        b.set_xlabel("bytes per parameter held between steps")
        b.set_title("light: weights + gradients; coloured: optimizer state", fontsize=8)
    fig.suptitle(bench_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def how_to_continue(out: str) -> str:
    if (pathlib.Path(out) / CHECKPOINTS / LATEST).is_file():
        return f"continue with --resume {out}"
    return "no checkpoint was written, so it cannot be resumed (pass --checkpoint-every K)"


def summary(cfg: Any, r: dict) -> None:
    """The lines a finished (or stopped) run prints."""
    how = describe(r["config"], r["workers"])
    score = (f"validation {r['test_bits_per_byte']:.3f} bits per byte (the unigram baseline's "
             f"{r['unigram_bits_per_byte']:.3f}: {r['test_bits_per_byte'] / r['unigram_bits_per_byte']:.0%}), "
             f"next-byte accuracy {r['test_accuracy']:.4f}," if "test_bits_per_byte" in r else
             f"test accuracy {r['test_accuracy']:.4f}, test loss {r['test_loss']:.4f}")
    print(f"{cfg.optimizer}{f' ({how})' if how else ''} on {cfg.dataset}: {score} after "
          f"{r['steps']} steps ({r['epochs']:.1f} epochs) of batch {cfg.batch_size}, lr {r['lr']:g}"
          + (f"; resumed at step {r['resumed_at']}" if r["resumed_at"] is not None else "")
          + ("" if r["complete"] else f"; stopped before step {r['total_steps']}: "
             + how_to_continue(cfg.out)))
    rate = (f"{r['samples_per_s'] * cfg.context:,.0f} tokens/s" if "tokens" in r
            else f"{r['samples_per_s']:,.0f} samples/s")
    line = (f"{r['time_s']:.1f} s, {r['steps_per_s']:.1f} steps/s, {rate}, "
            f"{r['parameters']:,} parameters, {r['threads']} thread{'s' if r['threads'] != 1 else ''}")
    if "dgc_density" in r:
        dense, sent = r["dense_bytes_sent_per_rank_per_step"], r["dgc_bytes_sent_per_rank_per_step"]
        grad, msg = (r["dense_payload_bytes_per_rank_per_step"],
                     r["dgc_payload_bytes_per_rank_per_step"])
        last = r["dgc_final_telemetry"]
        sent = r.get("dgc_bytes_sent_measured_per_rank_per_step", sent)
        line += (f"; DGC between {r.get('dgc_between', str(r['workers']) + ' workers')}: "
                 f"density {r['dgc_density']:.4f}, {sent:,.0f} bytes sent per rank per step "
                 f"(counted from the buffers sent) vs {dense:,.0f} for a dense all-reduce "
                 f"of the same tensors "
                 f"({dense / max(sent, 1):.0f}x fewer); payload {msg:,.0f} bytes per rank per "
                 f"step vs a {grad:,.0f}-byte gradient ({grad / max(msg, 1):.0f}x smaller); "
                 f"last step: {last['dense_bytes'] / max(last['bytes_sent'], 1):.0f}x fewer "
                 f"bytes sent, payload {last['dense_payload_bytes'] / max(last['payload_bytes'], 1):.0f}x "
                 f"smaller")
    elif "replica_allreduce_bytes_per_step" in r:
        line += (f"; {r['config']['replicas']} replicas: {r['replica_allreduce_bytes_per_step']:,} "
                 f"bytes of gradient shards all-reduced between them per step (about "
                 f"{r['replica_bytes_sent_per_rank_per_step']:,} sent per rank)")
    elif "allreduce_bytes_per_step" in r:
        line += (f"; {r['workers']} workers, {r['allreduce_bytes_per_step']:,} gradient bytes "
                 f"all-reduced per step (about {r['bytes_sent_per_rank_per_step']:,} sent per rank)")
    print(line)
    per_param = r["unsharded_optimizer_state_bytes"] / max(r["parameters"], 1)
    print(f"per rank: {r['param_bytes_per_rank']:,} bytes of parameters and "
          f"{r['optimizer_state_bytes_per_rank']:,} of optimizer state "
          f"({per_param:.2f} bytes per parameter, state_dtype {cfg.state_dtype})"
          + (f" ({r['workers'] // cfg.replicas} shards; unsharded: {r['unsharded_param_bytes']:,} and "
             f"{r['unsharded_optimizer_state_bytes']:,})" if r["sharded"] else ""))
    if "noise_scale" in r:
        n = r["noise_scale"]
        print(f"gradient noise scale B_simple {n['b_simple']:.3g} examples"
              + (f" ({n['b_simple_tokens']:,.0f} tokens)" if "tokens" in r else "")
              + f" at the end (moving average of {len(n['history'])} measurements, one every "
                f"{n['every']} steps): batches well below it use their examples efficiently")
    for i, restart in enumerate(r.get("restarts", []), 1):
        print(f"restart {i}: {restart['cause']} at step {restart['at_step']}; resumed from "
              f"step {restart['from_step']}, {restart['redone_steps']} steps done again")
    if r["checkpoints"]:
        print(f"checkpoints: {len(r['checkpoints'])}, the last {r['checkpoints'][-1]}")
    if not r.get("write_error"):
        print(results_line(cfg.out, ["result.json", "history.csv"], "curves.png"))


def study_plot(plt: Any, title: str, a: Dict[str, Any], score: str, names: Dict[str, str],
               path: Any) -> None:
    """Left: each optimizer's mean test score against batch size (bars: its seeds' standard
    deviation); right: its tuned rate against batch size, beside the square-root rule (a
    large-batch study's analysis ``a``; ``names``: how the optimizers are written)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (n, cs) in enumerate(a["cells"].items()):
        pts = [(int(b), c["mean"], c["sd"]) for b, c in cs.items() if "mean" in c]
        left.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                      marker="o", capsize=3, label=names.get(n, n), color=f"C{i}")
        rates = [(int(b), c["lr"]) for b, c in cs.items()]
        right.plot([r[0] for r in rates], [r[1] / rates[0][1] for r in rates], marker="o",
                   label=names.get(n, n), color=f"C{i}")
    batches = sorted(int(b) for b in a["batches"])
    right.plot(batches, [(b / batches[0]) ** 0.5 for b in batches], "k--", label="square root")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (same examples; each rate tuned at each batch)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel(score)
    right.set_yscale("log", base=2)
    right.set_ylabel("tuned rate / tuned rate at the smallest batch")
    fig.suptitle(textwrap.fill(title, 120), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
