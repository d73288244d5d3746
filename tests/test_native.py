"""The fused CPU kernels: chosen by default on CPU float32, equal to the reference path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native

needs_kernels = pytest.mark.skipif(not _native.available(), reason="kernels not built")


def test_the_install_built_the_kernels():
    if os.environ.get("SCALEOPT_NATIVE") == "0":
        pytest.skip("disabled by SCALEOPT_NATIVE=0")
    assert _native.available(), "the C kernels were not built (is a C compiler installed?)"


def named(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(40, 300), nn.LayerNorm(300), nn.Linear(300, 130))
    return [(n, nn.Parameter(p.detach().to(dtype))) for n, p in m.named_parameters()]


def run(opt, params, steps=8, zero_at=None):
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        for k, (_, p) in enumerate(params):
            grad = torch.randn(p.shape, generator=g) * (10.0 if t % 3 == 0 else 0.1)
            p.grad = torch.zeros_like(p) if (zero_at is not None and k == zero_at) else grad.to(p.dtype)
        opt.step()


LAMB_CONFIGS = [
    dict(),
    dict(weight_decay=0.1, exclude_from_weight_decay="bias"),
    dict(weight_decay=0.1, weight_decay_mode="decoupled", always_adapt=True),
    dict(weight_decay=0.1, weight_decay_mode="l2", bias_correction=False),
    dict(lower_bound=5.0, upper_bound=8.0, max_grad_norm=1.0, clip_grad_value=0.5),
    dict(exclude_from_layer_adaptation=r"^2\.", weight_decay=0.0, always_adapt=True),
]
LANS_CONFIGS = [
    dict(),
    dict(weight_decay=0.1, decay_moved_weight=True),
    dict(weight_decay=0.1, lower_bound=5.0, upper_bound=8.0, clip_grad_value=0.01,
         exclude_from_weight_decay="bias", always_adapt=False),
    dict(weight_decay=0.05, decay_moved_weight=True, clip_grad_value=(-0.02, 0.01)),
]


@needs_kernels
@pytest.mark.parametrize("cls, config", [(scaleopt.LAMB, c) for c in LAMB_CONFIGS]
                         + [(scaleopt.LANS, c) for c in LANS_CONFIGS])
def test_kernels_equal_the_reference_path(cls, config, monkeypatch):
    calls = []
    real = getattr(_native, cls.__name__.lower())
    monkeypatch.setattr(_native, cls.__name__.lower(), lambda *a, **k: (calls.append(1), real(*a, **k)))
    a, b = named(), named()
    native = cls(a, lr=1e-2, **config)
    ref = cls(b, lr=1e-2, foreach=False, **config)
    run(native, a, zero_at=1)
    run(ref, b, zero_at=1)
    assert calls, "the kernels were not used"
    for (n, x), (_, y) in zip(a, b):
        assert torch.isfinite(x).all(), n
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=n)
    for (_, x), (_, y) in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(native.state[x][key], ref.state[y][key], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_kernels_run_the_fp32_master_of_bf16_parameters(cls):
    a, b = named(dtype=torch.bfloat16), named(dtype=torch.bfloat16)
    native = cls(a, lr=1e-2, master_weights=True)
    ref = cls(b, lr=1e-2, master_weights=True, foreach=False)
    run(native, a)
    run(ref, b)
    for (_, x), (_, y) in zip(a, b):
        master = native.state[x]["master_param"]
        torch.testing.assert_close(master, ref.state[y]["master_param"], rtol=1e-5, atol=1e-6)
        # the kernel's rounding into the bf16 parameter is torch's (round to nearest even)
        assert torch.equal(x.detach(), master.to(torch.bfloat16))


@needs_kernels
def test_kernel_rounding_to_bf16_matches_torch_on_every_kind_of_value():
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([  # finite values from subnormals to 1e38
        torch.randn(100_000, generator=gen)
        * 10.0 ** torch.randint(-40, 38, (100_000,), generator=gen).float(),
        torch.tensor([0.0, -0.0, float("nan"), 3.4e38, -3.4e38, 3.3961775e38,  # -> bf16 inf
                      1e-45, 1.00390625, 1.01171875]),  # ties round to even
    ])  # (an infinite weight itself turns NaN in the kernels: 0 * inf in the decay term)
    values = values[values.isfinite() | values.isnan()]
    master = values.clone()
    low = torch.zeros_like(master, dtype=torch.bfloat16)
    zeros, ones = torch.zeros_like(master), torch.ones_like(master)  # m, v: kept alive
    # lr = 0: phase 2 writes the master unchanged and its rounding into low
    _native._lib.lamb_phase2(master.data_ptr(), zeros.data_ptr(), ones.data_ptr(),
                             master.numel(), 1.0, 1.0, 1e-8, 0.0, 0, 1.0, 0.0, 1.0, low.data_ptr(), 2)
    expected = values.to(torch.bfloat16)
    same = (low == expected) | (low.isnan() & expected.isnan())
    assert same.all(), values[~same][:5]


def test_without_kernels_the_pytorch_path_runs():
    code = (
        "import torch, scaleopt; from scaleopt import _native; assert not _native.available();"
        "p = torch.nn.Parameter(torch.ones(3)); o = scaleopt.LANS([p]); p.grad = torch.ones(3);"
        "o.step(); assert torch.isfinite(p).all() and not torch.equal(p, torch.ones(3))"
    )
    env = dict(os.environ, SCALEOPT_NATIVE="0")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
