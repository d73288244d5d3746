"""The MXNet LAMB and LANS golden cases, replayed through scaleopt.compat.mxnet at every step."""

from __future__ import annotations

import pytest

from scaleopt.compat import mxnet

from oracle import assert_variant_misses, case_files, load, make_params, replay

CASES = case_files(["mxnet_"])


def build(case, params):
    hp = dict(case["hyperparams"])
    if "param_idx2name" in hp:
        hp["param_idx2name"] = {int(k): v for k, v in hp["param_idx2name"].items()}
    cls = getattr(mxnet, case["optimizer"])
    if cls is mxnet.LANS:
        # the LANS cases were recorded from MXNet's step() path
        hp.setdefault("use_fused_step", not case["normalized"].get("second_part_uses_updated_weight", False))
    return cls(list(params.values()), **hp)


def state_of(opt):
    return lambda p: {"m": opt.state[p]["exp_avg"], "v": opt.state[p]["exp_avg_sq"]}


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
@pytest.mark.parametrize("foreach", [True, False, None], ids=["fast", "reference", "default"])
def test_golden_case(path, foreach):
    case = load(path)
    params = make_params(case)
    opt = build(case, params)
    for g in opt.param_groups:
        g["foreach"] = foreach
    replay(case, params, opt.step, state_of(opt))


def test_the_golden_cases_are_there():
    names = {p.stem for p in CASES}
    assert {"mxnet_lamb_default_single", "mxnet_lans_seedcode_default",
            "mxnet_lans_seedcode_wd_bounds"} <= names


@pytest.mark.parametrize("name, change", [
    ("mxnet_lans_seedcode_wd_bounds", dict(lower_bound=None, upper_bound=None)),
    ("mxnet_lans_seedcode_default", dict(bias_correction=False)),
    ("mxnet_lamb_bounds_single", dict(lower_bound=None)),
    ("mxnet_lamb_wd_single", dict(always_adapt=False, weight_decay=0.0)),
])
def test_a_plausible_wrong_variant_misses(name, change):
    case = load(next(p for p in CASES if p.stem == name))
    params = make_params(case)
    assert_variant_misses(case, params, build(case, params), change)
