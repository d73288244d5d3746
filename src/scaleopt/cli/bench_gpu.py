"""LAMB and LANS on a GPU: step time as paired ratios to torch.optim.AdamW(fused=True).

    scaleopt bench --device cuda                       # BERT-base shapes (109.5M), float32
    scaleopt bench --device cuda --size 1b --dtype bfloat16

Each candidate steps on its own copy of the parameter set (with gradients), interleaved round
by round with a fused AdamW on another copy; only the two are in memory at a time. The
candidates: scaleopt's LAMB and LANS by the Triton kernels (with float32 and with int8 moments),
by torch's multi-tensor ops, and by the multi-tensor ops under ``torch.compile``, and timm's
Lamb where installed; with
``--dtype bfloat16``, the parameters are bfloat16 and scaleopt keeps float32 masters
(``master_weights=True``; split masters on the Triton path). Per candidate: the median step
time (CUDA events) and the median over rounds of its ratio to the fused AdamW; the host time of
a step (until ``step()`` returns, launches queued, before the GPU is done); the achieved
bandwidth, the bytes the algorithm must move per parameter over the step time, against a
device-to-device copy measured in the same run; the peak memory the candidate adds, and the
bytes of state (moments, scales, masters' extra halves) it holds per parameter.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

import scaleopt

from ..benchmarking import NO_DECAY, held_bytes, interleaved, make_params, paired_ratio, sync

#: the bytes each algorithm must move per parameter in one step: float32 (parameters,
#: gradients, moments), and bfloat16 parameters and gradients with split float32 masters
#: (AdamW: bfloat16 moments); "-int8": the moments as int8 codes (their scales not counted);
#: see docs/gpu.md
FLOOR_BYTES = {("adamw", "float32"): 28, ("adamw-int8", "float32"): 16,
               ("lamb", "float32"): 40, ("lans", "float32"): 48,
               ("lamb-int8", "float32"): 26, ("lans-int8", "float32"): 30,
               ("adamw", "bfloat16"): 14, ("lamb", "bfloat16"): 38, ("lans", "bfloat16"): 42,
               ("lamb-int8", "bfloat16"): 22, ("lans-int8", "bfloat16"): 24}

BASELINE = "torch.AdamW(fused=True)"


def _layerwise(cls: type, masters: bool, **options: Any) -> Callable:
    return lambda named: cls(named, lr=1e-3, exclude_from_weight_decay=NO_DECAY,
                             master_weights=masters, **options)


def candidates(dtype: torch.dtype) -> Dict[str, Tuple[Callable, bool, str]]:
    """name -> (make(named params) -> optimizer, compile its step, algorithm)."""
    masters = dtype != torch.float32
    rows: Dict[str, Tuple[Callable, bool, str]] = {
        BASELINE: (lambda n: torch.optim.AdamW([p for _, p in n], lr=1e-3, fused=True),
                   False, "adamw")}
    for cls in (scaleopt.LAMB, scaleopt.LANS):
        kind = cls.__name__.lower()
        rows[f"scaleopt.{cls.__name__}(triton)"] = (
            _layerwise(cls, masters, implementation="triton"), False, kind)
        rows[f"scaleopt.{cls.__name__}(triton, int8 state)"] = (
            _layerwise(cls, masters, implementation="triton", state_dtype="int8"), False,
            f"{kind}-int8")
        rows[f"scaleopt.{cls.__name__}(multi-tensor)"] = (
            _layerwise(cls, masters, foreach=True), False, kind)
        rows[f"scaleopt.{cls.__name__}(multi-tensor, compiled)"] = (
            _layerwise(cls, masters, foreach=True), True, kind)
    if not masters:  # AdamW on the Triton kernel: float32 parameters (it keeps no masters)
        for state, kind in (("float32", "adamw"), ("int8", "adamw-int8")):
            name = "scaleopt.AdamW(triton" + (", int8 state)" if state == "int8" else ")")
            rows[name] = (lambda n, state=state: scaleopt.AdamW(
                n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, implementation="triton",
                state_dtype=state), False, kind)
    try:
        from timm.optim import Lamb as TimmLamb

        rows["timm.optim.Lamb"] = (lambda n: TimmLamb([p for _, p in n], lr=1e-3), False, "lamb")
    except Exception:
        pass
    return rows


def _timed(step: Callable[[], Any], device: str) -> Tuple[float, float]:
    """(device seconds, host seconds) of one step."""
    sync(device)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0
    return host, host


def copy_bandwidth(nbytes: int, device: str, rounds: int = 10) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read and write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(_timed(lambda: dst.copy_(src), device)[0] for _ in range(rounds))
    return 2 * src.numel() * 4 / seconds


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def time_pair(shapes, name: str, row: Tuple[Callable, bool, str], dtype: torch.dtype,
              device: str, rounds: int) -> Dict[str, Any]:
    """One candidate against the fused AdamW, interleaved over ``rounds`` (after 3 warm-up
    steps each: state, compilation)."""
    make, compiled, kind = row
    base_params = make_params(shapes, dtype, device)
    base = torch.optim.AdamW([p for _, p in base_params], lr=1e-3, fused=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = _peak()
    named = make_params(shapes, dtype, device)
    opt = make(named)
    step = torch.compile(opt.step) if compiled else opt.step
    measured = interleaved({"base": base.step, name: step}, rounds, warmup=3,
                           timer=lambda s: _timed(s, device))
    base_times = [seconds for seconds, _ in measured["base"]]
    times, hosts = (list(x) for x in zip(*measured[name]))
    model, state = held_bytes(opt, named)
    numel = sum(p.numel() for _, p in named)
    return {"optimizer": name, "median_s": statistics.median(times),
            "ratio": paired_ratio(times, base_times), "host_s": statistics.median(hosts),
            "algorithm": kind, "peak_bytes_added": _peak() - before,
            "model_bytes_per_param": model / numel, "state_bytes_per_param": state / numel}


def run(shapes, label: str, dtype_name: str, device: str, rounds: int,
        only: List[str] = ()) -> Dict[str, Any]:
    """Time the candidates (``only``: those whose name contains one of these, and the fused
    AdamW against itself); print the table; return the results."""
    dtype = getattr(torch, dtype_name)
    nparams = sum(torch.Size(s).numel() for _, s in shapes)
    copy = copy_bandwidth(4 * nparams, device)
    rows = candidates(dtype)
    chosen = [k for k in rows if k == BASELINE or not only or any(o in k for o in only)]
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu (interpreter)"
    print(f"BERT-like {label} set: {nparams / 1e6:.1f}M parameters in {len(shapes)} tensors, "
          f"{dtype_name}; {name}, torch {torch.__version__}, {rounds} rounds")
    print(f"device-to-device copy: {copy / 1e9:.0f} GB/s")
    print(f"{'optimizer':42s} {'median ms':>9s} {'x fused AdamW':>13s} {'host ms':>8s} "
          f"{'GB/s':>6s} {'% of copy':>9s} {'+peak MiB':>9s} {'state B/p':>9s}")
    out = []
    for key in chosen:
        r = time_pair(shapes, key, rows[key], dtype, device, rounds)
        r["bytes_per_param"] = FLOOR_BYTES[(r["algorithm"], dtype_name)]
        r["gb_per_s"] = r["bytes_per_param"] * nparams / r["median_s"] / 1e9
        r["fraction_of_copy"] = r["gb_per_s"] * 1e9 / copy
        out.append(r)
        print(f"{key:42s} {r['median_s'] * 1e3:9.2f} {r['ratio']:13.2f} {r['host_s'] * 1e3:8.2f} "
              f"{r['gb_per_s']:6.0f} {100 * r['fraction_of_copy']:8.0f}% "
              f"{r['peak_bytes_added'] / 2**20:9.0f} {r['state_bytes_per_param']:9.2f}")
    return {"params": nparams, "tensors": len(shapes), "dtype": dtype_name, "device": name,
            "torch": torch.__version__, "rounds": rounds, "copy_bytes_per_s": copy, "rows": out}
