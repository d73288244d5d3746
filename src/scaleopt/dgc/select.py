"""Choosing the k largest ``|v|``: exactly k indices, by a sampled threshold or by ``topk``."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import _native


def k_of(numel: int, sparsity: float) -> int:
    """``ceil(density * numel)``, at least 1 (for a non-empty tensor), at most ``numel``."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil((1.0 - sparsity) * numel - 1e-9)))


def topk_exact(v: Tensor, k: int) -> Tensor:
    """Indices of the k largest ``|v|`` of a flat tensor (``torch.topk``)."""
    return torch.topk(v.abs(), k, sorted=False).indices


def topk_sampled(v: Tensor, k: int, sample_fraction: float = 0.01,
                 generator: Optional[torch.Generator] = None) -> Tensor:
    """The same indices as :func:`topk_exact` (ties aside), usually much faster.

    Estimates the threshold from a random sample of about ``sample_fraction`` of the entries
    (the sample's top ``k * fraction``, with a margin so that the estimate errs low), keeps the
    entries at or above it, and takes the exact top-k among those few candidates. When the
    estimate keeps fewer than k entries it is lowered and tried again; after three tries, exact
    ``topk``. Always returns exactly k indices.
    """
    n = v.numel()
    if k >= n:
        return torch.arange(n, device=v.device)
    m = min(n, max(int(n * sample_fraction), 256))
    if m >= n or k * 8 > n:  # dense-ish selection: sampling does not pay
        return torch.topk(v.abs(), k, sorted=False).indices
    # drawn on the host (the generator is a CPU one), so a GPU run samples what a CPU run does
    sample = v[torch.randint(0, n, (m,), generator=generator).to(v.device)].abs()
    want = min(m, max(1, math.ceil(k * m / n * 2)))  # twice the expected count: err low
    threshold = float(torch.topk(sample, want, sorted=True).values[-1])
    capacity = 8 * k
    for _ in range(4):
        candidates = _native.select_above(v, threshold, capacity)
        if candidates is None:  # too many: a larger buffer
            capacity *= 4
            continue
        if candidates.numel() >= k:
            best = torch.topk(v[candidates].abs(), k, sorted=False).indices
            return candidates[best]
        threshold *= 0.5
    return torch.topk(v.abs(), k, sorted=False).indices
