"""Sending exactly k (index, value) pairs per tensor with one all-gather, and decoding them."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

INT32_LIMIT = 2 ** 31


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices, int64 only for tensors of 2^31 elements or more."""
    return torch.int32 if numel < INT32_LIMIT else torch.int64


def world_of(group: Optional[dist.ProcessGroup]) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class PeerFailure(RuntimeError):
    """A collective failed or timed out: a peer rank has probably died."""


def _collective(fn, what: str):
    try:
        return fn()
    except RuntimeError as exc:  # gloo/NCCL errors and timeouts
        raise PeerFailure(
            f"DGC {what} failed (a peer rank may have died or stalled past the process group's "
            f"timeout): {exc}"
        ) from exc


def any_rank(flags: List[bool], group: Optional[dist.ProcessGroup],
             device: torch.device) -> List[bool]:
    """``flags`` OR-ed over the ranks (one small all-reduce; the flags themselves in one
    process)."""
    if world_of(group) <= 1 or not flags:
        return list(flags)
    t = torch.tensor(flags, dtype=torch.int32, device=device)
    _collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), "all-reduce")
    return [bool(f) for f in t.tolist()]


#: bytes of the scale sent before a tensor's int8 values
SCALE_BYTES = 4


def encode(values: Tensor, dtype: torch.dtype) -> Tensor:
    """The values as sent: cast to ``dtype``, or for ``torch.int8`` rounded to 127 levels of
    their largest magnitude, that scale (float32) sent first as 4 int8 bytes."""
    if dtype != torch.int8:
        return values.to(dtype)
    x = values.float()
    top = x.abs().max() if x.numel() else x.new_zeros(())
    scale = torch.where(top > 0, top / 127, torch.ones_like(top)).reshape(1)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([scale.view(torch.int8), q])


def decode(sent: Tensor) -> Tensor:
    """The values :func:`encode` sent, as the receiver (and the sender's residual) reads them:
    float32 for int8, else as sent."""
    if sent.dtype != torch.int8:
        return sent
    scale = sent[:SCALE_BYTES].clone().view(torch.float32)
    return sent[SCALE_BYTES:].float() * scale


def _order(sizes: Sequence[int]) -> List[int]:
    """Segments by decreasing element size (stable): each segment's bytes are a multiple of its
    element size, so every segment starts aligned for its dtype."""
    return sorted(range(len(sizes)), key=lambda j: -sizes[j])


def pack(indices: Sequence[Tensor], values: Sequence[Tensor]) -> Tensor:
    """One byte buffer holding every tensor's indices and values (int64 before int32 before
    2-byte values, so that each can be viewed in place)."""
    segments = [t for pair in zip(indices, values) for t in pair]
    parts = [segments[j].contiguous().view(torch.uint8)
             for j in _order([t.element_size() for t in segments])]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buf: Tensor, layout: Sequence[Tuple[int, torch.dtype, torch.dtype]]):
    """Inverse of :func:`pack` for one rank's buffer: ``layout`` is (k, index dtype, value dtype)
    per tensor, the same on every rank (int8 values: :func:`encode`'s, the scale first).
    Returns (indices, values) per tensor."""
    specs = [(k + SCALE_BYTES * (vdt == torch.int8), dt) if dt is vdt else (k, dt)
             for k, idt, vdt in layout for dt in (idt, vdt)]
    views: List[Optional[Tensor]] = [None] * len(specs)
    at = 0
    for j in _order([dt.itemsize for _, dt in specs]):
        k, dt = specs[j]
        views[j] = buf[at:at + k * dt.itemsize].view(dt)
        at += k * dt.itemsize
    return [(views[2 * t], views[2 * t + 1]) for t in range(len(layout))]


def _count(sent: Optional[Dict[str, float]], buf: Tensor, wire: float) -> None:
    """Add a buffer handed to a collective to ``sent``: its bytes, and the bytes this rank puts
    on the wire for it (``wire`` times them)."""
    if sent is not None:
        sent["buffer_bytes"] += buf.numel() * buf.element_size()
        sent["bytes_sent_measured"] += wire * buf.numel() * buf.element_size()


def sparse_allgather_mean(indices: List[Tensor], values: List[Tensor], numels: List[int],
                          group: Optional[dist.ProcessGroup],
                          sent: Optional[Dict[str, float]] = None) -> List[Tensor]:
    """Every rank sends its k (index, value) pairs per tensor in one all-gather; returns, per
    tensor, the dense mean over ranks of the scattered values (flat, in the decoded values'
    dtype: see :func:`encode`). ``sent`` counts the buffer (a ring all-gather sends it to
    N - 1 ranks)."""
    world = world_of(group)
    layout = [(i.numel(), i.dtype, v.dtype) for i, v in zip(indices, values)]
    buf = pack(indices, values)
    _count(sent, buf, max(world - 1, 0))
    if world > 1:
        chunks = [torch.empty_like(buf) for _ in range(world)]
        _collective(lambda: dist.all_gather(chunks, buf, group=group), "all-gather")
    else:
        chunks = [buf]
    dense = [torch.zeros(n, dtype=torch.float32 if v.dtype == torch.int8 else v.dtype,
                         device=v.device) for n, v in zip(numels, values)]
    for chunk in chunks:
        for d, (i, v) in zip(dense, unpack(chunk, layout)):
            d.index_add_(0, i.long(), decode(v))
    if world > 1:
        for d in dense:
            d.div_(world)
    return dense


def dense_allreduce_mean(tensors: List[Tensor], group: Optional[dist.ProcessGroup],
                         sent: Optional[Dict[str, float]] = None) -> List[Tensor]:
    """The mean over ranks of each tensor (one flat all-reduce); copies, inputs untouched.
    ``sent`` counts the buffer (a ring all-reduce sends 2 (N - 1) / N of it)."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors])
    world = world_of(group)
    _count(sent, flat, 2 * (world - 1) / world)
    if world > 1:
        _collective(lambda: dist.all_reduce(flat, group=group), "all-reduce")
        flat.div_(world)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out
