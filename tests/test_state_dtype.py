"""Optimizer state in bfloat16 and 8 bits (``state_dtype``): the stored forms against their
definitions, blocks that no row split changes, unbiased rounding, every optimizer and
implementation, checkpoints that resume exactly and convert with a message, and bad input
refused by name."""

from __future__ import annotations

import io
import math
import warnings
from fractions import Fraction

import pytest
import torch

import scaleopt
from scaleopt import _compact, _native
from steps import on_loss

FORMS = ("float32", "bfloat16", "int8")
#: the compact kernels' loops: portable C, and AVX-512 where the CPU has it
LANES = ("portable", "avx512")


# -- the stored forms against their definitions ---------------------------------------------


def _bits(x, step=1.0, offset=0):
    """The random bits with which the second moment x (at this step, its piece starting at
    ``offset`` in the whole tensor) is stored."""
    index = torch.arange(x.numel()).view(x.shape) + offset
    return _compact.code_random16(index, math.prod(x.shape[1:]), torch.tensor(step), 2)


def _codes_by_definition(x, signed, bits):
    """The int8 codes of a 2-D tensor, element by element as the docs define them (in
    Fractions: exact), with the random bits of unsigned codes."""
    rows, length = x.shape
    codes, scales = [], []
    for r in range(rows):
        row_codes, row_scales = [], []
        for start in range(0, length, _compact.BLOCK):
            block = [float(v) for v in x[r, start:start + _compact.BLOCK]]
            s = max(abs(v) for v in block)
            row_scales.append(s)
            for i, v in enumerate(block):
                y = Fraction(abs(v)) / Fraction(s) if s > 0 else Fraction(0)
                if signed:
                    row_codes.append(round(127 * math.sqrt(y)) * (1 if v >= 0 else -1))
                else:
                    row_codes.append(_exact_code(y * Fraction(15, 8), False,
                                                 int(bits[r, start + i])))
        codes.append(row_codes)
        scales.append(row_scales)
    return torch.tensor(codes), torch.tensor(scales)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_and_scales_are_those_of_the_definition(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g) * torch.logspace(-4, 0, 300)
    x[1, 256:] = 0.0  # an all-zero last block
    if not signed:
        x = x.square()
    codes, scales = _compact.quantize(x, signed, None if signed else _bits(x))
    want_codes, want_scales = _codes_by_definition(x, signed, _bits(x))
    assert codes.dtype == (torch.int8 if signed else torch.uint8)
    assert scales.shape == (3, 2) and scales.dtype == torch.float32
    torch.testing.assert_close(scales, want_scales.float())
    # the same codes, but for a value on a rounding boundary (y = |x| c is rounded in float32)
    assert (codes.long() - want_codes).abs().max() <= 1
    assert (codes.long() != want_codes).float().mean() < 1e-3


def _f32(x):
    """x (exact in double) rounded to float32, once."""
    return torch.tensor(float(x), dtype=torch.float64).float().item()


#: 2^-31, the offset of the second moment's 8-bit floats
LOW = Fraction(1, 2 ** 31)


def _float8(q):
    """F(q), the 8-bit float of an unsigned code before its offset: 2^-31 + q 2^-34 up to
    q = 8, then 8 steps per binade, (8 + q mod 8) 2^(q div 8 - 34)."""
    return LOW + Fraction(q, 2 ** 34) if q < 8 else Fraction(8 + q % 8) * Fraction(2) ** (q // 8 - 34)


#: what each unsigned code decodes to, for the scale 1.875: F(q) - 2^-31
LEVELS = [_float8(q) - LOW for q in range(256)]


def _exact_code(y, signed, r=None):
    """The code of y (|x| times 127^2/s or 1.875/s) by its definition. Signed: the largest k
    with (k - 1/2)^2 <= y in exact arithmetic, i.e. the square root rounded, halves up.
    Unsigned, with 16 random bits r: with z = y + 2^-31 rounded to float32, the code q of
    the level F(q) <= z below it, and q + 1 where z lies at least the fraction 1 - r/2^16 of
    the way to the next level (so with probability the fraction, to 2^-16); 255 at most."""
    y = Fraction(y)
    k = 0
    if signed:
        while Fraction(2 * k + 1, 2) ** 2 <= y:
            k += 1
        return k
    z = Fraction(_f32(y + LOW))
    while k < 255 and _float8(k + 1) <= z:
        k += 1
    if k == 255:
        return 255
    way = (z - _float8(k)) / (_float8(k + 1) - _float8(k))
    return k + (way >= 1 - Fraction(r, 65536))


def _near(value, values):
    """value (rounded to float32) and the floats one and two roundings either side of it."""
    edge = torch.tensor(float(value))
    values.add(float(edge))
    for toward in (-math.inf, math.inf):
        near = edge
        for _ in range(2):
            near = torch.nextafter(near, torch.tensor(toward))
            values.add(float(near))


def _boundary_rows(signed):
    """Rows of one block each: the scale s that makes 127^2/s (1.875/s) exactly 1, then values
    on and a float rounding or two either side of every boundary between two codes: (k-1/2)^2
    (signed), the levels F(k) - 2^-31 (unsigned). Then, for unsigned codes, rows whose values
    lie on and around the point where each element's random bits (at step 1) decide between
    k and k + 1."""
    scale = 16129.0 if signed else 1.875
    values = set()
    for k in range(1, 128 if signed else 256):
        _near((k - 0.5) ** 2 if signed else LEVELS[k], values)
    values = sorted(v for v in values if v <= scale)
    rows = []
    for start in range(0, len(values), 255):
        row = [scale] + values[start:start + 255]
        rows.append(row + [0.0] * (256 - len(row)))
    if not signed:
        rows += _random_boundary_rows(len(rows), scale)
    return torch.tensor(rows), scale


def _random_boundary_rows(first, scale):
    """Rows from row ``first``: in each group of 5 elements, with k = 1 .. 254 in turn, the
    values on and either side of the point (1 - r/2^16) of the way from level k to k + 1 for
    the bits r of the middle element."""
    rows, k = [], 0
    bits = _bits(torch.zeros(first + 6, 256)).tolist()
    for row in range(first, first + 6):
        out = [scale]
        while len(out) + 5 <= 256:
            k = k % 254 + 1
            r = bits[row][len(out) + 2]
            point = LEVELS[k] + (1 - Fraction(r, 65536)) * (LEVELS[k + 1] - LEVELS[k])
            near = set()
            _near(float(point), near)
            out += sorted(near)[:5] + [0.0] * (5 - len(near))
        rows.append(out + [0.0] * (256 - len(out)))
    return rows


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("impl", ["torch", *LANES])
def test_codes_are_those_of_exact_arithmetic_in_every_implementation(signed, impl, monkeypatch):
    """Every implementation stores the same codes, those of exact arithmetic on y = |x| c,
    even for values a float rounding away from a boundary between two codes, or from where
    the random bits decide."""
    x, scale = _boundary_rows(signed)
    x = torch.cat([x, -x]) if signed else x
    if impl == "torch":
        monkeypatch.setattr(_native, "_lib", None)
    elif not _native.available():
        pytest.skip("the C kernels are not built")
    else:
        was = _native.compact_simd()
        if _native.compact_simd(impl == "avx512") != (impl == "avx512"):
            _native.compact_simd(was)
            pytest.skip("this CPU has no AVX-512")
    try:
        key = "exp_avg" if signed else "exp_avg_sq"
        state = {"step": torch.tensor(1.0)}
        _compact.write(state, key, "int8", x, torch.empty(x.shape), state["step"])
    finally:
        if impl != "torch":
            _native.compact_simd(was)
    assert (state[_compact.scale_key(key)] == scale).all()
    bits = _bits(x).tolist()
    want = [[_exact_code(abs(v), signed, r) * (-1 if v < 0 else 1) for v, r in zip(row, rb)]
            for row, rb in zip(x.tolist(), bits)]
    assert state[key].tolist() == want


@pytest.mark.parametrize("signed", [True, False])
def test_int8_decoding_error_is_bounded_by_the_code_steps(signed):
    """Signed codes: within half a step of the value; unsigned ones (rounded stochastically):
    one of the two codes either side of it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 512, generator=g)
    if not signed:
        x = x.square()
    codes, scales = _compact.quantize(x, signed, None if signed else _bits(x))
    back = _compact.dequantize(codes, scales)
    blocks = scales.repeat_interleave(_compact.BLOCK, dim=1)
    y = (x.abs() / blocks)
    if signed:
        t = (y.sqrt() * 127)  # the code's real-valued position
        step = (((t + 0.5).clamp(max=127) / 127) ** 2 - (t / 127) ** 2).abs() * blocks
    else:  # the code of the level below or above y = 1.875 x / s
        levels = torch.tensor([float(v) for v in LEVELS], dtype=torch.float64)
        below = torch.searchsorted(levels, (y * 1.875).double(), right=True) - 1
        assert ((codes.long() == below) | (codes.long() == below + 1)).all()
        step = (levels[(below + 1).clamp(max=255)] - levels[below]).float() * blocks / 1.875
    assert ((back - x).abs() <= step + 1e-7).all()
    # each block's largest magnitude comes back exactly, signs are kept, zeros stay zero
    for r in range(4):
        for b in range(2):
            block = x[r, b * 256:(b + 1) * 256]
            i = block.abs().argmax()
            assert back[r, b * 256 + i] == block[i]
    assert (torch.sign(back) == torch.sign(x)).all() or not signed
    zeros = torch.zeros(2, 10)
    zero_codes, zero_scales = _compact.quantize(zeros, signed, _bits(zeros))
    assert (_compact.dequantize(zero_codes, zero_scales) == 0).all()


def test_the_second_moments_codes_are_unbiased():
    """Stored over many steps (new random bits each), the second moment's codes decode to
    the value on average, where rounding to the nearest code would miss it by up to half a
    step: the values here lie a third of a step above a code, so nearest would always round
    down."""
    s = 1.0
    lo = torch.tensor([float(LEVELS[q]) for q in range(20, 255)], dtype=torch.float64)
    hi = torch.tensor([float(LEVELS[q + 1]) for q in range(20, 255)], dtype=torch.float64)
    x = torch.cat([torch.tensor([s]), (s / 1.875 * (lo + (hi - lo) / 3)).float()]).view(1, -1)
    total = torch.zeros_like(x)
    for step in range(1, 801):
        codes, scales = _compact.quantize(x, False, _bits(x, step=float(step)))
        total += _compact.dequantize(codes, scales)
    relative = (total / 800 - x) / x
    assert relative.abs().max() < 0.02  # 800 draws: within about 3 sigma
    assert relative[0, 1:].mean().abs() < 0.002
    nearest = s / 1.875 * lo
    assert ((nearest - x[0, 1:]) / x[0, 1:]).mean() < -0.004  # what rounding to nearest gives


def test_no_row_split_changes_a_block():
    """FSDP2 splits along rows, anywhere: every split quantizes like the whole tensor."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 3, 130, generator=g)  # rows of 390: blocks of 256 and 134
    whole = _compact.quantize(x, True)
    for cut in range(0, 8):
        for part in (x[:cut], x[cut:]):
            codes, scales = _compact.quantize(part, True)
            rows = slice(0, cut) if part.shape[0] == cut else slice(cut, 7)
            assert torch.equal(codes, whole[0][rows]) and torch.equal(scales, whole[1][rows])


def test_bfloat16_rounding_is_unbiased_reproducible_and_one_of_the_two_neighbours():
    x = torch.full((20000,), 1.0 + 2 ** -9)  # a quarter of the way from 1 to the next bfloat16
    index = torch.arange(x.numel())
    out = _compact.round_bf16(x, index, torch.tensor(3.0), 1)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(out.float().mean().item() - x[0].item()) < 2 ** -7 / 50
    assert torch.equal(out, _compact.round_bf16(x, index, torch.tensor(3.0), 1))
    other_step = _compact.round_bf16(x, index, torch.tensor(4.0), 1)
    assert not torch.equal(out, other_step)
    # negative values round the same way in magnitude; exact values stay
    assert torch.equal(_compact.round_bf16(-x, index, torch.tensor(3.0), 1), -out)
    exact = torch.tensor([0.0, -2.5, 3.0, float("inf")])
    assert torch.equal(_compact.round_bf16(exact, torch.arange(4), torch.tensor(1.0), 2).float(),
                       exact)


def test_a_decaying_second_moment_decays_in_bfloat16():
    """Rounded to nearest, 0.999 v is v again: the second moment would never decay."""
    model = torch.nn.Linear(128, 64, bias=False)
    opt = scaleopt.AdamW(model.parameters(), lr=0.0, weight_decay=0.0, state_dtype="bfloat16")
    model.weight.grad = torch.ones_like(model.weight)
    opt.step()
    model.weight.grad = torch.zeros_like(model.weight)
    for _ in range(700):
        opt.step()
    v = opt.state[model.weight]["exp_avg_sq"].float()
    expected = 1e-3 * 0.999 ** 700  # ~ half of its first value
    assert abs(v.mean().item() / expected - 1) < 0.02


# -- which tensors, how many bytes --------------------------------------------------------------


def _stepped(cls, form, shapes=((512, 384), (384,), (8, 8)), **kw):
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    opt = cls(params, lr=1e-3, state_dtype=form, **kw)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    opt.step()
    return params, opt


def _state_bytes(opt, p):
    return sum(v.numel() * v.element_size() for k, v in opt.state[p].items() if k != "step")


def test_the_forms_by_size_and_dimension_and_the_bytes_they_hold():
    params, opt = _stepped(scaleopt.LAMB, "int8")
    big, bias, small = params
    assert opt.state[big]["exp_avg"].dtype == torch.int8
    assert opt.state[big]["exp_avg_sq"].dtype == torch.uint8
    assert opt.state[big]["exp_avg_scale"].shape == (512, 2)
    assert _state_bytes(opt, big) / big.numel() == pytest.approx(2 + 2 * 4 * 2 / 384)
    for p in (bias, small):  # one dimension, or fewer than MIN_NUMEL elements: float32
        assert opt.state[p]["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in opt.state[p]
    params, opt = _stepped(scaleopt.LAMB, "bfloat16", shapes=((64, 64), (8192,), (8, 8)))
    assert [opt.state[p]["exp_avg"].dtype for p in params] == [
        torch.bfloat16, torch.bfloat16, torch.float32]
    assert _state_bytes(opt, params[0]) == 4 * params[0].numel()


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS, scaleopt.AdamW,
                                 scaleopt.OffloadAdam])
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_every_optimizer_stores_its_moments_compactly_and_trains(cls, form):
    def train(state_dtype):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                    torch.nn.Linear(128, 4))
        opt = cls(model.parameters(), lr=3e-3, state_dtype=state_dtype)
        x, y = torch.randn(256, 64), torch.randint(0, 4, (256,))
        for _ in range(60):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        return loss.item(), opt.state[model[0].weight]

    reference, _ = train("float32")
    loss, state = train(form)
    assert state["exp_avg"].dtype == {"bfloat16": torch.bfloat16, "int8": torch.int8}[form]
    assert loss == pytest.approx(reference, rel=0.1, abs=0.02)


# -- every implementation ------------------------------------------------------------------------


def _impls():
    out = ["single", "multi"]
    if _native.available():
        out.append("native")
    return out


def three_steps(cls, implementation, form, rows, cols=300):
    """Three steps of ``cls`` on a (rows, cols) weight and a bias, the same gradients each time
    (by default blocks of 256 and 44 in each row)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, cols) * 0.1),
              torch.nn.Parameter(torch.randn(rows) * 0.1)]
    opt = cls(params, lr=1e-2, weight_decay=0.01, implementation=implementation,
              state_dtype=form)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_every_implementation_stores_the_same_state(cls, form):
    results = {}
    for impl in _impls():
        params, opt = three_steps(cls, impl, form, 96)
        results[impl] = [p.detach().clone() for p in params], [
            _compact.read(opt.state[params[0]], k, torch.float32)
            for k in ("exp_avg", "exp_avg_sq")]
    ref_w, ref_m = results["single"]
    for impl, (w, m) in results.items():
        for a, b in zip(w, ref_w):  # a moment that rounds the other way moves its weight
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5, msg=impl)  # by ~1e-5
            assert ((a - b).abs() > 1e-6).float().mean() < 0.01, impl
        for a, b in zip(m, ref_m):  # a value on a rounding boundary may store either way
            assert ((a - b).abs() > 1e-6 + 0.02 * b.abs()).float().mean() < 1e-3, impl


# -- checkpoints ----------------------------------------------------------------------------------


def _run(cls, form, steps, opt_state=None, weights=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 128), torch.nn.Tanh(), torch.nn.Linear(128, 3))
    if weights is not None:
        model.load_state_dict(weights)
    opt = cls(model.parameters(), lr=1e-2, state_dtype=form, **kw)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    start = 0 if opt_state is None else int(opt.state[model[0].weight]["step"])

    def loss(t):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(32, 48, generator=g), torch.randint(0, 3, (32,), generator=g)
        return torch.nn.functional.cross_entropy(model(x), y)

    on_loss(opt, range(start, start + steps), loss)
    return model, opt


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS, scaleopt.AdamW,
                                 scaleopt.OffloadAdam])
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_a_resumed_run_continues_bit_for_bit_from_a_weights_only_checkpoint(cls, form):
    whole, _ = _run(cls, form, 6)
    model, opt = _run(cls, form, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    saved = opt.state_dict()["state"][0]
    assert saved["exp_avg"].dtype == {"int8": torch.int8, "bfloat16": torch.bfloat16}[form]
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed, opt2 = _run(cls, form, 3, ckpt["opt"], ckpt["model"])
    assert opt2.state[resumed[0].weight]["exp_avg"].dtype == saved["exp_avg"].dtype
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)
    # the checkpoint holds the state as it is stored: (2 or 4)/8 of float32 state for the
    # 6144-element weight, float32 for the 515 others
    _, opt32 = _run(cls, "float32", 3)
    assert _saved_size(opt) < _saved_size(opt32) * (0.4 if form == "int8" else 0.6)


def _saved_size(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return len(buf.getvalue())


@pytest.mark.parametrize("source, target", [("float32", "int8"), ("int8", "float32"),
                                            ("bfloat16", "int8"), ("int8", "bfloat16")])
def test_loading_another_form_converts_with_a_message(source, target):
    model, opt = _run(scaleopt.LAMB, source, 3)
    before = _compact.read(opt.state[model[0].weight], "exp_avg_sq", torch.float32)
    _, fresh = _run(scaleopt.LAMB, target, 0)
    with pytest.warns(UserWarning, match="converted"):
        fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["state_dtype"] == target  # the optimizer's own choice stays
    st = fresh.state[fresh.param_groups[0]["params"][0]]
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}[target]
    assert st["exp_avg_sq"].dtype == want and ("exp_avg_sq_scale" in st) == (target == "int8")
    after = _compact.read(st, "exp_avg_sq", torch.float32)
    # within a step of the codes (stochastic): an eighth of the value at most
    torch.testing.assert_close(after, before, rtol=0.126, atol=1e-9)
    with warnings.catch_warnings():  # the same form: no message
        warnings.simplefilter("error")
        _, same = _run(scaleopt.LAMB, source, 0)
        same.load_state_dict(opt.state_dict())


def test_a_group_that_changes_its_state_dtype_converts_at_the_next_step():
    model, opt = _run(scaleopt.AdamW, "float32", 2)
    opt.param_groups[0]["state_dtype"] = "int8"
    model(torch.randn(2, 48)).sum().backward()
    opt.step()
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.int8


# -- bad input ------------------------------------------------------------------------------------


def test_an_unknown_state_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="state_dtype.*'int4'"):
        scaleopt.LAMB(torch.nn.Linear(4, 4).parameters(), state_dtype="int4")


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.AdamW])
def test_compact_state_of_parameters_updated_in_low_precision_is_refused(cls):
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="state_dtype='int8'.*bfloat16 parameter"):
        cls(model.named_parameters(), state_dtype="int8")
    scaleopt.LAMB(model.parameters(), state_dtype="int8", master_weights=True)  # masters: fine


def _int8_checkpoint():
    model, opt = _run(scaleopt.LAMB, "int8", 2)
    return model, opt, opt.state_dict()


@pytest.mark.parametrize("damage, match", [
    (lambda st: st.update(exp_avg=st["exp_avg"][:, :10].contiguous()), "codes of shape"),
    (lambda st: st.update(exp_avg_scale=st["exp_avg_scale"][:5]), "float32 scales of shape"),
    (lambda st: st.update(exp_avg_scale=-st["exp_avg_scale"]), "negative or non-finite"),
    (lambda st: st.update(exp_avg_sq=st["exp_avg_sq"].to(torch.int8)), "torch.uint8 codes"),
    (lambda st: st.pop("exp_avg_scale"), "float32 scales"),
    (lambda st: st.update(exp_avg=st["exp_avg"].float()), "scales without the int8 codes"),
])
def test_codes_and_scales_that_do_not_fit_are_refused_and_change_nothing(damage, match):
    model, opt, sd = _int8_checkpoint()
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    sd["state"][0] = dict(sd["state"][0])
    damage(sd["state"][0])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state[model[0].weight]
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.skipif(not _native.available(), reason="the C kernels are not built")
@pytest.mark.parametrize("shape", [(3, 300), (5, 7, 40), (0, 300), (64, 512)])
def test_the_c_kernels_store_exactly_what_the_torch_reference_stores(shape, monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 4
    stored = {}
    for lib in (_native._lib, None):  # the kernels, then the PyTorch reference
        monkeypatch.setattr(_native, "_lib", lib)
        got = stored[lib is None] = {}
        for key, value in (("exp_avg", x), ("exp_avg_sq", x.square())):
            for form in ("int8", "bfloat16"):
                state = {"step": torch.tensor(9.0)}
                template = torch.empty(shape)
                _compact.write(state, key, form, value, template, state["step"])
                got[key, form] = dict(state), _compact.read(state, key, torch.float32)
    for k, (state, back) in stored[False].items():
        ref_state, ref_back = stored[True][k]
        assert all(torch.equal(v, ref_state[name]) for name, v in state.items()), k
        assert torch.equal(back, ref_back), k


# -- the C kernels update compact moments in place ------------------------------------------------

_FUSED_CASES = {
    "LAMB": (scaleopt.LAMB, {}, torch.float32),
    "LAMB decoupled": (scaleopt.LAMB, {"weight_decay_mode": "decoupled"}, torch.float32),
    "LAMB l2, clipped": (scaleopt.LAMB, {"weight_decay_mode": "l2", "clip_grad_value": 0.5},
                         torch.float32),
    "LAMB bf16 split masters": (scaleopt.LAMB, {"master_weights": True}, torch.bfloat16),
    "LANS": (scaleopt.LANS, {}, torch.float32),
    "LANS clipped, moved": (scaleopt.LANS, {"clip_grad_value": 0.5, "decay_moved_weight": True},
                            torch.float32),
    "LANS bf16 split masters": (scaleopt.LANS, {"master_weights": True}, torch.bfloat16),
    "OffloadAdam": (scaleopt.OffloadAdam, {}, torch.float32),
    "OffloadAdam nesterov, L2": (scaleopt.OffloadAdam, {"nesterov": True, "decoupled": False},
                                 torch.float32),
    "OffloadAdam bf16 split": (scaleopt.OffloadAdam, {}, torch.bfloat16),
    "AdamW": (scaleopt.AdamW, {}, torch.float32),
}


def _four_steps(case, form):
    """The weights (masters) and moments after four steps, and how far each weight moved
    (its steps' sizes added)."""
    cls, kw, dtype = _FUSED_CASES[case]
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(40, 300) * 0.1).to(dtype)),
              torch.nn.Parameter((torch.randn(40) * 0.1).to(dtype))]
    opt = cls(params, lr=1e-2, weight_decay=0.01, state_dtype=form, **kw)

    def weights():
        return [(opt.master(p) if hasattr(opt, "master") else p).detach().float().clone()
                for p in params]

    g = torch.Generator().manual_seed(5)
    moved = [torch.zeros(p.shape) for p in params]
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        before = weights()
        opt.step()
        for total, a, b in zip(moved, weights(), before):
            total += (a - b).abs()
    return (weights(), [_compact.read(opt.state[params[0]], k, torch.float32)
                        for k in ("exp_avg", "exp_avg_sq")], moved)


@pytest.fixture(params=LANES)
def lanes(request):
    """The C kernels run their compact loops as named (restored after the test)."""
    if not _native.available():
        pytest.skip("the C kernels are not built")
    was = _native.compact_simd()
    if _native.compact_simd(request.param == "avx512") != (request.param == "avx512"):
        pytest.skip("this CPU has no AVX-512")
    yield request.param
    _native.compact_simd(was)


@pytest.mark.parametrize("form", ["bfloat16", "int8"])
@pytest.mark.parametrize("case", list(_FUSED_CASES))
def test_the_c_kernels_update_compact_moments_in_place_as_on_float32_copies(case, form, lanes,
                                                                           monkeypatch):
    """On the CPU the kernels read and write bfloat16 or int8 moments block by block inside
    the update, with no float32 copy of a moment; the numbers are those of the update run on
    float32 copies of the moments (decoded, updated, stored back): to float rounding in the
    portable loops, and within 2^-13 of each step's size in the AVX-512 ones (their square
    roots and divisions are 14-bit estimates)."""
    def no_copies(*args, **kwargs):
        raise AssertionError("a float32 copy of a compact moment was made")

    with monkeypatch.context() as patch:
        patch.setattr(_compact, "working", no_copies)
        fused_w, fused_m, _ = _four_steps(case, form)
    with monkeypatch.context() as patch:  # the kernels refuse stored moments: decoded copies
        moments_apply = _native._moments_apply
        patch.setattr(_native, "_moments_apply",
                      lambda m, v, stored: stored is None and moments_apply(m, v, stored))
        copies_w, copies_m, moved = _four_steps(case, form)
    for a, b, steps in zip(fused_w, copies_w, moved):
        if lanes == "portable":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=case)
        else:  # the estimates' error, plus float rounding of the weights
            bound = 2.0 ** -12 * steps + 2.0 ** -22 * b.abs() + 1e-9
            assert ((a - b).abs() <= bound).all(), (case, ((a - b).abs() / bound).max())
    for a, b in zip(fused_m, copies_m):  # a value on a rounding boundary may store either way
        assert ((a - b).abs() > 1e-6 + 0.02 * b.abs()).float().mean() < 1e-3, case


@pytest.mark.parametrize("form", ["bfloat16", "int8"])
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_layerwise_steps_keep_updates_between_passes_without_changing_a_bit(cls, form, lanes,
                                                                            monkeypatch):
    """The AVX-512 loops keep the last updates of each tensor from LAMB's and LANS's first pass
    to the second (a buffer of 2^21 floats: LAMB's u, LANS's r and 1/(sqrt(v^) + eps)) instead
    of computing them again; sharded tensors, whose passes run apart, compute them again. Both
    give the same bits, for a tensor longer than the buffer and for one shorter."""
    def run(whole):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(2100, 1000) * 0.1),
                  torch.nn.Parameter(torch.randn(300, 70) * 0.1)]
        opt = cls(params, lr=1e-2, weight_decay=0.01, state_dtype=form)
        g = torch.Generator().manual_seed(5)
        with monkeypatch.context() as patch:
            if not whole:  # the sharded tensors' calls: each pass over all tensors
                real = _native.LayerwiseKernel.apply
                patch.setattr(_native.LayerwiseKernel, "apply", lambda kernel, totals: real(
                    kernel, kernel.first_pass() if totals is None else totals))
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
        return [p.detach() for p in params] + [
            v for p in params for v in opt.state[p].values() if torch.is_tensor(v)]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
