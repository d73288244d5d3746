"""torch.optim's contract for every registry entry: param groups that carry a trainer's own keys,
``foreach``/``fused`` as torch means them, and the generic cases of PyTorch's own optimizer tests
(``TestOptimRenewed`` in PyTorch's test/test_optim.py, driven by its ``OptimizerInfo`` database).

Those generic cases and where they are held here (docs/migrating.md lists the differences):

* state-dict hooks (``test_state_dict_pre_hook``, ``..._post_hook``,
  ``test_load_state_dict_pre_hook_and_prepend``, ``test_load_state_dict_post_hook``): here;
* ``test_can_load_older_state_dict`` (groups without ``foreach``/``fused``/``maximize``),
  ``test_deepcopy_copies_all_public_attrs``, ``test_param_groups_lr``,
  ``test_param_groups_weight_decay``: here;
* step hooks, printing, ``zero_grad``, LR schedulers, a tensor ``lr``, resuming bit for bit,
  ``weights_only`` loading, numbers as ``step``, a parameter without a gradient, compiled steps,
  ``foreach`` against the loop (``test_foreach_matches_forloop``): tests/test_matrix.py;
* ``test_fused_matches_forloop``: tests/test_dispatch.py, tests/test_native.py and here;
* not applicable: complex parameters (refused with a clear error, tests/test_validation.py),
  sparse gradients (refused, test_matrix), ``differentiable=True`` (no such option).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import scaleopt
from registry import REGISTRY

#: keys trainers put in their groups: timm's layer decay, a name, torch's path flags
FOREIGN = {"lr_scale": 0.5, "layer_id": 3, "name": "block.0"}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))


def groups(model: nn.Module, **extra) -> list:
    """Two groups (the first layer; the rest), with names and ``extra`` keys in each."""
    named = list(model.named_parameters())
    return [dict(params=[p for _, p in part], param_names=[n for n, _ in part], **extra)
            for part in (named[:2], named[2:])]


def train(model: nn.Module, opt, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + t)
        x, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def quietly(make):
    """``make()`` with every warning an error (a foreign key must not warn)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return make()


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def resumed_from(info, model: nn.Module, sd) -> tuple:
    """A copy of ``model`` and a new optimizer of ``info`` for it that loaded ``sd``."""
    twin = copy.deepcopy(model)
    opt = info.make(groups(twin))
    opt.load_state_dict(sd)
    return twin, opt


def step_alike(a: tuple, b: tuple, start: int) -> bool:
    """Whether two (model, optimizer) pairs end 2 more steps with the same weights."""
    for model, opt in (a, b):
        train(model, opt, 2, start=start)
    return same_weights(a[0], b[0])


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_foreign_group_keys_are_kept_unused_and_saved(info):
    m1, m2 = make_model(), make_model()
    plain = info.make(groups(m2))
    # (Paddle's front-ends have an option of that name, its groups' learning-rate multiplier)
    foreign = {k: v for k, v in FOREIGN.items() if k not in plain.defaults}
    paths = {k: plain.defaults[k] for k in ("foreach", "fused")}  # as trainers pass them
    annotated = quietly(lambda: info.make(groups(m1, **foreign, **paths)))
    for g in annotated.param_groups:  # Muon's split groups keep them too
        assert {k: g[k] for k in foreign} == foreign
    train(m1, annotated, 3)
    train(m2, plain, 3)
    assert same_weights(m1, m2)  # the arithmetic never reads them

    sd = roundtrip(annotated.state_dict())
    assert all({k: g[k] for k in foreign} == foreign for g in sd["param_groups"])
    m3, resumed = resumed_from(info, m1, sd)  # built without them: the state dict brings them
    assert all({k: g[k] for k in foreign} == foreign for g in resumed.param_groups)
    assert step_alike((m1, annotated), (m3, resumed), start=3)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_add_param_group_keeps_foreign_keys(info):
    model = make_model()
    opt = info.make(groups(model)[:1])
    extra = nn.Parameter(torch.randn(4, 3))
    quietly(lambda: opt.add_param_group(
        {"params": [extra], "param_names": ["extra.weight"], **FOREIGN}))
    assert {k: opt.param_groups[-1][k] for k in FOREIGN} == FOREIGN
    assert opt.state_dict()["param_groups"][-1]["layer_id"] == 3


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_near_misses_warn_once_naming_the_option(info):
    model = make_model()
    opt = info.make(groups(model)[:1])
    elsewhere, owner = ("amsgrad", "AdamW") if "amsgrad" not in opt.defaults else (
        "ns_steps", "Muon")
    extra = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"'weight_decy'.*did you mean 'weight_decay'"):
        opt.add_param_group({"params": [extra[0]], "param_names": ["a"], "weight_decy": 0.1})
    with pytest.warns(UserWarning, match=f"'{elsewhere}'.*an option of .*{owner}"):
        opt.add_param_group({"params": [extra[1]], "param_names": ["b"], elsewhere: 1})
    quietly(lambda: opt.add_param_group(  # each key warned about once per optimizer
        {"params": [extra[2]], "param_names": ["c"], "weight_decy": 0.2, elsewhere: 2}))
    assert opt.param_groups[-1]["weight_decy"] == 0.2


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_foreach_and_fused_are_accepted_as_torch_means_them(info):
    model = make_model()
    single = quietly(lambda: info.make(groups(model, foreach=False, fused=False)))
    train(model, single, 2)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(g["foreach"] is False and g["fused"] is False for g in single.param_groups)
    no_kernels = isinstance(single, (scaleopt.Momentum, scaleopt.DGCMomentum)) or (
        isinstance(single, scaleopt.OffloadAdam) and single.defaults["amsgrad"])
    one_at_a_time = isinstance(single, (scaleopt.OffloadAdam, scaleopt.DGCMomentum))
    for key, refused in (("fused", no_kernels), ("foreach", one_at_a_time)):
        flags = {"foreach": None, "fused": None, key: True}
        if refused:
            with pytest.raises(ValueError, match=f"{key}=True.* (has no|cannot)"):
                info.make(groups(make_model(), **flags))
        else:
            m = make_model()
            opt = info.make(groups(m, **flags))
            train(m, opt, 2)
            assert all(torch.isfinite(p).all() for p in m.parameters())
    with pytest.raises(ValueError, match="cannot be set together"):
        info.make(groups(make_model(), foreach=True, fused=True))
    with pytest.raises(TypeError, match="fused"):
        info.make(groups(make_model(), fused="yes"))


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=lambda c: c.__name__)
def test_fused_runs_the_c_kernels_and_the_flags_pick_the_paths(cls):
    """On the CPU: ``fused=True`` is the C kernels (the default's choice), ``foreach=False``
    the per-tensor loop, ``foreach=True`` the multi-tensor ops, bit for bit."""
    if not scaleopt._native.available():
        with pytest.raises(ValueError, match="fused=True: the C kernels are not built"):
            cls(make_model().parameters(), fused=True)
        return
    for flags, implementation in ((dict(fused=True), "native"), (dict(), "native"),
                                  (dict(foreach=False), "single"),
                                  (dict(foreach=False, fused=False), "single"),
                                  (dict(fused=False), "single"), (dict(foreach=True), "multi")):
        m1, m2 = make_model(), make_model()
        o1, o2 = cls(groups(m1), lr=1e-2, **flags), cls(groups(m2), lr=1e-2,
                                                         implementation=implementation)
        train(m1, o1, 3)
        train(m2, o2, 3)
        assert same_weights(m1, m2), flags
    with pytest.raises(ValueError, match="implementation='native' and fused=True"):
        cls(make_model().parameters(), implementation="native", fused=True)


def test_adamw_foreach_false_is_torchs_loop_and_fused_its_kernel():
    for flags in (dict(foreach=False), dict(foreach=True), dict(fused=True), dict()):
        m1, m2 = make_model(), make_model()
        mine = scaleopt.AdamW(m1.parameters(), lr=1e-2, **flags)
        torchs = torch.optim.AdamW(m2.parameters(), lr=1e-2, **(flags or dict(fused=True)))
        train(m1, mine, 3)
        train(m2, torchs, 3)
        assert same_weights(m1, m2), flags


# -- PyTorch's generic cases -----------------------------------------------------------------------

@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_state_dict_hooks_may_put_any_value_in_the_state(info):
    """``test_state_dict_pre_hook`` / ``_post_hook`` and the load hooks: a hook's entry in
    ``optimizer.state`` that is not a parameter's dict passes through ``state_dict`` and
    ``load_state_dict``, as in torch."""
    model = make_model()
    opt = info.make(groups(model))
    train(model, opt, 1)
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    opt.register_state_dict_post_hook(lambda o, sd: sd.__setitem__("ran_post_hook", True))
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1 and sd["ran_post_hook"]

    other_model = copy.deepcopy(model)
    other = info.make(groups(other_model))
    order = []
    other.register_load_state_dict_pre_hook(lambda o, sd: order.append("second"))
    other.register_load_state_dict_pre_hook(lambda o, sd: order.append("first"), prepend=True)
    other.register_load_state_dict_post_hook(
        lambda o: o.state.__setitem__("loaded", True))
    other.load_state_dict(copy.deepcopy(sd))  # (torch's loader keeps the tensors it is given)
    assert order == ["first", "second"]
    assert other.state["test"] == 1 and other.state["loaded"] is True
    assert other.state_dict()["state"]["loaded"] is True
    train(model, opt, 2, start=1)
    train(other_model, other, 2, start=1)
    assert same_weights(model, other_model)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_state_dict_from_before_foreach_and_fused_loads(info):
    """``test_can_load_older_state_dict``: groups saved without the newer keys load, take the
    defaults and step as before."""
    model = make_model()
    opt = info.make(groups(model))
    train(model, opt, 2)
    sd = roundtrip(opt.state_dict())
    for g in sd["param_groups"]:
        for key in ("foreach", "fused", "maximize"):
            g.pop(key, None)
    other_model, other = resumed_from(info, model, sd)
    assert all(g["foreach"] == opt.defaults["foreach"] and g["fused"] == opt.defaults["fused"]
               for g in other.param_groups)
    assert step_alike((model, opt), (other_model, other), start=2)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_deepcopy_copies_all_public_attributes(info):
    model = make_model()
    opt = info.make(groups(model))
    train(model, opt, 1)
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    assert public == {k for k in copy.deepcopy(opt).__dict__ if not k.startswith("_")}


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_group_with_a_higher_rate_moves_further(info):
    """``test_param_groups_lr``: a group's own ``lr`` is the one its parameters step with."""
    base, faster = make_model(), make_model()
    o1 = info.make(groups(base))
    o2 = info.make(groups(faster))
    for g in o2.param_groups[:1]:
        g["lr"] = g["lr"] * 4
    train(base, o1, 1)
    train(faster, o2, 1)
    start = make_model()
    moved = [(p - q).norm() for p, q in zip(base.parameters(), start.parameters())]
    moved_fast = [(p - q).norm() for p, q in zip(faster.parameters(), start.parameters())]
    first = len(o1.param_groups[0]["params"])
    assert all(f > b for f, b in zip(moved_fast[:first], moved[:first]))


def test_muons_adamw_part_takes_the_flags_as_torchs_adamw():
    """Muon's parameters that are not matrices step on AdamW by the path the flags name."""
    for flags in (dict(foreach=False), dict(foreach=True), dict(fused=True)):
        torch.manual_seed(0)
        norms = [nn.LayerNorm(6), nn.LayerNorm(6)]
        twins = copy.deepcopy(norms)
        mine = scaleopt.Muon([p for m in norms for p in m.parameters()], lr=0.02,
                             adamw_lr=1e-2, weight_decay=0.1, **flags)
        torchs = torch.optim.AdamW([p for m in twins for p in m.parameters()], lr=1e-2,
                                   betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **flags)
        assert [g["algorithm"] for g in mine.param_groups] == ["adamw"]
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
        for opt, layers in ((mine, norms), (torchs, twins)):
            for _ in range(3):
                opt.zero_grad()
                layers[1](layers[0](x)).sin().sum().backward()
                opt.step()
        for a, b in zip(norms, twins):
            assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), flags
