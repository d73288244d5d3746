"""MXNet front-ends: ``mxnet.optimizer.LAMB`` and ``LANS`` with MXNet's names and semantics.

- ``lower_bound`` / ``upper_bound`` clamp ``||w||`` before the zero test; ``None``, 0 or a
  negative bound means unset, as in MXNet.
- ``clip_gradient`` clips element-wise after ``rescale_grad`` (LAMB) or after the gradient
  normalisation (LANS); ``None``, 0 or negative means no clipping.
- ``wd`` defaults to 0 and the trust ratio applies to every tensor, decayed or not.
- ``param_idx2name`` maps parameter indices (their order in ``params``) to names; as in MXNet 1.x,
  every name that does not end in ``_weight`` or ``_gamma`` gets no weight decay.
  ``set_lr_mult`` / ``set_wd_mult`` take ``{name or index: multiplier}``.
- ``multi_precision=True`` keeps float32 master weights for float16/bfloat16 parameters.
- ``LANS(use_fused_step=False)`` reproduces MXNet's ``LANS.step()`` (the second part decays the
  weight already moved by the first part); ``use_fused_step=True`` (the default) is the fused
  kernel's and the paper's semantics. For LAMB, ``use_fused_step`` and ``aggregate_num`` pick
  MXNet kernels with the same math and change nothing here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from .._params import normalize_params
from ..lamb import LAMB as _LAMB
from ..lans import LANS as _LANS
from ._common import as_float

__all__ = ["LAMB", "LANS"]

Key = Union[int, str]

_MX_ARGS = {
    "lr": "learning_rate",
    "betas[0]": "beta1",
    "betas[1]": "beta2",
    "eps": "epsilon",
    "weight_decay": "wd",
    "clip_grad_value": "clip_gradient",
    "master_weights": "multi_precision",
}


def _bound(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    value = as_float(name, value)
    return value if value > 0 else None


def _clip(value: Any) -> Optional[float]:
    if value is None:
        return None
    value = as_float("clip_gradient", value)
    return value if value > 0 else None


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid {name}: {value!r} (must be an int >= 0)")


class _MXNetAPI:
    """Per-parameter ``lr_mult`` / ``wd_mult`` by name or index, and MXNet's name rule."""

    _arg_names = _MX_ARGS

    def _mx_setup(self, params: Any, param_idx2name: Optional[Dict[Key, str]]) -> List[Dict[str, Any]]:
        groups = normalize_params(params)
        flat = [p for g in groups for p in g["params"]]
        if param_idx2name is not None:
            if not isinstance(param_idx2name, dict):
                raise TypeError("param_idx2name must be a dict {index: name}")
            idx2name = {}
            for k, n in param_idx2name.items():
                i = int(k)
                if not 0 <= i < len(flat):
                    raise ValueError(f"param_idx2name: index {k!r} is not a parameter index")
                idx2name[i] = str(n)
        else:
            idx2name = {}
        names = [n for g in groups for n in g.get("param_names", [None] * len(g["params"]))]
        # by position in the parameter list (MXNet's index), not by object, so that copies and
        # unpickled optimizers find them
        self._mx_names = [idx2name.get(i, names[i]) for i in range(len(flat))]
        self.idx2name = idx2name
        self.lr_mult: Dict[Key, float] = {}
        self.wd_mult: Dict[Key, float] = {}
        self.set_wd_mult({})
        return groups

    def _mx_options(self, learning_rate, beta1, beta2, epsilon, lower_bound, upper_bound, wd,
                    rescale_grad, clip_gradient, multi_precision, aggregate_num,
                    use_fused_step) -> Dict[str, Any]:
        """MXNet's shared arguments as scaleopt options (the ratio applies to every tensor)."""
        _check_int("aggregate_num", aggregate_num)
        if not isinstance(use_fused_step, bool):
            raise TypeError(f"use_fused_step must be True or False, got {use_fused_step!r}")
        self.aggregate_num = aggregate_num
        self.use_fused_step = use_fused_step
        return dict(
            lr=as_float("learning_rate", learning_rate),
            betas=(as_float("beta1", beta1), as_float("beta2", beta2)),
            eps=as_float("epsilon", epsilon),
            weight_decay=as_float("wd", wd),
            always_adapt=True,
            lower_bound=_bound("lower_bound", lower_bound),
            upper_bound=_bound("upper_bound", upper_bound),
            clip_grad_value=_clip(clip_gradient),
            rescale_grad=as_float("rescale_grad", rescale_grad),
            master_weights=multi_precision,
        )

    def set_lr_mult(self, args_lr_mult: Dict[Key, float]) -> None:
        """Learning-rate multipliers by parameter name or index (replaces earlier ones)."""
        self.lr_mult = {k: as_float(f"lr_mult[{k!r}]", v) for k, v in dict(args_lr_mult).items()}

    def set_wd_mult(self, args_wd_mult: Dict[Key, float]) -> None:
        """Weight-decay multipliers by name or index. As in MXNet, names from ``param_idx2name``
        that end in neither ``_weight`` nor ``_gamma`` get 0 unless given here."""
        self.wd_mult = {n: 0.0 for n in self.idx2name.values()
                        if not (n.endswith("_weight") or n.endswith("_gamma"))}
        self.wd_mult.update({k: as_float(f"wd_mult[{k!r}]", v) for k, v in dict(args_wd_mult).items()})

    def _mult(self, table: Dict[Key, float], i: int) -> float:
        """The multiplier of the ``i``-th parameter (MXNet's index) in ``table``."""
        if i in table:
            return table[i]
        name = self._mx_names[i] if i < len(self._mx_names) else None  # groups added later
        return table.get(name, 1.0) if name is not None else 1.0

    def _param_multipliers(self, group, idx):
        groups = self.param_groups  # type: ignore[attr-defined]
        k = next(k for k, g in enumerate(groups) if g is group)
        first = sum(len(g["params"]) for g in groups[:k])
        return ([self._mult(self.lr_mult, first + i) for i in idx],
                [self._mult(self.wd_mult, first + i) for i in idx])

    @property
    def learning_rate(self) -> float:
        return self.param_groups[0]["lr"]  # type: ignore[attr-defined]

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate of every group."""
        lr = as_float("lr", lr)
        for g in self.param_groups:  # type: ignore[attr-defined]
            g["lr"] = lr

    @property
    def wd(self) -> float:
        return self.param_groups[0]["weight_decay"]  # type: ignore[attr-defined]


class LAMB(_MXNetAPI, _LAMB):
    r"""``mxnet.optimizer.LAMB`` on :class:`scaleopt.LAMB`.

    .. math::
        g \leftarrow \mathrm{clip}(g\cdot\text{rescale_grad}),\quad
        u = \frac{m_t/(1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t)}+\epsilon} + \text{wd}\,w,\quad
        w \leftarrow w - \eta\,\frac{\phi(\lVert w\rVert)}{\lVert u\rVert}\,u

    (no bias correction with ``bias_correction=False``; ratio 1 when ``phi(||w||)`` or
    ``||u||`` is 0.)

    Args:
        params: tensors, ``(name, tensor)`` pairs or group dicts.
        learning_rate (0.001), beta1 (0.9), beta2 (0.999), epsilon (1e-6), lower_bound (None),
        upper_bound (None), bias_correction (True), wd (0.0), rescale_grad (1.0),
        clip_gradient (None), param_idx2name (None), multi_precision (False), aggregate_num (0),
        use_fused_step (True).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LAMB(list(model.parameters()), learning_rate=0.01, wd=0.01,
        ...            param_idx2name={0: "dense0_weight", 1: "dense0_bias"})
        >>> opt.wd_mult
        {'dense0_bias': 0.0}
    """

    def __init__(
        self,
        params: Any,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        lower_bound: Optional[float] = None,
        upper_bound: Optional[float] = None,
        bias_correction: bool = True,
        wd: float = 0.0,
        rescale_grad: float = 1.0,
        clip_gradient: Optional[float] = None,
        param_idx2name: Optional[Dict[Key, str]] = None,
        multi_precision: bool = False,
        aggregate_num: int = 0,
        use_fused_step: bool = True,
    ) -> None:
        options = self._mx_options(learning_rate, beta1, beta2, epsilon, lower_bound, upper_bound,
                                   wd, rescale_grad, clip_gradient, multi_precision,
                                   aggregate_num, use_fused_step)
        groups = self._mx_setup(params, param_idx2name)
        super().__init__(groups, weight_decay_mode="update", bias_correction=bias_correction,
                         **options)


class LANS(_MXNetAPI, _LANS):
    r"""``mxnet.optimizer.LANS`` on :class:`scaleopt.LANS`.

    ``use_fused_step=True`` (default): both parts decay the pre-step weight (the fused kernel and
    the paper). ``use_fused_step=False``: MXNet's ``step()``, whose second part decays the weight
    already moved by the first part. Either way an all-zero gradient leaves the tensor finite,
    where MXNet's ``step()`` turns it into NaN.

    Args:
        params: tensors, ``(name, tensor)`` pairs or group dicts.
        learning_rate (0.001), beta1 (0.9), beta2 (0.999), epsilon (1e-6), lower_bound (None),
        upper_bound (None), wd (0.0), rescale_grad (1.0), clip_gradient (None),
        param_idx2name (None), multi_precision (False), aggregate_num (4), use_fused_step (True).
    """

    def __init__(
        self,
        params: Any,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        lower_bound: Optional[float] = None,
        upper_bound: Optional[float] = None,
        wd: float = 0.0,
        rescale_grad: float = 1.0,
        clip_gradient: Optional[float] = None,
        param_idx2name: Optional[Dict[Key, str]] = None,
        multi_precision: bool = False,
        aggregate_num: int = 4,
        use_fused_step: bool = True,
    ) -> None:
        options = self._mx_options(learning_rate, beta1, beta2, epsilon, lower_bound, upper_bound,
                                   wd, rescale_grad, clip_gradient, multi_precision,
                                   aggregate_num, use_fused_step)
        groups = self._mx_setup(params, param_idx2name)
        super().__init__(groups, decay_moved_weight=not use_fused_step, **options)
