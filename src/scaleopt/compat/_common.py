"""Pieces shared by the front-ends with the reference frameworks' names."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from torch import Tensor

from .._checks import check_number
from .._params import normalize_params

LearningRate = Union[float, Callable[..., float]]


def as_float(name: str, value: Any) -> float:
    """A float from a number or a one-element tensor; ``TypeError`` naming ``name`` otherwise."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
    return float(value)


def rename_group_keys(
    params: Any, renames: Dict[str, str], betas_keys: Optional[Tuple[str, str]] = None,
    default_betas: Optional[Tuple[float, float]] = None,
) -> List[Dict[str, Any]]:
    """Param groups in a framework's key names -> scaleopt's (``beta1``/``beta2`` -> ``betas``)."""
    groups = normalize_params(params)
    out = []
    for g in groups:
        g = dict(g)
        for src, dst in renames.items():
            if src in g:
                g[dst] = g.pop(src)
        if betas_keys is not None and (betas_keys[0] in g or betas_keys[1] in g):
            b1 = g.pop(betas_keys[0], default_betas[0])
            b2 = g.pop(betas_keys[1], default_betas[1])
            g["betas"] = (as_float(betas_keys[0], b1), as_float(betas_keys[1], b2))
        out.append(g)
    return out


class ScheduledLR:
    """Mixin: a base learning rate that is a float or a schedule, times a per-group scale.

    ``group["lr"] = base * group["lr_scale"]`` is refreshed before every step when the base is a
    schedule (or after :meth:`_set_base_lr`); otherwise ``group["lr"]`` is left alone, so torch
    LR schedulers work on these optimizers as on any other.
    """

    _lr_source: LearningRate

    def _init_lr_source(self, learning_rate: LearningRate, name: str = "learning_rate") -> float:
        if callable(learning_rate):
            self._lr_source = learning_rate
            return float(self._scheduled_lr())
        value = as_float(name, learning_rate)
        check_number(name, value)
        self._lr_source = value
        return value

    def _scheduled_lr(self) -> float:
        return float(self._lr_source())  # type: ignore[operator]

    def _set_base_lr(self, value: float) -> None:
        for g in self.param_groups:  # type: ignore[attr-defined]
            g["lr"] = value * g.get("lr_scale", 1.0)

    def _refresh_hyperparameters(self) -> None:
        if callable(self._lr_source):
            self._set_base_lr(self._scheduled_lr())

    def _base_lr(self) -> float:
        g = self.param_groups[0]  # type: ignore[attr-defined]
        return g["lr"] / g.get("lr_scale", 1.0)


class GradientsAndVariables:
    """Mixin: Keras/TF-style ``apply_gradients(zip(grads, vars))``."""

    def apply_gradients(self, grads_and_vars: Iterable[Tuple[Tensor, Tensor]], *args, **kwargs):
        """Use the given gradients (not ``.grad``) for one step of the given variables."""
        pairs = list(grads_and_vars)
        everything = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        saved = {id(p): p.grad for p in everything}
        for p in everything:
            p.grad = None
        try:
            for g, v in pairs:
                if g is None:
                    continue
                if g.shape != v.shape:
                    raise ValueError(
                        f"gradient shape {tuple(g.shape)} != variable shape {tuple(v.shape)}"
                    )
                v.grad = g.detach().to(dtype=v.dtype, device=v.device)
            self.step()  # type: ignore[attr-defined]
        finally:
            for p in everything:
                p.grad = saved[id(p)]
