"""The one driver of "step this optimizer N times" that the test files share: on gradients the
test gives (the numbers then depend on the optimizer alone), or on a loss's backward."""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence


def on_gradients(opt: Any, params: Sequence[Any], steps: Iterable[int],
                 grads: Callable[[int], List[Any]]) -> None:
    """For each step ``t`` of ``steps``: every parameter's gradient set to ``grads(t)``'s (in
    the order of ``params``), then ``opt.step()``."""
    for t in steps:
        for p, g in zip(params, grads(t)):
            p.grad = g
        opt.step()


def on_loss(opt: Any, steps: Iterable[int], loss: Callable[[int], Any],
            before_step: Optional[Callable[[], None]] = None, scheduler: Any = None) -> None:
    """For each step ``t`` of ``steps``: ``zero_grad``, ``loss(t).backward()`` (``loss`` may
    run several backwards itself and return None), ``before_step()`` (clipping), the step and
    the scheduler's."""
    for t in steps:
        opt.zero_grad()
        value = loss(t)
        if value is not None:
            value.backward()
        if before_step is not None:
            before_step()
        opt.step()
        if scheduler is not None:
            scheduler.step()
