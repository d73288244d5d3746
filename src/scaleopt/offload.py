"""Optimizers whose state and update live in host memory while the model lives on a device.

:class:`HostOffload` is the pipeline: float32 master weights and optimizer state in host memory
(pinned when the parameter is on an accelerator), gradients copied to the host as soon as
backward produces them, the update run on the host, the weights copied back without blocking.
:class:`OffloadAdam` is Adam/AdamW on it; :func:`offload` puts LAMB or LANS on it.

When a parameter already lives in host memory as a float32 tensor (a CPU model), it is its own
master: the step updates it in place and nothing is copied.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import torch
from torch import Tensor

from . import _blocks, _native
from ._base import (
    NameRule,
    ScaleOptimizer,
    check_bool,
    check_choice,
    check_name_rule,
    check_number,
)
from ._layerwise import LayerwiseAdam, joined_masters

__all__ = ["OffloadAdam", "HostOffload", "offload"]


def _on_host(p: Tensor) -> bool:
    return p.device.type == "cpu"


def _in_place(p: Tensor) -> bool:
    """A parameter the host step updates directly: a float32 (or float64) host tensor."""
    return _on_host(p) and p.dtype in (torch.float32, torch.float64)


@contextlib.contextmanager
def _threads(n: Optional[int]) -> Iterator[int]:
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


class HostOffload:
    """Mixin: the host side of an offloaded optimizer.

    Per parameter ``p`` (state keyed by ``p``, as in torch):

    * ``state["master_param"]``: the float32 host copy the update runs on, for every ``p`` that
      is not a float32 host tensor itself (device parameters, bfloat16/float16 host parameters);
      pinned when ``p`` is on an accelerator. Moments live beside it, in float32 host memory.
      Where the fused kernels run, :class:`OffloadAdam` holds the float32 master of a bfloat16
      parameter split in two halves instead: the parameter itself (the master rounded to
      nearest) and ``state["master_lo"]``, the low 16 bits (see :meth:`master`). That is the
      same float32 value in less memory and less traffic; checkpoints hold it as
      ``master_param``.
    * Gradients: a host ``p.grad`` is read where it is. A device gradient is copied into a host
      buffer of its dtype on a side stream, started by a post-accumulate-grad hook the moment
      backward has produced it (``overlap=True``), so the copies overlap the rest of backward.
      With gradient accumulation the hook fires after every micro-batch and the last copy wins;
      ``step()`` re-copies any gradient that changed after its copy (e.g. clipped on the device).
    * Weights back: the kernels write bfloat16 parameters' rounded weights into a pinned staging
      buffer in the same pass as the update; each device parameter is then copied from its
      staging buffer (or float32 master) with ``non_blocking=True`` on the current stream, so
      the next forward, queued after the copies, never reads a half-copied weight. The next
      step waits for those copies before writing the host buffers again.
    """

    #: Whether bfloat16 parameters keep their master as (parameter, low halves) when the
    #: kernels are available (see :meth:`master`).
    _split_masters = False

    def _offload_init(self, overlap: bool, num_threads: Optional[int]) -> None:
        if num_threads is not None:
            if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
                raise ValueError(f"Invalid num_threads: {num_threads!r} (a positive int or None)")
        check_bool("overlap", overlap)
        self.num_threads = num_threads
        self.overlap = overlap
        self._plans: Dict[Tensor, Any] = {}
        self._grad_bufs: Dict[Tensor, Tensor] = {}
        self._staging: Dict[Tensor, Tensor] = {}
        self._pending: Dict[Tensor, Tuple[Tensor, int, Any]] = {}
        self._streams: Dict[torch.device, Any] = {}
        self._h2d_done: List[Any] = []
        self._hooks: List[Any] = []
        for group in self.param_groups:
            self._register_hooks(group["params"])

    # -- buffers ---------------------------------------------------------------------------------

    @staticmethod
    def _host_empty(like: Tensor, dtype: torch.dtype) -> Tensor:
        pin = not _on_host(like) and torch.cuda.is_available()
        return torch.empty(like.shape, dtype=dtype, pin_memory=pin)

    def _master(self, p: Tensor) -> Tensor:
        """The float32 host tensor the update runs on (``p`` itself for a float32 host tensor)."""
        if _in_place(p):
            return p
        state = self.state[p]
        master = state.get("master_param")
        if master is None:
            master = self._host_empty(p, torch.float32)
            master.copy_(p.detach())
            state["master_param"] = master
        return master

    def _wants_split(self, p: Tensor) -> bool:
        return (self._split_masters and p.dtype == torch.bfloat16 and _native.available()
                and (not _on_host(p) or p.is_contiguous()))

    def _hi(self, p: Tensor) -> Tensor:
        """The bfloat16 upper half of a split master: ``p`` on the host, else a host copy."""
        if _on_host(p):
            return p
        buf = self._staging.get(p)
        if buf is None:
            buf = self._staging[p] = self._host_empty(p, torch.bfloat16)
            buf.copy_(p.detach())
        return buf

    def _split_pair(self, p: Tensor) -> Tuple[Tensor, Tensor]:
        """``(hi, lo)``: the two halves of ``p``'s float32 master (created equal to ``p``)."""
        state = self.state[p]
        lo = state.get("master_lo")
        if lo is None:
            lo = state["master_lo"] = torch.zeros(p.shape, dtype=torch.int16)
        return self._hi(p), lo

    def master(self, p: Tensor) -> Tensor:
        """The float32 master weights of ``p`` (a new tensor for a split master; ``p`` itself
        for a float32 host parameter)."""
        state = self.state.get(p, {})
        if "master_lo" in state:
            return _native.split_join(self._hi(p).detach(), state["master_lo"])
        if _in_place(p):
            return p
        return self._master(p)

    def _low_target(self, p: Tensor) -> Optional[Tensor]:
        """Where the kernels write the rounded bfloat16 weights: ``p`` itself on the host, a
        pinned staging buffer for a device parameter; None for other dtypes."""
        if p.dtype != torch.bfloat16:
            return None
        if _on_host(p):
            return p if p.is_contiguous() else None
        buf = self._staging.get(p)
        if buf is None:
            buf = self._staging[p] = self._host_empty(p, torch.bfloat16)
        return buf

    # -- gradients to the host --------------------------------------------------------------------

    def _register_hooks(self, params: List[Tensor]) -> None:
        if not self.overlap:
            return
        ref = weakref.ref(self)
        for p in params:
            if _on_host(p) or not p.requires_grad or p.device.type != "cuda":
                continue

            def before_accumulate(grad: Tensor, p=p) -> Tensor:
                opt = ref()
                if opt is not None:  # the accumulation must not overwrite a copy in flight
                    pending = opt._pending.get(p)
                    if pending is not None:
                        torch.cuda.current_stream(p.device).wait_event(pending[2])
                return grad

            def after_accumulate(param: Tensor, p=p) -> None:
                opt = ref()
                if opt is not None:
                    opt._start_copy(p)

            self._hooks.append(p.register_hook(before_accumulate))
            self._hooks.append(p.register_post_accumulate_grad_hook(after_accumulate))

    def _start_copy(self, p: Tensor) -> None:
        """Start copying ``p.grad`` (on an accelerator) into its host buffer, on a side stream."""
        g = p.grad
        buf = self._grad_bufs.get(p)
        if buf is None or buf.dtype != g.dtype:
            buf = self._grad_bufs[p] = self._host_empty(p, g.dtype)
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

    def _host_grad(self, p: Tensor) -> Tensor:
        """``p``'s gradient in host memory, complete (waits for its copy)."""
        g = p.grad
        if _on_host(p):
            return g
        pending = self._pending.get(p)
        if pending is None or pending[0] is not g or pending[1] != g._version:
            self._start_copy(p)
            pending = self._pending[p]
        pending[2].synchronize()
        return self._grad_bufs[p]

    def _grads_to_host(self, params: List[Tensor]) -> List[Tensor]:
        if not self._pending and all(p.device.type == "cpu" for p in params):
            return [p.grad for p in params]
        grads = [self._host_grad(p) for p in params]
        for p in params:
            self._pending.pop(p, None)
        return grads

    # -- weights back -----------------------------------------------------------------------------

    def _wait_for_copies_back(self) -> None:
        """The host buffers are read by the previous step's copies to the device: wait for them."""
        for event in self._h2d_done:
            event.synchronize()
        self._h2d_done = []

    def _write_back(self, params: List[Tensor], work: List[Tensor],
                    low: List[Optional[Tensor]], written: List[bool]) -> None:
        """Bring each parameter up to date with its master: ``written[i]`` tells that the kernel
        already wrote ``low[i]`` in its pass."""
        devices = set()
        for p, w, lp, done in zip(params, work, low, written):
            if p is w:
                continue
            if _on_host(p):
                if not (done and lp is p):
                    p.detach().copy_(w)
                continue
            src = lp if (done and lp is not None) else w
            p.detach().copy_(src, non_blocking=True)
            devices.add(p.device)
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._h2d_done.append(event)

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return joined_masters(self, super().state_dict())  # type: ignore[misc]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint (also one of :class:`torch.optim.AdamW` for :class:`OffloadAdam`).

        torch's loader would move the state to each parameter's device and dtype; here master
        weights and moments go back to float32 host memory, from the saved values (not rounded).
        A checkpoint without ``master_param`` starts the master from the parameter."""
        keep: Dict[int, Dict[str, Tensor]] = {}
        for sg, g in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(sg["params"], g["params"]):
                st = state_dict["state"].get(pid, {})
                if _in_place(p):
                    continue
                host = {}
                for k, v in st.items():
                    if k != "step" and torch.is_tensor(v) and v.is_floating_point():
                        t = self._host_empty(p, torch.float32)
                        t.copy_(v.detach().reshape(p.shape))
                        host[k] = t
                keep[id(p)] = host
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._plans.clear()
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state.get(p)
                if st and id(p) in keep:
                    st.update(keep[id(p)])
                    st.pop("master_lo", None)
                    if self._wants_split(p):
                        master = st.pop("master_param", None)
                        hi, lo = self._split_pair(p)
                        if master is not None:
                            _native.split_(master, hi.detach(), lo)
                            if not _on_host(p):
                                p.detach().copy_(hi)
                    elif "master_param" not in st:
                        self._master(p)
                elif st and _in_place(p):
                    st.pop("master_param", None)  # a float32 host parameter is its own master

    def remove_hooks(self) -> None:
        """Remove the gradient hooks (they are also inert once the optimizer is deleted)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class OffloadAdam(HostOffload, ScaleOptimizer):
    r"""Adam / AdamW with float32 master weights and state in host memory.

    The parameters stay on their device in any float dtype; the update runs on the host (see
    :class:`HostOffload` for the pipeline). The numbers are those of :class:`torch.optim.AdamW`
    (``decoupled=True``) or :class:`torch.optim.Adam` (``decoupled=False``):

    .. math::
        \begin{aligned}
        g &\leftarrow \pm\, c \cdot \nabla / s \quad (+\lambda w \text{ if not decoupled})\\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g,\qquad v_t = \beta_2 v_{t-1} + (1-\beta_2) g^2\\
        w &\leftarrow w\,(1-\eta\lambda)_{\text{decoupled}}
            - \frac{\eta}{1-\beta_1^t}\,\frac{m_t}{\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon}
        \end{aligned}

    where :math:`s` is the loss scale (``loss_scale`` times a :class:`torch.amp.GradScaler`'s
    scale) and :math:`c` the global-norm clipping factor, folded into one scalar that the host
    kernel applies while it reads the gradient: ``p.grad`` is never written. An inf/NaN gradient
    (reported by a GradScaler, or found by the clipping norm or by ``check_finite``) skips the
    step with no change of state, as torch's fused Adam does under a GradScaler.

    The state holds ``step``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad),
    as :class:`torch.optim.AdamW`, plus ``master_param`` for parameters that are not float32 host
    tensors: a ``state_dict`` loads into and from :class:`torch.optim.AdamW`.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float, default 1e-3), betas (default (0.9, 0.999)), eps (default 1e-8).
        weight_decay (float, default 0): :math:`\lambda`.
        decoupled (bool, default True): AdamW's decoupled decay; False adds :math:`\lambda w` to
            the gradient (Adam's L2).
        amsgrad (bool, default False), maximize (bool, default False): as in torch.
        nesterov (bool, default False): step along :math:`\beta_1 m_t + (1-\beta_1) g`
            instead of :math:`m_t` (MindSpore's ``use_nesterov``).
        eps_mode (``"standard"`` or ``"hat"``, default ``"standard"``): ``"hat"`` is the Adam
            paper's :math:`\hat\epsilon` form, :math:`w \leftarrow w - \eta
            \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\frac{m_t}{\sqrt{v_t}+\epsilon}` (MindSpore,
            TensorFlow's Adam).
        exclude_from_weight_decay (name rule, default None): names that get no decay.
        max_grad_norm (float or None, default None): clip by the global norm of all gradients.
        loss_scale (float, default 1): the gradients are divided by it.
        check_finite (bool, default False): look for inf/NaN gradients (one extra read of the
            gradients) even without a GradScaler or clipping, and skip such steps.
        num_threads (int or None, default None): intra-op threads of the host step (``None``:
            torch's setting).
        overlap (bool, default True): start the gradient copies from backward hooks.

    After a step, ``opt.skipped`` tells whether it was skipped for a non-finite gradient.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OffloadAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step(); opt.zero_grad()

    References: Kingma & Ba, "Adam", ICLR 2015; Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019; Ren et al., "ZeRO-Offload", USENIX ATC 2021.
    """

    _name_rule_keys = ("exclude_from_weight_decay",)
    _step_supports_amp_scaling = True
    _split_masters = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = True,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        nesterov: bool = False,
        eps_mode: str = "standard",
        exclude_from_weight_decay: NameRule = None,
        max_grad_norm: Optional[float] = None,
        loss_scale: float = 1.0,
        check_finite: bool = False,
        num_threads: Optional[int] = None,
        overlap: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled=decoupled,
            amsgrad=amsgrad,
            maximize=maximize,
            nesterov=nesterov,
            eps_mode=eps_mode,
            exclude_from_weight_decay=exclude_from_weight_decay,
            max_grad_norm=max_grad_norm,
            loss_scale=loss_scale,
        )
        check_bool("check_finite", check_finite)
        self.check_finite = check_finite
        self.skipped = False
        super().__init__(params, defaults)
        self._offload_init(overlap, num_threads)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_hooks"):
            self._register_hooks(self.param_groups[-1]["params"])

    def _validate_group(self, group: Dict[str, Any]) -> None:
        a = self._arg
        check_number(a("lr"), group["lr"])
        self._validate_adam_group(group)
        check_bool(a("decoupled"), group["decoupled"])
        check_bool(a("amsgrad"), group["amsgrad"])
        check_bool(a("maximize"), group["maximize"])
        check_bool(a("nesterov"), group["nesterov"])
        check_choice("eps_mode", group["eps_mode"], ("standard", "hat"))
        if group["amsgrad"] and group["nesterov"]:
            raise ValueError("amsgrad=True and nesterov=True cannot be combined")
        check_number(a("max_grad_norm"), group["max_grad_norm"], low=0.0, low_open=True,
                     allow_none=True)
        check_number(a("loss_scale"), group["loss_scale"], low=0.0, low_open=True)
        for p in group["params"]:
            if not p.is_floating_point():
                raise TypeError(f"{type(self).__name__} optimizes floating-point tensors, got {p.dtype}")
        for key in self._name_rule_keys:
            check_name_rule(a(key), group.get(key))

    # -- the step --------------------------------------------------------------------------------

    def _gather(self) -> List[Tuple[Dict[str, Any], List[int], List[Tensor], List[Tensor]]]:
        self._refresh_hyperparameters()
        out = []
        for group in self.param_groups:
            idx = [i for i, p in enumerate(group["params"]) if p.grad is not None]
            params = [group["params"][i] for i in idx]
            for i, p in zip(idx, params):
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients "
                        f"(parameter {self._param_label(group, i)})"
                    )
            if params:
                out.append((group, idx, params, self._grads_to_host(params)))
        return out

    def _multipliers(self, staged, threads: int) -> Optional[List[float]]:
        """Per group, the one scalar each gradient is multiplied by (sign, unscaling, clipping);
        None when the step must be skipped for a non-finite gradient."""
        amp_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return None
        inv_amp = 1.0 if amp_scale is None else 1.0 / float(amp_scale)
        unscale = [inv_amp / g["loss_scale"] for g, *_ in staged]
        clip = [g["max_grad_norm"] for g, *_ in staged]
        coef = [1.0] * len(staged)
        if any(c is not None for c in clip):
            total = 0.0
            for u, (_, _, _, grads) in zip(unscale, staged):
                total += float(_blocks.global_norm(grads)) ** 2 * u * u
            total = math.sqrt(total)
            if not math.isfinite(total):
                return None
            coef = [1.0 if c is None else c / max(total, c) for c in clip]
        elif self.check_finite:
            if any(_native.any_nonfinite(g, threads) for *_, grads in staged for g in grads):
                return None
        return [
            u * c * (-1.0 if g["maximize"] else 1.0) for u, c, (g, *_) in zip(unscale, coef, staged)
        ]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        staged = self._gather()
        self._wait_for_copies_back()
        with _threads(self.num_threads) as threads:
            muls = self._multipliers(staged, threads)
            self.skipped = muls is None
            if muls is not None:
                for (group, idx, params, grads), mul in zip(staged, muls):
                    self._update_group(group, idx, params, grads, mul, threads)
        self._after_step()
        return loss

    def _after_step(self) -> None:
        """Called at the end of every step, skipped or not. Front-ends override it."""

    def _plan(self, p: Tensor, amsgrad: bool):
        """Per parameter, what the update reads: ``(state, exp_avg, exp_avg_sq, work, low,
        split, kernel_takes_it)`` where ``work`` is the float32 master (or the bfloat16 upper
        half of a split master) and ``low`` the bfloat16 copy to write (or the split master's
        low half). Cached while the state holds the same tensors."""
        st = self.state[p]
        plan = self._plans.get(p)
        if (plan is not None and plan[0] is st and plan[1] is st.get("exp_avg")
                and plan[2] is st.get("exp_avg_sq") and plan[7] == (p.dtype, p.device)
                and not (amsgrad and "max_exp_avg_sq" not in st)):
            return plan
        split = self._wants_split(p)
        if split:  # the kernel's split storage: (bfloat16 upper half, int16 lower half)
            work, low = self._split_pair(p)
        else:
            work, low = self._master(p), self._low_target(p)
        st = self._state(p, amsgrad)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        takes = _native.adam_applies(work, torch.empty(0), m, v, low)
        plan = self._plans[p] = (st, m, v, work, low, split, takes, (p.dtype, p.device))
        return plan

    def _state(self, p: Tensor, amsgrad: bool) -> Dict[str, Any]:
        """``p``'s step and moments: host tensors, float32 (float64 for a float64 parameter)."""
        state = self.state[p]
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        elif state["step"].dtype != torch.float32 or state["step"].device.type != "cpu":
            state["step"] = state["step"].to("cpu", torch.float32)  # e.g. from a fused CUDA Adam
        if "exp_avg" not in state:
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros(p.shape, dtype=dtype)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype)
        return state

    def _step_scalars(self, group: Dict[str, Any], step: float) -> Tuple[float, float]:
        """``(step_size, d)`` of the update ``w -= step_size * m / (sqrt(v)/d + eps)`` at step
        ``step``: ``(lr/(1-b1^t), sqrt(1-b2^t))``, or ``(lr*sqrt(1-b2^t)/(1-b1^t), 1)`` in the
        epsilon-hat form."""
        beta1, beta2 = group["betas"]
        bc1 = 1 - beta1 ** step
        bc2_sqrt = math.sqrt(1 - beta2 ** step)
        if group["eps_mode"] == "hat":
            return group["lr"] * bc2_sqrt / bc1, 1.0
        return group["lr"] / bc1, bc2_sqrt

    def _one_minus_betas(self, group: Dict[str, Any]) -> Tuple[float, float]:
        """``(1-beta1, 1-beta2)`` as the update uses them (in double, as torch)."""
        beta1, beta2 = group["betas"]
        return 1.0 - beta1, 1.0 - beta2

    @torch.compiler.disable
    def _update_group(self, group, idx, params, grads, mul, threads) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, amsgrad, decoupled = group["lr"], group["eps"], group["amsgrad"], group["decoupled"]
        nesterov = group["nesterov"]
        omb = self._one_minus_betas(group)
        no_decay = self._rule_flags(group, "exclude_from_weight_decay")
        plans = [self._plan(p, amsgrad) for p in params]
        work = [pl[3] for pl in plans]
        low: List[Optional[Tensor]] = [pl[4] for pl in plans]
        split = [pl[5] for pl in plans]
        states = [pl[0] for pl in plans]
        scalars: Dict[float, Tuple[float, float]] = {}
        fast: List[Tuple[int, float, float, float]] = []
        for k, (i, g, pl) in enumerate(zip(idx, grads, plans)):
            st, m, v, w = pl[0], pl[1], pl[2], pl[3]
            wd = 0.0 if no_decay[i] else group["weight_decay"]
            step = st["step"].item() + 1.0  # the kernel increments the counter, else below
            if step not in scalars:
                scalars[step] = self._step_scalars(group, step)
            step_size, bc2_sqrt = scalars[step]
            if pl[6] and not amsgrad and _native.grad_applies(g):
                fast.append((k, step_size, bc2_sqrt, wd))
                continue
            st["step"] += 1
            master = _native.split_join(w.detach(), low[k]) if split[k] else w
            if not split[k]:
                low[k] = None
            gf = g.to(torch.float32) if g.dtype != master.dtype else g
            gf = gf * mul if mul != 1.0 else gf
            _adam_reference(master, gf, m, v, st.get("max_exp_avg_sq"), lr=lr, beta1=beta1,
                            beta2=beta2, one_minus_betas=omb, step_size=step_size,
                            bc2_sqrt=bc2_sqrt, eps=eps, weight_decay=wd, decoupled=decoupled,
                            nesterov=nesterov)
            if split[k]:
                _native.split_(master, w.detach(), low[k])
        if fast:
            ks = [f[0] for f in fast]
            _native.adam(
                [work[k] for k in ks], [grads[k] for k in ks],
                [states[k]["exp_avg"] for k in ks], [states[k]["exp_avg_sq"] for k in ks],
                [low[k] for k in ks], [states[k]["step"] for k in ks],
                step_sizes=[f[1] for f in fast],
                bias_correction2_sqrts=[f[2] for f in fast],
                weight_decays_l2=[0.0 if decoupled else f[3] for f in fast],
                decays=[1.0 - lr * f[3] if decoupled else 1.0 for f in fast],
                beta1=beta1, beta2=beta2, eps=eps, grad_multipliers=[mul] * len(fast), nesterov=nesterov,
                one_minus_betas=omb, threads=threads,
            )
        # a split master's upper half is the parameter (host) or its staging copy (device)
        self._write_back(params, work, low,
                         [low[k] is not None and not split[k] for k in range(len(params))])


def _adam_reference(w: Tensor, g: Tensor, m: Tensor, v: Tensor, vmax: Optional[Tensor], *,
                    lr: float, beta1: float, beta2: float, one_minus_betas: Tuple[float, float],
                    step_size: float, bc2_sqrt: float, eps: float, weight_decay: float,
                    decoupled: bool, nesterov: bool) -> None:
    """Adam on one tensor with torch ops (any layout, dtype or device), for what the kernel does
    not take: torch's single-tensor Adam/AdamW (``vmax`` given: amsgrad), with the Nesterov
    numerator ``b1*m + (1-b1)*g`` when asked."""
    if weight_decay != 0:
        if decoupled:
            w.mul_(1 - lr * weight_decay)
        else:
            g = g.add(w, alpha=weight_decay)
    m.lerp_(g, one_minus_betas[0])
    v.mul_(beta2).addcmul_(g, g, value=one_minus_betas[1])
    if vmax is not None:
        torch.maximum(vmax, v, out=vmax)
        denom = (vmax.sqrt() / bc2_sqrt).add_(eps)
    else:
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
    num = m.mul(beta1).add_(g, alpha=one_minus_betas[0]) if nesterov else m
    w.addcdiv_(num, denom, value=-step_size)


def offload(optimizer_class: Type[LayerwiseAdam], params: Any, *, overlap: bool = True,
            num_threads: Optional[int] = None, **options: Any) -> LayerwiseAdam:
    """``optimizer_class`` (:class:`~scaleopt.LAMB` or :class:`~scaleopt.LANS`) on the host
    pipeline of :class:`HostOffload`: float32 masters (split for bfloat16 parameters) and moments
    in host memory, gradients to the host, the fused host kernels, weights back to the device.

    >>> import scaleopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = offload(scaleopt.LAMB, model.named_parameters(), lr=1e-3)
    >>> model(torch.randn(8, 4)).square().mean().backward()
    >>> opt.step()
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, LayerwiseAdam)):
        raise TypeError(
            f"offload() takes a layer-wise optimizer class (scaleopt.LAMB, scaleopt.LANS); "
            f"for Adam use scaleopt.OffloadAdam. Got {optimizer_class!r}"
        )
    cls = _OFFLOADED.get(optimizer_class)
    if cls is None:
        cls = type(f"Offload{optimizer_class.__name__}", (_OffloadLayerwise, optimizer_class),
                   {"__module__": __name__, "__doc__": optimizer_class.__doc__})
        _OFFLOADED[optimizer_class] = cls
    if "master_weights" in options and not options["master_weights"]:
        raise ValueError("offloaded optimizers always keep float32 master weights (master_weights)")
    opt = cls(params, **dict(options, master_weights=True))  # as its groups should say
    opt._offload_init(overlap, num_threads)
    return opt


class _OffloadLayerwise(HostOffload):
    """A :class:`LayerwiseAdam` whose step runs on :class:`HostOffload`."""

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        if hasattr(self, "_hooks"):
            self._register_hooks(self.param_groups[-1]["params"])

    def _grad_of(self, p: Tensor) -> Tensor:
        return self._host_grad(p)

    def _kernels_may_run(self, group: Dict[str, Any], params: List[Tensor]) -> bool:
        return group.get("foreach") is None and _native.available()  # the step is on the host

    _split_masters = True  # bfloat16 parameters: split masters on the host (HostOffload)

    @staticmethod
    def _splits(group: Dict[str, Any], p: Tensor) -> bool:
        return False  # HostOffload decides (_wants_split) and converts checkpoints

    def _masters(self, group: Dict[str, Any], params: List[Tensor]) -> List[Tensor]:
        return [self._split_pair(p)[0] if self._wants_split(p) else self._master(p)
                for p in params]

    @contextlib.contextmanager
    def _step_context(self):
        self._wait_for_copies_back()
        with _threads(self.num_threads):
            yield
        for group in self.param_groups:
            for p in group["params"]:
                self._pending.pop(p, None)


_OFFLOADED: Dict[type, type] = {}
