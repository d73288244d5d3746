"""The transformer on real text: the corpus, the gpt model, ``scaleopt train --model gpt``, the
study on it, and the gradient noise scale (scaleopt.GradientNoiseScale)."""

import collections
import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

import scaleopt
from scaleopt.cli import main, models, noise_scale, text

#: a gpt model small enough for tests: 1 block of width 32 on 16-byte windows
MODEL = ["--model", "gpt", "--width", "32", "--layers", "1", "--context", "16",
         "--train-size", "1024", "--no-progress", "--threads", "1"]
TINY = MODEL + ["--batch-size", "32"]


def test_the_corpus_is_real_text_that_ships_with_python_and_names_itself():
    data, identity = text.corpus()
    assert identity["bytes"] == len(data) > 300_000
    assert identity["sha256"] == hashlib.sha256(data).hexdigest()
    assert text.corpus() == (data, identity)  # the same bytes every time
    words = collections.Counter(data.decode("utf-8").split())
    assert {"the", "of", "is", "a"} <= {w for w, _ in words.most_common(20)}  # English prose
    train, test = text.splits("tail")
    assert len(train) + len(test) == len(data) and len(test) == pytest.approx(0.1 * len(data), abs=1)
    assert bytes(train[:100].tolist()) == data[:100] and bytes(test[-100:].tolist()) == data[-100:]


def _windows(t, n=64):
    b = bytes(t.tolist())
    return [b[i:i + n] for i in range(len(b) - n + 1)]


def test_the_held_out_text_shares_no_64_byte_window_with_the_training_bytes():
    """The default split holds out whole groups of topics: no 64-byte window of the
    development or the test part occurs anywhere in the training bytes; every topic is in
    exactly one part; the parts' sizes are the docs'."""
    from pydoc_data.topics import topics

    train, validation = text.splits()
    dev, test = text.heldout()
    seen = set(_windows(train))
    for part in (dev, test):
        assert not any(w in seen for w in _windows(part))
    parts = [bytes(t.tolist()).decode("utf-8") for t in (train, dev, test)]
    for body in topics.values():
        assert sum(body in part for part in parts) == 1
    assert torch.equal(validation, torch.cat([dev, torch.tensor([10, 10]), test]))
    total = len(text.corpus()[0])
    assert len(test) <= text.TEST_SHARE * total and len(dev) <= text.DEV_SHARE * total
    assert (len(train), len(dev), len(test)) == (411_030, 18_055, 37_184)  # docs/cli.md
    # the earlier split's test part does share text with training (why it is not the default)
    old_train, _ = text.splits("tail")
    old_seen = set(_windows(old_train))
    assert any(w in old_seen for w in _windows(text.heldout("tail")[1]))


def test_the_validation_bytes_split_into_a_development_and_a_test_part_at_a_topic():
    from pydoc_data.topics import topics

    _, validation = text.splits("tail")
    dev, test = text.heldout("tail")
    assert torch.equal(torch.cat([dev, test]), validation)
    assert 0 < len(dev) <= len(validation) // 2 < len(test)
    whole = bytes(test.tolist()).decode("utf-8")
    starts = [t for t in topics.values() if whole.startswith(t[:200])]
    assert len(starts) == 1  # the test part begins where a topic begins
    assert whole.endswith(topics[sorted(topics)[-1]])  # and ends with the last topic
    # a run with --dev-split evaluates along the run on the test part, at the end on the dev one
    x, y, xt, yt, _ = text.load(64, 16, split="test", kind="tail")
    assert torch.equal(xt.flatten(), test[:xt.numel()])
    assert torch.equal(text.load(64, 16, split="dev", kind="tail")[2].flatten(),
                       dev[:len(dev) // 16 * 16])
    test = text.heldout()[1]
    xt = text.load(64, 16, split="test")[2]
    assert xt.numel() > 0 and torch.equal(xt.flatten(), test[:xt.numel()])


def test_windows_are_the_same_for_a_seed_and_targets_are_the_next_bytes():
    train, test = text.splits()
    x, y = text.windows(train, 50, 16, seed=1)
    assert torch.equal(x, text.windows(train, 50, 16, seed=1)[0])
    assert not torch.equal(x, text.windows(train, 50, 16, seed=2)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])
    xt, yt = text.tiled(test, 16)
    assert torch.equal(xt.flatten(), test[:xt.numel()])  # every byte once, in order
    assert torch.equal(yt.flatten(), test[1:xt.numel() + 1])


def test_the_unigram_baseline_is_the_cross_entropy_of_the_byte_frequencies():
    train, test = text.splits()
    counts = collections.Counter(train.tolist())
    total = len(train) + 256
    expected = -sum(math.log2((counts.get(b, 0) + 1) / total) for b in test[1:].tolist()) / (len(test) - 1)
    assert text.unigram_bits_per_byte() == pytest.approx(expected, rel=1e-9)
    assert 4 < expected < 5.5  # English in UTF-8


def test_the_gpt_model_is_causal_and_meets_every_kind_of_layer():
    torch.manual_seed(0)
    model = models.GPT(width=64, layers=2, context=16)
    x = torch.randint(0, 256, (2, 16))
    out = model(x)
    assert out.shape == (2, 16, 256)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    again = model(changed)
    assert torch.equal(out[:, :10], again[:, :10])  # no byte sees a later one
    assert not torch.allclose(out[:, 10:], again[:, 10:])
    groups = scaleopt.param_groups(model, weight_decay=0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert "blocks.0.qkv.weight" in names and "head.weight" in names
    assert not any(n.endswith("bias") or ".ln" in n or n.startswith("ln") for n in names)
    with pytest.raises(ValueError, match="multiple of 32"):
        models.GPT(width=48, layers=1, context=8)


def test_train_gpt_learns_the_text_and_records_the_corpus(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "60", "--lr", "0.1", "--out", str(out)]) == 0
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["model"] == "gpt" and r["config"]["dataset"] == "text"
    assert r["corpus"] == text.corpus()[1]
    assert r["tokens"] == 60 * 32 * 16
    assert r["test_bits_per_byte"] == pytest.approx(r["test_loss"] / math.log(2))
    # from 8 bits (uniform over bytes) to clearly below the unigram baseline
    assert r["test_bits_per_byte"] < 0.9 * r["unigram_bits_per_byte"]
    printed = capsys.readouterr().out
    assert "bits per byte (the unigram baseline's" in printed and "tokens/s" in printed


def test_the_dataset_and_the_model_go_together(tmp_path, capsys):
    assert main(["train", "--dataset", "text", "--model", "mlp", "--out", str(tmp_path / "a")]) == 2
    assert "does not train on" in capsys.readouterr().err
    assert main(["train", *TINY, "--width", "48", "--out", str(tmp_path / "b")]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    assert main(["train", *TINY, "--batch-size", "33", "--measure-noise",
                 "--out", str(tmp_path / "c")]) == 2
    assert "two halves" in capsys.readouterr().err


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_gpt_on_two_sharded_workers_computes_what_one_process_computes(tmp_path):
    """FSDP2 over the blocks: the same run as one process, noise scale included (the
    gradients, averaged over the ranks, differ in their last bits)."""
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        extra = ["--workers", "2", "--shard"] if workers > 1 else []
        assert main(["train", *TINY, "--steps", "12", "--measure-noise", *extra,
                     "--out", str(out)]) == 0
        runs[workers] = json.loads((out / "result.json").read_text())
    one, two = runs[1], runs[2]
    assert two["sharded"] and two["workers"] == 2
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-4)
    assert len(two["noise_scale"]["history"]) == len(one["noise_scale"]["history"]) == 12
    for a, b in zip(one["noise_scale"]["history"], two["noise_scale"]["history"]):
        assert b["g2"] == pytest.approx(a["g2"], rel=1e-3)
        assert b["trace"] == pytest.approx(a["trace"], rel=1e-3, abs=1e-3 * abs(a["g2"]))


def _example_gradients(model, x, y):
    """Each example's gradient, flattened: (examples, parameters)."""
    params = [p for p in model.parameters()]
    rows = []
    for i in range(len(x)):
        loss = F.cross_entropy(model(x[i:i + 1]).flatten(0, 1), y[i].flatten())
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows).double()


def _pool():
    """A tiny GPT past its first steps (where |G| dwarfs the noise), a pool of 256 sequences,
    and the pool's exact |G|^2 and tr(Sigma) (sampling with replacement: the pool's mean
    gradient and covariance) from its per-example gradients."""
    torch.manual_seed(0)
    train, _ = text.splits()
    x, y = text.windows(train, 256, 16, seed=3)
    model = models.GPT(width=32, layers=1, context=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(60):
        b = torch.randint(0, len(x), (32,))
        opt.zero_grad()
        F.cross_entropy(model(x[b]).flatten(0, 1), y[b].flatten()).backward()
        opt.step()
    per_example = _example_gradients(model, x, y)
    mean = per_example.mean(0)
    return model, x, y, {"g2": mean.square().sum().item(),
                         "trace": ((per_example - mean) ** 2).sum(1).mean().item()}


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_noise_scale_from_two_batch_sizes_matches_a_direct_estimate():
    """At fixed weights, over a pool of N sequences sampled with replacement, the gradient's
    mean is exactly the pool's mean gradient G and its covariance the pool's, so the direct
    value tr(Sigma) / |G|^2 is exact. The two-batch estimates of |G|^2 and tr(Sigma) are
    unbiased, and their averages over 300 measurements have a relative standard error of a few
    percent at these sizes (micro-batches of 8, near B_simple, where neither term swamps the
    other); the ratio of averages is then within a few tens of percent. A factor of 2 leaves
    room for that, and still fails an estimator that is off by a factor of the batch size or
    of k (the errors an estimator of this kind makes)."""
    model, x, y, exact = _pool()
    direct = exact["trace"] / exact["g2"]

    noise = scaleopt.GradientNoiseScale(model.parameters(), beta=0.995)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        model.zero_grad(set_to_none=True)
        noise.begin()
        for _ in range(2):
            part = torch.randint(0, len(x), (8,), generator=g)
            (F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten()) / 2).backward()
            noise.accumulated()
        noise.end(micro_batch=8)
    assert 1 < direct < 200  # a regime where the test can tell estimators apart
    assert direct / 2 < noise.b_simple < direct * 2, (noise.b_simple, direct)


def test_the_noise_scale_at_a_checkpoint_brackets_the_pools_exact_values():
    """``scaleopt study noise-scale``'s measurement at fixed weights: independent batches of
    2 and 64 sequences drawn with replacement from the pool. Its estimates of |G|^2 and
    tr(Sigma) are unbiased, so their 95% bootstrap intervals hold the pool's exact values, and
    B_simple's holds their ratio; an estimator off by a factor of a batch size misses them.
    The measurement stops once |G|^2's interval lies above zero, and says so."""
    model, x, y, exact = _pool()
    e = noise_scale.measure(model, x, y, small=2, large=64, per_round=512, min_rounds=2,
                            rounds=8)
    assert e["settled"] and e["g2_95"][0] > 0 and 2 <= e["rounds"] <= 8
    assert e["batches"] == [256 * e["rounds"], 8 * e["rounds"]]
    direct = exact["trace"] / exact["g2"]
    for key, value in (("g2", exact["g2"]), ("trace", exact["trace"]), ("b_simple", direct)):
        lo, hi = e[key + "_95"]
        assert lo <= value <= hi, (key, lo, value, hi)
        assert lo <= e[key] <= hi
    assert 1 < direct < 200 and hi / lo < 3  # an interval narrow enough to mean something


def test_the_noise_scale_estimate_refuses_batches_it_cannot_use():
    with pytest.raises(ValueError, match="below the large"):
        noise_scale.estimate([1.0, 2.0], [1.0, 2.0], 8, 8)
    with pytest.raises(ValueError, match="two measurements"):
        noise_scale.estimate([1.0], [1.0, 2.0], 2, 8)
    # |G|^2 estimated at or below zero: B_simple has no finite value
    e = noise_scale.estimate([1.0, 1.0], [2.0, 2.0], 2, 8)
    assert e["g2"] > 0 and e["trace"] < 0
    e = noise_scale.estimate([10.0, 10.0], [0.1, 0.1], 2, 8)
    assert e["g2"] < 0 and e["b_simple"] == math.inf and e["b_simple_95"][1] == math.inf


def test_the_noise_scale_refuses_too_few_micro_batches():
    model = torch.nn.Linear(3, 1)
    noise = scaleopt.GradientNoiseScale(model.parameters())
    noise.begin()
    model(torch.ones(2, 3)).sum().backward()
    noise.accumulated()
    with pytest.raises(ValueError, match="two or more micro-batches"):
        noise.end(micro_batch=2)
    with pytest.raises(ValueError, match="beta"):
        scaleopt.GradientNoiseScale(model.parameters(), beta=1.0)
    assert math.isnan(scaleopt.GradientNoiseScale(model.parameters()).b_simple)


@pytest.mark.slow
def test_the_study_on_two_sharded_workers_computes_what_one_process_computes(tmp_path):
    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        extra = ["--workers", "2", "--shard"] if workers > 1 else []
        assert main(["study", "large-batch", *MODEL, "--batch-sizes", "16", "--optimizers",
                     "lans", "--grid", "1", "--extensions", "0", "--seeds", "1", "--jobs", "1",
                     "--epochs", "1", *extra, "--out", str(out)]) == 0
        rows[workers] = json.loads((out / "study.json").read_text())["rows"]
    (one,), (two,) = rows[1], rows[2]
    assert two["steps"] == one["steps"] == 1024 // 16
    assert two["test_bits_per_byte"] == pytest.approx(one["test_bits_per_byte"], rel=1e-4)
    assert two["dev_bits_per_byte"] == pytest.approx(one["dev_bits_per_byte"], rel=1e-4)
    b_simple = [[trace / g2 for _, g2, trace in r["noise"]] for r in (one, two)]
    assert b_simple[1] == pytest.approx(b_simple[0], rel=1e-2)


@pytest.mark.parametrize("options", [["--state-dtype", "int8"], ["--offload"],
                                     ["--optimizer", "muon"]])
def test_gpt_trains_with_compact_state_offload_and_muon(tmp_path, options):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "8", *options, "--out", str(out)]) == 0
    r = json.loads((out / "result.json").read_text())
    assert r["steps"] == 8 and math.isfinite(r["test_bits_per_byte"])


def test_muon_leaves_the_gpt_models_embeddings_and_head_to_adamw():
    from scaleopt.cli import optimizers
    from scaleopt.cli.config import Config

    cfg = Config(optimizer="muon", dataset="text", model="gpt", width=32, layers=2)
    torch.manual_seed(0)
    model = models.GPT(32, 2, 16)
    opt = optimizers.build(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    assert muon == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc", "out")}


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_a_resumed_gpt_run_with_noise_measurement_ends_where_an_unbroken_one_does(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    run = ["train", *TINY, "--steps", "10", "--measure-noise"]
    assert main([*run, "--out", str(whole)]) == 0
    assert main([*run, "--stop-after", "5", "--out", str(part)]) == 0
    assert main(["train", "--resume", str(part), "--no-progress"]) == 0
    a = json.loads((whole / "result.json").read_text())
    b = json.loads((part / "result.json").read_text())
    assert b["resumed_at"] == 5 and b["steps"] == 10
    assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-6)
    assert b["noise_scale"]["b_simple"] == pytest.approx(a["noise_scale"]["b_simple"], rel=1e-6)
    assert len(b["noise_scale"]["history"]) == len(a["noise_scale"]["history"]) == 10
