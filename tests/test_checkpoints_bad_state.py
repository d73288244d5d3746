"""Bad state never reaches a step: state dicts checked on load, kernels that check sizes, copies
and pickles with LR schedulers attached, non-float parameters refused, tensor learning rates of
any one-element shape."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import scaleopt
from scaleopt import _native
from registry import REGISTRY


def _model(width: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 2))


def _stepped(info, width: int = 3, steps: int = 1):
    model = _model(width)
    opt = info.make(list(model.named_parameters()))
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return model, opt


def _first_state(sd):
    return sd["state"][next(iter(sd["state"]))]


def _tensors_of(opt):
    return {id(p): (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()
                                         if torch.is_tensor(v)})
            for g in opt.param_groups for p in g["params"]}


def _assert_unchanged(opt, before):
    for g in opt.param_groups:
        for p in g["params"]:
            w, st = before[id(p)]
            assert torch.equal(p.detach(), w)
            for k, v in st.items():
                assert torch.equal(opt.state[p][k], v), k


# -- item 1 and 5: state dicts checked on load ----------------------------------------------


def _wider(info):
    return _stepped(info, width=4)[1].state_dict()


def _transposed(sd):
    for k, v in list(_first_state(sd).items()):
        if torch.is_tensor(v) and v.dim() == 2:
            _first_state(sd)[k] = v.t().contiguous()  # same element count, another shape
    return sd


def _without_moment(sd):
    st = _first_state(sd)
    del st[next(k for k in st if k != "step")]
    return sd


def _step_is(value):
    def change(sd):
        _first_state(sd)["step"] = torch.tensor(value)
        return sd
    return change


BAD = {
    "wider-model": (None, "shape"),
    "transposed": (_transposed, "shape"),
    "missing-moment": (_without_moment, "lacks"),
    "nan-step": (_step_is(float("nan")), "'step'"),
    "negative-step": (_step_is(-3.0), "'step'"),
    "integer-moment": (lambda sd: {**sd, "state": {k: {n: (v.long() if n != "step" and
                                                          torch.is_tensor(v) else v)
                                                      for n, v in st.items()}
                                                  for k, st in sd["state"].items()}},
                       "floating-point"),
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_bad_state_dict_is_refused_by_name_and_changes_nothing(info, bad):
    model, opt = _stepped(info, steps=2)
    change, words = BAD[bad]
    sd = _wider(info) if change is None else change(copy.deepcopy(opt.state_dict()))
    before = _tensors_of(opt)
    with pytest.raises(ValueError, match=words) as err:
        opt.load_state_dict(sd)
    assert "'0.weight'" in str(err.value) or "'0.bias'" in str(err.value)  # the parameter's name
    _assert_unchanged(opt, before)
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()  # the optimizer still steps on its own state
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("info", [i for i in REGISTRY if "exp_avg_sq" in str(
    i.make([("w", torch.zeros(2))]).__class__._state_spec.shaped)], ids=str)
def test_a_negative_second_moment_is_refused(info):
    model, opt = _stepped(info)
    sd = copy.deepcopy(opt.state_dict())
    # the first parameter with a second moment (Muon's matrices hold a momentum only)
    next(st for st in sd["state"].values() if "exp_avg_sq" in st)["exp_avg_sq"][0] = -1.0
    with pytest.raises(ValueError, match=r"'exp_avg_sq' of parameter '0\.(weight|bias)' has negative"):
        opt.load_state_dict(sd)


def test_unnamed_parameters_are_named_by_place():
    model = _model()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sd = _transposed(copy.deepcopy(opt.state_dict()))
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape \(3, 4\)\)"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("source, target, loads", [
    (scaleopt.AdamW, scaleopt.LAMB, False),
    (scaleopt.LAMB, scaleopt.LANS, False),
    (scaleopt.LANS, scaleopt.OffloadAdam, False),
    (scaleopt.AdamW, scaleopt.OffloadAdam, True),  # the same Adam state
    (scaleopt.OffloadAdam, scaleopt.AdamW, True),
    (torch.optim.AdamW, scaleopt.LAMB, True),  # torch's state dicts do not say their class
])
def test_another_kind_of_state_is_refused_where_the_state_dict_says(source, target, loads):
    model = _model()
    src = source(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    src.step()
    sd = src.state_dict()
    dst = target(model.parameters(), lr=1e-2)
    if loads:
        dst.load_state_dict(sd)
        assert torch.equal(dst.state[model[0].weight]["exp_avg"], src.state[model[0].weight]["exp_avg"])
        return
    with pytest.raises(ValueError, match="saved by scaleopt.* delete the state dict's 'scaleopt'"):
        dst.load_state_dict(sd)
    del sd["scaleopt"]
    dst.load_state_dict(sd)  # the way out the message gives


def test_state_dict_says_who_saved_it():
    opt = scaleopt.offload(scaleopt.LAMB, _model().parameters(), lr=1e-2)
    assert opt.state_dict()["scaleopt"] == {"optimizer": "scaleopt.LAMB", "state": "lamb",
                                            "skipped_steps": 0}


def test_amsgrad_state_needs_its_maximum():
    model = _model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    plain.step()
    opt = scaleopt.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        opt.load_state_dict(plain.state_dict())


def test_kernels_refuse_state_of_another_size():
    if not _native.available():
        pytest.skip("the C kernels are not built")
    w, g, v = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    with pytest.raises(ValueError, match="10 elements but a \\(9,\\)"):
        _native.adam([w], [g], [torch.zeros(9)], [v], [None], [torch.zeros(())],
                     step_sizes=[1.0], bias_correction2_sqrts=[1.0], weight_decays_l2=[0.0],
                     decays=[1.0], beta1=0.9, beta2=0.99, eps=1e-8, grad_multipliers=[1.0],
                     threads=1)


def test_lamb_kernel_entry_refuses_state_of_another_size():
    """State put in by hand, past load_state_dict: the step raises instead of a kernel reading
    out of bounds."""
    model = _model()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    opt.state[model[0].weight]["exp_avg"] = torch.zeros(5)
    with pytest.raises((ValueError, RuntimeError)):
        opt.step()


# -- item 2: copies and pickles with a scheduler attached --------------------------------------


SCHEDULERS = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.01, total_steps=10, cycle_momentum=False),
}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_copy_and_pickle_step_themselves_with_a_scheduler(info, scheduler):
    model, opt = _stepped(info)
    sched = SCHEDULERS[scheduler](opt)
    opt.step()
    sched.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        before = [p.detach().clone() for p in model.parameters()]
        theirs = [p for g in clone.param_groups for p in g["params"]]
        start = [p.detach().clone() for p in theirs]
        for p, q in zip(model.parameters(), theirs):
            q.grad = torch.ones_like(q)
        clone.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert any(not torch.equal(a, b) for a, b in zip(start, theirs))
    opt.step()  # the original keeps its scheduler's wrapper
    assert opt._opt_called


# -- item 3: non-float parameters ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_non_float_parameters_are_refused_at_construction(info, dtype):
    with pytest.raises(TypeError, match=f"floating-point tensors only.*{dtype}.*'counts'"):
        info.make([("w", torch.zeros(3)), ("counts", torch.zeros(3, dtype=dtype))])


# -- item 6: tensor learning rates of any one-element shape --------------------------------------


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_tensor_lr_of_any_one_element_shape(info, shape):
    model = _model()
    ref_model = copy.deepcopy(model)
    opt = info.make(list(model.named_parameters()))
    ref = info.make(list(ref_model.named_parameters()))
    for g, rg in zip(opt.param_groups, ref.param_groups):
        g["lr"] = torch.full(shape, float(rg["lr"]))
    torch.manual_seed(1)
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (ref_model, ref)):
        m(x).square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
