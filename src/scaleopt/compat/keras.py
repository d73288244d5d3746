"""Keras front-end: ``keras.optimizers.Lamb`` with Keras' names, defaults and semantics."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

from torch import Tensor

from ..lamb import LAMB as _LAMB
from ._common import GradientsAndVariables, ScheduledLR, as_float

__all__ = ["Lamb"]


_KERAS_ARGS = {
    "lr": "learning_rate",
    "betas[0]": "beta_1",
    "betas[1]": "beta_2",
    "eps": "epsilon",
    "max_grad_norm": "global_clipnorm",
    "clip_grad_value": "clipvalue",
    "clip_grad_norm_per_tensor": "clipnorm",
    "exclude_from_weight_decay": "var_names",
}


class Lamb(ScheduledLR, GradientsAndVariables, _LAMB):
    r"""``keras.optimizers.Lamb`` on :class:`scaleopt.LAMB`.

    .. math::
        w \leftarrow w - \eta\lambda w \ \text{(decoupled, before the step; not for excluded
        variables)},\qquad
        u = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)}+\epsilon},\qquad
        w \leftarrow w - \eta\,\frac{\lVert w\rVert}{\lVert u\rVert}\,u

    The trust ratio (1 when a norm is 0) applies to every variable; the decay stays outside it.

    Args:
        params: tensors, ``(name, tensor)`` pairs or group dicts.
        learning_rate (float or callable(iterations) -> float, default 0.001)
        beta_1 (0.9), beta_2 (0.999), epsilon (1e-7, Keras' default)
        weight_decay (float or None, default None): decoupled decay rate.
        clipnorm (per-variable norm), clipvalue (element value), global_clipnorm (global norm):
            at most one may be set, as in Keras.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(model.named_parameters(), learning_rate=0.01, weight_decay=0.1)
        >>> opt.exclude_from_weight_decay(var_names=["bias"])
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
    """

    _arg_names = _KERAS_ARGS

    def __init__(
        self,
        params: Any,
        learning_rate: Union[float, Callable[[int], float]] = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        weight_decay: Optional[float] = None,
        clipnorm: Optional[float] = None,
        clipvalue: Optional[float] = None,
        global_clipnorm: Optional[float] = None,
        name: str = "lamb",
    ) -> None:
        if sum(x is not None for x in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise ValueError(
                "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
                f"clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
            )
        if callable(learning_rate):  # a schedule of the iteration count, read before each step
            self._lr_source, lr = learning_rate, 0.0
        else:
            lr = self._init_lr_source(learning_rate)
        self.name = name
        self._excluded_ids: set = set()
        super().__init__(
            params,
            lr=lr,
            betas=(as_float("beta_1", beta_1), as_float("beta_2", beta_2)),
            eps=as_float("epsilon", epsilon),
            weight_decay=0.0 if weight_decay is None else as_float("weight_decay", weight_decay),
            weight_decay_mode="decoupled",
            bias_correction=True,
            always_adapt=True,
            max_grad_norm=global_clipnorm,
            clip_grad_value=clipvalue,
            clip_grad_norm_per_tensor=clipnorm,
        )
        if callable(learning_rate):
            self._set_base_lr(self._scheduled_lr())

    @property
    def iterations(self) -> int:
        """The number of steps applied so far."""
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        return max(steps, default=0)

    @property
    def learning_rate(self) -> float:
        return self._scheduled_lr() if callable(self._lr_source) else self._base_lr()

    @learning_rate.setter
    def learning_rate(self, value: Union[float, Callable[[int], float]]) -> None:
        if callable(value):
            self._lr_source = value
            self._set_base_lr(self._scheduled_lr())
        else:
            self._lr_source = self._init_lr_source(value)
            self._set_base_lr(self._lr_source)

    def _scheduled_lr(self) -> float:
        return float(self._lr_source(self.iterations))  # type: ignore[operator]

    def exclude_from_weight_decay(
        self, var_list: Optional[Iterable[Tensor]] = None, var_names: Optional[Sequence[str]] = None
    ) -> None:
        """Exclude variables (by identity) and names (regexes, ``re.search``) from weight decay."""
        if self.state:
            raise ValueError(
                "`exclude_from_weight_decay()` can only be configured before the optimizer is built."
            )
        if var_list is not None:
            self._excluded_ids.update(id(v) for v in var_list)
        if var_names:
            names = list(var_names)
            for g in self.param_groups:
                old = g["exclude_from_weight_decay"]
                old = [] if old is None else ([old] if isinstance(old, str) else list(old))
                g["exclude_from_weight_decay"] = old + names
                self._validate_group(g)
            for g in self.param_groups:
                if "param_names" not in g:
                    raise ValueError(
                        "var_names needs named parameters: pass model.named_parameters()"
                    )

    def _rule_flags(self, group: Dict[str, Any], key: str) -> Tuple[bool, ...]:
        flags = super()._rule_flags(group, key)
        if key == "exclude_from_weight_decay" and self._excluded_ids:
            flags = tuple(f or id(p) in self._excluded_ids for f, p in zip(flags, group["params"]))
        return flags
