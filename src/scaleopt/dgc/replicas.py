"""DGC between the replicas of sharded parameters (HSDP with the replica exchange compressed).

On a 2-D device mesh ``(replicate, shard)``, the model is ``fully_shard``-ed on the shard
dimension alone: its backward reduce-scatters each gradient inside a replica (the fast links),
and nothing crosses the replicas. :class:`~scaleopt.dgc.DGCMomentum` given ``mesh=`` does that
exchange itself, over the replicate dimension: each rank sends the top-k of its local shard's
accumulated velocity to the ranks holding the same shard in the other replicas. A shard's replicas
have the same local sizes, so they send the same k and make the same dense/sparse choices.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .._sharding import is_dtensor

SHARDED_ERROR = (
    "DGCMomentum got sharded (FSDP2 / DTensor) parameters without a mesh. DGC compresses the "
    "gradient exchange between replicas: with DDP (every rank holds every parameter), or with "
    "HSDP where the model is fully_shard-ed on the 'shard' dimension of a 2-D (replicate, "
    "shard) DeviceMesh and the optimizer is given that mesh: DGCMomentum(params, lr, "
    "mesh=mesh). Parameters sharded over every rank have no replicas, and DGC nothing to "
    "compress: use LAMB / LANS / AdamW / Momentum there.")


def check_mesh(mesh: Any, process_group: Any) -> Any:
    """``mesh`` if it is a 2-D (replicate, shard) DeviceMesh with at least two replicas; None
    for None. Raises for anything else."""
    if mesh is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise TypeError(f"mesh must be a 2-D DeviceMesh (replicate, shard), got "
                        f"{mesh if not isinstance(mesh, DeviceMesh) else f'{mesh.ndim}-D mesh'}")
    if process_group is not None:
        raise ValueError("give mesh= or process_group=, not both: with a mesh, DGC communicates "
                         "over its replicate dimension (mesh.get_group(0))")
    if mesh.size(0) < 2:
        raise ValueError(f"the mesh {tuple(mesh.shape)} has one replica: there is no exchange "
                         f"between replicas, so DGC has nothing to compress")
    return mesh


def _ranks(group: Any) -> List[int]:
    return list(dist.get_process_group_ranks(group))


def check_params(params: Sequence[Tensor], mesh: Any) -> None:
    """Every parameter a DTensor sharded on ``mesh``'s shard dimension (dimension 1)."""
    shard_ranks = _ranks(mesh.get_group(1))
    for i, p in enumerate(params):
        if not is_dtensor(p):
            raise TypeError(f"parameter {i} (shape {tuple(p.shape)}) is not sharded: with mesh=, "
                            f"every parameter must be sharded on the mesh's shard dimension "
                            f"(fully_shard(module, mesh=mesh['shard']))")
        pm = p.device_mesh
        if pm.ndim != 1:
            raise ValueError(
                f"parameter {i} lives on a {pm.ndim}-D mesh with placements {p.placements}: "
                f"plain HSDP (fully_shard on the 2-D mesh) already all-reduces each gradient "
                f"between the replicas, so DGC would have nothing left to compress. "
                f"fully_shard on mesh['shard'] instead and DGCMomentum exchanges between the "
                f"replicas")
        if _ranks(pm.get_group(0)) != shard_ranks or not all(pl.is_shard() for pl in p.placements):
            raise ValueError(f"parameter {i} is not sharded on the mesh's shard dimension "
                             f"(its mesh {pm}, placements {p.placements}): fully_shard(module, "
                             f"mesh=mesh['shard'])")


def whole_norms(mesh: Any) -> Callable[[Sequence[Tensor]], List[float]]:
    """Each tensor's norm from its local pieces: per-tensor norms (no mesh), or the shards'
    sums of squares totalled over the mesh's shard dimension (one all-reduce)."""
    if mesh is None:
        return lambda pieces: [float(torch.linalg.vector_norm(g.float())) for g in pieces]

    def norms(pieces: Sequence[Tensor]) -> List[float]:
        if not pieces:
            return []
        sq = torch.stack([g.float().square().sum() for g in pieces])
        dist.all_reduce(sq, group=mesh.get_group(1))
        return sq.sqrt().tolist()

    return norms


def layout(mesh: Optional[Any]) -> Optional[List[int]]:
    """The (replicas, shards) a checkpoint's per-rank state belongs to; None without a mesh."""
    return None if mesh is None else [mesh.size(0), mesh.size(1)]
