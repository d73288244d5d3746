"""Sharded parameters (FSDP2 / DTensor): local shards, and sums over whole tensors in one go.

Sharding is a property of the parameters, not of an optimizer. For a group whose parameters are
DTensors, an optimizer runs its update on the local shards (:func:`local`) and asks
:class:`ShardSums` for whatever needs a whole tensor: each quantity (a squared norm, a dot
product) is summed over the local shard, the per-tensor partial sums go into one vector, and
that vector is all-reduced once per mesh dimension that shards the tensors, not once per
tensor. A mesh dimension that replicates a tensor (HSDP's ``Replicate()``) holds the whole
tensor along it and adds nothing.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import _blocks


class _NoDTensor:
    """Stands for the DTensor class while no DTensor can exist."""


_DTENSOR_MODULES = ("torch.distributed.tensor._api", "torch.distributed._tensor.api")  # 2.4
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
    cls = _dtensor()
    return any(isinstance(t, cls) for t in tensors)


def local_piece(t: Tensor) -> Tensor:
    """A DTensor's local shard (a view of its memory), another tensor itself."""
    return t.to_local() if isinstance(t, _dtensor()) else t


def like(template: Tensor, piece: Tensor) -> Tensor:
    """``piece`` (a local shard's values) as a DTensor laid out as ``template``, when that is
    one; ``piece`` itself otherwise."""
    DTensor = _dtensor()
    if not isinstance(template, DTensor):
        return piece
    return DTensor.from_local(piece, template.device_mesh, template.placements,
                              shape=template.shape, stride=template.stride())


def local(tensors: Sequence[Tensor]) -> List[Tensor]:
    """Each DTensor's local shard (a view of its memory), other tensors as they are."""
    return [local_piece(t) for t in tensors]


def _sharding_groups(t: Tensor) -> List[Any]:
    """The process groups of the mesh dimensions along which ``t`` is split into pieces."""
    if not isinstance(t, _dtensor()):
        return []
    mesh = t.device_mesh
    return [mesh.get_group(d) for d, pl in enumerate(t.placements) if pl.is_shard()]


class ShardSums:
    """Sums over whole tensors from the local shards' partial sums of ``params``'s tensors.

    :meth:`reduce` takes a vector of partial sums and, for each entry, the index of the
    parameter the summed quantity is shaped like; it returns the total sums, after one
    all-reduce per ``(mesh, dimension)`` that shards any of those parameters (FSDP2: one).
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.dims = [_sharding_groups(p) for p in params]

    def norms(self, pieces: Sequence[Tensor]) -> Tensor:
        """The whole norm of each tensor whose local piece is ``pieces[i]`` (one reduction)."""
        return self.reduce(_blocks.sq_norms(pieces), range(len(pieces))).sqrt()

    def reduce(self, sums: Tensor, owners: Sequence[int]) -> Tensor:
        groups: Dict[Any, List[int]] = {}  # process group -> entries (meshes may share groups)
        for entry, owner in enumerate(owners):
            for group in self.dims[owner]:
                groups.setdefault(group, []).append(entry)
        if not groups:
            return sums
        sums = sums.clone()
        for group, entries in groups.items():
            if len(entries) == len(owners):
                _all_reduce(sums, group)
            else:
                index = torch.tensor(entries, device=sums.device)
                part = sums.index_select(0, index)
                _all_reduce(part, group)
                sums.index_copy_(0, index, part)
        return sums


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
