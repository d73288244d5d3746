"""AdamW with name-based decay exclusion, on torch's fused kernel where it can run."""

from __future__ import annotations

import operator
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

from . import _compact, _ops, _native, _triton
from ._dispatch import check_implementation
from ._adam import _entries
from ._group import _DTYPE, _PLAIN, GroupTensors
from ._sharding import any_dtensor, local_piece
from ._base import ScaleOptimizer
from ._checks import check_bool
from ._loading import ADAM_STATE
from ._masters import WithMasterWeights, split_join
from ._params import NameRule

__all__ = ["AdamW"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_devices() -> List[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except Exception:  # pragma: no cover - very old torch
        return ["cuda"]


def fused_supported(params: List[Tensor]) -> bool:
    """Whether torch's fused Adam kernel runs on all of ``params`` (dense, contiguous: the
    fused kernel addresses a parameter's memory as one block)."""
    devices = _fused_devices()
    return all(
        p.dtype in _FUSED_DTYPES and p.device.type in devices and p.layout == torch.strided
        and p.is_contiguous()
        for p in params
    )


def takes_fused(group: Dict[str, Any], params: List[Tensor]) -> bool:
    """Whether a group's step runs torch's fused kernel: as its ``fused`` option says, or by
    default where ``foreach`` asks for no path (True: torch's multi-tensor ops, False: its
    per-tensor loop) and the kernel takes every parameter."""
    if group.get("implementation") is not None:  # a path named: torch's fused kernel is not
        return False
    fused = group["fused"]
    if fused is None:
        fused = group["foreach"] is None and fused_supported(params)
    return fused


def check_fused(group: Dict[str, Any]) -> None:
    """``fused=True``: torch's fused Adam kernel takes every parameter of the group."""
    if group["fused"] and not fused_supported(group["params"]):
        raise ValueError(
            "fused=True needs floating-point parameters on a device with torch's fused Adam "
            f"kernel ({', '.join(_fused_devices())})"
        )


def _beside(steps: List[Tensor], params: List[Tensor]) -> List[Tensor]:
    """The step counters beside their parameters, as torch's multi-tensor Adam takes them under
    ``torch.compile`` (host counters of accelerator parameters, as tensor scalars, are constants
    the graph cannot take): copies where a counter is elsewhere, to be written back after the
    update; the counters themselves where all are."""
    if all(s.device == p.device for s, p in zip(steps, params)):
        return steps
    return [s.to(p.device) for s, p in zip(steps, params)]


class AdamW(WithMasterWeights, ScaleOptimizer):
    r"""AdamW (Loshchilov & Hutter, 2019) with decay exclusion by parameter name.

    .. math::
        \begin{aligned}
        w &\leftarrow w - \eta \lambda w \quad\text{(not for excluded names)}\\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t,\qquad v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2\\
        w_t &= w - \eta\,\frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon}
        \end{aligned}

    The numbers, the state (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) and the
    checkpoints are those of :class:`torch.optim.AdamW`: a ``state_dict`` moves between the two.
    The update runs on torch's fused kernel whenever every parameter supports it (CPU and CUDA,
    float16/bfloat16/float32/float64), else on torch's foreach or single-tensor path.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float, default 1e-3): learning rate :math:`\eta`.
        betas (tuple[float, float], default (0.9, 0.999)): :math:`(\beta_1, \beta_2)`.
        eps (float, default 1e-8): :math:`\epsilon`.
        weight_decay (float, default 0.01): :math:`\lambda` (decoupled).
        amsgrad (bool, default False): keep the running maximum of :math:`v`.
        exclude_from_weight_decay (regex, list of regexes, callable(name) or None): names that
            get no decay.
        max_grad_norm (float or None, default None): global gradient-norm clipping.
        clip_grad_value, clip_grad_norm_per_tensor, rescale_grad: as in :class:`LAMB`.
        maximize (bool, default False): maximize the objective.
        foreach (bool or None, default None), fused (bool or None, default None): the path, as
            in :class:`torch.optim.AdamW`: ``fused=True`` torch's fused kernel (and the C
            kernels for ``bfloat16``/``int8`` state on the CPU), ``foreach=True`` torch's
            multi-tensor ops, ``foreach=False`` its per-tensor loop; both ``None`` pick the
            fused kernel where it takes every parameter.
        nonfinite (``"propagate"`` or ``"skip"``, default ``"propagate"``): what a step does
            with an inf/NaN gradient (see :doc:`/robustness`): let it flow into the update, as
            torch's optimizers do, or skip the whole step, counted in ``skipped_steps``.
        state_dtype (``"float32"``, ``"bfloat16"`` or ``"int8"``, default ``"float32"``): how
            the moments are stored between steps, as in :class:`LAMB` (see :doc:`/state`).
        implementation (None, ``"single"``, ``"multi"``, ``"native"`` or ``"triton"``, default
            None): the path by name, instead of ``foreach``/``fused``: torch's per-tensor loop
            or multi-tensor ops, the C kernel (CPU) or the Triton kernel (CUDA; CPU tensors
            under ``TRITON_INTERPRET=1``), each kernel one pass over every tensor of a group in
            every ``state_dtype``, the two with the same bits. None: torch's fused kernel where
            it takes every parameter (the C kernel for compact moments on the CPU). The
            kernels take float32 parameters (bfloat16 ones with ``master_weights``) without
            ``amsgrad`` (see :doc:`/gpu`).
        capturable (bool, default False): keep the step counters on the parameters' device and
            read them, and the learning rate when it is a tensor on that device, there: the
            step reads nothing on the host and can be captured in a CUDA graph (change ``lr``
            between replays in place, ``group["lr"].fill_(...)``). The Triton kernel only
            (``implementation`` None or ``"triton"``).
        master_weights (bool, default False): float32 master weights (and float32 moments) for
            float16/bfloat16 parameters, as in :class:`LAMB`: a bfloat16 parameter's master
            is split (the parameter holds its upper 16 bits rounded to nearest,
            ``state["master_lo"]`` the lower 16) where scaleopt's kernels run its group, a
            float32 copy (``state["master_param"]``) elsewhere; a ``state_dict`` holds each
            as a float32 ``master_param``. The kernels update a split master in place, torch's
            paths its float32 value (see :doc:`/adamw`).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamW(model.named_parameters(), lr=1e-3, exclude_from_weight_decay=r"bias$")
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()

    Paper: Ilya Loshchilov, Frank Hutter, "Decoupled Weight Decay Regularization", ICLR 2019,
    https://arxiv.org/abs/1711.05101
    """

    _name_rule_keys = ("exclude_from_weight_decay",)
    _state_spec = ADAM_STATE
    _fused_kernels = True  # torch's fused Adam kernel

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        exclude_from_weight_decay: NameRule = None,
        max_grad_norm: Optional[float] = None,
        clip_grad_value: Any = None,
        clip_grad_norm_per_tensor: Optional[float] = None,
        rescale_grad: float = 1.0,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        nonfinite: str = "propagate",
        state_dtype: str = "float32",
        implementation: Optional[str] = None,
        capturable: bool = False,
        master_weights: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            exclude_from_weight_decay=exclude_from_weight_decay,
            max_grad_norm=max_grad_norm,
            clip_grad_value=clip_grad_value,
            clip_grad_norm_per_tensor=clip_grad_norm_per_tensor,
            rescale_grad=rescale_grad,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
            state_dtype=state_dtype,
            implementation=implementation,
            capturable=capturable,
            master_weights=master_weights,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        self._validate_adam_group(group)
        a = self._arg
        check_bool(a("amsgrad"), group["amsgrad"])
        check_fused(group)
        check_implementation(group)
        check_bool(a("capturable"), group["capturable"])
        check_bool(a("master_weights"), group["master_weights"])
        impl = group.get("implementation")
        if group["capturable"] and impl not in (None, "triton"):
            raise ValueError(f"capturable=True runs on the Triton kernel, not "
                             f"implementation={impl!r}")
        if (impl in _KERNELS or group["capturable"]) and group["amsgrad"]:
            what = "capturable=True" if group["capturable"] else f"implementation={impl!r}"
            raise ValueError(f"{what} does not keep amsgrad's running maximum: leave "
                             "implementation None (torch's paths) for amsgrad=True")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        for item in self._intake():
            update(self, item.group, item.idx, item.params, item.grads)
        return loss


def update(opt: Any, group: Dict[str, Any], idx: List[int], params: List[Tensor],
           grads: List[Tensor]) -> None:
    """One AdamW step of ``group``'s parameters ``params`` (at positions ``idx`` of the group)
    with their gradients ``grads`` (local shards for DTensors), the state in ``opt.state``:
    the group's keys as :class:`AdamW` has them (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``amsgrad``, ``foreach``, ``fused``, ``state_dtype``, ``exclude_from_weight_decay``)."""
    impl = named_path(group)
    if impl in _KERNELS:
        _kernel_step(opt, group, idx, params, grads, impl)
        return
    parts = _joined_parts(group, params)
    if len(parts) > 1:  # each part's float32 masters joined, stepped and split in turn
        for part in parts:
            update(opt, group, [idx[k] for k in part], [params[k] for k in part],
                   [grads[k] for k in part])
        return
    view, work, joined, lows = _working(opt, group, params)
    fused = takes_fused(group, work if view is None else [work[k] for k in joined])
    pending: List[_compact.Pending] = []
    native: Dict[bool, List[Tuple[Any, ...]]] = {}
    lists = _init_group(opt, group, idx, params, work, grads, fused, pending, native, lows,
                        joined)
    for decayed, rows in native.items():
        *columns, w16s = (list(col) for col in zip(*rows))
        _adam_kernel(group, tuple(columns), [decayed] * len(rows), "native",
                     _kernel_cache(opt, group), w16s=w16s)
    beta1, beta2 = group["betas"]
    for decayed, (ps, gs, ms, vs, maxs, steps) in lists.items():
        # torch's foreach path needs its tensor-scalar form under torch.compile
        capturable = _ops.compiling() and not fused
        counters, steps = steps, _beside(steps, ps) if capturable else steps
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and not capturable:
            lr = lr.item()  # torch's foreach and fused CPU paths take a number here
        if capturable:
            # a 0-d tensor made from the float: an input of the compiled graph, not a
            # constant that an LR schedule would recompile at every step
            lr = torch.ones((), dtype=torch.float32, device=ps[0].device) * lr
        _torch_adamw(ps, gs, ms, vs, maxs if group["amsgrad"] else [], steps,
                     foreach=None if fused else (impl == "multi" if impl else group["foreach"]),
                     fused=fused, capturable=capturable, amsgrad=group["amsgrad"], beta1=beta1,
                     beta2=beta2, lr=lr, weight_decay=group["weight_decay"] if decayed else 0.0,
                     eps=group["eps"], maximize=False)
        for s, moved in zip(counters, steps) if steps is not counters else ():
            s.copy_(moved)
    _compact.store(pending)
    if view is not None:
        opt._master_weights.split_back(view.subset(joined), [work[k] for k in joined])
        opt._master_weights.commit(view, False)


#: the elements of float32 masters torch's paths join at once (4 MiB of them; a larger tensor
#: alone): the step's transients are bounded by that, not by the model
JOIN_ELEMENTS = 1 << 20


def _joined_parts(group: Dict[str, Any], params: List[Tensor]) -> List[List[int]]:
    """Where torch's paths run on joined float32 masters (``master_weights`` with float32
    moments, or no C kernel), the positions of ``params`` in parts of about
    :data:`JOIN_ELEMENTS` elements each; one part otherwise. Each tensor's update is its own
    (element-wise), so the parts give the bits of one call."""
    if not group.get("master_weights") or len(params) < 2:
        return [list(range(len(params)))]
    if group["state_dtype"] != "float32" and _native.available() \
            and _native.kernels_allowed(group):
        return [list(range(len(params)))]  # split masters stay split on the C kernel
    parts: List[List[int]] = [[]]
    size = 0
    for k, p in enumerate(params):
        if parts[-1] and size + p.numel() > JOIN_ELEMENTS:
            parts.append([])
            size = 0
        parts[-1].append(k)
        size += p.numel()
    return parts


def _working(opt: Any, group: Dict[str, Any], params: List[Tensor]) -> Tuple[Any, ...]:
    """``(view, work, joined, lows)``: with master weights, torch's paths run on their float32
    values (``work``; split ones joined, their positions in ``joined``); a split master whose
    moments are compact is left split (``lows``: its lower halves), for the C kernel to update
    its halves in place (no float32 copy of it), or to be joined later where it cannot."""
    view = opt._master_weights.view(group, params) if group.get("master_weights") else None
    if view is None:
        return None, params, [], [None] * len(params)
    work = list(view.weights)
    kernel = _native.available() and _native.kernels_allowed(group)
    joined = [k for k, (p, lo) in enumerate(zip(params, view.lower_halves))
              if lo is None or not kernel
              or _compact.form_for(group["state_dtype"], tuple(p.shape)) == "float32"]
    for k, w in zip(joined, opt._master_weights.joined(view.subset(joined))):
        work[k] = w
    kept = set(range(len(params))).difference(joined)
    lows = [lo if k in kept else None for k, lo in enumerate(view.lower_halves)]
    return view, work, joined, lows


def _step_counter(state: Dict[str, Any], p: Tensor, fused: bool) -> None:
    """``state["step"]``, made where new: on ``p``'s device where ``fused`` needs it, else on
    the CPU."""
    if "step" not in state:
        state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                         else torch.tensor(0.0, dtype=torch.float32))
    if fused and state["step"].device != p.device:
        state["step"] = state["step"].to(p.device)
    elif not fused and state["step"].device.type != "cpu":
        state["step"] = state["step"].cpu()


def _init_group(opt: Any, group: Dict[str, Any], idx: List[int], params: List[Tensor],
                work: List[Tensor], grads: List[Tensor], fused: bool,
                pending: List[_compact.Pending], native: Dict[bool, List[Tuple[Any, ...]]],
                lows: List[Optional[Tensor]], joined: List[int]
                ) -> Dict[bool, Tuple[List[Tensor], ...]]:
    """The group's tensors for torch's ``adamw``, split by whether they decay: the tensors
    updated (``work``: the parameters, or their float32 masters), grads, moments (in the
    dtype of those), max moments (the params without amsgrad) and steps; state made where
    new, step counters where ``fused`` needs them (on the parameter's device) or not.
    Sharded parameters and their state are given as their local shards (as the gradients
    are). Moments stored in bfloat16 or 8 bits go to the C kernel where it takes them
    (into ``native``, see :func:`_native_row`, for :func:`_adam_kernel`), else are given as
    float32 working tensors, put on ``pending`` to be stored back after the update. A split
    master left split (``lows[k]``: its lower halves) goes to the C kernel, or is joined here
    into ``work`` (its position added to ``joined``) where the kernel cannot take it."""
    no_decay = opt._rule_flags(group, "exclude_from_weight_decay")
    keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    lists: Dict[bool, Tuple[List[Tensor], ...]] = {}
    for k, (i, p, w, g) in enumerate(zip(idx, params, work, grads)):
        state = opt.state[p]
        _step_counter(state, p, fused)
        form = _compact.form_for(group["state_dtype"], tuple(p.shape))
        _compact.convert(state, form, p, torch.float32 if lows[k] is not None else w.dtype)
        row = None if form == "float32" else _native_row(group, p, w, g, state, form, lows[k])
        if row is not None:
            native.setdefault(not no_decay[i], []).append(row)
            continue
        if lows[k] is not None:  # split, and the kernel cannot take it: joined after all
            w = work[k] = split_join(local_piece(w).detach(), local_piece(lows[k]))
            joined.append(k)
        moments = {}
        for key in keys:
            if form != "float32":
                moments[key] = _compact.working(state, key, form, p, w.dtype, pending)
                continue
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=w.dtype,
                                              memory_format=torch.preserve_format)
            moments[key] = local_piece(state[key])
        ls = lists.setdefault(not no_decay[i], ([], [], [], [], [], []))
        if g.dtype != w.dtype:  # a low-precision gradient of a float32 master
            g = g.to(w.dtype)
        for dest, t in zip(ls, (local_piece(w), g, moments["exp_avg"], moments["exp_avg_sq"],
                                moments.get("max_exp_avg_sq", local_piece(w)),
                                state["step"])):
            dest.append(t)
    return lists

def _native_row(group: Dict[str, Any], p: Tensor, w: Tensor, grad: Tensor,
                state: Dict[str, Any], form: str,
                low: Optional[Tensor] = None) -> Optional[Tuple[Any, ...]]:
    """``(weight, grad, exp_avg, exp_avg_sq, step, stored, w16)`` of a parameter ``p`` whose
    moments are stored in ``form`` (bfloat16 or 8 bits), for the C kernel, which updates
    them and ``w`` (``p`` or its float32 master; with ``low``, a split master's upper half,
    whose lower halves ``low`` are ``w16``) in place in one pass (no float32 copies): where it
    takes the tensor (float32 or split on the CPU, the kernels built, no amsgrad, not under
    ``torch.compile``, no path other than the fused ones asked for), else None."""
    if (group["amsgrad"] or not _native.kernels_allowed(group)
            or (w.dtype != torch.float32 and low is None)
            or not _native.available() or _ops.compiling() or not state["step"].is_cpu):
        return None
    stored = _compact.stored(state, form, p)
    w16 = None if low is None else local_piece(low)
    row = (local_piece(w), grad, local_piece(state["exp_avg"]),
           local_piece(state["exp_avg_sq"]), state["step"], stored, w16)
    return row if _native.adam_applies(*row[:4], w16, stored) else None

#: the implementations that run AdamW on scaleopt's own kernels (one pass per tensor)
_KERNELS = ("native", "triton")


def named_path(group: Dict[str, Any]) -> Optional[str]:
    """The path an AdamW group's options name: ``"triton"`` where it is ``capturable``, else
    its ``implementation`` (None: torch's paths, chosen by ``foreach``/``fused``)."""
    return "triton" if group.get("capturable") else group.get("implementation")


def _grads_key(grads: List[Tensor]) -> Optional[Tuple[List[Any], ...]]:
    """What a plan made for some gradients holds for others that give the same key: their
    dtypes, sizes and devices (``Tensor.get_device``: -1 for the CPU); None where one is not
    a plain contiguous tensor (a few passes in C, no Python work per tensor)."""
    if not (set(map(type, grads)) <= _PLAIN and all(map(Tensor.is_contiguous, grads))):
        return None
    return (list(map(_DTYPE, grads)), list(map(Tensor.numel, grads)),
            list(map(Tensor.get_device, grads)))


class _KernelPlan(NamedTuple):
    """A group's step on scaleopt's kernels but its gradients: the columns (weights, moments,
    step counters, stored forms) made from its parameters' state, and what they were made of
    (the parameters, the options that decide the state's form, the state dicts and every
    entry in them, the gradients' :func:`_grads_key`): given again while all
    of these are the same (a few passes in C instead of a pass of checks and conversions per
    tensor, the host's work of a step)."""

    idx: List[int]
    options: tuple
    params: List[Tensor]
    dicts: List[Dict[str, Any]]
    entries: List[Any]
    columns: Tuple[List[Any], ...]
    grads_key: Any
    #: the masters' view (``master_weights``), to commit to the parameters after a step
    view: Any

    def holds(self, opt: Any, idx: List[int], options: tuple, params: List[Tensor],
              grads: List[Tensor]) -> bool:
        if not (self.idx == idx and self.options == options
                and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params))):
            return False
        dicts = list(map(opt.state.__getitem__, params))
        entries = _entries(dicts)
        return (all(map(operator.is_, dicts, self.dicts)) and len(entries) == len(self.entries)
                and all(map(operator.is_, entries, self.entries))
                and self.grads_key is not None and _grads_key(grads) == self.grads_key)


def _kernel_plan(opt: Any, group: Dict[str, Any], idx: List[int], params: List[Tensor],
                 grads: List[Tensor], impl: str, cache: Dict[str, Any]) -> _KernelPlan:
    """The group's :class:`_KernelPlan`: the last step's (in ``cache``) where it holds, else
    made: the state made where new (step counters float32 scalars on the host, as torch's
    non-fused AdamW keeps them; with ``capturable`` where the weights are), converted to the
    group's ``state_dtype``, and the tensors checked (``ValueError`` where the kernel ``impl``
    cannot take one)."""
    options = (group["state_dtype"], group.get("capturable", False), impl,
               bool(group.get("master_weights")))
    kept = cache.get("kernel plan")  # ("plan" is the Triton launcher's own)
    if kept is not None and kept.holds(opt, idx, options, params, grads):
        return kept
    on_device = options[1]
    # with master weights: a split master's upper half (the parameter) and lower halves, or
    # a float32 copy and the parameter its rounded values go to (the kernels' w16)
    view = opt._master_weights.view(group, params) if options[3] else None
    weights, w16s = (params, [None] * len(params)) if view is None else (view.weights,
                                                                          view.kernel_w16())
    rows = []
    for p, weight, w16 in zip(params, weights, w16s):
        state = opt.state[p]
        dtype = torch.float32 if view is not None and opt._computes_in_float32(group, p) \
            else p.dtype
        where = p.device if on_device else torch.device("cpu")
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=where)
        elif state["step"].device != where:
            state["step"] = state["step"].to(where)
        form = _compact.form_for(group["state_dtype"], tuple(p.shape))
        _compact.convert(state, form, p, dtype)
        if form == "float32":
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = torch.zeros_like(p, dtype=dtype,
                                                  memory_format=torch.preserve_format)
            stored = None
        else:
            stored = _compact.stored(state, form, p)
        rows.append((local_piece(weight), local_piece(state["exp_avg"]),
                     local_piece(state["exp_avg_sq"]), state["step"], stored,
                     None if w16 is None else local_piece(w16)))
    columns = tuple(list(col) for col in zip(*rows)) if rows else ([],) * 6
    w, m, v, _, stored, w16 = columns
    _check_kernel_takes(impl, w, list(grads), m, v, stored, w16, on_device)
    dicts = list(map(opt.state.__getitem__, params))
    plan = _KernelPlan(list(idx), options, list(params), dicts, _entries(dicts), columns,
                       _grads_key(grads), view)
    # sharded parameters' local pieces are taken again at every step (a shard may move)
    cache["kernel plan"] = None if any_dtensor(params) else plan
    return plan


def _kernel_step(opt: Any, group: Dict[str, Any], idx: List[int], params: List[Tensor],
                 grads: List[Tensor], impl: str) -> None:
    """AdamW on the C kernel or the Triton one (``impl``), which take the same arguments and
    give the same bits: every tensor of the group in one call, its moments as ``state_dtype``
    stores them (updated in place: no float32 copy), the scalars computed as torch computes
    them. ``ValueError`` where the kernel cannot take a tensor."""
    if not params:
        return
    cache = _kernel_cache(opt, group)
    plan = _kernel_plan(opt, group, idx, params, grads, impl, cache)
    w, m, v, steps, stored, w16 = plan.columns
    no_decay = opt._rule_flags(group, "exclude_from_weight_decay")
    _adam_kernel(group, (w, list(grads), m, v, steps, stored), [not no_decay[i] for i in idx],
                 impl, cache, w16)
    if plan.view is not None:  # (split masters' upper halves are the parameters: nothing)
        opt._master_weights.commit(plan.view, True)


def _kernel_cache(opt: Any, group: Dict[str, Any]) -> Dict[str, Any]:
    """What the kernels keep between a group's steps: per group, by its list of parameters
    (which a Muon group's AdamW view shares)."""
    return opt.__dict__.setdefault("_kernel_caches", {}).setdefault(id(group["params"]), {})


def _adam_kernel(group: Dict[str, Any], columns: Tuple[List[Any], ...], decayed: List[bool],
                 impl: str, cache: Dict[str, Any],
                 w16s: Optional[List[Optional[Tensor]]] = None) -> None:
    """AdamW on the C kernel or the Triton one (``impl``) for ``columns`` (weights, gradients,
    moments, step counters, stored forms; ``decayed``: whether each decays; ``w16s``: split
    masters' lower halves, or where a float32 master's rounded values go): torch's
    single-tensor AdamW's operations, with the scalars computed as it computes them (with
    ``capturable``, by device operations: :func:`scaleopt._triton.adamw_on_device`)."""
    beta1, beta2 = group["betas"]
    w, g, m, v, steps, stored = columns
    wd = group["weight_decay"]
    w16s = [None] * len(w) if w16s is None else w16s
    if impl == "triton":
        on = _triton.adamw_on_device if group.get("capturable") else _triton.adamw
        on(w, g, m, v, steps, lr=group["lr"], weight_decays=[wd if d else 0.0 for d in decayed],
           beta1=beta1, beta2=beta2, eps=group["eps"], stored=stored, cache=cache, w16s=w16s)
        return
    lr, count = float(group["lr"]), len(w)
    bc1, bc2_sqrt = _ops.bias_corrections([float(s) + 1.0 for s in steps], beta1, beta2, True)
    _native.adam(w, g, m, v, w16s, steps, threads=torch.get_num_threads(),
                 step_sizes=[lr / b for b in bc1], bias_correction2_sqrts=bc2_sqrt,
                 weight_decays_l2=[0.0] * count,
                 decays=[1.0 - lr * (wd if d else 0.0) for d in decayed], beta1=beta1,
                 beta2=beta2, eps=group["eps"], grad_multipliers=[1.0] * count, stored=stored)


def _check_kernel_takes(impl: str, w: List[Tensor], g: List[Tensor], m: List[Tensor],
                        v: List[Tensor], stored: List[Any], w16: List[Optional[Tensor]],
                        capturable: bool = False) -> None:
    """``ValueError`` naming what the kernel ``impl`` cannot take among a group's tensors
    (``w16``: split masters' lower halves, or where a float32 master's rounded values go)."""
    if impl == "triton":
        t = GroupTensors(w, g, m, v, [], w16 if any(x is not None for x in w16) else None,
                         stored=stored)
        ok = _triton.applies(t)
        where = ("float32 parameters (or float16/bfloat16 ones with master_weights=True), "
                 "contiguous, on a CUDA device (CPU tensors under TRITON_INTERPRET=1), and "
                 "Triton installed")
    else:
        ok = _native.available() and all(_native.adam_applies(*row, st)
                                          for *row, st in zip(w, g, m, v, w16, stored))
        where = ("float32 CPU parameters (or bfloat16 ones with master_weights=True), "
                 "contiguous, and the C kernels built")
    if not ok:
        asked = "capturable=True" if capturable else f"implementation={impl!r}"
        raise ValueError(f"{asked}: the {impl} kernel cannot take this group's tensors: it "
                         f"takes {where}")
