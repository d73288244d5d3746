"""LAMB and AdamW semantics a user relies on, checked against independent computations."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

import scaleopt

from close import assert_within_steps
from registry import REGISTRY


def model_and_named(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)
    return m, list(m.named_parameters())


def feed(params, t, scale=1.0):
    g = torch.Generator().manual_seed(t)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def test_without_decay_and_adaptation_lamb_is_torch_adam():
    """wd=0 and always_adapt=False: no trust ratio, i.e. Adam with eps outside sqrt(v_hat)."""
    _, a = model_and_named()
    _, b = model_and_named()
    pa, pb = [p for _, p in a], [p for _, p in b]
    lamb = scaleopt.LAMB(a, lr=1e-2, eps=1e-6, weight_decay=0.0)
    adam = torch.optim.Adam(pb, lr=1e-2, eps=1e-6, foreach=False)
    for t in range(10):
        feed(pa, t)
        feed(pb, t)
        lamb.step()
        adam.step()
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x, y)


def test_trust_ratio_by_hand():
    """One step on one tensor, computed independently in float64."""
    torch.manual_seed(0)
    w0 = torch.randn(4, 3, dtype=torch.float64)
    g = torch.randn(4, 3, dtype=torch.float64)
    p = nn.Parameter(w0.clone())
    opt = scaleopt.LAMB([p], lr=0.1, weight_decay=0.05, eps=1e-6)
    p.grad = g.clone()
    opt.step()
    m = 0.1 * g / (1 - 0.9)
    v = 0.001 * g * g / (1 - 0.999)
    u = m / (v.sqrt() + 1e-6) + 0.05 * w0
    expected = w0 - 0.1 * (w0.norm() / u.norm()) * u
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_zero_tensor_gets_ratio_one_not_nan():
    p = nn.Parameter(torch.zeros(5))
    opt = scaleopt.LAMB([p], lr=0.1, always_adapt=True)
    p.grad = torch.ones(5)
    opt.step()
    # ||w|| = 0 -> ratio 1: the plain first Adam step, lr * 1/(1 + eps)
    torch.testing.assert_close(p.detach(), torch.full((5,), -0.1 / (1 + 1e-6)))
    p.grad = torch.zeros(5)
    opt2 = scaleopt.LAMB([nn.Parameter(torch.zeros(3))], always_adapt=True)
    opt2.param_groups[0]["params"][0].grad = torch.zeros(3)
    opt2.step()
    assert torch.isfinite(opt2.param_groups[0]["params"][0]).all()


def test_exclusion_from_decay_and_adaptation_by_name():
    _, named = model_and_named()
    opt = scaleopt.LAMB(
        named,
        exclude_from_weight_decay=[r"\.bias$"],
        exclude_from_layer_adaptation=lambda n: n.startswith("2."),
        always_adapt=True,
    )
    group = opt.param_groups[0]
    _, wds, adapt = opt._layer_options(group, range(len(named)))
    decay = [w != 0 for w in wds]
    names = [n for n, _ in named]
    assert dict(zip(names, decay)) == {
        "0.weight": True, "0.bias": False, "2.weight": True, "2.bias": False,
    }
    assert dict(zip(names, adapt)) == {
        "0.weight": True, "0.bias": True, "2.weight": False, "2.bias": False,
    }


def test_excluded_tensor_takes_a_plain_adam_step():
    """Paddle/timm/apex default: a tensor with no decay gets no trust ratio."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8) * 10)  # large norm: a ratio would change the step a lot
    b = nn.Parameter(w.detach().clone())
    lamb = scaleopt.LAMB([("layer.bias", w)], lr=0.01, exclude_from_weight_decay="bias")
    adam = torch.optim.Adam([b], lr=0.01, eps=1e-6)
    for t in range(3):
        w.grad = torch.randn(8, generator=torch.Generator().manual_seed(t))
        b.grad = w.grad.clone()
        lamb.step()
        adam.step()
    torch.testing.assert_close(w, b)


def test_global_clipping_equals_clipping_by_hand_and_leaves_grads_alone():
    _, a = model_and_named()
    _, b = model_and_named()
    pa, pb = [p for _, p in a], [p for _, p in b]
    clipped = scaleopt.LAMB(a, lr=1e-2, max_grad_norm=0.5)
    plain = scaleopt.LAMB(b, lr=1e-2)
    for t in range(5):
        feed(pa, t, scale=3.0)
        feed(pb, t, scale=3.0)
        raw = [p.grad.clone() for p in pa]
        total = torch.cat([g.flatten() for g in raw]).norm()
        for p in pb:
            p.grad.mul_(0.5 / max(total.item(), 0.5))
        clipped.step()
        plain.step()
        for p, g in zip(pa, raw):
            assert torch.equal(p.grad, g)  # p.grad untouched
    for x, y in zip(pa, pb):
        torch.testing.assert_close(x, y)


def test_decoupled_mode_decays_outside_the_ratio():
    torch.manual_seed(0)
    w0 = torch.randn(6, dtype=torch.float64)
    g = torch.randn(6, dtype=torch.float64)
    p = nn.Parameter(w0.clone())
    opt = scaleopt.LAMB([p], lr=0.1, weight_decay=0.2, weight_decay_mode="decoupled")
    p.grad = g.clone()
    opt.step()
    w1 = w0 * (1 - 0.1 * 0.2)
    u = g / (g.abs() + 1e-6)
    torch.testing.assert_close(p.detach(), w1 - 0.1 * w1.norm() / u.norm() * u)


def test_l2_mode_adds_decay_to_the_gradient():
    torch.manual_seed(0)
    w0 = torch.randn(6, dtype=torch.float64)
    g = torch.randn(6, dtype=torch.float64)
    p = nn.Parameter(w0.clone())
    opt = scaleopt.LAMB([p], lr=0.1, weight_decay=0.2, weight_decay_mode="l2")
    p.grad = g.clone()
    opt.step()
    ge = g + 0.2 * w0
    u = ge / (ge.abs() + 1e-6)
    torch.testing.assert_close(p.detach(), w0 - 0.1 * w0.norm() / u.norm() * u)


def test_callable_rules_are_saved_as_names_and_load_weights_only():
    _, named = model_and_named()
    opt = scaleopt.LAMB(named, exclude_from_weight_decay=lambda n: n.endswith("bias"))
    sd = opt.state_dict()
    rule = sd["param_groups"][0]["exclude_from_weight_decay"]
    assert rule == [r"^0\.bias$", r"^2\.bias$"]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    _, named2 = model_and_named()
    opt2 = scaleopt.LAMB(named2)
    opt2.load_state_dict(loaded)
    assert opt2._rule_flags(opt2.param_groups[0], "exclude_from_weight_decay") == (
        False, True, False, True,
    )
    assert all(re.compile(r) for r in rule)


def test_per_group_options():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    opt = scaleopt.LAMB(
        [{"params": [a], "weight_decay_mode": "decoupled", "lr": 0.5},
         {"params": [b], "bias_correction": False, "upper_bound": 0.1}],
        weight_decay=0.1,
    )
    assert opt.param_groups[0]["weight_decay_mode"] == "decoupled"
    assert opt.param_groups[1]["weight_decay_mode"] == "update"
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    b0 = b.detach().clone()
    opt.step()
    # group 2: ||w|| clamped to 0.1, so the step has norm lr * 0.1
    torch.testing.assert_close((b0 - b.detach()).norm(), torch.tensor(1e-3 * 0.1))


@pytest.mark.parametrize("foreach", [True, False])
def test_bf16_parameters_track_float32(foreach):
    _, a = model_and_named()
    _, b = model_and_named(dtype=torch.bfloat16)
    pa, pb = [p for _, p in a], [p for _, p in b]
    o32 = scaleopt.LAMB(a, lr=1e-2, foreach=foreach)
    o16 = scaleopt.LAMB(b, lr=1e-2, foreach=foreach)
    for t in range(5):
        feed(pa, t)
        feed(pb, t)
        o32.step()
        o16.step()
    for x, y in zip(pa, pb):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_step_never_writes_the_gradients(info):
    _, named = model_and_named()
    opt = info.make(named)
    params = [p for _, p in named]
    for t in range(3):
        feed(params, t, scale=5.0)
        saved = [p.grad.clone() for p in params]
        opt.step()
        for p, g in zip(params, saved):
            assert torch.equal(p.grad, g)


@pytest.mark.parametrize("foreach", [True, False], ids=["fast", "reference"])
def test_no_host_reads_of_device_tensors(foreach):
    """On the meta device any read of a tensor value raises: the step must never need one."""
    params = [("a.weight", nn.Parameter(torch.empty(4, 3, device="meta"))),
              ("a.bias", nn.Parameter(torch.empty(4, device="meta")))]
    opt = scaleopt.LAMB(params, max_grad_norm=1.0, clip_grad_value=0.5, lower_bound=0.1,
                        upper_bound=10.0, exclude_from_weight_decay="bias", foreach=foreach,
                        weight_decay_mode="l2")
    for _, p in params:
        p.grad = torch.empty_like(p)
    opt.step()
    opt.step()
    assert opt.state[params[0][1]]["step"].item() == 2


def test_adamw_is_torch_adamw_and_shares_checkpoints():
    _, a = model_and_named()
    _, b = model_and_named()
    pa, pb = [p for _, p in a], [p for _, p in b]
    ours = scaleopt.AdamW(a, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(pb, lr=1e-2, weight_decay=0.1, fused=True)
    for t in range(5):
        feed(pa, t)
        feed(pb, t)
        ours.step()
        ref.step()
    for x, y in zip(pa, pb):
        assert torch.equal(x, y)
    # checkpoints move both ways
    _, c = model_and_named()
    pc = [p for _, p in c]
    for x, y in zip(pc, pa):
        x.data.copy_(y)
    into_torch = torch.optim.AdamW(pc, lr=1e-2, weight_decay=0.1, fused=True)
    into_torch.load_state_dict(copy.deepcopy(ours.state_dict()))  # not shared tensors
    back = scaleopt.AdamW(model_and_named()[1], lr=1e-2, weight_decay=0.1)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert back.param_groups[0]["max_grad_norm"] is None  # options missing in torch's: defaults
    for t in range(5, 8):
        feed(pa, t)
        feed(pc, t)
        ours.step()
        into_torch.step()
    for x, y in zip(pa, pc):
        # the loaded group says fused=None, so torch continues on its single-tensor kernel
        assert_within_steps(x, y, step=1e-2, steps=3)


def test_adamw_exclusion_by_name():
    torch.manual_seed(0)
    w = nn.Parameter(torch.ones(3))
    b = nn.Parameter(torch.ones(3))
    opt = scaleopt.AdamW([("x.weight", w), ("x.bias", b)], lr=0.1, weight_decay=0.5,
                         exclude_from_weight_decay=r"bias$")
    w.grad, b.grad = torch.zeros(3), torch.zeros(3)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), 1 - 0.1 * 0.5))
    torch.testing.assert_close(b.detach(), torch.ones(3))


def test_a_lamb_whose_tensors_all_skip_the_trust_ratio_warns_once_that_it_is_adam():
    """HF Trainer's optimizer_cls_and_kwargs builds the groups with TrainingArguments'
    weight_decay, 0.0 by default: with always_adapt=False no tensor would take the ratio."""
    import warnings

    def steps(**kw):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        opt = scaleopt.LAMB([{"params": [m.weight], "weight_decay": kw.pop("wd", 0.0)},
                             {"params": [m.bias], "weight_decay": 0.0}], lr=1e-2, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                m(torch.randn(2, 4)).sum().backward()
                opt.step()
        return [str(w.message) for w in caught if "trust ratio" in str(w.message)]

    (message,) = steps()
    assert "always_adapt" in message and "weight_decay" in message
    assert steps(wd=0.01) == [] and steps(always_adapt=True) == []


def test_the_step_memo_is_the_optimizers_own_and_goes_with_it():
    """What a step keeps for the next (each group's state lists) belongs to the optimizer: a
    copy starts without it, and a deleted optimizer's state is freed with it."""
    import copy
    import gc
    import weakref

    model = torch.nn.Linear(8, 4)
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
    assert len(opt.__dict__["_adam_memos"]) == 1
    assert "_adam_memos" not in copy.deepcopy(opt).__dict__
    moment = weakref.ref(opt.state[model.weight]["exp_avg"])
    del opt
    gc.collect()
    assert moment() is None
