"""The gradient noise scale: where the critical batch size lies.

McCandlish, Kaplan, Amodei et al. (2018), "An Empirical Model of Large-Batch Training": with
``G`` the true gradient and ``Sigma`` the per-example gradient covariance, the simple noise scale

    B_simple = tr(Sigma) / |G|^2

estimates the critical batch: well below it, doubling the batch halves the steps a run needs;
well above it, a larger batch buys almost nothing. Neither quantity is observed, but the
squared norm of a gradient averaged over a batch of ``B`` examples has expectation

    E |G_B|^2 = |G|^2 + tr(Sigma) / B,

so norms measured at two batch sizes ``b < B`` give unbiased estimates (their appendix A.1)

    |G|^2    ~  (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~  (|G_b|^2 - |G_B|^2) / (1/b - 1/B).

Each is noisy, so :class:`GradientNoiseScale` keeps an exponential moving average of each and
reports the ratio of the averages. The two batch sizes come for free from gradient
accumulation: split a step's batch into ``k`` micro-batches, and the micro-batches' own gradients
are the small-batch ones, their sum the large-batch one. On several processes (DDP or FSDP2,
where each backward averages the micro-batch's gradient over the ranks) the sizes are global:
``k`` micro-batches of ``world x`` the per-rank micro-batch each.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional

import torch
from torch import Tensor

from . import _ops
from ._sharding import ShardSums, local, total_one

__all__ = ["GradientNoiseScale"]


class GradientNoiseScale:
    """Estimates ``B_simple = tr(Sigma) / |G|^2`` from the gradients of micro-batches.

    ``params``: the parameters whose gradients count (those that require them). At a step
    that measures, call :meth:`begin` before the first micro-batch's backward (the
    gradients must be None or zero, as after ``zero_grad``), :meth:`accumulated` after each of
    the ``k >= 2`` micro-batches' backward (each loss scaled by ``1 / k``, so that the gradients
    add up to the batch's mean), and :meth:`end` with the examples per micro-batch (over all
    ranks). ``beta`` is the moving averages' decay per measurement. Parameters may be FSDP2
    DTensors: the squared norms are totalled over the shards with one all-reduce per step that
    measures.

    Example (a batch of 64 in 4 micro-batches of 16)::

        >>> import torch, scaleopt
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(8, 1)
        >>> x = torch.randn(64, 8)
        >>> y = x.sum(1, keepdim=True) + torch.randn(64, 1)
        >>> noise = scaleopt.GradientNoiseScale(model.parameters())
        >>> model.zero_grad()
        >>> noise.begin()
        >>> for xs, ys in zip(x.chunk(4), y.chunk(4)):
        ...     (torch.nn.functional.mse_loss(model(xs), ys) / 4).backward()
        ...     noise.accumulated()
        >>> m = noise.end(micro_batch=16)
        >>> 0 < m["b_simple"] < 64  # far from the optimum: the gradient's mean dominates
        True
    """

    def __init__(self, params: Iterable[Tensor], beta: float = 0.9) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.params: List[Tensor] = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("GradientNoiseScale got no parameters that require gradients")
        self.beta = beta
        self._sums = ShardSums(self.params)
        self._before: Optional[List[Tensor]] = None
        self._small: List[Tensor] = []
        #: the moving averages of |G|^2 and tr(Sigma), and how many measurements they hold
        self.g2, self.trace, self.count = 0.0, 0.0, 0

    def begin(self) -> None:
        """Before the first micro-batch's backward of a step that measures."""
        self._before, self._small = None, []

    def _grads(self) -> List[Tensor]:
        return local([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def accumulated(self) -> None:
        """After a micro-batch's backward: the squared norm of what it added (per parameter,
        this rank's pieces; totalled in :meth:`end`)."""
        grads = self._grads()
        if self._before is None:
            added = grads
        else:
            added = [g.float() - b for g, b in zip(grads, self._before)]
        self._small.append(_ops.sq_norms(added))
        self._before = [g.detach().float().clone() for g in grads]

    def end(self, micro_batch: int) -> Dict[str, float]:
        """The step's measurement: ``{"g2", "trace"}`` (this step's estimates of ``|G|^2`` and
        tr(Sigma)), ``"small"`` and ``"large"`` (the mean squared norm of the micro-batches'
        gradients and that of the batch's), and ``"b_simple"`` (the moving averages' ratio,
        in examples; NaN while the average of ``|G|^2`` is not positive)."""
        k = len(self._small)
        if k < 2 or micro_batch < 1:
            raise ValueError("GradientNoiseScale.end needs two or more micro-batches "
                             f"(accumulated() after each backward) of at least one example; got "
                             f"{k} micro-batch(es) of {micro_batch}")
        sums = torch.cat(self._small + [_ops.sq_norms(self._grads())])
        n = len(self.params)
        totals = _total(self._sums, sums, list(range(n)) * (k + 1)).view(k + 1, n).sum(1)
        totals = totals.double().tolist()
        self._before, self._small = None, []
        # each micro-batch added its mean gradient / k
        small, large = k * k * sum(totals[:k]) / k, totals[k]
        b, big = micro_batch, k * micro_batch
        g2 = (big * large - b * small) / (big - b)
        trace = (small - large) / (1 / b - 1 / big)
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.trace = self.beta * self.trace + (1 - self.beta) * trace
        self.count += 1
        return {"g2": g2, "trace": trace, "small": small, "large": large,
                "b_simple": self.b_simple}

    @property
    def b_simple(self) -> float:
        """``tr(Sigma) / |G|^2`` from the moving averages (both start at zero and so carry the
        same factor ``1 - beta ** count``, which the ratio cancels), in examples; NaN before the
        first measurement or while the average of ``|G|^2`` is not positive."""
        if self.count == 0 or not self.g2 > 0:
            return math.nan
        return self.trace / self.g2

    def state_dict(self) -> Dict[str, float]:
        return {"g2": self.g2, "trace": self.trace, "count": self.count, "beta": self.beta}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.g2, self.trace = float(state["g2"]), float(state["trace"])
        self.count, self.beta = int(state["count"]), float(state["beta"])


def _total(shard_sums: ShardSums, sums: Tensor, owners: List[int]) -> Tensor:
    """``sums`` totalled over the shards of the parameters they belong to."""
    return total_one(shard_sums.request(sums, owners))
