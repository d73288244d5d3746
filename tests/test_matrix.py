"""Generic behaviour every optimizer owes its users, driven by tests/helpers/registry.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import scaleopt
from registry import REGISTRY, set_foreach

FAST = [i for i in REGISTRY if i.has_foreach]

#: whether torch.compile takes a changed float (a learning rate) as an input of the graph: from
#: torch 2.13 on; torch 2.11's compiler makes it a constant, and recompiles (same numbers)
RATES_ARE_INPUTS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


def make_model(seed: int = 0, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3)).to(dtype)


def batch(t: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(16, 5, generator=g).to(dtype), torch.randn(16, 3, generator=g).to(dtype)


def loss_of(model: nn.Module, t: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = batch(t, dtype)
    return (model(x) - y).square().mean()


def train(model, opt, steps: int, start: int = 0, step_fn=None) -> None:
    step_fn = step_fn or opt.step
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, t).backward()
        step_fn()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def fresh(info, seed: int = 0, dtype=torch.float32):
    model = make_model(seed, dtype)
    return model, info.make(list(model.named_parameters()))


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_it_trains(info):
    model, opt = fresh(info)
    before = loss_of(model, 0).item()
    for _ in range(30):
        opt.zero_grad()
        loss_of(model, 0).backward()
        opt.step()
    after = loss_of(model, 0).item()
    if opt.defaults.get("maximize"):
        assert after > before, (before, after)
    else:
        assert after < before, (before, after)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_state_dict_resume_is_bit_identical(info):
    m1, o1 = fresh(info)
    train(m1, o1, 3)
    sd = roundtrip(o1.state_dict())  # weights_only=True
    m2 = copy.deepcopy(m1)
    o2 = info.make(list(m2.named_parameters()))
    o2.load_state_dict(sd)
    train(m1, o1, 4, start=3)
    train(m2, o2, 4, start=3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        for k, v in o1.state[p1].items():
            assert torch.equal(v, o2.state[p2][k]), k


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_state_dict_shows_every_option(info):
    _, opt = fresh(info)
    sd = roundtrip(opt.state_dict())
    for group in sd["param_groups"]:
        assert set(opt.defaults) <= set(group)
        assert group["param_names"]


@pytest.mark.parametrize("src, dst", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_state_dict_survives_a_change_of_dtype(info, src, dst):
    m1, o1 = fresh(info, dtype=src)
    train(m1, o1, 3)
    m2 = copy.deepcopy(m1).to(dst)
    o2 = info.make(list(m2.named_parameters()))
    o2.load_state_dict(roundtrip(o1.state_dict()))
    for p in m2.parameters():
        for k, v in o2.state[p].items():
            if k != "step" and torch.is_tensor(v):
                assert v.dtype == dst, k
    train(m1, o1, 3, start=3)
    train(m2, o2, 3, start=3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b.to(src), a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_zero_grad(info):
    model, opt = fresh(info)
    loss_of(model, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_closure_is_called_once_and_its_loss_returned(info):
    model, opt = fresh(info)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    before = params_of(model)
    loss = opt.step(closure)
    assert len(calls) == 1 and torch.is_tensor(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_step_hooks_run_once_per_step(info):
    model, opt = fresh(info)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    train(model, opt, 2)
    assert seen == ["pre", "post", "pre", "post"]


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_lr_scheduler_drives_the_step(info):
    model, opt = fresh(info)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    before = params_of(model)
    train(model, opt, 2)
    sched.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_one_cycle_lr(info):
    model, opt = fresh(info)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=10)
    key = "betas" if "betas" in opt.defaults else "momentum"
    first = (opt.param_groups[0]["lr"], opt.param_groups[0][key])
    for t in range(5):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        sched.step()
    now = (opt.param_groups[0]["lr"], opt.param_groups[0][key])
    assert now[0] != first[0] and now[1] != first[1]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_add_param_group(info):
    model, opt = fresh(info)
    extra = nn.Parameter(torch.randn(4, 3))
    opt.add_param_group({"params": [extra], "param_names": ["extra.weight"], "lr": 0.05})
    group = opt.param_groups[-1]
    assert group["lr"] == 0.05 and set(opt.defaults) <= set(group)
    before = extra.detach().clone()
    extra.grad = torch.randn(4, 3)
    opt.step()
    assert not torch.equal(before, extra)
    with pytest.raises(ValueError, match="more than one"):
        opt.add_param_group({"params": [extra], "param_names": ["again"]})


def _variants_slow(infos):
    """Each optimizer's plain entry in the default run, its variants and front-ends (the ids
    with an option or a framework's name) in the slow one."""
    return [pytest.param(i, id=str(i), marks=[pytest.mark.slow] if set(str(i)) & set("-.(") else [])
            for i in infos]


@pytest.mark.parametrize("info", _variants_slow(REGISTRY))
def test_compiled_step_matches_eager(info):
    torch._dynamo.reset()
    m1, o1 = fresh(info)
    m2, o2 = fresh(info)
    train(m1, o1, 3)
    train(m2, o2, 3, step_fn=torch.compile(o2.step, backend="eager"))
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_parameter_without_gradient_is_left_alone(info):
    model = make_model()
    idle = nn.Parameter(torch.randn(3, 3))
    opt = info.make(list(model.named_parameters()) + [("idle.weight", idle)])
    before = idle.detach().clone()
    train(model, opt, 3)
    assert torch.equal(before, idle)
    assert len(opt.state[idle]) == 0


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_zero_size_tensors(info):
    torch.manual_seed(0)
    named = [
        ("a.weight", nn.Parameter(torch.randn(3, 2))),
        ("empty.weight", nn.Parameter(torch.zeros(0, 4))),
        ("empty.bias", nn.Parameter(torch.zeros(0))),
    ]
    opt = info.make(named)
    before = named[0][1].detach().clone()
    for _ in range(2):
        for _, p in named:
            p.grad = torch.randn_like(p)
        opt.step()
    assert torch.isfinite(named[0][1]).all() and not torch.equal(before, named[0][1])
    assert named[1][1].shape == (0, 4) and named[2][1].shape == (0,)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_sparse_gradient_is_a_clear_error(info):
    p = nn.Parameter(torch.randn(4, 3))
    opt = info.make([("emb.weight", p)])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("info", FAST, ids=str)
def test_fast_path_equals_reference_path(info):
    m1, fast = fresh(info)
    m2, ref = fresh(info)
    set_foreach(fast, True)
    set_foreach(ref, False)
    train(m1, fast, 6)
    train(m2, ref, 6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_non_contiguous_parameters_are_updated(info):
    base = torch.randn(6, 4)
    p = nn.Parameter(base.t())  # a transposed, non-contiguous leaf
    assert not p.is_contiguous()
    opt = info.make([("w.weight", p)])
    before = p.detach().clone()
    p.grad = torch.randn(4, 6).t().contiguous().t()
    opt.step()
    assert not torch.equal(before, p)


# Tensor -> Python conversions: on a CUDA tensor each of these waits for the device.
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


def record_host_reads(monkeypatch, allowed=()):
    """Until ``monkeypatch.undo()``, every host read of a tensor value (``HOST_READS``) but of
    the tensors in ``allowed`` goes into the list returned."""
    allowed_ids = {id(t) for t in allowed}
    reads = []

    def guarded(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if id(self) not in allowed_ids:
                reads.append(f"Tensor.{name} on a {tuple(self.shape)} tensor")
            return original(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, guarded(name))
    return reads


@pytest.mark.parametrize("info", [i for i in FAST if not i.host_step], ids=str)
def test_device_path_reads_no_tensor_value_on_the_host(info, monkeypatch):
    """The path GPUs take (foreach) reads no value back but the step counters, which live on
    the CPU as in torch.optim: a proxy on CPU, run by CI, for the CUDA sync test in test_cuda.py.
    """
    model, opt = fresh(info)
    set_foreach(opt, True)
    train(model, opt, 1)  # state allocated
    steps = [s["step"] for s in opt.state.values() if "step" in s]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    reads = record_host_reads(monkeypatch, allowed=steps)
    for name in ("nonzero", "masked_select", "argwhere", "unique"):
        monkeypatch.setattr(torch, name, lambda *a, _n=name, **k: reads.append(f"torch.{_n}"))
    before = params_of(model)
    opt.step()
    opt.step()
    monkeypatch.undo()
    assert reads == []
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("info", _variants_slow(i for i in REGISTRY if not i.host_step))
def test_compiled_step_does_not_recompile_as_the_step_and_lr_change(info):
    """``torch.compile(opt.step)`` under an LR schedule: after the first steps (state
    allocation, the learning rate turning from a constant into an input), no step recompiles:
    neither the step counters nor the changing rates are constants of the graph; and the
    compiled steps compute what the eager ones do. Multi-tensor paths run as on a GPU
    (``foreach=True``; on the CPU the kernels are outside the graph). On torch before 2.13 the
    compiler recompiles for a new rate (``RATES_ARE_INPUTS``): only the numbers are held."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model, opt = fresh(info)
        if info.has_foreach:
            set_foreach(opt, True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + t))
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step

        def steps(start, n):
            for t in range(start, start + n):
                opt.zero_grad()
                loss_of(model, t).backward()
                step()
                sched.step()

        steps(0, 3)
        with torch._dynamo.config.patch(error_on_recompile=compiled and RATES_ARE_INPUTS):
            steps(3, 4)
        runs.append(model)
    for a, b in zip(runs[0].parameters(), runs[1].parameters()):
        torch.testing.assert_close(a, b)


def _state_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _copy(opt, how):
    import pickle

    return copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_copy_steps_as_the_original(info, how):
    """``copy.deepcopy`` and pickling: the copy (with copies of the parameters) has the same
    state dict and steps exactly as the original."""
    model, opt = fresh(info)
    train(model, opt, 2)
    twin = _copy(opt, how)
    assert _state_equal(twin.state_dict(), opt.state_dict())
    mine = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(mine, theirs))
    for t in (2, 3):
        for p, q in zip(mine, theirs):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(t + p.numel()))
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    assert _state_equal(twin.state_dict(), opt.state_dict())


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_state_dict_is_equal_to_itself_after_a_round_trip(info):
    model, opt = fresh(info)
    train(model, opt, 2)
    sd = opt.state_dict()
    _, other = fresh(info)
    other.load_state_dict(roundtrip(sd))
    assert _state_equal(other.state_dict(), sd)
    assert _state_equal(copy.deepcopy(opt).state_dict(), sd)
    assert other.param_groups[0].keys() == opt.param_groups[0].keys()


@pytest.mark.parametrize("step", [int, float])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_checkpoint_with_numbers_as_steps_resumes(info, step):
    """torch.optim before 1.12 and many ports saved ``state["step"]`` as a number."""
    model, opt = fresh(info)
    train(model, opt, 2)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        if "step" in st:
            st["step"] = step(st["step"].item() if torch.is_tensor(st["step"]) else st["step"])
    twin_model, twin = fresh(info)
    twin_model.load_state_dict(model.state_dict())
    twin.load_state_dict(sd)
    train(model, opt, 2, start=2)
    train(twin_model, twin, 2, start=2)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)


TENSOR_LR = {
    "LAMB": lambda ps, lr: scaleopt.LAMB(ps, lr=lr, weight_decay=0.1),
    "LAMB(foreach=False)": lambda ps, lr: scaleopt.LAMB(ps, lr=lr, foreach=False),
    "LANS": lambda ps, lr: scaleopt.LANS(ps, lr=lr),
    "AdamW": lambda ps, lr: scaleopt.AdamW(ps, lr=lr),
    "AdamW(foreach=True)": lambda ps, lr: scaleopt.AdamW(ps, lr=lr, foreach=True),
    "AdamW(foreach=False)": lambda ps, lr: scaleopt.AdamW(ps, lr=lr, foreach=False),
    "Momentum": lambda ps, lr: scaleopt.Momentum(ps, lr=lr, momentum=0.9),
    "OffloadAdam": lambda ps, lr: scaleopt.OffloadAdam(ps, lr=lr),
    "offload(LAMB)": lambda ps, lr: scaleopt.offload(scaleopt.LAMB, ps, lr=lr),
}


@pytest.mark.parametrize("name", TENSOR_LR)
def test_a_tensor_learning_rate_steps_as_the_number(name):
    """``lr=torch.tensor(...)``, as torch.optim takes it, also under an LR scheduler."""
    runs = []
    for lr in (1e-2, torch.tensor(1e-2)):
        model = make_model()
        opt = TENSOR_LR[name](list(model.named_parameters()), lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for t in range(3):
            train(model, opt, 1, start=t)
            sched.step()
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) == isinstance(lr, torch.Tensor)
        runs.append(params_of(model))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_tensor_learning_rate_must_hold_one_real_value():
    with pytest.raises(ValueError, match="one real floating-point value"):
        scaleopt.LAMB(make_model().parameters(), lr=torch.tensor([1e-2, 1e-3]))
    with pytest.raises(ValueError, match="Invalid lr"):
        scaleopt.LAMB(make_model().parameters(), lr=torch.tensor(-1.0))


def _views():
    """(name, the parameter's storage, the parameter): views with gaps, with a storage offset,
    transposed, and a channels_last tensor."""
    w = torch.randn(4, 6)
    yield "gaps", w, nn.Parameter(w[:, :3])
    w = torch.randn(30)
    yield "offset", w, nn.Parameter(w[5:17].view(3, 4))
    w = torch.randn(5, 3)
    yield "transposed", w, nn.Parameter(w.t())
    w = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    yield "channels_last", w, nn.Parameter(w)


@pytest.mark.parametrize("layout", ["gaps", "offset", "transposed", "channels_last"])
@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_view_parameter_updates_exactly_its_elements(info, layout):
    """The update of a parameter that is a view lands on its elements, as on a contiguous copy,
    and nothing else of the storage it views changes."""
    torch.manual_seed(0)
    _, storage, p = next(v for v in _views() if v[0] == layout)
    twin = nn.Parameter(p.detach().clone().contiguous())
    before, outside = p.detach().clone(), storage.detach().clone()
    viewed = torch.zeros_like(storage, dtype=torch.bool)  # the storage's elements p views
    if layout == "gaps":
        viewed[:, :3] = True
    elif layout == "offset":
        viewed[5:17] = True
    else:
        viewed[...] = True
    opts = [info.make([("w.weight", q)]) for q in (p, twin)]
    for t in range(3):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(t))
        for q, opt in zip((p, twin), opts):
            q.grad = g.clone()
            opt.step()
    assert not torch.equal(p.detach(), before)
    torch.testing.assert_close(p.detach(), twin.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(storage[~viewed], outside[~viewed])


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_step_without_gradients_changes_nothing(info):
    model, opt = fresh(info)
    before = params_of(model)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(len(opt.state[p]) == 0 for p in model.parameters())


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_printing_shows_the_class_and_every_group(info):
    model, opt = fresh(info)
    text = repr(opt)
    assert text.startswith(type(opt).__name__) and "Parameter Group 0" in text
    for key in opt.param_groups[0]:
        if key not in ("params", "param_names"):
            assert f"    {key}: " in text, key


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_a_tensor_learning_rate_in_the_groups_steps_as_the_number(info):
    """Every optimizer and front-end: a group's ``lr`` set to a tensor (as a scheduler or a
    compiled loop may) steps as the number."""
    runs = []
    for as_tensor in (False, True):
        model, opt = fresh(info)
        if as_tensor:
            for g in opt.param_groups:
                g["lr"] = torch.tensor(float(g["lr"]))
        train(model, opt, 3)
        runs.append(params_of(model))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
