"""Where a DTensor's elements lie: for each rank of the mesh dimensions that cut it, the global
indices it holds along each tensor dimension.

A placement cuts one tensor dimension, so a rank's local shard is the product of one index
set per dimension: the indices that the placements of its mesh coordinate leave along that
dimension, applied left to right as DTensor applies them (``Shard``: torch.chunk's blocks;
FSDP2's ``_StridedShard`` over tensor parallelism's ``Shard``: the interleaved blocks that
the two make together). Muon's exchange joins a matrix from these blocks on one rank and cuts
its result the same way, whatever the mesh: FSDP2's ``Shard(0)``, tensor parallelism's
``Shard(0)`` and ``Shard(1)``, FSDP x TP on two mesh dimensions, expert parallelism's cut of a
stack's leading dimension, each also under HSDP's ``Replicate()``.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._sharding import _dtensor, cuts

#: the process groups over several mesh dimensions, by their global ranks
_GROUPS: Dict[Tuple[int, ...], Any] = {}
#: the layouts of each mesh, by (placements, shape)
_LAYOUTS: Dict[int, Dict[Tuple[Any, ...], Optional["Layout"]]] = {}


class Layout:
    """How a parameter is cut: ``group``, the process group over the mesh dimensions that cut
    it (its rank ``k`` holds ``index[k]``: per tensor dimension, the global indices held, in
    local order); ``replicas``, the group over the dimensions that copy it, or None."""

    __slots__ = ("group", "replicas", "index", "ranks", "me", "kept", "__weakref__")

    def __init__(self, group: Any, replicas: Any, index: List[List[Tensor]]) -> None:
        self.group, self.replicas, self.index = group, replicas, index
        self.ranks, self.me = len(index), dist.get_rank(group)
        #: what users of the layout derive from it once (Muon's matrices of a parameter), by
        #: their own keys
        self.kept: Dict[Any, Any] = {}


def layout(p: Tensor) -> Optional[Layout]:
    """The :class:`Layout` of ``p``: None where nothing cuts it over more than one rank; an
    error naming the placement for what no exchange can join (a ``Partial`` one)."""
    if not isinstance(p, _dtensor()):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    known = _LAYOUTS.get(id(mesh))
    if known is None:
        known = _LAYOUTS[id(mesh)] = {}
        weakref.finalize(mesh, _LAYOUTS.pop, id(mesh), None)
    key = (placements, tuple(p.shape))
    if key not in known:
        known[key] = _layout_of(p, mesh, placements)
    return known[key]


def _layout_of(p: Tensor, mesh: Any, placements: Tuple[Any, ...]) -> Optional[Layout]:
    if any(pl.is_partial() for pl in placements):
        raise NotImplementedError(
            f"a {tuple(p.shape)} parameter placed {placements} holds partial sums, which no "
            f"exchange joins into its matrix: reduce it first")
    cut = [d for d, pl in enumerate(placements) if cuts(pl) and mesh.size(d) > 1]
    if not cut:
        return None
    copies = [d for d, pl in enumerate(placements) if pl.is_replicate() and mesh.size(d) > 1]
    group = group_over(mesh, cut)
    replicas = group_over(mesh, copies) if copies else None
    index = []
    for r in dist.get_process_group_ranks(group):
        coordinate = [int(c) for c in (mesh.mesh == r).nonzero()[0]]
        index.append([_held(p.shape, d, placements, mesh, coordinate) for d in range(p.ndim)])
    return Layout(group, replicas, index)


def _held(shape: Sequence[int], dim: int, placements: Sequence[Any], mesh: Any,
          coordinate: Sequence[int]) -> Tensor:
    """The global indices along ``dim`` of the block at mesh ``coordinate`` (in its order)."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    t = torch.arange(shape[dim]).view(view)
    for m, pl in enumerate(placements):
        if cuts(pl) and pl.dim % len(shape) == dim and mesh.size(m) > 1:
            pieces, _ = pl._split_tensor(t, mesh.size(m), with_padding=False, contiguous=False)
            t = pieces[coordinate[m]] if coordinate[m] < len(pieces) else t.narrow(dim, 0, 0)
    return t.reshape(-1).contiguous()


def group_over(mesh: Any, dims: Sequence[int]) -> Any:
    """The process group of the ranks that share this rank's mesh coordinate but along
    ``dims``: a mesh dimension's own group, or (several dimensions) one made once, by the
    member ranks alone."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    here = mesh.get_coordinate()
    pick = tuple(slice(None) if d in dims else here[d] for d in range(mesh.ndim))
    ranks = tuple(sorted(int(r) for r in mesh.mesh[pick].reshape(-1)))
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


def block_index(indices: Sequence[Tensor]) -> Tuple[Any, ...]:
    """An index of a tensor whose entries along each dimension are ``indices``' (the block
    they make): slices where they are runs, else broadcast index tensors."""
    if all(is_run(ix) for ix in indices):
        return tuple(slice(int(ix[0]), int(ix[0]) + ix.numel()) if ix.numel() else slice(0, 0)
                     for ix in indices)
    n = len(indices)
    return tuple(ix.view([-1 if i == d else 1 for i in range(n)]) for d, ix in enumerate(indices))


def is_run(ix: Tensor) -> bool:
    """Whether the indices ``ix`` are consecutive and increasing (or none)."""
    return ix.numel() == 0 or (int(ix[-1]) - int(ix[0]) + 1 == ix.numel()
                               and bool((ix.diff() == 1).all()))
