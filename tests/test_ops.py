"""The operations over lists of tensors (``_ops``): trust ratio, norms, clipping, moments."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaleopt import _ops

finite = st.floats(min_value=0.0, max_value=1e30, allow_nan=False, allow_infinity=False)
bound = st.one_of(st.none(), st.floats(min_value=1e-6, max_value=1e6))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(w=finite, u=finite, lo=bound, hi=bound)
def test_trust_ratio_is_finite_and_follows_the_formula(w, u, lo, hi):
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    r = _ops.trust_ratio(torch.tensor(w, dtype=torch.float64), torch.tensor(u, dtype=torch.float64), lo, hi)
    assert math.isfinite(r.item()) and r.item() >= 0
    phi = min(max(w, lo if lo is not None else -math.inf), hi if hi is not None else math.inf)
    expected = phi / u if phi > 0 and u > 0 else 1.0
    if not math.isfinite(expected):
        expected = 1.0  # an overflowing quotient falls back to 1
    assert math.isclose(r.item(), expected, rel_tol=1e-12, abs_tol=1e-300)


def test_trust_ratio_zero_norms_give_one():
    zero, two = torch.tensor(0.0), torch.tensor(2.0)
    assert _ops.trust_ratio(zero, two).item() == 1.0
    assert _ops.trust_ratio(two, zero).item() == 1.0
    assert _ops.trust_ratio(zero, zero).item() == 1.0


def test_lower_bound_applies_before_the_zero_test():
    # MXNet: a zero tensor with a lower bound gets lower/||u||, not 1
    r = _ops.trust_ratio(torch.tensor(0.0), torch.tensor(4.0), lower_bound=2.0)
    assert r.item() == 0.5
    r = _ops.trust_ratio(torch.tensor(10.0), torch.tensor(4.0), upper_bound=2.0)
    assert r.item() == 0.5


def test_norms_are_float32_for_low_precision_and_match_float64():
    torch.manual_seed(0)
    xs = [torch.randn(1000).to(torch.bfloat16), torch.randn(7, 3).half(), torch.zeros(0)]
    n = _ops.norms(xs)
    assert n.dtype == torch.float32
    exact = torch.stack([x.double().norm() for x in xs])
    torch.testing.assert_close(n.double(), exact, rtol=1e-6, atol=0)
    assert _ops.norms([torch.randn(3, dtype=torch.float64)]).dtype == torch.float64


def test_global_norm_is_the_norm_of_the_concatenation():
    torch.manual_seed(0)
    xs = [torch.randn(3, 4), torch.randn(5), torch.zeros(0)]
    torch.testing.assert_close(_ops.global_norm(xs), torch.cat([x.flatten() for x in xs]).norm())


def test_clipping_never_modifies_its_input():
    torch.manual_seed(0)
    gs = [torch.randn(10) * 5, torch.randn(3, 3)]
    saved = [g.clone() for g in gs]
    by_value = _ops.clip_by_value(gs, 0.5)
    by_pair = _ops.clip_by_value(gs, (-0.1, 0.3))
    by_norm = _ops.clip_by_tensor_norm(gs, 1.0)
    scaled = _ops.scale(gs, torch.tensor(0.5))
    for g, s in zip(gs, saved):
        assert torch.equal(g, s)
    assert all(b.abs().max() <= 0.5 for b in by_value)
    assert all(b.min() >= -0.1 and b.max() <= 0.3 for b in by_pair)
    for b, g in zip(by_norm, gs):
        assert b.norm() <= 1.0 + 1e-6
        torch.testing.assert_close(b / b.norm(), g / g.norm())  # direction kept
    torch.testing.assert_close(scaled[0], gs[0] * 0.5)


def test_clip_coef():
    assert _ops.clip_coef(torch.tensor(10.0), 5.0).item() == 0.5
    assert _ops.clip_coef(torch.tensor(1.0), 5.0).item() == 1.0
    assert _ops.clip_coef(torch.tensor(0.0), 5.0).item() == 1.0


def test_single_and_multi_tensor_moments_agree():
    torch.manual_seed(0)
    g = [torch.randn(4, 4), torch.randn(3)]
    m1, v1 = [torch.randn(4, 4), torch.randn(3)], [torch.rand(4, 4), torch.rand(3)]
    m2, v2 = [x.clone() for x in m1], [x.clone() for x in v1]
    _ops.adam_moments(m1, v1, g, 0.9, 0.99)
    for m, v, gg in zip(m2, v2, g):
        _ops.adam_moments_one(m, v, gg, 0.9, 0.99)
    for a, b in zip(m1 + v1, m2 + v2):
        assert torch.equal(a, b)
    d1 = _ops.adam_direction(m1, [0.5, 0.5], _ops.adam_denominators(v1, [0.1, 0.1], 1e-6))
    d2 = [_ops.adam_direction_one(m, 0.5, _ops.adam_denominator_one(v, 0.1, 1e-6))
          for m, v in zip(m2, v2)]
    for a, b in zip(d1, d2):
        assert torch.equal(a, b)


def test_heavy_ball():
    buf, g = [torch.ones(3)], [torch.full((3,), 2.0)]
    d = _ops.heavy_ball_(buf, g, 0.5, nesterov=False)
    assert torch.equal(buf[0], torch.full((3,), 2.5)) and d[0] is buf[0]
    d = _ops.heavy_ball_(buf, g, 0.5, nesterov=True)
    assert torch.equal(buf[0], torch.full((3,), 3.25))
    assert torch.equal(d[0], torch.full((3,), 2.0 + 0.5 * 3.25))
