"""``scaleopt study large-batch``: the protocol (every batch tuned on a development split,
grids extended at their edges, seeds of each chosen rate, runs repeatable from their recorded
command), its statistics (paired differences, steps to a target, B_crit's fit, B_simple at a
loss), and the large-batch page, whose results are made from the study's committed JSON."""

from __future__ import annotations

import json
import math
import pathlib
import shlex

import pytest

from scaleopt.cli import analysis, main, models, study, study_report

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
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
        assert f"- Batch {b} ({cell['steps']} steps): lowest {best} ({cell['mean']:.3f})" in md
        assert cell["mean"] == min(a["cells"][n][b]["mean"] for n in ranking["order"])
    assert "lamb minus AdamW, each tuned at each batch: batch 8: " in md and "target 5" in md


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
def _committed():
    return (json.loads((DOCS / "large_batch_gpt.json").read_text()),
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
    dev, test = text.heldout()
    assert f"({len(dev):,}\nbytes, starting mid-topic)" in page and f"({len(test):,} bytes" in page
    assert cfg["max_grad_norm"] == 1.0 and cfg["betas"] == [0.9, 0.95] and cfg["warmup"] == 0.1
    assert proto["grid"] == [0.5, 1.0, 2.0] and proto["extensions"] == 2
    assert proto["targets"] == [3.6, 3.2] and cfg["evals"] == 16 and cfg["eval_spacing"] == "log"
    steps = sorted({r["steps"] for r in s["rows"]}, reverse=True)
    assert ", ".join(f"{n:,}" for n in steps[:-1]) + f" and {steps[-1]} steps" in page


def test_the_pages_sentences_of_results_hold_in_the_committed_study():
    """The sentences of docs/large_batch.md's "What it shows" and docs/choosing.md, against the
    runs: who is lowest, LAMB and LANS against AdamW, how the losses rise, the tuned rates."""
    s, _ = _committed()
    a = analysis.analyse(s)
    sizes = [str(b) for b in sorted(s["protocol"]["batch_sizes"])]
    vs = {n: {b: a["batches"][b]["against_adamw"][n] for b in sizes}
          for n in ("lamb", "lans", "muon", "momentum")}
    for b in sizes:  # Muon lowest everywhere, every other optimizer behind beyond the interval
        assert a["batches"][b]["order"][0] == "muon"
        assert all(d["clear"] for d in a["batches"][b]["against_best"].values())
    lamb, lans = vs["lamb"], vs["lans"]
    assert lamb["4"]["clear"] and -0.1 < lamb["4"]["mean"] < 0
    assert not any(lamb[b]["clear"] for b in sizes[1:])
    assert not lans["4"]["clear"]
    assert all(lans[b]["clear"] and lans[b]["mean"] < 0 for b in sizes[1:])
    assert lans["16"]["mean"] > lans["64"]["mean"] > lans["256"]["mean"]  # a growing margin
    assert all(vs["momentum"][b]["clear"] and vs["momentum"][b]["mean"] > 0 for b in sizes)
    rise = {n: analysis.paired(c[sizes[-1]]["scores"], c[sizes[0]]["scores"])["mean"]
            for n, c in a["cells"].items()}
    assert min(rise, key=rise.get) == "lans"
    rates = {n: [a["cells"][n][b]["lr"] for b in sizes] for n in a["cells"]}
    for n in ("lamb", "lans"):  # the square-root rule: x2 for every 4x batch
        assert [r / q for q, r in zip(rates[n], rates[n][1:])] == pytest.approx([2, 2, 2])
    adamw = rates["adamw"]
    assert adamw[0] == adamw[2] == adamw[3] and adamw[1] == pytest.approx(2 * adamw[0])
    muon = rates["muon"]
    assert muon[0] < muon[1] < muon[2] and muon[3] < muon[2]
    momentum = rates["momentum"]
    assert momentum[-1] / momentum[0] < int(sizes[-1]) / int(sizes[0])  # less than linear
    assert not any(c["edge"] for cs in a["cells"].values() for c in cs.values())


def test_the_readme_states_the_studys_own_headline_and_cost():
    s, _ = _committed()
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert " ".join(study_report.headline(s).split()) in readme
    assert f"{len(s['rows'])} runs in {s['time_s'] / 60:.0f} minutes" in readme

    cfg, sizes = s["protocol"]["config"], s["protocol"]["batch_sizes"]
    model = models.GPT(cfg["width"], cfg["layers"], cfg["context"])
    assert f"a {sum(p.numel() for p in model.parameters()):,}-parameter transformer" in readme
    assert f"from {min(sizes)} to {max(sizes)} sequences" in readme and s["protocol"]["seeds"] == 3


def test_the_pages_sentences_on_the_critical_batch_hold_in_the_committed_study():
    s, _ = _committed()
    a = analysis.analyse(s)
    fits = {(n, t["target"]): t for n, o in a["optimizers"].items() for t in o["targets"]}
    for t in fits.values():  # each 4x larger batch divides the steps by less than the one before
        steps = [t["steps"][b] for b in sorted(t["steps"], key=int)]
        ratios = [x / y for x, y in zip(steps, steps[1:])]
        assert len(ratios) >= 1 and all(r2 < r1 for r1, r2 in zip(ratios, ratios[1:]))
    fitted = {k: t for k, t in fits.items() if t["fit"] is not None}
    assert len(fitted) == 9
    crit = sorted(t["fit"]["b_crit"] for t in fitted.values())
    assert 10 <= crit[0] < 12 and 140 < crit[-1] <= 150  # "between about 10 and 150"
    for target in (3.6, 3.2):  # LANS's and Muon's intervals above LAMB's
        lamb_hi = fits["lamb", target]["fit"]["b_crit_95"][1]
        assert all(fits[n, target]["fit"]["b_crit_95"][0] > lamb_hi for n in ("lans", "muon"))
    below = {k for k, t in fitted.items() if t["noise"]["b_simple"] < t["fit"]["b_crit"]}
    assert set(fitted) - below == {("momentum", 3.6)}
    apart = {k for k, t in fitted.items()
             if t["noise"]["b_simple_95"][1] < t["fit"]["b_crit_95"][0]}
    assert len(apart) == 4
    factor = {k: t["fit"]["b_crit"] / t["noise"]["b_simple"] for k, t in fitted.items()}
    assert max(factor, key=factor.get) == ("muon", 3.6) and 11 < factor["muon", 3.6] < 13


@pytest.mark.slow
def test_the_report_of_an_interrupted_study_says_what_finished(tiny_study):
    """A study stopped early has cells, optimizers or batch sizes without runs: its report
    still writes, and says so."""
    _, s = tiny_study
    for keep in (1, 4, 9, len(s["rows"]) - 1):
        part = dict(s, rows=s["rows"][:keep], complete=False)
        md = study_report.markdown(part)
        assert "INTERRUPTED" in md and md.startswith(s["title"])
