"""The fused CPU kernels (``_kernels.c``) for LAMB, LANS and Adam, called through ctypes.

They apply to contiguous float32 CPU tensors. When the extension was not built (no compiler at
install time) or ``SCALEOPT_NATIVE=0`` is set, :func:`available` is False and the optimizers run
their PyTorch paths, which compute the same numbers.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence, Tuple

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
    for _name in ("lamb_phase1", "lamb_phase1_bf16g"):
        getattr(_lib, _name).argtypes = [dp, dp, dp, f, i32, f, f, dp, dp, i64, f, f, f, f, f, f,
                                         i32, f, dp, i32]
        getattr(_lib, _name).restype = None
    _lib.lamb_phase2.argtypes = [dp, dp, dp, i64, f, f, f, f, i32, f, f, f, dp, i32, i32]
    _lib.lamb_phase2.restype = None
    for _name in ("sum_squares", "sum_squares_bf16"):
        getattr(_lib, _name).argtypes = [dp, i64, i32]
        getattr(_lib, _name).restype = ctypes.c_double
    for _name in ("lans_phase1", "lans_phase1_bf16g"):
        getattr(_lib, _name).argtypes = [dp, dp, dp, dp, dp, i64, f, f, f, i32, f, f, f, f, f, f, dp,
                                         i32]
        getattr(_lib, _name).restype = None
    for _name in ("lans_phase2", "lans_phase2_bf16g"):
        getattr(_lib, _name).argtypes = [dp, dp, dp, dp, i64, f, f, f, i32, f, f, f, f, f, f, f, f,
                                         i32, dp, i32, i32]
        getattr(_lib, _name).restype = None
    d = ctypes.c_double
    _multi = [i64] + [dp] * 12 + [d, d, f, i32, i32, d, i32, d, i32]
    _lib.lamb_multi.argtypes = _multi + [i32, i32, f, f]
    _lib.lamb_multi.restype = None
    _lib.lans_multi.argtypes = _multi + [i32, f, f, i32, dp]
    _lib.lans_multi.restype = None
    _lib.adam_multi.argtypes = [i64] + [dp] * 12 + [f] * 6 + [i32, i32]
    _lib.adam_multi.restype = None
    _lib.select_above.argtypes = [dp, i64, f, dp, i64]
    _lib.select_above.restype = i64
    for _name in ("any_nonfinite", "any_nonfinite_bf16"):
        getattr(_lib, _name).argtypes = [dp, i64, i32]
        getattr(_lib, _name).restype = i32

_MODES = {"update": 0, "decoupled": 1, "l2": 2}


def available() -> bool:
    return _lib is not None


def _cpu_contiguous(t: Tensor, dtypes) -> bool:
    return t.is_cpu and t.dtype in dtypes and t.is_contiguous()


def sums_of_squares(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """Each tensor's sum of squares (float64 vector) by the kernel LANS's first pass uses, for
    contiguous float32 and bfloat16 CPU tensors; None for others (or without the kernels)."""
    if _lib is None or not all(_cpu_contiguous(t, (torch.float32, torch.bfloat16))
                               for t in tensors):
        return None
    threads = torch.get_num_threads()

    def sum_squares(t: Tensor) -> float:
        fn = _lib.sum_squares_bf16 if t.dtype == torch.bfloat16 else _lib.sum_squares
        return fn(t.data_ptr(), t.numel(), threads)

    return torch.tensor([sum_squares(t) for t in tensors], dtype=torch.float64)


def applies(work: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
            exp_avg_sqs: Sequence[Tensor], low: Sequence[Optional[Tensor]]) -> bool:
    """Whether the LAMB/LANS kernels take these tensors: what :func:`adam_applies` takes, except
    a bfloat16 gradient for a float32 weight that is no master (no ``low``)."""
    return _lib is not None and all(
        adam_applies(w, g, m, v, lp)
        and not (lp is None and w.dtype == torch.float32 and g.dtype != torch.float32)
        for w, g, m, v, lp in zip(work, grads, exp_avgs, exp_avg_sqs, low))


def _tensor_table(params, grads, exp_avgs, exp_avg_sqs, low, state_steps):
    """What the ``*_multi`` kernels read per tensor: an int64 table whose rows are the
    addresses of the weights, gradients, moments, ``low`` tensors (0 for None), the element
    counts and the step counters, and the int32 kinds (bit 0: bfloat16 gradient, bit 1:
    bfloat16 weight, i.e. a split master)."""
    ptrs = torch.tensor(
        [[t.data_ptr() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
        + [[0 if t is None else t.data_ptr() for t in low], [t.numel() for t in params],
           [t.data_ptr() for t in state_steps]],
        dtype=torch.int64,
    )
    kind = torch.tensor([int(g.dtype == torch.bfloat16) + 2 * int(p.dtype == torch.bfloat16)
                         for p, g in zip(params, grads)], dtype=torch.int32)
    return ptrs, kind


def _run_multi(kernel, extra, params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lrs,
               weight_decays, adapt, low, beta1, beta2, eps, bias_correction, lower_bound,
               upper_bound, gmul=None) -> None:
    """Call a ``*_multi`` kernel on every tensor: per-tensor arrays (built as tensors, alive
    until the call returns), the group's scalars, then the kernel's own ``extra`` arguments.
    ``gmul`` (per tensor, or None for ones): the scalar each gradient is taken times."""
    count = len(params)
    if count == 0:
        return
    ptrs, kind = _tensor_table(params, grads, exp_avgs, exp_avg_sqs, low or [None] * count,
                               state_steps)
    rates = torch.tensor([list(lrs), list(weight_decays)], dtype=torch.float64)
    flags = torch.tensor([int(bool(a)) for a in adapt], dtype=torch.int32)
    mults = None if gmul is None else torch.tensor(list(gmul), dtype=torch.float32)
    row, rrow = ptrs.data_ptr(), rates.data_ptr()
    kernel(count, row, row + 8 * count, None if mults is None else mults.data_ptr(),
           *(row + 8 * count * k for k in range(2, 6)), kind.data_ptr(), row + 8 * count * 6,
           rrow, rrow + 8 * count, flags.data_ptr(), beta1, beta2, eps, int(bias_correction),
           int(lower_bound is not None), lower_bound or 0.0, int(upper_bound is not None),
           upper_bound or 0.0, torch.get_num_threads(), *extra)


@torch.compiler.disable  # host code calling C: nothing for dynamo to trace
def lamb(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, weight_decay_mode,
         clip_grad_value=None, **options) -> None:
    """LAMB on the fused kernels, all tensors in one call: the same update as
    :func:`scaleopt.lamb.lamb` (options: ``lrs``, ``weight_decays``, ``adapt``, ``beta1``,
    ``beta2``, ``eps``, ``bias_correction``, ``lower_bound``, ``upper_bound``, ``low``, ``gmul``).

    ``low[i]``, when given, is the bfloat16 parameter whose float32 master is ``params[i]``:
    it receives the rounded weights in the same pass. A bfloat16 ``params[i]`` is a split
    master, whose lower halves are ``low[i]`` (int16). ``gmul[i]``, when given, is the scalar
    ``grads[i]`` is taken times (sign, rescaling and clipping factors, see
    ``ScaleOptimizer._intake``): the gradients are read as they are, never copied; with
    ``clip_grad_value`` the product is then clamped (LAMB's element-wise clipping)."""
    options.setdefault("low", None)
    lo, hi = _blocks.clip_bounds(clip_grad_value)
    extra = (_MODES[weight_decay_mode], int(clip_grad_value is not None), lo, hi)
    _run_multi(_lib.lamb_multi, extra, params, grads, exp_avgs, exp_avg_sqs, state_steps,
               **options)


@torch.compiler.disable
def lans(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, clip_grad_value,
         decay_moved_weight, grad_sq_sums=None, **options) -> None:
    """LANS on the fused kernels, all tensors in one call: the same update as
    :func:`scaleopt.lans.lans` (options, ``low`` and ``gmul`` as in :func:`lamb`).
    ``grad_sq_sums``: the gradients' sums of squares from :func:`sums_of_squares`, when already
    computed (for clipping): LANS's own pass over the gradients for their norms is skipped."""
    options.setdefault("low", None)
    lo, hi = _blocks.clip_bounds(clip_grad_value)
    sq = None if grad_sq_sums is None else grad_sq_sums.contiguous()
    extra = (int(clip_grad_value is not None), lo, hi, int(decay_moved_weight),
             None if sq is None else sq.data_ptr())
    _run_multi(_lib.lans_multi, extra, params, grads, exp_avgs, exp_avg_sqs, state_steps,
               **options)


def adam_applies(work: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                 low: Optional[Tensor]) -> bool:
    """Whether :func:`adam` takes this tensor: float32 moments, contiguous on the CPU; a float32
    or bfloat16 gradient; and either a float32 weight with an optional bfloat16 copy ``low``, or
    split storage: a bfloat16 weight with the int16 low halves of its master in ``low``."""
    if _lib is None:
        return False
    if not (_cpu_contiguous(exp_avg, _F32) and _cpu_contiguous(exp_avg_sq, _F32)):
        return False
    if not grad_applies(grad):
        return False
    if work.dtype == torch.bfloat16:
        return _cpu_contiguous(work, _BF16) and low is not None and _cpu_contiguous(low, _INT16)
    if not _cpu_contiguous(work, _F32):
        return False
    return low is None or _cpu_contiguous(low, _BF16)


def grad_applies(grad: Tensor) -> bool:
    """Whether :func:`adam` reads this gradient: float32 or bfloat16, contiguous, on the CPU."""
    return _cpu_contiguous(grad, _ADAM_GRADS)


_F32, _BF16, _INT16 = (torch.float32,), (torch.bfloat16,), (torch.int16,)
_ADAM_GRADS = (torch.float32, torch.bfloat16)


def split_join(hi: Tensor, lo: Tensor) -> Tensor:
    """The float32 master held as a bfloat16 ``hi`` (the master rounded to nearest, ties away
    from zero) and int16 ``lo`` (its low 16 bits), as the kernels store it (see ``_kernels.c``)."""
    h = hi.view(torch.int16).to(torch.int32) & 0xFFFF
    low = lo.to(torch.int32) & 0xFFFF
    top = (h - (low >> 15)) & 0xFFFF
    bits = (top.to(torch.int64) << 16) | low.to(torch.int64)
    bits = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32
    return bits.to(torch.int32).view(torch.float32)


def split_(master: Tensor, hi: Tensor, lo: Tensor) -> None:
    """Store a float32 ``master`` exactly as ``hi`` and ``lo`` (the inverse of :func:`split_join`)."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    top = ((bits + 0x8000) >> 16) & 0xFFFF
    low = bits & 0xFFFF
    hi.copy_((top - (top >= 2 ** 15).to(torch.int64) * 2 ** 16).to(torch.int16).view(torch.bfloat16))
    lo.copy_((low - (low >= 2 ** 15).to(torch.int64) * 2 ** 16).to(torch.int16))


@torch.compiler.disable
def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], low: Sequence[Optional[Tensor]],
         state_steps: Sequence[Tensor], *,
         step_sizes: Sequence[float], bias_correction2_sqrts: Sequence[float],
         weight_decays_l2: Sequence[float], decays: Sequence[float], beta1: float, beta2: float,
         eps: float, grad_multiplier: float, nesterov: bool = False,
         one_minus_betas: Optional[Tuple[float, float]] = None, threads: int) -> None:
    """One Adam step on each tensor, one pass over memory each (see ``_kernels.c``), in one
    call. For a float32 ``params[i]``, ``low[i]``, when given, receives the rounded bfloat16
    weights; for a bfloat16 ``params[i]`` (split storage), ``low[i]`` holds the master's low
    halves.
    ``one_minus_betas`` overrides ``(1-beta1, 1-beta2)`` (computed in double by default).
    Each ``state_steps[i]`` (a float32 CPU scalar) is incremented; the scalars given are those
    of the incremented step."""
    count = len(params)
    if count == 0:
        return
    ptrs, kind = _tensor_table(params, grads, exp_avgs, exp_avg_sqs, low, state_steps)
    scalars = torch.tensor([list(step_sizes), list(bias_correction2_sqrts), list(weight_decays_l2),
                            list(decays)], dtype=torch.float32)
    omb1, omb2 = one_minus_betas or (1.0 - beta1, 1.0 - beta2)
    row = ptrs.data_ptr()
    srow = scalars.data_ptr()
    _lib.adam_multi(count, *(row + 8 * count * k for k in range(5)), row + 8 * count * 5,
                    kind.data_ptr(), row + 8 * count * 6, *(srow + 4 * count * k for k in range(4)),
                    beta1, omb1, beta2, omb2, eps, grad_multiplier, int(nesterov),
                    threads)


def any_nonfinite(t: Tensor, threads: int) -> bool:
    """Whether a tensor holds an inf or NaN (one read pass; kernels for contiguous float32 and
    bfloat16 CPU tensors, torch otherwise)."""
    if _lib is not None and t.device.type == "cpu" and t.is_contiguous():
        if t.dtype == torch.float32:
            return bool(_lib.any_nonfinite(t.data_ptr(), t.numel(), threads))
        if t.dtype == torch.bfloat16:
            return bool(_lib.any_nonfinite_bf16(t.data_ptr(), t.numel(), threads))
    return not bool(torch.isfinite(t).all())


def select_above(v: Tensor, threshold: float, capacity: int) -> Optional[Tensor]:
    """Indices of ``|v| >= threshold`` in a flat tensor, in one pass (the kernel, for contiguous
    float32 CPU tensors; torch otherwise). None when there are more than ``capacity``."""
    if _lib is not None and _cpu_contiguous(v, _F32):
        out = torch.empty(capacity, dtype=torch.int64)
        count = _lib.select_above(v.data_ptr(), v.numel(), threshold, out.data_ptr(), capacity)
        return out[:count] if count <= capacity else None
    idx = torch.nonzero(v.abs() >= threshold).flatten()
    return idx if idx.numel() <= capacity else None
