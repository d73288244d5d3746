"""The recipes of docs/recipes with the training frameworks users reach scaleopt through: HF
``Trainer`` and PyTorch Lightning, on tiny models built from a config (nothing downloaded). Each
trains, saves, resumes and compares with the uninterrupted run. Installed by the
``frameworks`` extra (``.ci/run`` installs it); skipped where the packages are absent."""

from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch

RECIPES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "recipes"
sys.path.insert(0, str(RECIPES))


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _trust_ratio_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args, **kwargs)
    return out, [w for w in caught if "takes the trust ratio" in str(w.message)]


# -- Hugging Face Trainer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import hf_trainer

    return hf_trainer


def test_hf_trainer_with_optimizers_resumes_bit_identically(hf, tmp_path):
    straight, trainer = hf.train_with_optimizers(str(tmp_path / "a"))
    import scaleopt

    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert trainer.state.global_step == 6 and type(inner) is scaleopt.LAMB
    resumed, trainer = hf.train_with_optimizers(str(tmp_path / "b"),
                                                resume=str(tmp_path / "a" / "checkpoint-3"))
    assert trainer.state.global_step == 6
    _assert_equal(_params(resumed), _params(straight))


def test_hf_trainer_cls_and_kwargs_warns_when_lamb_would_be_adam(hf, tmp_path):
    # TrainingArguments' default weight_decay (0.0) reaches every group: no trust ratio
    _, caught = _trust_ratio_warnings(hf.train_with_cls_and_kwargs, str(tmp_path / "wd0"),
                                      weight_decay=0.0, max_steps=2)
    assert len(caught) == 1 and "always_adapt" in str(caught[0].message)
    for kwargs in (dict(weight_decay=0.01), dict(weight_decay=0.0, always_adapt=True)):
        _, caught = _trust_ratio_warnings(hf.train_with_cls_and_kwargs, str(tmp_path / "ok"),
                                          max_steps=2, **kwargs)
        assert caught == [], kwargs


def test_hf_trainer_cls_and_kwargs_resumes_bit_identically(hf, tmp_path):
    straight, _ = hf.train_with_cls_and_kwargs(str(tmp_path / "a"))
    resumed, _ = hf.train_with_cls_and_kwargs(str(tmp_path / "b"),
                                              resume=str(tmp_path / "a" / "checkpoint-3"))
    _assert_equal(_params(resumed), _params(straight))


# -- PyTorch Lightning ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lit():
    pytest.importorskip("lightning")
    import lightning_lamb

    return lightning_lamb


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_resumes_bit_identically(lit, tmp_path, precision):
    straight = lit.fit(str(tmp_path / "a"), precision=precision)
    resumed = lit.fit(str(tmp_path / "b"), precision=precision,
                      ckpt_path=str(tmp_path / "a" / "epoch=0-step=4.ckpt"))
    _assert_equal(_params(resumed), _params(straight))


def test_lightning_clipping_and_the_optimizers_max_grad_norm_agree(lit, tmp_path):
    by_lightning = lit.fit(str(tmp_path / "a"), clip=0.05)
    by_the_optimizer = lit.fit(str(tmp_path / "b"), max_grad_norm=0.05)
    unclipped = lit.fit(str(tmp_path / "c"))
    for a, b in zip(_params(by_lightning), _params(by_the_optimizer)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not all(torch.allclose(a, b) for a, b in zip(_params(by_lightning), _params(unclipped)))


@pytest.mark.parametrize("optimizer", ["lamb", "offload-adam"])
def test_lightning_clips_under_bf16_for_optimizers_that_take_the_scalers_scale(lit, tmp_path,
                                                                             optimizer):
    """LAMB and OffloadAdam take a GradScaler's scale in their step; Lightning's clipping under
    bf16-mixed (no scaler) still runs, and equals the optimizer's own clipping."""
    by_lightning = lit.fit(str(tmp_path / "a"), precision="bf16-mixed", clip=0.05,
                           optimizer=optimizer)
    by_the_optimizer = lit.fit(str(tmp_path / "b"), precision="bf16-mixed",
                               optimizer=optimizer, max_grad_norm=0.05)
    unclipped = lit.fit(str(tmp_path / "c"), precision="bf16-mixed", optimizer=optimizer)
    # the two clipping norms are summed in other orders; Adam's normalised step can carry that
    # round-off into the 5th digit of a weight whose gradients are tiny
    for a, b in zip(_params(by_lightning), _params(by_the_optimizer)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert max(float((a - b).abs().max()) for a, b in zip(_params(by_lightning),
                                                          _params(unclipped))) > 1e-3


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_dgc_under_lightning_ddp_on_cpu_is_used_and_resumes_bit_identically(lit, tmp_path):
    import lightning_dgc

    initial = _params(lit.Classifier())
    straight = lightning_dgc.fit(str(tmp_path / "a"))
    dense = lightning_dgc.fit(str(tmp_path / "dense"), dgc=False)
    assert not any(torch.equal(a, b) for a, b in zip(_params(straight), initial))
    # the hook ran (Lightning alone would have trained without it on the CPU)
    assert not all(torch.allclose(a, b) for a, b in zip(_params(straight), _params(dense)))
    ckpt = tmp_path / "a" / "epoch=0-step=4.ckpt"
    states = torch.load(ckpt, weights_only=False)["dgc_hook_states"]
    assert [s["rank"] for s in states] == [0, 1] and all(s["step"] == 4 for s in states)
    name = "net.0.weight"
    assert not torch.equal(states[0]["residuals"][name]["v"], states[1]["residuals"][name]["v"])
    resumed = lightning_dgc.fit(str(tmp_path / "b"), ckpt_path=str(ckpt))
    _assert_equal(_params(resumed), _params(straight))
