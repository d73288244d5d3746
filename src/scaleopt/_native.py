"""The fused CPU kernels (``csrc/``) for LAMB, LANS and Adam, called through ctypes.

They apply to contiguous CPU tensors: float32 weights (or bfloat16 parameters with float32 or
split masters), float32 or bfloat16 gradients, moments in float32, bfloat16 or 8-bit codes. When the extension was not built (no compiler at
install time) or ``SCALEOPT_NATIVE=0`` is set, :func:`available` is False and the optimizers run
their PyTorch paths, which compute the same numbers.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_double, c_float, c_int32, c_int64, c_void_p
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _ops, _format
from ._checks import check_same_sizes
from ._compile import eager
from ._group import GroupTensors, TensorOptions, GroupOptions
from ._sharding import Reduction

_TENSOR_FIELDS = [("w", c_void_p), ("g", c_void_p), ("m", c_void_p), ("v", c_void_p),
                  ("w16", c_void_p), ("step", c_void_p), ("n", c_int64), ("kind", c_int32),
                  ("gmul", c_float)]
#: where the moments are stored in bfloat16 or 8 bits (``COMPACT_FIELDS`` in ``csrc/base.h``)
_COMPACT_FIELDS = [("m_scale", c_void_p), ("v_scale", c_void_p), ("row_len", c_int64),
                   ("offset", c_int64), ("form", c_int32)]


class LayerwiseTensor(ctypes.Structure):
    """One tensor of a LAMB/LANS call (``LayerwiseTensor`` in ``csrc/base.h``)."""

    _fields_ = _TENSOR_FIELDS + [("lr", c_double), ("wd", c_double), ("gsq", c_double),
                                 ("adapt", c_int32)] + _COMPACT_FIELDS


class LayerwiseConfig(ctypes.Structure):
    """A LAMB/LANS call's group options (``LayerwiseConfig`` in ``csrc/base.h``)."""

    _fields_ = [("beta1", c_double), ("beta2", c_double), ("lower", c_double),
                ("upper", c_double), ("eps", c_float), ("clip_lo", c_float), ("clip_hi", c_float),
                ("bias_correction", c_int32), ("has_lower", c_int32), ("has_upper", c_int32),
                ("clip", c_int32), ("nthreads", c_int32), ("mode", c_int32), ("moved", c_int32)]


class AdamTensor(ctypes.Structure):
    """One tensor of an Adam call (``AdamTensor`` in ``csrc/base.h``)."""

    _fields_ = _TENSOR_FIELDS + [("step_size", c_float), ("bc2_sqrt", c_float),
                                 ("wd_l2", c_float), ("decay", c_float)] + _COMPACT_FIELDS


class AdamConfig(ctypes.Structure):
    """An Adam call's group options (``AdamConfig`` in ``csrc/base.h``)."""

    _fields_ = [("beta1", c_float), ("one_m_b1", c_float), ("beta2", c_float),
                ("one_m_b2", c_float), ("eps", c_float), ("nesterov", c_int32),
                ("nthreads", c_int32)]


#: The structs in the order ``struct_layout()`` (C) numbers them.
STRUCTS = (LayerwiseTensor, LayerwiseConfig, AdamTensor, AdamConfig)

_COUNT_AND_THREADS = [c_void_p, c_int64, c_int32]
_LAYERWISE = [POINTER(LayerwiseTensor), c_int64, POINTER(LayerwiseConfig)]
#: Every C function called from Python: name -> (restype, argtypes). ``tests/test_native.py``
#: checks each against its declaration in ``csrc/``.
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
    "int8_encode": (None, [c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int32, c_int64,
                           c_int64, c_int32]),
    "int8_decode": (None, [c_void_p, c_void_p, c_void_p, c_int64, c_int64, c_int32, c_int32]),
    "bf16_round_stochastic": (None, [c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int32]),
    "compact_simd": (c_int32, [c_int32]),
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
    if os.environ.get("SCALEOPT_AVX512", "1") == "0":  # the portable compact loops from the start
        _lib.compact_simd(0)


def struct_layout(struct: type) -> Tuple[int, ...]:
    """``(sizeof, offsets of the fields...)`` of a struct as the C side lays it out."""
    out = (c_int64 * 32)()
    count = _lib.struct_layout(STRUCTS.index(struct), ctypes.addressof(out))
    return tuple(out[:count])

#: why the kernels do not run where :func:`available` says False
NOT_BUILT = ("the C kernels are not built in this install (no C compiler at install time, or "
             "SCALEOPT_NATIVE=0)")


def kernels_allowed(group: Dict[str, Any]) -> bool:
    """Whether a group's ``foreach``/``fused`` leave the fused kernels in the choice: no
    ``foreach`` path asked for, and not ``fused=False``."""
    return group.get("foreach") is None and group.get("fused") is not False


def available() -> bool:
    return _lib is not None


def compact_simd(use: Optional[bool] = None) -> bool:
    """Whether the kernels update compact moments with their AVX-512 loops (where the CPU has
    AVX-512) rather than the portable ones; ``use`` switches (both store the same codes; their
    float results agree to a few ulp). ``SCALEOPT_AVX512=0`` in the environment starts every
    process that imports scaleopt on the portable loops."""
    if _lib is None:
        return False
    return bool(_lib.compact_simd(-1 if use is None else int(use)))


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


def applies(t: GroupTensors) -> bool:
    """Whether the LAMB/LANS kernels take a group's tensors (a ``GroupTensors``): what
    :func:`adam_applies` takes, except a bfloat16 gradient for a float32 weight that is no
    master (no ``w16``)."""
    if _lib is None:
        return False
    w16s = t.w16 or [None] * len(t.weights)
    stored = t.stored or [None] * len(t.weights)
    for w, g, m, v, w16, st in zip(t.weights, t.grads, t.exp_avgs, t.exp_avg_sqs, w16s, stored):
        if not adam_applies(w, g, m, v, w16, st) or (
                w16 is None and w.dtype == torch.float32 and g.dtype != torch.float32):
            return False
    return True


def _stored_fields(st: Optional[_format.Stored]) -> dict:
    """The ``_COMPACT_FIELDS`` of a tensor whose moments are stored as ``st`` (a
    ``_format.Stored``, or None for float32 moments)."""
    if st is None:
        return {}
    m_scale, v_scale = st.scales
    return dict(m_scale=_ptr(m_scale), v_scale=_ptr(v_scale), row_len=st.row_len,
                offset=st.offset, form=_format.MOMENT_FORMS[st.form])


def _kind(weight: Tensor, grad: Tensor) -> int:
    """The tensor's kind (``_format.KIND_BITS``): a bfloat16 gradient; a bfloat16 weight, i.e.
    a split master."""
    return ((_format.KIND_BITS["bf16_grad"] if grad.dtype == torch.bfloat16 else 0)
            | (_format.KIND_BITS["split"] if weight.dtype == torch.bfloat16 else 0))


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _layerwise_tensors(t: GroupTensors, layer: TensorOptions):
    """The per-tensor array of a ``lamb_*`` / ``lans_*`` call, from a ``GroupTensors`` and its
    ``TensorOptions``, but for what a step writes in (:meth:`LayerwiseKernel._rows`): the
    gradients' addresses, multipliers and sums of squares, and the learning rates."""
    count = len(t.weights)
    w16s = t.w16 or [None] * count
    check_same_sizes("the LAMB/LANS C kernel", t.weights, t.grads, t.exp_avgs, t.exp_avg_sqs,
                     w16s)
    stored = t.stored or [None] * count
    return (LayerwiseTensor * count)(*[
        LayerwiseTensor(w=w.data_ptr(), m=m.data_ptr(), v=v.data_ptr(), w16=_ptr(w16),
                        step=s.data_ptr(), n=w.numel(), kind=_kind(w, g), wd=wd,
                        adapt=int(bool(a)), **_stored_fields(st))
        for w, g, m, v, w16, s, wd, a, st in zip(
            t.weights, t.grads, t.exp_avgs, t.exp_avg_sqs, w16s, t.steps,
            layer.weight_decays, layer.adapt, stored)])


def _layerwise_config(o: GroupOptions, clip_grad_value: Any, mode: int = 0,
                      moved: bool = False) -> LayerwiseConfig:
    """A call's group options from the group's ``GroupOptions``."""
    lo, hi = _ops.clip_bounds(clip_grad_value)
    return LayerwiseConfig(
        beta1=o.beta1, beta2=o.beta2, lower=o.lower_bound or 0.0, upper=o.upper_bound or 0.0,
        eps=o.eps, clip_lo=lo, clip_hi=hi, bias_correction=int(o.bias_correction),
        has_lower=int(o.lower_bound is not None), has_upper=int(o.upper_bound is not None),
        clip=int(clip_grad_value is not None), nthreads=0, mode=mode, moved=int(moved))


class LayerwiseKernel:
    """A ``lamb_*`` / ``lans_*`` call over a group's tensors, in the phases of a step (see
    ``scaleopt._sharding``): :meth:`grad_sums` (LANS on local shards: the whole gradients'
    sums of squares, where the intake did not give them), :meth:`sums` and :meth:`apply`. On
    whole tensors the first two ask for nothing, and :meth:`apply` runs ``{name}_multi``, both
    passes one tensor after the other; on local shards, ``{name}_multi_sums`` runs the first
    pass over all of them, and ``{name}_multi_apply`` the second on the sums totalled over the
    shards."""

    @eager
    def __init__(self, name: str, per_tensor: int, t: GroupTensors, layer: TensorOptions,
                 o: GroupOptions, clip_grad_value: Any, mode: int = 0, moved: bool = False,
                 grad_sq_sums: Optional[Tensor] = None) -> None:
        self.name, self.per_tensor, self.count = name, per_tensor, len(t.weights)
        self.t, self.layer, self.grad_sq_sums = t, layer, grad_sq_sums
        # the group's options: kept in t.cache (the group's plan's: the same while it is kept)
        config = t.cache.get("config") if t.cache is not None else None
        if config is None:
            config = _layerwise_config(o, clip_grad_value, mode, moved)
            if t.cache is not None:
                t.cache["config"] = config
        config.nthreads = torch.get_num_threads()
        self.config = ctypes.byref(config)
        self.tensors: Any = None

    @eager
    def grad_sums(self) -> Optional[Reduction]:
        """LANS on local shards without the gradients' sums: the local ones to total."""
        t = self.t
        if self.name != "lans" or not self.count or t.shard_sums is None or \
                self.grad_sq_sums is not None:
            return None
        return t.shard_sums.request(sums_of_squares(t.grads), range(self.count))

    @eager  # host code calling C: nothing for dynamo to trace
    def sums(self, grad_totals: Optional[Tensor] = None) -> Optional[Reduction]:
        """The per-tensor array of the call; on local shards, the first pass (``per_tensor``
        sums each) and its sums to total."""
        if not self.count:
            return None
        if grad_totals is not None:
            self.grad_sq_sums = grad_totals
        self.tensors = self._rows()
        if self.t.shard_sums is None:
            return None
        owners = [i for i in range(self.count) for _ in range(self.per_tensor)]
        return self.t.shard_sums.request(self.first_pass(), owners)

    def _rows(self) -> Any:
        """The per-tensor array of the call: the last step's, kept in ``t.cache`` (the group's
        plan's) while the other tensors are where they were, else made anew; with this step's
        gradients' addresses and multipliers (1 without), learning rates, and LANS's gradients'
        sums of squares (-1: not given) written in."""
        t, cache = self.t, self.t.cache
        fixed = [t.weights, t.exp_avgs, t.exp_avg_sqs, t.steps,
                 [x for x in t.w16 or () if x is not None]]
        kept = None if cache is None else cache.get(self.name)
        addresses = [list(map(Tensor.data_ptr, xs)) for xs in fixed] if cache is not None \
            else None
        if kept is None or kept[0] != addresses:
            rows = _layerwise_tensors(t, self.layer)
            if cache is not None:
                cache[self.name] = (addresses, rows)
        else:
            rows = kept[1]
        count = self.count
        mults = [1.0] * count if t.grad_scalars is None else t.grad_scalars.mults.tolist()
        gsq = [-1.0] * count if self.grad_sq_sums is None else self.grad_sq_sums.tolist()
        for row, g, gm, lr, sq in zip(rows, t.grads, mults, self.layer.lrs, gsq):
            row.g, row.gmul, row.lr, row.gsq = g.data_ptr(), gm, lr, sq
        return rows

    @eager
    def first_pass(self) -> Tensor:
        """``{name}_multi_sums``: the first pass over all tensors, ``per_tensor`` sums each."""
        out = torch.zeros(self.count * self.per_tensor, dtype=torch.float64)
        getattr(_lib, f"{self.name}_multi_sums")(self.tensors, self.count, self.config,
                                                 out.data_ptr())
        return out

    @eager
    def apply(self, totals: Optional[Tensor]) -> None:
        """The update: both passes, or on local shards the second on ``totals``."""
        if not self.count:
            return
        if totals is None:
            getattr(_lib, f"{self.name}_multi")(self.tensors, self.count, self.config)
            return
        totals = totals.contiguous()
        getattr(_lib, f"{self.name}_multi_apply")(self.tensors, self.count, self.config,
                                                  totals.data_ptr())


def lamb_kernel(t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> LayerwiseKernel:
    """LAMB on the fused kernels, all tensors of a group in one call: the same update as
    :func:`scaleopt.lamb.lamb` (``t`` a ``GroupTensors``, ``layer`` its ``TensorOptions``, ``o``
    the group's ``GroupOptions``).

    ``t.w16[i]``, when given, is the bfloat16 parameter whose float32 master is
    ``t.weights[i]``: it receives the rounded weights in the same pass. A bfloat16 weight is a
    split master, whose lower halves are ``t.w16[i]`` (int16). The gradients are read as they
    are, never copied, each taken times its deferred multiplier (sign, rescaling and clipping
    factors, see ``scaleopt._intake``), then clamped where the scalars say (LAMB's element-wise
    clipping)."""
    clamp = None if t.grad_scalars is None else t.grad_scalars.clamp
    return LayerwiseKernel("lamb", 2, t, layer, o, clamp,
                           mode=_format.WEIGHT_DECAY_MODES[o.weight_decay_mode])


def lans_kernel(t: GroupTensors, layer: TensorOptions, o: GroupOptions) -> LayerwiseKernel:
    """LANS on the fused kernels, all tensors of a group in one call: the same update as
    :func:`scaleopt.lans.lans` (``t``, ``layer`` as in :func:`lamb_kernel`, ``o`` the
    group's ``GroupOptions``). The gradients' sums of squares, where the intake computed them (for
    clipping: the scalars' ``sq_sums``, or ``t.grad_norms``), are not computed again."""
    sq_sums = None if t.grad_scalars is None else t.grad_scalars.sq_sums
    if sq_sums is None and t.grad_norms is not None:
        sq_sums = t.grad_norms.double().square()
    return LayerwiseKernel("lans", 4, t, layer, o, o.clip_grad_value,
                           moved=o.decay_moved_weight, grad_sq_sums=sq_sums)


def adam_applies(weight: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                 w16: Optional[Tensor], stored: Optional[_format.Stored] = None) -> bool:
    """Whether :func:`adam` takes this tensor: float32 moments, contiguous on the CPU, or
    moments stored in bfloat16 or 8 bits as ``stored`` (a ``_format.Stored``) says; a float32
    or bfloat16 gradient; and either a float32 weight with an optional bfloat16 copy ``w16``, or
    split storage: a bfloat16 weight with the int16 lower halves of its master in ``w16``."""
    if _lib is None:
        return False
    if not _moments_apply(exp_avg, exp_avg_sq, stored):
        return False
    if not grad_applies(grad):
        return False
    if weight.dtype == torch.bfloat16:
        return _cpu_contiguous(weight, _BF16) and w16 is not None and _cpu_contiguous(w16, _INT16)
    if not _cpu_contiguous(weight, _F32):
        return False
    return w16 is None or _cpu_contiguous(w16, _BF16)


def _moments_apply(exp_avg: Tensor, exp_avg_sq: Tensor, stored: Optional[_format.Stored]) -> bool:
    if stored is None:
        return _cpu_contiguous(exp_avg, _F32) and _cpu_contiguous(exp_avg_sq, _F32)
    return stored.offset is not None and takes_compact(
        exp_avg, exp_avg_sq, *(s for s in stored.scales if s is not None))


def grad_applies(grad: Tensor) -> bool:
    """Whether :func:`adam` reads this gradient: float32 or bfloat16, contiguous, on the CPU."""
    return _cpu_contiguous(grad, _ADAM_GRADS)


_F32, _BF16, _INT16 = (torch.float32,), (torch.bfloat16,), (torch.int16,)
_ADAM_GRADS = (torch.float32, torch.bfloat16)


@eager
def adam(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
         exp_avg_sqs: Sequence[Tensor], w16s: Sequence[Optional[Tensor]],
         state_steps: Sequence[Tensor], *,
         step_sizes: Sequence[float], bias_correction2_sqrts: Sequence[float],
         weight_decays_l2: Sequence[float], decays: Sequence[float], beta1: float, beta2: float,
         eps: float, grad_multipliers: Sequence[float], nesterov: bool = False,
         one_minus_betas: Optional[Tuple[float, float]] = None, threads: int,
         stored: Optional[Sequence[Any]] = None) -> None:
    """One Adam step on each tensor, one pass over memory each (see ``csrc/adam.h``), in one
    call. For a float32 ``params[i]``, ``w16s[i]``, when given, receives the rounded bfloat16
    weights; for a bfloat16 ``params[i]`` (split storage), ``w16s[i]`` holds the master's lower
    halves. ``grad_multipliers[i]``: the scalar ``grads[i]`` is taken times.
    ``one_minus_betas`` overrides ``(1-beta1, 1-beta2)`` (computed in double by default).
    Each ``state_steps[i]`` (a float32 CPU scalar) is incremented; the scalars given are those
    of the incremented step. ``stored[i]``, where given and not None, says how
    ``exp_avgs[i]`` and ``exp_avg_sqs[i]`` are stored (a ``_format.Stored``): the kernel
    updates them in place as stored."""
    count = len(params)
    if count == 0:
        return
    check_same_sizes("the Adam C kernel", params, grads, exp_avgs, exp_avg_sqs, w16s)
    tensors = (AdamTensor * count)(*[
        AdamTensor(w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), _ptr(w16),
                   s.data_ptr(), w.numel(), _kind(w, g), gm, ss, bc, l2, dc, **_stored_fields(st))
        for w, g, m, v, w16, s, gm, ss, bc, l2, dc, st in zip(
            params, grads, exp_avgs, exp_avg_sqs, w16s, state_steps, grad_multipliers,
            step_sizes, bias_correction2_sqrts, weight_decays_l2, decays,
            stored or [None] * count)])
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


# -- compact optimizer state (scaleopt._compact) ---------------------------------------------

def takes_compact(*tensors: Tensor) -> bool:
    """Whether the compact-state kernels take these tensors: the kernels built, each tensor
    plain, contiguous and on the CPU."""
    return _lib is not None and all(
        type(t) in _PLAIN_TYPES and t.is_cpu and t.is_contiguous() for t in tensors)


def int8_encode(x: Tensor, codes: Tensor, scales: Tensor, offset: int, key: int) -> None:
    """``codes`` and ``scales`` of the float32 ``x`` (rows along dimension 0), written in place;
    unsigned codes rounded with the hashes of ``offset`` + each element's index + ``key``; see
    :func:`scaleopt._compact.quantize`."""
    rows = x.shape[0]
    _lib.int8_encode(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), rows,
                     x.numel() // rows if rows else 0, int(codes.dtype == torch.int8), offset,
                     key, torch.get_num_threads())


def int8_decode(codes: Tensor, scales: Tensor, out: Tensor) -> None:
    """The float32 values of ``codes`` and ``scales`` into ``out``; see
    :func:`scaleopt._compact.dequantize`."""
    rows = codes.shape[0]
    _lib.int8_decode(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), rows,
                     codes.numel() // rows if rows else 0, int(codes.dtype == torch.int8),
                     torch.get_num_threads())


def bf16_round_stochastic(x: Tensor, out: Tensor, offset: int, key: int) -> None:
    """``x`` (float32) rounded into ``out`` (bfloat16), element ``i`` with the random bits of
    global index ``offset + i`` (see :func:`scaleopt._compact.round_bf16`)."""
    _lib.bf16_round_stochastic(x.data_ptr(), out.data_ptr(), x.numel(), offset, key,
                               torch.get_num_threads())
