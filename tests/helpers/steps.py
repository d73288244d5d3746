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


def lamb_moments(steps: int, device: str = "cpu", **options: Any) -> List[Any]:
    """LAMB's moments (float32 state), on the CPU, after ``steps`` steps with fixed gradients
    (LAMB's moments do not depend on the weights in its default decay mode) on tensors of
    ``device``: rows of whole 256-element blocks, of 384 and 70 elements, and a vector.
    ``options``: LAMB's (``implementation``, ``foreach``)."""
    import torch

    import scaleopt

    gen = torch.Generator().manual_seed(0)
    shapes = ((4, 512), (6, 384), (5, 70), (300,))
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(steps)]
    opt = scaleopt.LAMB(params, lr=1e-2, weight_decay=0.01, **options)
    on_gradients(opt, params, range(steps), lambda t: grads[t])
    return [(opt.state[p]["exp_avg"].cpu(), opt.state[p]["exp_avg_sq"].cpu()) for p in params]
