"""The fused CPU kernels: chosen by default on CPU float32, equal to the reference path."""

from __future__ import annotations

import copy
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native
from scaleopt._dispatch import Impl
from close import assert_within_steps
from steps import lamb_moments, on_gradients

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
    def grads(t):
        g = torch.Generator().manual_seed(t)
        out = []
        for k, (_, p) in enumerate(params):
            grad = torch.randn(p.shape, generator=g) * (10.0 if t % 3 == 0 else 0.1)
            out.append(torch.zeros_like(p) if (zero_at is not None and k == zero_at) else grad.to(p.dtype))
        return out

    on_gradients(opt, [p for _, p in params], range(steps), grads)


LAMB_CONFIGS = [
    dict(),
    # scalar gradient transforms the kernels apply as they read the gradient
    dict(max_grad_norm=0.5, rescale_grad=0.25, maximize=True),
    dict(clip_grad_norm_per_tensor=0.3, max_grad_norm=1.0, weight_decay_mode="l2",
         weight_decay=0.1),
    dict(clip_grad_value=0.02, rescale_grad=2.0, maximize=True, weight_decay_mode="l2",
         weight_decay=0.1),
    dict(weight_decay=0.1, exclude_from_weight_decay="bias"),
    dict(weight_decay=0.1, weight_decay_mode="decoupled", always_adapt=True),
    dict(weight_decay=0.1, weight_decay_mode="l2", bias_correction=False),
    dict(lower_bound=5.0, upper_bound=8.0, max_grad_norm=1.0, clip_grad_value=0.5),
    dict(exclude_from_layer_adaptation=r"^2\.", weight_decay=0.0, always_adapt=True),
]
LANS_CONFIGS = [
    dict(),
    dict(max_grad_norm=0.5, rescale_grad=4.0, maximize=True, clip_grad_norm_per_tensor=0.1),
    dict(weight_decay=0.1, decay_moved_weight=True),
    dict(weight_decay=0.1, lower_bound=5.0, upper_bound=8.0, clip_grad_value=0.01,
         exclude_from_weight_decay="bias", always_adapt=False),
    dict(weight_decay=0.05, decay_moved_weight=True, clip_grad_value=(-0.02, 0.01)),
]


@needs_kernels
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_clipping_that_does_not_clip_changes_nothing(cls):
    # the clipping's norms come from one read of the gradients (and LANS reuses them for its
    # normalisation); with a bound they never reach, the steps are bit for bit the plain ones
    a, b = named(), named()
    run(cls(a, lr=1e-2, max_grad_norm=1e9, clip_grad_norm_per_tensor=1e9), a)
    run(cls(b, lr=1e-2), b)
    for (n, x), (_, y) in zip(a, b):
        assert torch.equal(x, y), n


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_kernels_cover_every_element_of_large_tensors(cls, threads):
    # sizes around the parallel threshold (32768) and the backward passes' chunks (131072)
    sizes = [32767, 32769, 70001, 262143, 3 * 131072 + 12345]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = []
        for foreach in (None, False):
            g = torch.Generator().manual_seed(0)
            params = [(f"w{k}", nn.Parameter(torch.randn(n, generator=g))) for k, n in enumerate(sizes)]
            opt = cls(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
            for t in range(3):
                for _, p in params:
                    p.grad = torch.randn(p.shape, generator=g) * (1.0 + t)
                opt.step()
            pairs.append(params)
    finally:
        torch.set_num_threads(before)
    for (n, x), (_, y) in zip(*pairs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=n)


def _sums_at(threads, cls, state_dtype, monkeypatch):
    """One step of ``cls`` on tensors whose norms lose bits to the order of their additions (a
    weight and a gradient element of 2^30 beside normal ones, so that the sum of squares is
    about 2^60 and each later span's sum rounds into it), as sharded tensors run it (the first
    pass apart: its per-tensor sums returned); with the gradients' sums of squares and the
    weights after the step, at ``threads`` threads."""
    from scaleopt._host import threads as at

    sizes = [32769, 70001, 262143, 3 * 131072 + 12345, 1024 * 1024]
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    for p in params:
        p.data[0] = 2.0 ** 30
        p.grad = torch.randn(p.shape, generator=g)
        p.grad[0] = 2.0 ** 30
    opt = cls(params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    sums = []
    with at(threads), monkeypatch.context() as patch:
        real, first = _native.LayerwiseKernel.apply, _native.LayerwiseKernel.first_pass
        patch.setattr(_native.LayerwiseKernel, "first_pass",
                      lambda kernel: sums.append(first(kernel)) or sums[-1])
        patch.setattr(_native.LayerwiseKernel, "apply", lambda kernel, totals: real(
            kernel, kernel.first_pass() if totals is None else totals))
        squares = [_native.sum_squares(p.grad, threads) for p in params]
        opt.step()
    return sums, squares, [p.detach() for p in params]


@needs_kernels
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_the_kernels_sums_are_the_same_bits_at_every_thread_count(cls, state_dtype,
                                                                   monkeypatch):
    """The C kernels' reductions (the first pass's norms, LANS's and clipping's gradient sums of
    squares) add the same partial sums in the same order at 1, 2 and 3 threads (each span's
    sums kept apart, the spans added in order), so a step's norms, trust ratios and weights do
    not depend on the thread count, even where the order of the additions would change a
    norm's last bits."""
    one = _sums_at(1, cls, state_dtype, monkeypatch)
    for threads in (2, 3):
        sums, squares, weights = _sums_at(threads, cls, state_dtype, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(sums, one[0])), threads
        assert squares == one[1], threads
        assert all(torch.equal(a, b) for a, b in zip(weights, one[2])), threads


@needs_kernels
@pytest.mark.parametrize("cls, config", [(scaleopt.LAMB, c) for c in LAMB_CONFIGS]
                         + [(scaleopt.LANS, c) for c in LANS_CONFIGS])
def test_kernels_equal_the_reference_path(cls, config, monkeypatch):
    calls = []
    table = sys.modules[cls.__module__]._IMPLEMENTATIONS  # the update by implementation
    real = table[Impl.NATIVE]
    monkeypatch.setitem(table, Impl.NATIVE, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
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
        # the kernels keep the master split: the parameter + its int16 lower halves
        assert native.state[x]["master_lo"].dtype == torch.int16
        assert "master_param" not in native.state[x]
        assert native.state[x]["exp_avg"].dtype == torch.float32
        master = native.master(x)
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, ref.master(y), rtol=1e-5, atol=1e-6)
        # the parameter is the master rounded to nearest (ties away from zero)
        assert torch.equal(x.detach(), master.to(torch.bfloat16)) or rounded_to_nearest(x, master)


def rounded_to_nearest(param, master):
    """``param`` is ``master`` rounded to a nearest bfloat16 (ties broken either way)."""
    err = (param.detach().float() - master).abs()
    return bool(torch.all(err <= (master.to(torch.bfloat16).float() - master).abs()))


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
    w16 = torch.zeros_like(master, dtype=torch.bfloat16)
    grad, m, v = (torch.zeros_like(master) for _ in range(3))
    # lr = 0 and a zero gradient: the master stays as it is, and its rounding goes into w16
    scaleopt.lamb.lamb([master], [grad], [m], [v], [torch.tensor(0.0)], lrs=[0.0],
                       weight_decays=[0.0], adapt=[False], w16=[w16], weight_decay_mode="update",
                       beta1=0.9, beta2=0.999, eps=1e-8, implementation="native")
    expected = values.to(torch.bfloat16)
    same = (w16 == expected) | (w16.isnan() & expected.isnan())
    assert same.all(), values[~same][:5]


@needs_kernels
@pytest.mark.parametrize("fn", [scaleopt.lamb.lamb, scaleopt.lans.lans])
def test_the_functional_forms_former_low_argument_still_works_with_a_warning(fn):
    """``low=`` (the kernels' 16-bit tensor's former name) gives what ``w16=`` gives, with a
    FutureWarning; both at once is an error."""
    outs = []
    for name in ("w16", "low"):
        torch.manual_seed(0)
        master, grad = torch.randn(50), torch.randn(50)
        w16 = torch.zeros(50, dtype=torch.bfloat16)
        m, v = torch.zeros(50), torch.zeros(50)
        kwargs = dict(lrs=[0.1], weight_decays=[0.01], adapt=[True], beta1=0.9, beta2=0.999,
                      eps=1e-6, implementation="native", **{name: [w16]})
        if name == "low":
            with pytest.warns(FutureWarning, match="w16="):
                fn([master], [grad], [m], [v], [torch.tensor(0.0)], **kwargs)
        else:
            fn([master], [grad], [m], [v], [torch.tensor(0.0)], **kwargs)
        outs.append((master, w16))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[0][1], outs[0][0].bfloat16())
    with pytest.raises(TypeError, match="once"):
        fn([master], [grad], [m], [v], [torch.tensor(0.0)], lrs=[0.1], weight_decays=[0.01],
           adapt=[True], beta1=0.9, beta2=0.999, eps=1e-6, w16=[w16], low=[w16])


def test_without_kernels_the_pytorch_path_runs():
    code = (
        "import torch, scaleopt; from scaleopt import _native; assert not _native.available();"
        "p = torch.nn.Parameter(torch.ones(3)); o = scaleopt.LANS([p]); p.grad = torch.ones(3);"
        "o.step(); assert torch.isfinite(p).all() and not torch.equal(p, torch.ones(3))"
    )
    env = dict(os.environ, SCALEOPT_NATIVE="0")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_installing_without_a_compiler_gives_the_same_numbers(tmp_path):
    """A machine with no C compiler: the install succeeds without the kernels, and LAMB and LANS
    compute what they compute here (with the kernels, when built)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "src"), src / "src",
                    ignore=shutil.ignore_patterns("*.so", "*.egg-info", "__pycache__"))
    env = dict(os.environ, CC="/bin/false", CXX="/bin/false", PIP_NO_INDEX="1")
    env.pop("SCALEOPT_NATIVE", None)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(tmp_path / "site"), str(src)],
                   env=env, check=True, timeout=300, capture_output=True)
    code = (
        "import sys, torch, scaleopt; from scaleopt import _native;"
        "assert scaleopt.__file__.startswith(sys.argv[1]), scaleopt.__file__;"
        "assert not _native.available();"
        "from test_native import named, run;"
        "out = {}\n"
        "for cls in (scaleopt.LAMB, scaleopt.LANS):\n"
        "    p = named(); run(cls(p, lr=1e-2, weight_decay=0.01), p); out[cls.__name__] = [q for _, q in p]\n"
        "torch.save(out, sys.argv[2])"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "helpers")]))
    env.pop("SCALEOPT_NATIVE", None)
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "site"), str(tmp_path / "out.pt")],
                   env=env, check=True, timeout=120, cwd=tmp_path)
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    for cls in (scaleopt.LAMB, scaleopt.LANS):
        p = named()
        run(cls(p, lr=1e-2, weight_decay=0.01), p)
        for a, (_, b) in zip(theirs[cls.__name__], p):
            torch.testing.assert_close(a, b.detach(), rtol=2e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_split_masters_checkpoint_as_float32_both_ways(cls, monkeypatch):
    a = named(dtype=torch.bfloat16)
    split = cls(a, lr=1e-2, master_weights=True)
    run(split, a, steps=3)
    sd = split.state_dict()
    for (_, x), st in zip(a, sd["state"].values()):
        assert "master_lo" not in st and st["master_param"].dtype == torch.float32
        assert torch.equal(st["master_param"], split.master(x))
    # into an optimizer with plain float32 masters (as where the kernels are not built) ...
    b = [(n, nn.Parameter(x.detach().clone())) for n, x in a]
    with monkeypatch.context() as m:
        m.setattr(_native, "available", lambda: False)
        plain = cls(b, lr=1e-2, master_weights=True)
        plain.load_state_dict(copy.deepcopy(sd))
        for (_, x), (_, y) in zip(a, b):
            assert torch.equal(plain.state[y]["master_param"], split.master(x))
        run(plain, b, steps=2)
    # ... and back into split storage: the master comes back exactly
    c = [(n, nn.Parameter(y.detach().clone())) for n, y in b]
    again = cls(c, lr=1e-2, master_weights=True)
    again.load_state_dict(plain.state_dict())
    for (_, y), (_, z) in zip(b, c):
        assert "master_param" not in again.state[z]
        assert torch.equal(again.master(z), plain.state[y]["master_param"])


@needs_kernels
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
def test_pytorch_path_continues_a_split_master(cls):
    a, b = named(dtype=torch.bfloat16), named(dtype=torch.bfloat16)
    kernel = cls(a, lr=1e-2, master_weights=True, weight_decay=0.01)
    mixed = cls(b, lr=1e-2, master_weights=True, weight_decay=0.01)
    run(kernel, a, steps=6)
    run(mixed, b, steps=3)
    mixed.param_groups[0]["foreach"] = False  # now the PyTorch path, on the same split state
    for t in range(3, 6):
        g = torch.Generator().manual_seed(t)
        for _, p in b:
            p.grad = (torch.randn(p.shape, generator=g) * (10.0 if t % 3 == 0 else 0.1)).to(p.dtype)
        mixed.step()
    for (_, x), (_, y) in zip(a, b):
        assert "master_lo" in mixed.state[y] and "master_param" not in mixed.state[y]
        torch.testing.assert_close(mixed.master(y), kernel.master(x), rtol=1e-5, atol=1e-6)
        assert rounded_to_nearest(y, mixed.master(y))


@needs_kernels
def test_split_master_costs_two_bytes_per_parameter():
    a = named(dtype=torch.bfloat16)
    opt = scaleopt.LAMB(a, master_weights=True)
    run(opt, a, steps=1)
    for _, p in a:
        extra = [t for k, t in opt.state[p].items() if k not in ("step", "exp_avg", "exp_avg_sq")]
        assert sum(t.numel() * t.element_size() for t in extra) == 2 * p.numel()


@needs_kernels
@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scalars", [{}, dict(max_grad_norm=1.0, rescale_grad=0.5, maximize=True,
                                                clip_grad_norm_per_tensor=10.0),
                                     dict(clip_grad_value=0.1, rescale_grad=0.5)],
                         ids=["plain", "clipped", "value-clipped"])
def test_kernel_step_allocates_nothing_the_size_of_the_model(cls, dtype, scalars):
    # with clipping, rescaling or maximize the kernels take the gradients times one scalar per
    # tensor (then clamped, for clip_grad_value) as they read them: no scaled copy of them
    from torch.profiler import ProfilerActivity, profile

    ps = [nn.Parameter(torch.randn(512, 1024).to(dtype)) for _ in range(4)]  # 2M parameters
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = cls(ps, master_weights=True, weight_decay=0.01, **scalars)
    opt.step()  # the state is created here
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events())
    assert allocated < 4096, allocated
    # the check sees allocations: the PyTorch path allocates its temporaries
    ref = cls(ps, master_weights=True, weight_decay=0.01, foreach=True)
    ref.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ref.step()
    assert sum(max(e.cpu_memory_usage, 0) for e in prof.events()) > 4 * 2 ** 21


@needs_kernels
@pytest.mark.parametrize("n", [1, 5, 2047, 2048, 2049, 100_003, 1 << 20])
def test_sum_of_squares_is_the_double_sum(n):
    # blocks of 2048 (and a shorter last one): float partial sums added in double
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
    for t in (x, x.bfloat16()):
        want = float(t.double().square().sum())
        assert _native.sum_squares(t, 2) == pytest.approx(want, rel=1e-6)


# -- the binding -----------------------------------------------------------------------------------

_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int,
            "float": ctypes.c_float, "double": ctypes.c_double, "void": None}


def _c_source():
    """The C kernels' one translation unit as the compiler reads it: ``kernels.c`` with each
    of its parts in place of its ``#include``."""
    csrc = Path(scaleopt.__file__).parent / "csrc"
    return re.sub(r'^#include "(\w+\.h)"$', lambda m: (csrc / m[1]).read_text(),
                  (csrc / "kernels.c").read_text(), flags=re.M)


def _c_declarations():
    """Each non-static function of the C kernels (``csrc/``, read in the order ``kernels.c``
    includes its parts): name -> (return type, [parameter types]), also those a macro defines
    (``SUM_SQUARES(sum_squares, float, ...)``)."""
    source = _c_source()
    for macro, args, body in re.findall(r"^#define (\w+)\(([^)]*)\)((?:.*\\\n)+)", source,
                                        flags=re.M):
        names = [a.strip() for a in args.split(",")]
        for call in re.findall(rf"^{macro}\(([^\n]*)\)$", source, flags=re.M):
            values = [v.strip() for v in call.split(",")]
            text = body.replace("\\\n", "\n")
            for name, value in zip(names, values):
                text = re.sub(rf"\b{name}\b", value, text)
            source += "\n" + "\n".join(line.strip() for line in text.splitlines())
    found = {}
    pattern = r"^(?:TARGETS )?(\w+) (\w+)\(([^)]*)\) \{"
    for ret, name, params in re.findall(pattern, source, flags=re.M):
        found[name] = (ret, [" ".join(p.split()[:-1]) + ("*" if "*" in p else "")
                             for p in params.split(",")])
    return found


def _c_parts():
    """The C kernels' files in the order the compiler reads them: each part ``kernels.c``
    includes, then ``kernels.c`` itself; each as (name, text without comments and strings)."""
    csrc = Path(scaleopt.__file__).parent / "csrc"
    main = (csrc / "kernels.c").read_text()
    names = re.findall(r'^#include "(\w+\.h)"$', main, flags=re.M) + ["kernels.c"]

    def bare(text):
        text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m[0]), text, flags=re.S)
        return re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', text)

    return [(name, bare((csrc / name).read_text())) for name in names]


#: what a C part defines at the top level: functions (a name, its parameters, a body),
#: macros, structs and function-pointer types, enum constants, tables and variables
_C_DEFINITIONS = (r"^[A-Za-z_][^;{}()=#\n]*?\b(\w+)\([^;{}]*?\)\s*\{",
                  r"^#define (\w+)",
                  r"^\}\s*(\w+)\s*;",
                  r"^typedef [^;]*?\(\*(\w+)\)\(",
                  r"^static [^;(){}=]*?\b(\w+)\s*(?:\[[^\]]*\])*\s*[=;]")


def test_each_c_part_uses_only_what_it_or_an_earlier_part_defines():
    """The C sources read top to bottom: no file uses a function, type, macro, constant or
    table that a later file defines, and nothing is declared ahead of its definition (the
    first mention of each name is where it is defined)."""
    parts = _c_parts()
    source, starts = "", []
    for name, text in parts:
        starts.append((len(source), name))
        source += text + "\n"

    def part(at):
        return [name for start, name in starts if start <= at][-1]

    defined = {}
    for pattern in _C_DEFINITIONS:
        for m in re.finditer(pattern, source, flags=re.M):
            defined.setdefault(m[1], m.start())
    for m in re.finditer(r"^enum \{([^}]*)\}", source, flags=re.M):
        for constant in re.findall(r"(\w+)\s*(?:=[^,]*)?(?:,|$)", m[1]):
            defined.setdefault(constant, m.start())
    assert {"lamb_multi", "lamb_phase1", "v16_lamb_sums", "Blocks", "Pass", "SUM_SPAN",
            "LAMB1", "keep_buffer", "COMPACT_LOOP", "ADAM_PORTABLE"} <= set(defined)
    ahead = []
    for name, at in defined.items():
        first = re.search(rf"\b{name}\b", source).start()
        if first < at:
            ahead.append(f"{name} (defined in {part(at)}) is used first in {part(first)}")
    assert not ahead, ahead
    declarations = re.findall(r"^[A-Za-z_][^;{}()=#\n]*?\b(\w+)\([^;{}]*?\)\s*;", source,
                              flags=re.M)
    assert not declarations, f"declared ahead of their definitions: {declarations}"


def _as_ctypes(c_type: str):
    """The ctypes type a C parameter type is bound with: a pointer to a struct of the binding
    as POINTER(struct), any other pointer as c_void_p."""
    if c_type.endswith("*"):
        base = c_type.replace("const", "").replace("*", "").strip()
        struct = getattr(_native, base, None)
        return ctypes.POINTER(struct) if isinstance(struct, type) else ctypes.c_void_p
    return _C_TYPES[c_type]


@needs_kernels
def test_each_binding_matches_its_c_declaration():
    declared = _c_declarations()
    for name, (restype, argtypes) in _native.SIGNATURES.items():
        assert name in declared, f"{name} is bound but not declared in csrc/"
        ret, params = declared[name]
        assert restype is _C_TYPES[ret], name
        assert [_as_ctypes(p) for p in params] == argtypes, name
        fn = getattr(_native._lib, name)
        assert fn.restype is restype and fn.argtypes == argtypes
    assert set(declared) - {"PyInit__kernels"} == set(_native.SIGNATURES), "exported, unbound"


@needs_kernels
@pytest.mark.parametrize("struct", _native.STRUCTS, ids=lambda s: s.__name__)
def test_each_struct_has_the_c_layout(struct):
    fields = [getattr(struct, name).offset for name, _ in struct._fields_]
    assert _native.struct_layout(struct) == (ctypes.sizeof(struct), *fields)


@needs_kernels
def test_a_wrong_argument_raises_instead_of_reaching_c():
    with pytest.raises(ctypes.ArgumentError):
        _native._lib.lamb_multi(0, 1, None)


@needs_kernels
def test_lamb_on_the_c_kernels_takes_the_reference_loops_first_moment_bit_for_bit():
    """Three LAMB steps with the same gradients: the C kernels' first moments are the
    reference loop's bit for bit, and both moments after one step (1 - beta1 and 1 - beta2
    rounded once from float64, as the loop rounds them; from the float32 beta1, 1 - beta1
    would be 0.100000024 for 0.9). That holds where torch runs its vectorized CPU kernels
    (AVX2, AVX-512), whose ``lerp_`` rounds its multiply-add once, as the C kernels do; on its
    portable ones (``ATEN_CPU_CAPABILITY=default``) it rounds the product first, so from the
    second step the first moments agree to one rounding of their terms (below 1) per step."""
    fused = torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    for steps in (1, 3):
        got = lamb_moments(steps, implementation="native")
        for (m, v), (m0, v0) in zip(got, lamb_moments(steps, foreach=False)):
            if fused or steps == 1:
                assert torch.equal(m, m0)
            else:
                assert_within_steps(m, m0, step=1.0, steps=steps, ulps=1)
            assert steps > 1 or torch.equal(v, v0)
