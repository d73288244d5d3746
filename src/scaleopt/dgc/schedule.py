"""The sparsity warm-up: dense before ``rampup_begin_step``, then Paddle's list walk."""

from __future__ import annotations

from typing import Optional, Sequence

#: The DGC paper's warm-up (Lin et al. 2018): densities 25%, 6.25%, 1.5625%, 0.4%, 0.1%.
PAPER_SPARSITY = (0.75, 0.9375, 0.984375, 0.996, 0.999)


def sparsity_at(step: int, rampup_begin_step: int, rampup_step: int,
                sparsity: Sequence[float]) -> Optional[float]:
    """The sparsity of step ``step`` (0-based), or None before ``rampup_begin_step`` (dense).

    After it, Paddle's index ``int((step - rampup_begin_step) * len(sparsity) / rampup_step)``,
    clamped to the last entry, which then holds.
    """
    if step < rampup_begin_step:
        return None
    i = int((step - rampup_begin_step) * len(sparsity) / rampup_step)
    return sparsity[min(i, len(sparsity) - 1)]
