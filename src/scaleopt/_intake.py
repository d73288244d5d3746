"""The gradient intake every optimizer shares: each group's gradients after sign, unscaling and
clipping, or, for a consumer that applies them as it reads the gradients (the fused kernels),
those transforms as per-tensor scalars (see :func:`take`)."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Callable, Collection, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ops
from ._params import param_label
from ._sharding import Reduction, ShardSums, any_dtensor, local, on_any_rank, total


@dataclasses.dataclass(frozen=True)
class GradScalars:
    """A deferred group's gradient scalars (see :func:`take`). (A dataclass: torch 2.11's
    compiler hands on a NamedTuple made in a generator it inlines as an empty tuple.)"""

    #: per tensor, the number its raw gradient is to be taken times: a float64 vector where the
    #: gradients are (on an accelerator, nothing is read back to the host to make it)
    mults: Tensor
    #: per tensor, the raw gradient's sum of squares (float64) where the clipping computed it
    #: with the consumer's sum of squares; else None
    sq_sums: Optional[Tensor]
    #: ``clip_grad_value`` to clamp the product to (element-wise clipping, when no norm
    #: clipping follows it), or None
    clamp: Any = None


def apply_grad_scalars(grads: List[Tensor], scalars: Optional[GradScalars]) -> List[Tensor]:
    """The gradients with their deferred scalars applied (new tensors), for the implementations
    that do not take them as they read the gradients."""
    if scalars is None:
        return grads
    mults = scalars.mults
    scaled = (torch._foreach_mul(grads, mults.tolist()) if mults.device.type == "cpu"
              else _ops.scale_each(grads, mults))
    return _ops.clip_by_value(scaled, scalars.clamp)


class Deferral(NamedTuple):
    """A consumer that applies the gradients' scalar transforms itself as it reads them."""

    #: the ids of the param groups it takes (None: all)
    groups: Optional[Collection[int]]
    #: ``grads -> float64 vector or None``: its sum of squares, for the norms the clippings
    #: need (None where it does not take these tensors; the norms then come from torch)
    sums_of_squares: Callable[[List[Tensor]], Optional[Tensor]]
    #: ``grad -> bool``: its test for inf/NaN (for ``nonfinite="skip"``), or None for torch's
    any_nonfinite: Optional[Callable[[Tensor], bool]] = None


@dataclasses.dataclass
class GroupGrads:
    """One group's gradients as :func:`take` hands them over."""

    group: Dict[str, Any]
    #: the positions in ``group["params"]`` of the parameters that have a gradient
    idx: List[int]
    params: List[Tensor]
    #: transformed gradients, or for a deferred group the raw ones (see ``scalars``)
    grads: List[Tensor]
    #: a deferred group's scalars (None where nothing scales or the group is not deferred)
    scalars: Optional[GradScalars] = None
    deferred: bool = False
    #: a deferred group's raw gradients' norms, where a clipping needs them
    norms: Optional[Tensor] = None
    #: for sharded (DTensor) parameters, whose ``grads`` are the local shards: the
    #: :class:`~scaleopt._sharding.ShardSums` that totals sums over their shards
    shard_sums: Optional[ShardSums] = None
    #: a sharded group's gradients' norms (whole tensors) as handed over, where a clipping
    #: computed them
    grad_norms: Optional[Tensor] = None
    #: while the intake runs: the sums this group's clipping needs totalled over the shards,
    #: and the factor that unscales its gradients
    pending: Optional[Reduction] = None
    unscale: Any = 1.0


class Intake(list):
    """The :class:`GroupGrads` of a step (empty when ``skipped``)."""

    #: the step is to be skipped: an inf/NaN gradient (see :func:`take`)
    skipped: bool = False


def take(opt: Any, value_clip: bool = True, defer: Optional[Deferral] = None, *,
         amp_skip: bool = False) -> Intake:
    """Each group's parameters that have a gradient, and their gradients.

    The gradients are after ``maximize`` (negation), unscaling (``rescale_grad``, a group's
    ``loss_scale``, and a :class:`torch.amp.GradScaler`'s scale when the optimizer says
    ``_takes_amp_scale``), ``clip_grad_value`` (unless ``value_clip=False``: the optimizer
    applies it itself), ``clip_grad_norm_per_tensor`` and, last, global ``max_grad_norm``
    clipping, whose norm is taken over every gradient of every group. New tensors are made only
    for the transforms in use; ``p.grad`` itself is never written. They come from the
    optimizer's gradient source (``opt._grad_source``: host copies for an offloaded optimizer).

    With ``defer``, a group it accepts (unless element-wise clipping comes before a norm
    clipping) keeps its raw gradients, and the scalar transforms (sign, unscaling, both norm
    clippings) come in ``scalars`` as one float per tensor that the consumer multiplies the
    gradient by (then clamps, for element-wise clipping) as it reads it (the fused CPU kernels
    do, which saves a pass over the gradients and a copy of them); the norms the clippings need
    are those of the scaled gradients, from one read of the raw ones.

    The result is empty and ``skipped`` when (``amp_skip``) a GradScaler handed the step an
    inf/NaN, and, under the optimizer's ``nonfinite="skip"`` policy, when a gradient holds an
    inf/NaN (found by the global clipping norm where there is one, else by a read of the
    gradients, agreed over the ranks for sharded ones); such a skip is counted in
    ``opt.skipped_steps``. Under ``"propagate"`` nothing is checked.
    """
    opt._refresh_hyperparameters()
    piece = opt.__dict__.get("_backward_piece")  # a step taken in pieces, in backward (or None)
    if amp_skip and _found_inf(opt):
        return _skipped()
    staged = [_collect(opt, group, value_clip, defer) for group in opt.param_groups]
    for item, totals in zip(staged, total([s.pending for s in staged])):
        if totals is not None:  # sharded gradients: the clippings' norms over whole tensors
            _clip_by_tensor_norms(item, totals)
    clipping = any([s.group.get("max_grad_norm") is not None for s in staged])
    by_norm = clipping and not any([s.group.get("clip_grad_value") is not None for s in staged])
    if piece is not None and _measured(opt, piece, staged, defer, by_norm):
        return Intake()
    skip, finite = opt.nonfinite == "skip" and piece is None, True
    if clipping and not (piece is not None and piece.norm is None):
        global_norm = _clip_by_global_norm(opt, staged, None if piece is None else piece.norm)
        if skip and by_norm:
            finite = bool(torch.isfinite(global_norm))  # a host read: opted into
            skip = False  # decided: the norm is finite exactly where every gradient is
    if skip:
        finite = not _step_has_nonfinite(opt, staged, defer)
    if not finite:
        opt.skipped_steps += 1
        return _skipped()
    return Intake([s for s in staged if s.params])


def _measured(opt: Any, piece: Any, staged: List[GroupGrads], defer: Optional[Deferral],
              by_norm: bool) -> bool:
    """For a step taken in pieces (``scaleopt.in_backward.Piece``): its part of the global
    norm noted; and, in the first of two passes, whether an inf/NaN is there where the norm
    does not decide it (``by_norm``). True where the piece only measures (nothing is
    stepped)."""
    if piece.parts is not None:
        piece.parts.add(opt, staged)
    if not piece.measuring:
        return False
    piece.by_norm = by_norm
    if opt.nonfinite == "skip" and not piece.by_norm and not piece.found_nonfinite:
        piece.found_nonfinite = _step_has_nonfinite(opt, staged, defer)
    return True


def _step_has_nonfinite(opt: Any, staged: List[GroupGrads], defer: Optional[Deferral]) -> bool:
    """Whether any gradient of the step holds an inf/NaN as it came (before value clipping
    could hide it); for sharded gradients (local shards) OR-ed over the ranks of the default
    process group, so that every rank skips or none."""
    test = any_nonfinite if defer is None or defer.any_nonfinite is None \
        else defer.any_nonfinite
    found = any(test(g) for s in staged
                for g in (s.grads if s.deferred else
                          local([opt._grad_source.grad(p) for p in s.params])))
    if any(s.shard_sums is not None for s in staged):
        found = on_any_rank(found)
    return found

def _unscale(opt: Any, group: Dict[str, Any]) -> Union[float, Tensor]:
    """The factor a group's raw gradients are unscaled by: ``rescale_grad``, divided by the
    group's ``loss_scale`` and by a GradScaler's scale (when the optimizer takes it). An update
    on the host reads the scale there; elsewhere the factor is a tensor where the scale is
    (its float32 inverse, as the scaler's own unscaling uses), read by no host code."""
    amp = getattr(opt, "grad_scale", None) if opt._takes_amp_scale else None
    factor = group.get("rescale_grad", 1.0) / group.get("loss_scale", 1.0)
    if amp is None:
        return factor
    if opt._grad_source.on_host:
        return factor * (1.0 / float(amp))
    return amp.double().reciprocal().float().reshape(()) * factor


_GRAD = operator.attrgetter("grad")


def _present(opt: Any, group: Dict[str, Any]) -> Tuple[List[int], List[Tensor], List[Tensor]]:
    """The group's parameters that have a gradient: their places, themselves and their
    gradients (from the optimizer's gradient source); a sparse gradient is an error. Where
    every parameter has one, in a few passes in C."""
    everything = group["params"]
    piece = opt.__dict__.get("_backward_piece")
    if piece is None:
        present = list(map(_GRAD, everything))
    else:  # a step in backward takes the parameters whose gradients are complete
        present = [p.grad if id(p) in piece.ready else None for p in everything]
    if not any(map(operator.is_, present, itertools.repeat(None))):
        idx, params = list(range(len(everything))), list(everything)
    else:
        idx = [i for i, g in enumerate(present) if g is not None]
        params = [everything[i] for i in idx]
        present = [present[i] for i in idx]
    if any(map(operator.attrgetter("is_sparse"), present)):
        i = next(i for i, g in zip(idx, present) if g.is_sparse)
        raise RuntimeError(f"{type(opt).__name__} does not support sparse gradients "
                           f"(parameter {param_label(group, i)})")
    if opt._grad_source.on_host:  # host copies of the gradients, complete
        present = [opt._grad_source.grad(p) for p in params]
    return idx, params, present


def _collect(opt: Any, group: Dict[str, Any], value_clip: bool,
             defer: Optional[Deferral]) -> GroupGrads:
    """One group's gradients, transformed (or, deferred, their scalars) but for the global
    clipping (a :class:`GroupGrads`). For sharded parameters whose clipping needs norms of
    whole tensors, ``pending`` asks for the local sums' totals, and
    :func:`_clip_by_tensor_norms` finishes with them."""
    idx, params, grads = _present(opt, group)
    item = GroupGrads(group, idx, params, grads)
    if any_dtensor(params):  # from here on the local shards, norms totalled over them
        item.shard_sums = ShardSums(params)
        item.grads = grads = local(grads)
    clamp = group.get("clip_grad_value") if value_clip else None
    per_tensor = group.get("clip_grad_norm_per_tensor")
    norm_clip = per_tensor is not None or group.get("max_grad_norm") is not None
    item.deferred = (bool(grads) and defer is not None
                     and (defer.groups is None or id(group) in defer.groups)
                     and not (clamp is not None and norm_clip))
    item.unscale = unscale = _unscale(opt, group)
    if item.deferred:
        base = (-1.0 if group.get("maximize", False) else 1.0) * unscale
        if not (torch.is_tensor(base) or base != 1.0 or norm_clip or clamp is not None):
            return item  # nothing scales or clips
        item.scalars = GradScalars(_full(base, len(grads), grads[0].device), None, clamp)
        if norm_clip:
            sums = defer.sums_of_squares(grads)
            if item.shard_sums is not None:  # over the whole tensors
                local_sums = _ops.sq_norms(grads).double() if sums is None else sums
                item.pending = item.shard_sums.request(local_sums, range(len(grads)))
            else:
                _scale_by_tensor_norms(item, sums)
    elif grads:
        if group.get("maximize", False):
            grads = torch._foreach_neg(grads)
        grads = _ops.scale(grads, unscale)
        item.grads = grads = _ops.clip_by_value(grads, clamp)
        if item.shard_sums is None:
            item.grads = _ops.clip_by_tensor_norm(grads, per_tensor)
        elif norm_clip:  # whole-tensor norms: one reduction, shared with the global clip
            item.pending = item.shard_sums.norms_request(grads)
    return item


def _full(base: Any, n: int, device: torch.device) -> Tensor:
    """``n`` multipliers equal to ``base`` (a number, or a 0-d tensor), float64 on ``device``."""
    if torch.is_tensor(base):
        return base.to(device, torch.float64).expand(n).clone()
    return torch.full((n,), base, dtype=torch.float64, device=device)


def _clip_by_tensor_norms(item: GroupGrads, totals: Tensor) -> None:
    """A sharded group's norm clippings, with its sums totalled over the shards (``pending``)."""
    item.pending = None
    if item.deferred:
        _scale_by_tensor_norms(item, totals)
        return
    norms, per_tensor = totals, item.group.get("clip_grad_norm_per_tensor")
    if per_tensor is not None:
        coefs = _ops.clip_coef(norms, per_tensor)
        item.grads = _ops.scale_each(item.grads, coefs)
        norms = norms * coefs
    item.grad_norms = norms


def _scale_by_tensor_norms(item: GroupGrads, sums: Optional[Tensor]) -> None:
    """A deferred group's raw gradients' norms (from ``sums``, their sums of squares over whole
    tensors, or from torch where None), and its multipliers times ``clip_grad_norm_per_tensor``'s
    coefficients."""
    grads, scalars = item.grads, item.scalars
    item.norms = _ops.norms(grads) if sums is None else sums.sqrt().to(torch.float32)
    mults = scalars.mults
    per_tensor = item.group.get("clip_grad_norm_per_tensor")
    if per_tensor is not None:
        mults = mults * _ops.clip_coef(item.norms * item.unscale, per_tensor).to(mults)
    item.scalars = GradScalars(mults, sums, scalars.clamp)


class NormParts:
    """The pieces of the global gradient norm, per tensor, by (group, position): what a step
    that sees every gradient at once computes, and a step taken in pieces (in backward)
    gathers piece by piece, so that both total them in the same order into the same bits."""

    def __init__(self) -> None:
        #: (group's position, plain: 0 / deferred: 1 / sharded: 2) -> [(positions, vector)]
        self.chunks: Dict[Tuple[int, int], List[Tuple[List[int], Tensor]]] = {}

    def add(self, opt: Any, staged: List[GroupGrads]) -> None:
        """The per-tensor pieces of ``staged`` (the plain gradients' norms, the deferred ones'
        scaled norms, the sharded ones' whole-tensor norms)."""
        where = {id(g): k for k, g in enumerate(opt.param_groups)}
        for s in staged:
            if not s.grads:
                continue
            if s.deferred:
                if s.norms is None:
                    continue
                kind, vector = 1, s.norms * s.scalars.mults.to(s.norms).abs()
            elif s.grad_norms is not None:
                kind, vector = 2, s.grad_norms
            else:
                kind, vector = 0, _ops.norms(s.grads)
            self.chunks.setdefault((where.get(id(s.group), -1), kind), []).append(
                (list(s.idx), vector))

    def _vectors(self, kind: int) -> List[Tensor]:
        """Each group's vector of ``kind``, its tensors in their group's order."""
        out = []
        for key in sorted(k for k in self.chunks if k[1] == kind):
            chunks = self.chunks[key]
            if len(chunks) == 1:
                out.append(chunks[0][1])
                continue
            idx = [i for positions, _ in chunks for i in positions]
            joined = torch.cat([v.to(chunks[0][1].device) for _, v in chunks])
            order = sorted(range(len(idx)), key=idx.__getitem__)
            out.append(joined[torch.tensor(order, device=joined.device)])
        return out

    def total(self) -> Tensor:
        """The global norm: the plain gradients' norms totalled per device, then the deferred
        and sharded groups' (the order and arithmetic of a step that sees them all)."""
        plain = self._vectors(0)
        by_device: Dict[Any, List[Tensor]] = {}
        for v in plain:
            by_device.setdefault(v.device, []).append(v)
        total = torch.zeros(())
        if by_device:
            parts = [torch.cat(vs).square().sum() for vs in by_device.values()]
            total = parts[0]
            for extra in parts[1:]:
                total = total + extra.to(parts[0].device)
            total = total.sqrt()
        scaled = [v.square().sum() for v in self._vectors(1) + self._vectors(2)]
        if scaled:
            extra = torch.stack([x.to(scaled[0].device) for x in scaled]).sum()
            if not by_device:
                total = extra.sqrt()  # on the deferred gradients' device, nothing moved to the host
            else:
                total = (total.square() + extra.to(total.device)).sqrt()
        return total


def _clip_by_global_norm(opt: Any, staged: List[GroupGrads],
                         known: Optional[Tensor] = None) -> Tensor:
    """``max_grad_norm``: scale the gradients of the groups that set it by ``c / max(||g||,
    c)``, ``||g||`` (returned, or ``known``: the norm of a step taken in pieces) over every
    gradient of every group (deferred ones: into their scalars)."""
    if known is None:
        parts = NormParts()
        parts.add(opt, staged)
        total = parts.total()
    else:
        total = known
    for s in staged:
        if s.group.get("max_grad_norm") is None or not s.grads:
            continue
        coef = _ops.clip_coef(total, s.group["max_grad_norm"])
        if s.deferred:  # float64, as the C kernels' multipliers always were
            s.scalars = dataclasses.replace(s.scalars,
                                            mults=s.scalars.mults * coef.to(s.scalars.mults))
        else:
            s.grads = _ops.scale(s.grads, coef)
            if s.grad_norms is not None:
                s.grad_norms = s.grad_norms * coef
    return total


def _found_inf(opt: Any) -> bool:
    """Whether a GradScaler handed the optimizer an inf/NaN found in the gradients."""
    found = getattr(opt, "found_inf", None) if opt._takes_amp_scale else None
    return found is not None and float(found) != 0.0


def _skipped() -> Intake:
    out = Intake()
    out.skipped = True
    return out


def any_nonfinite(t: Tensor) -> bool:
    return t.numel() > 0 and not bool(torch.isfinite(t).all())
