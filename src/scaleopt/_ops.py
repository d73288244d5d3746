"""The operations every scaleopt optimizer's update is made of (moments, bias corrections,
decay, norms and trust ratios, clipping, momentum), each over lists of tensors (torch's
``_foreach_*`` kernels) and on one tensor.

Each operation comes in the forms the optimizers need:

* functions on one tensor (``*_one``) used by the reference single-tensor paths, and
* functions on lists of tensors that run on ``torch._foreach_*`` kernels, used by the fast
  multi-tensor paths.

Both forms compute the same thing with the same elementwise operations, so the two paths agree to
float round-off. Norms and trust ratios are computed in float32 (float64 for float64 tensors)
whatever the parameter dtype, and a zero norm never produces NaN. No operation reads a tensor value
back to the host, so they can run on an accelerator without synchronising.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

TensorList = List[Tensor]
ClipValue = Union[None, float, Tuple[float, float]]


# --------------------------------------------------------------------------------------------
# dtypes and norms
# --------------------------------------------------------------------------------------------


def norm_dtype(t: Tensor) -> torch.dtype:
    """The dtype norms of ``t`` are accumulated in: float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def norm_one(t: Tensor) -> Tensor:
    """L2 norm of one tensor as a 0-d float32 (float64) tensor; 0 for an empty tensor."""
    return torch.linalg.vector_norm(t, 2, dtype=norm_dtype(t))


def norms(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of each tensor, stacked into one float32 (float64 if all are float64) vector."""
    if len(tensors) == 0:
        return torch.zeros(0)
    dtype = torch.float64 if all(t.dtype == torch.float64 for t in tensors) else torch.float32
    try:
        out = torch._foreach_norm(list(tensors), 2, dtype=dtype)
    except (TypeError, RuntimeError):  # older torch without the dtype argument
        out = [norm_one(t).to(dtype) for t in tensors]
    return torch.stack([o.to(dtype) for o in out])


def global_norm(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of the concatenation of ``tensors`` (0-d, float32 or float64)."""
    if len(tensors) == 0:
        return torch.zeros(())
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    parts = [norms(ts).square().sum() for ts in by_device.values()]
    first = parts[0]
    total = first
    for extra in parts[1:]:
        total = total + extra.to(first.device)
    return total.sqrt()


# --------------------------------------------------------------------------------------------
# gradient clipping (out of place: the caller's gradients are never modified)
# --------------------------------------------------------------------------------------------


def clip_coef(norm: Tensor, max_norm: float) -> Tensor:
    """``max_norm / max(norm, max_norm)``: 1 when the norm is within bounds, else the scale."""
    return max_norm / torch.clamp(norm, min=max_norm)


def clip_bounds(clip: ClipValue) -> Tuple[float, float]:
    """``(lo, hi)`` of a value clip: ``[-clip, clip]``, a ``(lo, hi)`` pair, or infinite for None."""
    if clip is None:
        return -math.inf, math.inf
    return tuple(clip) if isinstance(clip, (tuple, list)) else (-clip, clip)


def clip_by_value(grads: TensorList, clip: ClipValue) -> TensorList:
    """Clamp every element to ``[-clip, clip]`` (or ``[lo, hi]`` for a pair)."""
    if clip is None:
        return grads
    lo, hi = clip_bounds(clip)
    out = torch._foreach_clamp_min(grads, lo)
    torch._foreach_clamp_max_(out, hi)
    return out


def clip_by_tensor_norm(grads: TensorList, max_norm: Optional[float]) -> TensorList:
    """Scale each tensor so its own L2 norm is at most ``max_norm``."""
    if max_norm is None or not grads:
        return grads
    return scale_each(grads, clip_coef(norms(grads), max_norm))


def scale(grads: TensorList, factor: Union[float, Tensor]) -> TensorList:
    """``grads * factor`` out of place (no copy when the factor is the float 1)."""
    if isinstance(factor, (int, float)) and factor == 1:
        return grads
    if isinstance(factor, Tensor):
        return torch._foreach_mul(grads, [factor.to(device=g.device, dtype=g.dtype) for g in grads])
    return torch._foreach_mul(grads, factor)


# --------------------------------------------------------------------------------------------
# Adam moments and direction
# --------------------------------------------------------------------------------------------


def by_value(values: Sequence[Any]) -> List[Tuple[Any, List[int]]]:
    """Indices grouped by equal value, in first-seen order: ``[(value, [i, ...]), ...]``."""
    out: Dict[Any, List[int]] = {}
    for i, v in enumerate(values):
        out.setdefault(v, []).append(i)
    return list(out.items())


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the step."""
    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


def to_device(tables: List[Tensor], device: torch.device) -> List[Tensor]:
    """CPU tensors of one dtype on ``device``, in one copy that does not make the host wait:
    on CUDA, through one buffer of pinned memory (a plain host-to-device copy waits for the
    GPU, and a step must not wait). Each starts at a multiple of 16 bytes (as the Triton
    kernels' specializations of the tables' addresses assume)."""
    if device.type != "cuda" or compiling():
        return [t.to(device) for t in tables]
    per16 = max(1, 16 // tables[0].element_size())
    sizes = [-(-t.numel() // per16) * per16 for t in tables]
    host = torch.empty(sum(sizes), dtype=tables[0].dtype, pin_memory=True)
    starts = list(itertools.accumulate([0] + sizes[:-1]))
    for t, at in zip(tables, starts):
        host[at:at + t.numel()] = t.reshape(-1)
    moved = host.to(device, non_blocking=True)
    return [moved[at:at + t.numel()].view(t.shape) for t, at in zip(tables, starts)]


def add_scaled_(params: TensorList, updates: TensorList, alphas: Sequence[float]) -> None:
    """``params[i] += alphas[i] * updates[i]``. Eagerly, one multi-tensor add per distinct
    factor; under ``torch.compile`` a product per tensor, where the compiler takes each factor
    (a learning rate an LR schedule changes) as an input rather than a constant of the graph: as
    a multi-tensor op's scalar it would recompile the step whenever the rate changes."""
    if compiling():
        torch._foreach_add_(list(params), [u * a for u, a in zip(updates, alphas)])
        return
    for a, ids in by_value(alphas):
        torch._foreach_add_([params[i] for i in ids], [updates[i] for i in ids], alpha=a)


def add_scaled_one_(p: Tensor, u: Tensor, alpha: float) -> None:
    """``p += alpha * u`` (see :func:`add_scaled_`)."""
    if compiling():
        p.add_(u * alpha)
    else:
        p.add_(u, alpha=alpha)


def bias_corrections(
    steps: Sequence[float], beta1: float, beta2: float, enabled: bool
) -> Tuple[List[float], List[float]]:
    """``(1 - beta1**t, sqrt(1 - beta2**t))`` per step count; all ones when disabled."""
    if not enabled:
        return [1.0] * len(steps), [1.0] * len(steps)
    bc1 = [1.0 - beta1**t for t in steps]
    bc2_sqrt = [(1.0 - beta2**t) ** 0.5 for t in steps]
    return bc1, bc2_sqrt


def step_bias_corrections(
    steps: Sequence[Tensor], beta1: float, beta2: float, enabled: bool
) -> Tuple[list, list]:
    """:func:`bias_corrections` of the step-counter tensors (on the CPU, as in torch.optim).

    Eagerly the counters are read as Python numbers. Under ``torch.compile`` the corrections
    are 0-d float64 tensors computed from the counters, so the compiled step neither reads them
    back nor specialises on their values (which would recompile it at every step).
    """
    if not compiling() or not enabled:
        return bias_corrections([s.item() for s in steps] if enabled else steps, beta1, beta2,
                                enabled)
    t = [s.double() for s in steps]
    return [1.0 - beta1**x for x in t], [(1.0 - beta2**x).sqrt() for x in t]


def adam_moments_one(m: Tensor, v: Tensor, g: Tensor, beta1: float, beta2: float,
                     one_minus_betas: Optional[Tuple[float, float]] = None) -> None:
    """``m = beta1*m + (1-beta1)*g``; ``v = beta2*v + (1-beta2)*g*g`` in place
    (``one_minus_betas`` overrides ``(1-beta1, 1-beta2)``)."""
    omb1, omb2 = one_minus_betas or (1.0 - beta1, 1.0 - beta2)
    m.lerp_(g, omb1)
    v.mul_(beta2).addcmul_(g, g, value=omb2)


def adam_moments(ms: TensorList, vs: TensorList, gs: TensorList, beta1: float, beta2: float) -> None:
    torch._foreach_lerp_(ms, gs, 1.0 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)


def adam_denominator_one(v: Tensor, bc2_sqrt: float, eps: float) -> Tensor:
    """``sqrt(v_hat) + eps`` with ``v_hat = v/bc2`` (new tensor)."""
    return v.sqrt().div_(bc2_sqrt).add_(eps)


def adam_denominators(vs: TensorList, bc2_sqrt: List[float], eps: float) -> TensorList:
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    return denom


def adam_direction_one(m: Tensor, bc1: float, denom: Tensor) -> Tensor:
    """``m_hat / denom`` with ``m_hat = m/bc1`` (new tensor); ``denom`` from
    :func:`adam_denominator_one`."""
    return (m / bc1).div_(denom)


def adam_direction(ms: TensorList, bc1: List[float], denom: TensorList) -> TensorList:
    upd = torch._foreach_div(ms, bc1)
    torch._foreach_div_(upd, denom)
    return upd


# --------------------------------------------------------------------------------------------
# weight decay
# --------------------------------------------------------------------------------------------

def add_decay_to_update(updates: TensorList, params: TensorList, weight_decay: float) -> None:
    """``u += wd * w`` (decay inside the trust ratio: LAMB paper, Paddle, MXNet, TF1)."""
    if updates and weight_decay != 0:
        torch._foreach_add_(updates, params, alpha=weight_decay)


def decoupled_decay_(params: TensorList, lr: float, weight_decay: float) -> None:
    """``w -= lr * wd * w`` in place (AdamW / Keras style, outside the trust ratio)."""
    if params and weight_decay != 0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)


def add_l2_to_grad(grads: TensorList, params: TensorList, weight_decay: float) -> TensorList:
    """``g + wd * w`` out of place (coupled L2 regularisation)."""
    if not grads or weight_decay == 0:
        return grads
    return torch._foreach_add(grads, params, alpha=weight_decay)


def add_l1_to_grad(grads: TensorList, params: TensorList, weight_decay: float) -> TensorList:
    """``g + wd * sign(w)`` out of place (L1 regularisation)."""
    if not grads or weight_decay == 0:
        return grads
    return torch._foreach_add(grads, torch._foreach_sign(params), alpha=weight_decay)


# --------------------------------------------------------------------------------------------
# trust ratio
# --------------------------------------------------------------------------------------------


def trust_ratio(
    w_norm: Tensor,
    u_norm: Tensor,
    lower_bound: Optional[float] = None,
    upper_bound: Optional[float] = None,
) -> Tensor:
    """``phi(||w||) / ||u||`` elementwise over norms of any shape.

    ``phi`` clamps ``||w||`` to ``[lower_bound, upper_bound]`` (``None`` = unbounded). The clamp
    comes before the zero test, so a zero tensor with a lower bound gets ``lower/||u||``. The
    ratio is 1 where ``phi(||w||)`` or ``||u||`` is 0, or where the quotient overflows, so it is
    never NaN or inf.
    """
    if lower_bound is not None or upper_bound is not None:
        w_norm = torch.clamp(w_norm, min=lower_bound, max=upper_bound)
    ok = (w_norm > 0) & (u_norm > 0)
    safe_u = torch.where(ok, u_norm, torch.ones_like(u_norm))
    ratio = w_norm / safe_u
    return torch.where(ok & torch.isfinite(ratio), ratio, torch.ones_like(ratio))


def apply_trust_ratio_(updates: TensorList, w_norms: Tensor, lower, upper,
                       u_norms: Optional[Tensor] = None) -> None:
    """Scale each update in place by its layer's trust ratio, given the weights' norms (and the
    updates' norms, when already known)."""
    if not updates:
        return
    ratios = trust_ratio(w_norms, norms(updates) if u_norms is None else u_norms, lower, upper)
    scale_each_(updates, ratios)


def scale_each_(tensors: TensorList, factors: Tensor) -> None:
    """``tensors[i] *= factors[i]`` in place (``factors``: a vector, one per tensor)."""
    torch._foreach_mul_(tensors, _per_tensor(tensors, factors))


def scale_each(tensors: TensorList, factors: Tensor) -> TensorList:
    """``tensors[i] * factors[i]`` (new tensors; ``factors``: a vector, one per tensor)."""
    return torch._foreach_mul(tensors, _per_tensor(tensors, factors))


def _per_tensor(tensors: TensorList, factors: Tensor) -> List[Tensor]:
    return [f.to(t.dtype) for t, f in zip(tensors, factors.unbind(0))]


def sq_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Each tensor's sum of squares (a float32 vector; float64 if all are float64)."""
    return norms(tensors).square()


def dots(xs: Sequence[Tensor], ys: Sequence[Tensor]) -> Tensor:
    """Each pair's sum of products, as :func:`sq_norms` (float32 or float64 vector)."""
    if len(xs) == 0:
        return torch.zeros(0)
    dtype = torch.float64 if all(x.dtype == torch.float64 for x in xs) else torch.float32
    return torch.stack([torch.sum(x.to(dtype) * y.to(dtype)) for x, y in zip(xs, ys)])


# --------------------------------------------------------------------------------------------
# momentum
# --------------------------------------------------------------------------------------------


def heavy_ball_(bufs: TensorList, grads: TensorList, momentum: float, nesterov: bool) -> TensorList:
    """``v = mu*v + g`` in place; returns the step direction (``v``, or ``g + mu*v`` for Nesterov)."""
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    if nesterov:
        return torch._foreach_add(grads, bufs, alpha=momentum)
    return bufs
