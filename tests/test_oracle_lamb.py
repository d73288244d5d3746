"""The Paddle, Keras and TF1 golden cases, replayed through scaleopt.compat at every step."""

from __future__ import annotations

import types

import pytest

from scaleopt.compat import keras, paddle, tf1

from oracle import assert_variant_misses, case_files, load, make_params, replay

CASES = case_files(["paddle_", "keras_", "tf1_"])


def _paddle_callable(src: str):
    """A recorded Paddle rule on ``p`` (``lambda p: p.name...``) as a rule on the name."""
    fn = eval(src)  # recorded source text of a lambda taking a parameter
    return lambda name: fn(types.SimpleNamespace(name=name))


def _paddle_clip(src: str):
    return eval(src, {"paddle": types.SimpleNamespace(nn=paddle)})


def build_paddle(case, named):
    hp = dict(case["hyperparams"])
    hp.pop("parameters", None)
    if "grad_clip" in hp:
        hp["grad_clip"] = _paddle_clip(hp["grad_clip"])
    for key in ("exclude_from_weight_decay_fn", "lr_ratio"):  # Paddle calls these with the Parameter
        if key in hp:
            hp[key] = _paddle_callable(hp[key])
    if "apply_decay_param_fun" in hp:  # Paddle calls this one with the name itself
        hp["apply_decay_param_fun"] = eval(hp["apply_decay_param_fun"])
    if "weight_decay" in hp and isinstance(hp["weight_decay"], str):
        hp["weight_decay"] = eval(hp["weight_decay"], {"paddle": types.SimpleNamespace(
            regularizer=paddle, L1Decay=paddle.L1Decay, L2Decay=paddle.L2Decay)})
    cls = getattr(paddle, case["optimizer"])
    return cls(parameters=named, **hp)


def build_keras(case, named):
    hp = dict(case["hyperparams"])
    exclude = hp.pop("exclude_from_weight_decay(var_names=...)", None)
    opt = keras.Lamb(named, **hp)
    if exclude is not None:
        opt.exclude_from_weight_decay(var_names=exclude)
    return opt


def build_tf1(case, named):
    return tf1.LAMBOptimizer(named, **case["hyperparams"])


BUILDERS = {"paddle": build_paddle, "keras": build_keras, "tf1": build_tf1}


def _state_keys(opt):
    def state_of(p):
        s = opt.state[p]
        out = {}
        if "exp_avg" in s:
            out["m"] = s["exp_avg"]
            out["v"] = s["exp_avg_sq"]
        if "momentum_buffer" in s:
            out["velocity"] = s["momentum_buffer"]
        return out

    return state_of


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
@pytest.mark.parametrize("foreach", [True, False, None], ids=["fast", "reference", "default"])
def test_golden_case(path, foreach):
    case = load(path)
    params = make_params(case)
    named = list(params.items())
    opt = BUILDERS[path.name.split("_")[0]](case, named)
    for g in opt.param_groups:
        if "foreach" in g and g.get("fused") is not True:
            g["foreach"] = foreach
    replay(case, params, opt.step, _state_keys(opt))


def test_the_golden_cases_are_there():
    families = {p.name.split("_")[0] + "_" + p.name.split("_")[1] for p in CASES}
    assert {"paddle_lamb", "paddle_adamw", "paddle_momentum", "keras_lamb", "tf1_lamb"} <= families


@pytest.mark.parametrize(
    "name, change",
    [
        ("paddle_lamb_exclude_bias", dict(always_adapt=True)),
        ("paddle_lamb_default", dict(weight_decay_mode="decoupled")),
        ("keras_lamb_wd_exclude_bias", dict(weight_decay_mode="update")),
        ("tf1_lamb_numpy_default", dict(bias_correction=True)),
    ],
)
def test_a_plausible_wrong_variant_misses(name, change):
    """The replay is sharp enough to tell the reference's semantics from a near miss."""
    path = next(p for p in CASES if p.stem == name)
    case = load(path)
    params = make_params(case)
    opt = BUILDERS[name.split("_")[0]](case, list(params.items()))
    assert_variant_misses(case, params, opt, change)
