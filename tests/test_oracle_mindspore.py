"""The MindSpore AdamOffload golden cases, replayed through scaleopt.compat.mindspore."""

from __future__ import annotations

import pytest
import torch

import scaleopt
from scaleopt.compat import mindspore

from oracle import assert_variant_misses, case_files, load, make_params, replay

CASES = case_files(["mindspore_"])


def _resolve(value, params):
    """Parameter names in a recorded ``params`` argument -> the tensors (with their names)."""
    if isinstance(value, str):
        return [(n, p) for n, p in params.items()]  # 'net.trainable_params()'
    groups = []
    for g in value:
        g = dict(g)
        for key in ("params", "order_params"):
            if key in g:
                g[key] = [(n, params[n]) if key == "params" else params[n] for n in g[key]]
        groups.append(g)
    return groups


def build(case, params):
    hp = dict(case["hyperparams"])
    norm = case["normalized"]
    for key, value in list(hp.items()):
        if isinstance(value, str) and key != "params":  # a callable recorded as source text
            pytest.fail(f"{case['case']}: cannot rebuild {key}={value!r}")
    hp["params"] = _resolve(hp.get("params", "net.trainable_params()"), params)
    for key in ("beta1", "beta2", "eps", "loss_scale"):
        if key in hp:
            hp[key] = float(hp[key])
    assert norm.get("eps_mode", "hat") == "hat"
    return mindspore.AdamOffload(**hp)


def state_of(opt):
    return lambda p: {"m": opt.state[p]["exp_avg"], "v": opt.state[p]["exp_avg_sq"]}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_golden_case(path, kernel, monkeypatch):
    if not kernel:
        from scaleopt import _native

        monkeypatch.setattr(_native, "adam_applies", lambda *a: False)
    case = load(path)
    params = make_params(case)
    opt = build(case, params)
    replay(case, params, opt.step, state_of(opt))


def test_the_golden_cases_are_there():
    names = {p.stem for p in CASES}
    assert {"mindspore_adamoffload_default", "mindspore_adamoffload_groups",
            "mindspore_adamoffload_wd"} <= names


def _case(name):
    return load(next(p for p in CASES if p.stem == name))


@pytest.mark.parametrize("name, change", [
    ("mindspore_adamoffload_default", dict(nesterov=True)),
    ("mindspore_adamoffload_wd", dict(decoupled=True)),
    ("mindspore_adamoffload_wd", dict(exclude_from_weight_decay=None)),
    ("mindspore_adamoffload_groups", dict(weight_decay=0.01)),
])
def test_a_plausible_wrong_variant_misses(name, change):
    case = _case(name)
    params = make_params(case)
    assert_variant_misses(case, params, build(case, params), change)


def test_torch_style_double_precision_scalars_miss_the_large_lr_case():
    # MindSpore keeps beta powers as float32 running products and computes 1-beta in float32;
    # with lr=0.1 the same Adam in double-precision scalars lands outside the tolerance.
    case = _case("mindspore_adamoffload_groups")
    params = make_params(case)
    opt = build(case, params)
    plain = scaleopt.OffloadAdam(
        [{"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"]}
         for g in opt.param_groups],
        decoupled=False, eps_mode="hat",
    )
    with pytest.raises(AssertionError):
        replay(case, params, plain.step)


def test_the_name_filter_decays_biases_but_not_beta_and_gamma():
    opt = build(_case("mindspore_adamoffload_wd"), make_params(_case("mindspore_adamoffload_wd")))
    g = opt.param_groups[0]
    excluded = [n for n, hit in zip(g["param_names"], opt._rule_flags(g, "exclude_from_weight_decay")) if hit]
    assert excluded == ["norm.gamma", "norm.beta"]


def test_loss_scale_divides_the_gradient_but_not_the_decay():
    case = _case("mindspore_adamoffload_wd")
    params = make_params(case)
    hp = dict(case["hyperparams"])
    opt = mindspore.AdamOffload(list(params.items()), loss_scale=1024.0, **hp)
    scaled = case["steps"]
    for rec in scaled:  # hand in 1024x the recorded gradients: the same trajectory
        for n, p in params.items():
            p.grad = torch.tensor(rec["grads"][n]).reshape(p.shape) * 1024.0
        opt.step()
        for n, p in params.items():
            want = torch.tensor(rec["params_after"][n]).reshape(p.shape)
            torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
