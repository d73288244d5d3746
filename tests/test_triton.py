"""The Triton kernels (``implementation="triton"``, the GPU path) on CPU tensors under Triton's
interpreter: equal to the reference loop for every LAMB and LANS configuration of the registry,
with float32 masters of bfloat16 and float16 parameters, bfloat16 gradients, and on FSDP2
shards; two launches per step for LAMB (three for LANS), whatever the number of tensors.

Where a GPU is present the kernels compile for it instead (tests/test_cuda.py), and these
interpreter tests skip."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
if torch.cuda.is_available():
    pytest.skip("CUDA here: the Triton kernels compile for the GPU (tests/test_cuda.py)",
                allow_module_level=True)
assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets it before Triton is imported"

import scaleopt  # noqa: E402
from scaleopt import _triton  # noqa: E402
from scaleopt._layerwise import LayerwiseAdam  # noqa: E402
import dgc_workers as W  # noqa: E402
import sharded_workers as S  # noqa: E402
from registry import REGISTRY  # noqa: E402
from test_matrix import fresh, loss_of, record_host_reads, train  # noqa: E402

LAYERWISE = [i for i in REGISTRY if not i.host_step
             and isinstance(fresh(i)[1], LayerwiseAdam)]


def use(opt, implementation=None, foreach=None):
    for group in opt.param_groups:
        group["implementation"], group["foreach"] = implementation, foreach
    return opt


def launches_of(step):
    before = dict(_triton.LAUNCHES)
    step()
    return {k: v - before.get(k, 0) for k, v in _triton.LAUNCHES.items() if v != before.get(k, 0)}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 8 x 2 elements: most tensors span several programs, some end mid-block."""
    monkeypatch.setattr(_triton, "BLOCK", 8)
    monkeypatch.setattr(_triton, "ITERS", 2)


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
    sums = {f"{kind}_sums", f"{kind}_apply"}
    for launched in per_step:  # one launch per phase for all tensors of the group
        assert set(launched) - {"sum_squares"} == sums and all(
            launched[k] == len(o1.param_groups) for k in sums), launched


def test_launches_do_not_grow_with_the_number_of_tensors():
    for count in (2, 40):
        params = [nn.Parameter(torch.randn(7)) for _ in range(count)]
        for cls, want in ((scaleopt.LAMB, {"lamb_sums": 1, "lamb_apply": 1}),
                          (scaleopt.LANS, {"sum_squares": 1, "lans_sums": 1, "lans_apply": 1})):
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


def test_the_address_tables_are_built_once_per_set_of_storages():
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(4))]
    opt = scaleopt.LAMB(params, implementation="triton")
    _triton._TABLES.clear()
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)  # a new gradient storage: new tables
        opt.step()
    assert len(_triton._TABLES) == 3
    grads = [p.grad for p in params]
    for _ in range(3):  # the same storages: the tables are found again
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
    assert len(_triton._TABLES) == 3


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
           "LAMB(bf16, master_weights)", "LANS(bf16, master_weights)"]


def test_on_fsdp2_shards_the_kernels_equal_one_process(tmp_path):
    """The kernels on each rank's local shards, the sums totalled between the phases: the
    numbers of one process on the whole tensors, one collective per step (LANS: two, the
    gradients' norms first), two launches per group and phase set."""
    (got,) = [r for r in W.run_workers(S.train_sharded_triton, 2, tmp_path, SHARDED, 3,
                                       timeout=300) if r is not None]
    for name in SHARDED:
        weights, masters, _ = S.train_reference(name, steps=3)
        rtol, atol = (1e-2, 1e-2) if "bf16" in name else (1e-5, 1e-6)
        for a, b in zip(got[name], weights):
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)
        for a, b in zip(got[name + " masters"], masters):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        groups = 2 if "two groups" in name else 1
        kind = "lans" if name.startswith("LANS") else "lamb"
        launched = got[name + " launches"]
        assert launched[f"{kind}_sums"] == launched[f"{kind}_apply"] == groups, (name, launched)
        assert got[name + " collectives"] == (2 if kind == "lans" else 1), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_benchmark_times_each_candidate_against_fused_adamw(dtype, capsys,
                                                                   monkeypatch):
    """``scaleopt bench --device cuda``'s code, here on CPU tensors (the Triton rows under the
    interpreter) and a tiny set: a row per candidate with its ratio, host time, bandwidth at
    the algorithm's bytes per parameter, and the table printed."""
    from scaleopt.cli import bench_gpu, paramsets

    monkeypatch.setattr(_triton, "BLOCK", 2048)  # few programs: the interpreter is slow
    monkeypatch.setattr(_triton, "ITERS", 4)

    shapes = paramsets.bert_shapes(16, 1, 64, 32)
    result = bench_gpu.run(shapes, "'tiny'", dtype, "cpu", rounds=1, only=["triton"])
    rows = {r["optimizer"]: r for r in result["rows"]}
    assert set(rows) == {"torch.AdamW(fused=True)", "scaleopt.LAMB(triton)",
                         "scaleopt.LANS(triton)"}
    floors = {"float32": (28, 40, 48), "bfloat16": (14, 38, 42)}[dtype]
    assert [rows[k]["bytes_per_param"] for k in sorted(rows)] == [floors[1], floors[2],
                                                                   floors[0]]
    for r in rows.values():
        assert r["ratio"] > 0 and r["host_s"] > 0 and r["gb_per_s"] > 0
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
    monkeypatch.setattr(_triton, "_launch", lambda name, *a, **k: launched.append(name))
    reads = record_host_reads(monkeypatch, allowed=steps)
    opt.step()
    monkeypatch.undo()
    assert reads == [] and launched


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
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
    monkeypatch.setattr(_triton, "_launch", lambda *x, **k: None)
    reads = record_host_reads(monkeypatch)  # the step counters included
    oa.step()
    monkeypatch.undo()
    assert reads == []


def test_capturable_needs_the_triton_kernels():
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="Triton"):
        scaleopt.LAMB([p], capturable=True, implementation="native")
    opt = scaleopt.LAMB([p], capturable=True)  # on the CPU the C kernels would run
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match="capturable=True needs the Triton kernels"):
        opt.step()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in
@pytest.mark.parametrize("capturable", [False, True])  # the interpreter's masked-off lanes
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
    monkeypatch.setattr(_triton, "_launch", lambda *x, **k: None)
    reads = record_host_reads(monkeypatch)
    opt.step()
    monkeypatch.undo()
    assert reads == []


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_compact_state_on_the_kernels_equals_the_loop_and_reads_nothing_back(cls, form,
                                                                            monkeypatch):
    """Moments in bfloat16 or 8 bits around the Triton kernels, by the PyTorch code a GPU
    runs (no C kernels): the loop's numbers, and no value read back but the step counters."""
    from scaleopt import _compact, _native

    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)  # small tensors: the interpreter is slow
    from test_state_dtype import three_steps

    results = {}
    for impl in ("single", "triton"):
        params, opt = three_steps(cls, impl, form, 3)
        results[impl] = [p.detach().clone() for p in params], opt
    (want, _), (got, opt) = results["single"], results["triton"]
    for a, b in zip(got, want):  # a moment rounded the other way moves its weight by ~1e-5
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
        assert ((a - b).abs() > 1e-6).float().mean() < 0.01
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].dtype == (
        torch.int8 if form == "int8" else torch.bfloat16)
    steps = [s["step"] for s in opt.state.values()]
    monkeypatch.setattr(_triton, "_launch", lambda name, *a, **k: None)
    reads = record_host_reads(monkeypatch, allowed=steps)
    opt.step()
    assert reads == []
