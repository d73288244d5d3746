"""How far a reader follows one optimizer step: the scaleopt functions ``opt.step()`` enters,
the files they are in, how deep the calls go, the calls from other modules back into the
optimizer's own module, and the generator frames resumed (``sys.setprofile`` over one step
after three warm-up steps of a small float32 model; on the C kernels where they are built).

    python tools/trace_step.py                  # LAMB, LANS, AdamW, Muon, and torch's AdamW
    python tools/trace_step.py LAMB --list      # and the functions, by file

The counts are the same on every run of the same code (they count calls, not time).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import pathlib
import sys
from typing import Any, Dict

import torch

import scaleopt

PACKAGE = pathlib.Path(scaleopt.__file__).resolve().parent
TORCH_OPTIM = pathlib.Path(torch.optim.__file__).resolve().parent


def make(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "torch.AdamW":
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)
    return getattr(scaleopt, name)(params, lr=1e-3, weight_decay=0.01)


def trace(name: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 8))
    opt = make(name, model.parameters())
    x = torch.randn(32, 64)

    def backward() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()

    for _ in range(3):
        backward()
        opt.step()
    backward()
    root = TORCH_OPTIM if name.startswith("torch.") else PACKAGE
    own = pathlib.Path(inspect.getfile(type(opt))).resolve()
    functions: Dict[str, set] = collections.defaultdict(set)
    counts = collections.Counter()
    depth = [0, 0]  # now, deepest

    def profile(frame: Any, event: str, arg: Any) -> None:
        path = pathlib.Path(frame.f_code.co_filename)
        inside = root in path.parents or path.parent == root
        if event == "call" and inside:
            functions[str(path.relative_to(root.parent))].add(frame.f_code.co_name)
            if frame.f_code.co_flags & inspect.CO_GENERATOR and frame.f_lasti >= 0:
                counts["generator resumes"] += 1
            caller = frame.f_back
            if (path == own and caller is not None
                    and pathlib.Path(caller.f_code.co_filename) != own
                    and (root in pathlib.Path(caller.f_code.co_filename).parents)):
                counts["calls back into the optimizer's module"] += 1
            depth[0] += 1
            depth[1] = max(depth)
        elif event == "return" and inside:
            depth[0] -= 1

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return {"functions": sum(len(v) for v in functions.values()), "files": len(functions),
            "depth": depth[1], **counts, "by file": {k: sorted(v) for k, v in functions.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=["LAMB", "LANS", "AdamW", "Muon", "torch.AdamW"])
    ap.add_argument("--list", action="store_true", help="the functions entered, by file")
    args = ap.parse_args()
    print(f"C kernels built: {scaleopt._native.available()}")
    print(f"{'optimizer':12s} {'functions':>9s} {'files':>5s} {'depth':>5s} "
          f"{'calls back':>10s} {'generator resumes':>17s}")
    for name in args.names:
        r = trace(name)
        print(f"{name:12s} {r['functions']:9d} {r['files']:5d} {r['depth']:5d} "
              f"{r.get('calls back into the optimizer' + chr(39) + 's module', 0):10d} "
              f"{r.get('generator resumes', 0):17d}")
        if args.list:
            for path, names in sorted(r["by file"].items()):
                print(f"    {path}: {', '.join(names)}")


if __name__ == "__main__":
    main()
