"""One policy for inf/NaN gradients in every optimizer and every implementation:
``nonfinite="propagate"`` (the default, as torch's optimizers: the values flow into the update)
or ``nonfinite="skip"`` (the step changes nothing and is counted)."""

from __future__ import annotations

import copy

import pytest
import torch

import scaleopt
from registry import REGISTRY


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _grads(model, bad: float = None):
    torch.manual_seed(1)
    model.zero_grad()
    model(torch.randn(6, 4)).square().sum().backward()
    if bad is not None:
        model[2].weight.grad[0, 3] = bad  # one element of one gradient


def _global_clip(opt) -> bool:
    return any(g.get("max_grad_norm") is not None for g in opt.param_groups)


def _snapshot(model, opt):
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for p in model.parameters()}
    return [p.detach().clone() for p in model.parameters()], state


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_propagate_is_the_default_and_reaches_only_what_the_arithmetic_reaches(info, bad):
    model = _model()
    opt = info.make(list(model.named_parameters()))
    opt.nonfinite = "propagate"  # the default (one configuration says check_finite=True)
    _grads(model)
    opt.step()  # state for every parameter first
    _grads(model, bad)
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    hit = {n for n, p in model.named_parameters() if not torch.isfinite(p).all()}
    # a NaN norm clips everything to NaN; an inf one scales the gradients by 0, and 0 * inf
    # is NaN only where the inf was (as torch.nn.utils.clip_grad_norm_ does)
    expected = set(names) if _global_clip(opt) and bad != bad else {"2.weight"}
    values_last = getattr(opt, "_intake_options", {}).get("value_clip") is False  # LANS
    if bad == float("inf") and not values_last and any(
            g.get("clip_grad_value") is not None for g in opt.param_groups):
        expected = set()  # clipped by value to a finite number before anything else
    assert hit == expected
    assert opt.skipped_steps == 0


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_skip_changes_nothing_counts_and_the_run_goes_on(info, bad):
    model = _model()
    opt = info.make(list(model.named_parameters()))
    opt.nonfinite = "skip"
    twin_model = copy.deepcopy(model)  # the same run without the bad step
    twin = info.make(list(twin_model.named_parameters()))
    twin.nonfinite = "skip"
    for m, o in ((model, opt), (twin_model, twin)):
        _grads(m)
        o.step()
    _grads(model, bad)
    weights, state = _snapshot(model, opt)
    opt.step()
    assert opt.skipped_steps == 1
    after_weights, after_state = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, after_weights))
    assert all(torch.equal(state[k][n], after_state[k][n]) for k in state for n in state[k])
    for m, o in ((model, opt), (twin_model, twin)):  # the next good step: as if never seen
        _grads(m)
        o.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    assert opt.state_dict()["scaleopt"]["skipped_steps"] == 1


IMPLEMENTATIONS = ["single", "multi", "native", "triton"]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=lambda c: c.__name__)
def test_every_implementation_follows_the_policy(cls, impl, clip):
    if impl == "triton":
        pytest.importorskip("triton")
    results = {}
    for policy in ("propagate", "skip"):
        model = _model()
        opt = cls(model.named_parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=clip,
                  implementation=impl, nonfinite=policy)
        _grads(model)
        opt.step()
        _grads(model, float("nan"))
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        results[policy] = (model, before, opt)
    model, _, opt = results["propagate"]
    hit = {n for n, p in model.named_parameters() if not torch.isfinite(p).all()}
    assert hit == ({"0.weight", "0.bias", "2.weight", "2.bias"} if clip else {"2.weight"})
    model, before, opt = results["skip"]
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_policy_is_checked_and_survives_a_load():
    model = _model()
    assert all(cls(model.parameters()).nonfinite == "propagate" for cls in (
        scaleopt.LAMB, scaleopt.LANS, scaleopt.AdamW, scaleopt.OffloadAdam))
    assert scaleopt.Momentum(model.parameters(), lr=0.1).nonfinite == "propagate"
    assert scaleopt.DGCMomentum(model.parameters(), lr=0.1).nonfinite == "propagate"
    with pytest.raises(ValueError, match="nonfinite"):
        scaleopt.LAMB(model.parameters(), nonfinite="ignore")
    opt = scaleopt.AdamW(model.parameters(), nonfinite="skip")
    opt.load_state_dict(scaleopt.AdamW(model.parameters()).state_dict())
    assert opt.nonfinite == "skip"
    with pytest.raises(ValueError, match="nonfinite"):
        opt.nonfinite = "zero"


def test_offload_check_finite_is_skip():
    opt = scaleopt.OffloadAdam(_model().parameters(), check_finite=True)
    assert opt.nonfinite == "skip"
