"""The Adam family (LAMB, LANS, OffloadAdam): master weights and Adam state, made in one place."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import _compact, _format
from ._base import ScaleOptimizer
from ._loading import ADAM_STATE
from ._masters import MasterView, WithMasterWeights

_MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamState(NamedTuple):
    """A group's tensors as the update reaches them: the masters' view, and per tensor its step
    counter and moments (``max_exp_avg_sqs`` with amsgrad, else None)."""

    view: MasterView
    steps: List[Tensor]
    exp_avgs: List[Tensor]
    exp_avg_sqs: List[Tensor]
    max_exp_avg_sqs: Optional[List[Tensor]] = None
    #: moments stored in bfloat16 or 8 bits, read into the float32 working tensors above: to
    #: store back once the update has run (:meth:`AdamFamily._store_moments`)
    pending: Optional[List[_compact.Pending]] = None
    #: per tensor, its moments as stored in bfloat16 or 8 bits where they are given so (the
    #: stored tensors above, for the C kernels to update in place; see :meth:`decoded`)
    stored: Optional[List[Optional[_format.Stored]]] = None

    def decoded(self, which: Optional[Sequence[int]] = None) -> "AdamState":
        """The state with float32 working tensors in place of the stored moments of the
        tensors ``which`` (all by default), to store back after the update."""
        if not self.stored or not any(self.stored):
            return self
        which = range(len(self.steps)) if which is None else which
        exp_avgs, exp_avg_sqs, stored = list(self.exp_avgs), list(self.exp_avg_sqs), \
            list(self.stored)
        pending = list(self.pending or [])
        for i in which:
            if stored[i] is not None:
                exp_avgs[i], exp_avg_sqs[i] = _compact.decode(stored[i], torch.float32,
                                                              pending)
                stored[i] = None
        return self._replace(exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, pending=pending,
                             stored=stored)


def _entries(dicts: List[Dict[str, Any]]) -> List[Any]:
    """Every entry of the parameters' state dicts, in order, as one list (one pass in C)."""
    return list(itertools.chain.from_iterable(map(dict.values, dicts)))


class _Memo(NamedTuple):
    """A group's :class:`AdamState` and what it was made of: the group and its options that
    decide the state's form, the parameters, their state dicts and every entry in them. The
    state is given again while all of these are the same objects (a checkpoint loaded, a
    counter or moment replaced, an entry added or removed, a form changed: another object,
    and the state is made again), at the cost of a few passes of identity checks instead of
    a pass of checks and conversions per tensor. Made only where it took no float32 working
    copies."""

    group: Dict[str, Any]
    options: tuple
    params: List[Tensor]
    dicts: List[Dict[str, Any]]
    entries: List[Any]
    state: AdamState
    #: [the optimizer's ``state`` mapping, its keys, its values], in order, as last seen: while
    #: they are the same objects, each parameter still has the same state dict (checked
    #: without hashing a tensor per parameter, which costs a Python call each)
    mapping: List[Any]

    @staticmethod
    def options_of(group: Dict[str, Any], amsgrad: bool) -> tuple:
        return (group["state_dtype"], group.get("capturable", False), group.get("master_weights"),
                group.get("implementation"), group.get("foreach"), group.get("fused"), amsgrad)

    @classmethod
    def of(cls, opt: Any, group: Dict[str, Any], params: List[Tensor], amsgrad: bool,
           state: AdamState) -> Optional["_Memo"]:
        if state.pending:
            return None
        dicts = [opt.state[p] for p in params]
        return cls(group, cls.options_of(group, amsgrad), list(params), dicts, _entries(dicts),
                   state, cls.mapping_of(opt))

    @staticmethod
    def mapping_of(opt: Any) -> List[Any]:
        return [opt.state, list(opt.state), list(opt.state.values())]

    def holds(self, opt: Any, group: Dict[str, Any], params: List[Tensor], amsgrad: bool) -> bool:
        if (self.group is not group or len(params) != len(self.params)
                or self.options != self.options_of(group, amsgrad)
                or not all(map(operator.is_, params, self.params))):
            return False
        mapping, keys, values = self.mapping
        if not (opt.state is mapping and len(mapping) == len(keys)
                and all(map(operator.is_, mapping, keys))
                and all(map(operator.is_, mapping.values(), values))):
            dicts = list(map(opt.state.__getitem__, params))  # the mapping changed: look up
            if not all(map(operator.is_, dicts, self.dicts)):
                return False
            self.mapping[:] = self.mapping_of(opt)  # (another group's state made, say)
        entries = _entries(self.dicts)
        return len(entries) == len(self.entries) and all(map(operator.is_, entries, self.entries))


class AdamFamily(WithMasterWeights, ScaleOptimizer):
    """Base of the optimizers with Adam moments and float32 master weights.

    Per parameter, the state holds ``step`` (a float32 CPU scalar, as in :mod:`torch.optim`; on
    the parameter's device where the group says ``capturable``),
    ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), shaped and laid out as
    the tensor the update runs on, in its dtype (float32 for a split master), and where the
    parameter has one, its master (``scaleopt._masters``).
    """

    _state_spec = ADAM_STATE
    #: per group (by id), the last step's state (:class:`_Memo`), the optimizer's own: no
    #: other optimizer reads it, a copy starts without it, and it goes with the optimizer
    _not_pickled = ScaleOptimizer._not_pickled + ("_adam_memos",)

    def _adam_state(self, group: Dict[str, Any], params: List[Tensor],
                    amsgrad: bool = False) -> AdamState:
        """:meth:`_new_adam_state`, or the same state again where nothing it is made of has
        changed since the last step of the group (:class:`_Memo`)."""
        if torch.compiler.is_compiling():
            return self._new_adam_state(group, params, amsgrad)
        memos = self.__dict__.setdefault("_adam_memos", {})
        memo = memos.get(id(group))
        if memo is not None and memo.holds(self, group, params, amsgrad):
            return memo.state
        state = self._new_adam_state(group, params, amsgrad)
        memos[id(group)] = _Memo.of(self, group, params, amsgrad, state)
        return state

    def _new_adam_state(self, group: Dict[str, Any], params: List[Tensor],
                        amsgrad: bool = False) -> AdamState:
        """The masters' view of ``params`` and their Adam state, made where new (masters equal
        to the parameters, moments zero); a step counter moved to where it belongs as float32
        (e.g. from a fused CUDA Adam's checkpoint) and moments cast to the working dtype (e.g.
        from a checkpoint saved without master weights). Moments stored in bfloat16 or 8 bits
        are given as stored (with ``amsgrad``: as float32 working tensors), for the C kernels;
        :meth:`AdamState.decoded` gives working tensors for the other paths."""
        view = self._master_weights.view(group, params)
        keys = _MOMENTS + (("max_exp_avg_sq",) if amsgrad else ())
        on_device = group.get("capturable", False)  # the step counters where the weights are
        cpu, f32 = torch.device("cpu"), torch.float32
        steps: List[Tensor] = []
        moments: List[List[Tensor]] = [[] for _ in keys]
        pending: List[_compact.Pending] = []
        stored: List[Optional[_format.Stored]] = []
        for p, w, split in zip(params, view.weights, view.split):
            state = self.state[p]
            step = state.get("step")
            device = w.device if on_device else cpu
            if step is None or step.dtype != f32 or (step.device != device if on_device
                                                     else not step.is_cpu):
                step = state["step"] = (torch.zeros((), dtype=f32, device=device) if step is None
                                        else step.to(device, f32))
            steps.append(step)
            dtype = f32 if split else w.dtype
            form = _compact.form_for(group["state_dtype"], self._state_shape(p))
            _compact.convert(state, form, w, dtype)  # another form: a group changed its option
            stored.append(None if form == "float32" or amsgrad
                          else _compact.stored(state, form, w))
            if stored[-1] is not None:  # given as stored, for the kernels (else decoded)
                moments[0].append(state["exp_avg"])
                moments[1].append(state["exp_avg_sq"])
                continue
            for key, out in zip(keys, moments):
                if form != "float32":
                    out.append(_compact.working(state, key, form, w, dtype, pending))
                    continue
                x = state.get(key)
                if x is None:
                    x = state[key] = torch.zeros_like(w, dtype=dtype,
                                                      memory_format=torch.preserve_format)
                elif x.dtype != dtype:  # e.g. a checkpoint saved without master weights
                    x = state[key] = x.to(dtype)
                out.append(x)
        return AdamState(view, steps, moments[0], moments[1],
                         moments[2] if amsgrad else None, pending, stored)

    def _store_moments(self, state: AdamState) -> None:
        """Store the moments read from bfloat16 or 8 bits back, after the update."""
        if state.pending:
            _compact.store(state.pending)
