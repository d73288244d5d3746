"""LANS semantics checked against independent float64 computations, and fp32 master weights."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt.compat import mxnet, paddle
from steps import on_gradients


def one_step_by_hand(w0, g, lr, wd, beta1=0.9, beta2=0.999, eps=1e-6, moved=False):
    gt = g / g.norm()
    m = (1 - beta1) * gt / (1 - beta1)
    v = (1 - beta2) * gt * gt / (1 - beta2)
    d = v.sqrt() + eps
    r = m / d + wd * w0
    w1 = w0 - lr * beta1 * (w0.norm() / r.norm()) * r
    c = gt / d + wd * (w1 if moved else w0)
    step_from = w1 if moved else w0 - lr * beta1 * (w0.norm() / r.norm()) * r
    return step_from - lr * (1 - beta1) * (w0.norm() / c.norm()) * c


@pytest.mark.parametrize("moved", [False, True])
@pytest.mark.parametrize("foreach", [True, False])
def test_one_step_by_hand(moved, foreach):
    torch.manual_seed(0)
    w0 = torch.randn(5, 4, dtype=torch.float64)
    g = torch.randn(5, 4, dtype=torch.float64) * 7
    p = nn.Parameter(w0.clone())
    opt = scaleopt.LANS([p], lr=0.1, weight_decay=0.3, decay_moved_weight=moved, foreach=foreach)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach(), one_step_by_hand(w0, g, 0.1, 0.3, moved=moved),
                               rtol=1e-12, atol=1e-12)


def test_the_two_semantics_differ_by_the_moved_decay():
    # at step 1 the two parts point the same way (m_hat = g) and the ratios hide the difference;
    # from step 2 on they differ
    torch.manual_seed(0)
    w0 = torch.randn(6, dtype=torch.float64)
    out = {}
    for moved in (False, True):
        p = nn.Parameter(w0.clone())
        opt = scaleopt.LANS([p], lr=0.5, weight_decay=0.5, decay_moved_weight=moved)
        for t in range(3):
            p.grad = torch.randn(6, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
            opt.step()
        out[moved] = p.detach()
    assert not torch.allclose(out[False], out[True], rtol=1e-6, atol=0)


@pytest.mark.parametrize("foreach", [True, False])
def test_all_zero_gradient_stays_finite(foreach):
    p = nn.Parameter(torch.ones(4))
    q = nn.Parameter(torch.ones(3))
    opt = scaleopt.LANS([p, q], lr=0.1, weight_decay=0.0, foreach=foreach)
    p.grad, q.grad = torch.zeros(4), torch.ones(3)
    opt.step()
    assert torch.isfinite(p).all() and torch.equal(p.detach(), torch.ones(4))
    assert torch.isfinite(q).all() and not torch.equal(q.detach(), torch.ones(3))
    # the same through the MXNet front-end (whose original turns this into NaN)
    r = nn.Parameter(torch.ones(4))
    mx = mxnet.LANS([r], learning_rate=0.1, use_fused_step=False)
    r.grad = torch.zeros(4)
    mx.step()
    assert torch.isfinite(r).all()


def test_gradient_scale_does_not_matter():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(8))
    b = nn.Parameter(a.detach().clone())
    oa, ob = scaleopt.LANS([a], lr=0.1), scaleopt.LANS([b], lr=0.1)
    for t in range(4):
        g = torch.randn(8, generator=torch.Generator().manual_seed(t))
        a.grad, b.grad = g, g * 1000
        oa.step()
        ob.step()
    torch.testing.assert_close(a, b)


def test_mxnet_multipliers_by_name_and_index():
    w = nn.Parameter(torch.ones(3))
    b = nn.Parameter(torch.ones(3))
    opt = mxnet.LAMB([w, b], learning_rate=0.1, wd=0.5, param_idx2name={0: "fc_weight", 1: "fc_bias"})
    assert opt.wd_mult == {"fc_bias": 0.0}
    opt.set_lr_mult({"fc_bias": 0.0})
    opt.set_wd_mult({1: 2.0})  # by index: overrides the name rule
    lrs, wds, _ = opt._layer_options(opt.param_groups[0], [0, 1])
    assert lrs == [0.1, 0.0] and wds == [0.5, 1.0]
    w.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3))  # lr_mult 0
    opt.set_learning_rate(0.2)
    assert opt.learning_rate == 0.2 and opt.wd == 0.5


def test_mxnet_bounds_of_zero_mean_unset_and_bad_aggregate():
    opt = mxnet.LAMB([nn.Parameter(torch.ones(2))], lower_bound=0, upper_bound=-1, clip_gradient=0)
    g = opt.param_groups[0]
    assert g["lower_bound"] is None and g["upper_bound"] is None and g["clip_grad_value"] is None
    with pytest.raises(ValueError, match="aggregate_num"):
        mxnet.LANS([nn.Parameter(torch.ones(2))], aggregate_num=-1)
    with pytest.raises(ValueError, match="beta1"):
        mxnet.LANS([nn.Parameter(torch.ones(2))], beta1=1.0)
    with pytest.raises(ValueError, match="param_idx2name"):
        mxnet.LAMB([nn.Parameter(torch.ones(2))], param_idx2name={3: "x_weight"})


# ---------------------------------------------------------------------------------------------
# fp32 master weights
# ---------------------------------------------------------------------------------------------


def bf16_representable_grads(shapes, t):
    g = torch.Generator().manual_seed(t)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]


SHAPES = [(16, 8), (8,), (4, 16)]
MAKERS = {
    "LAMB": lambda ps, **kw: scaleopt.LAMB(ps, lr=1e-2, weight_decay=0.01, **kw),
    "LANS": lambda ps, **kw: scaleopt.LANS(ps, lr=1e-2, weight_decay=0.01, **kw),
}


def params(dtype):
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(s).to(torch.bfloat16).to(dtype)) for s in SHAPES]


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("foreach", [True, False])
def test_bf16_master_tracks_the_fp32_run(name, foreach):
    p32, p16 = params(torch.float32), params(torch.bfloat16)
    o32 = MAKERS[name](p32, foreach=foreach)
    o16 = MAKERS[name](p16, master_weights=True, foreach=foreach)
    for t in range(50):
        grads = bf16_representable_grads(SHAPES, t)
        for a, b, g in zip(p32, p16, grads):
            a.grad, b.grad = g.float(), g
        o32.step()
        o16.step()
    for a, b in zip(p32, p16):
        master = o16.master(b)
        assert master.dtype == torch.float32 and o16.state[b]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, a.detach(), rtol=2e-6, atol=1e-7)
        # the parameter is the master rounded to nearest (a split master breaks ties away from 0)
        err = (b.detach().float() - master).abs()
        assert torch.all(err <= (master.to(torch.bfloat16).float() - master).abs())


@pytest.mark.parametrize("foreach", [None, True, False])
def test_adamw_joins_float32_masters_a_part_at_a_time_with_the_bits_of_one_call(
        foreach, monkeypatch):
    """AdamW's float32 moments on split masters run on torch's paths over joined float32
    masters: joined a part of JOIN_ELEMENTS at a time (its transients bounded by that, not by
    the model: docs/memory.md measures it), the bits of joining every tensor at once."""
    from scaleopt import adamw

    shapes = [(64, 32), (32,), (48, 64), (5,), (128, 16)]
    runs = []
    for join in (1 << 30, 64 * 32):  # one call, or a part per tensor here
        monkeypatch.setattr(adamw, "JOIN_ELEMENTS", join)
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in shapes]
        opt = scaleopt.AdamW(ps, lr=1e-2, weight_decay=0.1, master_weights=True,
                             foreach=foreach)
        assert len(adamw._joined_parts(opt.param_groups[0], ps)) == (1 if join > 1e6 else 5)
        for t in range(3):
            for p, g in zip(ps, bf16_representable_grads(shapes, t)):
                p.grad = g
            opt.step()
        runs.append([opt.master(p) for p in ps] + [opt.state[p]["exp_avg_sq"] for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bf16_master_resume_is_bit_identical(name):
    pa = params(torch.bfloat16)
    oa = MAKERS[name](pa, master_weights=True)

    def run(ps, opt, ts):
        on_gradients(opt, ps, ts, lambda t: bf16_representable_grads(SHAPES, t))

    run(pa, oa, range(5))
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    pb = [nn.Parameter(p.detach().clone()) for p in pa]
    ob = MAKERS[name](pb, master_weights=True)
    ob.load_state_dict(torch.load(buf, weights_only=True))
    for p in pb:
        assert ob.master(p).dtype == torch.float32
        assert ob.state[p]["exp_avg_sq"].dtype == torch.float32
    run(pa, oa, range(5, 12))
    run(pb, ob, range(5, 12))
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        assert torch.equal(oa.master(a), ob.master(b))


def test_without_master_weights_bf16_state_stays_bf16():
    ps = params(torch.bfloat16)
    opt = scaleopt.LAMB(ps)
    for p, g in zip(ps, bf16_representable_grads(SHAPES, 0)):
        p.grad = g
    opt.step()
    assert "master_param" not in opt.state[ps[0]]
    assert opt.state[ps[0]]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_grad_scaler_skips_non_finite_steps_without_touching_state(name):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = MAKERS[name](list(model.named_parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(8, 4)
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    snapshot = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(model(x).square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**8  # the scaler saw the inf and backed off
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for k, st in snapshot["state"].items():
        for key, v in st.items():
            assert torch.equal(v, after["state"][k][key])


@pytest.mark.parametrize("cls", [paddle.Lamb, paddle.AdamW])
def test_paddle_multi_precision_uses_master_weights(cls):
    ps = [("w", nn.Parameter(torch.ones(4, dtype=torch.bfloat16)))]
    opt = cls(parameters=ps, multi_precision=True)
    assert opt.param_groups[0]["master_weights"] is True
    ps[0][1].grad = torch.ones(4, dtype=torch.bfloat16)
    opt.step()
    assert opt.master(ps[0][1]).dtype == torch.float32
    assert opt.state[ps[0][1]]["exp_avg"].dtype == torch.float32
    assert opt.master(ps[0][1]).to(torch.bfloat16).equal(ps[0][1].detach())


def test_mxnet_multi_precision_keeps_fp32_masters():
    ps = [nn.Parameter(torch.ones(4, dtype=torch.float16)), nn.Parameter(torch.ones(2))]
    for cls in (mxnet.LAMB, mxnet.LANS):
        opt = cls(ps, learning_rate=0.01, multi_precision=True)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.state[ps[0]]["master_param"].dtype == torch.float32
        assert "master_param" not in opt.state[ps[1]]  # float32 is its own master
        assert ps[0].dtype == torch.float16
