"""The fused CPU kernels (``_kernels.c``) for LAMB and LANS, called through ctypes.

They apply to contiguous float32 CPU tensors. When the extension was not built (no compiler at
install time) or ``SCALEOPT_NATIVE=0`` is set, :func:`available` is False and the optimizers run
their PyTorch paths, which compute the same numbers.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _blocks

_lib = None
if os.environ.get("SCALEOPT_NATIVE", "1") != "0":
    try:
        from . import _kernels

        _lib = ctypes.CDLL(_kernels.__file__)
    except (ImportError, OSError):  # not built: the PyTorch paths serve
        _lib = None

if _lib is not None:
    f, i64, i32, dp = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    _lib.lamb_phase1.argtypes = [dp, dp, dp, dp, i64, f, f, f, f, f, f, i32, f, dp, i32]
    _lib.lamb_phase1.restype = None
    _lib.lamb_phase2.argtypes = [dp, dp, dp, i64, f, f, f, f, i32, f, f, f, i32]
    _lib.lamb_phase2.restype = None
    _lib.sum_squares.argtypes = [dp, i64, i32]
    _lib.sum_squares.restype = ctypes.c_double
    _lib.lans_phase1.argtypes = [dp, dp, dp, dp, i64, f, f, f, i32, f, f, f, f, f, f, dp, i32]
    _lib.lans_phase1.restype = None
    _lib.lans_phase2.argtypes = [dp, dp, dp, dp, i64, f, f, f, i32, f, f, f, f, f, f, f, f, i32, i32]
    _lib.lans_phase2.restype = None

_MODES = {"update": 0, "decoupled": 1, "l2": 2}


def available() -> bool:
    return _lib is not None


def applies(*lists: Sequence[Tensor]) -> bool:
    """Whether every tensor is a contiguous float32 CPU tensor (what the kernels take)."""
    return _lib is not None and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
        for ts in lists
        for t in ts
    )


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _ratio(w2: float, u2: float, lower: Optional[float], upper: Optional[float]) -> float:
    """:func:`scaleopt._blocks.trust_ratio` on host scalars (squared norms in, ratio out)."""
    w, u = math.sqrt(w2), math.sqrt(u2)
    if lower is not None:
        w = max(w, lower)
    if upper is not None:
        w = min(w, upper)
    if w > 0 and u > 0 and math.isfinite(w / u):
        return w / u
    return 1.0


def lamb(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lrs, weight_decays, adapt, beta1,
         beta2, eps, weight_decay_mode, bias_correction, lower_bound, upper_bound) -> None:
    """LAMB on the fused kernels: the same update as :func:`scaleopt.lamb.lamb`."""
    threads = torch.get_num_threads()
    mode = _MODES[weight_decay_mode]
    sums = (ctypes.c_double * 2)()
    for i, p in enumerate(params):
        state_steps[i] += 1
        (bc1,), (bc2_sqrt,) = _blocks.bias_corrections(
            [state_steps[i].item()], beta1, beta2, bias_correction
        )
        lr, wd = lrs[i], weight_decays[i]
        n = p.numel()
        pd, g, m, v = p.detach(), grads[i], exp_avgs[i], exp_avg_sqs[i]
        _lib.lamb_phase1(_ptr(pd), _ptr(g), _ptr(m), _ptr(v), n, beta1, beta2, bc1, bc2_sqrt,
                         eps, wd, mode, 1.0 - lr * wd, ctypes.addressof(sums), threads)
        ratio = _ratio(sums[0], sums[1], lower_bound, upper_bound) if adapt[i] else 1.0
        _lib.lamb_phase2(_ptr(pd), _ptr(m), _ptr(v), n, bc1, bc2_sqrt, eps, wd, mode, 1.0 - lr * wd,
                         lr, ratio, threads)


def lans(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lrs, weight_decays, adapt, beta1,
         beta2, eps, bias_correction, lower_bound, upper_bound, clip_grad_value,
         decay_moved_weight) -> None:
    """LANS on the fused kernels: the same update as :func:`scaleopt.lans.lans`."""
    threads = torch.get_num_threads()
    clip = int(clip_grad_value is not None)
    if clip_grad_value is None:
        lo, hi = -math.inf, math.inf
    elif isinstance(clip_grad_value, (tuple, list)):
        lo, hi = clip_grad_value
    else:
        lo, hi = -clip_grad_value, clip_grad_value
    sums = (ctypes.c_double * 4)()
    for i, p in enumerate(params):
        state_steps[i] += 1
        (bc1,), (bc2_sqrt,) = _blocks.bias_corrections(
            [state_steps[i].item()], beta1, beta2, bias_correction
        )
        lr, wd = lrs[i], weight_decays[i]
        n = p.numel()
        pd, g, m, v = p.detach(), grads[i], exp_avgs[i], exp_avg_sqs[i]
        gnorm = math.sqrt(_lib.sum_squares(_ptr(g), n, threads))
        ginv = 1.0 / gnorm if gnorm > 0 else 0.0
        _lib.lans_phase1(_ptr(pd), _ptr(g), _ptr(m), _ptr(v), n, ginv, lo, hi, clip, beta1, beta2, bc1,
                         bc2_sqrt, eps, wd, ctypes.addressof(sums), threads)
        w2, r2, c2, rc = sums[0], sums[1], sums[2], sums[3]
        a, b = lr * beta1, lr * (1.0 - beta1)
        ratio_r = _ratio(w2, r2, lower_bound, upper_bound) if adapt[i] else 1.0
        if decay_moved_weight:
            # c' = c - wd*a*ratio_r*r, so ||c'||^2 follows from the sums of phase 1
            k = wd * a * ratio_r
            c2 = max(c2 - 2.0 * k * rc + k * k * r2, 0.0)
        ratio_c = _ratio(w2, c2, lower_bound, upper_bound) if adapt[i] else 1.0
        _lib.lans_phase2(_ptr(pd), _ptr(g), _ptr(m), _ptr(v), n, ginv, lo, hi, clip, bc1, bc2_sqrt, eps,
                         wd, a, b, ratio_r, ratio_c, int(decay_moved_weight), threads)
