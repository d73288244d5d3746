"""PaddlePaddle front-ends: ``paddle.optimizer.Lamb``, ``AdamW``, ``Momentum`` and the clip classes.

Argument names and defaults are Paddle's. ``parameters`` takes tensors, ``(name, tensor)`` pairs
(``model.named_parameters()``) or group dicts with Paddle's keys (``params``, ``learning_rate`` as a
multiplier of the optimizer's rate, ``weight_decay`` / ``lamb_weight_decay``, ``beta1``, ``beta2``,
``epsilon``). Rules that Paddle calls with a parameter (``exclude_from_weight_decay_fn``,
``apply_decay_param_fun``, ``lr_ratio``) are called with the parameter's name, the counterpart of
Paddle's ``p.name``.

Each class is a :class:`torch.optim.Optimizer` and also has Paddle's methods: :meth:`step`,
``minimize(loss)``, ``clear_grad()``, ``set_lr(value)``, ``get_lr()``, ``set_state_dict``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import Tensor

from .. import _base
from ..adamw import AdamW as _AdamW
from ..lamb import LAMB as _LAMB
from ..dgc import DGCMomentum as _DGCMomentum
from ..momentum import Momentum as _Momentum
from ._common import ScheduledLR, as_float, rename_group_keys

__all__ = [
    "Lamb",
    "AdamW",
    "Momentum",
    "DGCMomentumOptimizer",
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "L1Decay",
    "L2Decay",
    "LRScheduler",
    "LambdaDecay",
]


# ------------------------------------------------------------------------------------------------
# gradient clipping and regularisers
# ------------------------------------------------------------------------------------------------


class ClipGradByGlobalNorm:
    """``g *= clip_norm / max(global_norm, clip_norm)``, the norm over all gradients."""

    def __init__(self, clip_norm: float, group_name: str = "default_group", auto_skip_clip: bool = False):
        self.clip_norm = as_float("clip_norm", clip_norm)
        _base.check_number("clip_norm", self.clip_norm, low=0.0, low_open=True)
        self.group_name = group_name
        self.auto_skip_clip = auto_skip_clip

    def options(self) -> Dict[str, Any]:
        return {"max_grad_norm": self.clip_norm}


class ClipGradByNorm:
    """Each gradient scaled so its own L2 norm is at most ``clip_norm``."""

    def __init__(self, clip_norm: float):
        self.clip_norm = as_float("clip_norm", clip_norm)
        _base.check_number("clip_norm", self.clip_norm, low=0.0, low_open=True)

    def options(self) -> Dict[str, Any]:
        return {"clip_grad_norm_per_tensor": self.clip_norm}


class ClipGradByValue:
    """Each gradient element clamped to ``[min, max]``; ``min`` defaults to ``-max``."""

    def __init__(self, max: float, min: Optional[float] = None):  # noqa: A002 - Paddle's names
        self.max = as_float("max", max)
        if min is None:
            if not self.max > 0:
                raise ValueError(f"Invalid max: {max!r} (must be > 0 when min is not given)")
            min = -self.max
        self.min = as_float("min", min)
        if not self.min < self.max:
            raise ValueError(f"Invalid min/max: {self.min!r} >= {self.max!r}")

    def options(self) -> Dict[str, Any]:
        return {"clip_grad_value": (self.min, self.max)}


_CLIPS = (ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue)


def _clip_options(grad_clip: Any, allowed=_CLIPS) -> Dict[str, Any]:
    if grad_clip is None:
        return {}
    if not isinstance(grad_clip, allowed):
        names = ", ".join(c.__name__ for c in allowed)
        raise TypeError(f"grad_clip should be an instance of {names}, got {type(grad_clip).__name__}")
    return grad_clip.options()


class L2Decay:
    """L2 regularisation ``g += coeff * w``."""

    mode = "l2"

    def __init__(self, coeff: float = 0.0):
        self.coeff = as_float("coeff", coeff)
        _base.check_number("coeff", self.coeff)


class L1Decay(L2Decay):
    """L1 regularisation ``g += coeff * sign(w)``."""

    mode = "l1"


# ------------------------------------------------------------------------------------------------
# learning-rate schedules (``paddle.optimizer.lr``)
# ------------------------------------------------------------------------------------------------


class LRScheduler:
    """Paddle's scheduler protocol: ``step()`` advances, ``scheduler()`` is the current rate."""

    def __init__(self, learning_rate: float = 0.1, last_epoch: int = -1, verbose: bool = False):
        self.base_lr = as_float("learning_rate", learning_rate)
        self.last_epoch = last_epoch
        self.verbose = verbose
        self.step()

    def __call__(self) -> float:
        return self.last_lr

    def step(self, epoch: Optional[int] = None) -> None:
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        self.last_lr = float(self.get_lr())

    def get_lr(self) -> float:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        return {"last_epoch": self.last_epoch, "last_lr": self.last_lr}

    def set_state_dict(self, state: Dict[str, Any]) -> None:
        self.last_epoch = state["last_epoch"]
        self.last_lr = state["last_lr"]


class LambdaDecay(LRScheduler):
    """``lr = learning_rate * lr_lambda(epoch)``."""

    def __init__(self, learning_rate: float, lr_lambda: Callable[[int], float], last_epoch: int = -1,
                 verbose: bool = False):
        if not callable(lr_lambda):
            raise TypeError(f"lr_lambda must be callable, got {type(lr_lambda).__name__}")
        self.lr_lambda = lr_lambda
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * self.lr_lambda(self.last_epoch)


# ------------------------------------------------------------------------------------------------
# shared behaviour
# ------------------------------------------------------------------------------------------------


class _PaddleAPI(ScheduledLR):
    """Paddle's optimizer methods on top of a scaleopt optimizer."""

    _extra_defaults = {"lr_scale": 1.0}
    _arg_names = {
        "lr": "learning_rate",
        "betas[0]": "beta1",
        "betas[1]": "beta2",
        "eps": "epsilon",
        "nesterov": "use_nesterov",
        "exclude_from_weight_decay": "exclude_from_weight_decay_fn",
        "lr_scale": "learning_rate (group multiplier)",
        "master_weights": "multi_precision",
    }

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)  # type: ignore[misc]
        _base.check_number(self._arg("lr_scale"), group["lr_scale"])

    def _paddle_init(self, learning_rate: Any, parameters: Any) -> float:
        if parameters is None:
            raise ValueError(
                "parameters must be given (tensors, model.named_parameters() or group dicts)"
            )
        if not callable(learning_rate) and not isinstance(learning_rate, (int, float, Tensor)):
            raise TypeError(
                f"learning_rate must be a float or an LRScheduler, got {type(learning_rate).__name__}"
            )
        return self._init_lr_source(learning_rate)

    def _after_init(self) -> None:
        self._set_base_lr(self._scheduled_lr() if callable(self._lr_source) else self._lr_source)

    def minimize(self, loss: Tensor, startup_program: Any = None, parameters: Any = None,
                 no_grad_set: Any = None):
        """``loss.backward()`` then :meth:`step`; returns ``(None, [(param, grad), ...])``."""
        loss.backward()
        self.step()  # type: ignore[attr-defined]
        pairs = [(p, p.grad) for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        return None, pairs

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Zero the gradients (``set_to_zero=True``, Paddle's default) or drop them."""
        self.zero_grad(set_to_none=not set_to_zero)  # type: ignore[attr-defined]

    def set_lr(self, value: float) -> None:
        """Set the learning rate. Not allowed when ``learning_rate`` is a scheduler."""
        if callable(self._lr_source):
            raise RuntimeError(
                "optimizer's learning rate can't be LRScheduler when invoke this API, because this "
                "will lead to conflict."
            )
        value = as_float("value", value)
        _base.check_number("value", value)
        self._lr_source = value
        self._set_base_lr(value)

    def get_lr(self) -> float:
        """The current learning rate (the scheduler's value when it is one)."""
        if callable(self._lr_source):
            return self._scheduled_lr()
        return self._base_lr()

    def set_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.load_state_dict(state_dict)  # type: ignore[attr-defined]


def _decay(name: str, value: Union[None, float, "L2Decay"]):
    """``(coefficient, mode)`` of a Paddle regulariser: None, a float (L2), L2Decay or L1Decay."""
    if value is None:
        return 0.0, "l2"
    if isinstance(value, L2Decay):
        return value.coeff, value.mode
    return as_float(name, value), "l2"


def _groups(parameters: Any, renames: Dict[str, str], betas=None) -> List[Dict[str, Any]]:
    renames = {"learning_rate": "lr_scale", **renames}
    return rename_group_keys(
        parameters, renames, ("beta1", "beta2") if betas is not None else None, betas
    )


def _check_multi_precision(opt: torch.optim.Optimizer, multi_precision: bool) -> None:
    if not multi_precision:
        return
    low = [p for g in opt.param_groups for p in g["params"] if p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise NotImplementedError(
            "multi_precision=True with float16/bfloat16 parameters (fp32 master weights) is not "
            "supported by this optimizer yet; use float32 parameters"
        )


# ------------------------------------------------------------------------------------------------
# optimizers
# ------------------------------------------------------------------------------------------------


class Lamb(_PaddleAPI, _LAMB):
    r"""``paddle.optimizer.Lamb`` on :class:`scaleopt.LAMB`.

    .. math::
        m_t = \beta_1 m + (1-\beta_1)g,\quad v_t = \beta_2 v + (1-\beta_2)g^2,\quad
        r_t = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)}+\epsilon} + \lambda w,\quad
        w \leftarrow w - \eta\,\frac{\lVert w\rVert}{\lVert r_t\rVert}\, r_t

    The ratio is 1 when either norm is 0, and for a tensor whose decay is 0 (``lamb_weight_decay=0``
    or excluded by ``exclude_from_weight_decay_fn``) unless ``always_adapt=True``.

    Args:
        learning_rate (float or LRScheduler, default 0.001): the learning rate.
        lamb_weight_decay (float, default 0.01): the decay inside the trust ratio.
        beta1 (float, default 0.9), beta2 (float, default 0.999), epsilon (float, default 1e-6):
            the moments' rates and the denominator's epsilon.
        parameters: the parameters (required), as tensors or ``model.named_parameters()``.
        grad_clip: ``ClipGradByGlobalNorm``, ``ClipGradByNorm``, ``ClipGradByValue`` or None.
        exclude_from_weight_decay_fn (callable(name) -> bool or None): no decay where True.
        multi_precision (bool, default False): float32 master weights and moments for
            float16/bfloat16 parameters.
        always_adapt (bool, default False): the trust ratio also for tensors without decay.
        name (str or None): kept for Paddle's signature.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(learning_rate=0.01, parameters=model.named_parameters(),
        ...            exclude_from_weight_decay_fn=lambda name: name.endswith(".bias"))
        >>> loss = model(torch.randn(8, 4)).square().mean()
        >>> _ = opt.minimize(loss); opt.clear_grad()
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        lamb_weight_decay: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        parameters: Any = None,
        grad_clip: Any = None,
        exclude_from_weight_decay_fn: Optional[Callable[[str], bool]] = None,
        multi_precision: bool = False,
        always_adapt: bool = False,
        name: Optional[str] = None,
    ) -> None:
        lr = self._paddle_init(learning_rate, parameters)
        self._arg_names = {**self._arg_names, "weight_decay": "lamb_weight_decay"}
        if exclude_from_weight_decay_fn is not None and not callable(exclude_from_weight_decay_fn):
            raise TypeError("exclude_from_weight_decay_fn must be callable(name) -> bool")
        self.name = name
        super().__init__(
            _groups(parameters, {"lamb_weight_decay": "weight_decay", "epsilon": "eps"},
                    (beta1, beta2)),
            lr=lr,
            betas=(as_float("beta1", beta1), as_float("beta2", beta2)),
            eps=as_float("epsilon", epsilon),
            weight_decay=as_float("lamb_weight_decay", lamb_weight_decay),
            weight_decay_mode="update",
            bias_correction=True,
            always_adapt=always_adapt,
            exclude_from_weight_decay=exclude_from_weight_decay_fn,
            master_weights=bool(multi_precision),
            **_clip_options(grad_clip),
        )
        self._after_init()


class AdamW(_PaddleAPI, _AdamW):
    r"""``paddle.optimizer.AdamW`` on :class:`scaleopt.AdamW` (decoupled decay, then Adam).

    .. math::
        w \leftarrow w - \eta\rho\lambda w,\qquad
        w \leftarrow w - \eta\rho\,\frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)}+\epsilon}

    with :math:`\rho` = ``lr_ratio(name)`` (1 by default). ``apply_decay_param_fun(name)`` returns
    whether a parameter is decayed (all are when it is None).

    Args:
        learning_rate (float or LRScheduler, default 0.001), beta1 (0.9), beta2 (0.999),
        epsilon (1e-8), parameters (required), weight_decay (0.01), lr_ratio (callable(name) ->
        float or None), apply_decay_param_fun (callable(name) -> bool or None), grad_clip (None),
        lazy_mode (False: the same numbers for dense gradients), multi_precision (False; True
        keeps float32 master weights of float16/bfloat16 parameters, as ``master_weights``
        does in scaleopt.AdamW), amsgrad (False), name (None).
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        parameters: Any = None,
        weight_decay: float = 0.01,
        lr_ratio: Optional[Callable[[str], float]] = None,
        apply_decay_param_fun: Optional[Callable[[str], bool]] = None,
        grad_clip: Any = None,
        lazy_mode: bool = False,
        multi_precision: bool = False,
        amsgrad: bool = False,
        name: Optional[str] = None,
    ) -> None:
        lr = self._paddle_init(learning_rate, parameters)
        self._arg_names = {**self._arg_names, "exclude_from_weight_decay": "apply_decay_param_fun"}
        if apply_decay_param_fun is not None and not callable(apply_decay_param_fun):
            raise TypeError("apply_decay_param_fun must be callable(name) -> bool")
        if lr_ratio is not None and not callable(lr_ratio):
            raise TypeError("lr_ratio must be callable(name) -> float")
        self.name = name
        groups = _groups(parameters, {"epsilon": "eps"}, (beta1, beta2))
        if lr_ratio is not None:
            groups = _split_by_lr_ratio(groups, lr_ratio)
        exclude = _negate(apply_decay_param_fun) if apply_decay_param_fun is not None else None
        super().__init__(
            groups,
            lr=lr,
            betas=(as_float("beta1", beta1), as_float("beta2", beta2)),
            eps=as_float("epsilon", epsilon),
            weight_decay=as_float("weight_decay", weight_decay),
            amsgrad=amsgrad,
            exclude_from_weight_decay=exclude,
            master_weights=bool(multi_precision),
            **_clip_options(grad_clip),
        )
        self._after_init()


class _negate:
    """Paddle's "decay this name" rule as scaleopt's "exclude this name" rule (an object, not a
    closure, so that the optimizer can be pickled when the rule can)."""

    def __init__(self, rule: Callable[[str], bool]) -> None:
        self.rule = rule

    def __call__(self, name: str) -> bool:
        return not self.rule(name)


def _split_by_lr_ratio(groups: List[Dict[str, Any]], lr_ratio: Callable[[str], float]):
    out = []
    for g in groups:
        names = g.get("param_names")
        if names is None:
            raise ValueError("lr_ratio is a rule on parameter names: pass model.named_parameters()")
        by_ratio: Dict[float, Dict[str, Any]] = {}
        for p, n in zip(g["params"], names):
            r = as_float("lr_ratio(name)", lr_ratio(n))
            sub = by_ratio.setdefault(
                r, {**g, "params": [], "param_names": [], "lr_scale": g.get("lr_scale", 1.0) * r}
            )
            sub["params"].append(p)
            sub["param_names"].append(n)
        out.extend(by_ratio.values())
    return out


class Momentum(_PaddleAPI, _Momentum):
    r"""``paddle.optimizer.Momentum``: :math:`v = \mu v + g`, :math:`w \leftarrow w - \eta v`
    (Nesterov: :math:`w \leftarrow w - \eta(g + \mu v)`).

    ``weight_decay`` is a float or :class:`L2Decay` (coupled, ``g += c*w``) or :class:`L1Decay`
    (``g += c*sign(w)``), added after gradient clipping, as Paddle does.

    Args:
        learning_rate (float or LRScheduler, default 0.001), momentum (0.9), parameters
        (required), use_nesterov (False), weight_decay (None), grad_clip (None),
        multi_precision (False), rescale_grad (1.0), use_multi_tensor (False: the multi-tensor
        path is used either way), name (None).
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        momentum: float = 0.9,
        parameters: Any = None,
        use_nesterov: bool = False,
        weight_decay: Union[None, float, L2Decay] = None,
        grad_clip: Any = None,
        multi_precision: bool = False,
        rescale_grad: float = 1.0,
        use_multi_tensor: bool = False,
        name: Optional[str] = None,
    ) -> None:
        lr = self._paddle_init(learning_rate, parameters)
        self.name = name
        wd, mode = _decay("weight_decay", weight_decay)
        super().__init__(
            _groups(parameters, {}),
            lr=lr,
            momentum=as_float("momentum", momentum),
            nesterov=use_nesterov,
            weight_decay=wd,
            weight_decay_mode=mode,
            rescale_grad=as_float("rescale_grad", rescale_grad),
            **_clip_options(grad_clip),
        )
        self._after_init()
        _check_multi_precision(self, multi_precision)


class DGCMomentumOptimizer(_PaddleAPI, _DGCMomentum):
    r"""``paddle.fluid.optimizer.DGCMomentumOptimizer`` on :class:`scaleopt.DGCMomentum`:
    Deep Gradient Compression momentum over ``torch.distributed`` (Paddle's runs on GPUs in
    static graphs only; this runs wherever torch does).

    Before ``rampup_begin_step``: :class:`Momentum` with a dense all-reduce. After it, the
    sparsity walks ``sparsity`` over ``rampup_step`` steps with Paddle's index, then its last
    entry holds; tensors below 16384 elements stay dense. ``local_grad_clip_norm`` clips each
    local gradient by norm at ``local_grad_clip_norm * num_trainers ** -0.5`` (``num_trainers``
    defaults to the process group's size). ``regularization`` (:class:`L2Decay` /
    :class:`L1Decay` or a float, L2) is added to the local gradient before the momentum
    correction. ``grad_clip`` must be :class:`ClipGradByNorm` (each local gradient clipped by its
    own norm), anything else raises ``TypeError``, as Paddle documents.

    Args:
        learning_rate (float or LRScheduler), momentum (float), rampup_begin_step (int),
        rampup_step (int, default 1), sparsity (list, default [0.999]), use_nesterov (False),
        local_grad_clip_norm (None), num_trainers (None), regularization (None),
        grad_clip (None), parameters (required), name (None).
        mesh (keyword only; not Paddle's): the 2-D (replicate, shard) mesh of HSDP, for
            sharded parameters, as in :class:`scaleopt.DGCMomentum`.
    """

    _arg_names = {"lr": "learning_rate"}

    def __init__(
        self,
        learning_rate: Any,
        momentum: float,
        rampup_begin_step: int,
        rampup_step: int = 1,
        sparsity: Any = (0.999,),
        use_nesterov: bool = False,
        local_grad_clip_norm: Optional[float] = None,
        num_trainers: Optional[int] = None,
        regularization: Union[None, float, L2Decay] = None,
        grad_clip: Any = None,
        parameters: Any = None,
        name: Optional[str] = None,
        *,
        mesh: Any = None,
    ) -> None:
        if grad_clip is not None and not isinstance(grad_clip, ClipGradByNorm):
            raise TypeError(
                "The type of grad_clip should be 'ClipGradByNorm', because DGCMomentumOptimizer "
                f"only supports ClipGradByNorm; got {type(grad_clip).__name__}"
            )
        lr = self._paddle_init(learning_rate, parameters)
        self.name = name
        wd, mode = _decay("regularization", regularization)
        super().__init__(
            _groups(parameters, {}),
            lr=lr,
            momentum=as_float("momentum", momentum),
            nesterov=use_nesterov,
            weight_decay=wd,
            weight_decay_mode=mode,
            sparsity=list(sparsity),
            rampup_begin_step=rampup_begin_step,
            rampup_step=rampup_step,
            local_grad_clip_norm=None if local_grad_clip_norm is None else as_float(
                "local_grad_clip_norm", local_grad_clip_norm),
            num_workers=num_trainers,
            clip_grad_norm_per_tensor=None if grad_clip is None else grad_clip.clip_norm,
            mesh=mesh,
        )
        self._after_init()
