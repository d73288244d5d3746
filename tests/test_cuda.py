"""CUDA paths. Skipped without a GPU (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native

from registry import REGISTRY, set_foreach
from steps import lamb_moments, on_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model(device="cuda", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8)).to(device, dtype)


def launch_sets(opt, params):
    """The sets of a group's tensors that the Triton kernels launch once per phase for, by
    the rule docs/gpu.md gives: per form of the moments (the state says), tensors whose
    length (an int8 tensor's row) is a multiple of 16 elements apart from the others (CUDA's
    allocations are 16-byte aligned: the 16-byte-vector variant), and int8 rows of whole
    256-element blocks apart again."""
    sets = set()
    for p in params:
        form = opt.state[p]["exp_avg"].dtype
        length = p.shape[-1] if form == torch.int8 else p.numel()
        sets.add((form, 2 if form == torch.int8 and length % 256 == 0 else int(length % 16 == 0)))
    return sets


def run(m, opt, steps, start=0):
    dev = next(m.parameters()).device
    dtype = next(m.parameters()).dtype

    def loss(t):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(64, 32, generator=g).to(dev, dtype)
        y = torch.randn(64, 8, generator=g).to(dev, dtype)
        return (m(x) - y).square().mean()

    on_loss(opt, range(start, start + steps), loss)


def run_on_given_gradients(pairs, steps):
    """Each (model, optimizer) steps on the same gradients, drawn on the CPU and given in each
    model's dtype and device: the numbers then depend on the optimizers alone, not on how each
    device computes a bfloat16 forward and backward."""
    for t in range(steps):
        g = torch.Generator().manual_seed(1000 + t)
        grads = [torch.randn(p.shape, generator=g) for p in pairs[0][0].parameters()]
        for m, opt in pairs:
            for p, grad in zip(m.parameters(), grads):
                p.grad = grad.to(p.device, p.dtype)
            opt.step()


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_cuda_matches_cpu(info):
    mc, mg = model("cpu"), model("cuda")
    oc, og = info.make(list(mc.named_parameters())), info.make(list(mg.named_parameters()))
    run(mc, oc, 5)
    run(mg, og, 5)
    rtol, atol = info.across or (1e-4, 1e-5)
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=rtol, atol=atol)


def test_cuda_muon_is_torch_muon():
    """On the GPU too the matrices' updates are torch.optim.Muon's bits (bfloat16 cuBLAS
    products of the same operands, in the same order)."""
    mats = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((64, 96), (96, 64))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in mats]
    ours, ref = scaleopt.Muon(mats, lr=0.02), torch.optim.Muon(twins, lr=0.02)
    for t in range(5):
        g = torch.Generator(device="cuda").manual_seed(t)
        for p, q in zip(mats, twins):
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(mats, twins))


@pytest.mark.parametrize("info", [i for i in REGISTRY if i.has_foreach], ids=str)
def test_cuda_fast_path_equals_reference(info):
    m1, m2 = model(), model()
    o1, o2 = info.make(list(m1.named_parameters())), info.make(list(m2.named_parameters()))
    set_foreach(o1, True)
    set_foreach(o2, False)
    run(m1, o1, 5)
    run(m2, o2, 5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("info, foreach", [
    pytest.param(i, f, id=f"{i}-{'multi-tensor' if f else 'default'}")
    for i in REGISTRY if not i.host_step for f in (None, True) if i.has_foreach or not f])
def test_cuda_step_never_synchronises(info, foreach):
    """No step waits for the GPU: the default path (the Triton kernels, whose address tables are
    made again whenever the gradients get new storage, as here) and torch's multi-tensor ops."""
    m = model()
    opt = info.make(list(m.named_parameters()))
    if foreach:
        set_foreach(opt, True)
    _two_steps_never_wait(m, opt)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("capturable", [False, True], ids=["host counters", "capturable"])
def test_cuda_triton_adamw_step_never_synchronises(state_dtype, capturable):
    """AdamW on the Triton kernel (its step table from the host's counters, or made on the
    device) waits for the GPU at no step."""
    pytest.importorskip("triton")
    m = model()
    _two_steps_never_wait(m, scaleopt.AdamW(m.parameters(), lr=1e-2, implementation="triton",
                                            state_dtype=state_dtype, capturable=capturable))


def _two_steps_never_wait(m, opt):
    run(m, opt, 1)  # state allocated
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_checkpoint_moves_between_devices():
    mc = model("cpu")
    oc = scaleopt.LAMB(mc.named_parameters(), lr=1e-2)
    run(mc, oc, 3)
    mg = copy.deepcopy(mc).cuda()
    og = scaleopt.LAMB(mg.named_parameters(), lr=1e-2)
    og.load_state_dict(oc.state_dict())
    assert all(v.is_cuda for s in og.state.values() for k, v in s.items() if k != "step")
    run(mc, oc, 3, start=3)
    run(mg, og, 3, start=3)
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


def test_cuda_adamw_is_torch_fused_adamw():
    m1, m2 = model(), model()
    ours = scaleopt.AdamW(m1.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    run(m1, ours, 5)
    run(m2, ref, 5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_cuda_triton_adamw_takes_the_steps_of_the_cpu_kernels(state_dtype, monkeypatch):
    """``AdamW(implementation="triton")`` compiled for the GPU, in every state form, on the
    same gradients as the C kernel on the CPU (``implementation="native"``): the same numbers,
    to a moment stored the other way; with float32 moments torch's fused AdamW's too; one
    launch per step and set of tensors (:func:`launch_sets`)."""
    pytest.importorskip("triton")
    if not _native.available():
        pytest.skip("the C kernels are not built")
    from scaleopt import _compact, _triton

    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)
    torch.manual_seed(0)
    # int8 rows of whole blocks (256, 512) and of 16 elements (96)
    big = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 96), nn.GELU(),
                        nn.Linear(96, 8))
    mc, mg = copy.deepcopy(big), copy.deepcopy(big).cuda()
    oc = scaleopt.AdamW(mc.parameters(), lr=1e-2, implementation="native",
                        state_dtype=state_dtype)
    og = scaleopt.AdamW(mg.parameters(), lr=1e-2, implementation="triton",
                        state_dtype=state_dtype)
    before = dict(_triton.LAUNCHES)
    run_on_given_gradients([(mc, oc), (mg, og)], 5)
    sets = launch_sets(og, mg.parameters())
    assert len(sets) == (2 if state_dtype == "float32" else 3 if state_dtype == "bfloat16"
                         else 4)  # int8: rows of 256 and of 96; the small ones float32
    assert _triton.LAUNCHES["adam_apply"] - before.get("adam_apply", 0) == 5 * len(sets)
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=5e-5)
    if state_dtype == "float32":
        ref = copy.deepcopy(big).cuda()
        fused = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        run_on_given_gradients([(ref, fused)], 5)
        for a, b in zip(mg.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_cuda_triton_adamw_split_masters_take_the_steps_of_the_cpu_kernels(state_dtype,
                                                                            monkeypatch):
    """``AdamW(master_weights=True)`` on bfloat16 parameters, compiled for the GPU: the split
    masters take the C kernel's steps on the CPU (the same numbers, to a moment stored the
    other way), and each parameter is its master rounded."""
    pytest.importorskip("triton")
    if not _native.available():
        pytest.skip("the C kernels are not built")
    from scaleopt import _compact

    monkeypatch.setattr(_compact, "MIN_NUMEL", 256)
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 96)).to(torch.bfloat16)
    mc, mg = copy.deepcopy(big), copy.deepcopy(big).cuda()
    oc, og = (scaleopt.AdamW(m.parameters(), lr=1e-2, implementation=impl,
                             state_dtype=state_dtype, master_weights=True)
              for m, impl in ((mc, "native"), (mg, "triton")))
    run_on_given_gradients([(mc, oc), (mg, og)], 5)
    bf16 = torch.finfo(torch.bfloat16)
    for a, b in zip(mc.parameters(), mg.parameters()):
        master = og.master(b).cpu()
        assert "master_lo" in og.state[b]
        torch.testing.assert_close(master, oc.master(a), rtol=1e-4, atol=5e-5)
        # the parameter: its master rounded (within a bfloat16 ulp of it)
        assert ((b.float().cpu() - master).abs()
                <= bf16.eps * master.abs().clamp_min(bf16.tiny)).all()


def test_cuda_graph_replays_the_triton_adamw_step_with_a_changed_lr():
    """``AdamW(capturable=True)``: a step captured once and replayed with a new learning rate
    written into its tensor gives the numbers of eager steps with the rate as a float."""
    pytest.importorskip("triton")
    captured = _replayed_against_eager(
        lambda m, lr: scaleopt.AdamW(m.parameters(), lr=lr, capturable=True),
        lambda m, lr: scaleopt.AdamW(m.parameters(), lr=lr, implementation="triton"))
    assert all(float(s["step"]) == 4 and s["step"].is_cuda for s in captured.state.values())


def _replayed_against_eager(make_captured, make_eager):
    """A step of ``make_captured(model, lr tensor)`` captured in a CUDA graph (after one
    eager step, on a side stream, that makes the state and tables) and replayed with three
    learning rates written into its tensor, against ``make_eager(model, float lr)`` stepping
    eagerly at the same rates on the same gradients: the same numbers. The captured
    optimizer."""
    m1, m2 = model(), model()
    lr = torch.tensor(0.01, device="cuda")
    o1, o2 = make_captured(m1, lr), make_eager(m2, 0.01)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g).cuda() for p in m1.parameters()]
    for p, q, gr in zip(m1.parameters(), m2.parameters(), grads):
        p.grad, q.grad = gr.clone(), gr.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # state made and tables built before the capture
        o1.step()
    torch.cuda.current_stream().wait_stream(side)
    o2.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o1.step()
    for rate in (0.01, 0.005, 0.002):
        lr.fill_(rate)
        o2.param_groups[0]["lr"] = rate
        graph.replay()
        o2.step()
    torch.cuda.synchronize()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return o1


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_cuda_compiled_step(info):
    torch._dynamo.reset()
    m1, m2 = model(), model()
    o1, o2 = info.make(list(m1.named_parameters())), info.make(list(m2.named_parameters()))
    run(m1, o1, 3)
    compiled = torch.compile(o2.step)
    o2.step = compiled  # run() calls opt.step
    run(m2, o2, 3)
    rtol, atol = info.across or (1e-5, 1e-6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_cuda_compiled_step_with_the_triton_kernels_asked_for(cls):
    """implementation="triton" under torch.compile (inductor): the launches run outside the
    graph, in the step's order, and give the eager step's weights."""
    torch._dynamo.reset()
    m1, m2 = model(), model()
    o1 = cls(m1.named_parameters(), lr=1e-2, implementation="triton")
    o2 = cls(m2.named_parameters(), lr=1e-2, implementation="triton")
    run(m1, o1, 3)
    o2.step = torch.compile(o2.step)
    run(m2, o2, 3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_cuda_bf16_lamb_tracks_fp32():
    m32, m16 = model(), model(dtype=torch.bfloat16)
    o32 = scaleopt.LAMB(m32.named_parameters(), lr=1e-2)
    o16 = scaleopt.LAMB(m16.named_parameters(), lr=1e-2)
    run(m32, o32, 5)
    run(m16, o16, 5)
    for a, b in zip(m32.parameters(), m16.parameters()):
        torch.testing.assert_close(b.float(), a, rtol=0.05, atol=0.02)


# -- offloaded optimizers: the model on the GPU, the state and the update on the host -----------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_offload_keeps_state_on_the_host_and_matches_cpu(dtype, overlap):
    mc, mg = model("cpu", dtype), model("cuda", dtype)
    oc = scaleopt.OffloadAdam(mc.parameters(), lr=1e-2, weight_decay=0.1)
    og = scaleopt.OffloadAdam(mg.parameters(), lr=1e-2, weight_decay=0.1, overlap=overlap)
    assert bool(og.host.hooks) == overlap
    if dtype == torch.float32:
        run(mc, oc, 5)
        run(mg, og, 5)
    else:  # the same gradients (a bfloat16 backward differs between the devices)
        run_on_given_gradients([(mc, oc), (mg, og)], 5)
    for a, b in zip(mc.parameters(), mg.parameters()):
        assert b.is_cuda and b.dtype == dtype
        st = og.state[b]
        assert all(v.device.type == "cpu" for v in st.values())
        if dtype == torch.float32 or not _native.available():
            assert st["master_param"].is_pinned()
        else:  # split master (the C kernels read it): the pinned host copy of the parameter
            # and the low 16 bits, pinned too
            assert og.host.upper(b).is_pinned() and st["master_lo"].is_pinned()
            assert st["master_lo"].dtype == torch.int16
        master = og.master(b)
        assert master.dtype == torch.float32
        rounded = master.to(dtype).float()  # nearest (ties may break either way)
        assert torch.all((b.detach().cpu().float() - master).abs() <= (rounded - master).abs())
        torch.testing.assert_close(master, oc.master(a).detach(), rtol=1e-4, atol=1e-5)


def test_cuda_offload_accumulation_and_gradients_changed_after_backward():
    # two micro-batches per step, then the gradients are clipped on the device after the hooks
    # copied them: the step must use the final gradients
    torch.manual_seed(0)
    mc, mg = model("cpu"), model("cuda")
    oc = torch.optim.AdamW(mc.parameters(), lr=1e-2, foreach=False)
    og = scaleopt.OffloadAdam(mg.parameters(), lr=1e-2, weight_decay=0.01)
    for t in range(4):
        g = torch.Generator().manual_seed(t)
        xs = [torch.randn(32, 32, generator=g) for _ in range(2)]
        for m, opt in ((mc, oc), (mg, og)):
            dev = next(m.parameters()).device
            opt.zero_grad()
            for x in xs:
                m(x.to(dev)).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            opt.step()
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=["LAMB", "LANS"])
def test_cuda_offloaded_layerwise_bf16_tracks_the_host_run(cls):
    mc, mg = model("cpu", torch.bfloat16), model("cuda", torch.bfloat16)
    oc = scaleopt.offload(cls, mc.named_parameters(), lr=1e-2)
    og = scaleopt.offload(cls, mg.named_parameters(), lr=1e-2)
    run_on_given_gradients([(mc, oc), (mg, og)], 5)  # both updates run on the host
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(og.master(b), oc.master(a), rtol=1e-5, atol=1e-6)
        assert torch.equal(b.detach().cpu(), og.master(b).to(torch.bfloat16))


def test_cuda_offload_checkpoint_from_a_cpu_run_stays_on_the_host():
    mc = model("cpu")
    oc = scaleopt.OffloadAdam(mc.parameters(), lr=1e-2)
    run(mc, oc, 3)
    mg = copy.deepcopy(mc).cuda()
    og = scaleopt.OffloadAdam(mg.parameters(), lr=1e-2)
    # a copy, as a file gives it: torch's loader keeps a tensor already where it belongs (the
    # host step counters), which the two runs would otherwise share
    og.load_state_dict(copy.deepcopy(oc.state_dict()))
    assert all(v.device.type == "cpu" for s in og.state.values() for v in s.values())
    run(mc, oc, 3, start=3)
    run(mg, og, 3, start=3)
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


def _layerwise():
    from scaleopt._layerwise import LayerwiseAdam

    return [i for i in REGISTRY if not i.host_step
            and isinstance(i.make(list(model("cpu").named_parameters())), LayerwiseAdam)]


@pytest.mark.parametrize("info", _layerwise(), ids=str)
def test_cuda_triton_kernels_equal_the_reference_with_a_launch_per_phase(info):
    pytest.importorskip("triton")
    from scaleopt import _triton

    m1, m2 = model(), model()
    o1, o2 = info.make(list(m1.named_parameters())), info.make(list(m2.named_parameters()))
    for g in o1.param_groups:
        g["foreach"] = None  # the default: Triton on CUDA
    set_foreach(o2, False)
    run(m1, o1, 2)
    before = dict(_triton.LAUNCHES)
    run(m1, o1, 1, start=2)
    launched = {k: v - before.get(k, 0) for k, v in _triton.LAUNCHES.items()}
    kind = "lans" if isinstance(o1, scaleopt.LANS) else "lamb"
    sets = sum(len(launch_sets(o1, g["params"])) for g in o1.param_groups)
    assert launched[f"{kind}_sums"] == launched[f"{kind}_apply"] == sets
    assert launched["totals"] == len(o1.param_groups) * (1 + bool(launched.get("sum_squares")))
    run(m1, o1, 2, start=3)
    run(m2, o2, 5)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, decoupled", [(scaleopt.LAMB, False), (scaleopt.LAMB, True),
                                            (scaleopt.LANS, False)])
def test_cuda_triton_first_phases_sums_are_the_norms_of_the_update(cls, decoupled,
                                                                  monkeypatch):
    """Compiled, the first phases (which multiply by the bias corrections' reciprocals, made
    in float64 once per program) total the float64 norms of the update the step applies,
    within 1e-6 relatively, as under the interpreter."""
    pytest.importorskip("triton")
    from kernel_probe import first_phase_sums

    got, want = first_phase_sums(cls, decoupled, "cuda", monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_cuda_triton_lamb_moments_after_a_step_are_the_reference_loops_bits():
    """One LAMB step, compiled: the Triton kernels' moments are the reference loop's on the
    GPU bit for bit (1 - beta1 and 1 - beta2 from the host, rounded once from float64: computed
    in the kernel from the float32 beta1 they were 0.100000024, not 0.1, for beta1 = 0.9)."""
    pytest.importorskip("triton")
    for (m, v), (m0, v0) in zip(lamb_moments(1, "cuda", implementation="triton"),
                                lamb_moments(1, "cuda", foreach=False)):
        assert torch.equal(m, m0)
        torch.testing.assert_close(v, v0, rtol=2**-23, atol=0)  # (torch's product order)


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_cuda_triton_split_masters_of_bf16_parameters(cls):
    pytest.importorskip("triton")
    m1, m2 = model(dtype=torch.bfloat16), model(dtype=torch.bfloat16)
    o1 = cls(m1.parameters(), lr=1e-2, master_weights=True)
    o2 = cls(m2.parameters(), lr=1e-2, master_weights=True, foreach=False)
    run(m1, o1, 4)
    run(m2, o2, 4)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert "master_lo" in o1.state[a] and "master_param" in o2.state[b]
        torch.testing.assert_close(o1.master(a), o2.master(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_cuda_graph_replays_the_triton_step_with_a_changed_lr(cls):
    """capturable=True: a step captured once and replayed with a new learning rate written into
    its tensor gives the reference loop's numbers."""
    pytest.importorskip("triton")
    _replayed_against_eager(lambda m, lr: cls(m.parameters(), lr=lr, capturable=True),
                            lambda m, lr: cls(m.parameters(), lr=lr, foreach=False))


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
@pytest.mark.parametrize("form", ["bfloat16", "int8"])
def test_cuda_triton_kernels_update_compact_moments_as_the_cpu(cls, form, monkeypatch):
    """bfloat16 and int8 moments updated in place by the Triton kernels (no float32 copy of a
    moment): the CPU's numbers, to the rounding of a moment that falls the other way."""
    pytest.importorskip("triton")
    from scaleopt import _compact

    def no_copies(*args, **kwargs):
        raise AssertionError("a float32 copy of a compact moment was made")

    runs = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(128, 96), nn.GELU(), nn.Linear(96, 8)).to(device)
        opt = cls(m.parameters(), lr=1e-2, weight_decay=0.01, state_dtype=form)
        with monkeypatch.context() as patch:
            if device == "cuda":
                patch.setattr(_compact, "working", no_copies)
            for t in range(5):
                g = torch.Generator().manual_seed(t)
                x, y = torch.randn(64, 128, generator=g), torch.randn(64, 8, generator=g)
                opt.zero_grad()
                (m(x.to(device)) - y.to(device)).square().mean().backward()
                opt.step()
        state = opt.state[m[0].weight]
        assert state["exp_avg"].dtype == (torch.int8 if form == "int8" else torch.bfloat16)
        runs.append(([p.detach().cpu() for p in m.parameters()],
                     [_compact.read(state, k, torch.float32).cpu()
                      for k in ("exp_avg", "exp_avg_sq")]))
    (wc, mc), (wg, mg) = runs
    for a, b in zip(wg, wc):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
    for a, b in zip(mg, mc):
        assert ((a - b).abs() > 1e-6 + 0.02 * b.abs()).float().mean() < 1e-3


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_cuda_kernels_store_the_int8_codes_of_the_cpu(signed):
    """Compiled for the GPU (no fused multiply-add, each operation rounded once), the kernels
    store the codes of the definition on values on and a float either side of every boundary
    between two codes and of where the random bits decide, and, on 2^22 heavy-tailed moments,
    the codes and scales of the CPU's ``_compact.quantize``, bit for bit, in each variant for
    the rows' lengths (``ALIGNED``)."""
    pytest.importorskip("triton")
    from kernel_probe import exact_codes, stored_by_the_kernels
    from scaleopt import _compact
    from test_state_dtype import _bits, _boundary_rows

    key = "exp_avg" if signed else "exp_avg_sq"
    x, scale = _boundary_rows(signed)
    x = torch.cat([x, -x]) if signed else x
    codes, scales, _ = stored_by_the_kernels("int8", x, x.abs(), step=1.0, device="cuda")[key]
    assert (scales == scale).all()
    assert codes.tolist() == exact_codes(x, signed)
    g = torch.Generator().manual_seed(6)
    for cols in (1024, 1008, 1000):  # rows of whole blocks, of 16 elements, neither
        x = torch.randn(4096, cols, generator=g) * torch.rand(4096, cols, generator=g) ** 4
        value = x if signed else x.square()
        codes, scales, back = stored_by_the_kernels("int8", x, x.square(), step=7.0,
                                                    device="cuda")[key]
        want, want_scales = _compact.quantize(value, signed,
                                              None if signed else _bits(value, 7.0))
        assert torch.equal(scales, want_scales), cols
        assert int((codes != want).sum()) == 0, cols
        assert torch.equal(back, _compact.dequantize(want, want_scales)), cols


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS], ids=["LAMB", "LANS"])
@pytest.mark.parametrize("setting", ["float32", "bf16 masters", "int8 state"])
def test_cuda_two_runs_give_the_same_bits(cls, setting):
    """The sums phase writes each chunk's partial sums to its own slot and totals them in a
    fixed order (no float atomics): two runs of the same steps on the GPU give the same
    weights and moments, bit for bit, on tensors of hundreds of chunks."""
    pytest.importorskip("triton")
    dtype = torch.bfloat16 if setting == "bf16 masters" else torch.float32
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 512)).to("cuda", dtype)
        opt = cls(m.parameters(), lr=1e-2, weight_decay=0.01,
                  master_weights=setting == "bf16 masters",
                  state_dtype="int8" if setting == "int8 state" else "float32")
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda").to(dtype)
            opt.step()
        runs.append([p.detach().clone() for p in m.parameters()]
                    + [v.clone() for s in opt.state.values() for v in s.values()
                       if torch.is_tensor(v)])
    assert len(runs[0]) == len(runs[1])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
