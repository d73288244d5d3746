"""``DGCMomentum``: Deep Gradient Compression momentum SGD that communicates in ``step()``."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .._base import ScaleOptimizer, lr_number
from .._checks import check_bool, check_choice, check_number
from .._compile import eager
from .._intake import any_nonfinite
from .._loading import StateSpec
from .._sharding import any_dtensor, local_piece
from . import comm, replicas, select
from .schedule import PAPER_SPARSITY, sparsity_at


def _check_sparsity(name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(f"{name} must be a non-empty list of sparsities in [0, 1), got {value!r}")
    for s in value:
        check_number(f"{name} entry", s, low=0.0, high=1.0, high_open=True)


class DGCMomentum(ScaleOptimizer):
    r"""Deep Gradient Compression (Lin et al., ICLR 2018) momentum SGD over ``torch.distributed``.

    Per worker and step, for each tensor with gradient :math:`g` (after weight decay, L2
    :math:`g+\lambda w` or L1 :math:`g+\lambda\,\mathrm{sign}(w)`, and local clipping to
    ``local_grad_clip_norm`` :math:`\cdot N^{-1/2}`):

    .. math::
        \begin{aligned}
        u &\leftarrow m u + g,\qquad v \leftarrow v + u
            \qquad(\text{Nesterov: } u \leftarrow m(u + g),\ v \leftarrow v + u + g)\\
        S &= \text{the } k = \lceil (1-s)\,n \rceil \text{ entries of largest } |v|\\
        G &= \frac1N \sum_{\text{ranks}} v_S \quad(\text{one all-gather of exactly } k
            \text{ (index, value) pairs per tensor})\\
        v_S &\leftarrow 0,\quad u_S \leftarrow 0 \ (\text{momentum factor masking}),\qquad
        w \leftarrow w - \eta\, G
        \end{aligned}

    Before ``rampup_begin_step`` every tensor is dense: its gradient is all-reduced and
    :math:`u \leftarrow m u + \bar g,\ w \leftarrow w - \eta u` (Nesterov:
    :math:`w \leftarrow w - \eta(\bar g + m u)`), i.e. Paddle's ``Momentum``. After it the
    sparsity :math:`s` walks ``sparsity`` over ``rampup_step`` steps with Paddle's index
    ``int((t - begin) * len(sparsity) / rampup_step)``, then its last entry holds. Tensors with
    fewer than ``min_numel`` elements, and tensors for which the sparse all-gather would move more
    bytes than a dense all-reduce at this world size and density, stay dense.

    Args:
        params: tensors, ``(name, tensor)`` pairs or param-group dicts.
        lr (float): :math:`\eta`.
        momentum (float, default 0.9): :math:`m`.
        nesterov (bool, default False).
        weight_decay (float, default 0), weight_decay_mode (``"l2"`` or ``"l1"``).
        sparsity (sequence of floats, default the paper's 0.75, 0.9375, 0.984375, 0.996, 0.999).
        rampup_begin_step (int, default 0), rampup_step (int, default 1).
        local_grad_clip_norm (float or None, default None): clip threshold before scaling by
            :math:`N^{-1/2}`; ``clip_mode`` ``"tensor"`` (Paddle: each tensor by its own norm)
            or ``"global"`` (the paper: the norm over all gradients of the group).
        min_numel (int, default 16384): smaller tensors stay dense.
        momentum_masking (bool, default True): clear the sent entries of :math:`u` too.
        selection (``"sample"`` or ``"topk"``, default ``"sample"``): threshold estimated from
            a ~1% sample then refined (exact top-k of the candidates), or ``torch.topk``.
        value_dtype (torch.dtype or None, default None): dtype of the values sent (float16,
            bfloat16 or float32; None: the gradient's; ``torch.int8``: each tensor's k values
            rounded to 127 levels of their largest magnitude, that float32 scale sent with
            them). The rounding error stays in :math:`v`.
        process_group (default None: the default group, or no communication when
            ``torch.distributed`` is not initialized).
        mesh (DeviceMesh or None, default None): for sharded parameters, a 2-D
            ``(replicate, shard)`` mesh on whose shard dimension the model is
            ``fully_shard``-ed: DGC then compresses the exchange between the replicas, over the
            replicate dimension, each rank sending the top-k of its local shard (HSDP with a
            sparse replica exchange; see :doc:`/dgc`). Parameters sharded with no replicas are
            refused: there is nothing to compress.
        num_workers (int or None, default None): the :math:`N` of the clipping threshold
            (default: the process group's size; Paddle's ``num_trainers``).
        clip_grad_norm_per_tensor (float or None, default None): also clip each local gradient
            by its own norm, unscaled (Paddle's ``grad_clip=ClipGradByNorm(c)``).
        nonfinite (``"propagate"`` or ``"skip"``, default ``"propagate"``): what a step does
            with an inf/NaN gradient (see :doc:`/robustness`): let it flow into the update, as
            torch's optimizers do, or skip the whole step, counted in ``skipped_steps``.
        foreach, fused (None or False, default None): accepted as :mod:`torch.optim` trainers
            pass them; the update is one tensor at a time (each tensor's selection is its
            own), so ``True`` for either is an error.

    ``opt.telemetry`` holds, for the last step, host-side counts (no device sync):
    ``bytes_sent``, the bytes this rank puts on the wire (``(N-1) * k * (index + value bytes)``
    for the all-gather, ``2(N-1)/N`` of the values for a ring all-reduce of the dense tensors)
    against ``dense_bytes``, a ring all-reduce of every gradient; ``payload_bytes``, this rank's
    message (its k pairs per sparse tensor, the values of the dense ones) against
    ``dense_payload_bytes``, the gradient itself (the DGC paper's "gradient size"); the bytes
    gathered by all ranks, ``bytes_gathered`` (``N * k * (index + value bytes)``); the achieved
    ``density``; the selection time ``selection_s``; and, counted from the buffers actually
    handed to the collectives rather than from k, ``buffer_bytes`` and
    ``bytes_sent_measured`` (what a ring all-gather and all-reduce put on the wire for them).

    Example:
        >>> model = torch.nn.Linear(200, 100, bias=False)
        >>> opt = DGCMomentum(model.parameters(), lr=0.1, min_numel=1000, sparsity=[0.99])
        >>> model(torch.randn(8, 200)).square().mean().backward()
        >>> opt.step(); round(opt.telemetry["density"], 3)
        0.01
    """

    _state_spec = StateSpec("dgc", ("step", "u", "v"), ("u", "v"))
    _multi_tensor = False

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        sparsity: Sequence[float] = PAPER_SPARSITY,
        rampup_begin_step: int = 0,
        rampup_step: int = 1,
        local_grad_clip_norm: Optional[float] = None,
        min_numel: int = 16384,
        *,
        weight_decay_mode: str = "l2",
        clip_mode: str = "tensor",
        momentum_masking: bool = True,
        selection: str = "sample",
        value_dtype: Optional[torch.dtype] = None,
        process_group: Optional[Any] = None,
        num_workers: Optional[int] = None,
        clip_grad_norm_per_tensor: Optional[float] = None,
        nonfinite: str = "propagate",
        mesh: Optional[Any] = None,
        foreach: Optional[bool] = None, fused: Optional[bool] = None,
    ) -> None:
        self.mesh = replicas.check_mesh(mesh, process_group)
        if self.mesh is not None:
            process_group = self.mesh.get_group(0)
        if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(
                num_workers, int) or num_workers < 1):
            raise ValueError(f"Invalid num_workers: {num_workers!r} (a positive int or None)")
        self.num_workers = num_workers
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode, sparsity=list(sparsity) if isinstance(
                sparsity, (list, tuple)) else sparsity,
            rampup_begin_step=rampup_begin_step, rampup_step=rampup_step,
            local_grad_clip_norm=local_grad_clip_norm, clip_mode=clip_mode,
            min_numel=min_numel, momentum_masking=momentum_masking, selection=selection,
            clip_grad_norm_per_tensor=clip_grad_norm_per_tensor, foreach=foreach, fused=fused)
        if value_dtype not in (None, torch.float16, torch.bfloat16, torch.float32, torch.int8):
            raise ValueError(f"Invalid value_dtype: {value_dtype!r} (float16, bfloat16, float32, "
                             f"int8 or None)")
        self.value_dtype = value_dtype
        self.process_group = process_group
        self.dgc_step = 0
        self.telemetry: Dict[str, float] = {}
        self._generator = torch.Generator().manual_seed(0)
        super().__init__(params, defaults, nonfinite=nonfinite)
        self._world_at_init = comm.world_of(process_group)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        if self.mesh is not None:
            replicas.check_params(group["params"], self.mesh)
        elif any_dtensor(group["params"]):
            raise TypeError(replicas.SHARDED_ERROR)
        super()._validate_group(group)
        check_number("momentum", group["momentum"], low=0.0, high=1.0, high_open=True)
        check_bool("nesterov", group["nesterov"])
        check_number("weight_decay", group["weight_decay"])
        check_choice("weight_decay_mode", group["weight_decay_mode"], ("l2", "l1"))
        _check_sparsity("sparsity", group["sparsity"])
        for key in ("rampup_begin_step", "rampup_step", "min_numel"):
            v = group[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "rampup_step" else 0):
                raise ValueError(f"Invalid {key}: {v!r} (an int >= {1 if key == 'rampup_step' else 0})")
        check_number("local_grad_clip_norm", group["local_grad_clip_norm"], low=0.0,
                     low_open=True, allow_none=True)
        check_choice("clip_mode", group["clip_mode"], ("tensor", "global"))
        check_number("clip_grad_norm_per_tensor", group["clip_grad_norm_per_tensor"], low=0.0,
                     low_open=True, allow_none=True)
        check_bool("momentum_masking", group["momentum_masking"])
        check_choice("selection", group["selection"], ("sample", "topk"))
        if group["nesterov"] and group["momentum"] == 0:
            raise ValueError("nesterov=True needs momentum > 0")

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["dgc_step"] = self.dgc_step
        sd["world_size"] = comm.world_of(self.process_group)
        if self.mesh is not None:
            sd["mesh_shape"] = replicas.layout(self.mesh)
        sd["dgc_generator"] = self._generator.get_state()  # the threshold's samples
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict of this rank; one saved by another number of workers or on another
        mesh loads with its residuals (u, v: they belong to the old workers' data and shards)
        reset to zero, with a warning."""
        moved = self._layout_change(state_dict) if isinstance(state_dict, dict) else None
        if moved:
            state_dict = self._residuals_reset(state_dict)
        super().load_state_dict(state_dict)
        self.dgc_step = int(state_dict.get("dgc_step", 0))
        if "dgc_generator" in state_dict:
            self._generator.set_state(state_dict["dgc_generator"])
        if moved:
            warnings.warn(f"{moved}: the residuals (u, v) belong to the old workers and are "
                          f"reset", stacklevel=2)

    def _residuals_reset(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """``state_dict`` with each parameter's u and v zeros shaped like its state here."""
        ids = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
        params = [p for g in self.param_groups for p in g["params"]]
        state = dict(state_dict["state"])
        for i, p in zip(ids, params):
            st = state.get(i)
            if isinstance(st, dict) and ("u" in st or "v" in st):
                zeros = torch.zeros(self._state_shape(p), dtype=p.dtype)
                state[i] = dict(st, u=zeros, v=zeros.clone())
        return dict(state_dict, state=state)

    def _layout_change(self, state_dict: Dict[str, Any]) -> Optional[str]:
        """How the workers of ``state_dict`` differ from this optimizer's (None: they do not)."""
        saved, now = state_dict.get("world_size"), comm.world_of(self.process_group)
        if saved is not None and saved != now:
            return f"DGCMomentum checkpoint from {saved} workers loaded with {now}"
        layout, here = state_dict.get("mesh_shape"), replicas.layout(self.mesh)
        if layout is not None and list(layout) != here:
            return (f"DGCMomentum checkpoint from a {tuple(layout)} (replicate, shard) mesh "
                    f"loaded on {'a ' + str(tuple(here)) + ' one' if here else 'no mesh'}")
        return None

    def _state_shape(self, p: Tensor):
        """DGC's state is each rank's own: shaped like the local shard of a sharded parameter."""
        return tuple(local_piece(p).shape)

    # -- the step ------------------------------------------------------------------------------

    def _local_grads(self, group, params) -> List[Tensor]:
        """Each parameter's local gradient (its shard's, for sharded parameters) after decay
        and clipping; the norms of clipping are those of whole tensors."""
        world = self.num_workers or comm.world_of(self.process_group)
        grads = []
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError("DGCMomentum does not support sparse gradients")
            grads.append(local_piece(p.grad) if p.grad is not None  # unused here only: zero
                         else torch.zeros_like(local_piece(p)))
        norms = replicas.whole_norms(self.mesh)
        grads = local_gradients(grads, [local_piece(p) for p in params], group, world,
                                group["clip_mode"], norms)
        c = group["clip_grad_norm_per_tensor"]
        if c is not None:
            grads = [g * (c / max(n, c)) for g, n in zip(grads, norms(grads))]
        return grads

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One step: select, communicate, update. ``closure`` re-evaluates the loss."""
        loss = self._closure_loss(closure)
        self._refresh_hyperparameters()
        world = comm.world_of(self.process_group)
        tel = new_telemetry()
        # a parameter unused on this rank but used on another takes part with a zero gradient,
        # so that every rank sends the same tensors; one unused everywhere is skipped (the flags
        # of all groups in one all-reduce)
        every = [p for group in self.param_groups for p in group["params"]]
        device = every[0].device if every else torch.device("cpu")
        if self.nonfinite == "skip" and comm.any_rank(  # with a mesh: over all its ranks
                [any(p.grad is not None and any_nonfinite(p.grad) for p in every)],
                None if self.mesh is not None else self.process_group, device)[0]:
            self.skipped_steps += 1  # on every rank: nothing moves, residuals included
            return loss
        used = iter(comm.any_rank([p.grad is not None for p in every], self.process_group,
                                  device))
        for group in self.param_groups:
            params = [p for p in group["params"] if next(used)]
            if not params:
                continue
            grads = self._local_grads(group, params)
            states = []
            for p in params:
                st = self.state[p]
                if "u" not in st:
                    piece = local_piece(p.detach())
                    st["u"] = torch.zeros_like(piece, memory_format=torch.contiguous_format)
                    st["v"] = torch.zeros_like(piece, memory_format=torch.contiguous_format)
                    st.setdefault("step", torch.tensor(0.0))
                st["step"] += 1
                states.append(st)
            updates = dgc_updates(grads, states, group, self.dgc_step, world, self.process_group,
                                  self.value_dtype, self._generator, tel,
                                  [p.numel() for p in params])
            for p, upd in zip(params, updates):
                piece = local_piece(p)
                piece.add_(upd.view_as(piece).to(p.dtype), alpha=-lr_number(group))
        self.dgc_step += 1
        finish_telemetry(tel)
        self.telemetry = tel
        return loss


def new_telemetry() -> Dict[str, float]:
    return dict(bytes_sent=0, dense_bytes=0, bytes_gathered=0, payload_bytes=0,
                dense_payload_bytes=0, selected=0, numel=0, selection_s=0.0,
                buffer_bytes=0, bytes_sent_measured=0.0)


def finish_telemetry(tel: Dict[str, float]) -> None:
    tel["density"] = tel["selected"] / max(tel["numel"], 1)


def _is_dense(opts, world: int, numel: int, k: int, pair: float, gbytes: int,
              whole: int) -> bool:
    """Whether a tensor of ``numel`` local elements (``whole`` in the whole parameter: the
    size threshold never depends on the sharding) goes dense: ``pair``, the bytes of a sent
    (index, value) pair; ``gbytes``, those of a gradient element (what the all-reduce sends)."""
    if whole < opts["min_numel"]:
        return True
    if world <= 1:
        return False
    # ring all-reduce: about 2(N-1)/N * n gradient elements per rank; all-gather: (N-1) k pairs
    return (world - 1) * k * pair >= 2 * (world - 1) / world * numel * gbytes


def local_gradients(grads: List[Tensor], params: List[Tensor], options: Dict[str, Any],
                    world: int, clip_mode: str = "tensor",
                    norms: Optional[Callable[[List[Tensor]], List[float]]] = None) -> List[Tensor]:
    """Paddle's local gradients: the decay added (``weight_decay * w`` for ``"l2"``,
    ``weight_decay * sign(w)`` for ``"l1"``), then ``local_grad_clip_norm`` scaled by
    ``world ** -0.5``, per tensor (``clip_mode="tensor"``) or over all of them (``"global"``).
    ``norms`` gives the tensors' norms (default: of the tensors given; for shards, of the
    whole tensors)."""
    wd = options["weight_decay"]
    if wd:
        l2 = options["weight_decay_mode"] == "l2"
        grads = [g + wd * (p.detach() if l2 else p.detach().sign()).view_as(g)
                 for g, p in zip(grads, params)]
    clip = options["local_grad_clip_norm"]
    if clip is None or not grads:
        return grads
    c = clip * world ** -0.5
    each = (norms or replicas.whole_norms(None))(grads)
    if clip_mode == "tensor":
        return [g * (c / max(n, c)) for g, n in zip(grads, each)]
    total = math.sqrt(sum(n ** 2 for n in each))
    return [g * (c / max(total, c)) for g in grads]


def _dense_and_sparse(grads: List[Tensor], opts: Dict[str, Any], s: Optional[float], world: int,
                      value_dtype, tel: Dict[str, float], wholes: Sequence[int]):
    """Which tensors go dense (positions) and which sparse (``(position, k, index dtype, value
    dtype, bytes per pair)``) at sparsity ``s`` (None: all dense); counts the dense baseline."""
    dense, sparse = [], []
    for j, g in enumerate(grads):
        numel = g.numel()
        vdt = value_dtype or g.dtype
        idt = comm.index_dtype(numel)
        k = numel if s is None else select.k_of(numel, s)
        allreduce_bytes = int(2 * (world - 1) / max(world, 1) * numel * g.element_size())
        tel["dense_bytes"] += allreduce_bytes
        tel["dense_payload_bytes"] += numel * g.element_size()
        tel["numel"] += numel
        pair = vdt.itemsize + idt.itemsize + comm.SCALE_BYTES * (vdt == torch.int8) / max(k, 1)
        if s is None or _is_dense(opts, world, numel, k, pair, g.element_size(), wholes[j]):
            dense.append(j)
            tel["bytes_sent"] += allreduce_bytes
            tel["payload_bytes"] += numel * g.element_size()
            tel["selected"] += numel
        else:
            sparse.append((j, k, idt, vdt, vdt.itemsize + idt.itemsize))
    return dense, sparse


def _momentum_and_selection(grads, states, sparse, opts, generator):
    """For each sparse tensor: momentum correction into ``u``, accumulation into ``v``, and the
    ``k`` largest entries of ``v`` (indices and values, in the dtypes to send)."""
    m, nesterov = opts["momentum"], opts["nesterov"]
    indices, values = [], []
    for j, k, idt, vdt, _ in sparse:
        g, u, v = grads[j], states[j]["u"], states[j]["v"]
        g = g.view_as(u)
        if nesterov:
            u.add_(g).mul_(m)
            v.add_(u).add_(g)
        else:
            u.mul_(m).add_(g)
            v.add_(u)
        flat = v.view(-1)
        if opts["selection"] == "topk":
            idx = select.topk_exact(flat, k)
        else:
            idx = select.topk_sampled(flat, k, generator=generator)
        indices.append(idx.to(idt))
        values.append(comm.encode(flat[idx], vdt))
    return indices, values


@eager  # selection and communication: host logic, nothing to trace
def dgc_updates(grads: List[Tensor], states: List[Dict[str, Tensor]], opts: Dict[str, Any],
                step: int, world: int, process_group, value_dtype, generator,
                tel: Dict[str, float], wholes: Optional[Sequence[int]] = None) -> List[Tensor]:
    """DGC for one set of tensors at step ``step``: momentum correction, selection, one
    all-gather for the sparse tensors and one all-reduce for the dense ones. Updates each
    state's ``u``/``v`` and returns, per tensor, the update ``U`` of ``w -= lr * U``: the mean of
    the gathered values for a sparse tensor, the momentum step for a dense one. ``opts`` holds
    the group's options (momentum, nesterov, sparsity schedule, min_numel, masking, selection);
    ``wholes``, the whole parameters' sizes where ``grads`` are shards (for ``min_numel``)."""
    s = sparsity_at(step, opts["rampup_begin_step"], opts["rampup_step"], opts["sparsity"])
    m, nesterov = opts["momentum"], opts["nesterov"]
    updates: List[Optional[Tensor]] = [None] * len(grads)
    dense, sparse = _dense_and_sparse(grads, opts, s, world, value_dtype, tel,
                                      wholes or [g.numel() for g in grads])
    # dense tensors: all-reduce, then momentum SGD on the mean gradient
    for j, g in zip(dense, comm.dense_allreduce_mean([grads[j] for j in dense], process_group,
                                                     tel)):
        u = states[j]["u"]
        u.mul_(m).add_(g.view_as(u))
        updates[j] = g.view_as(u).add(u, alpha=m) if nesterov else u.clone()
    if sparse:
        t0 = time.perf_counter()
        indices, values = _momentum_and_selection(grads, states, sparse, opts, generator)
        tel["selection_s"] += time.perf_counter() - t0
        means = comm.sparse_allgather_mean(indices, values, [grads[j].numel() for j, *_ in sparse],
                                           process_group, tel)
        for (j, k, idt, vdt, pair), idx, val, G in zip(sparse, indices, values, means):
            st = states[j]
            idx = idx.long()
            # what was sent leaves the residual (a rounding error of a low-precision value stays)
            st["v"].view(-1).index_add_(0, idx, comm.decode(val).to(st["v"].dtype), alpha=-1)
            if opts["momentum_masking"]:
                st["u"].view(-1)[idx] = 0
            updates[j] = G
            pairs = k * pair + comm.SCALE_BYTES * (vdt == torch.int8)
            tel["bytes_sent"] += pairs * max(world - 1, 0)
            tel["bytes_gathered"] += world * pairs
            tel["payload_bytes"] += pairs
            tel["selected"] += k
    return updates  # type: ignore[return-value]
