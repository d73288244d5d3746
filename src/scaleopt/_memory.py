"""What an optimizer holds in memory between steps: :func:`state_bytes`."""

from __future__ import annotations

from typing import Any, Dict, Iterator, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ._sharding import is_dtensor, local_piece


class StateBytes(NamedTuple):
    """The bytes an optimizer holds between steps besides its parameters and their gradients
    (:func:`state_bytes`)."""

    #: on this process: the local pieces of sharded tensors
    per_rank: int
    #: what one unsharded replica would hold: sharded tensors at their whole size
    unsharded: int
    #: elements of the parameters, unsharded
    parameters: int

    @property
    def per_param(self) -> float:
        """Unsharded bytes per parameter element."""
        return self.unsharded / max(self.parameters, 1)


def state_bytes(opt: torch.optim.Optimizer) -> StateBytes:
    """The memory ``opt`` holds between steps besides the parameters and their gradients:
    every tensor reachable from ``opt.state`` and from the optimizer's own attributes (through
    dicts, lists and tuples; not the param groups), each storage counted once and whole (step
    counters that share one buffer count it once; a view counts the storage it views).

    A DTensor counts its local piece on this rank and its whole size unsharded; a plain tensor
    in a sharded parameter's state that has the local piece's shape (a shard's own state, as
    DGC's residuals) counts, unsharded, as if the parameter were whole.

    Example:
        >>> import torch, scaleopt
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = scaleopt.LAMB(model.parameters(), state_dtype="int8")
        >>> model(torch.randn(4, 256)).sum().backward()
        >>> opt.step()
        >>> held = scaleopt.state_bytes(opt)
        >>> round(held.per_param, 2)  # int8 moments of the weight, float32 ones of the bias
        2.05
    """
    params = [p for group in opt.param_groups for p in group["params"]]
    skip = {_storage(x) for p in params for x in (p, p.grad) if x is not None}
    held: Dict[int, Tuple[int, int]] = {}
    for owner, t in _tensors(opt):
        piece = local_piece(t)
        key = piece.untyped_storage().data_ptr()
        if key in skip or key in held:
            continue
        here = piece.untyped_storage().nbytes()
        held[key] = (here, here * _unsharded_factor(t, piece, owner))
    return StateBytes(sum(h for h, _ in held.values()), int(sum(f for _, f in held.values())),
                      sum(p.numel() for p in params))


def _storage(t: Tensor) -> int:
    """The address of the storage of ``t`` (of its local piece for a DTensor)."""
    return local_piece(t).untyped_storage().data_ptr()


def _unsharded_factor(t: Tensor, piece: Tensor, owner: Optional[Tensor]) -> float:
    """How many times its bytes here a tensor holds unsharded: a DTensor's whole size over its
    local piece's; for a plain tensor of a sharded parameter's state shaped as that
    parameter's local piece, the parameter's; 1 otherwise."""
    if is_dtensor(t):
        return t.numel() / max(piece.numel(), 1)
    if owner is not None and is_dtensor(owner) and tuple(t.shape) == tuple(
            local_piece(owner).shape):
        return owner.numel() / max(local_piece(owner).numel(), 1)
    return 1


def _tensors(opt: torch.optim.Optimizer) -> Iterator[Tuple[Optional[Tensor], Tensor]]:
    """(the parameter whose state holds it or None, tensor) for every tensor reachable from
    the optimizer's state and its attributes but the param groups."""
    seen = set()
    todo: list = [(p, st) for p, st in opt.state.items()]
    todo += [(None, v) for k, v in vars(opt).items() if k not in ("param_groups", "state")]
    while todo:
        owner, obj = todo.pop()
        if isinstance(obj, Tensor):
            yield owner, obj
        elif isinstance(obj, (dict, list, tuple)) and id(obj) not in seen:
            seen.add(id(obj))
            values: Any = obj.values() if isinstance(obj, dict) else obj
            todo.extend((owner, v) for v in values)
