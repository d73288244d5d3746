"""Two builds of the C kernels, step for step in one process: this checkout's against another
(a copy of ``_kernels*.so`` built from an earlier commit), each optimizer timed with each build
in turn, round by round, on its own copy of the same parameters and gradients.

    cp src/scaleopt/_kernels*.so /tmp/before.so        # on the earlier commit, built
    python benchmarks/bench_builds.py /tmp/before.so   # 28.8M parameters, 2 threads
    python benchmarks/bench_builds.py /tmp/before.so --rounds 21 --cases "LAMB int8"
    python benchmarks/bench_builds.py /tmp/before.so --bits   # same bits first, then times

Cases: LAMB, LANS, AdamW and OffloadAdam with float32 state, LAMB and LANS with bfloat16
parameters (split float32 masters), and each with int8 state on the portable and on the
AVX-512 loops (``scaleopt._native.compact_simd``). The table gives each build's median step and
the median over rounds of this build's step divided by the other's in the same round
(:func:`scaleopt.benchmarking.paired_ratio`): 1.00 is no change; below 1, this build is
faster. With ``--bits`` each case first takes three steps with each build from the same
parameters and gradients (and, for LAMB and LANS, with element-wise clipping, and LANS with
``decay_moved_weight``; OffloadAdam with Nesterov momentum), and the parameters and every tensor
of the state must be equal bit for bit; the exit status is 1 where one is not. The builds must
bind the same functions with the same signatures (``_native.SIGNATURES``).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch

import scaleopt
from scaleopt import _native
from scaleopt.benchmarking import (cpu_options, cpu_shapes, interleaved, make_params,
                                    paired_ratio)

#: (case, optimizer, parameters' dtype, state_dtype, whether the AVX-512 compact loops run)
CASES: List[Tuple[str, str, torch.dtype, str, bool]] = [
    (f"{name} {label}", name, dtype, state, simd)
    for name in ("LAMB", "LANS", "AdamW", "OffloadAdam")
    for label, dtype, state, simd in (("float32", torch.float32, "float32", False),
                                      ("bf16 masters", torch.bfloat16, "float32", False),
                                      ("int8 portable", torch.float32, "int8", False),
                                      ("int8 avx512", torch.float32, "int8", True))
    if dtype == torch.float32 or name in ("LAMB", "LANS")  # split masters: LAMB's and LANS's
]


def load(path: str) -> ctypes.CDLL:
    """A build of the kernels, with the signatures ``_native`` gives its own."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in _native.SIGNATURES.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
    return lib


#: the options each optimizer's bit-for-bit check also takes, beside its defaults
VARIANTS: Dict[str, List[Dict[str, Any]]] = {
    "LAMB": [{"clip_grad_value": 0.5}],
    "LANS": [{"clip_grad_value": 0.5}, {"decay_moved_weight": True}],
    "AdamW": [],
    "OffloadAdam": [{"nesterov": True}],
}


def optimizer(name: str, dtype: torch.dtype, state: str, shapes, seed: int = 0,
              **options: Any) -> torch.optim.Optimizer:
    params = [p for _, p in make_params(shapes, dtype, seed=seed)]
    if dtype != torch.float32:
        options["master_weights"] = True
    if state != "float32":
        options["state_dtype"] = state
    return getattr(scaleopt, name)(params, lr=1e-2, weight_decay=0.01, **options)


def same_bits(builds: Dict[str, ctypes.CDLL], case: Tuple[str, str, torch.dtype, str, bool],
              shapes) -> bool:
    """Whether three steps give the same parameters and state with each build, for the case
    with its default options and with each of its variants."""
    _, name, dtype, state, simd = case
    for options in [{}] + VARIANTS[name]:
        ends = []
        for lib in builds.values():
            opt = optimizer(name, dtype, state, shapes, **options)
            params = [p for group in opt.param_groups for p in group["params"]]
            grads = torch.Generator().manual_seed(1)
            for step in range(3):
                for p in params:
                    p.grad = (torch.randn(p.shape, generator=grads) * (step + 1)).to(p.dtype)
                with_library(lib, simd, opt.step)()
            ends.append(params + [t for s in opt.state.values() for t in s.values()
                                  if torch.is_tensor(t)])
        if not all(a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                      b.reshape(-1).view(torch.uint8))
                   for a, b in zip(*ends)):
            return False
    return True


def with_library(lib: ctypes.CDLL, simd: bool, step: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        _native._lib = lib
        _native.compact_simd(simd)
        step()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="the other build's _kernels*.so")
    ap.add_argument("--this", default=None,
                    help="a build to time in place of this checkout's (a copy of its .so)")
    ap.add_argument("--cases", nargs="+", default=None, help="cases whose name starts so")
    ap.add_argument("--bits", action="store_true",
                    help="first check that both builds give the same bits in every case")
    cpu_options(ap, rounds=11)
    args = ap.parse_args()
    shapes = cpu_shapes(args, native=True)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    builds = {"this": load(args.this) if args.this else _native._lib,
              "before": load(args.before)}
    cases = [c for c in CASES if not args.cases or any(c[0].startswith(k) for k in args.cases)]
    print(f"BERT-like set: {numel / 1e6:.1f}M parameters, {args.threads} threads, "
          f"{args.rounds} rounds; AVX-512 loops available: {_native.compact_simd(True)}")
    was = (_native._lib, _native.compact_simd())
    differ = []
    try:
        if args.bits:
            for case in cases:
                same = same_bits(builds, case, shapes)
                print(f"{case[0]:26s} {'same bits' if same else 'DIFFERENT BITS'}", flush=True)
                differ += [] if same else [case[0]]
        print(f"{'case':26s} {'this ms':>8s} {'before ms':>9s} {'this / before':>13s}")
        for case, name, dtype, state, simd in cases:
            steps = {}
            for build, lib in builds.items():
                opt = optimizer(name, dtype, state, shapes)
                steps[build] = with_library(lib, simd, opt.step)
            times: Dict[str, List[float]] = interleaved(steps, args.rounds, warmup=1)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{case:26s} {med['this']:8.1f} {med['before']:9.1f} "
                  f"{paired_ratio(times['this'], times['before']):13.3f}", flush=True)
            del steps
    finally:
        _native._lib = was[0]
        _native.compact_simd(was[1])
    if differ:
        sys.exit(f"the builds give different bits: {', '.join(differ)}")


if __name__ == "__main__":
    main()
