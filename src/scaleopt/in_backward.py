"""Steps inside the backward pass: each parameter updated as soon as its gradient is complete,
and the gradient freed (:func:`step_in_backward`).

A post-accumulate-grad hook on every parameter of the optimizer collects the parameters whose
gradients backward has completed; once they hold ``bucket_bytes`` of gradients (and at the end
of backward, for the rest), the optimizer's own ``step`` runs on them alone and their
gradients are set to None. So at most a bucket of gradients is alive at once (beside the
accumulated ones of earlier micro-batches, which accumulation needs), and each step is the
optimizer's step for those tensors: LAMB's and LANS's trust ratios are per tensor, AdamW is
element-wise, Muon iterates each matrix alone, so the bits are those of one step over all
parameters.

Global clipping (``max_grad_norm``) and ``nonfinite="skip"`` need every gradient before the
first update. ``clip="exact"`` takes two passes (:meth:`StepsInBackward.backward`): the first
forward and backward only gather each tensor's piece of the global norm (and whether any
gradient is inf/NaN) and free each gradient at once; the second, on the same inputs and the
same random numbers, steps with the norm known, the bits of the ordinary clipped step, for the
price of a second forward and backward. ``clip="previous"`` clips every step by the norm of
the step before (an approximation, in one pass; the first step is not clipped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

import torch
from torch import Tensor

from ._intake import NormParts
from ._sharding import is_dtensor

__all__ = ["step_in_backward", "StepsInBackward"]

#: the ways to clip by the global norm when the steps are taken in backward
CLIPS = ("exact", "previous")


@dataclasses.dataclass
class Piece:
    """What the intake of a step taken in pieces reads (``opt._backward_piece``)."""

    #: ids of the parameters whose gradients are complete: the ones this piece steps
    ready: Set[int]
    #: the first pass: gather the norm's pieces and look for inf/NaN, step nothing
    measuring: bool = False
    #: where each piece's part of the global norm goes (None: not needed)
    parts: Optional[NormParts] = None
    #: the global norm to clip by (None: no clipping this step)
    norm: Optional[Tensor] = None
    found_nonfinite: bool = False
    #: whether the global norm's finiteness decides a skip (set by the intake)
    by_norm: bool = False


class StepsInBackward:
    """The steps of one optimizer inside backward (made by :func:`step_in_backward`)."""

    def __init__(self, optimizer: Any, *, clip: Optional[str] = None,
                 bucket_bytes: int = 4 << 20) -> None:
        from ._base import ScaleOptimizer

        if not isinstance(optimizer, ScaleOptimizer) or ".compat" in type(optimizer).__module__:
            raise TypeError(f"step_in_backward takes a scaleopt optimizer (LAMB, LANS, AdamW, "
                            f"Muon, OffloadAdam, offload(...)), got {type(optimizer).__name__}")
        if clip is not None and clip not in CLIPS:
            raise ValueError(f"Invalid clip: {clip!r} (one of {list(CLIPS)} or None)")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"Invalid bucket_bytes: {bucket_bytes!r} (an int >= 0)")
        clipping = any(g.get("max_grad_norm") is not None for g in optimizer.param_groups)
        if clipping and clip is None:
            raise ValueError(
                "max_grad_norm clips by the norm of all gradients, which backward knows only "
                "at its end: pass clip='exact' (two passes, the ordinary step's bits: "
                "steps.backward(closure)) or clip='previous' (the previous step's norm, an "
                "approximation in one pass)")
        self.optimizer, self.clip, self.bucket_bytes = optimizer, clip, bucket_bytes
        self.clipping = clipping
        self._accumulating = 0
        self._ready: List[Tensor] = []
        self._ready_bytes = 0
        self._queued = False
        self._pass: Optional[Piece] = None
        self._held: Dict[int, Tensor] = {}
        self._previous: Optional[Tensor] = None
        self._hooks: List[Any] = []
        self._params: List[Tensor] = []
        self._internal = False
        #: how many pieces the last backward stepped (for the docs' and tests' counts)
        self.pieces = 0
        ref = weakref.ref(self)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._hook(p, ref)
        self._guard_step()
        optimizer.__dict__["_steps_in_backward"] = self

    # -- set-up ---------------------------------------------------------------------------------

    @property
    def two_passes(self) -> bool:
        """Whether a step needs the first, measuring pass: exact clipping, or skipping inf/NaN
        gradients (which must be known before any parameter moves)."""
        return (self.clipping and self.clip == "exact") or self.optimizer.nonfinite == "skip"

    def _hook(self, p: Tensor, ref: Any) -> None:
        if is_dtensor(p):
            raise NotImplementedError(
                "steps in backward on sharded (DTensor) parameters are not supported: FSDP2 "
                "writes a shard's gradient after its reduce-scatter, where no "
                "post-accumulate-grad hook runs")
        owner = getattr(p, "_scaleopt_in_backward", None)
        if owner is not None and owner() is not None:
            raise ValueError("a parameter is already stepped in backward by another optimizer: "
                             "each parameter may be hooked by one (remove() the other first)")
        p._scaleopt_in_backward = ref
        self._params.append(p)

        def ready(param: Tensor) -> None:
            steps = ref()
            if steps is not None:
                steps._on_ready(param)

        self._hooks.append(p.register_post_accumulate_grad_hook(ready))

    def _guard_step(self) -> None:
        opt = self.optimizer
        before = opt.__dict__.get("step")
        ref = weakref.ref(self)

        def step(self: Any, closure: Any = None) -> Any:
            steps = ref()
            if steps is None or not steps._internal:
                raise RuntimeError(
                    f"{type(opt).__name__} steps inside backward (step_in_backward): each "
                    f"parameter is updated as its gradient completes, so there is nothing left "
                    f"for step() to do; remove the call (or steps.remove() to step as usual). "
                    f"A closure or a GradScaler's step cannot run here either")
            return before(closure) if before is not None else type(opt).step(opt, closure)

        self._before_step = before
        opt.step = types.MethodType(step, opt)  # a method, as LR schedulers wrap it

    def remove(self) -> None:
        """Remove the hooks; the optimizer steps as usual again."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self._params:
            if getattr(p, "_scaleopt_in_backward", None) is not None:
                del p._scaleopt_in_backward
        opt = self.optimizer
        if self._before_step is not None:
            opt.step = self._before_step
        else:
            opt.__dict__.pop("step", None)
        opt.__dict__.pop("_steps_in_backward", None)

    # -- what users call ------------------------------------------------------------------------

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (the micro-batches before the last);
        the steps happen in the next backward outside."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def backward(self, closure: Callable[[], Tensor]) -> Tensor:
        """One step's backward from ``closure`` (runs the forward, returns the loss): one
        ``closure().backward()``, or with :attr:`two_passes` two, the first measuring (the
        random-number state is put back between them, so dropout draws alike). Returns the
        loss (of the pass that stepped)."""
        if not self.two_passes:
            loss = closure()
            loss.backward()
            return loss
        rng = _rng_state()
        self._held = {id(p): p.grad for p in self._params if p.grad is not None}
        for p in self._params:
            p.grad = None
        self._pass = Piece(set(), measuring=True,
                           parts=NormParts() if self.clipping else None)
        try:
            loss = closure()
            loss.backward()
        finally:
            measured, self._pass = self._pass, None
            held, self._held = self._held, {}
            for p in self._params:  # the accumulated gradients back (the first pass freed its own)
                p.grad = held.get(id(p))
        norm = measured.parts.total() if measured.parts is not None else None
        opt = self.optimizer
        if opt.nonfinite == "skip":
            found = (not bool(torch.isfinite(norm)) if measured.by_norm and norm is not None
                     else measured.found_nonfinite)
            if found:  # nothing moved: the step is skipped, as the ordinary step skips it
                opt.skipped_steps += 1
                opt.skipped = True
                for p in self._params:
                    p.grad = None
                return loss
        opt.skipped = False
        _set_rng_state(rng)
        self._norm, self._second = (norm if self.clipping else None), True
        try:
            loss = closure()
            loss.backward()
        finally:
            self._norm, self._second = None, False
        return loss

    # -- inside backward ------------------------------------------------------------------------

    _norm: Optional[Tensor] = None
    _second = False

    def _on_ready(self, p: Tensor) -> None:
        if self._accumulating:
            return
        if self._pass is None and self.two_passes and not self._second:
            raise RuntimeError(
                "this optimizer needs every gradient before its first update (max_grad_norm "
                "with clip='exact', or nonfinite='skip'): run the step's last backward as "
                "steps.backward(closure), where closure runs the forward and returns the loss")
        if p.grad is None:
            return
        if not self._queued:
            self._queued = True
            self.pieces = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        if self._pass is not None:  # measuring: the norm of the accumulated gradient
            held = self._held.get(id(p))
            if held is not None:
                p.grad = held + p.grad
        self._ready.append(p)
        self._ready_bytes += p.grad.numel() * p.grad.element_size()
        if self._ready_bytes >= self.bucket_bytes:
            self._step_ready()

    def _flush(self) -> None:
        self._queued = False
        if self._ready:
            self._step_ready()
        if self._pass is None and self.clipping and self.clip == "previous":
            self._previous = self._parts.total() if self._parts is not None else None
            self._parts = None

    _parts: Optional[NormParts] = None

    def _step_ready(self) -> None:
        """The optimizer's step on the parameters made ready (their gradients then freed)."""
        ready, self._ready, self._ready_bytes = self._ready, [], 0
        opt = self.optimizer
        piece = self._pass
        if piece is None:
            norm = self._norm if self.clip == "exact" else self._previous
            parts = None
            if self.clipping and self.clip == "previous":
                if self._parts is None:
                    self._parts = NormParts()
                parts = self._parts
            piece = Piece(set(), parts=parts, norm=norm)
        piece.ready = {id(p) for p in ready}
        opt.__dict__["_backward_piece"] = piece
        self._internal = True
        try:
            with torch.no_grad():
                opt.step()
        finally:
            self._internal = False
            del opt.__dict__["_backward_piece"]
        for p in ready:
            p.grad = None
        self.pieces += 1


def step_in_backward(optimizer: Any, *, clip: Optional[str] = None,
                     bucket_bytes: int = 4 << 20) -> StepsInBackward:
    """Step ``optimizer`` inside the backward pass: each parameter is updated as soon as its
    gradient is complete (in buckets of ``bucket_bytes`` of gradients; 0: one tensor at a time)
    and its gradient freed, so a full set of gradients never exists at once.

    ``optimizer.step()`` is then an error (the steps already happened); ``zero_grad`` has
    nothing left to do. Accumulate micro-batches inside ``with steps.accumulating():``; the
    last one's backward steps. With ``max_grad_norm``, ``clip`` must say how: ``"exact"``
    (two passes through ``steps.backward(closure)``: the ordinary step's bits) or
    ``"previous"`` (the previous step's norm, an approximation). ``nonfinite="skip"`` takes the
    two passes too: an inf/NaN anywhere skips the whole step before anything moves, counted in
    ``skipped_steps``. See :doc:`/memory`.

    >>> import torch, scaleopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = scaleopt.LAMB(model.parameters(), lr=1e-3)
    >>> steps = scaleopt.step_in_backward(opt)
    >>> model(torch.randn(8, 4)).square().mean().backward()  # the step happens here
    >>> model.weight.grad is None
    True
    """
    return StepsInBackward(optimizer, clip=clip, bucket_bytes=bucket_bytes)


def _rng_state() -> Any:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Any) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
