"""Which code runs a group's update, and where its masters live: one function answers each."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native
from scaleopt._dispatch import Impl, implementation
from scaleopt._group import GroupTensors
from scaleopt._masters import Storage

needs_kernels = pytest.mark.skipif(not _native.available(), reason="kernels not built")


def group(**options):
    return {"foreach": None, "master_weights": False, **options}


@pytest.mark.parametrize("foreach, want", [(True, Impl.MULTI), (False, Impl.SINGLE)])
def test_an_explicit_foreach_decides(foreach, want):
    assert implementation(group(foreach=foreach), [torch.zeros(3)]) is want


def test_without_kernels_the_cpu_runs_the_loop(monkeypatch):
    monkeypatch.setattr(_native, "available", lambda: False)
    assert implementation(group(), [torch.zeros(3)]) is Impl.SINGLE


@needs_kernels
def test_the_cpu_runs_the_kernels_where_they_take_every_tensor():
    w, g, m, v = (torch.zeros(4) for _ in range(4))
    step = [torch.tensor(0.0)]
    assert implementation(group(), [w]) is Impl.NATIVE
    tensors = GroupTensors([w], [g], [m], [v], step, [None])
    assert implementation(group(), [w], tensors=tensors) is Impl.NATIVE
    strided = torch.zeros(4, 2)[:, 0]  # not contiguous: the kernels do not take it
    tensors = GroupTensors([strided], [g], [m], [v], step, [None])
    assert implementation(group(), [w], tensors=tensors) is Impl.SINGLE
    assert implementation(group(), [w], kernels=False) is Impl.SINGLE  # an optimizer without any


@needs_kernels
def test_each_optimizer_runs_the_implementation_the_function_names(monkeypatch):
    calls = []
    real = scaleopt.lamb._IMPLEMENTATIONS[Impl.NATIVE]
    monkeypatch.setitem(scaleopt.lamb._IMPLEMENTATIONS, Impl.NATIVE,
                        lambda *a, **k: (calls.append("native"), real(*a, **k))[1])
    for foreach, kernel_calls in ((None, 1), (True, 0), (False, 0)):
        calls.clear()
        p = nn.Parameter(torch.randn(5, 3))
        p.grad = torch.randn(5, 3)
        scaleopt.LAMB([p], foreach=foreach).step()
        assert len(calls) == kernel_calls, foreach


@needs_kernels
@pytest.mark.parametrize("dtype, master_weights, want", [
    (torch.float32, True, Storage.OWN),
    (torch.bfloat16, False, Storage.OWN),
    (torch.bfloat16, True, Storage.SPLIT),
    (torch.float16, True, Storage.COPY),
])
def test_one_function_says_where_each_master_lives(dtype, master_weights, want):
    p = nn.Parameter(torch.randn(4, 3).to(dtype))
    opt = scaleopt.LAMB([p], master_weights=master_weights)
    assert opt._master_weights.storage(opt.param_groups[0], p) is want
    p.grad = torch.randn(4, 3).to(dtype)
    opt.step()
    state = opt.state[p]
    assert ("master_lo" in state) == (want is Storage.SPLIT)
    assert ("master_param" in state) == (want is Storage.COPY)


@needs_kernels
def test_an_offloaded_optimizer_keeps_every_master_on_the_host():
    ps = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 3).bfloat16()),
          nn.Parameter(torch.randn(4, 3).half())]
    opt = scaleopt.offload(scaleopt.LAMB, ps)
    assert type(opt) is scaleopt.LAMB and opt.host is not None
    kinds = [opt._master_weights.storage(opt.param_groups[0], p) for p in ps]
    assert kinds == [Storage.OWN, Storage.SPLIT, Storage.COPY]


@needs_kernels
def test_a_copied_optimizer_still_saves_split_masters_as_float32():
    p = nn.Parameter(torch.randn(6, 4).bfloat16())
    opt = scaleopt.LANS([p], lr=1e-2, master_weights=True)
    for _ in range(2):
        p.grad = torch.randn(6, 4).bfloat16()
        opt.step()
    twin = copy.deepcopy(opt)
    for o in (opt, twin):
        (st,) = o.state_dict()["state"].values()
        assert "master_lo" not in st and st["master_param"].dtype == torch.float32
    assert torch.equal(opt.state_dict()["state"][0]["master_param"],
                       twin.state_dict()["state"][0]["master_param"])


def test_a_split_masters_lower_halves_are_made_where_its_kernels_read_them():
    """The int16 lower halves of a new split master: on the parameter's device for masters
    beside their parameters (a GPU parameter's on the GPU, where the Triton kernels read
    them), in host memory for an offloaded optimizer (where the C kernels read them). A
    meta-device parameter stands for a device one here."""
    from scaleopt._host import HostPipeline
    from scaleopt._masters import LocalPlacement

    p = nn.Parameter(torch.empty(3, 5, dtype=torch.bfloat16, device="meta"))
    beside, host = LocalPlacement().lower_halves(p), HostPipeline().lower_halves(p)
    assert (beside.device, beside.dtype, beside.shape) == (p.device, torch.int16, p.shape)
    assert (host.device.type, host.dtype, host.shape) == ("cpu", torch.int16, p.shape)
    assert not host.any()


def test_split_masters_halves_hold_every_float32_bit_pattern_exactly():
    """A split master's halves (16-bit pieces, no wider temporaries) give back every float32
    exactly, the same halves as the 64-bit integer form: random bit patterns and the edges of
    rounding (carries into the sign, inf, NaN)."""
    from scaleopt import _masters

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (100_003,), dtype=torch.int64, generator=g)
    edges = torch.tensor([0, 0x7FFF, 0x8000, 0xFFFF, 0x7FFF8000, 0x7FFFFFFF, 0x7F7FFFFF,
                          0x7F800000, 0x7FC00000, 0x3F807FFF, 0x3F808000], dtype=torch.int64)
    edges = torch.cat([edges, edges | (1 << 31)])
    edges = edges - (edges >= 2 ** 31).long() * 2 ** 32
    for b in (bits, edges):
        b = b.to(torch.int32)
        x = b.view(torch.float32).view(-1, 1)
        hi, lo = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16)
        hi2, lo2 = hi.clone(), lo.clone()
        _masters.split_(x, hi, lo)
        _masters._split_wide(x, hi2, lo2)
        assert torch.equal(hi.view(torch.int16), hi2.view(torch.int16)) and torch.equal(lo, lo2)
        assert torch.equal(_masters.split_join(hi, lo).view(torch.int32).view(-1), b)
        assert torch.equal(_masters._split_join_wide(hi, lo).view(torch.int32).view(-1), b)
