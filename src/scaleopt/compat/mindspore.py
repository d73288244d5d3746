"""MindSpore front-end: ``mindspore.nn.AdamOffload`` with MindSpore's names and semantics.

- Adam with coupled L2 decay (``g + wd*w``), the "epsilon-hat" form
  ``w -= lr * sqrt(1-beta2^t)/(1-beta1^t) * m/(sqrt(v)+eps)``, and with ``use_nesterov`` the
  numerator ``beta1*m + (1-beta1)*g``.
- Without groups, weight decay skips parameters whose name contains ``beta`` or ``gamma``
  (MindSpore's default filter; torch names come from ``model.named_parameters()``: biases are
  decayed). With groups, a group decays iff its ``weight_decay`` is above 0.
- ``loss_scale=S``: the gradients handed in are S times the true ones; the step uses
  ``g/S + wd*w``.
- ``learning_rate``: a number, a 0-d tensor, a 1-D tensor or an iterable (the i-th value at the
  i-th step; the last value once the list is exhausted), or a schedule ``f(global_step)``
  (MindSpore's ``LearningRateSchedule``). Group ``lr`` takes the same forms. ``weight_decay``:
  a number or ``f(global_step)``.

It is :class:`scaleopt.OffloadAdam` underneath: state and update on the host, the model on
any device.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from torch import Tensor

from .._params import normalize_group
from ..offload import OffloadAdam

__all__ = ["AdamOffload"]

_MS_ARGS = {
    "lr": "learning_rate",
    "betas[0]": "beta1",
    "betas[1]": "beta2",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "loss_scale": "loss_scale",
    "nesterov": "use_nesterov",
}


LRSource = Union[float, List[float], Callable[[int], Any]]


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _float_arg(name: str, value: Any) -> float:
    """MindSpore's ``check_value_type(name, value, [float])``: a Python float, nothing else."""
    if not isinstance(value, float):
        raise TypeError(f"For 'AdamOffload', the type of '{name}' must be float, "
                        f"but got {type(value).__name__} ({value!r})")
    if math.isnan(value):
        raise ValueError(f"For 'AdamOffload', '{name}' must not be NaN")
    return value


def _lr_source(value: Any, name: str = "learning_rate") -> LRSource:
    """A constant, a list of per-step values, or a schedule callable."""
    if isinstance(value, bool):
        raise TypeError(f"For 'AdamOffload', '{name}' must be int, float, Tensor, Iterable or a "
                        f"schedule, but got bool")
    if _is_real(value):
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"For 'AdamOffload', '{name}' must be a finite number >= 0, got {value!r}")
        return value
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(f"For 'AdamOffload', a Tensor '{name}' must be of a float dtype, "
                            f"got {value.dtype}")
        if value.dim() == 0:
            return _lr_source(float(value), name)
        if value.dim() != 1:
            raise ValueError(f"For 'AdamOffload', a Tensor '{name}' must be 0-D or 1-D, "
                             f"got {value.dim()}-D")
        value = value.tolist()
    if callable(value):
        return value
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"For 'AdamOffload', '{name}' must be int, float, Tensor, Iterable or a "
                        f"schedule callable(step), but got {type(value).__name__}")
    values = list(value)
    if not values:
        raise ValueError(f"For 'AdamOffload', '{name}' is an empty sequence")
    out = []
    for v in values:
        if isinstance(v, Tensor) and v.numel() == 1:
            v = v.item()
        if not _is_real(v):
            raise TypeError(f"For 'AdamOffload', every value of '{name}' must be a number, "
                            f"got {type(v).__name__}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"For 'AdamOffload', every value of '{name}' must be >= 0, got {v!r}")
        out.append(float(v))
    return out


def _lr_at(source: LRSource, step: int) -> float:
    if isinstance(source, float):
        return source
    if isinstance(source, list):
        return source[min(step, len(source) - 1)]
    value = source(step)
    return float(value.item() if isinstance(value, Tensor) else value)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (an operation on float32 values done in double and rounded so
    gives the float32 operation's result)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _wd_source(value: Any, name: str = "weight_decay") -> Union[float, Callable[[int], Any]]:
    if callable(value) and not isinstance(value, Tensor):
        return value
    if not _is_real(value):
        raise TypeError(f"For 'AdamOffload', the type of '{name}' must be float or int, "
                        f"but got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"For 'AdamOffload', '{name}' must be >= 0, got {value!r}")
    return value


def _check_ms_args(beta1: Any, beta2: Any, eps: Any, loss_scale: Any, use_locking: Any,
                   use_nesterov: Any) -> None:
    """MindSpore's checks of ``AdamOffload``'s arguments, with its messages."""
    for name, b in (("beta1", beta1), ("beta2", beta2)):
        _float_arg(name, b)
        if not 0.0 < b < 1.0:
            raise ValueError(f"For 'AdamOffload', '{name}' must be in range (0.0, 1.0), got {b!r}")
    _float_arg("eps", eps)
    if not eps > 0:
        raise ValueError(f"For 'AdamOffload', 'eps' must be greater than 0, got {eps!r}")
    _float_arg("loss_scale", loss_scale)
    if not (loss_scale > 0 and math.isfinite(loss_scale)):
        raise ValueError(f"For 'AdamOffload', 'loss_scale' must be greater than 0, got {loss_scale!r}")
    for name, flag in (("use_locking", use_locking), ("use_nesterov", use_nesterov)):
        if not isinstance(flag, bool):
            raise TypeError(f"For 'AdamOffload', the type of '{name}' must be bool, "
                            f"but got {type(flag).__name__}")


class AdamOffload(OffloadAdam):
    r"""``mindspore.nn.AdamOffload``: Adam whose state and update live on the host.

    .. math::
        \begin{aligned}
        g &= \nabla / S + \lambda w\\
        m_t &= \beta_1 m_{t-1} + (1-\beta_1) g,\qquad v_t = \beta_2 v_{t-1} + (1-\beta_2) g^2\\
        w &\leftarrow w - \eta\,\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\,
            \frac{m_t \;\text{or}\; \beta_1 m_t + (1-\beta_1) g}{\sqrt{v_t} + \epsilon}
        \end{aligned}

    Args:
        params: parameters (``model.named_parameters()`` for the ``beta``/``gamma`` name
            filter, or plain tensors) or group dicts with ``params`` and optionally ``lr``,
            ``weight_decay``; a dict ``{"order_params": [...]}`` fixes the order of the
            parameters (each must be in a group).
        learning_rate (float, int, Tensor, iterable or callable(step), default 1e-3).
        beta1 (float, default 0.9), beta2 (float, default 0.999): in (0, 1).
        eps (float, default 1e-8): > 0.
        use_locking (bool, default False): MindSpore's lock flag; updates here never race.
        use_nesterov (bool, default False): Nesterov numerator.
        weight_decay (float, int or callable(step), default 0.0): >= 0, coupled L2.
        loss_scale (float, default 1.0): > 0; the gradients are divided by it.

    Raises:
        TypeError: ``learning_rate`` of another type; an element of ``params`` that is neither
            a tensor, a ``(name, tensor)`` pair nor a dict; ``beta1``, ``beta2``, ``eps`` or
            ``loss_scale`` not a float; ``weight_decay`` not a float or int; ``use_locking`` or
            ``use_nesterov`` not a bool.
        ValueError: ``eps`` or ``loss_scale`` <= 0; ``beta1`` or ``beta2`` outside (0, 1);
            ``weight_decay`` < 0; a negative learning rate.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = AdamOffload(model.named_parameters(), learning_rate=[0.1, 0.05, 0.01])
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step(); opt.get_lr()
        0.05
    """

    _arg_names = _MS_ARGS

    def __init__(
        self,
        params: Any,
        learning_rate: Any = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        use_locking: bool = False,
        use_nesterov: bool = False,
        weight_decay: Any = 0.0,
        loss_scale: float = 1.0,
    ) -> None:
        _check_ms_args(beta1, beta2, eps, loss_scale, use_locking, use_nesterov)
        self._lr_default = _lr_source(learning_rate)
        self._wd_default = _wd_source(weight_decay)
        self.global_step = 0
        groups, grouped = self._ms_groups(params)
        self._lr_sources: List[LRSource] = []
        self._wd_sources: List[Union[float, Callable[[int], Any]]] = []
        torch_groups = []
        for g in groups:
            lr_src = _lr_source(g.pop("lr"), "lr") if "lr" in g else self._lr_default
            wd_src = _wd_source(g.pop("weight_decay")) if "weight_decay" in g else self._wd_default
            self._lr_sources.append(lr_src)
            self._wd_sources.append(wd_src)
            g["lr"] = _lr_at(lr_src, 0)
            g["weight_decay"] = self._wd_at(wd_src, 0)
            if not grouped and "param_names" in g:
                g["exclude_from_weight_decay"] = r"beta|gamma"
            torch_groups.append(g)
        self.use_locking = use_locking
        super().__init__(
            torch_groups,
            lr=_lr_at(self._lr_default, 0),
            betas=(beta1, beta2),
            eps=eps,
            weight_decay=self._wd_at(self._wd_default, 0),
            decoupled=False,
            nesterov=use_nesterov,
            eps_mode="hat",
            loss_scale=loss_scale,
        )

    @staticmethod
    def _wd_at(source: Union[float, Callable[[int], Any]], step: int) -> float:
        if isinstance(source, float):
            return source
        value = source(step)
        value = float(value.item() if isinstance(value, Tensor) else value)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"For 'AdamOffload', the dynamic weight_decay gave {value!r} "
                             f"at step {step} (must be >= 0)")
        return value

    @staticmethod
    def _ms_groups(params: Any):
        """MindSpore's ``params``: tensors / named tensors, or group dicts plus ``order_params``."""
        if isinstance(params, Tensor):
            raise TypeError("For 'AdamOffload', 'params' must be a list of parameters or dicts, "
                            "got a single Tensor")
        items = list(params)
        if not items:
            raise ValueError("For 'AdamOffload', the 'params' list is empty")
        for x in items:
            named = isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) \
                and isinstance(x[1], Tensor)
            if not (isinstance(x, (Tensor, dict)) or named):
                raise TypeError("For 'AdamOffload', each element of 'params' must be a Tensor "
                                f"(Parameter), a (name, Tensor) pair or a dict, got {type(x).__name__}")
        if not any(isinstance(x, dict) for x in items):
            return [normalize_group({"params": items})], False
        if not all(isinstance(x, dict) for x in items):
            raise TypeError("For 'AdamOffload', 'params' mixes dicts and parameters")
        order: Optional[Sequence[Any]] = None
        groups = []
        for d in items:
            if "order_params" in d:
                order = list(d["order_params"])
                continue
            if d.get("grad_centralization"):
                raise ValueError("For 'AdamOffload', grad_centralization is not supported")
            groups.append(normalize_group(d))  # other keys are kept, as torch.optim keeps them
        if order is not None:
            groups = AdamOffload._apply_order(groups, order)
        return groups, True

    @staticmethod
    def _apply_order(groups: List[Dict[str, Any]], order: Sequence[Any]) -> List[Dict[str, Any]]:
        """Order each group's parameters as in ``order_params``; every listed parameter must be
        in a group, as MindSpore requires."""
        rank: Dict[int, int] = {}
        for k, x in enumerate(order):
            t = x[1] if isinstance(x, tuple) else x
            if not isinstance(t, Tensor):
                raise TypeError(f"For 'AdamOffload', 'order_params' holds a {type(t).__name__}")
            rank[id(t)] = k
        in_groups = {id(p) for g in groups for p in g["params"]}
        missing = [k for k, x in enumerate(order)
                   if id(x[1] if isinstance(x, tuple) else x) not in in_groups]
        if missing:
            raise ValueError(f"For 'AdamOffload', 'order_params' entries {missing} are in no group")
        out = []
        for g in groups:
            g = dict(g)
            keys = sorted(range(len(g["params"])), key=lambda i: rank.get(id(g["params"][i]), len(rank) + i))
            g["params"] = [g["params"][i] for i in keys]
            if "param_names" in g:
                g["param_names"] = [g["param_names"][i] for i in keys]
            out.append(g)
        return out

    # -- MindSpore's float32 bias corrections ------------------------------------------------

    def _power(self, beta: float, t: int) -> float:
        """``beta**t`` as MindSpore keeps it: a float32 running product, one multiply per step."""
        cache = self.__dict__.setdefault("_powers", {})
        t0, value = cache.get(beta, (0, 1.0))
        if t < t0:
            t0, value = 0, 1.0
        b = _f32(beta)
        for _ in range(t - t0):
            value = _f32(value * b)
        cache[beta] = (t, value)
        return value

    def _step_scalars(self, group: Dict[str, Any], step: float):
        """MindSpore's ``lr * sqrt(1 - beta2_power) / (1 - beta1_power)`` in float32, with the
        powers of the global step (MindSpore's ``beta1_power``/``beta2_power``)."""
        beta1, beta2 = group["betas"]
        t = self.global_step + 1
        p1, p2 = self._power(beta1, t), self._power(beta2, t)
        lr_t = _f32(_f32(group["lr"]) * _f32(math.sqrt(_f32(1.0 - p2))))
        return _f32(lr_t / _f32(1.0 - p1)), 1.0

    def _one_minus_betas(self, group: Dict[str, Any]):
        """``1 - beta`` in float32, as MindSpore's kernel computes it."""
        beta1, beta2 = group["betas"]
        return _f32(1.0 - _f32(beta1)), _f32(1.0 - _f32(beta2))

    # -- dynamic hyperparameters -------------------------------------------------------------

    def _refresh_hyperparameters(self) -> None:
        for g, lr_src, wd_src in zip(self.param_groups, self._lr_sources, self._wd_sources):
            if not isinstance(lr_src, float):
                g["lr"] = _lr_at(lr_src, self.global_step)
            if not isinstance(wd_src, float):
                g["weight_decay"] = self._wd_at(wd_src, self.global_step)

    def _after_step(self) -> None:
        self.global_step += 1

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_lr_sources") and len(self._lr_sources) < len(self.param_groups):
            g = self.param_groups[-1]
            self._lr_sources.append(g["lr"])
            self._wd_sources.append(g["weight_decay"])

    def get_lr(self) -> Union[float, List[float]]:
        """The learning rate the next step uses (a list, one per group, with several groups)."""
        lrs = [_lr_at(s, self.global_step) if not isinstance(s, float) else g["lr"]
               for g, s in zip(self.param_groups, self._lr_sources)]
        return lrs[0] if len(lrs) == 1 else lrs

    def state_dict(self) -> Dict[str, Any]:
        """The state with ``global_step`` at the top and in each param group (which is what
        ``torch.distributed.checkpoint``'s optimizer state dicts carry)."""
        sd = super().state_dict()
        sd["global_step"] = self.global_step
        for g in sd["param_groups"]:
            g["global_step"] = self.global_step
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        groups = state_dict.get("param_groups") or [{}]
        step = state_dict.get("global_step", groups[0].get("global_step", self.global_step))
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            g.pop("global_step", None)
        self.global_step = int(step)
