"""scaleopt.compat.mindspore.AdamOffload: MindSpore's arguments, checks and dynamic rates."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from scaleopt.compat.mindspore import AdamOffload


def named(seed=0):
    torch.manual_seed(seed)
    return [("dense.weight", nn.Parameter(torch.randn(4, 3))),
            ("dense.bias", nn.Parameter(torch.randn(4))),
            ("norm.gamma", nn.Parameter(torch.ones(4))),
            ("norm.beta", nn.Parameter(torch.zeros(4)))]


def feed(params, t):
    g = torch.Generator().manual_seed(t)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g)


def lrs_used(opt, steps, params):
    seen = []
    for t in range(steps):
        seen.append(opt.get_lr())
        feed(params, t)
        opt.step()
    return seen


@pytest.mark.parametrize("learning_rate", [
    [0.1, 0.05, 0.02],
    (0.1, 0.05, 0.02),
    torch.tensor([0.1, 0.05, 0.02]),
    iter([0.1, 0.05, 0.02]),
])
def test_a_sequence_learning_rate_gives_the_ith_value_at_step_i(learning_rate):
    params = named()
    opt = AdamOffload(params, learning_rate=learning_rate)
    seen = lrs_used(opt, 4, params)
    torch.testing.assert_close(torch.tensor(seen), torch.tensor([0.1, 0.05, 0.02, 0.02]))


def test_a_schedule_learning_rate_is_called_with_the_global_step():
    params = named()
    opt = AdamOffload(params, learning_rate=lambda step: 0.1 / (1 + step))
    assert lrs_used(opt, 3, params) == [0.1, 0.05, 0.1 / 3]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


@pytest.mark.parametrize("learning_rate", [0.01, 1, torch.tensor(0.01)])
def test_a_constant_learning_rate(learning_rate):
    params = named()
    opt = AdamOffload(params, learning_rate=learning_rate)
    assert lrs_used(opt, 2, params) == [pytest.approx(float(learning_rate))] * 2


def test_the_dynamic_rate_drives_the_update():
    a, b = named(), named()
    oa = AdamOffload(a, learning_rate=[0.1, 0.0])
    ob = AdamOffload(b, learning_rate=0.1)
    feed(a, 0), feed(b, 0)
    oa.step(), ob.step()
    after_first = [p.detach().clone() for _, p in a]
    feed(a, 1)
    oa.step()  # lr 0 at step 1: nothing moves
    assert all(torch.equal(x, p) for x, (_, p) in zip(after_first, a))
    assert all(torch.equal(x, p) for x, (_, p) in zip(after_first, b))


def test_dynamic_weight_decay_is_called_with_the_global_step():
    params = named()
    calls = []
    opt = AdamOffload(params, weight_decay=lambda step: calls.append(step) or 0.01 * step)
    for t in range(3):
        feed(params, t)
        opt.step()
    assert calls[-3:] == [0, 1, 2] and opt.param_groups[0]["weight_decay"] == pytest.approx(0.02)


def test_groups_with_their_own_rates_and_order_params():
    params = named()
    (nw, w), (nb, b), (ng, g), (nbeta, beta) = params
    opt = AdamOffload(
        [{"params": [(nb, b), (nw, w)], "weight_decay": 0.01, "lr": [0.5, 0.25]},
         {"params": [(ng, g), (nbeta, beta)]},
         {"order_params": [w, b, g, beta]}],
        learning_rate=0.1, weight_decay=0.0,
    )
    assert opt.param_groups[0]["params"] == [w, b]  # reordered as order_params says
    assert opt.param_groups[0]["param_names"] == [nw, nb]
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert lrs_used(opt, 2, params) == [[0.5, 0.1], [0.25, 0.1]]
    # grouped: the beta/gamma name filter is off, decay follows the group's weight_decay
    assert opt.param_groups[0].get("exclude_from_weight_decay") is None


def test_order_params_must_be_in_a_group():
    params = named()
    stray = nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match="order_params"):
        AdamOffload([{"params": [p for _, p in params]}, {"order_params": [stray]}])


def test_an_unsupported_group_key_is_an_error():
    with pytest.raises(ValueError, match="grad_centralization"):
        AdamOffload([{"params": [p for _, p in named()], "grad_centralization": True}])


def test_without_names_every_parameter_is_decayed():
    opt = AdamOffload([p for _, p in named()], weight_decay=0.1)
    assert opt.param_groups[0].get("exclude_from_weight_decay") is None


def test_checkpoint_carries_the_global_step_and_resumes_exactly():
    a = named()
    oa = AdamOffload(a, learning_rate=[0.1, 0.05, 0.02, 0.01])
    for t in range(2):
        feed(a, t)
        oa.step()
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    b = [(n, nn.Parameter(p.detach().clone())) for n, p in a]
    ob = AdamOffload(b, learning_rate=[0.1, 0.05, 0.02, 0.01])
    ob.load_state_dict(torch.load(buf, weights_only=True))
    assert ob.global_step == 2 and ob.get_lr() == pytest.approx(0.02)
    for t in range(2, 4):
        feed(a, t), feed(b, t)
        oa.step(), ob.step()
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(a, b))


P = [nn.Parameter(torch.randn(2))]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(learning_rate="0.1"), TypeError, "learning_rate"),
    (dict(learning_rate=True), TypeError, "learning_rate"),
    (dict(learning_rate=None), TypeError, "learning_rate"),
    (dict(learning_rate=-0.1), ValueError, "learning_rate"),
    (dict(learning_rate=[]), ValueError, "learning_rate"),
    (dict(learning_rate=[0.1, "x"]), TypeError, "learning_rate"),
    (dict(learning_rate=torch.ones(2, 2)), ValueError, "learning_rate"),
    (dict(learning_rate=torch.tensor([1, 2])), TypeError, "learning_rate"),
    (dict(beta1=1), TypeError, "beta1"),
    (dict(beta2="0.9"), TypeError, "beta2"),
    (dict(beta1=1.0), ValueError, "beta1"),
    (dict(beta2=0.0), ValueError, "beta2"),
    (dict(eps=1), TypeError, "eps"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(loss_scale=1), TypeError, "loss_scale"),
    (dict(loss_scale=0.0), ValueError, "loss_scale"),
    (dict(weight_decay="0.1"), TypeError, "weight_decay"),
    (dict(weight_decay=True), TypeError, "weight_decay"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(use_locking=1), TypeError, "use_locking"),
    (dict(use_nesterov="yes"), TypeError, "use_nesterov"),
])
def test_mindspore_checks(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdamOffload(P, **kwargs)


@pytest.mark.parametrize("params", [[1.0], [[nn.Parameter(torch.randn(2))]], ["w"]])
def test_params_elements_must_be_tensors_or_dicts(params):
    with pytest.raises(TypeError, match="params"):
        AdamOffload(params)


def test_a_group_weight_decay_is_checked_too():
    with pytest.raises(ValueError, match="weight_decay"):
        AdamOffload([{"params": P, "weight_decay": -1.0}])
