"""The bits of LAMB and LANS steps, to compare two versions of the package: a change that should
not change the arithmetic (a refactoring of the route to it) leaves every weight and state
tensor equal bit for bit.

    PYTHONPATH=<checkout A>/src python tools/step_bits.py a.pt
    PYTHONPATH=<checkout B>/src python tools/step_bits.py b.pt
    python tools/step_bits.py --compare a.pt b.pt       # exit 1 if any configuration differs

40 configurations: LAMB and LANS, each on the C kernels (the default on the CPU), the
single-tensor loop, the multi-tensor path and the Triton kernels under the interpreter
(``TRITON_INTERPRET=1``, set here), each with float32 state, int8 state, bfloat16 state,
global-norm and value clipping, and bfloat16 parameters with master weights; a small model in
two param groups (one without decay, its own rate), an LR schedule, five steps. The C kernels
must be built in both checkouts (``python setup.py build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

EXTRAS = ({}, {"state_dtype": "int8"}, {"state_dtype": "bfloat16"},
          {"max_grad_norm": 1.0, "clip_grad_value": 0.5}, {"master_weights": True})


def run() -> dict:
    import scaleopt

    out = {}
    for cls in ("LAMB", "LANS"):
        for impl in (None, "single", "multi", "triton"):
            for extra in EXTRAS:
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(80, 70), nn.LayerNorm(70), nn.Linear(70, 5))
                if extra.get("master_weights"):
                    model = model.bfloat16()
                groups = [{"params": [model[0].weight, model[2].weight]},
                          {"params": [model[0].bias, model[1].weight, model[1].bias,
                                      model[2].bias], "weight_decay": 0.0, "lr": 2e-3}]
                opt = getattr(scaleopt, cls)(groups, lr=1e-2, weight_decay=0.01,
                                             implementation=impl, always_adapt=True, **extra)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 / (1 + t))
                x = torch.randn(16, 80)
                dtype = next(model.parameters()).dtype
                for t in range(5):
                    opt.zero_grad()
                    model(x.to(dtype) + t).float().square().mean().backward()
                    opt.step()
                    sched.step()
                key = f"{cls} implementation={impl} {extra}"
                out[key] = [p.detach().clone() for p in model.parameters()] + [
                    v.clone() for st in opt.state.values() for v in st.values()
                    if torch.is_tensor(v)]
    return out


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal dtypes, shapes and bytes (-0.0 is not 0.0, a NaN equals the same NaN)."""
    return (x.dtype == y.dtype and x.shape == y.shape
            and torch.equal(x.detach().contiguous().reshape(-1).view(torch.uint8),
                            y.detach().contiguous().reshape(-1).view(torch.uint8)))


def compare(a: dict, b: dict) -> list:
    """The configurations whose tensors differ in any bit (or are missing on one side)."""
    return [k for k in sorted(set(a) | set(b))
            if k not in a or k not in b or len(a[k]) != len(b[k])
            or not all(same_bits(x, y) for x, y in zip(a[k], b[k]))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="where to save, or with --compare the two saved")
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    if args.compare:
        a, b = (torch.load(f) for f in args.files[:2])
        differ = compare(a, b)
        print(f"{len(a)} configurations, {len(differ)} differ" + "".join(
            f"\n  {k}" for k in differ))
        return 1 if differ else 0
    out = run()
    torch.save(out, args.files[0])
    import scaleopt

    print(f"{len(out)} configurations from {scaleopt.__file__} -> {args.files[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
