"""Param-group helpers: no weight decay on biases and normalisation weights."""

from __future__ import annotations

from typing import Any, Dict, List

from torch import nn

from ._checks import check_name_rule, check_number
from ._params import NameRule, match_names

__all__ = ["param_groups", "is_norm_module"]

_NORM_TYPES = tuple(
    t
    for t in (
        getattr(nn.modules.batchnorm, "_NormBase", None),
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)


def is_norm_module(module: nn.Module) -> bool:
    """Batch/instance/layer/group/RMS norm modules (torch's, or any class named ``*Norm*``)."""
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.01,
    no_decay: NameRule = None,
    *,
    decay_1d: bool = False,
    **options: Any,
) -> List[Dict[str, Any]]:
    """Split ``model``'s trainable parameters into at most two groups: decayed and not decayed.

    A parameter gets ``weight_decay=0`` if it belongs to a normalisation module, if it has fewer
    than 2 dimensions (biases, scales; unless ``decay_1d=True``), or if its name matches
    ``no_decay`` (a regex, list of regexes or callable on the name). Everything else gets
    ``weight_decay``. Frozen parameters (``requires_grad=False``) are left out, and an empty
    group is not returned. Each group carries ``param_names``, so name rules of the optimizer
    keep working; extra ``options`` (e.g. ``lr=...``) are copied into both groups.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> groups = param_groups(model, weight_decay=0.01)
        >>> [(g["weight_decay"], g["param_names"]) for g in groups]
        [(0.01, ['0.weight']), (0.0, ['0.bias', '1.weight', '1.bias'])]
    """
    check_number("weight_decay", weight_decay)
    check_name_rule("no_decay", no_decay)
    norm_params = {
        id(p) for m in model.modules() if is_norm_module(m) for p in m.parameters(recurse=False)
    }
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    by_rule = match_names(no_decay, [n for n, _ in named])
    decay: Dict[str, List[Any]] = {"params": [], "param_names": []}
    plain: Dict[str, List[Any]] = {"params": [], "param_names": []}
    for (name, p), ruled in zip(named, by_rule):
        skip = ruled or id(p) in norm_params or (p.ndim < 2 and not decay_1d)
        target = plain if skip else decay
        target["params"].append(p)
        target["param_names"].append(name)
    groups = []
    for g, wd in ((decay, weight_decay), (plain, 0.0)):
        if g["params"]:
            groups.append({**g, "weight_decay": wd, **options})
    return groups
