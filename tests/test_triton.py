"""The Triton kernels (``implementation="triton"``, the GPU path) on CPU tensors under Triton's
interpreter: equal to the reference loop for every LAMB and LANS configuration of the registry,
with float32 masters of bfloat16 and float16 parameters, bfloat16 gradients, and on FSDP2
shards; two launches per step for LAMB (three for LANS), whatever the number of tensors.

Where a GPU is present the kernels compile for it instead (tests/test_cuda.py), and these
interpreter tests skip."""

from __future__ import annotations

import collections
import copy
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
if torch.cuda.is_available():
    pytest.skip("CUDA here: the Triton kernels compile for the GPU (tests/test_cuda.py)",
                allow_module_level=True)
assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets it before Triton is imported"


import scaleopt  # noqa: E402
from scaleopt import _compact, _format, _triton, _triton_launch, _triton_layout  # noqa: E402
from scaleopt import _triton_kernels as K  # noqa: E402
from scaleopt._layerwise import LayerwiseAdam  # noqa: E402
from kernel_probe import exact_codes, first_phase_sums, stored_by_the_kernels  # noqa: E402
import dgc_workers as W  # noqa: E402
import sharded_workers as S  # noqa: E402
from registry import REGISTRY  # noqa: E402
from steps import lamb_moments, on_gradients  # noqa: E402
from close import assert_within_steps  # noqa: E402
from test_matrix import fresh, loss_of, record_host_reads, train  # noqa: E402

LAYERWISE = [i for i in REGISTRY if not i.host_step
             and isinstance(fresh(i)[1], LayerwiseAdam)]


def use(opt, implementation=None, foreach=None):
    for group in opt.param_groups:
        group["implementation"], group["foreach"] = implementation, foreach
    return opt


def counter_buffers(opt):
    """The tensors that the optimizer's step counters point into (``_triton.counters``, kept
    with each group's plan): reading them on the host is reading the counters, which live on
    the CPU as in torch.optim."""
    return [plan.tensors.cache["counters"][1] for plan in opt._plans.values()
            if plan.tensors.cache and "counters" in plan.tensors.cache]


def launches_of(step):
    before = dict(_triton.LAUNCHES)
    step()
    return {k: v - before.get(k, 0) for k, v in _triton.LAUNCHES.items() if v != before.get(k, 0)}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 8 x 2 elements: most tensors span several programs, some end mid-block."""
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=16, block=8))


def test_the_registry_has_every_layerwise_configuration():
    names = {i.name for i in LAYERWISE}
    assert {"LAMB", "LAMB-decoupled-bounds", "LAMB-l2-clip-nobc", "LANS",
            "LANS-moved-bounds-clip", "mxnet.LANS", "paddle.Lamb", "keras.Lamb"} <= names


@pytest.mark.parametrize("info", LAYERWISE, ids=str)
def test_triton_equals_the_reference_loop(info):
    (m1, o1), (m2, o2) = fresh(info), fresh(info)
    use(o1, "triton")
    use(o2, foreach=False)
    per_step = []
    for t in range(4):
        for model, opt in ((m1, o1), (m2, o2)):
            opt.zero_grad()
            loss_of(model, t).backward()
        per_step.append(launches_of(o1.step))
        o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(o1.state[a][key], o2.state[b][key], rtol=1e-5, atol=1e-6)
    kind = "lans" if isinstance(o1, scaleopt.LANS) else "lamb"
    sums = {f"{kind}_sums", f"{kind}_apply", "totals"}
    for launched in per_step:  # one launch per phase for all tensors of the group, and one
        # to total the sums phase's partial sums (and the gradients' norms' where launched)
        assert set(launched) - {"sum_squares"} == sums, launched
        assert launched[f"{kind}_sums"] == launched[f"{kind}_apply"] == len(o1.param_groups)
        assert launched["totals"] == len(o1.param_groups) * (1 + ("sum_squares" in launched))


@pytest.mark.parametrize("cls, decoupled", [
    (scaleopt.LAMB, False), pytest.param(scaleopt.LAMB, True, marks=pytest.mark.slow),
    pytest.param(scaleopt.LANS, False, marks=pytest.mark.slow)])
def test_the_first_phases_sums_are_the_norms_of_the_update(cls, decoupled, monkeypatch):
    """The sums the trust ratios come from (the first phase's, totalled) are those of the
    update the step applies, computed in float64 from the weights before the step and the
    moments it stored: within 1e-6 relatively (the first phases multiply by the bias
    corrections' reciprocals, and add in their own order)."""
    got, want = first_phase_sums(cls, decoupled, "cpu", monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_launches_do_not_grow_with_the_number_of_tensors():
    for count in (2, 40):
        params = [nn.Parameter(torch.randn(7)) for _ in range(count)]
        for cls, want in ((scaleopt.LAMB, {"lamb_sums": 1, "totals": 1, "lamb_apply": 1}),
                          (scaleopt.LANS, {"sum_squares": 1, "lans_sums": 1, "totals": 2,
                                           "lans_apply": 1})):
            opt = cls(params, implementation="triton")
            for p in params:
                p.grad = torch.randn(7)
            assert launches_of(opt.step) == want


def two_layers(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 3)).to(dtype)


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
@pytest.mark.parametrize("dtype, storage", [(torch.bfloat16, "master_lo"),
                                            (torch.float16, "master_param")])
def test_low_precision_parameters_step_on_float32_masters(cls, dtype, storage):
    """bfloat16 parameters keep split masters (their lower halves in master_lo), float16 ones
    float32 copies whose rounded values the apply phase writes into the parameter."""
    (a, b) = (two_layers(dtype), two_layers(dtype))
    oa = cls(a.parameters(), lr=1e-2, master_weights=True, implementation="triton")
    ob = cls(b.parameters(), lr=1e-2, master_weights=True, foreach=False)
    g = torch.Generator().manual_seed(3)
    for t in range(4):
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in a.parameters()]
        for model, opt in ((a, oa), (b, ob)):
            for p, gr in zip(model.parameters(), grads):
                p.grad = gr.clone()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert storage in oa.state[p]
        torch.testing.assert_close(oa.master(p), ob.master(q), rtol=1e-5, atol=1e-6)
        assert torch.equal(p, oa.master(p).to(dtype))  # the parameter: its master, rounded


@pytest.mark.parametrize("functional", [scaleopt.lamb.lamb, scaleopt.lans.lans])
def test_bfloat16_gradients_of_float32_weights(functional):
    """The functional forms take bfloat16 gradients for float32 weights (masters) as they are."""
    gen = torch.Generator().manual_seed(4)
    weights = [torch.randn(n, generator=gen) for n in (30, 17)]
    outs = []
    for impl in ("triton", "single"):
        ws = [w.clone() for w in weights]
        ms, vs = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]
        steps = [torch.tensor(0.0) for _ in ws]
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            grads = [torch.randn(w.shape, generator=g).bfloat16() for w in ws]
            functional(ws, grads, ms, vs, steps, lrs=[0.01, 0.02], weight_decays=[0.1, 0.0],
                       adapt=[True, False], beta1=0.9, beta2=0.999, eps=1e-6,
                       implementation=impl)
        outs.append(ws)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tensors_and_gradients_that_allow_16_byte_vectors_launch_the_aligned_variant(
        monkeypatch):
    """A launch may load and store in 16-byte vectors (``ALIGNED``) only where every address
    it reads is a multiple of 16 bytes and every size a multiple of 16 elements: tensors that
    are not go to a launch of their own, and a step whose gradient sits at an address that is
    not launches that tensor's set without vectors."""
    launched = []
    monkeypatch.setattr(_triton, "_run", lambda name, programs, *a, **k: launched.append(
        (name, k.get("ALIGNED"))) if name != "totals" else None)
    base = torch.randn(4096 + 1)
    aligned = nn.Parameter(torch.randn(64, 64))
    shifted = nn.Parameter(base[1:].view(64, 64))  # 4 bytes past an aligned address
    odd = nn.Parameter(torch.randn(65, 70))  # 4550 elements
    params = [aligned, shifted, odd]
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 4
    opt = scaleopt.LAMB(params, lr=1e-3, implementation="triton")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    # one launch per phase for the aligned tensor, one for the two others
    assert sorted(launched) == sorted([("lamb_sums", 1), ("lamb_sums", 0), ("lamb_apply", 1),
                                       ("lamb_apply", 0)])
    launched.clear()
    aligned.grad = torch.randn(4096 + 1)[1:].view(64, 64)  # a gradient 4 bytes off
    opt.step()
    assert sorted(launched) == sorted([("lamb_sums", 0), ("lamb_sums", 0), ("lamb_apply", 0),
                                       ("lamb_apply", 0)])
    launched.clear()
    aligned.grad = torch.randn(64, 64)
    opt.step()
    assert ("lamb_apply", 1) in launched and ("lamb_sums", 1) in launched


def test_the_address_tables_are_built_once_per_set_of_storages(monkeypatch):
    """The plan (the weights', moments' and states' addresses, the chunks) is made once while
    they stay where they are; gradients in new storages at each step (as a backward that
    allocates them anew gives them) make only a table of their addresses, found again when
    they are where they were. Both are the optimizer's own: another optimizer makes its own."""
    made = collections.Counter()
    for name in ("_new_plan", "_grad_table"):
        real = getattr(_triton, name)
        monkeypatch.setattr(_triton, name, lambda *a, _real=real, _name=name: (
            made.update([_name]), _real(*a))[1])
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4))]
    opt = scaleopt.LAMB(params, implementation="triton")
    kept = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)  # a new gradient storage: a new gradient table
            kept.append(p.grad)  # (kept, so that no address is handed out again)
        opt.step()
    (cache,) = [plan.tensors.cache for plan in opt._plans.values()]
    assert made["_new_plan"] == 1 and len(cache["grad tables"]) == 3
    grads = [p.grad for p in params]
    for _ in range(3):  # the same storages: the tables are found again
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
    assert made["_new_plan"] == 1 and len(cache["grad tables"]) == 3
    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].clone()  # moved
    opt.step()
    assert made["_new_plan"] == 2
    other = scaleopt.LAMB(params, implementation="triton")
    other.step()
    assert made["_new_plan"] == 3  # its own plan, not the first optimizer's


@pytest.mark.parametrize("cls", [scaleopt.LAMB, pytest.param(scaleopt.LANS, marks=pytest.mark.slow)])
def test_a_compiled_step_launches_the_kernels_outside_the_graph(cls):
    """``torch.compile(opt.step)`` with the kernels asked for by name: the compiler does not
    trace into a launch (the kernels reach the tensors through tables of addresses), it runs
    each as a call of its own; the weights are those of the eager step."""
    torch._dynamo.reset()
    info = next(i for i in LAYERWISE if i.name == cls.__name__)
    (m1, o1), (m2, o2) = fresh(info), fresh(info)
    use(o1, "triton")
    use(o2, "triton")
    train(m1, o1, 3)
    train(m2, o2, 3, step_fn=torch.compile(o2.step, backend="eager"))
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_the_functional_form_runs_the_kernels_by_name():
    w, g = torch.randn(20), torch.randn(20)
    outs = []
    for impl in ("triton", "single"):
        p, m, v, s = w.clone(), torch.zeros(20), torch.zeros(20), torch.tensor(0.0)
        scaleopt.lamb.lamb([p], [g], [m], [v], [s], lrs=[0.1], weight_decays=[0.01],
                           adapt=[True], beta1=0.9, beta2=0.999, eps=1e-6, implementation=impl)
        outs.append(p)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_asking_for_what_cannot_run_is_a_clear_error(monkeypatch):
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="together"):
        scaleopt.LAMB([p], implementation="triton", foreach=True)
    with pytest.raises(ValueError, match="implementation"):
        scaleopt.LAMB([p], implementation="cuda")
    opt = scaleopt.LAMB([nn.Parameter(torch.randn(4, 4).t())], implementation="triton")
    opt.param_groups[0]["params"][0].grad = torch.randn(4, 4)
    with pytest.raises(ValueError, match="cannot take"):  # not contiguous
        opt.step()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    opt = scaleopt.LAMB([p], implementation="triton")
    p.grad = torch.randn(4, 4)
    with pytest.raises(ValueError, match="cannot take"):
        opt.step()


SHARDED = ["LAMB", "LAMB(bounds, always_adapt, decoupled)", "LAMB(two groups)", "LANS",
           "LANS(decay_moved_weight, bounds)", "LANS(two groups, clipping)",
           "LAMB(bf16, master_weights)", "LANS(bf16, master_weights)", "LAMB(int8 state)",
           "LANS(bfloat16 state)", "LAMB(bf16, master_weights, int8 state)"]


@pytest.mark.slow
def test_on_fsdp2_shards_the_kernels_equal_one_process(tmp_path):
    """The kernels on each rank's local shards, the sums totalled between the phases: the
    numbers of one process on the whole tensors, one collective per step (LANS: two, the
    gradients' norms first), a launch per group, phase and set of tensors of one kind (the
    compact moments of a weight, the float32 ones of the others; aligned or not)."""
    (got,) = [r for r in W.run_workers(S.train_sharded_triton, 2, tmp_path, SHARDED, 3,
                                       timeout=300) if r is not None]
    for name in SHARDED:
        weights, masters, _ = S.train_reference(name, steps=3)
        compact = "state)" in name  # a moment rounded the other way moves a weight by ~1e-5
        close = (1e-4, 5e-5) if compact else (1e-5, 1e-6)
        rtol, atol = (1e-2, 1e-2) if "bf16" in name else close
        for a, b in zip(got[name], weights):
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)
        for a, b in zip(got[name + " masters"], masters):
            torch.testing.assert_close(a, b, rtol=close[0], atol=close[1], msg=name)
            if compact:
                assert ((a - b).abs() > 1e-6).float().mean() < 0.01, name
        groups = (2 if "two groups" in name else 1) * (2 if compact else 1)
        kind = "lans" if name.startswith("LANS") else "lamb"
        launched = got[name + " launches"]
        # (a set's tensors that allow 16-byte vectors and those that do not, such as a shard
        # of 31 rows, launch apart)
        assert launched[f"{kind}_sums"] == launched[f"{kind}_apply"], (name, launched)
        assert groups <= launched[f"{kind}_sums"] <= 2 * groups, (name, launched)
        assert launched["totals"] == groups // (2 if compact else 1) * (
            1 + ("sum_squares" in launched)), (name, launched)  # one a group and sums phase
        assert got[name + " collectives"] == (2 if kind == "lans" else 1), name


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_benchmark_times_each_candidate_against_fused_adamw(dtype, capsys,
                                                                   monkeypatch):
    """``scaleopt bench --device cuda``'s code, here on CPU tensors (the Triton rows under the
    interpreter) and a tiny set: a row per candidate with its ratio, host time, bandwidth at
    the algorithm's bytes per parameter, and the table printed."""
    from scaleopt.cli import bench_gpu

    # few programs: the interpreter is slow
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=8192, block=2048))

    shapes = [("dense.weight", (32, 256)), ("dense.bias", (32,)), ("out.weight", (20, 300)),
              ("LayerNorm.weight", (300,))]  # int8 state for the matrices
    result = bench_gpu.run(shapes, "'tiny'", dtype, "cpu", rounds=1, only=["triton"])
    rows = {r["optimizer"]: r for r in result["rows"]}
    floors = {"float32": (28, 40, 26, 48, 30, 28, 16),
              "bfloat16": (14, 38, 22, 42, 24)}[dtype]
    names = ["torch.AdamW(fused=True)", "scaleopt.LAMB(triton)",
             "scaleopt.LAMB(triton, int8 state)", "scaleopt.LANS(triton)",
             "scaleopt.LANS(triton, int8 state)"]
    if dtype == "float32":  # AdamW on the Triton kernel takes float32 parameters
        names += ["scaleopt.AdamW(triton)", "scaleopt.AdamW(triton, int8 state)"]
    assert sorted(rows) == sorted(names)
    assert [rows[k]["bytes_per_param"] for k in names] == list(floors)
    for r in rows.values():
        assert r["ratio"] > 0 and r["host_s"] > 0 and r["gb_per_s"] > 0
    for kind in ("LAMB", "LANS") + (("AdamW",) if dtype == "float32" else ()):
        # int8 moments hold a quarter of the bytes, and more
        full, small = (rows[f"scaleopt.{kind}(triton{x})"]["state_bytes_per_param"]
                       for x in ("", ", int8 state"))
        assert small < full - 4
    assert result["params"] == sum(torch.Size(s).numel() for _, s in shapes)
    out = capsys.readouterr().out
    assert "x fused AdamW" in out and "scaleopt.LANS(triton)" in out


@pytest.mark.parametrize("info", LAYERWISE, ids=str)
def test_the_triton_path_reads_no_tensor_value_on_the_host(info, monkeypatch):
    """Around its launches, the Triton path reads nothing back from the device but the step
    counters (CPU scalars, as in torch.optim), clipping included: the kernels' launches are
    recorded instead of run (under the interpreter they read their tensors on the host)."""
    model, opt = fresh(info)
    use(opt, "triton")
    train(model, opt, 1)  # state allocated
    steps = [s["step"] for s in opt.state.values() if "step" in s]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    launched = []
    monkeypatch.setattr(_triton, "_run", lambda name, *a, **k: launched.append(name))
    reads = record_host_reads(monkeypatch, allowed=steps + counter_buffers(opt))
    opt.step()
    monkeypatch.undo()
    assert reads == [] and launched


@pytest.mark.parametrize("cls", [scaleopt.LAMB, pytest.param(scaleopt.LANS, marks=pytest.mark.slow)])
def test_capturable_reads_the_steps_and_a_tensor_lr_where_they_are(cls, monkeypatch):
    """capturable=True: the step counters stay with the parameters and the learning rate may
    be a tensor that a scheduler changes in place; the numbers are the reference loop's with a
    float rate, and the step's host code reads no tensor value at all (step counters
    included): what a CUDA graph needs."""
    (a, b) = (two_layers(torch.float32), two_layers(torch.float32))
    oa = cls(a.parameters(), lr=torch.tensor(0.02), implementation="triton", capturable=True)
    ob = cls(b.parameters(), lr=0.02, foreach=False)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1.0 + t)) for o in (oa, ob)]
    g = torch.Generator().manual_seed(6)
    for t in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in a.parameters()]
        for model, opt, sched in ((a, oa, scheds[0]), (b, ob, scheds[1])):
            for p, gr in zip(model.parameters(), grads):
                p.grad = gr.clone()
            opt.step()
            sched.step()
    assert torch.is_tensor(oa.param_groups[0]["lr"])
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert oa.state[p]["step"].device == p.device and float(oa.state[p]["step"]) == 4
    monkeypatch.setattr(_triton, "_run", lambda *x, **k: None)
    reads = record_host_reads(monkeypatch)  # the step counters included
    oa.step()
    monkeypatch.undo()
    assert reads == []


@pytest.mark.parametrize("form", ["bfloat16", pytest.param("int8", marks=pytest.mark.slow)])
def test_capturable_steps_store_compact_moments_as_steps_with_host_numbers(form, monkeypatch):
    """With capturable=True the step counters are read on the device, bfloat16 rounding's key
    included: the stored moments are those of steps whose numbers the host made, bit for
    bit."""
    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)
    # few programs: the interpreter is slow
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=256, block=128))
    runs = []
    for capturable in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(40, 20)
        opt = scaleopt.LAMB(model.parameters(), lr=0.02, implementation="triton",
                            capturable=capturable, state_dtype=form)
        g = torch.Generator().manual_seed(7)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        state = opt.state[model.weight]
        assert state["exp_avg"].dtype == (torch.int8 if form == "int8" else torch.bfloat16)
        runs.append((model.weight.detach(), [v for v in state.values() if v.dim()]))
    (w1, s1), (w2, s2) = runs
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)
    assert len(s1) == len(s2) and all(torch.equal(a, b) for a, b in zip(s1, s2))


def test_capturable_needs_the_triton_kernels():
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="Triton"):
        scaleopt.LAMB([p], capturable=True, implementation="native")
    opt = scaleopt.LAMB([p], capturable=True)  # on the CPU the C kernels would run
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match="capturable=True needs the Triton kernels"):
        opt.step()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in
@pytest.mark.parametrize("capturable", [False, pytest.param(True, marks=pytest.mark.slow)])  # the
# interpreter's masked-off lanes
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_a_gradscaler_hands_the_kernels_its_scale_and_inf_flag(cls, capturable):
    """With a GradScaler, the kernels unscale the gradients as they read them (the scale stays
    a tensor) and a step with an inf changes nothing, its step counters included (decided on
    the device with capturable=True); the numbers are those of unscaled gradients."""
    (a, b) = (two_layers(torch.float32), two_layers(torch.float32))
    oa = cls(a.parameters(), lr=1e-2, implementation="triton", capturable=capturable,
             max_grad_norm=0.5)
    ob = cls(b.parameters(), lr=1e-2, foreach=False, max_grad_norm=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x = torch.randn(8, 9)
    for t in range(3):
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
        scaler.scale(a(x + t).square().mean()).backward()
        b(x + t).square().mean().backward()
        scaler.step(oa)
        scaler.update()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    before = [p.detach().clone() for p in a.parameters()]
    state = copy.deepcopy(oa.state_dict()["state"])
    oa.zero_grad()
    scaler.scale(a(x).square().mean()).backward()
    a[0].weight.grad[0, 0] = float("inf")
    scaler.step(oa)
    scaler.update()
    assert scaler.get_scale() < 2.0 ** 8
    for p, q in zip(before, a.parameters()):
        assert torch.equal(p, q)
    for k, st in oa.state_dict()["state"].items():
        for key, value in st.items():
            assert torch.equal(value, state[k][key]), key


def test_a_capturable_step_takes_the_scale_and_skips_without_host_reads(monkeypatch):
    p = nn.Parameter(torch.randn(6, 5))
    opt = scaleopt.LAMB([p], implementation="triton", capturable=True, max_grad_norm=1.0)
    p.grad = torch.randn(6, 5)
    opt.step()
    opt.grad_scale, opt.found_inf = torch.tensor(128.0), torch.tensor([1.0])  # as GradScaler
    monkeypatch.setattr(_triton, "_run", lambda *x, **k: None)
    reads = record_host_reads(monkeypatch)
    opt.step()
    monkeypatch.undo()
    assert reads == []


@pytest.mark.parametrize("chunk", [(128, 2), (1024, 1)], ids=["one-block-tiles", "four-block-tiles"])
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_compact_state_on_the_kernels_equals_the_loop_and_reads_nothing_back(cls, form, chunk,
                                                                            monkeypatch):
    """Moments in bfloat16 or 8 bits updated in place by the Triton kernels (no float32 copy
    of a moment): the loop's numbers, a launch per phase for each form in the group (the
    int8 or bfloat16 weight, the float32 bias), and no value read back but the step
    counters. int8 tiles of one block of 256, and of four (a tile's blocks from two rows, the
    last ones past the tensor's end)."""
    from scaleopt import _compact, _native

    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)  # small tensors: the interpreter is slow
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=chunk[0] * chunk[1],
                                                                  block=chunk[0]))
    from test_state_dtype import three_steps

    params, loop = three_steps(cls, "single", form, 3)
    want = [p.detach().clone() for p in params]
    with monkeypatch.context() as patch:
        patch.setattr(_compact, "working", _no_copies)
        launches = _triton.LAUNCHES.copy()
        params, opt = three_steps(cls, "triton", form, 3)
        counted = _triton.LAUNCHES - launches
    kind = "lans" if cls is scaleopt.LANS else "lamb"
    assert counted[f"{kind}_sums"] == counted[f"{kind}_apply"] == 2 * 3  # two forms, 3 steps
    for a, b in zip(params, want):  # a moment rounded the other way moves its weight by ~1e-5
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
        assert ((a - b).abs() > 1e-6).float().mean() < 0.01
    for key in ("exp_avg", "exp_avg_sq"):  # a value on a rounding boundary may store either way
        x, y = (_compact.read(o.state[o.param_groups[0]["params"][0]], key, torch.float32)
                for o in (opt, loop))
        assert ((x - y).abs() > 1e-6 + 0.02 * y.abs()).float().mean() < 1e-3
    assert opt.state[params[0]]["exp_avg"].dtype == (
        torch.int8 if form == "int8" else torch.bfloat16)
    steps = [s["step"] for s in opt.state.values()]
    monkeypatch.setattr(_triton, "_run", lambda name, *a, **k: None)
    reads = record_host_reads(monkeypatch, allowed=steps + counter_buffers(opt))
    opt.step()
    assert reads == []


def _variants_launched(monkeypatch):
    """A set that each launch, run as before, adds its (kernel, ``FORM``, ``ALIGNED``) to."""
    launched, run = set(), _triton._run

    def recorded(name, *args, **kwargs):
        launched.add((name, kwargs.get("FORM"), kwargs.get("ALIGNED")))
        return run(name, *args, **kwargs)
    monkeypatch.setattr(_triton, "_run", recorded)
    return launched


@pytest.mark.parametrize("cls", [scaleopt.LAMB, pytest.param(scaleopt.LANS, marks=pytest.mark.slow)])
def test_int8_rows_of_16_byte_vectors_and_of_whole_blocks_step_as_the_loop(cls, monkeypatch):
    """int8 moments of rows whose lengths are multiples of 16 (80: one short block a row) and
    of 256 (512: the kernels place whole blocks without dividing, and sum each block inside a
    warp): the launches take those variants (``ALIGNED`` 1 and 2), and the steps give the
    loop's numbers, as rows that end mid-block do."""
    from scaleopt import _compact, _native
    from test_state_dtype import three_steps

    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=1024, block=512))
    kind = "lans" if cls is scaleopt.LANS else "lamb"
    for cols, want in ((80, 1), (512, _triton_layout.WHOLE_BLOCKS)):
        with monkeypatch.context() as patch:
            launched = _variants_launched(patch)
            params, opt = three_steps(cls, "triton", "int8", 5, cols)
        loop_params, loop = three_steps(cls, "single", "int8", 5, cols)
        int8 = _format.MOMENT_FORMS["int8"]
        assert {(n, a) for n, f, a in launched if f == int8} == {
            (f"{kind}_sums", want), (f"{kind}_apply", want)} | (
            {("sum_squares", want)} if kind == "lans" else set())
        for a, b in zip(params, loop_params):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
            assert ((a - b).abs() > 1e-6).float().mean() < 0.01
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = (_compact.read(o.state[o.param_groups[0]["params"][0]], key, torch.float32)
                    for o in (opt, loop))
            assert ((x - y).abs() > 1e-6 + 0.02 * y.abs()).float().mean() < 1e-3


def _no_copies(*args, **kwargs):
    raise AssertionError("a float32 copy of a compact moment was made")


# -- the stored forms, exactly as the reference stores them ----------------------------------


@pytest.mark.parametrize("row_len, aligned", [(16, 1), (80, 1), (384, 1), (576, 1), (1152, 1),
                                              (4112, 1), (70, 0), (300, 0), (256, 2),
                                              (512, 2), (768, 2)])
@pytest.mark.parametrize("qb", [1, 2, 4, 8])
def test_the_kernels_place_each_tiles_int8_blocks_in_their_rows(row_len, aligned, qb):
    """A program's tiles, one after another from any block: block B of the tensor lies in row
    B // per_row from column (B % per_row) * 256, is 256 elements long or what is left of its
    row, and is masked out where its row is past the tensor's end (each variant: rows of 16,
    other rows, whole blocks; tiles of 1 to 8 blocks; rows of 1 to 17 blocks, so that a tile
    further on adds rows, columns, or both with a carry)."""
    from kernel_probe import placed_by_the_kernels

    rows, iters = 7, 4
    per_row = -(-row_len // 256)
    for start in sorted({0, 1, per_row - 1, per_row, 2 * per_row + 1, 3 * qb + 2}):
        offs, mask, blocks, bmask = placed_by_the_kernels(rows, row_len, start, qb, iters,
                                                          aligned)
        for lane in range(iters * qb):
            b = start + lane
            r, c = divmod(b, per_row)
            assert int(blocks[lane]) == b and bool(bmask[lane]) == (r < rows)
            length = min(256, row_len - c * 256) if r < rows else 0
            assert mask[lane].tolist() == [k < length for k in range(256)], (start, lane)
            want = torch.arange(length) + r * row_len + c * 256
            assert torch.equal(offs[lane, :length], want), (start, lane)


@pytest.mark.parametrize("shape, aligned", [((5, 300), 0), ((3, 7, 40), 0), ((6, 100), 0),
                                            ((1, 1000), 0), ((4, 304), 1), ((3, 7, 48), 1),
                                            ((6, 512), 2), ((5, 256), 2)])
@pytest.mark.parametrize("qb", [1, 4])
def test_the_kernels_store_and_read_int8_codes_as_the_reference(shape, aligned, qb):
    """Blocks of 256 within rows (shorter at a row's end, several rows per tile; rows of
    whole blocks, which the kernels place without dividing): the codes and scales of
    ``_compact.quantize`` (the second moment's rounded with the bits of each element's index
    in the whole tensor and the step), and read back as ``_compact.dequantize``, bit for bit,
    by the variant the launcher picks for the rows' lengths (``ALIGNED``: 0, 16-byte vectors,
    whole blocks)."""
    from test_state_dtype import _bits

    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) ** 4
    assert _triton._aligned([x.data_ptr()], math.prod(shape[1:]), int8=True) == aligned
    offset = 11 * math.prod(shape[1:])  # a piece from row 11 of the whole tensor on
    got = stored_by_the_kernels("int8", x, x.square(), offset=offset, qb=qb)
    for key, value in (("exp_avg", x), ("exp_avg_sq", x.square())):
        bits = None if key == "exp_avg" else _bits(value, step=7.0, offset=offset)
        codes, scales = _compact.quantize(value, key == "exp_avg", bits)
        stored, stored_scales, back = got[key]
        assert torch.equal(stored, codes) and torch.equal(stored_scales, scales), key
        assert torch.equal(back, _compact.dequantize(codes, scales)), key


@pytest.mark.parametrize("signed", [True, False])
def test_the_kernels_codes_are_those_of_exact_arithmetic(signed):
    """Values on and a float rounding or two either side of every boundary between two codes,
    and of where the random bits decide: the codes of exact arithmetic, as in every other
    implementation."""
    from test_state_dtype import _boundary_rows

    x, scale = _boundary_rows(signed)
    x = torch.cat([x, -x]) if signed else x
    key = "exp_avg" if signed else "exp_avg_sq"
    codes, scales, _ = stored_by_the_kernels("int8", x, x.abs(), step=1.0)[key]
    assert (scales == scale).all()
    assert codes.tolist() == exact_codes(x, signed)


def test_a_nan_moment_stores_code_0_and_its_block_keeps_the_others_scale():
    """As the C kernels: a NaN moment's code is 0, and its block's scale is the largest of its
    other values, whose codes are those of the block without the NaN."""
    from scaleopt import _native

    x = torch.linspace(-1, 2, 300).repeat(2, 1)
    clean = x.clone()
    x[0, 10] = float("nan")
    without = stored_by_the_kernels("int8", clean, clean.abs(), step=1.0)
    for key, (codes, scales, _) in stored_by_the_kernels("int8", x, x.abs(), step=1.0).items():
        assert codes[0, 10] == 0 and torch.equal(scales, without[key][1]), key
        others = torch.ones(x.shape, dtype=torch.bool)
        others[0, 10] = False
        assert torch.equal(codes[others], without[key][0][others]), key
        if _native.available():
            state = {"step": torch.tensor(1.0)}
            _compact.write(state, key, "int8", x if key == "exp_avg" else x.abs(),
                           torch.empty(x.shape), state["step"])
            assert torch.equal(state[key], codes), key
            assert torch.equal(state[_compact.scale_key(key)], scales), key


@pytest.mark.parametrize("offset", [0, 4099])
def test_the_kernels_round_bfloat16_as_the_reference(offset):
    """Stochastic rounding with the bits of each element's index in the whole tensor (the
    local piece's offset plus its own), the step and the moment: the reference's bits."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 130, generator=g)
    got = stored_by_the_kernels("bfloat16", x, x.square(), step=12.0, offset=offset)
    index = torch.arange(x.numel()).view(x.shape) + offset
    for key, value, salt in (("exp_avg", x, 1), ("exp_avg_sq", x.square(), 2)):
        stored, _, back = got[key]
        assert torch.equal(stored, _compact.round_bf16(value, index, torch.tensor(12.0), salt))
        assert torch.equal(back, stored.float())
    again = stored_by_the_kernels("bfloat16", x, x.square(), step=13.0, offset=offset)
    assert not torch.equal(again["exp_avg"][0], got["exp_avg"][0])  # a new step, new bits


TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _compile(tmp_path_factory, *args):
    """tools/triton_compile.py's rows for ``args``, compiled in a process without the
    interpreter."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    out = tmp_path_factory.mktemp("compiled") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # a cache of its own: a kernel cached by another checkout carries that checkout's source
    # path in its line info, where the "# estimate:" marks are looked up
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    done = subprocess.run([sys.executable, str(TOOLS / "triton_compile.py"), "--json", str(out),
                           "-j", "2", *args], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The suite's cover (sm_90: each kernel and form in four variants that give each kind and
    option each value, and the heaviest; sm_80: the heaviest)."""
    return _compile(tmp_path_factory)


RULES = ("fma", "unrounded", "atomics", "approx")


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_heaviest_variant_of_each_kernel_compiles_for_sm90_by_the_rules(tmp_path_factory):
    """The quick part of the cover: the heaviest variant of each kernel in each state form (a
    split master, float16 gradients, every option on) compiles for sm_90 with no spill and
    breaks none of the numerical rules (the whole cover: the slow run)."""
    rows = _compile(tmp_path_factory, "90", "--heaviest")
    kernels = {"sum_squares", "lamb_sums", "lamb_apply", "lans_sums", "lans_apply", "adam_apply"}
    assert [r for r in rows if "error" in r] == []
    assert {(r["kernel"], r["constexprs"].get("FORM")) for r in rows} == (
        {(k, f) for k in kernels for f in (0, 1, 2)} | {("totals", None)})
    assert all(r["arch"] == "sm_90" and r["constexprs"].get("W_SPLIT", 1) == 1 for r in rows)
    assert all(r["spills"] == 0 and 0 < r["registers"] <= 255 for r in rows)
    for rule in RULES:
        assert [(r["kernel"], r["constexprs"]) for r in rows if r[rule]] == [], rule
    _within_budget_and_in_vectors(rows)


def _within_budget_and_in_vectors(rows):
    """Every variant within its instruction budget (or the count its kernel is held at while
    it is not yet within it); where a launch's tensors are aligned, every byte of the float32
    and bfloat16 forms' streams read by 128-bit loads and written by 128-bit stores."""
    rows = [r for r in rows if r["kernel"] != "totals"]
    assert [(r["kernel"], r["arch"], r["constexprs"], r["per_element"], r["limit"])
            for r in rows if r["per_element"] > r["limit"]] == []
    aligned = [r for r in rows if r["constexprs"]["ALIGNED"] and r["constexprs"]["FORM"] != 2]
    assert aligned
    for r in aligned:
        assert r["vectors"] == pytest.approx(r["moved"]), (r["kernel"], r["constexprs"])


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(compiled):
    """Triton's compiler, unlike its interpreter, refuses code such as a global that is not
    a constexpr; ptxas reports the registers and spills: every kernel in every form compiles
    for sm_80 and sm_90, with no byte spilled."""
    assert [r for r in compiled if "error" in r] == []
    kernels = {"sum_squares", "lamb_sums", "lamb_apply", "lans_sums", "lans_apply", "adam_apply"}
    for arch in ("sm_80", "sm_90"):
        seen = {(r["kernel"], r["constexprs"].get("FORM")) for r in compiled if r["arch"] == arch}
        assert seen >= {(k, f) for k in kernels for f in (0, 1, 2)} | {("totals", None)}, arch
    assert sum(r["arch"] == "sm_90" for r in compiled) == 6 * 3 * 5 + 3
    assert all(r["spills"] == 0 and 0 < r["registers"] <= 255 for r in compiled)
    _within_budget_and_in_vectors([r for r in compiled if r["arch"] == "sm_90"])


@pytest.mark.slow
def test_compiled_kernels_round_each_operation_once_and_use_no_float_atomics(compiled):
    """What LLVM and ptxas made of the kernels: no fused multiply-add (it would round the int8
    codes' product and their 2^-31 offset once, where the codes round each), every float
    multiplication and addition explicitly rounded (so ptxas fuses none), no float atomics
    (deterministic sums), and correctly rounded square roots and divisions but for the signed
    codes' root estimate, which an exact comparison corrects."""
    for rule in RULES:
        assert [(r["kernel"], r["arch"], r["constexprs"]) for r in compiled if r[rule]] == [], rule
    apply_int8 = [r for r in compiled if r["kernel"] == "lamb_apply" and r["constexprs"]["FORM"] == 2]
    assert all(r["ops"].get("sqrt.rn.f32") and r["ops"].get("div.rn.f32") for r in apply_int8)
    assert all(r["ops"].get("sqrt.approx.ftz.f32") for r in apply_int8)  # the marked estimate


def test_the_compile_checks_kinds_sweep_takes_every_kind_and_alignment():
    """``tools/triton_compile.py --kinds --form int8``: every kind of tensors (12) in each of
    the cover's sets of options and each ``ALIGNED`` (none, vectors, whole blocks) for every
    kernel, only in the form asked for; the other forms take whole blocks as vectors."""
    sys.path.insert(0, str(TOOLS))
    try:
        import triton_compile as TC
    finally:
        sys.path.remove(str(TOOLS))
    int8 = _format.MOMENT_FORMS["int8"]
    rows = [(n, c) for n, c in TC.variants(kinds=True, forms=(int8,)) if n != "totals"]
    assert {c["FORM"] for _, c in rows} == {int8}
    seen = {(n, (c["W_SPLIT"], c["G_KIND"], c["W16_KIND"]), c["ALIGNED"]) for n, c in rows}
    assert seen == {(n, kind, a) for n in TC.CHOICES for kind in TC.KINDS for a in (0, 1, 2)}
    float32 = TC.variants(kinds=True, forms=(_format.MOMENT_FORMS["float32"],))
    assert {c["ALIGNED"] for n, c in float32 if n != "totals"} == {0, 1}


def test_the_compile_check_reads_the_rules_from_ptx():
    """The PTX reading of tools/triton_compile.py: each rule counts what it names, and an
    approximation passes only on a source line marked as an estimate."""
    sys.path.insert(0, str(TOOLS))
    try:
        import triton_compile as TC
    finally:
        sys.path.remove(str(TOOLS))
    source = Path(K.__file__)
    marked = next(i for i, line in enumerate(source.read_text().splitlines(), 1)
                  if TC.ESTIMATE in line)
    ptx = "\n".join([
        f'\t.file\t1 "{source}"',
        "\t.loc\t1 10 4",
        "\tfma.rn.f32 \t%r531, %r456, %r527, 0f30000000;",
        "\tmul.f32 \t%r1, %r2, %r3;",
        "\tmul.rn.f32 \t%r1, %r2, %r3;",
        "\tadd.rn.f32 \t%r1, %r2, 0f30000000;",
        "\tadd.s64 \t%rd1, %rd2, %rd3;",
        "\t@%p1 atom.global.gpu.acq_rel.add.f32 \t%r9, [%rd1], %r8;",
        "\tatom.global.add.u32 \t%r9, [%rd1], %r8;",
        "\tsqrt.approx.ftz.f32 \t%r1, %r2;",
        "\tdiv.full.f32 \t%r1, %r2, %r3;",
        "\tdiv.rn.f32 \t%r1, %r2, %r3;",
        f"\t.loc\t1 {marked} 8",
        "\tsqrt.approx.ftz.f32 \t%r1, %r2;",
    ]) + "\n"
    counts, ops = TC.ptx_rules(ptx)
    assert counts == {"fma": 1, "unrounded": 1, "atomics": 1, "approx": 2}
    assert ops == {"sqrt.approx.ftz.f32": 2, "div.full.f32": 1, "div.rn.f32": 1}



def _tool(name):
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))


def test_the_budget_reads_instructions_and_memory_widths_from_sass():
    """tools/sass_budget.py: the body's instructions end where the out-of-line slow paths
    begin, NOPs and the padding loop after EXIT are not counted, the blocks that call a slow
    path are not executed in the usual case, and each global load and store is counted by the
    bits it moves."""
    SB = _tool("sass_budget")
    sass = "\n".join([
        "lamb_apply:",
        "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*0020*/              @!P0 LDG.E R8, desc[UR4][R2.64] ;",
        "        /*0030*/                   LDG.E.U16 R9, desc[UR4][R2.64] ;",
        "        /*0040*/                   LDG.E.S8 R10, desc[UR4][R2.64] ;",
        "        /*0050*/                   LDG.E.64 R12, desc[UR4][R2.64] ;",
        "        /*0060*/                   STG.E.128 desc[UR4][R2.64], R4 ;",
        "        /*0070*/               @P1 STG.E.U8 desc[UR4][R2.64], R10 ;",
        "        /*0080*/                   FFMA R1, R2, R3, R4 ;",
        "        /*0084*/              @!P1 BRA `(.L_x_0) ;",
        "        /*0085*/                   BSSY B0, `(.L_x_1) ;",
        "        /*0086*/                   MOV R10, 0x480 ;",
        "        /*0087*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;",
        "        /*0088*/                   BSYNC B0 ;",
        ".L_x_1:",
        "        /*0089*/                   MOV R5, R90 ;",
        "        /*008a*/                   BRA `(.L_x_2) ;",
        ".L_x_0:",
        "        /*008b*/                   FMUL.FTZ R5, R0, R9 ;",
        ".L_x_2:",
        "        /*008c*/                   FADD R5, R5, R9 ;",
        "        /*0090*/                   EXIT ;",
        ".L_x_9:",
        "        /*00a0*/                   BRA 0xa0;",
        "        /*00b0*/                   NOP;",
        "$__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath:",
        "        /*00c0*/                   FCHK P0, R1, R2 ;",
        "        /*00d0*/                   LDG.E R8, desc[UR4][R2.64] ;",
        "        /*00e0*/                   RET.REL.NODEC R72 `(lamb_apply) ;",
    ])
    got = SB.read_sass(sass)
    assert got["body"] == 19 and got["total"] == 24
    # the slow path's call and the moves around it are not what a thread usually executes:
    # the branch around them, the fast path's FMUL and the join's FADD are
    assert got["executed"] == 19 - 6
    assert got["loads"] == {128: 1, 32: 1, 16: 1, 8: 1, 64: 1}
    assert got["stores"] == {128: 1, 8: 1}


def test_the_budget_is_the_bytes_moved_at_h100s_instructions_per_byte():
    """A kernel's budget: its bytes per element (what it must read and write) times H100's
    lane instructions per byte of bandwidth (about 10); and the warps per SM its registers
    leave."""
    SB = _tool("sass_budget")
    from scaleopt import _format as F
    G, W16, FORM = F.GRAD_KINDS, F.W16_KINDS, F.MOMENT_FORMS
    assert 9.9 < SB.PER_BYTE < 10.0
    f32 = dict(W_SPLIT=0, G_KIND=G["float32"], W16_KIND=W16["none"], FORM=FORM["float32"])
    # LAMB's second phase with float32 moments: reads w, m, v and writes w (the first phase
    # stored the moments): 16 bytes
    assert SB.bytes_per_element("lamb_apply", f32) == 16
    # the first phase reads w, g, m, v and writes m, v
    assert SB.bytes_per_element("lamb_sums", f32) == 24
    # int8 moments, a bfloat16 gradient, a split master: the apply phase reads the halves
    # (4), the gradient (2), the codes (2) and scales; writes the halves and the codes
    split = dict(W_SPLIT=1, G_KIND=G["bfloat16"], W16_KIND=W16["split"], FORM=FORM["int8"])
    assert SB.bytes_per_element("lamb_apply", split) == pytest.approx(4 + 2 + 4 + 4 * 4 / 256 + 4)
    assert SB.bytes_per_element("sum_squares", split) == 2
    assert SB.budget("lamb_apply", f32) == pytest.approx(16 * SB.PER_BYTE)
    # 124 registers: a warp takes 3968 of the SM's 65536, so 4 programs of 4 warps fit
    assert SB.warps_per_sm(124, 4, 0, 90) == 16
    assert SB.warps_per_sm(32, 4, 16, 90) == 64  # the SM's limit
    assert SB.warps_per_sm(32, 4, 40000, 90) == 5 * 4  # shared memory's


@pytest.mark.parametrize("cls", [pytest.param(scaleopt.LAMB, id="LAMB"),
                                 pytest.param(scaleopt.LANS, id="LANS", marks=pytest.mark.slow)])
def test_the_order_the_programs_run_in_changes_no_bit(cls, monkeypatch):
    """Each chunk's partial sums go to its own slot and are totalled in a fixed order (no
    float atomics): with the chunk table reversed, the interpreter runs the programs in the
    other order, as a GPU may schedule them, and the weights and moments are the same bits."""
    def train_with(chunk_table):
        monkeypatch.setattr(_triton, "_chunk_table", chunk_table)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(24, 20), nn.Tanh(), nn.Linear(20, 3))
        opt = cls(model.parameters(), lr=0.1, weight_decay=0.01, implementation="triton")
        x = torch.randn(16, 24)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()] + [
            s[k].clone() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]

    table = _triton._chunk_table
    assert len(table([(480, 0)], "float32", 0)) == 30  # 30 programs of 16 for the first weight
    forward = train_with(table)
    backward = train_with(lambda *args: table(*args)[::-1])
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))


def test_an_address_used_again_by_a_tensor_of_another_size_or_dtype_gets_its_own_tables():
    """The tables are found by the tensors' addresses; the allocator hands a freed address to
    the next tensor, of any size and dtype. Here the same buffers hold the weights, gradients
    and moments of three steps in turn (20 float32 elements, then 30, then 30 with bfloat16
    gradients): each as the reference loop."""
    wbuf, gbuf, mbuf, vbuf = (torch.zeros(64) for _ in range(4))
    g = torch.Generator().manual_seed(5)
    for n, gdtype in ((20, torch.float32), (30, torch.float32), (30, torch.bfloat16)):
        start = torch.randn(n, generator=g)
        grad = torch.randn(n, generator=g).to(gdtype)
        w, gr = wbuf[:n], gbuf.view(gdtype)[:n]
        w.copy_(start)
        gr.copy_(grad)
        assert (w.data_ptr(), gr.data_ptr()) == (wbuf.data_ptr(), gbuf.data_ptr())
        ref = start.clone()
        moments = [mbuf[:n].zero_(), vbuf[:n].zero_()]
        for weight, grads, (m, v), impl in ((w, gr, moments, "triton"),
                                            (ref, grad.clone(), torch.zeros(2, n), "single")):
            scaleopt.lamb.lamb([weight], [grads], [m], [v],
                               [torch.tensor(0.0)], lrs=[0.1], weight_decays=[0.01],
                               adapt=[True], beta1=0.9, beta2=0.999, eps=1e-6,
                               implementation=impl)
        torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_a_step_keeps_no_gradient_alive():
    """What the path keeps between steps (tables, the last signature) holds no tensor of the
    step: gradients set to None are freed, as the next backward needs their memory."""
    import weakref

    params = [nn.Parameter(torch.randn(40, 3)) for _ in range(3)]
    for state_dtype in ("float32", "int8"):
        opt = scaleopt.LAMB(params, implementation="triton", state_dtype=state_dtype)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()
        refs = [weakref.ref(p.grad) for p in params]
        opt.zero_grad(set_to_none=True)
        assert all(r() is None for r in refs), state_dtype


def _step_each(models, opts, x):
    for m, opt in zip(models, opts):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("key", ["exp_avg"] + [pytest.param(k, marks=pytest.mark.slow)
                                                for k in ("exp_avg_sq", "step")])
def test_a_replaced_state_tensor_is_the_one_the_next_step_takes(key):
    """The Adam state is given again while its tensors are the same objects: a moment or a
    counter replaced between steps by a new tensor (as a user or a tool may) is the one the
    next step reads and updates, as in the reference loop where the same values are written
    into the old tensor in place."""
    models = [two_layers(torch.float32) for _ in range(2)]
    opts = [scaleopt.LAMB(m.parameters(), lr=0.05, weight_decay=0.01, implementation=impl)
            for m, impl in zip(models, ("triton", "single"))]
    x = torch.randn(8, 9)
    shift = 3.0 if key == "step" else 0.01
    for t in range(4):
        if t == 2:
            for st in opts[0].state.values():
                st[key] = st[key] * 0.5 + shift
            for st in opts[1].state.values():
                st[key].mul_(0.5).add_(shift)
        _step_each(models, opts, x)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for sa, sb in zip(*(o.state.values() for o in opts)):
        torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", ["lr"] + [pytest.param(c, marks=pytest.mark.slow) for c in (
    "tensor lr in place", "weight_decay", "always_adapt", "exclude_from_weight_decay",
    "state dict replaced")])
def test_what_a_group_changes_between_steps_is_what_the_next_step_takes(change):
    """A step finds its state and its tables again from the last step while they are the same
    (a cost per tensor saved); a group option changed between steps (as a scheduler or a user
    changes it), a tensor learning rate changed in place, or a parameter's state dict replaced
    by another is what the next step takes, as in the reference loop."""
    models = [two_layers(torch.float32) for _ in range(2)]
    lr = torch.tensor(0.05) if change == "tensor lr in place" else 0.05
    opts = [scaleopt.LAMB(list(m.named_parameters()), lr=lr if i == 0 else lr.clone()
                          if torch.is_tensor(lr) else lr, weight_decay=0.01,
                          implementation=impl)
            for i, (m, impl) in enumerate(zip(models, ("triton", "single")))]
    x = torch.randn(8, 9)
    for t in range(4):
        if t == 2:
            for opt in opts:
                group = opt.param_groups[0]
                if change == "lr":
                    group["lr"] = 0.01
                elif change == "tensor lr in place":
                    group["lr"].fill_(0.01)
                elif change == "weight_decay":
                    group["weight_decay"] = 0.5
                elif change == "always_adapt":
                    group["weight_decay"] = 0.0  # no tensor adapts, until always_adapt
                    group["always_adapt"] = t == 2
                elif change == "exclude_from_weight_decay":
                    group["exclude_from_weight_decay"] = ["bias"]
                else:
                    for p in list(opt.state):
                        opt.state[p] = {k: v.clone() * (0.5 if k != "step" else 1.0)
                                        for k, v in opt.state[p].items()}
        _step_each(models, opts, x)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and the change made a difference: the same run without it ends elsewhere
    same = two_layers(torch.float32)
    opt = scaleopt.LAMB(same.parameters(), lr=0.05, weight_decay=0.01, implementation="triton")
    for t in range(4):
        _step_each([same], [opt], x)
    assert not torch.allclose(same[2].bias, models[0][2].bias, rtol=1e-5, atol=1e-6) or \
        not torch.allclose(same[0].weight, models[0][0].weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("own_rates", [False, True], ids=["group's rate", "rates of their own"])
def test_tensors_at_other_steps_take_their_own(own_rates):
    """A step table is one row added to the constant columns where every tensor has the
    group's rate and step; tensors whose counters differ (one had no gradient for a step),
    with the group's rate or rates of their own (MXNet's multipliers), take theirs, as in the
    reference loop."""
    from scaleopt.compat import mxnet

    models = [two_layers(torch.float32) for _ in range(2)]
    opts = []
    for m, impl in zip(models, ("triton", "single")):
        if own_rates:
            opt = mxnet.LAMB(list(m.parameters()), learning_rate=0.05, wd=0.01, param_idx2name={
                0: "a_weight", 1: "a_bias", 2: "b_weight", 3: "b_bias"})
            opt.param_groups[0]["implementation"] = impl
            opt.set_lr_mult({"a_bias": 0.5, 2: 2.0})
        else:
            opt = scaleopt.LAMB(m.parameters(), lr=0.05, weight_decay=0.01, implementation=impl)
        opts.append(opt)
    x = torch.randn(8, 9)
    for t in range(4):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            m(x).square().mean().backward()
            if t == 1:
                m[0].weight.grad = None  # its counter stays behind from here on
            opt.step()
    steps = [float(st["step"]) for st in opts[0].state.values()]
    assert sorted(steps) == [3.0, 4.0, 4.0, 4.0]
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lists_changed_in_place_between_calls_are_read_again():
    """The functional form with the same lists of rates and decays, changed in place between
    calls: each call takes their values then (only tuples, which cannot change, are kept by
    identity)."""
    torch.manual_seed(3)
    start = [torch.randn(50), torch.randn(20)]
    grads = [torch.randn(50), torch.randn(20)]
    runs = {}
    for impl in ("triton", "single"):
        ws = [w.clone() for w in start]
        ms, vs = [torch.zeros(50), torch.zeros(20)], [torch.zeros(50), torch.zeros(20)]
        steps = [torch.tensor(0.0), torch.tensor(0.0)]
        lrs, wds, adapt = [0.1, 0.1], [0.01, 0.0], [True, True]
        for t in range(3):
            if t == 2:
                lrs[1], wds[1] = 0.3, 0.5
            scaleopt.lamb.lamb(ws, grads, ms, vs, steps, lrs=lrs, weight_decays=wds,
                               adapt=adapt, beta1=0.9, beta2=0.999, eps=1e-6,
                               implementation=impl)
        runs[impl] = ws
    for a, b in zip(runs["triton"], runs["single"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _python_calls_of_a_step(opt, params, move):
    """The Python-level calls (functions, and builtins called from Python) of one step of
    ``opt``, its gradients moved to new storage first where ``move`` (the old ones kept alive,
    so that no address is handed out again)."""
    import collections

    kept = [p.grad for p in params]
    for p in params:
        p.grad = p.grad.clone() if move else p.grad
    counts = collections.Counter()

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counts[event] += 1

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    del kept
    return counts


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=["LAMB", "LANS"])
@pytest.mark.parametrize("variant", ["float32", "bf16 split masters", "int8 state", "tensor lr"])
def test_a_steps_python_work_does_not_grow_with_the_number_of_tensors(cls, variant, monkeypatch):
    """Once a group's plan is made, a step does no Python work per tensor: the same number of
    Python-level calls for 10 tensors as for 60, with the gradients where they were and with
    gradients in new storage (as a backward may put them), the launches left out (on a GPU
    each is one call of Triton's launcher). What is left per tensor is passes in C."""
    monkeypatch.setattr(_triton, "_run", lambda *args, **kwargs: None)

    def calls(n):
        torch.manual_seed(n)
        dtype = torch.bfloat16 if variant == "bf16 split masters" else torch.float32
        params = [nn.Parameter(torch.randn((64, 128) if i % 2 else (65, 70), dtype=dtype))
                  for i in range(n)]
        lr = torch.tensor(1e-3) if variant == "tensor lr" else 1e-3
        opt = cls(params, lr=lr, implementation="triton",
                  master_weights=variant == "bf16 split masters",
                  state_dtype="int8" if variant == "int8 state" else "float32")
        for p in params:
            p.grad = torch.randn_like(p)
        for _ in range(3):  # state, plan and tables made
            opt.step()
        if variant == "int8 state":
            assert all(st["exp_avg"].dtype == torch.int8 for st in opt.state.values())
        return [_python_calls_of_a_step(opt, params, move) for move in (False, True, False)]

    few, many = calls(10), calls(60)
    assert few == many
    assert few[0]["call"] > 0


def test_the_counters_step_together_and_save_as_tensors_of_their_own():
    """The counters of a group point into one buffer, so a step adds 1 to all of them at once;
    each stays the optimizer's own tensor, and a state dict holds each as a one-element tensor
    of its own (not the buffer), with its value."""
    model = two_layers(torch.float32)
    opt = scaleopt.LAMB(model.parameters(), implementation="triton")
    x = torch.randn(8, 9)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    steps = [st["step"] for st in opt.state.values()]
    assert [float(s) for s in steps] == [3.0] * 4
    assert len({s.untyped_storage().data_ptr() for s in steps}) == 1  # one buffer
    saved = [st["step"] for st in opt.state_dict()["state"].values()]
    assert all(s.untyped_storage().nbytes() == 4 and float(s) == 3.0 for s in saved)
    assert all(s is t for s, t in zip(steps, (st["step"] for st in opt.state.values())))


def test_the_tables_are_read_and_written_by_column_name():
    """The kernels read ``ptrs``, the step table and ``chunks`` by the names of
    ``_triton_layout``, and ``_triton`` writes the step table by them: no column is a bare
    offset on either side, so the two cannot drift apart."""
    import re

    from scaleopt import _triton_layout

    src = Path(scaleopt.__file__).parent
    kernels = (src / "_triton_kernels.py").read_text()
    assert not re.findall(r"tl\.load\((row|s|c)( \+ \d+)?\)", kernels)
    writer = (src / "_triton.py").read_text()
    assert not re.findall(r"table\[(?:[^\]]*,\s*)?\d+(?::\d*)?\]", writer)  # table[:, 4]
    assert len(set(_triton_layout.PTRS)) == _triton._ROW == 9
    assert [_triton_layout.SCAL.index(n) for n in ("lr", "step")] == [_triton._LR, _triton._T]


# -- Adam ------------------------------------------------------------------------------------


def _adam_set(weights, grad_dtype, form, seed):
    """Tensors for one Adam step of the C kernel or the Triton one: weights (float32; with
    their bfloat16 copy; or split masters), gradients, moments as ``form`` stores them (from
    a state dict), step counters."""
    from scaleopt import _masters

    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 80), (40, 129), (4112,), (96, 256)]
    out = dict(w=[], w16=[], g=[], m=[], v=[], steps=[], stored=[], states=[])
    for shape in shapes:
        master = torch.randn(shape, generator=g) * 0.1
        if weights == "split":
            w, w16 = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape,
                                                                           dtype=torch.int16)
            _masters.split_(master, w, w16)
        else:
            w, w16 = master, (torch.empty(shape, dtype=torch.bfloat16)
                              if weights == "float32 + bfloat16 copy" else None)
        state = {"step": torch.tensor(0.0)}
        kind = _compact.form_for(form, shape)
        if kind == "float32":
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros(shape), torch.zeros(shape)
            out["m"].append(state["exp_avg"])
            out["v"].append(state["exp_avg_sq"])
            out["stored"].append(None)
        else:
            st = _compact.stored(state, kind, master)
            out["m"].append(state["exp_avg"])
            out["v"].append(state["exp_avg_sq"])
            out["stored"].append(st)
        out["w"].append(w)
        out["w16"].append(w16)
        out["g"].append((torch.randn(shape, generator=g) * 1e-2).to(grad_dtype))
        out["steps"].append(state["step"])
        out["states"].append(state)
    return out


def _adam_step(step_fn, s, lr, wd, l2, nesterov, **extra):
    from scaleopt import _ops

    beta1, beta2 = 0.9, 0.999
    steps = [float(x) + 1.0 for x in s["steps"]]
    bc1, bc2 = _ops.bias_corrections(steps, beta1, beta2, True)
    n = len(s["w"])
    step_fn(s["w"], s["g"], s["m"], s["v"], s["w16"], s["steps"],
            step_sizes=[lr / b for b in bc1], bias_correction2_sqrts=bc2,
            weight_decays_l2=[wd if l2 else 0.0] * n,
            decays=[1.0 if l2 else 1.0 - lr * wd] * n, beta1=beta1, beta2=beta2, eps=1e-8,
            grad_multipliers=[0.5] * n, nesterov=nesterov, stored=s["stored"], **extra)


_ADAM_KINDS = [("float32", torch.float32, False, False),
               ("float32 + bfloat16 copy", torch.bfloat16, True, False),
               ("split", torch.bfloat16, False, True)]


@pytest.mark.parametrize("form, weights, grad_dtype, l2, nesterov", [
    # each form and each kind of weights in the default run, every pair in the slow one
    pytest.param(form, *kind, marks=() if i == j else pytest.mark.slow)
    for i, form in enumerate(["float32", "bfloat16", "int8"])
    for j, kind in enumerate(_ADAM_KINDS)])
def test_the_triton_adam_gives_the_c_kernels_bits(form, weights, grad_dtype, l2, nesterov,
                                                  monkeypatch):
    """AdamW (decoupled decay) and Adam (L2), with Nesterov momentum, on float32 weights (with
    their rounded bfloat16 copy) and split masters, bfloat16 gradients, moments in float32,
    bfloat16 and 8 bits: three steps of the Triton kernel and of the C kernel give the same
    bits in every weight, copy, moment, code and scale (tensors aligned and not, int8 rows
    that end mid-block and rows of whole blocks: each ``ALIGNED`` variant), as the C kernel's
    portable loops give them."""
    from scaleopt import _native

    if not _native.available():
        pytest.skip("the C kernels are not built")
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=2048, block=512))
    launched = _variants_launched(monkeypatch)
    c, t = _adam_set(weights, grad_dtype, form, 0), _adam_set(weights, grad_dtype, form, 0)
    cache = {}
    simd = _native.compact_simd()
    _native.compact_simd(False)  # the portable loops: the AVX-512 ones round a few ulp apart
    try:
        for _ in range(3):
            _adam_step(_native.adam, c, 1e-2, 0.1, l2, nesterov, threads=1)
            _adam_step(_triton.adam, t, 1e-2, 0.1, l2, nesterov, cache=cache)
    finally:
        _native.compact_simd(simd)
    assert [float(x) for x in t["steps"]] == [float(x) for x in c["steps"]] == [3.0] * 4
    assert any(st is not None for st in t["stored"]) == (form != "float32")
    code = _format.MOMENT_FORMS[form]
    assert {a for _, f, a in launched if f == code} == ({0, 1, 2} if form == "int8" else {0, 1})
    for key in ("w", "w16", "m", "v"):
        for a, b in zip(t[key], c[key]):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), key
    for a, b in zip(t["states"], c["states"]):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _adamw_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(80, 96), nn.Tanh(), nn.Linear(96, 64))


def _adamw_run(impl, state_dtype, steps=3, **options):
    model = _adamw_model()
    opt = scaleopt.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                         exclude_from_weight_decay=r"bias$", implementation=impl,
                         state_dtype=state_dtype, **options)
    x = torch.randn(32, 80, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def _on_both_kernels(run, monkeypatch):
    """``run("triton")`` and ``run("native")``: small tensors stored compact, few programs
    (the interpreter is slow), the C kernel on its portable loops (the AVX-512 ones round a
    few ulp apart)."""
    from scaleopt import _native

    if not _native.available():
        pytest.skip("the C kernels are not built")
    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=2048, block=512))
    simd = _native.compact_simd()
    _native.compact_simd(False)
    try:
        return run("triton"), run("native")
    finally:
        _native.compact_simd(simd)


def _same_bits(a, oa, b, ob):
    """Models ``a`` and ``b`` and their optimizers' states equal bit for bit."""
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for key, value in oa.state[p].items():
            assert torch.equal(value, ob.state[q][key]), key


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_lamb_moments_after_a_step_are_the_reference_loops_bits():
    """One LAMB step with the same gradients: the Triton kernels' moments are the reference
    loop's bit for bit (m = (1 - beta1) g, v = (1 - beta2) g^2: 1 - beta1 and 1 - beta2 rounded
    once from float64 as the loop rounds them, each product rounded once)."""
    for (m, v), (m0, v0) in zip(lamb_moments(1, implementation="triton"),
                                lamb_moments(1, foreach=False)):
        assert torch.equal(m, m0) and torch.equal(v, v0)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_adamw_on_the_triton_kernel_gives_the_c_kernels_bits(state_dtype, monkeypatch):
    """``AdamW(implementation="triton")`` and ``implementation="native"``: the same weights,
    moments and codes bit for bit after three steps (decay excluded from the biases), in each
    state form; and with float32 moments torch's AdamW's numbers."""
    (a, oa), (b, ob) = _on_both_kernels(lambda impl: _adamw_run(impl, state_dtype), monkeypatch)
    assert launches_of(lambda: None) == {}  # (nothing pending)
    _same_bits(a, oa, b, ob)
    if state_dtype == "int8":
        assert oa.state[a[0].weight]["exp_avg"].dtype == torch.int8
    if state_dtype == "float32":  # torch's AdamW on the same gradients: its numbers, to a
        # few roundings of the weight and of the step per step (close.py)
        ours, theirs = _adamw_model(), _adamw_model()
        opt = scaleopt.AdamW(ours.named_parameters(), lr=1e-2, weight_decay=0.1,
                             exclude_from_weight_decay=r"bias$", implementation="triton")
        decay = [p for n, p in theirs.named_parameters() if not n.endswith("bias")]
        rest = [p for n, p in theirs.named_parameters() if n.endswith("bias")]
        ref = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                lr=1e-2, weight_decay=0.1, foreach=False)

        def grads(t):
            g = torch.Generator().manual_seed(20 + t)
            return [torch.randn(p.shape, generator=g) for p in ours.parameters()]
        on_gradients(opt, list(ours.parameters()), range(3), grads)
        on_gradients(ref, list(theirs.parameters()), range(3), grads)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert_within_steps(p, q, step=1e-2, steps=3)


def _bf16_adamw_run(impl, state_dtype="float32", steps=3, model=None, opt=None, start=0):
    """AdamW with master weights on a bfloat16 copy of :func:`_adamw_model` (given
    bfloat16 gradients), ``steps`` steps (``impl`` "capturable": ``capturable=True``); the
    model and the optimizer."""
    if model is None:
        model = _adamw_model().to(torch.bfloat16)
        path = dict(capturable=True) if impl == "capturable" else dict(implementation=impl)
        opt = scaleopt.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                             exclude_from_weight_decay=r"bias$", state_dtype=state_dtype,
                             master_weights=True, **path)
    for t in range(start, start + steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t)).to(
                torch.bfloat16)
        opt.step()
    return model, opt


@pytest.mark.parametrize("impl", ["triton", "capturable", "native", None, "multi", "single"])
def test_adamw_keeps_float32_masters_of_bfloat16_parameters_on_every_path(impl, monkeypatch):
    """``AdamW(master_weights=True)`` on bfloat16 parameters: on every path the masters take
    the steps a float32 AdamW takes on the same (bfloat16) gradients, and each parameter is
    its master rounded to nearest; split (``master_lo``) where scaleopt's kernels run the
    group, a float32 copy on torch's own paths."""
    from scaleopt import _native

    if impl == "native" and not _native.available():
        pytest.skip("the C kernels are not built")
    # few programs: the interpreter is slow
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=2048, block=512))
    model, opt = _bf16_adamw_run(impl)
    ref = _adamw_model().to(torch.bfloat16).float()
    decay = [p for n, p in ref.named_parameters() if not n.endswith("bias")]
    rest = [p for n, p in ref.named_parameters() if n.endswith("bias")]
    torch_adamw = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                    lr=1e-2, weight_decay=0.1, foreach=False)
    for t in range(3):
        for p in ref.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t)).to(
                torch.bfloat16).float()
        torch_adamw.step()
    split = impl in ("triton", "capturable", "native") or (impl is None
                                                           and _native.available())
    for p, q in zip(model.parameters(), ref.parameters()):
        master = opt.master(p)
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert ("master_lo" in opt.state[p]) == split
        assert ("master_param" in opt.state[p]) == (not split)
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert_within_steps(master, q, step=1e-2, steps=3)
        # the parameter: the master rounded (within a bfloat16 ulp of it)
        ulp = torch.finfo(torch.bfloat16).eps * master.abs().clamp_min(
            torch.finfo(torch.bfloat16).tiny)
        assert ((p.float() - master).abs() <= ulp).all()


@pytest.mark.parametrize("state_dtype", [  # (int8 under the interpreter: 13 s)
    "float32", pytest.param("int8", marks=pytest.mark.slow)])
def test_adamw_split_masters_on_the_triton_kernel_give_the_c_kernels_bits(state_dtype,
                                                                           monkeypatch):
    """Split masters of bfloat16 parameters, in float32 and int8 state: the Triton kernel and
    the C kernel give the same parameters, lower halves, moments and codes bit for bit; a
    checkpoint holds each master as a float32 ``master_param``, and a run resumed from it
    takes the same steps."""
    (a, oa), (b, ob) = _on_both_kernels(lambda impl: _bf16_adamw_run(impl, state_dtype),
                                        monkeypatch)
    _same_bits(a, oa, b, ob)
    assert all("master_lo" in oa.state[p] for p in a.parameters())
    saved, kept = copy.deepcopy(oa.state_dict()), copy.deepcopy(a.state_dict())
    assert all(st["master_param"].dtype == torch.float32 and "master_lo" not in st
               for st in saved["state"].values())
    _bf16_adamw_run("triton", model=a, opt=oa, steps=2, start=3)
    model = _adamw_model().to(torch.bfloat16)
    model.load_state_dict(kept)
    opt = scaleopt.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                         exclude_from_weight_decay=r"bias$", implementation="triton",
                         state_dtype=state_dtype, master_weights=True)
    opt.load_state_dict(saved)
    _bf16_adamw_run("triton", model=model, opt=opt, steps=2, start=3)
    _same_bits(a, oa, model, opt)


def test_adamw_on_the_kernels_asks_for_master_weights_for_bfloat16_parameters():
    """Without master weights a bfloat16 parameter has no float32 values for the kernels to
    update: a clear error that names the option."""
    model = _adamw_model().to(torch.bfloat16)
    opt = scaleopt.AdamW(model.parameters(), implementation="triton")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="master_weights=True"):
        opt.step()


def test_adamw_on_the_triton_kernel_follows_its_state_as_it_changes(monkeypatch):
    """The Triton AdamW keeps what it made of a group's state between steps: the C kernel's
    bits still where the step counts differ between tensors (a parameter without a gradient
    at a step), after a checkpoint is loaded into the running optimizer, after the group's
    ``state_dtype`` changes, and with new gradient tensors at every step."""

    def run(impl):
        model = _adamw_model()
        opt = scaleopt.AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1,
                             exclude_from_weight_decay=r"bias$", implementation=impl)
        x = torch.randn(32, 80, generator=torch.Generator().manual_seed(1))
        saved = None
        for i in range(6):
            opt.zero_grad()
            model(x).square().mean().backward()
            if i == 1:
                model[0].bias.grad = None  # its counter lags from here on
            if i == 2:
                saved = copy.deepcopy(opt.state_dict())
            if i == 3:  # the checkpoint of step 2 loaded into the running optimizer
                opt.load_state_dict(saved)
            if i == 4:
                opt.param_groups[0]["state_dtype"] = "int8"
            opt.step()
        return model, opt

    (a, oa), (b, ob) = _on_both_kernels(run, monkeypatch)
    _same_bits(a, oa, b, ob)
    steps = sorted({float(oa.state[p]["step"]) for p in a.parameters()})
    assert steps == [4.0, 5.0] and oa.state[a[0].weight]["exp_avg"].dtype == torch.int8


def test_adamw_on_the_triton_kernel_launches_once_per_step_and_checkpoints_as_torch(
        monkeypatch):
    """One launch of ``adam_apply`` per step for the group's tensors (all float32, aligned);
    the state dict is torch's AdamW's (the steps float32 scalars), and a run resumed from it
    on torch's AdamW takes the step the kernel takes."""
    # few programs: the interpreter is slow
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=2048, block=512))
    model, opt = _adamw_run("triton", "float32", steps=1)
    x = torch.randn(32, 80)

    def step(o):
        o.zero_grad()
        model(x).square().mean().backward()
        o.step()
    assert launches_of(lambda: step(opt)) == {"adam_apply": 1}
    saved, kept = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    step(opt)
    on_kernel = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(kept)
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    ref = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=0.1, foreach=False)
    state = {"state": {}, "param_groups": [dict(g, params=[]) for g in ref.state_dict()[
        "param_groups"]]}
    order = [n for n, _ in model.named_parameters()]
    names = [n for n in order if not n.endswith("bias")] + [n for n in order if n.endswith("bias")]
    for j, name in enumerate(names):
        state["state"][j] = saved["state"][order.index(name)]
        state["param_groups"][0 if j < len(decay) else 1]["params"].append(j)
    ref.load_state_dict(state)
    assert all(float(s["step"]) == 2.0 for s in ref.state.values())
    step(ref)
    for p, q in zip(model.parameters(), on_kernel):  # (the same weights: the same gradients)
        assert_within_steps(p, q, step=1e-2)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_capturable_adamw_reads_nothing_on_the_host_and_takes_a_tensor_lr(clip, monkeypatch):
    """``AdamW(capturable=True)`` (on the Triton kernel, as ``implementation=None`` picks it):
    the step counters stay with the weights, the learning rate may be a tensor that a
    scheduler changes in place, and the step's host code reads no tensor value at all (step
    counters included; clipping by the global norm too): what a CUDA graph needs. The numbers
    are those of the host-made scalars (``implementation="triton"`` with a float rate), to
    the powers' last bits."""
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=2048, block=512))
    runs = []
    for options in (dict(capturable=True, lr=torch.tensor(0.01)),
                    dict(implementation="triton", lr=0.01)):
        model = _adamw_model()
        opt = scaleopt.AdamW(model.named_parameters(), weight_decay=0.1, max_grad_norm=clip,
                             exclude_from_weight_decay=r"bias$", **options)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + t))
        x = torch.randn(32, 80, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            sched.step()
        runs.append((model, opt))
    (a, oa), (b, ob) = runs
    assert torch.is_tensor(oa.param_groups[0]["lr"])
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert oa.state[p]["step"].device == p.device and float(oa.state[p]["step"]) == 3
        assert torch.equal(oa.state[p]["exp_avg_sq"], ob.state[q]["exp_avg_sq"])
    launched = []
    monkeypatch.setattr(_triton, "_run", lambda name, *x, **k: launched.append(name))
    reads = record_host_reads(monkeypatch)  # the step counters included
    oa.step()
    monkeypatch.undo()
    assert reads == [] and launched == ["adam_apply"]


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_capturable_adamw_stores_compact_moments_as_with_host_numbers(monkeypatch):
    """With capturable=True the int8 codes' random bits take the step from the device: the
    stored moments are those of a step whose numbers the host made, bit for bit."""
    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)
    monkeypatch.setattr(_triton, "LAUNCH", _triton_launch.uniform(chunk=2048, block=512))
    (a, oa), (b, ob) = (_adamw_run(None, "int8", capturable=True),
                        _adamw_run("triton", "int8"))
    assert oa.state[a[0].weight]["exp_avg"].dtype == torch.int8
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key, value in oa.state[p].items():
            if key != "step":
                assert torch.equal(value, ob.state[q][key]), key


def _muon_run(adamw_implementation, state_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 64), nn.Linear(64, 48), nn.LayerNorm(48))
    opt = scaleopt.Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-2, weight_decay=0.1,
                        exclude_from_muon=r"^0\.", exclude_from_weight_decay=r"bias$",
                        state_dtype=state_dtype, adamw_implementation=adamw_implementation)
    ids = torch.randint(0, 40, (16,), generator=torch.Generator().manual_seed(2))
    launched = []
    for _ in range(3):
        opt.zero_grad()
        model(ids).square().mean().backward()
        launched.append(launches_of(opt.step))
    return model, opt, launched


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_muons_adamw_part_runs_on_the_triton_kernel_with_the_c_kernels_bits(state_dtype,
                                                                           monkeypatch):
    """``Muon(adamw_implementation="triton")``: the AdamW part (an embedding, a bias, a norm's
    weight and bias) in one ``adam_apply`` launch per step and state form, with the C kernel's
    bits (``adamw_implementation="native"``) in every weight and moment; the matrices' Muon
    step is the same either way."""
    (a, oa, launched), (b, ob, _) = _on_both_kernels(
        lambda impl: _muon_run(impl, state_dtype), monkeypatch)
    assert [g["algorithm"] for g in oa.param_groups] == ["muon", "adamw"]
    forms = 1 if state_dtype == "float32" else 2  # (the 1-D tensors' moments stay float32)
    assert launched == [{"adam_apply": forms}] * 3
    _same_bits(a, oa, b, ob)
    if state_dtype == "int8":
        assert oa.state[a[0].weight]["exp_avg"].dtype == torch.int8


@pytest.mark.parametrize("options, message", [
    (dict(adamw_implementation="bogus"), "Invalid adamw_implementation"),
    (dict(adamw_implementation="triton", foreach=True),
     "adamw_implementation='triton' and foreach=True cannot be set together"),
])
def test_muon_adamw_implementation_errors_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        scaleopt.Muon(nn.Linear(4, 4).named_parameters(), **options)


@pytest.mark.parametrize("options, message", [
    (dict(implementation="triton", amsgrad=True), "amsgrad"),
    (dict(implementation="triton", fused=True), "cannot be set together"),
    (dict(implementation="bogus"), "Invalid implementation"),
    (dict(capturable=True, implementation="native"), "capturable=True runs on the Triton"),
    (dict(capturable=True, amsgrad=True), "capturable=True does not keep amsgrad"),
])
def test_adamw_implementation_errors_are_clear(options, message):
    with pytest.raises(ValueError, match=message):
        scaleopt.AdamW(nn.Linear(4, 4).parameters(), **options)


@pytest.mark.parametrize("options, asked", [(dict(implementation="triton"),
                                               "implementation='triton'"),
                                          (dict(capturable=True), "capturable=True")])
def test_adamw_on_the_triton_kernel_refuses_bfloat16_parameters_by_name(options, asked):
    model = nn.Linear(64, 64).to(torch.bfloat16)
    opt = scaleopt.AdamW(model.parameters(), **options)
    model(torch.randn(2, 64, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(ValueError, match=f"{asked}: the triton kernel cannot "
                                         "take this group's tensors: it takes float32"):
        opt.step()


def test_info_names_the_adamw_kernels():
    from scaleopt._info import group_implementations

    for impl in ("triton", "native", "multi", "single"):
        opt = scaleopt.AdamW(nn.Linear(4, 4).parameters(), implementation=impl)
        assert group_implementations(opt) == [impl]
        muon = scaleopt.Muon(nn.Linear(4, 4).named_parameters(), adamw_implementation=impl)
        assert group_implementations(muon)[1] == impl  # the AdamW part (the bias)
    capturable = scaleopt.AdamW(nn.Linear(4, 4).parameters(), capturable=True)
    assert group_implementations(capturable) == ["triton"]
