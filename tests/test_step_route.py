"""What a reader follows through one step, and what a step keeps: the route of a LAMB or LANS
step stays short and straight (``tools/trace_step.py``: functions, files, no call back into the
optimizer's module, no generator resumed), and what it keeps from one step to the next is the
optimizer's own (no module of the package changes its state while optimizers step, two
optimizers share nothing, ``del opt`` frees it)."""

from __future__ import annotations

import copy
import gc
import importlib
import pkgutil
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import scaleopt
from scaleopt import _native

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
import trace_step  # noqa: E402

sys.path.remove(str(TOOLS))

needs_kernels = pytest.mark.skipif(not _native.available(), reason="kernels not built")

#: module-level objects that change while optimizers step, each process-wide by nature (the
#: comment beside each in the code says why)
PROCESS_WIDE = {
    ("scaleopt._sharding", "_SHARDING_GROUPS"),  # per mesh, as meshes are
    ("scaleopt._sharding", "_dtensor_class"),  # a class
    ("scaleopt._triton", "LAUNCHES"),  # a counter of launches, for tests and benchmarks
}


@needs_kernels
@pytest.mark.parametrize("name, most", [("LAMB", 30), ("LANS", 30)])
def test_a_step_on_the_kernels_reads_top_to_bottom(name, most):
    """One LAMB or LANS step after three warm-up steps on the C kernels: at most 30 scaleopt
    functions in at most 7 files, nothing called back in the optimizer's own module from
    another, no generator resumed (counted calls: the same on every run)."""
    r = trace_step.trace(name)
    assert r["functions"] <= most and r["files"] <= 7, r["by file"]
    assert r.get("calls back into the optimizer's module", 0) == 0
    assert r.get("generator resumes", 0) == 0


def _module_state():
    """Every module-level value of the package's modules (not the command's), by identity, and
    the sizes of containers."""
    seen = {}
    for info in pkgutil.walk_packages(scaleopt.__path__, "scaleopt."):
        if ".cli" in info.name or info.name.endswith("__main__"):
            continue
        module = sys.modules.get(info.name)
        if module is None:
            continue
        for key, value in vars(module).items():
            size = len(value) if isinstance(value, (dict, list, set)) else None
            info_of = getattr(value, "cache_info", None)
            if callable(info_of):  # an lru_cache: its entries
                size = info_of().currsize
            seen[(info.name, key)] = (id(value), size)
    return seen


def _train(opt, params, steps=2):
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


@needs_kernels
def test_no_module_keeps_state_of_a_step():
    """Steps of LAMB and LANS (C kernels and the Triton kernels under the interpreter, float32
    and int8 state, a bfloat16 split master), AdamW and Muon change no module-level object of
    the package but the process-wide ones listed here: what a step keeps is the optimizer's."""
    for name in ("scaleopt._triton_kernels",):
        importlib.import_module(name)
    made = []

    def make():
        made.clear()
        for cls in (scaleopt.LAMB, scaleopt.LANS):
            for kwargs in ({}, {"state_dtype": "int8"}, {"implementation": "triton"}):
                params = [nn.Parameter(torch.randn(70, 70)), nn.Parameter(torch.randn(7))]
                made.append((cls(params, **kwargs), params))
            params = [nn.Parameter(torch.randn(8, 8).bfloat16())]
            made.append((cls(params, master_weights=True), params))
        params = [nn.Parameter(torch.randn(8, 8))]
        made.append((scaleopt.AdamW(params), params))
        params = [nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))]
        made.append((scaleopt.Muon(params), params))

    make()  # first steps: imports and compiled kernels settle
    for opt, params in made:
        _train(opt, params, 1)
    before = _module_state()
    make()
    for opt, params in made:
        _train(opt, params)
    after = _module_state()
    changed = {k for k in after if k in before and after[k] != before[k]} - PROCESS_WIDE
    assert not changed, changed


@needs_kernels
@pytest.mark.parametrize("implementation", [None, "triton"])
def test_what_a_step_keeps_is_the_optimizers_and_goes_with_it(implementation):
    """Two optimizers over the same parameters keep their own plans (neither finds the other's),
    and deleting one frees what it kept (the kernels' tables and arrays)."""
    params = [nn.Parameter(torch.randn(30, 4)), nn.Parameter(torch.randn(4))]
    a = scaleopt.LAMB(params, implementation=implementation)
    b = scaleopt.LAMB(params, implementation=implementation)
    _train(a, params)
    _train(b, params)
    (plan_a,), (plan_b,) = a._plans.values(), b._plans.values()
    assert plan_a.tensors.cache is not plan_b.tensors.cache and plan_a.tensors.cache
    cache = plan_a.tensors.cache
    held = (cache["plan"][1].spans if implementation == "triton"  # an address table
            else cache["lamb"][1])  # the C call's array of tensors
    kept = [weakref.ref(plan_a), weakref.ref(held)]
    del a, plan_a, cache, held
    gc.collect()
    assert [r() for r in kept] == [None, None]


@needs_kernels
def test_a_kept_plan_is_made_again_when_what_it_was_made_of_changes():
    """The plan found again at the next step is made anew when a group option changes (a
    front-end's weight-decay schedule, say), a state tensor is replaced (a checkpoint loaded),
    or a gradient changes dtype; a learning rate from a schedule only changes its rates. Each
    time the step equals that of a fresh optimizer given the same state."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(30, 4)), nn.Parameter(torch.randn(4))]
    opt = scaleopt.LAMB(params, lr=1e-2)
    _train(opt, params)
    first = next(iter(opt._plans.values()))

    def step_both(change):
        change(opt)
        twin_params = [nn.Parameter(p.detach().clone()) for p in params]
        twin = scaleopt.LAMB(twin_params, lr=1e-2)
        twin.load_state_dict(copy.deepcopy(opt.state_dict()))
        grads = [torch.randn_like(p) for p in params]
        for p, q, g in zip(params, twin_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
        for p, q in zip(params, twin_params):
            assert torch.equal(p, q)
        return next(iter(opt._plans.values()))

    def set_lr(o):
        o.param_groups[0]["lr"] = 3e-3

    assert step_both(set_lr) is first  # the same plan, the new rate

    def set_wd(o):
        o.param_groups[0]["weight_decay"] = 0.1

    second = step_both(set_wd)
    assert second is not first

    def replace_moment(o):
        st = o.state[params[0]]
        st["exp_avg"] = st["exp_avg"].clone()

    assert step_both(replace_moment) is not second


def test_the_bits_tool_names_each_configuration_that_differs():
    """tools/step_bits.py's verdict: equal runs pass; one bit flipped in one tensor, or a
    configuration on one side only, is named."""
    sys.path.insert(0, str(TOOLS))
    import step_bits

    sys.path.remove(str(TOOLS))
    a = {"x": [torch.ones(3), torch.zeros(2)], "y": [torch.ones(1)]}
    b = {k: [t.clone() for t in v] for k, v in a.items()}
    assert step_bits.compare(a, b) == []
    b["x"][1] = torch.tensor([0.0, -0.0])  # -0.0: equal as a number, not bit for bit
    assert step_bits.compare(a, b) == ["x"]
    b["x"][1] = torch.zeros(2)
    b["x"][1].view(torch.int32)[1] = 1  # the smallest subnormal
    assert step_bits.compare(a, b) == ["x"]
    nan = torch.tensor([float("nan")])
    assert step_bits.compare({"z": [nan]}, {"z": [nan.clone()]}) == []  # the same NaN
    del b["y"]
    assert step_bits.compare(a, b) == ["x", "y"]
