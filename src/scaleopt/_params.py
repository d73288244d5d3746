"""Parameters in: tensors, ``(name, tensor)`` pairs or group dicts as param groups, and the rules
on parameter names (``exclude_from_*``)."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from torch import Tensor

NameRule = Union[None, str, Sequence[str], Callable[[str], bool]]

#: Group keys that are not hyperparameters but may appear in a param group.
BOOKKEEPING_KEYS = frozenset({"params", "param_names", "initial_lr"})


def _split_named(params: Iterable[Any]) -> Tuple[List[Any], Optional[List[str]]]:
    tensors: List[Any] = []
    names: List[str] = []
    for p in params:
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            names.append(p[0])
            tensors.append(p[1])
        else:
            tensors.append(p)
    if names and len(names) != len(tensors):
        raise ValueError("params: either every parameter is named (name, tensor) or none is")
    return tensors, (names if names else None)


def normalize_group(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param-group dict with plain tensors in ``params`` and names, if any, in ``param_names``."""
    if not isinstance(group, dict):
        raise TypeError(f"param_group must be a dict, got {type(group).__name__}")
    group = dict(group)
    params = group.get("params")
    if params is None:
        raise ValueError("param group has no 'params'")
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("params must be an ordered collection (list), not a set")
    tensors, names = _split_named(list(params))
    group["params"] = tensors
    if names is not None:
        if "param_names" in group and list(group["param_names"]) != names:
            raise ValueError("param group gives both named parameters and different 'param_names'")
        group["param_names"] = names
    elif "param_names" in group:
        group["param_names"] = list(group["param_names"])
        if len(group["param_names"]) != len(tensors):
            raise ValueError(
                f"param_names has {len(group['param_names'])} names for {len(tensors)} parameters"
            )
    return group


def normalize_params(params: Any) -> List[Dict[str, Any]]:
    """Tensors, ``(name, tensor)`` pairs or group dicts -> a non-empty list of group dicts."""
    if isinstance(params, Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors, "
            "(name, Tensor) pairs or dicts, but got a single Tensor"
        )
    if isinstance(params, dict):
        params = [params]
    items = list(params)
    if len(items) == 0:
        raise ValueError("optimizer got an empty parameter list (params)")
    if all(isinstance(x, dict) for x in items):
        return [normalize_group(g) for g in items]
    if any(isinstance(x, dict) for x in items):
        raise TypeError("params: mix of param-group dicts and parameters; use dicts for all")
    return [normalize_group({"params": items})]


def param_label(group: Dict[str, Any], i: int) -> str:
    """Parameter ``i`` of ``group`` in a message: its name, quoted, where the group has names,
    else ``#i``."""
    names = group.get("param_names")
    return repr(names[i]) if names else f"#{i}"


def rule_is_set(rule: NameRule) -> bool:
    return rule is not None and not (isinstance(rule, (list, tuple)) and len(rule) == 0)


# process-wide: a pure function of a rule and names (hashable: tuples and strings), which
# every optimizer with that rule may share
@functools.lru_cache(maxsize=1024)
def _match_names(rule: Any, names: Tuple[str, ...]) -> Tuple[bool, ...]:
    if rule is None:
        return (False,) * len(names)
    if callable(rule):
        return tuple(bool(rule(n)) for n in names)
    patterns = [re.compile(r) for r in ((rule,) if isinstance(rule, str) else rule)]
    return tuple(any(p.search(n) is not None for p in patterns) for n in names)


def match_names(rule: NameRule, names: Sequence[str]) -> Tuple[bool, ...]:
    """For each name, whether ``rule`` (regex, regex list or callable) selects it."""
    key = tuple(rule) if isinstance(rule, list) else rule
    try:
        return _match_names(key, tuple(names))
    except TypeError:  # an unhashable callable
        return _match_names.__wrapped__(key, tuple(names))


def freeze_rule(rule: NameRule, names: Sequence[str]) -> NameRule:
    """A callable rule as the equivalent list of anchored, escaped names (serialisable)."""
    if not callable(rule):
        return list(rule) if isinstance(rule, tuple) else rule
    return ["^" + re.escape(n) + "$" for n, hit in zip(names, match_names(rule, names)) if hit]
