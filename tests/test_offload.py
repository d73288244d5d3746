"""OffloadAdam and offload(): torch's Adam/AdamW numbers, host masters, checkpoints, AMP, errors.

On this machine the parameters live on the CPU, so these tests run the in-place host path (and
the bfloat16 master path); tests/test_cuda.py runs the device path when a GPU is present.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native
from scaleopt.offload import OffloadAdam, offload
from close import assert_within_steps
from steps import on_loss


def model_of(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).to(dtype)


def loss_of(model, t, micro=None):
    """Step ``t``'s loss (micro-batch ``micro`` of two): linear in the weights, so that its
    gradients are fixed tensors whatever the weights are. Two optimizers compared on it take
    the same gradients at every step, through backward, accumulation and GradScaler as a
    training loop runs them, and their weights differ only by their own roundings
    (close.py); a loss of the model's outputs would carry each difference into the next
    gradients."""
    g = torch.Generator().manual_seed(100 + t + (0 if micro is None else 1000 * (1 + micro)))
    return sum((p.float() * torch.randn(p.shape, generator=g)).sum() * 0.1
               for p in model.parameters())


def assert_rounded(param, master):
    """``param`` (bfloat16) is ``master`` rounded to nearest: no farther from it than
    ``master.to(bfloat16)`` (which breaks ties to even; the split master breaks them away from 0)."""
    p = param.detach().float()
    assert torch.all((p - master).abs() <= (master.to(torch.bfloat16).float() - master).abs())


def groups_of(model):
    (w0, b0), (w1, b1), (w2, b2) = [(m.weight, m.bias) for m in (model[0], model[2], model[3])]
    return [
        {"params": [w0, w2], "lr": 3e-2, "weight_decay": 0.1},
        {"params": [b0, b1, b2], "lr": 1e-2, "weight_decay": 0.0},
        {"params": [w1], "betas": (0.8, 0.99)},
    ]


def clip_(model, max_norm):
    """The global-norm clipping scaleopt documents: g * c / max(||g||, c)."""
    grads = [p.grad for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = max_norm / max(float(norm), max_norm)
    for g in grads:
        g.mul_(coef)


def run(model, opt, steps=20, accumulate=False, clip=None, sched=True, first=0):
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5) if sched else None

    def loss(t):
        if not accumulate:
            return loss_of(model, t)
        loss_of(model, t, 0).backward()
        loss_of(model, t, 1).backward()
        return None

    on_loss(opt, range(first, first + steps), loss,
            before_step=(lambda: clip_(model, clip)) if clip is not None else None,
            scheduler=scheduler)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("options", [
    dict(),
    dict(amsgrad=True),
    dict(maximize=True),
    dict(accumulate=True),
    dict(clip=0.05),
], ids=["plain", "amsgrad", "maximize", "accumulate", "clip"])
def test_equals_torch_adamw_over_20_steps(options, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(_native, "adam_applies", lambda *a: False)
    options = dict(options)
    accumulate = options.pop("accumulate", False)
    clip = options.pop("clip", None)
    ref_model = model_of()
    ref = torch.optim.AdamW(groups_of(ref_model), lr=1e-2, weight_decay=0.01, foreach=False,
                            **options)
    want = run(ref_model, ref, accumulate=accumulate, clip=clip)
    model = model_of()
    opt = OffloadAdam(groups_of(model), lr=1e-2, weight_decay=0.01, max_grad_norm=clip, **options)
    got = run(model, opt, accumulate=accumulate)
    for a, b in zip(got, want):
        assert_within_steps(a, b, step=3e-2, steps=20)


def test_coupled_decay_equals_torch_adam():
    ref_model, model = model_of(), model_of()
    want = run(ref_model, torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=0.1,
                                           foreach=False))
    got = run(model, OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled=False))
    for a, b in zip(got, want):
        assert_within_steps(a, b, step=1e-2, steps=20)


def test_nesterov_and_epsilon_hat_follow_their_formulas():
    p = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    opt = OffloadAdam([p], lr=0.1, betas=(0.9, 0.99), eps=0.1, nesterov=True, eps_mode="hat")
    w = p.detach().clone()
    m = torch.zeros(3, dtype=torch.float64)
    v = torch.zeros(3, dtype=torch.float64)
    for t in range(1, 4):
        g = torch.tensor([0.3, -0.2, 0.1], dtype=torch.float64) * t
        p.grad = g.clone()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        w = w - 0.1 * (1 - 0.99 ** t) ** 0.5 / (1 - 0.9 ** t) * (0.9 * m + 0.1 * g) / (v.sqrt() + 0.1)
        torch.testing.assert_close(p.detach(), w)


def test_bf16_parameters_with_fp32_master_track_the_fp32_run():
    grads = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * t + i))
              for i, s in enumerate([(8, 6), (8,)])] for t in range(20)]
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(8, 6).to(dtype)), nn.Parameter(torch.randn(8).to(dtype))]
        opt = OffloadAdam(params, lr=1e-2, weight_decay=0.1)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.to(dtype)
            opt.step()
        runs[dtype] = (params, opt)
    (p32, _), (p16, opt16) = runs[torch.float32], runs[torch.bfloat16]
    for a, b in zip(p32, p16):
        master = opt16.master(b)
        assert master.dtype == torch.float32 and b.dtype == torch.bfloat16
        assert opt16.state[b]["exp_avg"].dtype == torch.float32
        assert_rounded(b, master)  # the parameter is the master rounded to nearest
        torch.testing.assert_close(master, a.detach(), rtol=0, atol=2e-2)
        # the master keeps what bfloat16 cannot hold
        assert not torch.equal(master, b.detach().float())


def test_bf16_kernel_equals_torch_path(monkeypatch):
    def train(use_kernel):
        monkeypatch.setattr(_native, "adam_applies",
                            _native.adam_applies if use_kernel else (lambda *a: False))
        model = model_of(dtype=torch.bfloat16)
        opt = OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
        run(model, opt, steps=5, sched=False)
        return [p.detach().clone() for p in model.parameters()], opt
    real = _native.adam_applies
    (k, ok), (t, ot) = train(True), train(False)
    monkeypatch.setattr(_native, "adam_applies", real)
    for a, b, pa, pb in zip(k, t, ok.param_groups[0]["params"], ot.param_groups[0]["params"]):
        torch.testing.assert_close(ok.master(pa), ot.master(pb), rtol=1e-6, atol=1e-7)
        assert (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max()


def test_fp16_parameters_take_the_torch_path_with_a_master():
    p = nn.Parameter(torch.randn(5, 4).half())
    opt = OffloadAdam([p], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(5, 4).half()
        opt.step()
    assert opt.state[p]["master_param"].dtype == torch.float32
    assert torch.equal(p.detach(), opt.master(p).half())


def test_a_float32_host_parameter_is_its_own_master():
    model = model_of()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    run(model, opt, steps=2)
    for p in model.parameters():
        assert "master_param" not in opt.state[p]
        assert opt.state[p]["exp_avg"].device.type == "cpu"
    assert opt.host.hooks == []  # nothing to copy on the host: no gradient hooks


def test_non_contiguous_parameters_match_torch():
    base = torch.randn(6, 4)
    p = nn.Parameter(base.t().clone().t().t())  # transposed, non-contiguous
    q = nn.Parameter(p.detach().clone())
    assert not p.is_contiguous()
    opt = OffloadAdam([p], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1, foreach=False)
    for t in range(5):
        g = torch.randn(4, 6, generator=torch.Generator().manual_seed(t))
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert not p.is_contiguous()
    assert_within_steps(p.detach(), q.detach(), step=1e-2, steps=5)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("direction", ["offload->torch", "torch->offload"])
def test_state_dict_interoperates_with_torch_adamw(direction):
    m1, m2 = model_of(), model_of()
    if direction == "offload->torch":
        first, second = OffloadAdam, torch.optim.AdamW
    else:
        first, second = torch.optim.AdamW, OffloadAdam
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    o1 = first(m1.parameters(), **kwargs)
    run(m1, o1, steps=4, sched=False)
    m2.load_state_dict(m1.state_dict())
    o2 = second(m2.parameters(), **kwargs)
    o2.load_state_dict(_roundtrip(o1.state_dict()))
    for p in m2.parameters():
        assert set(o2.state[p]) >= {"step", "exp_avg", "exp_avg_sq"}
    ref_model = copy.deepcopy(m1)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **kwargs)
    ref.load_state_dict(_roundtrip(o1.state_dict()))
    for t in range(4, 8):
        for model, opt in ((m2, o2), (ref_model, ref)):
            opt.zero_grad()
            loss_of(model, t).backward()
            opt.step()
    for a, b in zip(m2.parameters(), ref_model.parameters()):
        assert_within_steps(a, b, step=1e-2, steps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_is_bit_identical(dtype):
    m1 = model_of(dtype=dtype)
    o1 = OffloadAdam(m1.parameters(), lr=1e-2, weight_decay=0.1)
    run(m1, o1, steps=3, sched=False)
    m2 = copy.deepcopy(m1)
    o2 = OffloadAdam(m2.parameters(), lr=1e-2, weight_decay=0.1)
    o2.load_state_dict(_roundtrip(o1.state_dict()))
    for model, opt in ((m1, o1), (m2, o2)):
        run(model, opt, steps=3, sched=False, first=3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(m1.parameters(), m2.parameters()):
        for k in o1.state[a]:
            assert torch.equal(o1.state[a][k], o2.state[b][k]), k


def test_a_bf16_checkpoint_keeps_the_float32_master():
    m1 = model_of(dtype=torch.bfloat16)
    o1 = OffloadAdam(m1.parameters(), lr=1e-3)
    run(m1, o1, steps=3, sched=False)
    m2 = copy.deepcopy(m1)
    o2 = OffloadAdam(m2.parameters(), lr=1e-3)
    o2.load_state_dict(_roundtrip(o1.state_dict()))
    saved = o1.state_dict()
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(o1.master(a), o2.master(b))
        assert not torch.equal(o2.master(b), b.detach().float())
    for st in saved["state"].values():
        assert st["master_param"].dtype == torch.float32 and "master_lo" not in st


def test_a_bf16_master_is_held_as_the_parameter_plus_16_low_bits():
    model = model_of(dtype=torch.bfloat16)
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    run(model, opt, steps=3, sched=False)
    for p in model.parameters():
        st = opt.state[p]
        if _native.available():
            assert "master_param" not in st and st["master_lo"].dtype == torch.int16
        assert_rounded(p, opt.master(p))


@pytest.mark.parametrize("saved_split, loaded_split", [(True, False), (False, True)])
def test_checkpoints_move_between_split_and_float32_masters(saved_split, loaded_split,
                                                            monkeypatch):
    def build(split, model):
        monkeypatch.setattr(_native, "available", lambda: split)
        return OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    m1 = model_of(dtype=torch.bfloat16)
    o1 = build(saved_split, m1)
    run(m1, o1, steps=3, sched=False)
    m2 = copy.deepcopy(m1)
    o2 = build(loaded_split, m2)
    o2.load_state_dict(_roundtrip(o1.state_dict()))
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(o1.master(a), o2.master(b))
        assert ("master_lo" in o2.state[b]) == loaded_split


def _grad_scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)


def test_grad_scaler_unscales_on_the_host():
    m1, m2 = model_of(), model_of()
    ref = torch.optim.AdamW(m1.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    opt = OffloadAdam(m2.parameters(), lr=1e-2)
    scaler = _grad_scaler()
    for t in range(5):
        ref.zero_grad()
        loss_of(m1, t).backward()
        ref.step()
        opt.zero_grad()
        scaler.scale(loss_of(m2, t)).backward()
        grads = [p.grad.clone() for p in m2.parameters()]
        scaler.step(opt)
        scaler.update()
        # the scaled gradients were read, not unscaled in place
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, m2.parameters()))
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert_within_steps(a, b, step=1e-2, steps=5)


@pytest.mark.parametrize("make", [
    lambda ps: OffloadAdam(ps, lr=1e-2),
    lambda ps: scaleopt.LAMB(ps, lr=1e-2, weight_decay=0.01),
], ids=["OffloadAdam", "LAMB"])
def test_a_trainer_that_unscales_before_clipping_gets_the_same_step(make):
    """Only the GradScaler is told the step takes its scale; a trainer asking (to clip) is told
    it does not, unscales through the scaler first, and the step then reads no scale."""
    m1, m2 = model_of(), model_of()
    direct, via_unscale = make(m1.parameters()), make(m2.parameters())
    assert not via_unscale._step_supports_amp_scaling  # what Lightning reads before clipping
    s1, s2 = _grad_scaler(), _grad_scaler()
    for t in range(4):
        for m, o, s in ((m1, direct, s1), (m2, via_unscale, s2)):
            o.zero_grad()
            s.scale(loss_of(m, t)).backward()
        s2.unscale_(via_unscale)
        s1.step(direct)
        s2.step(via_unscale)
        s1.update()
        s2.update()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()})


def _unchanged(model, opt, snap):
    params, state = snap
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    for p in model.parameters():
        for k, v in state[id(p)].items():
            assert torch.equal(v, opt.state[p][k]), k


def test_grad_scaler_inf_skips_the_step_without_state_change():
    model = model_of()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    scaler = _grad_scaler()
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    snap = _snapshot(model, opt)
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    model[0].weight.grad[0, 0] = float("inf")
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert opt.skipped
    _unchanged(model, opt, snap)
    assert scaler.get_scale() < scale


@pytest.mark.parametrize("options", [dict(max_grad_norm=1.0, nonfinite="skip"),
                                     dict(check_finite=True)])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradients_skip_the_step(options, bad):
    model = model_of()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **options)
    run(model, opt, steps=1, sched=False)
    snap = _snapshot(model, opt)
    opt.zero_grad()
    loss_of(model, 1).backward()
    model[3].bias.grad[1] = bad
    opt.step()
    assert opt.skipped
    _unchanged(model, opt, snap)
    model[3].bias.grad[1] = 0.0
    opt.step()
    assert not opt.skipped and opt.state[model[3].bias]["step"] == 2


def test_loss_scale_divides_the_gradient():
    m1, m2 = model_of(), model_of()
    o1 = OffloadAdam(m1.parameters(), lr=1e-2, weight_decay=0.1, decoupled=False)
    o2 = OffloadAdam(m2.parameters(), lr=1e-2, weight_decay=0.1, decoupled=False, loss_scale=64.0)
    for t in range(4):
        for model, opt, s in ((m1, o1, 1.0), (m2, o2, 64.0)):
            opt.zero_grad()
            (loss_of(model, t) * s).backward()
            opt.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_num_threads_is_used_and_restored(monkeypatch):
    seen = []
    real = _native.adam

    def spy(*args, **kwargs):
        seen.append((kwargs["threads"], torch.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(_native, "adam", spy)
    before = torch.get_num_threads()
    model = model_of()
    opt = OffloadAdam(model.parameters(), num_threads=1)
    run(model, opt, steps=1, sched=False)
    if _native.available():
        assert seen and all(s == (1, 1) for s in seen)
    assert torch.get_num_threads() == before


def test_grads_are_never_written():
    model = model_of()
    opt = OffloadAdam(model.parameters(), lr=1e-2, max_grad_norm=1e-3, maximize=True,
                      loss_scale=4.0, weight_decay=0.1, decoupled=False)
    loss_of(model, 0).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


# -- offload(LAMB / LANS) --------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=["LAMB", "LANS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_layerwise_equals_the_plain_optimizer(cls, dtype):
    m1, m2 = model_of(dtype=dtype), model_of(dtype=dtype)
    plain = cls(m1.named_parameters(), lr=1e-2, master_weights=True, max_grad_norm=1.0,
                exclude_from_weight_decay="bias")
    off = offload(cls, m2.named_parameters(), lr=1e-2, max_grad_norm=1.0,
                  exclude_from_weight_decay="bias")
    assert type(off) is cls and off.host is not None and plain.host is None
    run(m1, plain, steps=6)
    run(m2, off, steps=6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    if dtype == torch.bfloat16:  # both keep split masters: the same bits
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert "master_lo" in off.state[b] and "master_param" not in off.state[b]
            assert torch.equal(off.master(b), plain.master(a))


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=["LAMB", "LANS"])
def test_offloaded_layerwise_bf16_checkpoints_carry_float32_masters(cls):
    m1 = model_of(dtype=torch.bfloat16)
    off = offload(cls, m1.named_parameters(), lr=1e-2)
    run(m1, off, steps=4, sched=False)
    sd = off.state_dict()
    for p, st in zip(m1.parameters(), sd["state"].values()):
        assert "master_lo" not in st and torch.equal(st["master_param"], off.master(p))
    # into a fresh offloaded optimizer and into the plain one: both go on bit for bit
    m2, m3 = copy.deepcopy(m1), copy.deepcopy(m1)
    again = offload(cls, m2.named_parameters(), lr=1e-2)
    again.load_state_dict(copy.deepcopy(sd))
    plain = cls(m3.named_parameters(), lr=1e-2, master_weights=True)
    plain.load_state_dict(copy.deepcopy(sd))
    for opt, m in ((off, m1), (again, m2), (plain, m3)):
        for t in range(4, 7):
            opt.zero_grad()
            loss_of(m, t).backward()
            opt.step()
    for a, b, c in zip(m1.parameters(), m2.parameters(), m3.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
        assert torch.equal(off.master(a), again.master(b))
        assert torch.equal(off.master(a), plain.master(c))


def test_offloaded_fp16_parameters_are_rounded_from_the_master():
    p = nn.Parameter(torch.randn(6, 5).half())
    opt = offload(scaleopt.LAMB, [p], lr=1e-2)
    for _ in range(3):
        p.grad = torch.randn(6, 5).half()
        opt.step()
    assert torch.equal(p.detach(), opt.state[p]["master_param"].half())


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(lr="1e-3"), TypeError, "lr"),
    (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
    (dict(betas=(0.9,)), TypeError, "betas"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(decoupled=1), TypeError, "decoupled"),
    (dict(amsgrad="yes"), TypeError, "amsgrad"),
    (dict(nesterov=True, amsgrad=True), ValueError, "amsgrad"),
    (dict(eps_mode="inside"), ValueError, "eps_mode"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    (dict(loss_scale=0.0), ValueError, "loss_scale"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=1.5), ValueError, "num_threads"),
    (dict(check_finite=None), TypeError, "check_finite"),
    (dict(overlap="no"), TypeError, "overlap"),
    (dict(exclude_from_weight_decay="("), ValueError, "exclude_from_weight_decay"),
    (dict(foreach=True), ValueError, "foreach=True: OffloadAdam has no multi-tensor path"),
    (dict(foreach="yes"), TypeError, "foreach"),
    (dict(fused=True, amsgrad=True), ValueError, "fused=True.*amsgrad"),
    (dict(fused=True, foreach=True), ValueError, "cannot be set together"),
])
def test_bad_options_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        OffloadAdam([("w", nn.Parameter(torch.randn(2, 2)))], **kwargs)


def test_bad_parameters_are_clear_errors():
    with pytest.raises(TypeError, match="floating-point"):
        OffloadAdam([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="empty"):
        OffloadAdam([])
    with pytest.raises(TypeError, match="single Tensor"):
        OffloadAdam(torch.zeros(3))
    p = nn.Parameter(torch.randn(4, 3))
    opt = OffloadAdam([p])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_offload_takes_only_layerwise_optimizers():
    p = nn.Parameter(torch.randn(2))
    with pytest.raises(TypeError, match="OffloadAdam"):
        offload(torch.optim.AdamW, [p])
    with pytest.raises(ValueError, match="master"):
        offload(scaleopt.LAMB, [p], master_weights=False)
    with pytest.raises(ValueError, match="num_threads"):
        offload(scaleopt.LAMB, [p], num_threads=-2)


def test_the_host_kernel_computes_torchs_adamw_bit_for_bit_almost_everywhere():
    # the same operations in the same order (and no fused multiply-adds): after a step nearly
    # every weight is the very float torch computes; the few others sit near zero, where decay
    # and update nearly cancel
    gen = torch.Generator().manual_seed(0)
    w0, g = torch.randn(1 << 18, generator=gen), torch.randn(1 << 18, generator=gen)
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    ours = OffloadAdam([a], lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW([b], lr=1e-3, weight_decay=0.01, foreach=False)
    a.grad, b.grad = g.clone(), g.clone()
    ours.step()
    ref.step()
    same = a.detach() == b.detach()
    assert same.float().mean() > 0.99
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("make", [
    lambda ps: OffloadAdam(ps, lr=1e-2, check_finite=True, num_threads=1),
    lambda ps: offload(scaleopt.LAMB, ps, lr=1e-2, num_threads=1),
], ids=["OffloadAdam", "offload(LAMB)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_offloaded_optimizer_keeps_its_pipeline_and_steps_the_same(make, dtype, how):
    import pickle

    model = model_of(dtype=dtype)
    opt = make(model.parameters())
    run(model, opt, steps=2, sched=False)
    model2, opt2 = (copy.deepcopy((model, opt)) if how == "deepcopy"
                    else pickle.loads(pickle.dumps((model, opt))))
    assert opt2.host is not None and opt2.host.num_threads == 1
    assert opt2.host is not opt.host
    for m, o in ((model, opt), (model2, opt2)):
        run(m, o, steps=2, sched=False, first=2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(opt.master(a), opt2.master(b))


def test_the_step_sees_exactly_the_documented_gradient_changes():
    """The rule that decides whether a gradient copied from a backward hook is copied again at
    step() (GPU parameters; the rule itself is device-independent)."""
    from scaleopt._host import copy_is_current

    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    copied = (p.grad, p.grad._version)
    assert copy_is_current(copied, p.grad)
    torch.nn.utils.clip_grad_norm_([p], 1e-3)  # clipping after backward: seen
    assert not copy_is_current(copied, p.grad)
    for change in (lambda g: g.mul_(0.5), lambda g: torch._foreach_mul_([g], 0.5),
                   lambda g: torch.nn.utils.clip_grad_value_([p], 1e-4)):
        copied = (p.grad, p.grad._version)
        with torch.no_grad():
            change(p.grad)
        assert not copy_is_current(copied, p.grad)
    copied = (p.grad, p.grad._version)
    p.grad = p.grad.clone()  # another tensor: seen
    assert not copy_is_current(copied, p.grad)
    copied = (p.grad, p.grad._version)
    p.grad.data.mul_(0.5)  # through .data: not seen, as documented (use overlap=False)
    assert copy_is_current(copied, p.grad)
