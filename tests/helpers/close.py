"""How close two implementations of one update must come when their arithmetic is ordered
differently (scaleopt's kernels against torch's optimizers, a kernel against the reference
loop): a few float32 roundings of the weight and of the step, per step taken.

A step of Adam, AdamW or LAMB moves a weight w by about ``step`` (the learning rate times a
ratio near 1); computing the new weight in another order rounds it a few times, each rounding
off by at most half an ulp of |w| or of the step. After ``steps`` steps on the same gradients
the two results are within ``ulps * steps * eps * (|w| + step)``, where an absolute tolerance
(1e-7, say) on a weight near zero is a large multiple of its ulps on one machine's rounding and
a small one on another's. Gradients computed from the weights (a loss's backward) carry the
first difference into the next step, amplified where a gradient is near zero: comparisons with
this tolerance give both sides the same gradients."""

from __future__ import annotations

from typing import Any, Optional

import torch

EPS = torch.finfo(torch.float32).eps


def assert_within_steps(got: Any, want: Any, step: float, steps: int = 1, ulps: float = 2.0,
                        msg: Optional[str] = None) -> None:
    """``|got - want| <= ulps * steps * eps * (|want| + step)`` element by element (float32
    ``eps``; ``step``: the size of one step, for Adam-type updates the learning rate)."""
    tol = ulps * steps * EPS
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * step, msg=msg)
