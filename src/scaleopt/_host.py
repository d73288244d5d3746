"""The host pipeline of the offloaded optimizers: host masters, gradients in, weights out.

A :class:`HostPipeline` is attached to one optimizer (:class:`scaleopt.OffloadAdam`, or LAMB /
LANS through :func:`scaleopt.offload`) as two things: its gradient source (the seam of
``scaleopt._base``: the gradients it reads, :meth:`HostPipeline.grad`, and the step's
surroundings, :meth:`HostPipeline.stepping`: the previous step's copies, host threads), and the
:class:`~scaleopt._masters.Placement` of its masters (where they live, and the copies back,
:meth:`HostPipeline.copy_back`).

Per parameter ``p`` (state keyed by ``p``, as in torch):

* Masters: a float32 (or float64) host parameter is its own master, updated in place with no
  copy. Any other parameter has a float32 master in host memory, pinned when ``p`` is on an
  accelerator: ``state["master_param"]``, or, for a bfloat16 parameter where the fused kernels
  run, a split master (the bfloat16 upper half is ``p`` itself on the host, a pinned staging
  copy of it otherwise; ``state["master_lo"]`` the lower half). Moments live beside the master.
* Gradients: a host ``p.grad`` is read where it is. A device gradient is copied into a host
  buffer of its dtype on a side stream, started by a post-accumulate-grad hook the moment
  backward has produced it (``overlap=True``), so the copies overlap the rest of backward.
  With gradient accumulation the hook fires after every micro-batch and the last copy wins (a
  pre-accumulate hook makes the next accumulation wait for a copy in flight); the step
  re-copies any gradient that changed after its copy (e.g. clipped on the device).
* Weights back: the kernels write bfloat16 parameters' rounded weights into a pinned staging
  buffer in the same pass as the update; each device parameter is then copied from its
  staging buffer (or float32 master) with ``non_blocking=True`` on the current stream, so the
  next forward, queued after the copies, never reads a half-copied weight. The next step waits
  for those copies before writing the host buffers again.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from . import _native
from ._checks import check_bool, check_num_threads
from ._masters import Storage, plain
from ._sharding import is_dtensor


def on_host(p: Tensor) -> bool:
    return p.device.type == "cpu"


def in_place(p: Tensor) -> bool:
    """A parameter the host step updates directly: a float32 (or float64) host tensor."""
    return on_host(p) and p.dtype in (torch.float32, torch.float64)


def host_empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    """A host tensor shaped like ``like``, pinned when ``like`` is on an accelerator."""
    pin = not on_host(like) and torch.cuda.is_available()
    return torch.empty(like.shape, dtype=dtype, pin_memory=pin)


@contextlib.contextmanager
def threads(n: Optional[int]) -> Iterator[int]:
    """Run the body with ``n`` intra-op threads (``None``: leave torch's setting)."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield before
        return
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


class HostPipeline:
    """The host side of one offloaded optimizer (see the module doc)."""

    #: the update runs in host memory (see ``scaleopt._base.InPlace``)
    on_host = True

    def __init__(self, *, overlap: bool = True, num_threads: Optional[int] = None) -> None:
        check_num_threads(num_threads)
        check_bool("overlap", overlap)
        self.overlap = overlap
        self.num_threads = num_threads
        self._grad_bufs: Dict[Tensor, Tensor] = {}
        self._staging: Dict[Tensor, Tensor] = {}
        #: per parameter, its gradient copy in flight: (gradient, its version, done event)
        self._pending: Dict[Tensor, Tuple[Tensor, int, Any]] = {}
        self._streams: Dict[torch.device, Any] = {}
        self._copies_back: List[Any] = []
        self.hooks: List[Any] = []

    def attach(self, optimizer: Any) -> None:
        """Become ``optimizer``'s gradient source and the placement of its masters, and start
        the gradient copies of its parameters."""
        optimizer._grad_source = self
        optimizer._master_weights.placement = self
        for group in optimizer.param_groups:
            self.track(group["params"])

    def options(self) -> Dict[str, Any]:
        """What a copy of the optimizer needs to build its own pipeline."""
        return {"overlap": self.overlap, "num_threads": self.num_threads}

    def __getstate__(self) -> Dict[str, Any]:  # a copy is a new pipeline with these options
        return self.options()

    def __setstate__(self, options: Dict[str, Any]) -> None:
        self.__init__(**options)

    # -- masters (the Placement of scaleopt._masters) --------------------------------------------

    def storage(self, group: Dict[str, Any], p: Tensor) -> Storage:
        if in_place(p):
            return Storage.OWN
        if (p.dtype == torch.bfloat16 and _native.available() and plain(p)
                and (not on_host(p) or p.is_contiguous())):
            return Storage.SPLIT
        return Storage.COPY

    def new_copy(self, p: Tensor) -> Tensor:
        if is_dtensor(p):  # a host shard: its master is a DTensor laid out alike
            return p.detach().to(torch.float32, copy=True)
        master = host_empty(p, torch.float32)
        master.copy_(p.detach())
        return master

    def upper(self, p: Tensor) -> Tensor:
        """``p`` on the host, else its pinned bfloat16 staging copy."""
        if on_host(p):
            return p
        buf = self._staging.get(p)
        if buf is None:
            buf = self._staging[p] = host_empty(p, torch.bfloat16)
            buf.copy_(p.detach())
        return buf

    def lower_halves(self, p: Tensor) -> Tensor:
        """In host memory, pinned for a device parameter, beside the upper halves."""
        return host_empty(p, torch.int16).zero_()

    def rounded_target(self, p: Tensor) -> Optional[Tensor]:
        """``p`` itself on the host, a pinned staging buffer for a device parameter; None for
        dtypes other than bfloat16."""
        if p.dtype != torch.bfloat16:
            return None
        if on_host(p):
            return p if p.is_contiguous() else None
        buf = self._staging.get(p)
        if buf is None:
            buf = self._staging[p] = host_empty(p, torch.bfloat16)
        return buf

    def load_float32(self, p: Tensor, value: Tensor) -> Tensor:
        if is_dtensor(value):
            return value.detach().to(torch.float32, copy=True)
        t = host_empty(p, torch.float32)
        t.copy_(value.detach().reshape(p.shape))
        return t

    def keeps_float32(self, p: Tensor, saved: Dict[str, Any]) -> bool:
        return not in_place(p)

    def copy_back(self, pairs: List[tuple]) -> None:
        devices = set()
        for p, src in pairs:
            if on_host(p):
                p.detach().copy_(src)
            else:
                p.detach().copy_(src, non_blocking=True)
                devices.add(p.device)
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._copies_back.append(event)

    # -- gradients to the host -------------------------------------------------------------------

    def track(self, params: List[Tensor]) -> None:
        """Start the gradient copies of ``params`` from backward hooks (CUDA parameters)."""
        if not self.overlap:
            return
        ref = weakref.ref(self)
        for p in params:
            if on_host(p) or not p.requires_grad or p.device.type != "cuda":
                continue

            def before_accumulate(grad: Tensor, p=p) -> Tensor:
                pipeline = ref()
                if pipeline is not None:  # the accumulation must not overwrite a copy in flight
                    pending = pipeline._pending.get(p)
                    if pending is not None:
                        torch.cuda.current_stream(p.device).wait_event(pending[2])
                return grad

            def after_accumulate(param: Tensor, p=p) -> None:
                pipeline = ref()
                if pipeline is not None:
                    pipeline._start_copy(p)

            self.hooks.append(p.register_hook(before_accumulate))
            self.hooks.append(p.register_post_accumulate_grad_hook(after_accumulate))

    def _start_copy(self, p: Tensor) -> None:
        """Start copying ``p.grad`` (on an accelerator) into its host buffer, on a side stream."""
        g = p.grad
        buf = self._grad_bufs.get(p)
        if buf is None or buf.dtype != g.dtype:
            buf = self._grad_bufs[p] = host_empty(p, g.dtype)
        stream = self._streams.get(p.device)
        if stream is None:
            stream = self._streams[p.device] = torch.cuda.Stream(p.device)
        stream.wait_stream(torch.cuda.current_stream(p.device))
        with torch.cuda.stream(stream):
            buf.copy_(g, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        g.record_stream(stream)
        self._pending[p] = (g, g._version, event)

    def grad(self, p: Tensor) -> Tensor:
        """``p``'s gradient in host memory, complete (waits for its copy)."""
        g = p.grad
        if on_host(p):
            return g
        pending = self._pending.get(p)
        if pending is None or not copy_is_current(pending, g):
            self._start_copy(p)
            pending = self._pending[p]
        pending[2].synchronize()
        return self._grad_bufs[p]

    # -- the step --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def stepping(self) -> Iterator[int]:
        """Around a step: wait for the previous step's copies to the device (they read the host
        buffers), run with ``num_threads`` (yields the thread count), and forget the gradient
        copies the step consumed."""
        for event in self._copies_back:
            event.synchronize()
        self._copies_back = []
        try:
            with threads(self.num_threads) as n:
                yield n
        finally:
            self._pending.clear()

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (they are also inert once the pipeline is deleted)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


def attach_host(optimizer: Any, *, overlap: bool = True,
                num_threads: Optional[int] = None) -> HostPipeline:
    """Put ``optimizer`` (a scaleopt optimizer with master weights) on a new host pipeline: its
    gradients are read from host copies, its masters live in host memory, and its parameters
    are written from there."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"{type(optimizer).__name__} on the host pipeline takes parameters in host "
                    f"or CUDA memory, got one on {p.device.type!r}")
        if any(is_dtensor(p) and not on_host(p) for p in group["params"]):
            raise NotImplementedError(
                "offloading sharded (DTensor) parameters that live on an accelerator is not "
                "supported: with FSDP2, CPUOffloadPolicy keeps the shards, their gradients and "
                "the optimizer step on the host, where OffloadAdam and offload() run on them")
    pipeline = HostPipeline(overlap=overlap, num_threads=num_threads)
    pipeline.attach(optimizer)
    return pipeline


def copy_is_current(pending: Tuple[Any, ...], grad: Tensor) -> bool:
    """Whether a gradient copy started from a backward hook (``pending``: the gradient tensor
    and its version counter then) still holds ``grad``. A change is seen when ``p.grad`` is
    another tensor or was changed in place by an operation that bumps its version counter:
    ``p.grad.mul_()``, ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``,
    ``GradScaler.unscale_``, ``torch._foreach_mul_``, also under ``torch.no_grad()``. A change
    made through ``p.grad.data`` is not: ``.data`` is a tensor with its own version counter.
    Loops that change gradients that way use ``overlap=False`` (copies at ``step()``)."""
    return pending[0] is grad and pending[1] == grad._version
