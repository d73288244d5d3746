"""The GPU check's offload part (``tools/gpu_check.py --parts offload``): the offloaded
optimizers and the steps in backward on a model whose float32 AdamW state does not fit a
device-memory cap, measured.

    python tools/gpu_offload.py OUT.json                 # on a CUDA machine
    python tools/gpu_offload.py OUT.json --dry-run       # here: tiny sizes on the CPU

1. Under a cap (``torch.cuda.set_per_process_memory_fraction``) that a bfloat16 model with
   float32 masters and AdamW's float32 moments (16 bytes per parameter) does not fit: torch's
   fused AdamW on float32 masters (expected: out of memory), ``OffloadAdam``,
   ``offload(LAMB)``, ``offload(Muon)`` (int8 state), each ordinary and stepping in backward:
   the peak device bytes per parameter of a whole training step
   (``torch.cuda.max_memory_allocated``) and the step's time.
2. Where both fit (a smaller model, no cap): each offloaded step's time against torch's fused
   AdamW on the device, on the same model.
3. How much of the copies the host's work hides: the step (forward, backward, step) against
   forward and backward alone, the host step alone and the copies alone (every gradient to
   pinned host memory and every weight back): hidden = 1 - (step - forward/backward - host
   step) / copies, clamped to [0, 1].
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import scaleopt  # noqa: E402
from scaleopt.cli.bench_memory import Matrices  # noqa: E402

#: (width, layers) of the capped model and of the model both fit, on a GPU and in a dry run
SIZES = {"gpu": ((4096, 48), (2048, 24)), "dry": ((128, 4), (64, 3))}
#: the device-memory cap, in bytes per parameter of the capped model: above the offloaded
#: steps' need (weights 2, gradients 2, a bucket, activations), below AdamW's 16
CAP_BYTES_PER_PARAM = 7


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peers() -> Dict[str, Callable[[Any], Any]]:
    """The peers that are installed (benchmark extras: carried as wheels to a GPU machine):
    torchao's CPUOffloadOptimizer and 8-bit AdamW, FlashOptim's AdamW, bitsandbytes' 8-bit
    AdamW."""
    out: Dict[str, Callable[[Any], Any]] = {}
    try:
        from torchao.optim import AdamW8bit, CPUOffloadOptimizer

        out["torchao CPUOffloadOptimizer(AdamW)"] = lambda n: CPUOffloadOptimizer(
            [p for _, p in n], torch.optim.AdamW, lr=1e-4, fused=True)
        out["torchao AdamW8bit"] = lambda n: AdamW8bit([p for _, p in n], lr=1e-4)
    except ImportError:
        pass
    try:
        import flashoptim

        out["flashoptim FlashAdamW"] = lambda n: flashoptim.FlashAdamW([p for _, p in n], lr=1e-4)
    except ImportError:
        pass
    try:
        import bitsandbytes

        out["bitsandbytes AdamW8bit"] = lambda n: bitsandbytes.optim.AdamW8bit(
            [p for _, p in n], lr=1e-4)
    except ImportError:
        pass
    return out


def _rows() -> Dict[str, Callable[[Any], Any]]:
    return {
        "torch.AdamW(fused, float32 masters)": None,  # made by _masters_adamw
        "OffloadAdam": lambda n: scaleopt.OffloadAdam(n, lr=1e-4),
        "offload(LAMB, int8)": lambda n: scaleopt.offload(scaleopt.LAMB, n, lr=1e-4,
                                                          state_dtype="int8"),
        "offload(Muon, int8)": lambda n: scaleopt.offload(scaleopt.Muon, n, lr=0.02,
                                                          state_dtype="int8"),
        **_peers(),
    }


class _MastersAdamW:
    """torch's fused AdamW on float32 masters of a bfloat16 model (what mixed precision keeps
    on the device: 16 bytes per parameter with the bfloat16 weights and gradients)."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        self.params = params
        self.masters = [p.detach().float() for p in params]
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.inner = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad.copy_(p.grad)
        self.inner.step()
        torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _make(name: str, model: torch.nn.Module, in_backward: bool) -> Any:
    named = list(model.named_parameters())
    if name.startswith("torch"):
        return _MastersAdamW([p for _, p in named]), None
    opt = _rows()[name](named)
    if in_backward and name.startswith("flashoptim"):  # its own gradient release
        import flashoptim

        flashoptim.enable_gradient_release(model, opt)
        return opt, _Released()
    return opt, scaleopt.step_in_backward(opt) if in_backward else None


class _Released:
    """A peer's own steps in backward: a plain backward steps."""

    def backward(self, closure: Callable[[], torch.Tensor]) -> None:
        closure().backward()


def _modes(name: str) -> tuple:
    """Whether each row of ``name`` steps in backward: ours both ways, FlashOptim's also with
    its own gradient release, the other peers ordinary only."""
    if name.startswith(("offload", "OffloadAdam", "flashoptim")):
        return (False, True)
    return (False,)


def _train_step(model, batch, opt, steps) -> None:
    if steps is not None:
        steps.backward(lambda: model(batch))
        return
    model(batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure(name: str, base: torch.nn.Module, device: str, in_backward: bool,
             rounds: int) -> Dict[str, Any]:
    model = copy.deepcopy(base)
    params = sum(p.numel() for p in model.parameters())
    batch = model.batch(torch.bfloat16).to(device)
    row: Dict[str, Any] = {"row": name + (", in backward" if in_backward else ""),
                           "params": params}
    try:
        opt, steps = _make(name, model, in_backward)
        _train_step(model, batch, opt, steps)  # state made
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        row["step_s"] = _timed(lambda: _train_step(model, batch, opt, steps), device, rounds)
        if device == "cuda":
            row["peak_device_bytes_per_param"] = torch.cuda.max_memory_allocated() / params
        row["fits"] = True
    except torch.OutOfMemoryError:
        row["fits"] = False
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def _hidden(base: torch.nn.Module, device: str, rounds: int) -> Dict[str, Any]:
    """How much of OffloadAdam's copies the host's work hides (see the module doc)."""
    model = copy.deepcopy(base)
    batch = model.batch(torch.bfloat16).to(device)
    opt = scaleopt.OffloadAdam(list(model.named_parameters()), lr=1e-4)
    _train_step(model, batch, opt, None)
    step = _timed(lambda: _train_step(model, batch, opt, None), device, rounds)

    def forward_backward():
        model(batch).backward()
        for p in model.parameters():
            p.grad = None

    fb = _timed(forward_backward, device, rounds)
    model(batch).backward()
    host = _timed(opt.step, device, rounds)  # the copies' waits included once done
    params = list(model.parameters())
    pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=device == "cuda") for p in params]

    def copies():
        for p, h in zip(params, pinned):
            h.copy_(p.grad, non_blocking=True)
        for p, h in zip(params, pinned):
            p.detach().copy_(h, non_blocking=True)

    copy_s = _timed(copies, device, rounds)
    hidden = 1 - (step - fb - host) / copy_s if copy_s > 0 else 0.0
    return {"step_s": step, "forward_backward_s": fb, "host_step_s": host, "copies_s": copy_s,
            "hidden": min(1.0, max(0.0, hidden))}


def run(device: str = "cuda", dry: bool = False, rounds: int = 5) -> Dict[str, Any]:
    (width, layers), (small_w, small_l) = SIZES["dry" if dry else "gpu"]
    torch.manual_seed(0)
    big = Matrices(width, layers).to(device, torch.bfloat16)
    params = sum(p.numel() for p in big.parameters())
    report: Dict[str, Any] = {"kind": "offload", "device": device, "params": params,
                              "torch": torch.__version__, "rounds": rounds}
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        cap = CAP_BYTES_PER_PARAM * params
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        report["cap_bytes"] = cap
    report["capped"] = [_measure(name, big, device, ib, rounds)
                        for name in _rows() for ib in _modes(name)]
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0)
    del big
    small = Matrices(small_w, small_l).to(device, torch.bfloat16)
    both = [_measure(name, small, device, ib, rounds) for name in _rows()
            for ib in _modes(name)]
    base = both[0].get("step_s")
    for row in both:
        if base and row.get("step_s"):
            row["x_device_adamw"] = row["step_s"] / base
    report["both_fit"] = {"params": sum(p.numel() for p in small.parameters()), "rows": both}
    report["hidden"] = _hidden(small, device, rounds)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON report")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny sizes on the CPU: every code path, no GPU numbers")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_offload: no CUDA device (use --dry-run here)", file=sys.stderr)
        return 3
    report = run("cpu" if args.dry_run else "cuda", args.dry_run, args.rounds)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
