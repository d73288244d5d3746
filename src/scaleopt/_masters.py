"""Master weights: where each parameter's float32 master lives and how the update reaches it.

A parameter's master is stored in one of three ways (:class:`Storage`):

* ``OWN``: the parameter is its own master (a float32 parameter, or no master weights);
* ``COPY``: a float32 tensor, ``state["master_param"]``;
* ``SPLIT``: the float32 value held in two halves: a bfloat16 tensor with its upper 16 bits
  (rounded to nearest: the parameter itself, or its host copy) and ``state["master_lo"]``
  (int16) with its lower 16 bits. The same value as a float32 master in 2 extra bytes per
  parameter instead of 4; the fused kernels read and write it in place.

:class:`MasterWeights` owns those state entries for one optimizer: it gives the tensors an
update runs on (:meth:`MasterWeights.view`), joins and re-splits them for the PyTorch paths
(:meth:`MasterWeights.joined`, :meth:`MasterWeights.split_back`), commits the result to the
parameters (:meth:`MasterWeights.commit`), and converts checkpoints through the optimizer's state-dict
hooks: a state dict always holds a float32 ``master_param``, and loading one keeps the saved
float32 values (torch's loader would round them to the parameter's dtype) and splits them where
this optimizer splits. A :class:`Placement` says where masters live: beside their parameters
(:class:`LocalPlacement`) or in host memory (``scaleopt._host.HostPipeline``).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import sys
from typing import Any, Dict, Iterator, List, Optional, Protocol, Union

import torch
from torch import Tensor

from . import _native, _triton
from ._sharding import is_dtensor, like, local_piece

LOW_PRECISION = (torch.float16, torch.bfloat16)


def plain(p: Tensor) -> bool:
    """Not a tensor subclass (e.g. a DTensor, whose local shard is not its shape): what a split
    master's halves can be made for."""
    return type(p) in (torch.Tensor, torch.nn.Parameter)


def split_join(hi: Tensor, lo: Tensor) -> Tensor:
    """The float32 master held as a bfloat16 ``hi`` (the master rounded to nearest, ties away
    from zero) and int16 ``lo`` (its low 16 bits), as the kernels store it (see ``csrc/base.h``).

    In 16-bit pieces (a float32's two halves in memory, little-endian): the low half is ``lo``,
    the high half ``hi`` less the carry that rounding added (1 where ``lo``'s top bit is set),
    so the only temporaries are 16-bit and 8-bit ones, not wider integers."""
    if sys.byteorder != "little":
        return _split_join_wide(hi, lo)
    out = torch.empty(hi.shape, dtype=torch.float32, device=hi.device)
    halves = out.reshape(-1).view(torch.int16).view(-1, 2)
    low = lo.reshape(-1)
    halves[:, 0] = low
    torch.sub(hi.reshape(-1).view(torch.int16), low.lt(0).to(torch.int16), out=halves[:, 1])
    return out


def split_(master: Tensor, hi: Tensor, lo: Tensor) -> None:
    """Store a float32 ``master`` exactly as ``hi`` and ``lo`` (the inverse of :func:`split_join`):
    ``lo`` its low half, ``hi`` its high half plus the carry of rounding to nearest (ties away
    from zero: 1 where the low half's top bit is set), in 16-bit pieces."""
    if sys.byteorder != "little":
        return _split_wide(master, hi, lo)
    halves = master.contiguous().reshape(-1).view(torch.int16).view(-1, 2)
    low = halves[:, 0]
    lo.copy_(low.view(lo.shape))
    top = halves[:, 1] + low.lt(0).to(torch.int16)
    hi.copy_(top.view(torch.bfloat16).view(hi.shape))


def _split_join_wide(hi: Tensor, lo: Tensor) -> Tensor:
    """:func:`split_join` in 64-bit integers (any byte order)."""
    h = hi.view(torch.int16).to(torch.int32) & 0xFFFF
    low = lo.to(torch.int32) & 0xFFFF
    top = (h - (low >> 15)) & 0xFFFF
    bits = (top.to(torch.int64) << 16) | low.to(torch.int64)
    bits = bits - (bits >= 2 ** 31).to(torch.int64) * 2 ** 32
    return bits.to(torch.int32).view(torch.float32)


def _split_wide(master: Tensor, hi: Tensor, lo: Tensor) -> None:
    """:func:`split_` in 64-bit integers (any byte order)."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    top = ((bits + 0x8000) >> 16) & 0xFFFF
    low = bits & 0xFFFF
    hi.copy_((top - (top >= 2 ** 15).to(torch.int64) * 2 ** 16).to(torch.int16).view(torch.bfloat16))
    lo.copy_((low - (low >= 2 ** 15).to(torch.int64) * 2 ** 16).to(torch.int16))


class Storage(enum.Enum):
    OWN = "own"
    COPY = "copy"
    SPLIT = "split"


class Placement(Protocol):
    """Where the masters of an optimizer live, and how the parameters get their values."""

    def storage(self, group: Dict[str, Any], p: Tensor) -> Storage:
        """How a new master of ``p`` is to be stored."""

    def new_copy(self, p: Tensor) -> Tensor:
        """A new float32 master equal to ``p``."""

    def upper(self, p: Tensor) -> Tensor:
        """The bfloat16 tensor holding the upper halves of ``p``'s split master."""

    def lower_halves(self, p: Tensor) -> Tensor:
        """Zero lower halves (int16) for a new split master of ``p``, where the kernels that
        update it read them."""

    def rounded_target(self, p: Tensor) -> Optional[Tensor]:
        """Where the fused kernels may write the rounded weights of a ``COPY`` master."""

    def load_float32(self, p: Tensor, value: Tensor) -> Tensor:
        """A checkpoint's ``value`` (master or moment of ``p``) as this placement keeps it."""

    def keeps_float32(self, p: Tensor, saved: Dict[str, Any]) -> bool:
        """Whether ``p``'s saved state is to be loaded in float32 (not in ``p``'s dtype)."""

    def copy_back(self, pairs: List[tuple]) -> None:
        """Give each parameter of ``(parameter, source)`` the source's values."""


def _kernels_take_split(group: Dict[str, Any], p: Tensor) -> bool:
    """Whether kernels that read split masters in place run ``p``'s group: the C kernels on the
    CPU, the Triton kernels on CUDA, or either asked for by the group's ``implementation``."""
    asked = group.get("implementation")
    if asked is not None:
        return asked == "triton" or (asked == "native" and p.device.type == "cpu")
    if not _native.kernels_allowed(group):
        return False
    if p.device.type == "cpu":
        return _native.available()
    return p.device.type == "cuda" and _triton.available()


class LocalPlacement:
    """Masters beside their parameters, on the same device. A float16/bfloat16 parameter has a
    master when its group says ``master_weights``; it is split where kernels that read split
    masters run (a contiguous bfloat16 parameter, or a DTensor whose local shard is one: the C
    kernels on the CPU, the Triton kernels on CUDA), a float32 copy elsewhere."""

    def storage(self, group: Dict[str, Any], p: Tensor) -> Storage:
        if not group.get("master_weights") or p.dtype not in LOW_PRECISION:
            return Storage.OWN
        if (p.dtype == torch.bfloat16 and local_piece(p).is_contiguous()
                and _kernels_take_split(group, p)):
            return Storage.SPLIT
        return Storage.COPY

    def new_copy(self, p: Tensor) -> Tensor:
        return p.detach().to(torch.float32, copy=True)

    def upper(self, p: Tensor) -> Tensor:
        return p

    def lower_halves(self, p: Tensor) -> Tensor:
        """On ``p``'s device, laid out as ``p`` (a DTensor's are a DTensor)."""
        if is_dtensor(p):
            return torch.zeros_like(p, dtype=torch.int16)
        return torch.zeros(p.shape, dtype=torch.int16, device=p.device)

    def rounded_target(self, p: Tensor) -> Optional[Tensor]:
        return p

    def load_float32(self, p: Tensor, value: Tensor) -> Tensor:
        return value.to(device=p.device, dtype=torch.float32, copy=True)

    def keeps_float32(self, p: Tensor, saved: Dict[str, Any]) -> bool:
        return "master_param" in saved and p.dtype in LOW_PRECISION

    def copy_back(self, pairs: List[tuple]) -> None:
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [src for _, src in pairs])


@dataclasses.dataclass
class MasterView:
    """One group's parameters as an update sees them."""

    params: List[Tensor]
    #: the tensors the update runs on: a float32 master, a split master's upper half, or the
    #: parameter itself
    weights: List[Tensor]
    #: per tensor: a split master's lower halves (int16), else None
    lower_halves: List[Optional[Tensor]]
    #: per tensor: where the fused kernels may write a ``COPY`` master's rounded weights in
    #: their pass (the parameter, or a staging buffer), else None
    rounded_into: List[Optional[Tensor]]

    @property
    def split(self) -> List[bool]:
        return [lo is not None for lo in self.lower_halves]

    def kernel_w16(self) -> List[Optional[Tensor]]:
        """The kernels' second tensor per weight (``w16``, 16 bits per element): the lower halves of a
        split master, or where the rounded weights of a float32 master go (made once per
        view: a step's view is given again while nothing changed, ``_adam._Memo``)."""
        w16 = self.__dict__.get("_kernel_w16")
        if w16 is None:
            w16 = self.__dict__["_kernel_w16"] = [
                lo if lo is not None else r for lo, r in zip(self.lower_halves, self.rounded_into)]
        return list(w16)

    def subset(self, indices: List[int]) -> "MasterView":
        return MasterView(*([xs[k] for k in indices] for xs in (
            self.params, self.weights, self.lower_halves, self.rounded_into)))


class MasterWeights:
    """The master weights of one optimizer (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer, placement: Placement) -> None:
        self.optimizer = optimizer
        self.placement = placement
        self._loading: Dict[int, Dict[str, Tensor]] = {}
        optimizer.register_state_dict_post_hook(self._joined_in_state_dict)
        optimizer.register_load_state_dict_pre_hook(self._keep_float32)
        optimizer.register_load_state_dict_post_hook(self._after_load)

    # -- the step --------------------------------------------------------------------------------

    def storage(self, group: Dict[str, Any], p: Tensor) -> Storage:
        """How ``p``'s master is stored: as its state holds it, else as the placement says."""
        state = self.optimizer.state[p]
        if "master_lo" in state:
            return Storage.SPLIT
        if "master_param" in state:
            return Storage.COPY
        return self.placement.storage(group, p)

    def view(self, group: Dict[str, Any], params: List[Tensor]) -> MasterView:
        """The tensors ``params``' update runs on (masters made equal to the parameters where
        new)."""
        view = MasterView(list(params), [], [], [])
        for p in params:
            kind = self.storage(group, p)
            state = self.optimizer.state[p]
            lower = rounded = None
            if kind is Storage.SPLIT:
                if "master_lo" not in state:
                    state["master_lo"] = self.placement.lower_halves(p)
                weight, lower = self.placement.upper(p), state["master_lo"]
            elif kind is Storage.COPY:
                if "master_param" not in state:
                    state["master_param"] = self.placement.new_copy(p)
                weight, rounded = state["master_param"], self.placement.rounded_target(p)
            else:
                weight = p
            view.weights.append(weight)
            view.lower_halves.append(lower)
            view.rounded_into.append(rounded)
        return view

    def joined(self, view: MasterView) -> List[Tensor]:
        """The view's working tensors with split masters joined into float32 tensors (the
        PyTorch paths run on these; :meth:`split_back` splits them again after)."""
        return [w if lo is None else split_join(local_piece(w).detach(), local_piece(lo))
                for w, lo in zip(view.weights, view.lower_halves)]

    def split_back(self, view: MasterView, full: List[Tensor]) -> None:
        """Split the float32 tensors that :meth:`joined` made into the split masters' halves."""
        for w, f, lo in zip(view.weights, full, view.lower_halves):
            if lo is not None:
                split_(f, local_piece(w).detach(), local_piece(lo))

    def commit(self, view: MasterView, rounded_written: Union[bool, List[bool]]) -> None:
        """Bring each parameter up to date with its master. ``rounded_written`` (for all
        tensors, or per tensor): the fused kernels wrote a ``COPY`` master's rounded weights
        into its ``rounded_into`` tensor."""
        if all(map(operator.is_, view.params, view.weights)):  # no masters: nothing to copy
            self.placement.copy_back([])
            return
        if isinstance(rounded_written, bool):
            rounded_written = [rounded_written] * len(view.params)
        pairs = []
        for p, w, into, written in zip(view.params, view.weights, view.rounded_into,
                                       rounded_written):
            if p is w:
                continue
            source = into if (written and into is not None) else w
            if source is not p:
                pairs.append((p, source))
        self.placement.copy_back(pairs)

    def master(self, p: Tensor) -> Tensor:
        """The float32 master weights of ``p``: a new tensor for a split master, the stored copy
        for a ``COPY`` master, ``p`` itself otherwise."""
        state = self.optimizer.state.get(p, {})
        if "master_lo" in state:
            upper, lower = self.placement.upper(p).detach(), state["master_lo"]
            return like(upper, split_join(local_piece(upper), local_piece(lower)))
        return state.get("master_param", p)

    # -- checkpoints -----------------------------------------------------------------------------

    def _params(self) -> Iterator[tuple]:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                yield group, p

    def _joined_in_state_dict(self, optimizer: Any, sd: Dict[str, Any]) -> Dict[str, Any]:
        """A state dict holds each split master as a float32 ``master_param``."""
        for index, (_, p) in enumerate(self._params()):
            st = sd["state"].get(index)
            if st is not None and "master_lo" in st:
                st = {k: v for k, v in st.items() if k != "master_lo"}
                st["master_param"] = self.master(p)
                sd["state"][index] = st
        return sd

    def _keep_float32(self, optimizer: Any, sd: Dict[str, Any]) -> None:
        """Before torch's loader casts the state to the parameters' dtypes: the float32 values
        to keep (masters and moments), by parameter."""
        self._loading = {}
        saved = [p for g in sd["param_groups"] for p in g["params"]]
        for pid, (_, p) in zip(saved, self._params()):
            st = sd["state"].get(pid, {})
            if self.placement.keeps_float32(p, st):
                self._loading[id(p)] = {
                    k: self.placement.load_float32(p, v) for k, v in st.items()
                    if k != "step" and torch.is_tensor(v) and v.is_floating_point()}

    def _after_load(self, optimizer: Any) -> None:
        loading, self._loading = self._loading, {}
        for group, p in self._params():
            st = self.optimizer.state.get(p)
            if not st:
                continue
            st.pop("master_lo", None)
            st.update(loading.get(id(p), {}))
            kind = self.placement.storage(group, p)
            if kind is Storage.OWN:
                st.pop("master_param", None)
            elif kind is Storage.SPLIT:
                master = st.pop("master_param", None)
                st["master_lo"] = self.placement.lower_halves(p)
                upper = self.placement.upper(p)
                if master is not None:
                    split_(local_piece(master), local_piece(upper).detach(),
                                   local_piece(st["master_lo"]))
                    if upper is not p:
                        p.detach().copy_(upper)
            elif "master_param" not in st:
                st["master_param"] = self.placement.new_copy(p)


class WithMasterWeights:
    """The master weights of an optimizer (a mixin before :class:`~scaleopt._base.ScaleOptimizer`):
    its :class:`MasterWeights`, made where the optimizer is set up (beside the parameters, by
    :meth:`_master_placement`; an offload's pipeline moves them to the host), and
    :meth:`master`."""

    def _master_placement(self) -> Placement:
        return LocalPlacement()

    def _attach(self) -> None:
        super()._attach()  # type: ignore[misc]
        self._master_weights = MasterWeights(self, self._master_placement())

    def master(self, p: Tensor) -> Tensor:
        """The float32 master weights of ``p``: a new tensor for a split master, the stored copy
        for another low-precision parameter with master weights, ``p`` itself otherwise."""
        return self._master_weights.master(p)
