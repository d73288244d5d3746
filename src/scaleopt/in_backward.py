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

On FSDP2 (and HSDP) the same hooks run on the shards: FSDP2 calls a sharded parameter's
post-accumulate-grad hooks once its reduce-scatter (and HSDP's all-reduce) has set the shard's
gradient. A piece there is made of whole modules: a module's shards, views of one
reduce-scatter's output, are never split, so LAMB's and LANS's norms of a module's tensors are
totalled in one all-reduce; the bucket counts whole tensors' bytes, the same on every rank, so
every rank steps the same pieces. The weights are the ordinary sharded step's bits.

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
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

import torch
import torch.distributed as dist
from torch import Tensor

from ._intake import NormParts
from ._sharding import is_dtensor, local_piece

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
                 bucket_bytes: int = 4 << 20, ddp: Any = None) -> None:
        self.clipping = _check(optimizer, clip, bucket_bytes)
        if ddp is not None:
            _check_ddp(ddp, optimizer)
        self.optimizer, self.clip, self.bucket_bytes = optimizer, clip, bucket_bytes
        #: the DistributedDataParallel module whose buckets' all-reduces the steps follow
        self.ddp = ddp
        self._buckets: List[Any] = []  # DDP: (future, parameters) of buckets not stepped yet
        self._stepped: List[Tensor] = []  # DDP: the parameters stepped in this backward
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
        if ddp is not None:
            _follow_ddp(self, ddp)
        elif _data_parallel() and not all(map(is_dtensor, self._params)):
            warnings.warn(
                "steps in backward on several ranks without ddp= take each rank's own "
                "gradients, before any all-reduce: under DistributedDataParallel pass "
                "step_in_backward(opt, ddp=model)", stacklevel=3)
        self._guard_step()
        optimizer.__dict__["_steps_in_backward"] = self

    # -- set-up ---------------------------------------------------------------------------------

    @property
    def two_passes(self) -> bool:
        """Whether a step needs the first, measuring pass: exact clipping, or skipping inf/NaN
        gradients (which must be known before any parameter moves)."""
        return (self.clipping and self.clip == "exact") or self.optimizer.nonfinite == "skip"

    def _hook(self, p: Tensor, ref: Any) -> None:
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
            if steps is None or not (steps._internal or _making_state(opt)):
                raise RuntimeError(
                    f"{type(opt).__name__} steps inside backward (step_in_backward): each "
                    f"parameter is updated as its gradient completes, so there is nothing left "
                    f"for step() to do; remove the call (or steps.remove() to step as usual). "
                    f"A closure or a GradScaler's step cannot run here either")
            return before(closure) if before is not None else type(opt).step(opt, closure)

        self._before_step = before
        opt.step = types.MethodType(step, opt)  # a method, as LR schedulers wrap it

    def remove(self) -> None:
        """Remove the hooks; the optimizer steps as usual again. (Under ``ddp=`` the
        communication hook stays, as DDP takes none back: it all-reduces as DDP's own.)"""
        self.ddp = None
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
        if self.ddp is None:
            self._held = {id(p): p.grad for p in self._params if p.grad is not None}
            for p in self._params:
                p.grad = None
        else:  # DDP's buckets add the accumulated gradients in, before their all-reduce
            self._held = {id(p): p.grad.clone() for p in self._params if p.grad is not None}
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

    def _taking(self) -> bool:
        """Whether this backward steps (not accumulating); the first call of a backward that
        steps queues the end-of-backward flush."""
        if self._accumulating:
            return False
        if self._pass is None and self.two_passes and not self._second:
            raise RuntimeError(
                "this optimizer needs every gradient before its first update (max_grad_norm "
                "with clip='exact', or nonfinite='skip'): run the step's last backward as "
                "steps.backward(closure), where closure runs the forward and returns the loss")
        if not self._queued:
            self._queued = True
            self.pieces = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        return True

    def _on_ready(self, p: Tensor) -> None:
        if self.ddp is not None or p.grad is None or not self._taking():
            return
        sharded = is_dtensor(p)
        if sharded and self._ready_bytes >= self.bucket_bytes and self._ready \
                and not _one_reduce(self._ready[-1], p):
            self._step_ready()  # a full bucket of whole FSDP2 modules
        if self._pass is not None:  # measuring: the norm of the accumulated gradient
            held = self._held.get(id(p))
            if held is not None:
                p.grad = held + p.grad
        self._ready.append(p)
        # the whole tensor's bytes (a DTensor's shape is global): the same count on every rank,
        # so that every rank steps the same pieces and their collectives match
        self._ready_bytes += p.grad.numel() * p.grad.element_size()
        if not sharded and self._ready_bytes >= self.bucket_bytes:
            self._step_ready()

    def _on_bucket(self, params: List[Tensor], future: Any) -> None:
        """DDP handed a bucket to its all-reduce (``future``): the bucket before it steps once
        its own all-reduce is complete, this one at the next bucket or at the end of
        backward (after DDP's own end-of-backward work, which waits for every bucket)."""
        if self.ddp is None or not self._taking():
            return
        self._buckets.append((future, params))
        while len(self._buckets) > 1:
            self._step_bucket(*self._buckets.pop(0))

    def _step_bucket(self, future: Any, params: List[Tensor]) -> None:
        future.wait()  # the bucket's gradients (the parameters' .grad, views of it) averaged
        self._ready = [p for p in params if p.grad is not None]
        self._stepped.extend(self._ready)
        if self._ready:
            self._step_ready()

    def _flush(self) -> None:
        self._queued = False
        while self._buckets:
            self._step_bucket(*self._buckets.pop(0))
        if self._stepped:  # after DDP's own end of backward, which points .grad at the buckets
            torch.autograd.Variable._execution_engine.queue_callback(self._release)
        if self._ready:
            self._step_ready()
        if self._pass is None and self.clipping and self.clip == "previous":
            self._previous = self._parts.total() if self._parts is not None else None
            self._parts = None

    def _release(self) -> None:
        """DDP: the stepped parameters' gradients (views of DDP's buckets) dropped, so that the
        next backward does not add to them."""
        for p in self._stepped:
            p.grad = None
        self._stepped = []

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
            _record_stream(p.grad)
            p.grad = None
        self.pieces += 1


def _check(optimizer: Any, clip: Optional[str], bucket_bytes: Any) -> bool:
    """Refuse what cannot step in backward; whether the optimizer clips by the global norm."""
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
    return clipping


def _making_state(opt: Any) -> bool:
    """Whether a ``step()`` from outside is torch.distributed.checkpoint making an empty
    optimizer's state before loading into it (``get_optimizer_state_dict``: a step of zero
    gradients with every learning rate 0, which moves nothing): let through."""
    return not opt.state and all(float(g["lr"]) == 0.0 for g in opt.param_groups)


def _data_parallel() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_ddp(ddp: Any, optimizer: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp= takes the DistributedDataParallel module, got "
                        f"{type(ddp).__name__}")
    if not ddp.gradient_as_bucket_view:
        raise ValueError(
            "steps in backward under DDP read the all-reduced gradients where DDP leaves them: "
            "wrap the model with DistributedDataParallel(..., gradient_as_bucket_view=True), "
            "so that each parameter's .grad is its view of the bucket")
    inside = {id(p) for p in ddp.parameters()}
    if any(id(p) not in inside for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("under ddp=, every parameter of the optimizer must be one of the "
                         "DDP module's (the others would step on their local gradients)")


def _follow_ddp(steps: StepsInBackward, ddp: Any) -> None:
    """Step after each of ``ddp``'s buckets is all-reduced: a communication hook that
    all-reduces as DDP's own (``allreduce_hook``: the average) and hands the bucket on."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ref = weakref.ref(steps)

    def hook(state: Any, bucket: Any) -> Any:
        future = allreduce_hook(state, bucket)
        live = ref()
        if live is not None:
            live._on_bucket(bucket.parameters(), future)
        return future

    # DDP checks the annotations as objects (this module's are strings)
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(None, hook)


def step_in_backward(optimizer: Any, *, clip: Optional[str] = None,
                     bucket_bytes: int = 4 << 20, ddp: Any = None) -> StepsInBackward:
    """Step ``optimizer`` inside the backward pass: each parameter is updated as soon as its
    gradient is complete (in buckets of ``bucket_bytes`` of gradients; 0: one tensor at a time)
    and its gradient freed, so a full set of gradients never exists at once.

    ``optimizer.step()`` is then an error (the steps already happened); ``zero_grad`` has
    nothing left to do. Accumulate micro-batches inside ``with steps.accumulating():``; the
    last one's backward steps. With ``max_grad_norm``, ``clip`` must say how: ``"exact"``
    (two passes through ``steps.backward(closure)``: the ordinary step's bits) or
    ``"previous"`` (the previous step's norm, an approximation). ``nonfinite="skip"`` takes the
    two passes too: an inf/NaN anywhere skips the whole step before anything moves, counted in
    ``skipped_steps``.

    On FSDP2 and HSDP nothing more is needed: a module's shards step after its reduce-scatter,
    a module never split between pieces. Under DDP pass the module, ``ddp=model`` (wrapped with
    ``gradient_as_bucket_view=True``): a communication hook that all-reduces as DDP's own steps
    each DDP bucket once its all-reduce is complete (``bucket_bytes`` is then DDP's
    ``bucket_cap_mb``); without ``ddp=`` on several ranks the steps would take each rank's own
    gradients, and a warning says so. See :doc:`/memory`.

    >>> import torch, scaleopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = scaleopt.LAMB(model.parameters(), lr=1e-3)
    >>> steps = scaleopt.step_in_backward(opt)
    >>> model(torch.randn(8, 4)).square().mean().backward()  # the step happens here
    >>> model.weight.grad is None
    True
    """
    return StepsInBackward(optimizer, clip=clip, bucket_bytes=bucket_bytes, ddp=ddp)


def _record_stream(grad: Optional[Tensor]) -> None:
    """A CUDA gradient freed after a step queued on the current stream: its memory is not
    handed to another stream (FSDP2's reduce-scatter output, say) before that step has read
    it."""
    if grad is not None and grad.is_cuda:
        local_piece(grad).record_stream(torch.cuda.current_stream())


def _one_reduce(a: Tensor, b: Tensor) -> bool:
    """Whether two FSDP2 shards' fresh gradients came from one reduce-scatter (one module's:
    they are views of its output). Accumulated gradients have their own memory each, so each
    then counts as its own."""
    if not (is_dtensor(a) and a.grad is not None and b.grad is not None):
        return False
    return (a.grad.to_local().untyped_storage().data_ptr()
            == b.grad.to_local().untyped_storage().data_ptr())


def _rng_state() -> Any:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: Any) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
