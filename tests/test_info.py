"""`scaleopt.info()` and `scaleopt info`: what runs here, and which implementation each param
group of an optimizer takes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import scaleopt
from scaleopt import _native
from scaleopt._info import group_implementations
from scaleopt.cli import EXIT_OK, main

NATIVE = "native" if _native.available() else "single"


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_info_says_what_runs_here():
    r = scaleopt.info()
    assert r["scaleopt"] == scaleopt.__version__ and r["torch"] == torch.__version__
    assert r["c_kernels"]["used"] == _native.available()
    assert (r["c_kernels"]["why_not"] is None) == _native.available()
    assert r["threads"] == torch.get_num_threads() and r["cores"] >= 1
    assert r["cuda_devices"] == ([torch.cuda.get_device_name(i)
                                  for i in range(torch.cuda.device_count())]
                                 if torch.cuda.is_available() else [])


@pytest.mark.parametrize("make, expected", [
    (lambda ps: scaleopt.LAMB(ps), [NATIVE]),
    (lambda ps: scaleopt.LANS(ps, foreach=False), ["single"]),
    (lambda ps: scaleopt.LAMB(ps, foreach=True), ["multi"]),
    (lambda ps: scaleopt.offload(scaleopt.LAMB, ps), [NATIVE + " (host)"]),
    (lambda ps: scaleopt.OffloadAdam(ps), [NATIVE + " (host)"]),
    (lambda ps: scaleopt.AdamW(ps), ["fused (torch)"]),
    (lambda ps: scaleopt.Muon(ps), ["Newton-Schulz (bfloat16 matmuls), matrices whole on one "
                                    "rank each", "fused (torch)"]),
    (lambda ps: scaleopt.Momentum(ps, lr=0.1), ["single"]),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), ["torch.optim.sgd.SGD's own step"]),
])
def test_each_group_names_its_implementation(make, expected):
    assert group_implementations(make(_model().parameters())) == expected


def test_two_groups_and_an_explicit_triton_path():
    pytest.importorskip("triton")  # under TRITON_INTERPRET=1 (conftest) on CPU tensors
    m = _model()
    opt = scaleopt.LAMB([{"params": m[0].parameters(), "implementation": "triton"},
                         {"params": m[1].parameters(), "foreach": False}])
    assert scaleopt.info(opt)["groups"] == ["triton", "single"]


def test_the_command_prints_it(capsys):
    assert main(["info", "--optimizer", "LANS"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"lans on the built-in model (cpu): group 0: {NATIVE}; group 1: {NATIVE}" in out
    assert f"scaleopt {scaleopt.__version__}, torch {torch.__version__}" in out
    assert ("C kernels: built and used" in out) == _native.available()


def test_kernels_turned_off_are_reported_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "scaleopt", "info"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, SCALEOPT_NATIVE="0"))
    assert proc.returncode == 0, proc.stderr
    assert "C kernels: turned off by SCALEOPT_NATIVE=0" in proc.stdout
    assert "group 0: single; group 1: single" in proc.stdout


@pytest.mark.skipif(not _native.available() or not _native.compact_simd(),
                    reason="needs the C kernels on a CPU with AVX-512")
def test_the_avx512_loops_turned_off_by_the_environment_are_reported():
    """``SCALEOPT_AVX512=0`` starts a process on the portable compact loops (as the bit tests'
    rerun in CI does), and ``scaleopt info`` says which loops run."""
    def info(**env):
        proc = subprocess.run([sys.executable, "-m", "scaleopt", "info"], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, **env))
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    assert "C kernels: built and used; compact state on their AVX-512 loops" in info()
    off = info(SCALEOPT_AVX512="0")
    assert "C kernels: built and used\n" in off and "AVX-512" not in off
