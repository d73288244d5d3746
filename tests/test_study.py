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
    assert proto["warmups"] == [0.05, 0.2, 0.5] and proto["warmup_batches"] == 2
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
    assert [_called(vs["lamb"][b]) for b in sizes] == [-1, 0, 1, 1]
    assert [round(vs["lamb"][b]["mean"], 3) for b in ("4", "64", "256")] == [-0.074, 0.188, 0.246]
    assert [_called(vs["lans"][b]) for b in sizes] == [0, 0, 1, -1]
    assert [round(vs["lans"][b]["mean"], 3) for b in ("64", "256")] == [0.025, -0.273]
    assert [_called(vs["muon"][b]) for b in sizes] == [-1] * 4
    assert [_called(vs["momentum"][b]) for b in sizes] == [1] * 4
    rise = {n: analysis.paired(c[sizes[-1]]["scores"], c[sizes[0]]["scores"])["mean"]
            for n, c in a["cells"].items()}
    adam_family = {n: r for n, r in rise.items() if n != "momentum"}
    assert min(adam_family, key=adam_family.get) == "lans"
    rates = {n: [a["cells"][n][b]["lr"] for b in sizes] for n in a["cells"]}
    for n in ("lamb", "lans"):  # the square-root rule: x2 for every 4x batch
        assert [r / q for q, r in zip(rates[n], rates[n][1:])] == pytest.approx([2, 2, 2])
    assert rates["adamw"] == pytest.approx([0.0025, 0.005, 0.005, 0.0025])
    muon = rates["muon"]
    assert muon[0] < muon[1] < muon[2] and muon[3] < muon[2]
    assert rates["momentum"][-1] / rates["momentum"][0] < int(sizes[-1]) / int(sizes[0])
    assert not any(c["edge"] for cs in a["cells"].values() for c in cs.values())
    warm = {(n, b): a["cells"][n][b]["warmup"] for n in a["cells"] for b in sizes[-2:]}
    assert sum(w == 0.5 for w in warm.values()) == 7 and len(warm) == 10
    assert {k for k, w in warm.items() if w == 0.05} == {("lans", "64"), ("momentum", "256")}
    cfg = s["protocol"]["config"]  # "about 0.8 tokens per parameter"
    params = sum(p.numel() for p in models.GPT(cfg["width"], cfg["layers"],
                                               cfg["context"]).parameters())
    assert round(cfg["train_size"] * cfg["context"] / params, 1) == 0.8
    choosing = " ".join((DOCS / "choosing.md").read_text().split())
    assert ("LAMB was lower than a tuned AdamW only at batch 4; at 64 and 256 it was higher "
            "with warm-ups up to half the examples" in choosing)
    assert "lower than every other optimizer at all four after the correction" in choosing
    assert "LANS, lower than AdamW there with warm-ups up to half the examples" in choosing
    assert "AdamW's went 0.0025, 0.005, 0.005, 0.0025 from batch 4 to 256" in choosing
    assert "(half the examples) in 7 of its 10 cells" in choosing


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


def test_the_readme_states_the_studys_own_headline_and_cost():
    s, _ = _committed()
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert " ".join(study_report.headline(s).split()) in readme
    assert f"{len(s['rows'])} runs in {s['time_s'] / 60:.0f} minutes" in readme

    cfg, sizes = s["protocol"]["config"], s["protocol"]["batch_sizes"]
    model = models.GPT(cfg["width"], cfg["layers"], cfg["context"])
    assert f"a {sum(p.numel() for p in model.parameters()):,}-parameter transformer" in readme
    assert f"at batch {min(sizes)} to" in readme and f"at batch {max(sizes)}," in readme
    assert "3 seeds per chosen rate" in readme and s["protocol"]["seeds"] == 3


def test_the_pages_sentences_on_the_critical_batch_hold_in_the_committed_study():
    """Of the ten fits, AdamW's and LANS's at 3.6 alone hold, over batches 4, 16 and 64 (below
    both B_crit); every other is withdrawn by its test or has fewer than three batch sizes."""
    s, page = _committed()
    a = analysis.analyse(s)
    fits = {(n, t["target"]): t["fit"] for n, o in a["optimizers"].items() for t in o["targets"]}
    assert len(fits) == 10
    holding = {k: f for k, f in fits.items() if f is not None and f["holds"]}
    assert sorted(holding) == [("adamw", 3.6), ("lans", 3.6)]
    for f in holding.values():
        assert f["batches"] == [4, 16, 64] and f["b_crit"] > 64
    assert [round(holding["adamw", 3.6][k], 1) for k in ("b_crit",)] == [64.8]
    assert round(holding["lans", 3.6]["b_crit"]) == 95
    for f in fits.values():
        assert f is None or f["holds"] or f["lack_of_fit"]["superlinear"] or (
            f["lack_of_fit"]["p"] < analysis.ALPHA)
    assert "Of the ten fits (five optimizers, two targets), two hold, both at 3.6" in " ".join(
        page.split())


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
        assert (m["lr"], m["warmup"]) == (cell["lr"], cell["warmup"])
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


def test_the_pages_words_on_longer_warm_ups_hold_in_their_study():
    """The committed study resumed with one more warm-up (80% of the examples): its runs are
    the committed study's and more, and the longest is chosen where the page says."""
    s, page = _committed()
    w = json.loads((STUDY.parent / "large_batch_gpt_topics_w08" / "study.json").read_text())
    assert w["complete"] and w["protocol"]["warmups"] == [0.05, 0.2, 0.5, 0.8]
    journal = (STUDY.parent / "large_batch_gpt_topics_w08" / "runs.jsonl").read_text()
    runs = [json.loads(line) for line in journal.splitlines()]
    assert {study_journal.run_key(r) for r in s["rows"]} < {study_journal.run_key(r)
                                                             for r in runs}
    a, sizes = analysis.analyse(w), [str(b) for b in w["protocol"]["batch_sizes"][-2:]]
    warm = {(n, b): a["cells"][n][b]["warmup"] for n in a["cells"] for b in sizes}
    longest = sorted(k for k, v in warm.items() if v == 0.8)
    text = " ".join(page.split())
    assert f"80% is chosen in {len(longest)} of the 10 cells" in text
    assert len(longest) == 7 and ("lans", "64") not in longest
    assert "again the longest (80%) in 7 of them" in " ".join(
        (DOCS / "choosing.md").read_text().split())
    vs = {n: [a["batches"][b]["against_adamw"][n] for b in map(str, w["protocol"]["batch_sizes"])]
          for n in ("lamb", "lans", "muon", "momentum")}
    assert {n: [_called(d) for d in ds] for n, ds in vs.items()} == {
        "lamb": [-1, 0, 0, 0], "lans": [0] * 4, "muon": [-1] * 4, "momentum": [1] * 4}
    assert ("LAMB is lower at batch 4 and not told apart at 16, 64 and 256, and LANS is not told "
            "apart at any batch size; Muon stays lower and SGD with momentum higher at all four"
            in text)
    adamw = [a["cells"]["adamw"]["256"][k] for k in ("mean", "lr")]
    old = [analysis.analyse(s)["cells"]["adamw"]["256"][k] for k in ("mean", "lr")]
    assert f"from {old[0]:.3f} to {adamw[0]:.3f}" in text and [old[1], adamw[1]] == [0.0025, 0.005]
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert ("(chosen in 7 of the 10 cells at 64 and 256: the warm-up still binds), LAMB is lower "
            "at batch 4 and not told apart at 16, 64 and 256, and LANS is not told apart at any "
            "batch size") in readme
    more = len(runs) - len((STUDY / "runs.jsonl").read_text().splitlines())
    assert f"{more} more runs" in text
