"""Muon on one device: torch.optim.Muon's numbers, AdamW for the rest of a model in the same
optimizer, its checks, state and compact momentum."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _orthogonal
from steps import on_gradients

SHAPES = [(24, 40), (40, 24), (32, 32)]  # wide, tall (iterated transposed), square

OPTIONS = [
    dict(),
    dict(nesterov=False),
    dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.3, momentum=0.9),
    dict(adjust_lr_fn="original", ns_steps=3, eps=1e-3, weight_decay=0.0),
    dict(ns_coefficients=(2.0, -1.5, 0.5), ns_steps=7, momentum=0.0),
]


def _matrices(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, t):
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _run(opt, params, steps, first=0):
    on_gradients(opt, params, range(first, first + steps), lambda t: _grads(params, t))


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_matrices_take_torch_muons_bits(options):
    """The same operations as torch.optim.Muon: bit-equal weights after 6 steps, every option."""
    ours, theirs = _matrices(), _matrices()
    _run(scaleopt.Muon(ours, lr=0.02, **options), ours, 6)
    _run(torch.optim.Muon(theirs, lr=0.02, **options), theirs, 6)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_bfloat16_matrices_and_a_tensor_learning_rate_take_torch_muons_bits():
    ours, theirs = _matrices(torch.bfloat16), _matrices(torch.bfloat16)
    _run(scaleopt.Muon(ours, lr=torch.tensor(0.02)), ours, 4)
    _run(torch.optim.Muon(theirs, lr=torch.tensor(0.02)), theirs, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_bfloat16_plain_momentum_keeps_its_momentum():
    """Without Nesterov the matrix iterated is the momentum itself; the iteration works on a
    copy, so the momentum stays the running mean of the gradients. (torch.optim.Muon
    normalizes a bfloat16 momentum in place there: its norm is 1 after every step.)"""
    params = _matrices(torch.bfloat16)
    opt = scaleopt.Muon(params, lr=0.02, nesterov=False, momentum=0.9)
    want = [torch.zeros_like(p) for p in params]
    for t in range(3):
        for b, g in zip(want, _grads(params, t)):
            b.lerp_(g, 0.1)
        _run(opt, params, 1, first=t)
    for p, b in zip(params, want):
        assert torch.equal(opt.state[p]["momentum_buffer"], b)
        assert abs(b.float().norm().item() - 1.0) > 0.1


@pytest.mark.parametrize("first", ["torch", "scaleopt"])
def test_state_dicts_move_between_torch_muon_and_this_one(first):
    """Three steps by one, its state dict loaded into the other, three more by both: the
    weights of the run that changed optimizer equal those of the one that did not."""
    ours, theirs = _matrices(), _matrices()
    make = {"torch": lambda ps: torch.optim.Muon(ps, lr=0.02),
            "scaleopt": lambda ps: scaleopt.Muon(ps, lr=0.02)}
    second = "scaleopt" if first == "torch" else "torch"
    reference = make[first](theirs)
    _run(reference, theirs, 3)
    with torch.no_grad():
        for a, b in zip(ours, theirs):
            a.copy_(b)
    opt = make[second](ours)
    opt.load_state_dict(copy.deepcopy(reference.state_dict()))  # as a checkpoint is
    _run(opt, ours, 3, first=3)
    _run(reference, theirs, 3, first=3)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    if second == "scaleopt":
        assert opt.param_groups[0]["algorithm"] == "muon"


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.conv = nn.Conv1d(8, 8, 1)  # 3-D: a stack by default, AdamW's with nd_params

    def forward(self, tokens):
        x = self.norm(torch.relu(self.hidden(self.embed(tokens))))
        return self.head(x + self.conv(x.transpose(1, 2)).transpose(1, 2))


def _tokens(t):
    return torch.randint(0, 10, (4, 6), generator=torch.Generator().manual_seed(t))


def _train_model(model, opt, steps):
    for t in range(steps):
        opt.zero_grad()
        model(_tokens(t)).square().mean().backward()
        opt.step()


def test_a_model_is_split_into_matrices_and_the_rest_and_each_part_is_what_its_optimizer_does():
    model = _Model()
    opt = scaleopt.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3, weight_decay=0.05,
                        betas=(0.8, 0.9), adamw_eps=1e-6, exclude_from_muon=r"embed|head",
                        exclude_from_weight_decay=r"bias|norm", nd_params="adamw")
    groups = {g["algorithm"]: g for g in opt.param_groups}
    assert groups["muon"]["param_names"] == ["hidden.weight"]
    assert sorted(groups["adamw"]["param_names"]) == sorted(
        n for n, _ in model.named_parameters() if n != "hidden.weight")
    assert groups["muon"]["lr"] == 0.02 and groups["adamw"]["lr"] == 3e-3

    twin = _Model()
    named = dict(twin.named_parameters())
    no_decay = [p for n, p in named.items() if "bias" in n or "norm" in n]
    rest = [p for n, p in named.items() if n != "hidden.weight" and not any(
        p is q for q in no_decay)]
    muon = torch.optim.Muon([named["hidden.weight"]], lr=0.02, weight_decay=0.05)
    adamw = torch.optim.AdamW([{"params": rest}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05,
                              fused=True)  # scaleopt.AdamW's kernel on the CPU
    for t in range(4):
        for m, step in ((model, opt.step), (twin, lambda: (muon.step(), adamw.step()))):
            m.zero_grad()
            m(_tokens(t)).square().mean().backward()
            step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    assert set(opt.state[model.hidden.weight]) == {"step", "momentum_buffer"}
    assert set(opt.state[model.embed.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_groups_that_name_their_algorithm_are_kept_and_new_groups_split():
    model = _Model()
    opt = scaleopt.Muon([{"params": [model.hidden.weight, model.head.weight],
                          "algorithm": "muon"},
                         {"params": [model.embed.weight], "algorithm": "adamw", "lr": 1e-3}],
                        lr=0.02)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
    opt.add_param_group({"params": list(model.norm.parameters()) + [model.conv.weight]})
    # split in two: the Conv1d weight a stack (3-D), the norm's parameters AdamW's
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw", "muon", "adamw"]
    with pytest.raises(ValueError, match=r"algorithm='muon' takes matrices.*shape \(8,\)"):
        opt.add_param_group({"params": [model.hidden.bias], "algorithm": "muon"})


def test_an_lr_schedule_scales_both_parts():
    model = _Model()
    opt = scaleopt.Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    _train_model(model, opt, 1)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 5e-4]


@pytest.mark.parametrize("options, words", [
    (dict(lr=-1.0), "Invalid lr"),
    (dict(momentum=1.0), "Invalid momentum"),
    (dict(weight_decay=-0.1), "Invalid weight_decay"),
    (dict(ns_steps=100), "Invalid ns_steps"),
    (dict(ns_steps=2.0), "Invalid ns_steps"),
    (dict(ns_coefficients=(1.0, 2.0)), "three numbers"),
    (dict(ns_coefficients="polar"), "Invalid ns_coefficients"),
    (dict(ns_coefficients=((3.0, -4.0, 2.0), (1.0, 2.0))), "a sequence of such triples"),
    (dict(ns_coefficients=((3.0, -4.0, 2.0), (1.0, 2.0, float("nan")))), "c of step 1"),
    (dict(eps=0.0), "Invalid eps"),
    (dict(exchange_buckets=0), "Invalid exchange_buckets"),
    (dict(exchange_buckets=2.0), "Invalid exchange_buckets"),
    (dict(adjust_lr_fn="rms"), "Invalid adjust_lr_fn"),
    (dict(ns_dtype="float16"), "Invalid ns_dtype"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(adamw_lr=-1e-3), "Invalid adamw_lr"),
    (dict(state_dtype="int4"), "Invalid state_dtype"),
    (dict(nesterov=1), "nesterov must be True or False"),
    (dict(exclude_from_muon="embed"), "parameters have no names"),
])
def test_bad_arguments_are_refused_by_name(options, words):
    with pytest.raises((ValueError, TypeError), match=words):
        scaleopt.Muon(_Model().parameters(), **options)


def test_a_state_dict_of_another_grouping_is_refused_by_name():
    model = _Model()
    split = scaleopt.Muon(model.named_parameters(), lr=0.02)
    _train_model(model, split, 1)
    # the same parameters, all in AdamW: the matrix's state holds no moments
    whole = scaleopt.Muon([{"params": [p for g in split.param_groups for p in g["params"]],
                            "algorithm": "adamw"}], lr=0.02)
    sd = split.state_dict()
    sd["param_groups"] = [dict(sd["param_groups"][0], params=[
        i for g in sd["param_groups"] for i in g["params"]])]
    with pytest.raises(ValueError, match=r"lacks \['exp_avg', 'exp_avg_sq'\]"):
        whole.load_state_dict(sd)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_int8_momentum_holds_about_one_byte_per_element_and_trains_as_float32_state():
    losses, held = {}, {}
    for state_dtype in ("float32", "int8"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64))
        opt = scaleopt.Muon(model.named_parameters(), lr=0.02, state_dtype=state_dtype)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
        y = torch.sin(x)
        for _ in range(60):
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
        losses[state_dtype] = loss.item()
        st = opt.state[model[0].weight]
        held[state_dtype] = sum(st[k].numel() * st[k].element_size()
                                for k in ("momentum_buffer", "momentum_buffer_scale") if k in st)
    assert held["int8"] / model[0].weight.numel() <= 1.1  # codes and a scale per 256
    assert held["float32"] / model[0].weight.numel() == 4
    assert abs(losses["int8"] - losses["float32"]) <= 0.02 * losses["float32"], losses


def test_the_ranks_share_the_matrices_by_cost():
    shapes = [(64, 64), (64, 256), (256, 64), (8, 8), (128, 128), (32, 512), (64, 64)]
    for ranks in (1, 2, 3, 5):
        owner = _orthogonal.owners(shapes, ranks)
        assert owner == _orthogonal.owners(list(shapes), ranks)  # the same on every rank
        load = [sum(_orthogonal.cost(s) for s, o in zip(shapes, owner) if o == r)
                for r in range(ranks)]
        # greedy, largest first: no rank exceeds another by more than one matrix's cost
        assert max(load) - min(load) <= max(map(_orthogonal.cost, shapes))
    assert sorted(_orthogonal.owners(shapes, 7)) == list(range(7))  # one each
    # a rank measured twice as slow gets about a third of the work of two
    owner = _orthogonal.owners([(64, 64)] * 30, 2, speeds=[1.0, 2.0])
    assert owner.count(0) == 20 and owner.count(1) == 10


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (128, 128)])
def test_a_float32_iteration_is_the_float64_one_to_round_off(shape):
    """ns_dtype="float32": the iteration's error against float64 is float32 round-off grown by
    its five steps (each multiplies small errors by at most about a = 3.4: 3.4^5 x 2^-24 x
    |X|, under 1e-5 here), where bfloat16's is a few 1e-3; and the optimizer takes it."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    run = {dtype: _orthogonal.newton_schulz(g.to(dtype), _orthogonal.NS_COEFFICIENTS, 5, 1e-7,
                                            dtype).double()
           for dtype in (torch.float32, torch.float64, torch.bfloat16)}
    assert (run[torch.float32] - run[torch.float64]).abs().max() < 1e-5
    assert (run[torch.bfloat16] - run[torch.float64]).abs().max() > 1e-3
    params = [nn.Parameter(torch.zeros(shape))]
    params[0].grad = g
    opt = scaleopt.Muon(params, lr=1.0, weight_decay=0.0, momentum=0.0, ns_dtype="float32")
    opt.step()
    torch.testing.assert_close(-params[0].detach().double(), run[torch.float64] * _orthogonal.
                               adjusted_lr(1.0, None, shape), rtol=0, atol=2e-5)


def test_newton_schulz_drives_singular_values_towards_one():
    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(_orthogonal.newton_schulz(g, _orthogonal.NS_COEFFICIENTS, 5,
                                                       1e-7).float())
    assert s.min() > 0.5 and s.max() < 1.3, s  # Keller Jordan's (0.5, 1.5) band
    assert math.isclose(_orthogonal.adjusted_lr(0.1, None, (48, 12)), 0.2)
    assert math.isclose(_orthogonal.adjusted_lr(0.1, "match_rms_adamw", (48, 12)),
                        0.02 * math.sqrt(48))


# -- the polar factor's iterations ---------------------------------------------------------------


def _composed(coefficients, x):
    """The iteration's polynomials applied in turn to singular values x (float64)."""
    for a, b, c in coefficients:
        x = a * x + b * x ** 3 + c * x ** 5
    return x


def _with_spectrum(rows, cols, singular_values, seed=0):
    """A matrix of the given singular values and random singular vectors (float64)."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64, generator=gen))
    k = len(singular_values)
    return (u[:, :k] * singular_values) @ v[:, :k].T


def test_each_polar_express_step_is_the_quintic_nearest_to_one_on_its_interval():
    """Remez's exchange: on [l, u] the error of the quintic it finds equioscillates at four
    points (l, two inner extrema, u) with one magnitude and alternating signs, nowhere on a
    fine grid is the error larger, and no quintic nearby has a smaller largest error."""
    for low, high in [(1e-3, 1.0), (0.1, 1.0), (0.5, 1.5), (0.9, 1.1)]:
        a, b, c = _orthogonal._optimal_quintic(low, high)
        grid = torch.linspace(low, high, 200001, dtype=torch.float64)
        error = _composed([(a, b, c)], grid) - 1
        worst = error.abs().max().item()
        inner = ((-3 * b + torch.tensor([-1.0, 1.0], dtype=torch.float64)
                  * math.sqrt(9 * b * b - 20 * a * c)) / (10 * c)).sqrt()
        points = torch.tensor([low, inner[0].item(), inner[1].item(), high], dtype=torch.float64)
        at = _composed([(a, b, c)], points) - 1
        assert torch.allclose(at.abs(), torch.full((4,), worst, dtype=torch.float64),
                              rtol=1e-9, atol=0), (low, high, at, worst)
        assert (at[:-1] * at[1:] < 0).all(), at  # alternating signs
        for k in range(3):  # no quintic nearby does better on the interval
            for nudge in (-1e-4, 1e-4):
                other = [a, b, c]
                other[k] += nudge
                assert (_composed([other], grid) - 1).abs().max().item() > worst


@pytest.mark.parametrize("steps", [3, 5, 6, 8])
def test_polar_express_maps_every_singular_value_from_its_floor_up_nearer_to_one(steps):
    """Composed in float64, Polar Express's polynomials keep every singular value in
    [1e-3, 1] (its design range after the normalization) within its computed bound of 1, and
    the bound shrinks with steps (0.134 after 5); torch's fixed quintic leaves the same range
    much further from 1 in as many steps (its lowest values near 1e-3 grow by a^steps only)."""
    grid = torch.logspace(-3, 0, 20001, dtype=torch.float64)
    polar = _composed(_orthogonal.polar_express(steps), grid)
    quintic = _composed([_orthogonal.NS_COEFFICIENTS] * steps, grid)
    polar_error = (polar - 1).abs().max().item()
    assert polar_error < (quintic - 1).abs().max().item()
    if steps >= 5:
        assert polar_error < 0.14 and (quintic - 1).abs().max().item() > 0.3
    if steps >= 6:  # the coefficients converge: 0.997-1.002 after 6 steps
        assert polar_error < (0.005 if steps == 6 else 1e-3)
    # the safety factor: values up to 1.01 (bfloat16 rounding of the normalization) stay bounded
    above = _composed(_orthogonal.polar_express(steps), torch.linspace(1, 1.01, 101,
                                                                        dtype=torch.float64))
    assert (above - 1).abs().max().item() < max(polar_error, 0.01) * 1.5


@pytest.mark.parametrize("case", ["random 256x160", "random 160x256", "condition 1e2",
                                  "condition 1e3"])
def test_polar_express_is_nearer_to_the_svds_polar_factor_than_the_quintic(case):
    """Against U V^T of an SVD (the exact polar factor): on random matrices and on
    ill-conditioned ones (singular values spread log-evenly over 2 and 3 decades) the float32
    iteration's singular values lie within the bound its coefficients promise for the values
    it was designed for (those at least 1e-3 after the normalization: all but the worst
    conditioned case), and in every case its update is nearer to the polar factor than the
    quintic's; bfloat16 adds its own rounding, about 1%."""
    gen = torch.Generator().manual_seed(1)
    if case.startswith("random"):
        rows, cols = map(int, case.split()[1].split("x"))
        x = torch.randn(rows, cols, dtype=torch.float64, generator=gen)
    else:
        decades = int(case[-1])
        x = _with_spectrum(192, 128, torch.logspace(0, -decades, 128, dtype=torch.float64))
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    polar_factor = u @ vh
    covered = (s / s.square().sum().sqrt()).min().item() >= 1e-3
    bound = (_composed(_orthogonal.polar_express(5),
                       torch.logspace(-3, 0, 20001, dtype=torch.float64)) - 1).abs().max().item()
    distance = {}
    for name in ("quintic", "polar_express"):
        for dtype, slack in ((torch.float32, 1e-4), (torch.bfloat16, 0.02)):
            y = _orthogonal.newton_schulz(x.float(), name, 5, 1e-7, dtype).double()
            distance[name, dtype] = ((y - polar_factor).norm() / polar_factor.norm()).item()
            if name == "polar_express" and covered:
                sv = torch.linalg.svdvals(y)
                assert (sv - 1).abs().max().item() <= bound + slack, (dtype, sv.min(), sv.max())
    assert covered == (case != "condition 1e3")
    for dtype in (torch.float32, torch.bfloat16):
        assert distance["polar_express", dtype] < 0.7 * distance["quintic", dtype], distance


def test_the_named_iterations_and_per_step_coefficients_are_one_option():
    """"quintic" is the default's numbers (the same bits); "polar_express" is its coefficients
    given step by step; a shorter sequence repeats its last triple; the optimizer takes each
    and keeps the name in its groups and state dict."""
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(2))
    run = functools.partial(_orthogonal.newton_schulz, x, steps=5, eps=1e-7)
    assert torch.equal(run(coefficients="quintic"), run(coefficients=_orthogonal.NS_COEFFICIENTS))
    assert torch.equal(run(coefficients="polar_express"),
                       run(coefficients=_orthogonal.polar_express(5)))
    assert torch.equal(run(coefficients=_orthogonal.polar_express(5)[:2]),
                       run(coefficients=_orthogonal.polar_express(5)[:2]
                           + (_orthogonal.polar_express(5)[1],) * 3))
    assert not torch.equal(run(coefficients="polar_express"), run(coefficients="quintic"))
    for coefficients in ("polar_express", [list(c) for c in _orthogonal.polar_express(5)]):
        p = nn.Parameter(torch.zeros(40, 24))
        p.grad = x.clone()
        opt = scaleopt.Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0,
                            ns_coefficients=coefficients)
        opt.step()
        want = run(coefficients="polar_express").float() * _orthogonal.adjusted_lr(1.0, None,
                                                                                   (40, 24))
        assert torch.equal(-p.detach(), want)
        loaded = scaleopt.Muon([nn.Parameter(torch.zeros(40, 24))], lr=1.0)
        loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert loaded.param_groups[0]["ns_coefficients"] == opt.param_groups[0]["ns_coefficients"]


@pytest.mark.parametrize("sizes,buckets,want", [
    ([10, 10, 10, 10], 2, [[0, 1], [2, 3]]),
    ([10, 10, 10, 10], 4, [[0], [1], [2], [3]]),
    ([10, 10], 4, [[0], [1]]),
    ([30, 1, 1, 1], 2, [[0], [1, 2, 3]]),
    ([1, 1, 1, 30], 2, [[0, 1, 2, 3]]),
    ([5, 5, 5], 1, [[0, 1, 2]]),
    ([], 3, []),
])
def test_exchange_runs_cut_the_matrices_in_order_by_size(sizes, buckets, want):
    """The runs of a bucketed exchange: consecutive matrices, a run closed once it holds its
    share of the elements, never more runs than asked, none empty."""
    assert _orthogonal.buckets_of(sizes, buckets) == want


@pytest.mark.parametrize("chunk", [1 << 16, 64])  # (a split master joined a few rows at a time)
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_bfloat16_matrices_with_master_weights_take_the_float32_updates_bits(state_dtype,
                                                                             nesterov, chunk,
                                                                             monkeypatch):
    monkeypatch.setattr(scaleopt.muon, "SPLIT_CHUNK", chunk)
    start = _matrices(torch.bfloat16)
    p16 = [nn.Parameter(p.detach().clone()) for p in start]
    p32 = [nn.Parameter(p.detach().float()) for p in start]
    o16 = scaleopt.Muon(p16, lr=0.02, master_weights=True, state_dtype=state_dtype,
                        nesterov=nesterov)
    o32 = scaleopt.Muon(p32, lr=0.02, state_dtype=state_dtype, nesterov=nesterov)
    for t in range(4):
        for p16_, p32_, g in zip(p16, p32, _grads(p16, t)):
            p16_.grad, p32_.grad = g, g.float()
        o16.step()
        o32.step()
    for a, b in zip(p16, p32):
        assert torch.equal(o16.master(a), b.detach())  # the float32 master is the float32 run
        assert torch.equal(a.detach(), _round_nearest_ties_away(b.detach()))
        assert "master_lo" in o16.state[a]  # split: 2 bytes per element beside the parameter


def _round_nearest_ties_away(x):
    """float32 to bfloat16 as a split master's upper half holds it."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    top = ((bits + 0x8000) >> 16) & 0xFFFF
    return (top - (top >= 2 ** 15).to(torch.int64) * 2 ** 16).to(torch.int16).view(torch.bfloat16)


def test_muon_master_weights_resume_exactly_from_a_float32_state_dict():
    params = _matrices(torch.bfloat16)
    opt = scaleopt.Muon(params, lr=0.02, master_weights=True, state_dtype="int8")
    _run(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    assert all(st["master_param"].dtype == torch.float32 for st in sd["state"].values())
    again = [nn.Parameter(p.detach().clone()) for p in params]
    resumed = scaleopt.Muon(again, lr=0.02, master_weights=True, state_dtype="int8")
    resumed.load_state_dict(sd)
    _run(opt, params, 2, first=2)
    _run(resumed, again, 2, first=2)
    for a, b in zip(params, again):
        assert torch.equal(a, b) and torch.equal(opt.master(a), resumed.master(b))


def test_int8_momentum_of_bfloat16_matrices_needs_master_weights():
    with pytest.raises(ValueError, match="master_weights=True"):
        scaleopt.Muon(_matrices(torch.bfloat16), state_dtype="int8")


def test_a_step_makes_one_matrixs_update_at_a_time(monkeypatch):
    """The step's transients are one matrix's: each update is applied before the next one's
    iteration starts (what bounds the step's peak memory, docs/memory.md)."""
    params = _matrices()
    opt = scaleopt.Muon(params, lr=0.02)
    events = []
    iterate = _orthogonal.newton_schulz_
    monkeypatch.setattr(scaleopt.muon, "newton_schulz_",
                        lambda y, *a: events.append(("iterate", tuple(y.shape))) or iterate(y, *a))
    moved = scaleopt.muon._move
    monkeypatch.setattr(scaleopt.muon, "_move",
                        lambda w, *a: events.append(("move", tuple(w.shape))) or moved(w, *a))
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    assert [e[0] for e in events] == ["iterate", "move"] * len(params)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_muon_is_muon_with_master_weights_bit_for_bit(dtype, state_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 8)).to(dtype)
    other = copy.deepcopy(model)
    options = dict(lr=0.02, adamw_lr=1e-3, state_dtype=state_dtype)
    here = scaleopt.Muon(model.named_parameters(), master_weights=True, **options)
    host = scaleopt.offload(scaleopt.Muon, other.named_parameters(), **options)
    assert host.host is not None and all(g["master_weights"] for g in host.param_groups)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(16, 32, generator=g).to(dtype)
        for m, o in ((model, here), (other, host)):
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    # its checkpoint is the on-device optimizer's, and back
    back = scaleopt.Muon(copy.deepcopy(other).named_parameters(), master_weights=True, **options)
    back.load_state_dict(copy.deepcopy(host.state_dict()))
    for a, b in zip(here.state.values(), back.state.values()):
        assert a.keys() == b.keys()


# -- parameters of more than two dimensions -----------------------------------------------------

STACKS = [((8, 64, 96), "stack"), ((8, 96, 64), "stack"), ((4, 3, 128, 128), "stack"),
          ((6, 4, 3, 3), "flatten"), ((64, 2, 3, 3), "flatten")]


@pytest.mark.parametrize("shape, reading", STACKS, ids=str)
@pytest.mark.parametrize("options", OPTIONS[:3], ids=str)
def test_stacks_and_flattened_parameters_take_torch_muons_bits_matrix_by_matrix(shape, reading,
                                                                               options):
    """A stack is each of its matrices under torch.optim.Muon (each with its own learning-rate
    adjustment); a flattened parameter is torch.optim.Muon on its [rows, rest] matrix: bit for
    bit, wide and tall."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = [nn.Parameter(w.clone())]
    as2d = ((lambda x: list(x.reshape(-1, *shape[-2:]))) if reading == "stack"
            else (lambda x: [x.reshape(shape[0], -1)]))
    theirs = [nn.Parameter(m.clone()) for m in as2d(w)]

    def grads(t):
        return torch.randn(shape, generator=torch.Generator().manual_seed(100 + t))

    on_gradients(scaleopt.Muon(ours, lr=0.02, nd_params=reading, **options), ours, range(3),
                 lambda t: [grads(t)])
    on_gradients(torch.optim.Muon(theirs, lr=0.02, **options), theirs, range(3),
                 lambda t: as2d(grads(t)))
    assert all(torch.equal(a, b) for a, b in zip(as2d(ours[0].detach()), theirs))


@pytest.mark.parametrize("shape, reading", [((0, 8, 8), "stack"), ((2, 0, 8), "stack"),
                                            ((0, 4, 3, 3), "flatten")])
def test_empty_stacks_and_flattened_parameters_step_and_keep_their_shape(shape, reading):
    p = nn.Parameter(torch.zeros(shape))
    opt = scaleopt.Muon([p], lr=0.02, nd_params=reading)
    p.grad = torch.zeros(shape)
    opt.step()
    assert p.shape == shape and opt.state[p]["momentum_buffer"].shape == shape


def test_bfloat16_stacks_with_master_weights_are_their_matrices_with_master_weights():
    shape = (3, 96, 128)

    def run(separate):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
        ps = [nn.Parameter(m.clone()) for m in w] if separate else [nn.Parameter(w.clone())]
        grads = [torch.randn(shape, generator=torch.Generator().manual_seed(t)).bfloat16()
                 for t in range(4)]
        on_gradients(scaleopt.Muon(ps, lr=0.02, nd_params="stack", master_weights=True), ps,
                     range(4), lambda t: list(grads[t]) if separate else [grads[t]])
        return torch.stack([p.detach() for p in ps]) if separate else ps[0].detach()

    assert torch.equal(run(False), run(True))


class _Experts(nn.Module):
    """A mixture of 4 experts, each a two-layer MLP, their weights stacked as torchtitan's
    GroupedExperts keeps them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(32, 4)
        self.w1 = nn.Parameter(torch.randn(4, 32, 64) / 32 ** 0.5)
        self.w2 = nn.Parameter(torch.randn(4, 64, 32) / 8)

    def forward(self, x):
        gate = torch.softmax(self.router(x), -1)
        h = torch.relu(torch.einsum("nd,edh->neh", x, self.w1))
        return (gate[..., None] * torch.einsum("neh,ehd->ned", h, self.w2)).sum(1)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_a_mixture_of_experts_trains_with_its_experts_in_muon_in_every_state_dtype():
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    y = torch.sin(x)
    losses = {}
    for state_dtype in ("float32", "bfloat16", "int8"):
        model = _Experts()
        opt = scaleopt.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3,
                            nd_params="stack", state_dtype=state_dtype)
        groups = {g["algorithm"]: g["param_names"] for g in opt.param_groups}
        assert groups == {"muon": ["w1", "w2", "router.weight"], "adamw": ["router.bias"]}
        for t in range(60):
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            losses.setdefault(state_dtype, [loss.item()]).append(loss.item())
            opt.step()
        if state_dtype == "int8":  # the experts' momentum as codes, about a byte each
            st = opt.state[model.w1]
            assert st["momentum_buffer"].dtype == torch.int8
    assert losses["float32"][-1] < 0.1 * losses["float32"][0]
    for state_dtype in ("bfloat16", "int8"):
        assert abs(losses[state_dtype][-1] - losses["float32"][-1]) <= 0.02 * losses["float32"][-1]


def test_how_parameters_of_more_dimensions_are_read_is_one_option():
    model = _Model()  # its Conv1d weight is 3-D
    kept = scaleopt.Muon(model.named_parameters(), lr=0.02, nd_params="adamw")
    assert "conv.weight" in next(g for g in kept.param_groups
                                 if g["algorithm"] == "adamw")["param_names"]
    stacked = scaleopt.Muon(model.named_parameters(), lr=0.02)  # "auto": 3-D is a stack
    assert "conv.weight" in next(g for g in stacked.param_groups
                                 if g["algorithm"] == "muon")["param_names"]
    kernel = torch.nn.Parameter(torch.randn(6, 4, 3, 3))  # 4-D: flattened to [6, 36]
    want = torch.nn.Parameter(kernel.detach().clone())
    def grads(t):
        return [torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(t))]

    on_gradients(scaleopt.Muon([kernel], lr=0.02), [kernel], range(2), grads)
    on_gradients(scaleopt.Muon([want], lr=0.02, nd_params="flatten"), [want], range(2), grads)
    assert torch.equal(kernel, want)
    named = scaleopt.Muon(model.named_parameters(), lr=0.02, nd_params="flatten",
                          exclude_from_muon="conv")
    assert "conv.weight" in next(g for g in named.param_groups
                                 if g["algorithm"] == "adamw")["param_names"]
    with pytest.raises(ValueError, match="Invalid nd_params"):
        scaleopt.Muon(model.parameters(), nd_params="batched")
    with pytest.raises(ValueError, match=r"or more dimensions with nd_params.*\(8, 8, 1\)"):
        scaleopt.Muon([{"params": [model.conv.weight], "algorithm": "muon",
                        "nd_params": "adamw"}])


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_a_mixture_of_experts_offloaded_and_resumed_is_the_one_on_device(state_dtype):
    """Stacks offloaded (state and update on the host) are the on-device optimizer with master
    weights, bit for bit; and a run resumed from a state_dict is the run that went on."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    options = dict(lr=0.02, adamw_lr=1e-3, nd_params="stack", state_dtype=state_dtype)

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            (model(x) - torch.sin(x)).square().mean().backward()
            opt.step()

    here, there, later = _Experts(), _Experts(), _Experts()
    opt = scaleopt.Muon(here.named_parameters(), master_weights=True, **options)
    host = scaleopt.offload(scaleopt.Muon, there.named_parameters(), **options)
    train(here, opt, 4)
    train(there, host, 4)
    assert all(torch.equal(a, b) for a, b in zip(here.parameters(), there.parameters()))
    resumed = scaleopt.Muon(later.named_parameters(), master_weights=True, **options)
    later.load_state_dict(here.state_dict())
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(here, opt, 3)
    train(later, resumed, 3)
    assert all(torch.equal(a, b) for a, b in zip(here.parameters(), later.parameters()))
