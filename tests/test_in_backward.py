"""Steps inside the backward pass (scaleopt.step_in_backward): the ordinary step's bits with
accumulation, exact clipping, schedulers and checkpoints; inf/NaN skipped before anything
moves; a bounded number of gradients alive; clear errors for what cannot work."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import scaleopt

MAKERS = {
    "LAMB": lambda n, **kw: scaleopt.LAMB(n, lr=1e-2, **kw),
    "LANS": lambda n, **kw: scaleopt.LANS(n, lr=1e-2, **kw),
    "AdamW": lambda n, **kw: scaleopt.AdamW(n, lr=1e-2, **kw),
    "AdamW(foreach)": lambda n, **kw: scaleopt.AdamW(n, lr=1e-2, foreach=True, **kw),
    "Muon": lambda n, **kw: scaleopt.Muon(n, lr=1e-2, adamw_lr=1e-2, **kw),
    "Muon(int8)": lambda n, **kw: scaleopt.Muon(n, lr=1e-2, state_dtype="int8", **kw),
    "OffloadAdam": lambda n, **kw: scaleopt.OffloadAdam(n, lr=1e-2, **kw),
    "offload(LANS)": lambda n, **kw: scaleopt.offload(scaleopt.LANS, n, lr=1e-2, **kw),
    "offload(Muon)": lambda n, **kw: scaleopt.offload(scaleopt.Muon, n, lr=1e-2, **kw),
}


class Net(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.c = nn.Linear(64, 16)
        self.unused = nn.Linear(3, 3)  # gets no gradient
        if tied:
            self.c.weight = self.a.weight  # (16, 64) used twice: one parameter, one step

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = self.norm(self.b(h))
        return (self.c(h) - x).square().mean() if self.c.weight is not self.a.weight else (
            nn.functional.linear(h, self.a.weight.T) - x).square().mean()


def _pair(tied=False):
    torch.manual_seed(0)
    one = Net(tied)
    return one, copy.deepcopy(one)


def _batches(steps, micro=4):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(8, 16, generator=g) for _ in range(micro)] for _ in range(steps)]


def _ordinary(model, opt, batches, scheduler=None):
    for micro in batches:
        for x in micro:
            model(x).backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _in_backward(model, steps, batches, scheduler=None):
    for micro in batches:
        with steps.accumulating():
            for x in micro[:-1]:
                model(x).backward()
        if steps.two_passes:
            steps.backward(lambda: model(micro[-1]))
        else:
            model(micro[-1]).backward()
        if scheduler is not None:
            scheduler.step()


def _same(m1, m2):
    return all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


@pytest.mark.parametrize("bucket", [0, 8192, 1 << 30])
@pytest.mark.parametrize("name", list(MAKERS))
def test_steps_in_backward_over_four_micro_batches_are_the_ordinary_steps_bits(name, bucket):
    m1, m2 = _pair()
    o1 = MAKERS[name](list(m1.named_parameters()))
    o2 = MAKERS[name](list(m2.named_parameters()))
    steps = scaleopt.step_in_backward(o2, bucket_bytes=bucket)
    _in_backward(m2, steps, _batches(3))
    _ordinary(m1, o1, _batches(3))
    assert _same(m1, m2)
    assert all(p.grad is None for p in m2.parameters())  # every gradient freed
    assert m2.unused.weight not in o2.state  # no gradient: not stepped
    assert steps.pieces == (1 if bucket > 1 << 20 else steps.pieces) and steps.pieces >= 1


@pytest.mark.parametrize("name", ["LAMB", "LANS", "AdamW(foreach)", "Muon", "OffloadAdam"])
def test_exact_clipping_in_two_passes_is_the_ordinary_clipped_steps_bits(name):
    m1, m2 = _pair()
    o1 = MAKERS[name](list(m1.named_parameters()), max_grad_norm=0.02)
    o2 = MAKERS[name](list(m2.named_parameters()), max_grad_norm=0.02)
    steps = scaleopt.step_in_backward(o2, clip="exact", bucket_bytes=0)
    batches = _batches(3)
    for x in batches[0]:
        m1(x).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in m1.parameters() if p.grad is not None])
    assert norm > 0.02 * 5  # the clipping binds
    for p in m1.parameters():
        p.grad = None
    _in_backward(m2, steps, batches)
    _ordinary(m1, o1, batches)
    assert _same(m1, m2)


def test_an_lr_scheduler_and_a_checkpoint_carry_on_with_the_same_bits():
    m1, m2 = _pair()
    o1 = scaleopt.LAMB(m1.parameters(), lr=1e-2)
    o2 = scaleopt.LAMB(m2.parameters(), lr=1e-2)
    s1 = torch.optim.lr_scheduler.StepLR(o1, 1, gamma=0.5)
    steps = scaleopt.step_in_backward(o2)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.5)
    batches = _batches(4)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        _in_backward(m2, steps, batches[:2], s2)
    _ordinary(m1, o1, batches[:2], s1)
    assert _same(m1, m2) and o1.param_groups[0]["lr"] == o2.param_groups[0]["lr"] == 2.5e-3
    # resumed from the state dict: into an ordinary optimizer, and back into one in backward
    m3 = copy.deepcopy(m2)
    o3 = scaleopt.LAMB(m3.parameters(), lr=1e-2)
    o3.load_state_dict(copy.deepcopy(o2.state_dict()))
    m4 = copy.deepcopy(m1)
    o4 = scaleopt.LAMB(m4.parameters(), lr=1e-2)
    o4.load_state_dict(copy.deepcopy(o1.state_dict()))
    steps4 = scaleopt.step_in_backward(o4)
    _ordinary(m3, o3, batches[2:])
    _in_backward(m4, steps4, batches[2:])
    _ordinary(m1, o1, batches[2:])
    assert _same(m1, m3) and _same(m1, m4)


def test_a_tied_weight_is_stepped_once_per_backward():
    m1, m2 = _pair(tied=True)
    o1 = scaleopt.AdamW(m1.parameters(), lr=1e-2)
    o2 = scaleopt.AdamW(m2.parameters(), lr=1e-2)
    steps = scaleopt.step_in_backward(o2, bucket_bytes=0)
    _in_backward(m2, steps, _batches(2))
    _ordinary(m1, o1, _batches(2))
    assert _same(m1, m2)
    assert o2.state[m2.a.weight]["step"].item() == 2


def test_at_most_one_bucket_of_gradients_is_alive_during_backward():
    model = Net()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    alive = []

    def count(_):
        alive.append(sum(p.grad is not None for p in model.parameters()))

    # counted as each gradient completes, before its step: the one gradient alive is its own
    hooks = [p.register_post_accumulate_grad_hook(count) for p in model.parameters()]
    scaleopt.step_in_backward(opt, bucket_bytes=0)
    model(torch.randn(8, 16)).backward()
    for h in hooks:
        h.remove()
    assert len(alive) == 8 and max(alive) == 1
    assert all(p.grad is None for p in model.parameters())


def test_a_late_inf_skips_the_whole_step_before_anything_moves():
    model = Net()
    opt = scaleopt.LANS(model.parameters(), lr=1e-2, nonfinite="skip")
    steps = scaleopt.step_in_backward(opt, bucket_bytes=0)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(8, 16)

    def poisoned():  # an inf in the first layer's gradient: the last one backward reaches
        model.a.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        return model(x)

    steps.backward(poisoned)
    model.a.weight._backward_hooks.clear()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.skipped_steps == 1 and opt.skipped and not opt.state
    assert all(p.grad is None for p in model.parameters())
    steps.backward(lambda: model(x))  # the next step steps
    assert opt.skipped_steps == 1 and not opt.skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_what_needs_every_gradient_first_says_how_to_get_it():
    model = Net()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="clip='exact'"):
        scaleopt.step_in_backward(opt)
    steps = scaleopt.step_in_backward(opt, clip="exact")
    with pytest.raises(RuntimeError, match=r"steps.backward\(closure\)"):
        model(torch.randn(8, 16)).backward()


def test_previous_clips_by_the_norm_of_the_step_before():
    m1, m2 = _pair()
    o2 = scaleopt.LAMB(m2.parameters(), lr=1e-2, max_grad_norm=0.02)
    steps = scaleopt.step_in_backward(o2, clip="previous", bucket_bytes=0)
    x = torch.randn(8, 16)
    m1(x).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in m1.parameters() if p.grad is not None])
    o1 = scaleopt.LAMB(m1.parameters(), lr=1e-2)  # the first step: not clipped
    o1.step()
    m2(x).backward()
    assert _same(m1, m2)
    torch.testing.assert_close(steps._previous, want)


def test_errors_for_what_cannot_work():
    model = Net()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    steps = scaleopt.step_in_backward(opt)
    with pytest.raises(RuntimeError, match="steps inside backward"):
        opt.step()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: model(torch.randn(8, 16)))
    other = scaleopt.AdamW(model.parameters())
    with pytest.raises(ValueError, match="another optimizer"):
        scaleopt.step_in_backward(other)
    with pytest.raises(ValueError, match="Invalid clip"):
        scaleopt.step_in_backward(other, clip="approximate")
    with pytest.raises(TypeError, match="scaleopt optimizer"):
        scaleopt.step_in_backward(torch.optim.SGD(model.parameters(), lr=0.1))
    steps.remove()  # ordinary again
    model(torch.randn(8, 16)).backward()
    assert model.a.weight.grad is not None
    opt.step()
    scaleopt.step_in_backward(other)  # free to hook again


def test_a_copy_of_an_optimizer_stepping_in_backward_is_an_ordinary_optimizer():
    model = Net()
    opt = scaleopt.LAMB(model.parameters(), lr=1e-2)
    scaleopt.step_in_backward(opt)
    model(torch.randn(8, 16)).backward()
    twin = copy.deepcopy(opt)  # the hooks stay with the original, as torch's hooks do
    assert "_steps_in_backward" not in vars(twin) and "step" not in vars(twin)
    assert twin.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
