"""Muon: orthogonalized momentum for the matrices of a model, AdamW for the rest, in one optimizer."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _compact, _ops, adamw
from ._base import ScaleOptimizer, lr_of
from ._checks import check_betas, check_bool, check_choice, check_number
from ._dispatch import check_implementation
from ._loading import StateSpec, _pairs
from ._masters import (LOW_PRECISION, LocalPlacement, MasterView, Storage, WithMasterWeights,
                       split_, split_join)
from ._layout import layout
from ._orthogonal import (EPS, NS_COEFFICIENTS, NS_METHODS, NS_STEPS, Job, adjusted_lr,
                          newton_schulz_, orthogonalize, stack_whole_here, whole_here)
from ._params import NameRule, match_names, normalize_group, param_label, rule_is_set
from ._sharding import local_piece

__all__ = ["Muon"]

#: the choices of ``adjust_lr_fn`` (torch.optim.Muon's)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
#: how the ranks share the sharded matrices (``exchange_balance``)
BALANCES = ("cost", "measured")
#: what updates a group's parameters
ALGORITHMS = ("muon", "adamw")
#: how a parameter of 3 or more dimensions is read (``nd_params``): a stack if 3-D and
#: flattened if more ("auto"), AdamW's, a stack of matrices over its leading dimensions, or
#: one matrix of its first dimension's rows
ND_READINGS = ("auto", "adamw", "stack", "flatten")
#: the elements of a split master joined at a time (its float32 values exist only for these)
SPLIT_CHUNK = 1 << 16
#: the dtypes the iteration runs in (``ns_dtype``)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
#: the state of a parameter of each algorithm (``step`` is made where missing: torch.optim.Muon
#: keeps none)
_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}


class Muon(WithMasterWeights, ScaleOptimizer):
    r"""Muon (Jordan et al., 2024) for a model's matrices, AdamW for its other parameters.

    For each matrix :math:`W` (a 2-D parameter) with gradient :math:`G`:

    .. math::
        \begin{aligned}
        B_t &= \mu B_{t-1} + (1-\mu) G_t \qquad
        \tilde B_t = \begin{cases} (1-\mu) G_t + \mu B_t & \text{nesterov} \\
                                   B_t & \text{otherwise} \end{cases}\\
        O_t &= \mathrm{NS}^{(a,b,c)}_k(\tilde B_t):\quad X_0 = \tilde B_t / \max(\|\tilde B_t\|_F,
              \varepsilon),\quad X_{i+1} = a X_i + (b A_i + c A_i^2) X_i,\ A_i = X_i X_i^T\\
        W_t &= (1 - \eta\lambda)\, W_{t-1} - \eta'\, O_t, \qquad
        \eta' = \begin{cases} \eta \sqrt{\max(1, A/B)} & \text{original} \\
                              0.2\, \eta \sqrt{\max(A, B)} & \text{match\_rms\_adamw}
                \end{cases}
        \end{aligned}

    for an :math:`A \times B` matrix, the iteration in bfloat16 (``ns_dtype``) on the wide
    orientation. These are :class:`torch.optim.Muon`'s operations: on one device the matrices'
    updates are torch's bits, and its ``state_dict`` loads here. The iteration drives the update's singular values
    towards 1, so every direction of the momentum moves the weights alike.

    The other parameters (not 2-D: biases, norms; and 2-D ones that ``exclude_from_muon`` names:
    embeddings, the output head) take AdamW (:class:`scaleopt.AdamW`'s step, ``betas``,
    ``adamw_eps``, the group's ``weight_decay``), as Moonlight and Keller Jordan's reference
    do. A group of mixed parameters is split in two at construction (and in
    :meth:`add_param_group`): its matrices (``algorithm="muon"``) and the rest
    (``algorithm="adamw"``, at ``adamw_lr`` if given); a group that says its ``algorithm``
    is kept whole. So one optimizer, one ``state_dict`` and one LR scheduler (which scales
    each group's ``lr``) serve a whole model.

    On FSDP2, tensor-parallel, FSDP x TP and expert-parallel shards (each also under HSDP)
    each matrix is iterated whole, by one rank of the whole mesh (on HSDP not once per
    replica): the ranks share the matrices by cost, and the blocks travel in one batched
    exchange each way per step (on HSDP, and one all-gather over the replicas); the results
    are one process's (see :doc:`/muon`).

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float, default 1e-3): learning rate :math:`\eta`.
        weight_decay (float, default 0.1): :math:`\lambda`, decoupled (both algorithms).
        momentum (float, default 0.95): :math:`\mu`.
        nesterov (bool, default True): Nesterov momentum.
        ns_coefficients (tuple of 3 floats, a sequence of such triples, or a name, default
            (3.4445, -4.7750, 2.0315)): :math:`(a, b, c)` of every step, or of each step in
            turn (the last repeated); or a named iteration: ``"quintic"`` (the default's
            numbers) or ``"polar_express"`` (Polar Express's per-step coefficients, computed
            for ``ns_steps``: a more nearly orthogonal update in the same matrix products,
            see :doc:`/muon`).
        eps (float, default 1e-7): :math:`\varepsilon` of the iteration's normalization.
        ns_steps (int, default 5): :math:`k`, the iteration's steps.
        adjust_lr_fn (None, ``"original"`` or ``"match_rms_adamw"``, default None =
            ``"original"``): :math:`\eta'`. ``"match_rms_adamw"`` gives the update AdamW's
            RMS, so the matrices and the AdamW parameters can share one ``lr``.
        ns_dtype (``"bfloat16"`` or ``"float32"``, default ``"bfloat16"``): the dtype of the
            iteration. bfloat16 is torch's (its bits), and fast on GPUs and on CPUs that
            multiply bfloat16 (AVX-512 BF16, AMX); ``"float32"`` for CPUs that do not.
        betas (tuple[float, float], default (0.9, 0.95)): AdamW's :math:`(\beta_1, \beta_2)`.
        adamw_eps (float, default 1e-8): AdamW's :math:`\epsilon`.
        adamw_lr (float or None, default None): the learning rate of the AdamW part of a split
            group; None: the group's ``lr``.
        exclude_from_muon (regex, list of regexes, callable(name) or None): parameters that
            would take Muon but take AdamW (e.g. ``r"embed|head"``).
        nd_params (``"auto"``, ``"stack"``, ``"flatten"`` or ``"adamw"``, default
            ``"auto"``): how a parameter of 3 or more dimensions is read: a stack of matrices
            over its leading dimensions (the last two are the matrix: a mixture of experts'
            ``[experts, in, out]`` weight), each orthogonalized on its own, with its own
            :math:`\eta'`, so that each gets torch.optim.Muon's bits for that matrix; one
            matrix of its first dimension's rows (a convolution's ``[out, in, kh, kw]`` as
            ``[out, in * kh * kw]``, as Keller Jordan's Muon reads it); AdamW's; or
            (``"auto"``) a stack if 3-D, flattened if more. A stack cut over ranks by its
            leading dimensions alone (expert parallelism's or FSDP2's ``Shard(0)``) is
            iterated where its matrices lie, with no exchange; any other cut goes through the
            exchange, one matrix of the stack at a time.
        exclude_from_weight_decay (name rule or None): names that get no decay.
        max_grad_norm (float or None, default None): global gradient-norm clipping.
        nonfinite (``"propagate"`` or ``"skip"``): as in :class:`LAMB` (see :doc:`/robustness`).
        state_dtype (``"float32"``, ``"bfloat16"`` or ``"int8"``, default ``"float32"``): how
            the momentum and AdamW's moments are stored (see :doc:`/state`).
        exchange_buckets (int, default 1): on sharded matrices, the exchange in that many
            runs, each run's blocks travelling (asynchronously) while the run before is
            iterated and its results going back while the next is: the same bits, two
            all-to-alls per run (see :doc:`/muon`).
        exchange_balance (``"cost"`` or ``"measured"``, default ``"cost"``): how the ranks
            share the sharded matrices: by the iteration's cost, or by it times each rank's
            pace, measured in the exchanges of steps 2 and 3 and shared once (two all-gathers
            of one number, then never again), so that a slower rank gets less: the same
            bits either way.
        foreach (bool or None, default None), fused (bool or None, default None): the AdamW
            part's path, as in :class:`AdamW` (torch's fused kernel, multi-tensor ops or
            per-tensor loop); the matrices' iteration has one form and ignores them.
        adamw_implementation (str or None, default None): the AdamW part's path by name, as
            the ``implementation`` of :class:`AdamW` (``"single"``, ``"multi"``, ``"native"``
            or ``"triton"``); ``"triton"`` runs its parameters in one Triton launch per step
            (CUDA) in every ``state_dtype``, ``"native"`` on the C kernel (CPU), the two with
            the same bits.
        master_weights (bool, default False): float32 master weights (and float32 momentum)
            for float16/bfloat16 matrices: a bfloat16 matrix's master is split (the parameter
            holds its upper 16 bits, ``state["master_lo"]`` the lower 16), 2 bytes per element,
            and each update is the float32 update's bits, rounded into the parameter; other
            parameters take AdamW's ``master_weights``. Allows a ``state_dtype`` other than
            float32 for such parameters. Saved in ``state_dict`` as float32 ``master_param``.

    A step makes, applies and lets go of one matrix's update before the next one's (the
    sharded matrices of an exchange together, a stack's matrices together), so that its peak
    above what the optimizer holds is the gradients and one matrix's (or stack's) update and
    one matrix's iteration (see :doc:`/memory`).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-3)
        >>> [g["algorithm"] for g in opt.param_groups]
        ['muon', 'adamw']
        >>> model(torch.randn(4, 8)).square().mean().backward()
        >>> opt.step()

    Papers: Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks",
    2024, https://kellerjordan.github.io/posts/muon/; Jingyuan Liu et al., "Muon is Scalable
    for LLM Training", 2025, https://arxiv.org/abs/2502.16982
    """

    _name_rule_keys = ("exclude_from_muon", "exclude_from_weight_decay")
    _state_spec = StateSpec("muon", (), ("momentum_buffer", "exp_avg", "exp_avg_sq"))
    _fused_kernels = True  # torch's fused Adam kernel, for the AdamW part

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        *,
        ns_dtype: str = "bfloat16",
        betas: Tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: Optional[float] = None,
        exclude_from_muon: NameRule = None,
        nd_params: str = "auto",
        exclude_from_weight_decay: NameRule = None,
        max_grad_norm: Optional[float] = None,
        nonfinite: str = "propagate",
        state_dtype: str = "float32",
        exchange_buckets: int = 1,
        exchange_balance: str = "cost",
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        adamw_implementation: Optional[str] = None,
        master_weights: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=_as_tuples(ns_coefficients),
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
            betas=tuple(betas) if isinstance(betas, list) else betas, adamw_eps=adamw_eps,
            adamw_lr=adamw_lr, exclude_from_muon=exclude_from_muon, nd_params=nd_params,
            exclude_from_weight_decay=exclude_from_weight_decay, max_grad_norm=max_grad_norm,
            state_dtype=state_dtype, exchange_buckets=exchange_buckets,
            exchange_balance=exchange_balance, foreach=foreach,
            fused=fused, adamw_implementation=adamw_implementation, algorithm=None,
            master_weights=master_weights,
        )
        #: the ranks' measured paces per process group (``exchange_balance="measured"``)
        self._paces: Dict[Any, Dict[str, Any]] = {}
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _master_placement(self) -> LocalPlacement:
        return _MuonPlacement()

    # -- groups -------------------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group; one whose ``algorithm`` is None (the default) is added as up to two:
        its matrices for Muon and its other parameters (and those ``exclude_from_muon``
        names) for AdamW, at ``adamw_lr`` where that is set."""
        group = normalize_group(param_group)
        if group.get("algorithm", self.defaults["algorithm"]) is not None:
            return super().add_param_group(group)
        rule = group.get("exclude_from_muon", self.defaults["exclude_from_muon"])
        names = group.get("param_names")
        if rule_is_set(rule) and names is None:
            raise ValueError("exclude_from_muon is a rule on parameter names, but the parameters "
                             "have no names: pass model.named_parameters() or groups with "
                             "'param_names'")
        excluded = match_names(rule, names) if rule_is_set(rule) else (False,) * len(
            group["params"])
        nd = dict(nd_params=group.get("nd_params", self.defaults["nd_params"]))
        matrix = [p.ndim >= 2 and _reading(nd, p) != "adamw" and not x
                  for p, x in zip(group["params"], excluded)]
        parts = [(a, [i for i, m in enumerate(matrix) if m == (a == "muon")]) for a in ALGORITHMS]
        parts = [(a, idx) for a, idx in parts if idx] or [("muon", [])]
        for algorithm, idx in parts:
            part = dict(group, algorithm=algorithm, params=[group["params"][i] for i in idx])
            if names is not None:
                part["param_names"] = [names[i] for i in idx]
            adamw_lr = group.get("adamw_lr", self.defaults["adamw_lr"])
            if algorithm == "adamw" and adamw_lr is not None:
                part["lr"] = adamw_lr
            super().add_param_group(part)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("weight_decay", group["weight_decay"])
        check_number("momentum", group["momentum"], high=1.0)
        check_bool("nesterov", group["nesterov"])
        check_bool("master_weights", group["master_weights"])
        _check_coefficients(_as_tuples(group["ns_coefficients"]))
        check_number("eps", group["eps"], low=0.0, low_open=True)
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"Invalid ns_steps: {steps!r} (an int in [0, 100))")
        buckets = group["exchange_buckets"]
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            raise ValueError(f"Invalid exchange_buckets: {buckets!r} (an int >= 1)")
        check_choice("exchange_balance", group["exchange_balance"], BALANCES)
        check_choice("adjust_lr_fn", group["adjust_lr_fn"], ADJUST_LR_FNS)
        check_choice("ns_dtype", group["ns_dtype"], tuple(NS_DTYPES))
        check_betas(group["betas"])
        check_number("adamw_eps", group["adamw_eps"])
        check_number("adamw_lr", group["adamw_lr"], allow_none=True)
        check_choice("algorithm", group["algorithm"], ALGORITHMS)
        self._check_state_dtype(group)
        if group["algorithm"] == "adamw":
            adamw.check_fused(group)
        try:  # (its messages name the option as AdamW's)
            check_implementation(dict(implementation=group["adamw_implementation"],
                                      foreach=group["foreach"], fused=group["fused"]))
        except ValueError as exc:
            raise ValueError(str(exc).replace("implementation", "adamw_implementation", 1)
                             ) from None
        check_choice("nd_params", group["nd_params"], ND_READINGS)
        if group["algorithm"] == "muon":
            for i, p in enumerate(group["params"]):
                if p.ndim < 2 or _reading(group, p) == "adamw":
                    raise ValueError(
                        f"a group with algorithm='muon' takes matrices (2-D parameters, or more "
                        f"dimensions with nd_params 'stack' or 'flatten'), and "
                        f"{param_label(group, i)} has shape {tuple(p.shape)}: leave the group's "
                        f"algorithm unset to send it to AdamW")
                try:
                    layout(p)
                except NotImplementedError as exc:
                    raise ValueError(f"{param_label(group, i)}: {exc}") from None

    # -- loading ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As :meth:`ScaleOptimizer.load_state_dict`, with each parameter's state checked for
        its algorithm's keys (a matrix's ``momentum_buffer``; AdamW's ``step`` and moments);
        a state dict of :class:`torch.optim.Muon` loads into a Muon of its matrices. Each
        group keeps its algorithm."""
        if isinstance(state_dict, dict) and "state" in state_dict:
            self._check_algorithms(state_dict)
        algorithms = [g["algorithm"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, algorithm in zip(self.param_groups, algorithms):
            group["algorithm"] = algorithm

    def _check_algorithms(self, state_dict: Dict[str, Any]) -> None:
        for group, pid, (i, _) in _pairs(self.param_groups, state_dict.get("param_groups", [])):
            st = state_dict["state"].get(pid)
            if not isinstance(st, dict):
                continue
            missing = [k for k in _KEYS[group["algorithm"]] if k not in st]
            if missing:
                raise ValueError(
                    f"state of {param_label(group, i)} lacks {missing}: it is updated by "
                    f"{group['algorithm']}, whose state holds {list(_KEYS[group['algorithm']])}"
                    f" (the checkpoint is of another optimizer or another grouping)")

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step. ``closure`` re-evaluates the model and returns the loss."""
        loss = self._closure_loss(closure)
        matrices: List[Tuple[Dict[str, Any], Tensor, Job]] = []  # the sharded ones
        pending: List[_compact.Pending] = []
        for item in self._intake():
            group = item.group
            if group["algorithm"] == "adamw":
                adamw.update(self, _as_adamw(group), item.idx, item.params, item.grads)
                continue
            decays = [not x for x in self._rule_flags(group, "exclude_from_weight_decay")]
            for i, p, g in zip(item.idx, item.params, item.grads):
                each = group if decays[i] else dict(group, weight_decay=0.0)
                if _iterated_here(group, p):  # made, applied and freed before the next
                    self._step_matrix(each, p, g)
                else:
                    matrices.append((each, p, Job(p, self._momentum_update(group, p, g,
                                                                           pending),
                                                  _reading(group, p))))
        if matrices:
            self._apply(matrices)
        _compact.store(pending)
        return loss

    def _momentum_update(self, group: Dict[str, Any], p: Tensor, grad: Tensor,
                         pending: List[_compact.Pending]) -> Tensor:
        """The momentum buffer moved by ``grad`` (local pieces), and the matrix to iterate: its
        Nesterov look-ahead, or the buffer."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["step"] += 1
        dtype = _working_dtype(group, p)
        # the momentum lives beside the master: in host memory when offloaded
        template = self._master_view(group, p).weights[0] if self.host is not None else p
        form = _compact.form_for(group["state_dtype"], tuple(p.shape))
        _compact.convert(state, form, template, dtype)  # a group that changed its state_dtype
        if form != "float32":
            buf = _compact.working(state, "momentum_buffer", form, template, dtype, pending)
        else:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    template, dtype=dtype, memory_format=torch.preserve_format)
            buf = local_piece(state["momentum_buffer"])
        converted = grad.dtype != buf.dtype  # a low-precision gradient of a float32 master
        if converted:
            grad = grad.to(buf.dtype)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        if not group["nesterov"]:
            return buf
        # the look-ahead into the converted gradient, which is this step's own copy
        return grad.lerp_(buf, momentum) if converted else grad.lerp(buf, momentum)

    def _step_matrix(self, group: Dict[str, Any], p: Tensor, grad: Tensor) -> None:
        """One matrix that no exchange joins: its momentum moved and stored, its update made
        (the momentum's working copy and the look-ahead let go of as soon as the next buffer
        exists) and applied. A step so holds one matrix's transients at a time: the
        iteration's dtype copy, one m x m buffer and the next iterate."""
        own: List[_compact.Pending] = []
        look = self._momentum_update(group, p, grad, own)
        _compact.store(own)
        del own
        # the iteration runs where the parameter is (offloaded: its momentum comes over)
        device, dtype = local_piece(p).device, NS_DTYPES[group["ns_dtype"]]
        how = (_as_tuples(group["ns_coefficients"]), group["ns_steps"], group["eps"])
        if _reading(group, p) != "stack":
            y = look.reshape(matrix_shape(group, look.shape)).to(device=device, dtype=dtype,
                                                                  copy=True)
            del look
            self._move(group, p, newton_schulz_(y, *how).reshape(p.shape))
            return
        # a stack (its local matrices, where its leading dimensions are cut over ranks): each
        # matrix iterated on its own, the updates gathered into one
        shape, flat = look.shape, look.reshape(math.prod(look.shape[:-2]), *look.shape[-2:])
        update = torch.empty(flat.shape, device=device, dtype=dtype)
        for e in range(flat.shape[0]):
            update[e] = newton_schulz_(flat[e].to(device=device, dtype=dtype, copy=True), *how)
        del look, flat
        self._move(group, p, update.view(shape))

    def _move(self, group: Dict[str, Any], p: Tensor, update: Tensor) -> None:
        """``p`` (its local piece), or its float32 master with ``master_weights``, decayed and
        moved by ``update``; a master's parameter then brought up to date (a split master's
        upper half is the parameter: joined, moved and split again)."""
        view = self._master_view(group, p)
        shape = matrix_shape(group, p.shape)
        if view.weights[0] is p and view.lower_halves[0] is None:  # no master
            _move(local_piece(p), update, group, shape)
            return
        if view.lower_halves[0] is not None:  # split: joined, moved and split a few rows at a time
            hi = local_piece(view.weights[0]).detach()
            lo = local_piece(view.lower_halves[0])
            update = update.to(hi.device)
            rows = max(1, SPLIT_CHUNK // max(1, math.prod(hi.shape[1:])))
            for r in range(0, hi.shape[0], rows):
                w = split_join(hi[r:r + rows], lo[r:r + rows])
                _move(w, update[r:r + rows], group, shape)
                split_(w, hi[r:r + rows], lo[r:r + rows])
            self._master_weights.commit(view, False)
            return
        work = self._master_weights.joined(view)
        w = local_piece(work[0])
        _move(w, update.to(w.device), group, shape)
        self._master_weights.split_back(view, work)
        self._master_weights.commit(view, False)

    def _master_view(self, group: Dict[str, Any], p: Tensor) -> Any:
        """``p``'s master as the update sees it (``p`` itself where it has none): with
        ``master_weights`` beside it (split for a bfloat16 matrix), offloaded in host memory."""
        if not group["master_weights"]:
            return MasterView([p], [p], [None], [None])
        return self._master_weights.view(group, [p])

    def _apply(self, matrices: List[Tuple[Dict[str, Any], Tensor, Job]]) -> None:
        """Orthogonalize every matrix's update (one exchange per process group that shards
        them, per setting of the iteration), then decay and move each (local pieces)."""
        settings: Dict[Tuple[Any, ...], List[Job]] = {}
        for group, _, job in matrices:
            key = (_as_tuples(group["ns_coefficients"]), group["ns_steps"], group["eps"],
                   NS_DTYPES[group["ns_dtype"]], group["exchange_buckets"],
                   group["exchange_balance"])
            settings.setdefault(key, []).append(job)
        for (coefficients, steps, eps, dtype, buckets, balance), jobs in settings.items():
            orthogonalize(jobs, coefficients, steps, eps, dtype, buckets, balance,
                          self._paces)
        for group, p, job in matrices:
            self._move(group, p, job.result)


def _move(w: Tensor, update: Tensor, group: Dict[str, Any], shape: Any) -> None:
    """``w`` decayed and moved by the orthogonalized ``update``: by torch.optim.Muon's
    operations for a learning rate that the host holds; as tensor arithmetic under
    ``torch.compile`` (a rate that changes is then an input of the graph, not a constant that
    recompiles it) and for a rate held on an accelerator (no host read)."""
    lr = lr_of(group)
    if _ops.compiling() or (isinstance(lr, Tensor) and not lr.is_cpu):
        w.mul_(1 - lr * group["weight_decay"])
        w.sub_(update.to(w.dtype) * adjusted_lr(lr, group["adjust_lr_fn"], shape))
        return
    lr = float(lr)
    w.mul_(1 - lr * group["weight_decay"])
    w.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))


def _reading(group: Dict[str, Any], p: Tensor) -> str:
    """How ``p`` (of 2 or more dimensions) is read: see :func:`_read_as`."""
    return _read_as(group["nd_params"], p.ndim)


def _read_as(nd_params: str, ndim: int) -> str:
    """How a parameter of ``ndim`` (2 or more) dimensions is read: a ``"matrix"``, a
    ``"stack"`` of matrices, one ``"flatten"``ed matrix, or ``"adamw"``'s (``nd_params``;
    ``"auto"``: a stack if 3-D, flattened if more)."""
    if ndim == 2:
        return "matrix"
    if nd_params == "auto":
        return "stack" if ndim == 3 else "flatten"
    return nd_params


def _iterated_here(group: Dict[str, Any], p: Tensor) -> bool:
    """Whether each matrix of ``p`` is whole on this process and iterated by it alone, with
    no exchange: nothing cuts ``p`` over ranks, or (a stack) only its leading dimensions are
    cut, with no copies (expert parallelism's or FSDP2's ``Shard(0)``)."""
    if _reading(group, p) == "stack":
        return stack_whole_here(p)
    return whole_here(p)


def matrix_shape(group: Dict[str, Any], shape: Sequence[int]) -> Tuple[int, int]:
    """The shape of the matrix (or of each matrix of a stack) that ``shape`` is read as, whose
    rows and columns set the learning rate's adjustment."""
    if _read_as(group.get("nd_params", "auto"), len(shape)) in ("matrix", "stack"):
        return tuple(shape[-2:])  # type: ignore[return-value]
    return shape[0], math.prod(shape[1:])


def _working_dtype(group: Dict[str, Any], p: Tensor) -> torch.dtype:
    """The dtype a matrix's momentum is computed in: float32 for a low-precision parameter
    with master weights, else the parameter's."""
    if group["master_weights"] and p.dtype in LOW_PRECISION:
        return torch.float32
    return p.dtype


class _MuonPlacement(LocalPlacement):
    """Masters beside their parameters; a contiguous bfloat16 matrix's master split (its
    upper half the parameter itself, ``master_lo`` the lower: 2 bytes per element), as the
    matrices' update joins and splits it with torch's ops on any device."""

    def storage(self, group: Dict[str, Any], p: Tensor) -> Storage:
        if (group.get("algorithm") == "muon" and group.get("master_weights")
                and p.dtype == torch.bfloat16 and local_piece(p).is_contiguous()):
            return Storage.SPLIT
        return super().storage(group, p)


def _as_tuples(coefficients: Any) -> Any:
    """``ns_coefficients`` with its lists as tuples (a group's key of the iteration)."""
    if isinstance(coefficients, (list, tuple)):
        return tuple(_as_tuples(c) for c in coefficients)
    return coefficients


def _check_coefficients(coefficients: Any) -> None:
    """``ns_coefficients``: a named iteration, three numbers, or a sequence of triples."""
    if isinstance(coefficients, str):
        check_choice("ns_coefficients", coefficients, NS_METHODS)
        return
    triples = (coefficients if isinstance(coefficients, tuple) and coefficients
               and all(isinstance(c, tuple) for c in coefficients) else (coefficients,))
    for k, triple in enumerate(triples):
        if not isinstance(triple, tuple) or len(triple) != 3:
            raise TypeError(f"ns_coefficients must be one of {list(NS_METHODS)}, three numbers "
                            f"(a, b, c), or a sequence of such triples, one per step; got "
                            f"{coefficients!r}")
        where = f" of step {k}" if len(triples) > 1 else ""
        for name, c in zip("abc", triple):
            check_number(f"ns_coefficients ({name}{where})", c, low=None)


def _as_adamw(group: Dict[str, Any]) -> Dict[str, Any]:
    """A Muon group's AdamW options under :class:`scaleopt.AdamW`'s keys."""
    return dict(group, eps=group["adamw_eps"], amsgrad=False,
                implementation=group.get("adamw_implementation"))
