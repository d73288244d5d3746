"""Bad input fails at construction with an error that names the argument."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt.compat import keras, paddle, tf1


def named():
    torch.manual_seed(0)
    return list(nn.Linear(3, 2).named_parameters())


def plain():
    return list(nn.Linear(3, 2).parameters())


CORE = [scaleopt.LAMB, scaleopt.AdamW, scaleopt.Momentum]


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(lr=math.nan), ValueError, "lr"),
        (dict(lr=math.inf), ValueError, "lr"),
        (dict(lr="0.1"), TypeError, "lr"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(weight_decay=math.nan), ValueError, "weight_decay"),
        (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
        (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm"),
        (dict(clip_grad_value=(1.0, -1.0)), ValueError, "clip_grad_value"),
        (dict(clip_grad_norm_per_tensor=0.0), ValueError, "clip_grad_norm_per_tensor"),
        (dict(rescale_grad=0.0), ValueError, "rescale_grad"),
        (dict(exclude_from_weight_decay=123), TypeError, "exclude_from_weight_decay"),
        (dict(exclude_from_weight_decay=["(unclosed"]), ValueError, "exclude_from_weight_decay"),
        (dict(maximize="yes"), TypeError, "maximize"),
        (dict(foreach=1), TypeError, "foreach"),
        (dict(not_an_option=1), TypeError, "not_an_option"),
    ],
)
def test_bad_common_arguments(cls, kwargs, error, words):
    with pytest.raises(error, match=words):
        cls(named(), **kwargs)


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.AdamW], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(eps=-1e-8), ValueError, "eps"),
        (dict(eps=math.nan), ValueError, "eps"),
        (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
        (dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (dict(betas=(0.9, math.nan)), ValueError, r"betas\[1\]"),
        (dict(betas=0.9), TypeError, "betas"),
    ],
)
def test_bad_adam_arguments(cls, kwargs, error, words):
    with pytest.raises(error, match=words):
        cls(named(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(weight_decay_mode="adamw"), ValueError, "weight_decay_mode"),
        (dict(lower_bound=-1.0), ValueError, "lower_bound"),
        (dict(lower_bound=2.0, upper_bound=1.0), ValueError, "lower_bound"),
        (dict(upper_bound=math.inf), ValueError, "upper_bound"),
        (dict(bias_correction=None), TypeError, "bias_correction"),
        (dict(always_adapt=1), TypeError, "always_adapt"),
        (dict(exclude_from_layer_adaptation=3.0), TypeError, "exclude_from_layer_adaptation"),
    ],
)
def test_bad_lamb_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        scaleopt.LAMB(named(), **kwargs)


def test_momentum_and_adamw_specific_checks():
    with pytest.raises(ValueError, match="momentum"):
        scaleopt.Momentum(named(), momentum=-0.5)
    with pytest.raises(ValueError, match="weight_decay_mode"):
        scaleopt.Momentum(named(), weight_decay_mode="l3")
    with pytest.raises(ValueError, match="fused"):
        scaleopt.AdamW(named(), fused=True, foreach=True)
    with pytest.raises(TypeError, match="amsgrad"):
        scaleopt.AdamW(named(), amsgrad="no")


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
def test_empty_and_malformed_parameter_lists(cls):
    with pytest.raises(ValueError, match="empty parameter list"):
        cls([])
    with pytest.raises(ValueError, match="empty parameter list"):
        cls(iter([]))
    with pytest.raises(TypeError, match="Tensor"):
        cls(torch.zeros(3, requires_grad=True))
    with pytest.raises(TypeError, match="Tensors"):
        cls([1.0, 2.0])
    with pytest.raises(ValueError, match="named"):
        cls([("a", nn.Parameter(torch.zeros(2))), nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="complex"):
        cls([nn.Parameter(torch.zeros(2, dtype=torch.complex64))])


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
def test_a_name_rule_needs_names(cls):
    with pytest.raises(ValueError, match="exclude_from_weight_decay.*names"):
        cls(plain(), exclude_from_weight_decay=["bias"])
    with pytest.raises(ValueError, match="exclude_from_weight_decay.*names"):
        cls(plain(), exclude_from_weight_decay=lambda n: True)
    cls(plain(), exclude_from_weight_decay=[])  # an empty rule needs no names


def test_lamb_adaptation_rule_needs_names():
    with pytest.raises(ValueError, match="exclude_from_layer_adaptation"):
        scaleopt.LAMB(plain(), exclude_from_layer_adaptation="bias")


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
def test_bad_param_group_is_rejected_and_not_added(cls):
    opt = cls(named())
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "param_names": ["x"], "lr": -1.0})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", CORE, ids=lambda c: c.__name__)
def test_a_misspelt_group_key_is_kept_with_a_warning_naming_the_option(cls):
    opt = cls(named())
    with pytest.warns(UserWarning, match="'wieght_decay'.*did you mean 'weight_decay'"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "param_names": ["x"],
                             "wieght_decay": 0.1})
    with warnings.catch_warnings():  # once per optimizer and key
        warnings.simplefilter("error")
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "param_names": ["y"],
                             "wieght_decay": 0.2})
    assert [g.get("wieght_decay") for g in opt.param_groups] == [None, 0.1, 0.2]
    assert opt.param_groups[1]["weight_decay"] == opt.defaults["weight_decay"]
    with pytest.warns(UserWarning, match="did you mean 'lr'.*'learning_rate' is its name in other"):
        cls([{"params": named(), "learning_rate": 0.1}])


def test_paddle_front_end_errors():
    with pytest.raises(ValueError, match="parameters"):
        paddle.Lamb()
    with pytest.raises(TypeError, match="grad_clip"):
        paddle.Lamb(parameters=named(), grad_clip=1.0)
    with pytest.raises(TypeError, match="learning_rate"):
        paddle.AdamW(learning_rate="fast", parameters=named())
    with pytest.raises(ValueError, match="learning_rate"):
        paddle.Momentum(learning_rate=-0.1, parameters=named())
    with pytest.raises(TypeError, match="exclude_from_weight_decay_fn"):
        paddle.Lamb(parameters=named(), exclude_from_weight_decay_fn=["bias"])
    with pytest.raises(ValueError, match="clip_norm"):
        paddle.ClipGradByGlobalNorm(0.0)
    with pytest.raises(ValueError, match="max"):
        paddle.ClipGradByValue(-1.0)
    with pytest.raises(ValueError, match="min/max"):
        paddle.ClipGradByValue(max=1.0, min=2.0)
    with pytest.raises(ValueError, match="beta1"):
        paddle.Lamb(parameters=named(), beta1=1.5)
    low = [("w", nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)))]
    with pytest.raises(NotImplementedError, match="multi_precision"):
        paddle.Momentum(parameters=low, multi_precision=True)
    paddle.Momentum(parameters=named(), multi_precision=True)  # fp32 parameters: nothing to do


def test_keras_front_end_errors():
    with pytest.raises(ValueError, match="Only one of"):
        keras.Lamb(named(), clipnorm=1.0, clipvalue=0.5)
    with pytest.raises(ValueError, match="epsilon|eps"):
        keras.Lamb(named(), epsilon=-1.0)
    params = named()
    opt = keras.Lamb(params, weight_decay=0.1)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="before the optimizer is built"):
        opt.exclude_from_weight_decay(var_names=["bias"])
    opt2 = keras.Lamb(plain(), weight_decay=0.1)
    with pytest.raises(ValueError, match="names"):
        opt2.exclude_from_weight_decay(var_names=["bias"])


def test_tf1_front_end_errors():
    with pytest.raises(TypeError):
        tf1.LAMBOptimizer(named())  # learning_rate is required
    with pytest.raises(ValueError, match="weight_decay"):
        tf1.LAMBOptimizer(named(), learning_rate=0.1, weight_decay_rate=-1.0)
    with pytest.raises(ValueError, match="exclude_from_weight_decay"):
        tf1.LAMBOptimizer(plain(), learning_rate=0.1, exclude_from_weight_decay=["bias"])
