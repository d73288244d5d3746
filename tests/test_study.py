"""``scaleopt study large-batch``: the protocol (every batch tuned on a development split,
grids extended at their edges, seeds of each chosen rate, runs repeatable from their recorded
command), its statistics (paired differences, steps to a target, B_crit's fit, B_simple at a
loss), and the large-batch page, whose results are made from the study's committed JSON."""

from __future__ import annotations

import json
import math
import pathlib
import shlex
import shutil

import pytest

from scaleopt.cli import analysis, build_parser, main, models, study, study_journal, study_report
from scaleopt.cli.config import Config

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
#: the committed study that docs/large_batch.md reports
STUDY = DOCS.parent / "studies" / "large_batch_gpt_topics"
#: a gpt model small enough for tests: 1 block of width 32 on 16-byte windows
MODEL = ["--model", "gpt", "--width", "32", "--layers", "1", "--context", "16",
         "--train-size", "512", "--no-progress"]


def test_the_fit_recovers_b_crit_and_s_min_from_the_trade_off_curve():
    points = [(b, 300 * (1 + 40 / b)) for b in (4, 16, 64, 256)]
    s_min, b_crit = analysis.fit_bcrit(points)
    assert s_min == pytest.approx(300, rel=1e-4) and b_crit == pytest.approx(40, rel=1e-4)
    # steps that halve with every doubling of the batch: B_crit beyond anything measured
    assert analysis.fit_bcrit([(b, 4096 / b) for b in (4, 16, 64)])[1] > 64 * 100


def test_steps_to_a_target_are_read_between_evaluations_in_log_steps():
    unit = math.log(2)  # curves hold nats; targets are bits per byte
    curve = [[10, 4.0 * unit], [20, 3.0 * unit], [40, 2.0 * unit]]
    assert analysis.crossing(curve, 2.5, unit) == pytest.approx(800 ** 0.5)  # halfway in log
    assert analysis.crossing(curve, 3.5, unit) == pytest.approx(200 ** 0.5)
    assert analysis.crossing(curve, 4.5, unit) is None  # below it at the first evaluation
    assert analysis.crossing(curve, 1.0, unit) is None  # never reached


def test_log_spaced_evaluations_are_a_third_of_an_octave_apart_and_end_at_the_last_step():
    from scaleopt.cli.config import Config

    cfg = Config(train_size=2048, batch_size=1, epochs=1, evals=16, eval_spacing="log")
    steps = sorted(cfg.eval_steps())
    assert steps[-1] == 2048 and steps[0] == 64 and len(steps) == 16
    assert all(1.2 < b / a < 1.32 for a, b in zip(steps, steps[1:]))
    even = sorted(Config(train_size=2048, batch_size=1, epochs=1, evals=16).eval_steps())
    assert even == list(range(128, 2049, 128))


def test_a_paired_difference_is_clear_only_beyond_its_interval():
    clear = analysis.paired([2.0, 2.1, 2.2], [1.5, 1.61, 1.69])
    assert clear["mean"] == pytest.approx(0.5) and clear["clear"]
    noisy = analysis.paired([2.0, 2.5, 1.6], [1.9, 1.9, 2.0])
    assert not noisy["clear"] and noisy["half_width"] > abs(noisy["mean"])
    assert not analysis.paired([2.0], [1.0])["clear"]  # one seed tells nothing apart


def test_b_simple_at_a_loss_takes_the_measurements_around_the_crossing():
    unit = 1.0
    curve = [[50, 5.0], [100, 3.0], [200, 1.0]]
    # the noise scale is 10 until step 100 and 50 after: 2.0 is crossed at step 141
    noise = [[s, 1.0, 10.0 if s < 100 else 50.0] for s in range(0, 200, 5)]
    got = analysis.b_simple([{"curve": curve, "noise": noise}], 2.0, unit)
    assert got["b_simple"] == pytest.approx(50) and got["measurements"] == analysis.NOISE_NEAR
    early = analysis.b_simple([{"curve": curve, "noise": noise}], 4.5, unit)
    assert early["b_simple"] == pytest.approx(10)
    assert early["b_simple_95"][0] <= early["b_simple"] <= early["b_simple_95"][1]


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    assert main(["study", "large-batch", *MODEL, "--batch-sizes", "8", "32", "--optimizers",
                 "lamb", "adamw", "momentum", "--seeds", "2", "--extensions", "1",
                 "--targets", "5", "--jobs", "2", "--out", str(out)]) == 0
    return out, json.loads((out / "study.json").read_text())


@pytest.mark.slow
def test_every_batch_is_tuned_on_the_development_split_and_its_choice_run_with_seeds(tiny_study):
    _, s = tiny_study
    rows, grid = s["rows"], s["protocol"]["grid"]
    for name in ("lamb", "adamw", "momentum"):
        rule = "linear" if name == "momentum" else "sqrt"
        centre = study.scaled_lr(s["protocol"]["default_lr"][name], 8, 64, rule)
        for b in (8, 32):
            tried = sorted(r["lr"] for r in rows
                           if r["optimizer"] == name and r["batch_size"] == b and r["seed"] == 0)
            # the grid around the centre, at most one extension beyond it
            assert all(any(t == pytest.approx(centre * f) for t in tried) for f in grid)
            assert len(grid) <= len(tried) <= len(grid) + 1
            mine = [r for r in rows if r["optimizer"] == name and r["batch_size"] == b]
            best = min((r for r in mine if r["seed"] == 0), key=lambda r: r["dev_loss"])
            # the best on the edge only where the one extension allowed was spent
            edge = best["lr"] in (tried[0], tried[-1])
            assert not edge or len(tried) == len(grid) + 1
            assert sorted(r["seed"] for r in mine if r["lr"] == best["lr"]) == [0, 1]
            assert all(r["lr"] == best["lr"] for r in mine if r["seed"] == 1)
            centre = study.scaled_lr(best["lr"], 32, b, rule)  # the next batch's centre
    assert all(r["threads"] == 1 and "curve" in r and "noise" in r for r in rows)
    # what decides a run's last bits besides its command: torch's version and CPU kernels
    import torch
    assert {(r["torch"], r["cpu"]) for r in rows} == {
        (torch.__version__, torch.backends.cpu.get_cpu_capability())}


@pytest.mark.slow
def test_a_studys_run_is_the_run_its_recorded_command_repeats(tiny_study, tmp_path):
    _, s = tiny_study
    row = next(r for r in s["rows"] if r["optimizer"] == "adamw" and r["seed"] == 1)
    argv = shlex.split(row["command"])
    assert argv[:2] == ["scaleopt", "train"] and "--dev-split" in argv
    assert argv[argv.index("--betas") + 1:argv.index("--betas") + 3] == ["0.9", "0.95"]
    assert main(argv[1:] + ["--no-progress", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "result.json").read_text())
    assert again["dev_loss"] == row["dev_loss"] and again["test_loss"] == row["test_loss"]


@pytest.mark.slow
def test_the_studys_sentences_come_from_its_json(tiny_study):
    out, s = tiny_study
    md = (out / "study.md").read_text()
    assert md == study_report.markdown(s)
    a = analysis.analyse(s)
    for b in ("8", "32"):
        ranking = a["batches"][b]
        best = ranking["order"][0]
        cell = a["cells"][best][b]
        named = study_report.CLASSES[best]
        assert f"- Batch {b} ({cell['steps']} steps): lowest {named} ({cell['mean']:.3f})" in md
        assert cell["mean"] == min(a["cells"][n][b]["mean"] for n in ranking["order"])
    assert "LAMB minus AdamW, each tuned at each batch: batch 8: " in md and "target 5" in md


@pytest.mark.parametrize("name", ["lamb", "lans", "adamw", "muon", "offload-adam", "momentum"])
def test_every_optimizer_takes_the_commands_clipping_and_the_adam_family_its_betas(name):
    import torch

    from scaleopt.cli import optimizers
    from scaleopt.cli.config import Config

    betas = (0.9, 0.95) if optimizers.OPTIMIZERS[name].betas else None
    cfg = Config(optimizer=name, max_grad_norm=0.5, betas=betas)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = optimizers.build(model, cfg)
    for group in opt.param_groups:
        assert group["max_grad_norm"] == 0.5
        if betas:
            assert tuple(group["betas"]) == betas


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_trainer_clips_for_torchs_optimizers(tmp_path):
    """torch.optim.SGD has no max_grad_norm: the trainer clips its gradients, and a tight clip
    slows it down (SGD's step is the gradient's size)."""
    losses = []
    for clip in ([], ["--max-grad-norm", "1e-3"]):
        out = tmp_path / f"run{len(losses)}"
        assert main(["train", *MODEL, "--batch-size", "32", "--steps", "6", "--optimizer",
                     "torch-sgd", "--lr", "0.5", *clip, "--out", str(out)]) == 0
        losses.append(json.loads((out / "result.json").read_text())["test_loss"])
    start = math.log(256)  # the model starts near a uniform guess over the bytes
    assert losses[0] < start - 0.5 and abs(losses[1] - start) < 0.05, losses
def _called(d):
    """A comparison with AdamW as the page words it: -1 lower, +1 higher, 0 not told apart."""
    return (1 if d["mean"] > 0 else -1) if d["clear"] else 0


def _committed():
    return (json.loads((STUDY / "study.json").read_text()),
            (DOCS / "large_batch.md").read_text())


def test_the_large_batch_page_shows_what_the_committed_study_says():
    """Every result in docs/large_batch.md's Results section is the study's own text, made
    again here from the committed JSON: nothing there can drift from the runs."""
    s, page = _committed()
    begin, end = "<!-- study: begin -->\n", "<!-- study: end -->"
    block = page[page.index(begin) + len(begin):page.index(end)]
    assert block == study_report.markdown(s)
    proto = s["protocol"]
    assert not proto["quick"] and s["complete"] and proto["seeds"] >= 3
    assert proto["optimizers"] == ["lamb", "lans", "adamw", "muon", "momentum"]
    assert max(proto["batch_sizes"]) == 64 * min(proto["batch_sizes"])


def test_the_pages_description_of_the_protocol_is_the_committed_studys():
    from scaleopt.cli import text

    s, page = _committed()
    cfg, proto = s["protocol"]["config"], s["protocol"]
    model = models.GPT(cfg["width"], cfg["layers"], cfg["context"])
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters" in page
    assert (f"{cfg['train_size']:,}\nwindows of {cfg['context']} bytes" in page
            and f"({cfg['train_size'] * cfg['context']:,} tokens, one epoch)" in page)
    assert cfg["text_split"] == "topics"
    train, _ = text.splits()
    dev, test = text.heldout()
    assert f"{len(train):,}\nbytes train" in page
    assert f"**development split**\n({len(dev):,} bytes)" in page
    assert f"**test split** ({len(test):,} bytes)" in page
    assert cfg["max_grad_norm"] == 1.0 and cfg["betas"] == [0.9, 0.95] and cfg["warmup"] == 0.1
    assert proto["warmups"] == [0.05, 0.2, 0.5, 0.8, 0.95] and proto["warmup_batches"] == 2
    assert proto["beta2s"] == [0.95, 0.99] and proto["beta2_batches"] == 1
    text = " ".join(page.split())
    for b in proto["batch_sizes"][-2:]:  # each warm-up's steps, as the page counts them
        steps = [Config(**{**cfg, "warmup": w, "batch_size": b}).warmup_steps()
                 for w in proto["warmups"]]
        assert ", ".join(map(str, steps[:-1])) + f" and {steps[-1]}" in text
    assert proto["grid"] == [0.5, 1.0, 2.0] and proto["extensions"] == 2
    assert proto["targets"] == [3.6, 3.2] and cfg["evals"] == 16 and cfg["eval_spacing"] == "log"
    steps = sorted({r["steps"] for r in s["rows"]}, reverse=True)
    assert ", ".join(f"{n:,}" for n in steps[:-1]) + f" and {steps[-1]} steps" in page


def test_the_pages_sentences_of_results_hold_in_the_committed_study():
    """The sentences of docs/large_batch.md's "What it shows" and docs/choosing.md, against the
    runs: who is lowest, what the correction keeps against AdamW, how the losses rise, the
    tuned rates."""
    s, page = _committed()
    a = analysis.analyse(s)
    assert a["comparisons"] == 32 and "Holm's correction over all\n32" in page
    sizes = [str(b) for b in sorted(s["protocol"]["batch_sizes"])]
    vs = {n: {b: a["batches"][b]["against_adamw"][n] for b in sizes}
          for n in ("lamb", "lans", "muon", "momentum")}
    for b in sizes:  # Muon's mean lowest everywhere
        assert a["batches"][b]["order"][0] == "muon"
    for b in sizes:  # ahead of every other after the correction
        assert all(d["clear"] for d in a["batches"][b]["against_best"].values())
    text = " ".join(page.split())
    assert [_called(vs["lamb"][b]) for b in sizes] == [-1, 0, 0, 0]
    lamb = [round(vs["lamb"][b]["mean"], 3) for b in ("4", "64", "256")]
    assert lamb == [-0.074, 0.205, 0.353] and all(  # higher means, not kept by the correction
        vs["lamb"][b]["p"] < 0.05 and not vs["lamb"][b]["holm"] for b in ("64", "256"))
    assert (f"lower at batch 4 (by {-lamb[0]} bits per byte), not told apart at 16, 64 and 256 "
            f"(at 64 and 256 its mean is higher, by {lamb[1]} and {lamb[2]}, with p "
            f"{vs['lamb']['64']['p']:.2g} and {vs['lamb']['256']['p']:.2g}" in text)
    assert [_called(vs["lans"][b]) for b in sizes] == [0, 0, 0, -1]
    lans = vs["lans"]["256"]
    assert f"lower at 256 (by {-lans['mean']:.3f} ± {lans['half_width']:.3f})" in text
    assert [_called(vs["muon"][b]) for b in sizes] == [-1] * 4
    assert [_called(vs["momentum"][b]) for b in sizes] == [1] * 4
    rise = {n: analysis.paired(c[sizes[-1]]["scores"], c[sizes[0]]["scores"])["mean"]
            for n, c in a["cells"].items()}
    adam_family = {n: r for n, r in rise.items() if n != "momentum"}
    assert min(adam_family, key=adam_family.get) == "lans"
    rates = {n: [a["cells"][n][b]["lr"] for b in sizes] for n in a["cells"]}
    for n in ("lamb", "lans"):  # the square-root rule: x2 for every 4x batch
        assert [r / q for q, r in zip(rates[n], rates[n][1:])] == pytest.approx([2, 2, 2])
    assert rates["adamw"] == pytest.approx([0.0025, 0.005, 0.005, 0.005])
    muon = rates["muon"]
    assert muon[0] < muon[1] < muon[2] and muon[3] < muon[2]
    assert rates["momentum"][-1] / rates["momentum"][0] < int(sizes[-1]) / int(sizes[0])
    assert not any(c["edge"] for cs in a["cells"].values() for c in cs.values())
    warm = {(n, b): a["cells"][n][b]["warmup"] for n in a["cells"] for b in sizes[-2:]}
    assert len(warm) == 10 and sum(w >= 0.8 for w in warm.values()) == 7
    assert sorted(k for k, w in warm.items() if w == 0.95) == [
        ("adamw", "256"), ("momentum", "64"), ("muon", "256")]
    assert warm["lans", "64"] == 0.05 and warm["lans", "256"] == 0.2
    assert warm["momentum", "256"] == 0.05
    # beta2 at the largest batch: AdamW's 0.99, the others' 0.95, each pair within 0.023
    beta2 = {n: a["cells"][n][sizes[-1]]["beta2"] for n in ("lamb", "lans", "adamw", "muon")}
    assert beta2 == {"lamb": 0.95, "lans": 0.95, "adamw": 0.99, "muon": 0.95}
    gaps = []
    for n in beta2:
        best = {}
        for r in s["rows"]:
            if r["optimizer"] == n and str(r["batch_size"]) == sizes[-1] and r["seed"] == 0:
                b2 = analysis.beta2_of(r)
                best[b2] = min(best.get(b2, math.inf), r["dev_bits_per_byte"])
        assert sorted(best) == [0.95, 0.99]
        gaps.append(abs(best[0.95] - best[0.99]))
    assert round(max(gaps), 3) == 0.023
    assert "within 0.023 bits per byte of each other" in text
    cfg = s["protocol"]["config"]  # "about 0.8 tokens per parameter"
    params = sum(p.numel() for p in models.GPT(cfg["width"], cfg["layers"],
                                               cfg["context"]).parameters())
    assert round(cfg["train_size"] * cfg["context"] / params, 1) == 0.8
    choosing = " ".join((DOCS / "choosing.md").read_text().split())
    assert ("LAMB was lower than a tuned AdamW only at batch 4 and not told apart at 16, 64 and "
            "256 with the warm-up tuned up to 95% of the examples" in choosing)
    assert "lower than every other optimizer at all four after the correction" in choosing
    assert "LANS was lower than AdamW there, narrowly" in choosing
    assert "and not told apart from it at 4, 16 and 64" in choosing
    assert "AdamW's went 0.0025, 0.005, 0.005, 0.005 from batch 4 to 256" in choosing
    assert "80% or 95% of the examples in 7 of its 10 cells (95%, the longest tried, in 3)" in (
        choosing)
    assert "by at most 0.023 bits per byte" in choosing


def test_the_pages_words_on_its_test_splits_overlap_are_measured():
    """The share of each held-out split's 64-byte windows that occur verbatim in the training
    bytes, as the page states it."""
    from scaleopt.cli import text

    train, _ = text.splits("tail")  # the split the committed study ran on
    seen = bytes(train.byte().tolist())
    windows = {seen[i:i + 64] for i in range(len(seen) - 63)}
    shares = []
    for part in text.heldout("tail"):
        b = bytes(part.byte().tolist())
        shares.append(sum(b[i:i + 64] in windows for i in range(len(b) - 63)) / (len(b) - 63))
    _, page = _committed()
    page = " ".join(page.split())
    assert (f"{100 * shares[1]:.1f}% of the test split's 64-byte windows occur verbatim in the "
            f"training bytes, {100 * shares[0]:.1f}% of the development split's") in page


def test_the_readme_states_the_studys_own_table_scale_and_cost():
    """The README's table is the study's own (made again here from the JSON, line for line),
    beside the scale, the budget and the cost it states."""
    s, _ = _committed()
    lines = [line.strip() for line in (DOCS.parent / "README.md").read_text().splitlines()]
    table = study_report.summary_table(s)
    start = lines.index(table[0])
    assert lines[start:start + len(table)] == table
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert f"{len(s['rows'])} runs in {s['time_s'] / 60:.0f} minutes" in readme
    cfg, sizes = s["protocol"]["config"], s["protocol"]["batch_sizes"]
    model = models.GPT(cfg["width"], cfg["layers"], cfg["context"])
    assert f"a {sum(p.numel() for p in model.parameters()):,}-parameter transformer" in readme
    assert f"trained on {cfg['train_size'] * cfg['context']:,} tokens once" in readme
    assert f"at batch {min(sizes)} to" in readme and f"at batch {max(sizes)}," in readme
    assert "3 seeds per chosen rate" in readme and s["protocol"]["seeds"] == 3
    a = analysis.analyse(s)
    best = {r["order"][0] for r in a["batches"].values()}
    called = {n: [b for b, r in a["batches"].items() if r["against_adamw"][n]["clear"]]
              for n in ("lamb", "lans")}
    assert best == {"muon"} and [len(v) for v in called.values()] == [1, 1]
    assert ("Muon is lowest at every batch size; LAMB and LANS are each told apart from a tuned "
            "AdamW at one batch size only") in readme


def test_the_pages_sentences_on_the_critical_batch_hold_in_the_committed_study():
    """Of the ten fits, LANS's at 3.6 alone holds, over batches 4, 16 and 64 (below its
    B_crit); LAMB's at 3.6 is withdrawn by its test, every other has too few batch sizes."""
    s, page = _committed()
    a = analysis.analyse(s)
    fits = {(n, t["target"]): t["fit"] for n, o in a["optimizers"].items() for t in o["targets"]}
    assert len(fits) == 10
    holding = {k: f for k, f in fits.items() if f is not None and f["holds"]}
    assert sorted(holding) == [("lans", 3.6)]
    f = holding["lans", 3.6]
    assert f["batches"] == [4, 16, 64] and f["b_crit"] > 64
    text = " ".join(page.split())
    low, high = f["b_crit_95"]
    assert (f"B_crit {f['b_crit']:.0f} sequences, 95% interval {low:.3g} to {high:.3g}"
            in text)
    lamb = fits["lamb", 3.6]
    assert lamb is not None and lamb["lack_of_fit"]["p"] < analysis.ALPHA
    assert [k for k, v in fits.items() if v is None] == [
        k for k in fits if k not in {("lans", 3.6), ("lamb", 3.6)}]
    assert "Of the ten fits (five optimizers, two targets), one holds: LANS's at 3.6" in text
    cells, unit = analysis.cells(s), math.log(2)

    def crossings(n, b, t):
        c = cells[n][b]
        return [analysis.crossing(r["curve"], t, unit) for r in c["runs"]
                if (r["lr"], r["warmup"], analysis.beta2_of(r)) == (c["lr"], c["warmup"],
                                                                     c["beta2"])]

    targets = s["protocol"]["targets"]
    assert all(x is None for n in cells for t in targets for x in crossings(n, 256, t))
    assert all(x is None for b in cells["momentum"] for t in targets
               for x in crossings("momentum", b, t))
    warm = {n: Config(**{**s["protocol"]["config"], "warmup": cells[n][64]["warmup"],
                         "batch_size": 64}).warmup_steps() for n in ("adamw", "muon")}
    assert {n: cells[n][64]["warmup"] for n in warm} == {"adamw": 0.8, "muon": 0.8}
    assert all(x < warm["muon"] for t in targets for x in crossings("muon", 64, t))
    assert sum(x < warm["adamw"] for x in crossings("adamw", 64, 3.6)) == 2
    assert ("no run at batch 256 reaches either target, SGD's runs reach neither at any batch, "
            "and at batch 64 Muon's crossings and two of AdamW's three fall inside the 80% "
            "warm-ups they chose") in text


@pytest.mark.slow
def test_the_report_of_an_interrupted_study_says_what_finished(tiny_study):
    """A study stopped early has cells, optimizers or batch sizes without runs: its report
    still writes, and says so."""
    _, s = tiny_study
    for keep in (1, 4, 9, len(s["rows"]) - 1):
        part = dict(s, rows=s["rows"][:keep], complete=False)
        md = study_report.markdown(part)
        assert "INTERRUPTED" in md and md.startswith(s["title"])


@pytest.mark.slow
def test_the_noise_scale_is_measured_at_checkpoints_of_the_chosen_runs(tiny_study, tmp_path):
    """``scaleopt study noise-scale DIR``: each optimizer's chosen seed-0 run at the smallest
    batch trained again to where its curve crossed the target, its evaluations there equal to
    the recorded ones, its test loss at the checkpoint between the recorded evaluations around
    the crossing; the measurements kept beside the study and given in its report."""
    out, s = tiny_study
    folder = tmp_path / "study"
    shutil.copytree(out, folder)
    assert main(["study", "noise-scale", str(folder), "--small", "2", "--large", "32",
                 "--per-round", "256", "--rounds", "6"]) == 0
    kept = json.loads((folder / "noise_scale.json").read_text())
    assert kept["batch"] == 8 and (kept["small"], kept["large"]) == (2, 32)
    cells, unit = analysis.cells(s), math.log(2)
    reached = [m for m in kept["measurements"] if m["reached"]]
    assert reached and {m["optimizer"] for m in kept["measurements"]} == {"lamb", "adamw",
                                                                          "momentum"}
    md = (folder / "study.md").read_text()
    for m in kept["measurements"]:
        cell = cells[m["optimizer"]][8]
        assert (m["lr"], m["warmup"], m["beta2"]) == (cell["lr"], cell["warmup"], cell["beta2"])
        run = next(r for r in cell["runs"] if r["seed"] == 0)
        at = analysis.crossing(run["curve"], m["target"], unit)
        assert m["reached"] == (at is not None)
        if at is None:
            continue
        assert m["reproduced"] and m["evaluations_compared"] >= 1 and m["step"] == round(at)
        before = max(v for st, v in run["curve"] if st <= m["step"]) / unit
        after = min(v for st, v in run["curve"] if st >= m["step"]) / unit
        assert after <= m["test_at_step"] <= before
        lo, hi = m["b_simple_95"]
        assert m["settled"] == (m["g2_95"][0] > 0) and lo <= m["b_simple"] <= hi
        assert f"{study_report.CLASSES[m['optimizer']]}: B_simple {m['b_simple']:.3g}" in md
    assert md == study_report.markdown(json.loads((folder / "study.json").read_text()))
    assert all(m["largest_difference"] == 0.0 for m in reached)
    # a recorded curve the rerun cannot repeat fails the command, and the report says by how much
    study_json = json.loads((folder / "study.json").read_text())
    for row in study_json["rows"]:
        row["curve"] = [[st, v + 0.01 * unit] for st, v in row["curve"]]
    (folder / "study.json").write_text(json.dumps(study_json))
    assert main(["study", "noise-scale", str(folder), "--small", "2", "--large", "32",
                 "--per-round", "256", "--rounds", "6"]) == 1
    kept = json.loads((folder / "noise_scale.json").read_text())
    moved = [m for m in kept["measurements"] if m["reached"]]
    assert moved and all(not m["reproduced"] and m["largest_difference"] == pytest.approx(0.01)
                         for m in moved)
    assert "differ from the recorded ones by at most 0.01" in (folder / "study.md").read_text()


@pytest.fixture
def tiny_study_files(tmp_path):
    """A study's folder with its protocol and no runs."""
    folder = tmp_path / "protocol-only"
    folder.mkdir()
    (folder / "study.json").write_text(json.dumps({"protocol": {
        "batch_sizes": [8, 32], "optimizers": ["lamb", "adamw"], "targets": [5.0]}, "rows": []}))
    return folder


def test_the_noise_scale_command_refuses_what_it_cannot_measure(tiny_study_files, tmp_path,
                                                                capsys):
    assert main(["study", "noise-scale", str(tmp_path)]) == 2
    assert "no finished study there" in capsys.readouterr().err
    assert main(["study", "noise-scale", str(tiny_study_files), "--batch", "16"]) == 2
    assert "the study ran batches [8, 32]" in capsys.readouterr().err
    assert main(["study", "noise-scale", str(tiny_study_files), "--optimizers", "muon"]) == 2
    assert "the study ran ['lamb', 'adamw']" in capsys.readouterr().err
    assert main(["study", "noise-scale", str(tiny_study_files), "--small", "256"]) == 2
    assert "--small (256) must be below --large (256)" in capsys.readouterr().err
    assert main(["study", "noise-scale", str(tiny_study_files), "--rounds", "0"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert main(["study", "noise-scale", str(tiny_study_files), "--within", "-1"]) == 2
    assert "--within must be at least 0" in capsys.readouterr().err


def test_holm_keeps_the_smallest_ps_until_one_fails_its_share_of_the_error_rate():
    got = analysis.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}, alpha=0.05)
    # 0.005 <= 0.05/4, 0.01 <= 0.05/3, 0.03 > 0.05/2: c and everything after it kept apart
    assert got == {"d": True, "a": True, "c": False, "b": False}


def test_a_paired_t_tests_p_is_students():
    # with 2 degrees of freedom P(|T| >= t) = 1 - t / sqrt(2 + t^2)
    for t in (0.5, 2.0, 4.303, 10.0):
        assert analysis.t_two_sided(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t))
    assert analysis.t_two_sided(2.228, 10) == pytest.approx(0.05, abs=2e-4)
    assert analysis.f_upper(4.10, 2, 10) == pytest.approx(0.05, abs=2e-3)
    d = analysis.paired([2.0, 2.1, 2.2], [1.5, 1.61, 1.69])
    assert 0 < d["p"] < 0.05 and d["clear"]


def test_the_tuning_resolution_is_the_parabolas_gain_over_the_chosen_point():
    import math as m
    # development losses on a parabola in log(rate) with its minimum between two grid points
    tried = [[r, (m.log(r) - m.log(0.015)) ** 2, 0.0] for r in (0.005, 0.01, 0.02, 0.04)]
    assert analysis.resolution(tried, 0.01) == pytest.approx(tried[1][1])  # down to 0 from there
    assert analysis.resolution(tried, 0.005) == math.inf  # on the edge: not bracketed


def test_a_fit_with_a_super_linear_speed_up_or_a_rejected_lack_of_fit_is_withdrawn():
    unit = 1.0

    def cell(steps_by_seed, total=1000):
        runs = [{"steps": total, "curve": [[1, 10.0], [s, 1.0], [total, 0.5]]}
                for s in steps_by_seed]
        return {"runs": runs}

    # steps 4x fewer for every 4x batch (and a little more): super-linear, no B_crit
    fast = {4: cell([400, 410, 390]), 16: cell([90, 92, 88]), 64: cell([20, 21, 19])}
    fit = analysis.bcrit(fast, 1.0, unit)
    assert fit["lack_of_fit"]["superlinear"] and not fit["holds"]
    # points on the model, the seeds' scatter around them: the fit holds
    good = {b: cell([300 * (1 + 40 / b) * k for k in (0.98, 1.0, 1.02)]) for b in (4, 16, 64, 256)}
    fit = analysis.bcrit(good, 1.0, unit)
    assert fit["holds"] and fit["lack_of_fit"]["p"] > 0.05
    assert fit["b_crit_95"][0] <= fit["b_crit"] <= fit["b_crit_95"][1]
    # a crossing inside the warm-up (10% of 1000 steps) does not count
    assert analysis.steps_to({4: cell([50, 60, 70])}, 1.0, unit, warmup=0.1) == {}
    assert analysis.steps_to({4: cell([150, 160, 170])}, 1.0, unit, warmup=0.1) == {"4": 160.0}


@pytest.mark.slow
def test_a_killed_study_resumes_running_only_what_it_had_not_recorded(tiny_study, tmp_path,
                                                                      capsys):
    """The tiny study's journal cut to its first 7 runs (and a last line cut off mid-way, as
    a kill leaves it): --resume runs the rest, and the study is the uninterrupted one's."""
    out, whole = tiny_study
    lines = (out / "runs.jsonl").read_text().splitlines()
    assert len(lines) == len(whole["rows"])
    times = [json.loads(line)["study_s"] for line in lines]  # the study's clock at each
    assert times == sorted(times) and 0 < times[0] and times[-1] <= whole["time_s"]
    part = tmp_path / "part"
    part.mkdir()
    (part / "protocol.json").write_text((out / "protocol.json").read_text())
    (part / "runs.jsonl").write_text("\n".join(lines[:7]) + "\n" + lines[7][:40])
    args = ["study", "large-batch", *MODEL, "--batch-sizes", "8", "32", "--optimizers",
            "lamb", "adamw", "momentum", "--seeds", "2", "--extensions", "1",
            "--targets", "5", "--jobs", "2", "--resume", str(part)]
    assert main(args) == 0
    again = json.loads((part / "study.json").read_text())
    assert len((part / "runs.jsonl").read_text().splitlines()) == len(whole["rows"])
    strip = lambda rows: sorted((study_journal.run_key(r), r["test_loss"]) for r in rows)  # noqa: E731
    assert strip(again["rows"]) == strip(whole["rows"])
    # no report was left by the kill: the wall time goes on from the journal's
    assert again["time_s"] > times[6] and not any("study_s" in r for r in again["rows"])
    other = list(args)
    other[other.index("--seeds") + 1] = "3"
    capsys.readouterr()
    assert main(other) == 2
    assert "started with other options (seeds)" in capsys.readouterr().err


@pytest.mark.slow
def test_the_warm_up_is_tuned_with_the_rate_where_it_can_bind(tmp_path):
    """--warmups crossed with the rate grid at the largest batch only (--warmup-batches 1):
    every warm-up with every rate there, the base's alone below; the seeds run the chosen
    (rate, warm-up), which is the lowest development loss of all; the table names it."""
    out = tmp_path / "study"
    assert main(["study", "large-batch", *MODEL, "--batch-sizes", "8", "32", "--optimizers",
                 "adamw", "--seeds", "2", "--extensions", "1", "--warmups", "0.05", "0.5",
                 "--warmup-batches", "1", "--jobs", "2", "--out", str(out)]) == 0
    s = json.loads((out / "study.json").read_text())
    first = {r["warmup"] for r in s["rows"] if r["batch_size"] == 8}
    assert first == {0.1}
    tried = [r for r in s["rows"] if r["batch_size"] == 32 and r["seed"] == 0]
    for w in (0.05, 0.5):
        assert len({r["lr"] for r in tried if r["warmup"] == w}) >= 3
    best = min(tried, key=lambda r: r["dev_loss"])
    seeds = [r for r in s["rows"] if r["batch_size"] == 32 and r["seed"] > 0]
    assert [(r["lr"], r["warmup"]) for r in seeds] == [(best["lr"], best["warmup"])]
    cell = analysis.analyse(s)["cells"]["adamw"]["32"]
    assert (cell["lr"], cell["warmup"]) == (best["lr"], best["warmup"])
    assert f"warm-up {best['warmup']:g})" in (out / "study.md").read_text()
    assert "--warmup " + repr(best["warmup"]) in seeds[0]["command"]


@pytest.mark.slow
def test_a_resumed_study_may_try_more_warm_ups_and_then_is_the_study_that_tried_them_all(
        tmp_path):
    """Where the chosen warm-up lies on the edge of those tried, ``--resume DIR --warmups``
    with one more: the runs recorded are kept, the new warm-up's run, each cell chooses again
    over all, and the study is the one that tried every warm-up from the start; warm-ups
    taken away are refused."""
    base = ["study", "large-batch", *MODEL, "--batch-sizes", "8", "32", "--optimizers",
            "adamw", "--seeds", "2", "--extensions", "1", "--warmup-batches", "1",
            "--jobs", "2"]
    part, whole = tmp_path / "part", tmp_path / "whole"
    assert main([*base, "--warmups", "0.05", "0.2", "--out", str(part)]) == 0
    first = (part / "runs.jsonl").read_text().splitlines()
    before = json.loads((part / "study.json").read_text())
    assert main([*base, "--warmups", "0.05", "0.2", "0.5", "--resume", str(part)]) == 0
    assert main([*base, "--warmups", "0.05", "0.2", "0.5", "--out", str(whole)]) == 0
    again, fresh = (json.loads((d / "study.json").read_text()) for d in (part, whole))
    assert (part / "runs.jsonl").read_text().splitlines()[:len(first)] == first
    strip = lambda rows: sorted((study_journal.run_key(r), r["test_loss"]) for r in rows)  # noqa: E731
    assert strip(again["rows"]) == strip(fresh["rows"])
    # the study before it was resumed, made again from the journal alone
    journal = [json.loads(line) for line in (part / "runs.jsonl").read_text().splitlines()]
    earlier = study.protocol_of(build_parser().parse_args([*base, "--warmups", "0.05", "0.2"]))
    assert strip(study.replayed(earlier, journal)) == strip(before["rows"])
    wider = study.protocol_of(build_parser().parse_args([*base, "--warmups", "0.05", "0.8"]))
    with pytest.raises(ValueError, match="not recorded: scaleopt train .* --warmup 0.8"):
        study.replayed(wider, journal)
    assert {r["warmup"] for r in again["rows"] if r["batch_size"] == 32} >= {0.05, 0.2, 0.5}
    assert again["protocol"]["warmups"] == [0.05, 0.2, 0.5]
    assert main([*base, "--warmups", "0.05", "--resume", str(part)]) == 2


@pytest.mark.slow
def test_beta2_is_tuned_at_the_largest_batch_and_a_resumed_study_may_add_it(tmp_path):
    """``--beta2s 0.95 0.99``: at the largest batch each Adam-family optimizer's rate grid runs
    at each beta2 (crossed with the warm-ups), SGD's once; the seeds run the chosen (rate,
    warm-up, beta2), which the table names. A study started without it and resumed with it
    keeps its runs and is the study that tried both from the start."""
    base = ["study", "large-batch", *MODEL, "--batch-sizes", "8", "32", "--optimizers",
            "adamw", "momentum", "--seeds", "2", "--extensions", "1", "--warmups", "0.05",
            "0.5", "--warmup-batches", "1", "--jobs", "2"]
    part, whole = tmp_path / "part", tmp_path / "whole"
    assert main([*base, "--out", str(part)]) == 0
    first = (part / "runs.jsonl").read_text().splitlines()
    assert main([*base, "--beta2s", "0.95", "0.99", "--resume", str(part)]) == 0
    assert main([*base, "--beta2s", "0.95", "0.99", "--out", str(whole)]) == 0
    again, fresh = (json.loads((d / "study.json").read_text()) for d in (part, whole))
    assert (part / "runs.jsonl").read_text().splitlines()[:len(first)] == first
    strip = lambda rows: sorted((study_journal.run_key(r), r["test_loss"]) for r in rows)  # noqa: E731
    assert strip(again["rows"]) == strip(fresh["rows"])
    s = fresh
    assert s["protocol"]["beta2s"] == [0.95, 0.99] and s["protocol"]["beta2_batches"] == 1
    beta2 = analysis.beta2_of
    assert {beta2(r) for r in s["rows"] if r["optimizer"] == "adamw" and r["batch_size"] == 8} \
        == {0.95}
    assert {beta2(r) for r in s["rows"] if r["optimizer"] == "momentum"} == {None}
    tried = [r for r in s["rows"] if r["optimizer"] == "adamw" and r["batch_size"] == 32
             and r["seed"] == 0]
    for b2 in (0.95, 0.99):
        for w in (0.05, 0.5):
            assert len({r["lr"] for r in tried if (r["warmup"], beta2(r)) == (w, b2)}) >= 3
    best = min(tried, key=lambda r: r["dev_loss"])
    seeds = [r for r in s["rows"] if r["optimizer"] == "adamw" and r["batch_size"] == 32
             and r["seed"] > 0]
    assert [(r["lr"], r["warmup"], beta2(r)) for r in seeds] == [
        (best["lr"], best["warmup"], beta2(best))]
    assert seeds[0]["betas"] == [0.9, beta2(best)]
    assert f"--betas 0.9 {beta2(best)!r}" in seeds[0]["command"]
    cell = analysis.analyse(s)["cells"]["adamw"]["32"]
    assert (cell["lr"], cell["warmup"], cell["beta2"]) == (best["lr"], best["warmup"],
                                                           beta2(best))
    assert set(cell["beta2s_tried"]) == {"0.95", "0.99"}
    md = (whole / "study.md").read_text()
    assert f"warm-up {best['warmup']:g}, beta2 {beta2(best):g})" in md
    assert "beta2 0.95 (at the largest batch size tuned among 0.95, 0.99)" in md
    assert main([*base, "--beta2s", "0.99", "--resume", str(part)]) == 2


def _sides(vs, sizes):
    """A row of the page's sittings table: where the correction keeps a difference with AdamW."""
    sides = {}
    for b in sizes:
        if vs[b]["clear"]:
            sides.setdefault("lower" if vs[b]["mean"] < 0 else "higher", []).append(b)
    if not sides:
        return "not told apart anywhere"
    return "; ".join(f"{k} at {' and '.join(v) if len(v) < 3 else ', '.join(v)}"
                     for k, v in sides.items())


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_pages_account_of_how_the_study_grew_is_its_journal_replayed():
    """Each sitting's study, made again from the committed journal with that sitting's options
    (as if it had been run alone), gives the page's row for it; the last is the study."""
    s, page = _committed()
    journal = [json.loads(line) for line in (STUDY / "runs.jsonl").read_text().splitlines()]
    assert len(journal) == 324 and len(s["rows"]) == 293
    assert "324 runs were\nrecorded, 293 of them in the final study" in page
    sittings = [(["--warmups", "0.05", "0.2", "0.5"], "`--warmups 0.05 0.2 0.5`"),
                (["--warmups", "0.05", "0.2", "0.5", "0.8"], "80% added to `--warmups`"),
                (["--warmups", "0.05", "0.2", "0.5", "0.8", "0.95"], "95% added to `--warmups`"),
                (["--warmups", "0.05", "0.2", "0.5", "0.8", "0.95", "--beta2s", "0.95", "0.99"],
                 "`--beta2s 0.95 0.99`")]
    apart, means = [], []
    for k, (options, said) in enumerate(sittings, 1):
        p = study.protocol_of(build_parser().parse_args(
            ["study", "large-batch", "--model", "gpt", *options, "--jobs", "2", "--threads", "1"]))
        rows = study.replayed(p, journal)
        a = analysis.analyse({"protocol": p.describe(), "rows": rows})
        sizes = [str(b) for b in p.batch_sizes]
        longest = p.warmups[-1]
        chosen = sum(a["cells"][n][b]["warmup"] == longest for n in a["cells"]
                     for b in sizes[-2:])
        adamw = a["cells"]["adamw"][sizes[-1]]
        how = f"lr {adamw['lr']:g}, warm-up {adamw['warmup']:.0%}" + (
            f", beta2 {adamw['beta2']:g}" if len(p.beta2s) > 1 else "")
        vs = {n: {b: a["batches"][b]["against_adamw"][n] for b in sizes}
              for n in ("lamb", "lans", "muon", "momentum")}
        row = (f"| {k} | {said} | {len(rows)} | {longest:.0%}, in {chosen} | "
               f"{_sides(vs['lamb'], sizes)} | {_sides(vs['lans'], sizes)} | "
               f"{adamw['mean']:.3f} ({how}) |")
        assert row in page.splitlines(), row
        assert [_called(vs["muon"][b]) for b in sizes] == [-1] * 4
        assert [_called(vs["momentum"][b]) for b in sizes] == [1] * 4
        assert all(a["batches"][b]["order"][0] == "muon" for b in sizes)
        apart.append({(b, n) for b in sizes for n, d in a["batches"][b]["against_best"].items()
                      if not d["clear"]})
        if k == len(sittings) - 1:
            lans_before_beta2 = vs["lans"][sizes[-1]]["mean"]
        means.append({n: [a["cells"][n][b]["mean"] for b in sizes[-2:]] for n in a["cells"]})
        if k == len(sittings):
            assert sorted(map(study_journal.run_key, rows)) == sorted(
                map(study_journal.run_key, s["rows"]))
    assert apart == [set(), {("256", "lans"), ("256", "lamb")}, set(), set()]
    assert ("every sitting but the second (there, at batch 256, it is not told apart from LANS "
            "and LAMB)") in " ".join(page.split())
    gain = {n: [before - after for before, after in zip(means[0][n], means[-1][n])]
            for n in means[0]}
    for i in range(2):  # AdamW's mean fell the most at both of the largest batch sizes
        assert max(gain, key=lambda n: gain[n][i]) == "adamw"
    assert (f"by {gain['adamw'][0]:.3f} bits per byte at 64 and {gain['adamw'][1]:.3f} at 256"
            in " ".join(page.split()))
    assert round(lans_before_beta2, 3) == -0.172 and "same difference (0.172) was not called" in (
        " ".join(page.split()))


def test_the_pages_words_on_the_noise_scale_hold_in_its_measurements():
    """B_simple at the checkpoints of the committed study's batch-4 runs, as the page words it:
    its range, its intervals, how it moves between the targets, and against the one B_crit."""
    s, page = _committed()
    noise = s["noise_scale"]
    got = {(m["optimizer"], m["target"]): m for m in noise["measurements"] if m["reached"]}
    assert noise["batch"] == 4 and (noise["small"], noise["large"]) == (4, 256)
    assert sorted({n for n, _ in got}) == ["adamw", "lamb", "lans", "muon"] and len(got) == 8
    b = {k: m["b_simple"] for k, m in got.items()}
    assert f"{min(b.values()):.1f} to {max(b.values()):.1f}" == "11.5 to 36.9"
    for m in got.values():
        lo, hi = m["b_simple_95"]
        assert m["settled"] and 0.8 * m["b_simple"] <= lo <= m["b_simple"] <= hi <= 1.2 * (
            m["b_simple"])
    assert [n for n in ("lamb", "lans", "adamw", "muon") if b[n, 3.2] > b[n, 3.6]] == [
        "lamb", "lans", "adamw"]
    fit = next(t["fit"] for t in analysis.analyse(s)["optimizers"]["lans"]["targets"]
               if t["target"] == 3.6)
    assert round(fit["b_crit"] / b["lans", 3.6]) == 6
    text = " ".join(page.split())
    assert ("B_simple is 11.5 to 36.9 sequences over the four optimizers and two targets" in text
            and "B_simple (15.9 sequences) is about a sixth of B_crit (95)" in text)
    worst = max(got.values(), key=lambda m: m["largest_difference"])
    assert (worst["optimizer"], worst["target"]) == ("adamw", 3.2)
    assert f"to at most {worst['largest_difference']:.2g} bits per byte (AdamW's run at 3.2)" in (
        text)
    assert noise["within"] < worst["largest_difference"]


def test_the_pages_words_on_seed_zeros_selection_bias_hold_in_the_committed_study():
    """Seed 0's run chose each cell's setting: its test loss against the other seeds', over
    every cell, as the page states it."""
    import statistics

    s, page = _committed()
    gaps = []
    for cs in analysis.cells(s).values():
        for c in cs.values():
            test = {r["seed"]: r["test_bits_per_byte"] for r in c["runs"]
                    if (r["lr"], r["warmup"], analysis.beta2_of(r)) == (c["lr"], c["warmup"],
                                                                         c["beta2"])}
            assert sorted(test) == [0, 1, 2]
            gaps.append(test[0] - (test[1] + test[2]) / 2)
    mean, se = statistics.mean(gaps), statistics.stdev(gaps) / len(gaps) ** 0.5
    assert abs(mean) < 2 * se  # not told apart from none
    text = " ".join(page.split())
    assert (f"Over the study's {len(gaps)} cells its test loss lies {-mean:.3f} bits per byte "
            f"below the mean of seeds 1 and 2 (standard error {se:.3f}; below in "
            f"{sum(g < 0 for g in gaps)} of the {len(gaps)})") in text

