"""CUDA paths. Skipped without a GPU (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import scaleopt

from registry import REGISTRY, set_foreach

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def model(device="cuda", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8)).to(device, dtype)


def run(m, opt, steps, start=0):
    dev = next(m.parameters()).device
    dtype = next(m.parameters()).dtype
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(64, 32, generator=g).to(dev, dtype)
        y = torch.randn(64, 8, generator=g).to(dev, dtype)
        opt.zero_grad()
        (m(x) - y).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_cuda_matches_cpu(info):
    mc, mg = model("cpu"), model("cuda")
    oc, og = info.make(list(mc.named_parameters())), info.make(list(mg.named_parameters()))
    run(mc, oc, 5)
    run(mg, og, 5)
    for a, b in zip(mc.parameters(), mg.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


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


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_cuda_step_never_synchronises(info):
    m = model()
    opt = info.make(list(m.named_parameters()))
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


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_cuda_compiled_step(info):
    torch._dynamo.reset()
    m1, m2 = model(), model()
    o1, o2 = info.make(list(m1.named_parameters())), info.make(list(m2.named_parameters()))
    run(m1, o1, 3)
    compiled = torch.compile(o2.step)
    o2.step = compiled  # run() calls opt.step
    run(m2, o2, 3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cuda_bf16_lamb_tracks_fp32():
    m32, m16 = model(), model(dtype=torch.bfloat16)
    o32 = scaleopt.LAMB(m32.named_parameters(), lr=1e-2)
    o16 = scaleopt.LAMB(m16.named_parameters(), lr=1e-2)
    run(m32, o32, 5)
    run(m16, o16, 5)
    for a, b in zip(m32.parameters(), m16.parameters()):
        torch.testing.assert_close(b.float(), a, rtol=0.05, atol=0.02)
