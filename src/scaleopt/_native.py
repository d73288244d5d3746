"""The fused CPU kernels (``_kernels.c``) for LAMB, LANS and Adam, called through ctypes.

They apply to contiguous float32 CPU tensors. When the extension was not built (no compiler at
install time) or ``SCALEOPT_NATIVE=0`` is set, :func:`available` is False and the optimizers run
their PyTorch paths, which compute the same numbers.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_double, c_float, c_int32, c_int64, c_void_p
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _blocks
from ._compile import eager
from ._sharding import Steps

_TENSOR_FIELDS = [("w", c_void_p), ("g", c_void_p), ("m", c_void_p), ("v", c_void_p),
                  ("low", c_void_p), ("step", c_void_p), ("n", c_int64), ("kind", c_int32),
                  ("gmul", c_float)]


class LayerwiseTensor(ctypes.Structure):
    """One tensor of a LAMB/LANS call (``LayerwiseTensor`` in ``_kernels.c``)."""

    _fields_ = _TENSOR_FIELDS + [("lr", c_double), ("wd", c_double), ("gsq", c_double),
                                 ("adapt", c_int32)]


class LayerwiseConfig(ctypes.Structure):
    """A LAMB/LANS call's group options (``LayerwiseConfig`` in ``_kernels.c``)."""

    _fields_ = [("beta1", c_double), ("beta2", c_double), ("lower", c_double),
                ("upper", c_double), ("eps", c_float), ("clip_lo", c_float), ("clip_hi", c_float),
                ("bias_correction", c_int32), ("has_lower", c_int32), ("has_upper", c_int32),
                ("clip", c_int32), ("nthreads", c_int32), ("mode", c_int32), ("moved", c_int32)]


class AdamTensor(ctypes.Structure):
    """One tensor of an Adam call (``AdamTensor`` in ``_kernels.c``)."""

    _fields_ = _TENSOR_FIELDS + [("step_size", c_float), ("bc2_sqrt", c_float),
                                 ("wd_l2", c_float), ("decay", c_float)]


class AdamConfig(ctypes.Structure):
    """An Adam call's group options (``AdamConfig`` in ``_kernels.c``)."""

    _fields_ = [("beta1", c_float), ("one_m_b1", c_float), ("beta2", c_float),
                ("one_m_b2", c_float), ("eps", c_float), ("nesterov", c_int32),
                ("nthreads", c_int32)]


#: The structs in the order ``struct_layout()`` (C) numbers them.
STRUCTS = (LayerwiseTensor, LayerwiseConfig, AdamTensor, AdamConfig)

_COUNT_AND_THREADS = [c_void_p, c_int64, c_int32]
_LAYERWISE = [POINTER(LayerwiseTensor), c_int64, POINTER(LayerwiseConfig)]
#: Every C function called from Python: name -> (restype, argtypes). ``tests/test_native.py``
#: checks each against its declaration in ``_kernels.c``.
SIGNATURES = {
    "lamb_multi": (None, _LAYERWISE),
    "lamb_multi_sums": (None, _LAYERWISE + [c_void_p]),
    "lamb_multi_apply": (None, _LAYERWISE + [c_void_p]),
    "lans_multi": (None, _LAYERWISE),
    "lans_multi_sums": (None, _LAYERWISE + [c_void_p]),
    "lans_multi_apply": (None, _LAYERWISE + [c_void_p]),
    "adam_multi": (None, [POINTER(AdamTensor), c_int64, POINTER(AdamConfig)]),
    "sum_squares": (c_double, _COUNT_AND_THREADS),
    "sum_squares_bf16": (c_double, _COUNT_AND_THREADS),
    "any_nonfinite": (c_int32, _COUNT_AND_THREADS),
    "any_nonfinite_bf16": (c_int32, _COUNT_AND_THREADS),
    "select_above": (c_int64, [c_void_p, c_int64, c_float, c_void_p, c_int64]),
    "struct_layout": (c_int64, [c_int32, c_void_p]),
}

_lib = None
if os.environ.get("SCALEOPT_NATIVE", "1") != "0":
    try:
        from . import _kernels

        _lib = ctypes.CDLL(_kernels.__file__)
    except (ImportError, OSError):  # not built: the PyTorch paths serve
        _lib = None

if _lib is not None:
    for _name, (_restype, _argtypes) in SIGNATURES.items():
        getattr(_lib, _name).restype = _restype
        getattr(_lib, _name).argtypes = _argtypes


def struct_layout(struct: type) -> Tuple[int, ...]:
    """``(sizeof, offsets of the fields...)`` of a struct as the C side lays it out."""
    out = (c_int64 * 32)()
    count = _lib.struct_layout(STRUCTS.index(struct), ctypes.addressof(out))
    return tuple(out[:count])


_MODES = {"update": 0, "decoupled": 1, "l2": 2}


def available() -> bool:
    return _lib is not None


def _cpu_contiguous(t: Tensor, dtypes) -> bool:
    """Whether the kernels may address ``t``'s memory as ``numel()`` elements of its dtype from
    ``data_ptr()``: a plain tensor (not a subclass such as a DTensor), strided, contiguous, on
    the CPU, of one of ``dtypes``."""
    return (type(t) in _PLAIN_TYPES and t.layout == torch.strided and t.is_cpu
            and t.dtype in dtypes and t.is_contiguous())


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def sum_squares(t: Tensor, threads: int) -> float:
    """The sum of squares of a contiguous float32 or bfloat16 CPU tensor, as LANS's first pass
    computes it: float partial sums over blocks of 2048 elements, added in double."""
    fn = _lib.sum_squares_bf16 if t.dtype == torch.bfloat16 else _lib.sum_squares
    return fn(t.data_ptr(), t.numel(), threads)


def sums_of_squares(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """Each tensor's sum of squares (float64 vector) by :func:`sum_squares`, for contiguous
    float32 and bfloat16 CPU tensors; None for others (or without the kernels)."""
    if _lib is None or not all(_cpu_contiguous(t, (torch.float32, torch.bfloat16))
                               for t in tensors):
        return None
    threads = torch.get_num_threads()
    return torch.tensor([sum_squares(t, threads) for t in tensors], dtype=torch.float64)


def applies(weights: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
            exp_avg_sqs: Sequence[Tensor], low: Sequence[Optional[Tensor]]) -> bool:
    """Whether the LAMB/LANS kernels take these tensors: what :func:`adam_applies` takes, except
    a bfloat16 gradient for a float32 weight that is no master (no ``low``)."""
    return _lib is not None and all(
        adam_applies(w, g, m, v, lo)
        and not (lo is None and w.dtype == torch.float32 and g.dtype != torch.float32)
        for w, g, m, v, lo in zip(weights, grads, exp_avgs, exp_avg_sqs, low))


def _kind(weight: Tensor, grad: Tensor) -> int:
    """Bit 0: a bfloat16 gradient; bit 1: a bfloat16 weight, i.e. a split master."""
    return int(grad.dtype == torch.bfloat16) + 2 * int(weight.dtype == torch.bfloat16)


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _layerwise_tensors(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, lrs,
                       weight_decays, adapt, low=None, grad_multipliers=None,
                       grad_sq_sums=None):
    """The per-tensor array of a ``lamb_multi`` / ``lans_multi`` call. ``grad_multipliers``
    (per tensor, or None for ones): the scalar each gradient is taken times; ``grad_sq_sums``: the
    gradients' sums of squares where already computed (LANS)."""
    count = len(params)
    low = low or [None] * count
    mults = [1.0] * count if grad_multipliers is None else grad_multipliers
    gsq = [-1.0] * count if grad_sq_sums is None else grad_sq_sums.tolist()
    return (LayerwiseTensor * count)(*[
        LayerwiseTensor(w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), _ptr(lo),
                        s.data_ptr(), w.numel(), _kind(w, g), gm, lr, wd, sq, int(bool(a)))
        for w, g, m, v, lo, s, gm, lr, wd, sq, a in zip(
            params, grads, exp_avgs, exp_avg_sqs, low, state_steps, mults, lrs, weight_decays,
            gsq, adapt)])


def _layerwise_config(*, beta1, beta2, eps, bias_correction, lower_bound, upper_bound,
                      clip_grad_value, mode=0, moved=False) -> LayerwiseConfig:
    lo, hi = _blocks.clip_bounds(clip_grad_value)
    return LayerwiseConfig(
        beta1=beta1, beta2=beta2, lower=lower_bound or 0.0, upper=upper_bound or 0.0, eps=eps,
        clip_lo=lo, clip_hi=hi, bias_correction=int(bias_correction),
        has_lower=int(lower_bound is not None), has_upper=int(upper_bound is not None),
        clip=int(clip_grad_value is not None), nthreads=torch.get_num_threads(), mode=mode,
        moved=int(moved))


_LAYERWISE_ARRAYS = ("lrs", "weight_decays", "adapt", "low", "grad_multipliers", "grad_sq_sums")


class _LayerwiseCall:
    """The arguments of a ``lamb_*`` / ``lans_*`` kernel call over a group's tensors."""

    @eager
    def __init__(self, name, params, grads, exp_avgs, exp_avg_sqs, state_steps, **options):
        arrays = {k: options.pop(k) for k in _LAYERWISE_ARRAYS if k in options}
        self.name, self.count = name, len(params)
        self.tensors = _layerwise_tensors(params, grads, exp_avgs, exp_avg_sqs, state_steps,
                                          **arrays)
        self.config = ctypes.byref(_layerwise_config(**options))

    @eager  # host code calling C: nothing for dynamo to trace
    def whole(self) -> None:
        """``{name}_multi``: both passes, one tensor after the other."""
        getattr(_lib, f"{self.name}_multi")(self.tensors, self.count, self.config)

    @eager
    def sums(self, per_tensor: int) -> Tensor:
        """``{name}_multi_sums``: the first pass over all tensors; ``per_tensor`` sums each."""
        out = torch.zeros(self.count * per_tensor, dtype=torch.float64)
        getattr(_lib, f"{self.name}_multi_sums")(self.tensors, self.count, self.config,
                                                 out.data_ptr())
        return out

    @eager
    def apply(self, totals: Tensor) -> None:
        """``{name}_multi_apply``: the second pass, on the sums totalled over the shards."""
        totals = totals.contiguous()
        getattr(_lib, f"{self.name}_multi_apply")(self.tensors, self.count, self.config,
                                                  totals.data_ptr())


def _layerwise_steps(name, sums_per_tensor, params, grads, exp_avgs, exp_avg_sqs, state_steps,
                     shard_sums=None, **options) -> Steps:
    """``{name}_multi`` on all tensors, or, for the local pieces of sharded tensors (with
    ``shard_sums``, see ``scaleopt._sharding``), ``{name}_multi_sums`` on all, the sums
    totalled over the pieces (the one :class:`~scaleopt._sharding.Reduction` this yields), and
    ``{name}_multi_apply``."""
    if not params:
        return
    call = _LayerwiseCall(name, params, grads, exp_avgs, exp_avg_sqs, state_steps, **options)
    if shard_sums is None:
        call.whole()
        return
    owners = [t for t in range(call.count) for _ in range(sums_per_tensor)]
    call.apply((yield shard_sums.request(call.sums(sums_per_tensor), owners)))


def lamb_steps(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, weight_decay_mode,
               clip_grad_value=None, **options) -> Steps:
    """LAMB on the fused kernels, all tensors in one call: the same update as
    :func:`scaleopt.lamb.lamb` (options: ``lrs``, ``weight_decays``, ``adapt``, ``beta1``,
    ``beta2``, ``eps``, ``bias_correction``, ``lower_bound``, ``upper_bound``, ``low``,
    ``grad_multipliers``), as steps (see ``scaleopt._sharding``).

    ``low[i]``, when given, is the bfloat16 parameter whose float32 master is ``params[i]``:
    it receives the rounded weights in the same pass. A bfloat16 ``params[i]`` is a split
    master, whose lower halves are ``low[i]`` (int16). ``grad_multipliers[i]``, when given, is
    the scalar ``grads[i]`` is taken times (sign, rescaling and clipping factors, see
    ``ScaleOptimizer._intake``): the gradients are read as they are, never copied; with
    ``clip_grad_value`` the product is then clamped (LAMB's element-wise clipping).
    ``shard_sums``, for the local pieces of sharded tensors, totals the trust ratios' sums over
    the pieces (see :func:`_layerwise_steps`)."""
    return _layerwise_steps("lamb", 2, params, grads, exp_avgs, exp_avg_sqs, state_steps,
                            mode=_MODES[weight_decay_mode], clip_grad_value=clip_grad_value,
                            **options)


def lans_steps(params, grads, exp_avgs, exp_avg_sqs, state_steps, *, clip_grad_value,
               decay_moved_weight, grad_sq_sums=None, **options) -> Steps:
    """LANS on the fused kernels, all tensors in one call: the same update as
    :func:`scaleopt.lans.lans` (options, ``low`` and ``grad_multipliers`` as in
    :func:`lamb_steps`). ``grad_sq_sums``: the gradients' sums of squares from
    :func:`sums_of_squares`, when already computed (for clipping): LANS's own pass over the
    gradients for their norms is skipped. With ``shard_sums``, they are the whole gradients'
    sums, totalled first (a reduction of their own) if not given."""
    shard_sums = options.get("shard_sums")
    if shard_sums is not None and grad_sq_sums is None:  # the whole gradients' sums first
        grad_sq_sums = yield shard_sums.request(sums_of_squares(grads), range(len(grads)))
    yield from _layerwise_steps("lans", 4, params, grads, exp_avgs, exp_avg_sqs, state_steps,
                                clip_grad_value=clip_grad_value, moved=decay_moved_weight,
                                grad_sq_sums=grad_sq_sums, **options)


def adam_applies(weight: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
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
    if weight.dtype == torch.bfloat16:
        return _cpu_contiguous(weight, _BF16) and low is not None and _cpu_contiguous(low, _INT16)
    if not _cpu_contiguous(weight, _F32):
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


@eager
def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], low: Sequence[Optional[Tensor]],
         state_steps: Sequence[Tensor], *,
         step_sizes: Sequence[float], bias_correction2_sqrts: Sequence[float],
         weight_decays_l2: Sequence[float], decays: Sequence[float], beta1: float, beta2: float,
         eps: float, grad_multipliers: Sequence[float], nesterov: bool = False,
         one_minus_betas: Optional[Tuple[float, float]] = None, threads: int) -> None:
    """One Adam step on each tensor, one pass over memory each (see ``_kernels.c``), in one
    call. For a float32 ``params[i]``, ``low[i]``, when given, receives the rounded bfloat16
    weights; for a bfloat16 ``params[i]`` (split storage), ``low[i]`` holds the master's low
    halves. ``grad_multipliers[i]``: the scalar ``grads[i]`` is taken times.
    ``one_minus_betas`` overrides ``(1-beta1, 1-beta2)`` (computed in double by default).
    Each ``state_steps[i]`` (a float32 CPU scalar) is incremented; the scalars given are those
    of the incremented step."""
    count = len(params)
    if count == 0:
        return
    tensors = (AdamTensor * count)(*[
        AdamTensor(w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), _ptr(lo),
                   s.data_ptr(), w.numel(), _kind(w, g), gm, ss, bc, l2, dc)
        for w, g, m, v, lo, s, gm, ss, bc, l2, dc in zip(
            params, grads, exp_avgs, exp_avg_sqs, low, state_steps, grad_multipliers,
            step_sizes, bias_correction2_sqrts, weight_decays_l2, decays)])
    omb1, omb2 = one_minus_betas or (1.0 - beta1, 1.0 - beta2)
    config = AdamConfig(beta1=beta1, one_m_b1=omb1, beta2=beta2, one_m_b2=omb2, eps=eps,
                        nesterov=int(nesterov), nthreads=threads)
    _lib.adam_multi(tensors, count, ctypes.byref(config))


def any_nonfinite(t: Tensor, threads: int) -> bool:
    """Whether a tensor holds an inf or NaN (one read pass; kernels for contiguous float32 and
    bfloat16 CPU tensors, torch otherwise)."""
    if _lib is not None and _cpu_contiguous(t, _ADAM_GRADS):
        if t.dtype == torch.float32:
            return bool(_lib.any_nonfinite(t.data_ptr(), t.numel(), threads))
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
