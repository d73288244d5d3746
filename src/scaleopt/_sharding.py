"""Sharded parameters (FSDP2 / DTensor): local shards, and sums over whole tensors in one go.

Sharding is a property of the parameters, not of an optimizer. For a group whose parameters are
DTensors, an optimizer runs its update on the local shards (:func:`local`) and asks
:class:`ShardSums` for whatever needs a whole tensor: each quantity (a squared norm, a dot
product) is summed over the local shard, the per-tensor partial sums go into one vector, and
that vector is all-reduced once per mesh dimension that shards the tensors, not once per
tensor. A mesh dimension that replicates a tensor (HSDP's ``Replicate()``) holds the whole
tensor along it and adds nothing.

An update that needs such totals asks for them between two of its phases, which are plain
calls: each phase returns a :class:`Reduction` (or None), and :func:`total` totals the
reductions of all param groups of a step together, one all-reduce per process group, so that a
step's collectives do not grow with the number of groups. The optimizer's ``step`` calls the
phases in order (``scaleopt._group.Update``); the C kernels are cut the same way (a sums pass,
then an apply pass).

Every place that asks for a reduction:

* ``_intake._collect``: the gradients' norms for ``clip_grad_norm_per_tensor`` and
  ``max_grad_norm`` (one reduction, before the update);
* ``lamb._MultiTensorLamb.sums``: ||w||^2 and ||u||^2 of the tensors that take the trust ratio;
* ``lans._MultiTensorLans``: the gradients' norms (``grad_sums``, unless the intake's clipping
  gave them), then ||w||^2, ||r||^2, ||c||^2 (and <c, r>) (``sums``);
* ``_native.LayerwiseKernel`` and ``_triton.TritonStep``: the sums pass's per-tensor sums
  (LAMB 2, LANS 4 per tensor), and for LANS the gradients' sums of squares first, unless given;
* ``noise.GradientNoiseScale``: the micro-batches' squared norms.
"""

from __future__ import annotations

import functools
import itertools
import operator
import math
import sys
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _ops


class _NoDTensor:
    """Stands for the DTensor class while no DTensor can exist."""


_DTENSOR_MODULES = ("torch.distributed.tensor._api", "torch.distributed._tensor.api")  # 2.4
#: the DTensor class once its module is imported (a class: process-wide by nature)
_dtensor_class: Any = None


def _dtensor() -> Any:
    """The DTensor class, without importing it (half a second): until its module has been
    imported by someone, no tensor is a DTensor."""
    global _dtensor_class
    if _dtensor_class is None:
        for name in _DTENSOR_MODULES:
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "DTensor"):
                _dtensor_class = module.DTensor
                return _dtensor_class
        return _NoDTensor
    return _dtensor_class


def is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor())


def any_dtensor(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` is a DTensor (a set of their types: one pass in C)."""
    cls = _dtensor()
    return cls is not _NoDTensor and any(map(issubclass, set(map(type, tensors)),
                                             itertools.repeat(cls)))


def cuts(placement: Any) -> bool:
    """Whether a DTensor placement cuts a tensor dimension into blocks: ``Shard`` and FSDP2's
    ``_StridedShard`` (which torch 2.13 does not count as ``is_shard()``)."""
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def local_piece(t: Tensor) -> Tensor:
    """A DTensor's local shard (a view of its memory), another tensor itself."""
    return t.to_local() if isinstance(t, _dtensor()) else t


def like(template: Tensor, piece: Tensor, shape: Optional[Sequence[int]] = None) -> Tensor:
    """``piece`` (a local shard's values) as a DTensor laid out as ``template``, when that is
    one (of ``template``'s global shape and strides, or of the contiguous global ``shape``
    given: a tensor of another shape placed alike); ``piece`` itself otherwise."""
    DTensor = _dtensor()
    if not isinstance(template, DTensor):
        return piece
    if shape is None:
        shape, stride = template.shape, template.stride()
    else:
        shape = tuple(shape)
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(piece, template.device_mesh, template.placements,
                              shape=shape, stride=stride)


def local(tensors: Sequence[Tensor]) -> List[Tensor]:
    """Each DTensor's local shard (a view of its memory), other tensors as they are."""
    if not any_dtensor(tensors):  # this runs over every tensor of every step
        return list(tensors)
    cls = _dtensor()
    return [t.to_local() if isinstance(t, cls) else t for t in tensors]


#: id(mesh) -> {placements: the process groups that split a tensor so placed}, while the mesh
#: lives (looking the groups up by name costs more than the rest of a step's bookkeeping).
#: Process-wide, as meshes are: every optimizer over a mesh's tensors finds the same groups,
#: and an entry goes with its mesh
_SHARDING_GROUPS: Dict[int, Dict[Any, List[Any]]] = {}


def on_any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over the ranks of the default process group (every rank calls this; one
    small all-reduce, none without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _sharding_groups(t: Tensor) -> List[Any]:
    """The process groups of the mesh dimensions along which ``t`` is split into pieces (a
    list not to be changed)."""
    if not isinstance(t, _dtensor()):
        return []
    mesh, placements = t.device_mesh, t.placements
    known = _SHARDING_GROUPS.get(id(mesh))
    if known is None:
        known = _SHARDING_GROUPS[id(mesh)] = {}
        weakref.finalize(mesh, _SHARDING_GROUPS.pop, id(mesh), None)
    groups = known.get(placements)
    if groups is None:
        groups = known[placements] = [mesh.get_group(d) for d, pl in enumerate(placements)
                                      if cuts(pl)]
    return groups


class ShardSums:
    """Sums over whole tensors from the local shards' partial sums of ``params``'s tensors.

    :meth:`request` takes a vector of partial sums and, for each entry, the index of the
    parameter the summed quantity is shaped like, as a :class:`Reduction` for a phase of an
    update to return; :func:`total` gives its totals after one all-reduce per ``(mesh,
    dimension)`` that shards any of those parameters (FSDP2: one).
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.dims = [_sharding_groups(p) for p in params]

    def request(self, sums: Tensor, owners: Sequence[int]) -> "Reduction":
        return Reduction(self, sums, owners)

    def norms_request(self, pieces: Sequence[Tensor]) -> "Reduction":
        """The whole norm of each tensor whose local piece is ``pieces[i]``."""
        return Reduction(self, _ops.sq_norms(pieces), range(len(pieces)), root=True)


class Reduction(NamedTuple):
    """Partial sums to total over the shards: ``sums[e]`` is a quantity shaped like parameter
    ``owners[e]`` of ``shard_sums``; with ``root``, the answer is the totals' square roots."""

    shard_sums: ShardSums
    sums: Tensor
    owners: Sequence[int]
    root: bool = False


def total(requests: Sequence[Optional[Reduction]]) -> List[Optional[Tensor]]:
    """Each request's totals over the shards (None for a None request), all requests in one
    all-reduce per process group that shards any of their entries: a step's collectives do not
    grow with its number of groups. No collective where no request is sharded."""
    out: List[Optional[Tensor]] = [None] * len(requests)
    if not any(map(operator.is_not, requests, itertools.repeat(None))):
        return out  # nothing sharded: nothing to reduce
    asked = [i for i, r in enumerate(requests) if r is not None]
    for i, totals in zip(asked, _total([requests[i] for i in asked])):
        out[i] = totals
    return out


def total_one(request: Optional[Reduction]) -> Optional[Tensor]:
    """One request's totals (:func:`total` of one)."""
    return None if request is None else _total([request])[0]


def _total(reductions: Sequence[Reduction]) -> List[Tensor]:
    """Each reduction's totals, after one all-reduce per process group (and device) that
    shards any of their entries: the entries of all reductions in one vector, in the widest of
    their dtypes."""
    by_group: Dict[Tuple[Any, Any], List[Tuple[int, List[int]]]] = {}
    for r, red in enumerate(reductions):
        entries: Dict[Any, List[int]] = {}  # process group -> entries (meshes may share groups)
        for entry, owner in enumerate(red.owners):
            for group in red.shard_sums.dims[owner]:
                entries.setdefault(group, []).append(entry)
        for group, idx in entries.items():
            by_group.setdefault((group, red.sums.device), []).append((r, idx))
    reduced = {r for parts in by_group.values() for r, _ in parts}
    totals = [red.sums.clone() if r in reduced else red.sums for r, red in enumerate(reductions)]
    for (group, device), parts in by_group.items():
        index = {r: torch.tensor(idx, device=device) for r, idx in parts
                 if len(idx) < totals[r].numel()}
        pieces = [totals[r].index_select(0, index[r]) if r in index else totals[r]
                  for r, _ in parts]
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in pieces])
        flat = torch.cat([p.to(dtype) for p in pieces])
        _all_reduce(flat, group)
        for (r, _), part in zip(parts, flat.split([p.numel() for p in pieces])):
            part = part.to(totals[r].dtype)
            if r in index:
                totals[r].index_copy_(0, index[r], part)
            else:
                totals[r].copy_(part)
    return [t.sqrt() if red.root else t for t, red in zip(totals, reductions)]


def _all_reduce(t: Tensor, group: Any) -> None:
    try:
        dist.all_reduce(t, group=group)
    except RuntimeError as exc:
        if "No backend type associated with device type" not in str(exc):
            raise
        raise RuntimeError(
            f"the optimizer sums the shards' norms with a collective on {t.device.type} "
            f"tensors, and the process group has no backend for them: initialise it with one "
            f"for each device type, e.g. init_process_group(\"cpu:gloo,cuda:nccl\") ({exc})"
        ) from exc
