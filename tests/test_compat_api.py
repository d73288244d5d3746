"""The reference frameworks' methods and options on the compat front-ends."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaleopt.compat import keras, paddle, tf1


def named(seed=0):
    torch.manual_seed(seed)
    return list(nn.Linear(3, 2).named_parameters())


def feed(named_params, value=1.0):
    for _, p in named_params:
        p.grad = torch.full_like(p, value)


def test_paddle_minimize_clear_grad_and_lr():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = paddle.Lamb(learning_rate=0.01, parameters=model.named_parameters())
    before = model.weight.detach().clone()
    ops, pairs = opt.minimize(model(torch.randn(4, 3)).square().mean())
    assert not torch.equal(before, model.weight)
    assert len(pairs) == 2 and pairs[0][1] is not None
    opt.clear_grad()
    assert not model.weight.grad.any()  # Paddle zeroes by default
    opt.clear_grad(set_to_zero=False)
    assert model.weight.grad is None
    assert opt.get_lr() == 0.01
    opt.set_lr(0.5)
    assert opt.get_lr() == 0.5 and opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match="value"):
        opt.set_lr("fast")


def test_paddle_scheduler_drives_the_rate_and_set_lr_refuses():
    sched = paddle.LambdaDecay(learning_rate=0.1, lr_lambda=lambda epoch: 0.5**epoch)
    params = named()
    opt = paddle.Momentum(learning_rate=sched, momentum=0.0, parameters=params)
    assert opt.get_lr() == 0.1
    w0 = params[0][1].detach().clone()
    feed(params)
    opt.step()
    torch.testing.assert_close(params[0][1].detach(), w0 - 0.1)
    sched.step()
    assert opt.get_lr() == 0.05
    opt.step()
    torch.testing.assert_close(params[0][1].detach(), w0 - 0.15)
    with pytest.raises(RuntimeError, match="LRScheduler"):
        opt.set_lr(0.1)


def test_paddle_group_dicts_use_paddle_keys():
    (wn, w), (bn, b) = named()
    opt = paddle.Lamb(
        learning_rate=0.1,
        parameters=[{"params": [(wn, w)]},
                    {"params": [(bn, b)], "learning_rate": 0.5, "lamb_weight_decay": 0.0,
                     "beta1": 0.8}],
    )
    g0, g1 = opt.param_groups
    assert g0["lr"] == 0.1 and g1["lr"] == 0.05
    assert g1["weight_decay"] == 0.0 and g1["betas"] == (0.8, 0.999)
    opt.set_lr(1.0)
    assert g1["lr"] == 0.5


def test_paddle_adamw_rules_are_called_with_names():
    seen = []
    params = named()

    def decay(name):
        seen.append(name)
        return name.endswith("weight")

    opt = paddle.AdamW(learning_rate=0.1, parameters=params, weight_decay=0.5,
                       apply_decay_param_fun=decay, lr_ratio=lambda n: 0.1 if "bias" in n else 1.0)
    feed(params, 0.0)
    w0, b0 = (p.detach().clone() for _, p in params)
    opt.step()
    assert set(seen) == {"weight", "bias"}
    torch.testing.assert_close(params[0][1].detach(), w0 * (1 - 0.1 * 0.5))
    torch.testing.assert_close(params[1][1].detach(), b0)  # not decayed
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([0.01, 0.1])


def test_paddle_momentum_regularizers():
    for decay, expected in ((paddle.L2Decay(0.1), lambda w: w - 0.5 * (1 + 0.1 * w)),
                            (paddle.L1Decay(0.1), lambda w: w - 0.5 * (1 + 0.1 * torch.sign(w))),
                            (0.1, lambda w: w - 0.5 * (1 + 0.1 * w))):
        params = named()
        w0 = params[0][1].detach().clone()
        opt = paddle.Momentum(learning_rate=0.5, momentum=0.9, parameters=params, weight_decay=decay)
        feed(params)
        opt.step()
        torch.testing.assert_close(params[0][1].detach(), expected(w0))


def test_paddle_clip_by_norm_and_value():
    params = [("w", nn.Parameter(torch.zeros(4)))]
    opt = paddle.Momentum(learning_rate=1.0, momentum=0.0, parameters=params,
                          grad_clip=paddle.ClipGradByNorm(1.0))
    params[0][1].grad = torch.full((4,), 2.0)  # norm 4 -> scaled to norm 1
    opt.step()
    torch.testing.assert_close(params[0][1].detach(), torch.full((4,), -0.5))
    params = [("w", nn.Parameter(torch.zeros(3)))]
    opt = paddle.Momentum(learning_rate=1.0, momentum=0.0, parameters=params,
                          grad_clip=paddle.ClipGradByValue(max=0.5, min=-0.1))
    params[0][1].grad = torch.tensor([2.0, -2.0, 0.2])
    opt.step()
    torch.testing.assert_close(params[0][1].detach(), torch.tensor([-0.5, 0.1, -0.2]))


def test_keras_apply_gradients_touches_only_the_given_variables():
    params = named()
    (_, w), (_, b) = params
    opt = keras.Lamb(params, learning_rate=0.1)
    b.grad = torch.ones_like(b)
    b0, w0 = b.detach().clone(), w.detach().clone()
    opt.apply_gradients([(torch.ones_like(w), w)])
    assert not torch.equal(w0, w) and torch.equal(b0, b)
    assert torch.equal(b.grad, torch.ones_like(b))  # restored
    assert opt.iterations == 1


def test_keras_schedule_and_var_list_exclusion():
    params = named()
    (_, w), (_, b) = params
    opt = keras.Lamb(params, learning_rate=lambda it: 0.1 / (1 + it), weight_decay=0.5)
    opt.exclude_from_weight_decay(var_list=[b])
    assert opt.learning_rate == 0.1
    feed(params, 0.0)
    b0, w0 = b.detach().clone(), w.detach().clone()
    opt.step()
    torch.testing.assert_close(w.detach(), w0 * (1 - 0.1 * 0.5))
    torch.testing.assert_close(b.detach(), b0)
    assert opt.learning_rate == pytest.approx(0.05)
    opt.learning_rate = 0.2
    assert opt.param_groups[0]["lr"] == 0.2


def test_keras_clip_options_map_to_their_meaning():
    for kw, want in ((dict(clipnorm=1.0), "clip_grad_norm_per_tensor"),
                     (dict(clipvalue=0.5), "clip_grad_value"),
                     (dict(global_clipnorm=2.0), "max_grad_norm")):
        opt = keras.Lamb(named(), **kw)
        assert opt.param_groups[0][want] == list(kw.values())[0]


def test_tf1_apply_gradients_and_exclusion():
    params = named()
    opt = tf1.LAMBOptimizer(params, learning_rate=0.1, exclude_from_weight_decay=["bias"])
    _, wds, adapt = opt._layer_options(opt.param_groups[0], [0, 1])
    assert wds == [0.01, 0.0] and adapt == [True, True]
    w0 = params[0][1].detach().clone()
    opt.apply_gradients([(torch.ones_like(p), p) for _, p in params])
    assert not torch.equal(w0, params[0][1])
