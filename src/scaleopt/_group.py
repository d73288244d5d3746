"""What one param group's update works on, by name: its tensors (:class:`GroupTensors`), the
per-tensor options of the layer-wise optimizers (:class:`TensorOptions`) and their group options
(:class:`GroupOptions`). Named tuples and a plain dataclass: ``torch.compile`` traces them.

Every implementation of LAMB and LANS (``lamb._IMPLEMENTATIONS``, ``lans._IMPLEMENTATIONS``) is
one function of these three that returns an :class:`Update`: the update in the phases of a step,
which the optimizer's ``step`` calls in order for all its groups.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence

import torch
from torch import Tensor

from ._intake import GradScalars, apply_grad_scalars
from ._sharding import Reduction, ShardSums


#: a tensor's dtype (``map(_DTYPE, tensors)``: one pass in C)
_DTYPE = operator.attrgetter("dtype")
#: the gradient types the kernels take as they are
_PLAIN = {Tensor, torch.nn.Parameter}


def pick(xs: Sequence[Any], idx: Sequence[int]) -> List[Any]:
    return [xs[i] for i in idx]


def functional_tensors(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor],
                       exp_avg_sqs: List[Tensor], steps: List[Tensor],
                       w16: Optional[List[Optional[Tensor]]], grad_multipliers: Any,
                       sharded_as: Optional[Sequence[Tensor]],
                       grad_norms: Optional[Tensor] = None) -> "GroupTensors":
    """The :class:`GroupTensors` of the functional forms' arguments (public types): the
    multipliers as the gradients' deferred scalars, and for local shards what totals their
    sums over the DTensors ``sharded_as``."""
    scalars = None
    if grad_multipliers is not None:
        device = grads[0].device if grads else None
        scalars = GradScalars(torch.as_tensor(grad_multipliers, dtype=torch.float64)
                              .reshape(-1).to(device), None)
        if scalars.mults.numel() != len(grads):
            raise ValueError(f"grad_multipliers: {scalars.mults.numel()} numbers for "
                             f"{len(grads)} gradients")
    if sharded_as is not None and len(sharded_as) != len(params):
        raise ValueError(f"sharded_as: {len(sharded_as)} tensors for {len(params)} parameters")
    return GroupTensors(params, grads, exp_avgs, exp_avg_sqs, steps, w16, scalars,
                        None if sharded_as is None else ShardSums(sharded_as), grad_norms)


def w16_argument(w16: Optional[List[Optional[Tensor]]],
                 low: Optional[List[Optional[Tensor]]]) -> Optional[List[Optional[Tensor]]]:
    """The functional forms' ``w16``, or ``low``, its former name (a ``FutureWarning``)."""
    if low is None:
        return w16
    if w16 is not None:
        raise TypeError("give w16= (the kernels' 16-bit tensors) once: low= is its former name")
    warnings.warn("low= is now w16= (the kernels' 16-bit tensor per weight, as the kernels, "
                  "the Triton path and the docs name it)", FutureWarning, stacklevel=3)
    return low


@dataclasses.dataclass
class GroupTensors:
    """One group's tensors for its update (the local shards of sharded ones)."""

    #: the tensors the update writes: float32 masters, split masters' upper halves (bfloat16),
    #: or the parameters themselves
    weights: List[Tensor]
    #: read, never written
    grads: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    #: the step counters (float32 CPU scalars), incremented by the update
    steps: List[Tensor]
    #: per tensor, the kernels' second tensor, or None: a split master's lower halves (int16,
    #: with a bfloat16 weight), or where the rounded weights of a float32 master go (bfloat16)
    w16: Optional[List[Optional[Tensor]]] = None
    #: the gradients' deferred scalars (``scaleopt._intake``), to apply as they are read
    grad_scalars: Optional[GradScalars] = None
    #: for local shards: what totals their sums over the shards (``scaleopt._sharding``)
    shard_sums: Optional[ShardSums] = None
    #: the gradients' whole norms, where the intake's clipping computed them
    grad_norms: Optional[Tensor] = None
    #: a flag on the device (a GradScaler's ``found_inf``): when nonzero, the update changes
    #: nothing and the step counters go back (the Triton kernels, with ``capturable``)
    skip_if: Optional[Tensor] = None
    #: per tensor, how its moments are stored where in bfloat16 or 8 bits (a
    #: ``_format.Stored``; ``exp_avgs``/``exp_avg_sqs`` are then the stored tensors, which
    #: only the C kernels take), else None
    stored: Optional[List[Any]] = None
    #: what the fused kernels keep from one step to the next for these tensors (the tables
    #: of their addresses, say): a dict the group's plan owns, made anew with the plan (when
    #: anything the tensors are made of changed), or None (nothing kept)
    cache: Optional[Dict[str, Any]] = None

    def for_torch(self) -> "GroupTensors":
        """The tensors as the PyTorch implementations take them: the gradients with their
        deferred scalars applied and in the weights' dtypes, and no kernel ``w16`` tensors."""
        grads = apply_grad_scalars(self.grads, self.grad_scalars)
        grads = [g if g.dtype == w.dtype else g.to(w.dtype) for g, w in zip(grads, self.weights)]
        return dataclasses.replace(self, grads=grads, w16=None, grad_scalars=None, cache=None)


class TensorOptions(NamedTuple):
    """Per tensor of a group (one entry each): learning rate, weight decay, and whether it
    takes the trust ratio. The group's own options are :class:`GroupOptions`."""

    lrs: Sequence[float]
    weight_decays: Sequence[float]
    adapt: Sequence[bool]


class GroupOptions(NamedTuple):
    """A LAMB or LANS group's options (one value for all its tensors; the per-tensor ones are
    :class:`TensorOptions`). Each optimizer reads its own of the last three:
    ``weight_decay_mode`` is LAMB's; ``clip_grad_value`` (of the normalised gradient) and
    ``decay_moved_weight`` are LANS's."""

    beta1: float
    beta2: float
    eps: float
    bias_correction: bool = True
    lower_bound: Optional[float] = None
    upper_bound: Optional[float] = None
    #: where the decay enters: "update", "decoupled" or "l2"
    weight_decay_mode: str = "update"
    #: element-wise clipping of the normalised gradient: None, a bound or a (min, max) pair
    clip_grad_value: Any = None
    #: the second part decays the weight moved by the first (MXNet's ``LANS.step()``)
    decay_moved_weight: bool = False
    #: the step counters are on the device and the learning rates may be device tensors: the
    #: step reads both there (the Triton kernels), so that it can be captured in a CUDA graph
    capturable: bool = False

    @classmethod
    def of(cls, group: Dict[str, Any], **own: Any) -> "GroupOptions":
        """The options a param group holds, with the optimizer's ``own`` ones."""
        beta1, beta2 = group["betas"]
        return cls(beta1, beta2, group["eps"], group["bias_correction"], group["lower_bound"],
                   group["upper_bound"], capturable=group.get("capturable", False), **own)


class Update(Protocol):
    """One group's update in the phases of a step. The optimizer calls, for all its groups in
    turn, :meth:`grad_sums`, then :meth:`sums` with those totals, then :meth:`apply` with the
    totals of those; between two phases, the sums every group asks for (on the local shards of
    sharded tensors) are totalled in one all-reduce (``scaleopt._sharding.total``). On whole
    tensors no phase asks for anything and nothing is reduced."""

    def grad_sums(self) -> Optional[Reduction]:
        """LANS: the gradients' sums of squares to total, where nothing gave their norms."""

    def sums(self, grad_totals: Optional[Tensor] = None) -> Optional[Reduction]:
        """The work before the trust ratios, and their sums to total."""

    def apply(self, totals: Optional[Tensor]) -> None:
        """The rest of the update, on the totals (None where nothing was asked)."""


class WholeUpdate:
    """An :class:`Update` that asks for no sums (a reference loop over whole tensors): all of
    it runs in :meth:`apply`."""

    def __init__(self, update: Callable[..., None], t: GroupTensors, layer: TensorOptions,
                 o: GroupOptions) -> None:
        self.update, self.args = update, (t, layer, o)

    def grad_sums(self) -> None:
        return None

    def sums(self, grad_totals: Optional[Tensor] = None) -> None:
        return None

    def apply(self, totals: Optional[Tensor]) -> None:
        self.update(*self.args)
