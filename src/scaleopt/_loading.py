"""State dicts checked before they load: every state tensor against its parameter, the keys an
optimizer needs, the class the state was saved by, and the step counters.

A state dict that fails a check raises ``ValueError`` naming the parameter (by name where the
optimizer knows names), the key and what was expected, and changes nothing: a checkpoint of a
model of another width, with transposed moments, a missing moment, a negative or NaN step, or
another optimizer's state never reaches a step.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import _compact
from ._params import param_label
from ._sharding import local_piece

#: The top-level key of a state dict saved by a scaleopt optimizer: which class saved it and
#: the kind of state it holds (``torch.distributed.checkpoint`` keeps only ``state`` and
#: ``param_groups``, so state dicts that went through it load unchecked for the kind).
TAG = "scaleopt"


class StateSpec(NamedTuple):
    """What one parameter's state holds, once it has any."""

    #: the kind of state (state dicts load between optimizers of one kind)
    kind: str
    #: keys every parameter with state has
    required: Tuple[str, ...]
    #: keys whose tensors are shaped like the parameter
    shaped: Tuple[str, ...]
    #: keys required only where the group says so: ``(option, key)``
    optional: Tuple[Tuple[str, str], ...] = ()
    #: shaped keys that may hold None (torch's SGD saves ``momentum_buffer=None``)
    may_be_none: Tuple[str, ...] = ()


#: Adam's state (torch.optim.AdamW's, scaleopt's AdamW and OffloadAdam); LAMB and LANS hold the
#: same keys as other kinds.
#: state that is a running mean (or maximum) of squares
NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq")

ADAM_STATE = StateSpec("adam", ("step", "exp_avg", "exp_avg_sq"),
                       ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"),
                       optional=(("amsgrad", "max_exp_avg_sq"),))


def tag(optimizer: Any) -> Dict[str, str]:
    cls = type(optimizer)
    return {"optimizer": f"{cls.__module__.split('.')[0]}.{cls.__qualname__}",
            "state": optimizer._state_spec.kind}


def check_state_dict(optimizer: Any, state_dict: Dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` fits ``optimizer`` (see the module doc)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise ValueError(f"{type(optimizer).__name__}.load_state_dict takes a dict with 'state' "
                         f"and 'param_groups' (an optimizer's state_dict()), got "
                         f"{_describe(state_dict)}")
    spec = optimizer._state_spec
    _check_kind(optimizer, state_dict.get(TAG), spec)
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, "
                         f"{type(optimizer).__name__} has {len(optimizer.param_groups)}")
    for group, saved, (i, p) in _pairs(optimizer.param_groups, saved_groups):
        st = state_dict["state"].get(saved)
        if st is None:
            continue
        where = _name(group, i, p, optimizer)
        if not isinstance(st, dict):
            raise ValueError(f"state of {where}: a dict of tensors expected, got {_describe(st)}")
        _check_param_state(st, optimizer._state_shape(p), spec, group, where)


def _pairs(groups: List[Dict[str, Any]], saved_groups: List[Dict[str, Any]]
           ) -> Iterator[Tuple[Dict[str, Any], Any, Tuple[int, Tensor]]]:
    for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
        ids = saved.get("params", [])
        if len(ids) != len(group["params"]):
            raise ValueError(f"param group {gi} of the state dict has {len(ids)} parameters, "
                             f"the optimizer's has {len(group['params'])}")
        for i, (pid, p) in enumerate(zip(ids, group["params"])):
            yield group, pid, (i, p)


def _check_kind(optimizer: Any, saved_tag: Optional[Dict[str, Any]], spec: StateSpec) -> None:
    if not isinstance(saved_tag, dict) or saved_tag.get("state") in (None, spec.kind):
        return
    raise ValueError(
        f"this state dict was saved by {saved_tag.get('optimizer')} and holds "
        f"{saved_tag['state']!r} state; {type(optimizer).__name__} takes {spec.kind!r} state "
        f"(the same keys would give other numbers). To load the moments anyway, delete the "
        f"state dict's {TAG!r} entry first")


def _check_param_state(st: Dict[str, Any], shape: Tuple[int, ...], spec: StateSpec,
                       group: Dict[str, Any], where: str) -> None:
    needed = spec.required + tuple(key for option, key in spec.optional if group.get(option))
    missing = [k for k in needed if k not in st]
    if missing:
        raise ValueError(f"state of {where} lacks {missing} (a {spec.kind!r} state holds "
                         f"{list(needed)}): the checkpoint is incomplete or of another optimizer")
    if "step" in st:
        _check_step(st["step"], where)
    for key in _compact.SCALE_KEYS:
        codes = st.get(key[:-len("_scale")])
        if key in st and not _compact.is_codes(codes):
            raise ValueError(f"state {key!r} of {where}: scales without the int8 codes they "
                             f"belong to")
    for key in spec.shaped:
        if key not in st or (st[key] is None and key in spec.may_be_none):
            continue
        x = st[key]
        if _compact.is_codes(x):
            _compact.check_codes(st, key, shape, where)
            continue
        if not isinstance(x, Tensor) or not (x.is_floating_point() and not x.is_complex()):
            raise ValueError(f"state {key!r} of {where}: a floating-point tensor expected, got "
                             f"{_describe(x)}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"state {key!r} of {where} has shape {tuple(x.shape)}, the "
                             f"parameter's state {tuple(shape)}: the checkpoint is of another "
                             f"model or layout")
        if key in NON_NEGATIVE and bool((local_piece(x.detach()) < 0).any()):
            raise ValueError(f"state {key!r} of {where} has negative values: a running mean of "
                             f"squares never does, so the checkpoint was altered or corrupted")


def _check_step(step: Any, where: str) -> None:
    if isinstance(step, Tensor):
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            raise ValueError(f"state 'step' of {where}: one real number expected, got "
                             f"{_describe(step)}")
        value = float(step.detach().reshape(()).cpu())
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise ValueError(f"state 'step' of {where}: a number expected, got {_describe(step)}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"state 'step' of {where} is {value!r}: a step count is a finite "
                         f"number >= 0")


def _name(group: Dict[str, Any], i: int, p: Tensor, optimizer: Any) -> str:
    if group.get("param_names") is not None:
        return f"parameter {param_label(group, i)}"
    gi = next(k for k, g in enumerate(optimizer.param_groups) if g is group)
    return f"parameter {i} of param group {gi} (shape {tuple(p.shape)})"


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__}"
