"""The shared optimizer base: parameter groups, names, name rules, validation, gradient intake."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import (Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import torch
from torch import Tensor

from . import _blocks
from ._compile import eager
from ._sharding import ShardSums, Steps, any_dtensor, local, settle_together

NameRule = Union[None, str, Sequence[str], Callable[[str], bool]]

#: Group keys that are not hyperparameters but may appear in a param group.
_BOOKKEEPING_KEYS = frozenset({"params", "param_names", "initial_lr"})


# ------------------------------------------------------------------------------------------------
# validation helpers
# ------------------------------------------------------------------------------------------------


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_number(
    name: str,
    value: Any,
    *,
    low: Optional[float] = 0.0,
    low_open: bool = False,
    high: Optional[float] = None,
    high_open: bool = True,
    allow_none: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is a finite number in range."""
    if value is None and allow_none:
        return
    if not _is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    bad = math.isnan(value) or math.isinf(value)
    if low is not None:
        bad = bad or value < low or (low_open and value == low)
    if high is not None:
        bad = bad or value > high or (high_open and value == high)
    if bad:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        rng = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number in {rng})")


def check_betas(value: Any, names: Tuple[str, str] = ("betas[0]", "betas[1]")) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {value!r}")
    for name, b in zip(names, value):
        check_number(name, b, low=0.0, high=1.0, high_open=True)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (choose one of {list(choices)})")


def check_optional_bool(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_name_rule(name: str, rule: Any) -> None:
    if rule is None or callable(rule) or isinstance(rule, str):
        rules = [] if rule is None or callable(rule) else [rule]
    elif isinstance(rule, (list, tuple)) and all(isinstance(r, str) for r in rule):
        rules = list(rule)
    else:
        raise TypeError(
            f"{name} must be None, a regex, a list of regexes or a callable(name) -> bool, "
            f"got {rule!r}"
        )
    for r in rules:
        try:
            re.compile(r)
        except re.error as exc:
            raise ValueError(f"Invalid {name}: {r!r} is not a valid regular expression ({exc})")


def _checked_value_clip(cv: Any) -> Any:
    """``clip_grad_value`` checked: None, a positive number, or a ``(min, max)`` pair (as
    floats)."""
    if not isinstance(cv, (tuple, list)):
        check_number("clip_grad_value", cv, low=0.0, low_open=True, allow_none=True)
        return cv
    if len(cv) != 2:
        raise TypeError(f"clip_grad_value must be a number or a (min, max) pair, got {cv!r}")
    check_number("clip_grad_value[0]", cv[0], low=None)
    check_number("clip_grad_value[1]", cv[1], low=None)
    if not cv[0] < cv[1]:
        raise ValueError(f"Invalid clip_grad_value: {cv!r} (needs min < max)")
    return (float(cv[0]), float(cv[1]))


def _rule_is_set(rule: NameRule) -> bool:
    return rule is not None and not (isinstance(rule, (list, tuple)) and len(rule) == 0)


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


def _freeze_rule(rule: NameRule, names: Sequence[str]) -> NameRule:
    """A callable rule as the equivalent list of anchored, escaped names (serialisable)."""
    if not callable(rule):
        return list(rule) if isinstance(rule, tuple) else rule
    return ["^" + re.escape(n) + "$" for n, hit in zip(names, match_names(rule, names)) if hit]


# ------------------------------------------------------------------------------------------------
# parameters in
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# the base class
# ------------------------------------------------------------------------------------------------


class GradScalars(NamedTuple):
    """A deferred group's gradient scalars (see :meth:`ScaleOptimizer._intake`)."""

    #: per tensor, the float its raw gradient is to be taken times
    mults: List[float]
    #: per tensor, the raw gradient's sum of squares (float64) where the clipping computed it
    #: with the consumer's sum of squares; else None
    sq_sums: Optional[Tensor]
    #: ``clip_grad_value`` to clamp the product to (element-wise clipping, when no norm
    #: clipping follows it), or None
    clamp: Any = None


def apply_grad_scalars(grads: List[Tensor], scalars: Optional[GradScalars]) -> List[Tensor]:
    """The gradients with their deferred scalars applied (new tensors), for the implementations
    that do not take them as they read the gradients."""
    if scalars is None:
        return grads
    return _blocks.clip_by_value(torch._foreach_mul(grads, scalars.mults), scalars.clamp)


class Deferral(NamedTuple):
    """A consumer that applies the gradients' scalar transforms itself as it reads them."""

    #: ``(group, params) -> bool``: whether it does for this group
    accepts: Callable[[Dict[str, Any], List[Tensor]], bool]
    #: ``grads -> float64 vector or None``: its sum of squares, for the norms the clippings
    #: need (None where it does not take these tensors; the norms then come from torch)
    sums_of_squares: Callable[[List[Tensor]], Optional[Tensor]]
    #: ``grad -> bool``: its test for inf/NaN (for ``check_finite``), or None for torch's
    any_nonfinite: Optional[Callable[[Tensor], bool]] = None


@dataclasses.dataclass
class GroupGrads:
    """One group's gradients as :meth:`ScaleOptimizer._intake` hands them over."""

    group: Dict[str, Any]
    #: the positions in ``group["params"]`` of the parameters that have a gradient
    idx: List[int]
    params: List[Tensor]
    #: transformed gradients, or for a deferred group the raw ones (see ``scalars``)
    grads: List[Tensor]
    #: a deferred group's scalars (None where nothing scales or the group is not deferred)
    scalars: Optional[GradScalars] = None
    deferred: bool = False
    #: a deferred group's raw gradients' norms, where a clipping needs them
    norms: Optional[Tensor] = None
    #: for sharded (DTensor) parameters, whose ``grads`` are the local shards: the
    #: :class:`~scaleopt._sharding.ShardSums` that totals sums over their shards
    shard_sums: Optional[ShardSums] = None
    #: a sharded group's gradients' norms (whole tensors) as handed over, where a clipping
    #: computed them
    grad_norms: Optional[Tensor] = None


class Intake(list):
    """The :class:`GroupGrads` of a step (empty when ``skipped``)."""

    #: the step is to be skipped: an inf/NaN gradient (see :meth:`ScaleOptimizer._intake`)
    skipped: bool = False


class ScaleOptimizer(torch.optim.Optimizer):
    """Base class of the scaleopt optimizers.

    On top of :class:`torch.optim.Optimizer` it gives every optimizer:

    * ``params`` as tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or group
      dicts; names are kept in each group's ``param_names`` as torch does;
    * validation of every hyperparameter of every group, at construction and in
      :meth:`add_param_group`, raising ``ValueError``/``TypeError`` that name the argument; an
      unknown group key is an error, not silently kept;
    * name rules (``exclude_from_*``): a regex, a list of regexes (``re.search`` on the name) or a
      callable on the name. A callable is written into :meth:`state_dict` as the equivalent list of
      anchored names, so checkpoints load with ``weights_only=True``;
    * the gradient intake shared by all optimizers (:meth:`_intake`): ``maximize``,
      ``rescale_grad``, element-wise ``clip_grad_value``, ``clip_grad_norm_per_tensor`` and global
      ``max_grad_norm`` clipping. It never modifies ``p.grad``.
    """

    #: Group keys holding name rules.
    _name_rule_keys: Tuple[str, ...] = ()
    #: Extra group options a subclass (e.g. a front-end) adds to the defaults.
    _extra_defaults: Dict[str, Any] = {}
    #: Option -> the argument name users of a subclass know it by (front-ends), for errors.
    _arg_names: Dict[str, str] = {}
    #: Whether a GradScaler hands the step its scale and inf flag (``grad_scale``,
    #: ``found_inf``) instead of unscaling the gradients itself (see :meth:`_intake`).
    _step_supports_amp_scaling = False

    def _arg(self, key: str) -> str:
        return self._arg_names.get(key, key)

    #: The :class:`~scaleopt._host.HostPipeline` of an offloaded optimizer (its gradients,
    #: masters and weights go through host memory), else None.
    host: Any = None

    def __init__(self, params: Any, defaults: Dict[str, Any]) -> None:
        groups = normalize_params(params)
        super().__init__(groups, {**defaults, **self._extra_defaults})
        self._attach()

    def _attach(self) -> None:
        """Set up what is not part of the pickled state (called by ``__init__`` and after
        unpickling or copying). Subclasses extend it."""

    def _refresh_hyperparameters(self) -> None:
        """Called at the start of every step, before gradients are read. Front-ends override it."""

    # -- groups -------------------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        group = normalize_group(param_group)
        unknown = set(group) - set(self.defaults) - _BOOKKEEPING_KEYS
        if unknown:
            raise ValueError(
                f"Unknown option(s) {sorted(unknown)} in param group for "
                f"{type(self).__name__}; known options: {sorted(self.defaults)}"
            )
        filled = dict(self.defaults)
        filled.update(group)
        for p in filled["params"]:
            if not isinstance(p, Tensor):
                raise TypeError(
                    f"{type(self).__name__} can only optimize Tensors, got {type(p).__name__}"
                )
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters")
        self._validate_group(filled)
        for key in self._name_rule_keys:
            if _rule_is_set(filled.get(key)) and "param_names" not in filled:
                raise ValueError(
                    f"{self._arg(key)} is a rule on parameter names, but the parameters have no names: "
                    f"pass model.named_parameters() or groups with 'param_names'"
                )
        super().add_param_group(group)
        if self.host is not None:
            self.host.track(self.param_groups[-1]["params"])

    def _validate_group(self, group: Dict[str, Any]) -> None:
        """Check a group's hyperparameters (defaults filled in): the learning rate, the gradient
        options :meth:`_intake` reads where the optimizer has them, ``maximize``, ``foreach``
        and the name rules. Subclasses extend this."""
        lr = group["lr"]
        if isinstance(lr, Tensor):  # as torch.optim: a tensor keeps compiled steps from recompiling
            if lr.numel() != 1 or lr.is_complex() or not lr.dtype.is_floating_point:
                raise ValueError(f"{self._arg('lr')} as a tensor must be one real floating-point "
                                 f"value, got {lr.dtype} of shape {tuple(lr.shape)}")
            lr = lr.item()
        check_number(self._arg("lr"), lr)
        for key in ("rescale_grad", "loss_scale"):
            if key in group:
                check_number(self._arg(key), group[key], low=0.0, low_open=True)
        for key in ("max_grad_norm", "clip_grad_norm_per_tensor"):
            if key in group:
                check_number(self._arg(key), group[key], low=0.0, low_open=True, allow_none=True)
        if "clip_grad_value" in group:
            group["clip_grad_value"] = _checked_value_clip(group["clip_grad_value"])
        if "maximize" in group:
            check_bool(self._arg("maximize"), group["maximize"])
        if "foreach" in group:
            check_optional_bool("foreach", group["foreach"])
        for key in self._name_rule_keys:
            check_name_rule(self._arg(key), group.get(key))

    def _validate_adam_group(self, group: Dict[str, Any]) -> None:
        """Checks shared by the Adam-family optimizers: betas, eps, weight_decay."""
        a = self._arg
        check_betas(group["betas"], (a("betas[0]"), a("betas[1]")))
        check_number(a("eps"), group["eps"])
        check_number(a("weight_decay"), group["weight_decay"])

    #: Attributes a copy or an unpickled optimizer does not take over: ``_attach`` and the host
    #: options rebuild them (torch's hooks, ``_optimizer_*``, are not copied either, as in torch).
    _not_pickled: Tuple[str, ...] = ("host", "_master_weights")

    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in self._not_pickled and not k.startswith("_optimizer_")}
        if self.host is not None:
            state["host_options"] = self.host.options()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        host_options = state.pop("host_options", None)
        unpickled = "defaults" in state  # not torch's load_state_dict, which passes no defaults
        options = set(state["defaults"] if unpickled else self.defaults)
        super().__setstate__(state)
        if "differentiable" not in options:  # torch adds it; these optimizers have no such option
            self.defaults.pop("differentiable", None)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for st in self.state.values():  # checkpoints of torch < 1.12 and of many ports
            if "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        if unpickled:
            self._attach()
        if host_options is not None:
            from ._host import attach_host

            attach_host(self, **host_options)

    # -- names --------------------------------------------------------------------------------

    @eager
    def _rule_flags(self, group: Dict[str, Any], key: str) -> Tuple[bool, ...]:
        """Per parameter of ``group``: whether the name rule ``group[key]`` selects it."""
        rule = group.get(key)
        if not _rule_is_set(rule):
            return (False,) * len(group["params"])
        return match_names(rule, group["param_names"])

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        for g in sd["param_groups"]:
            for key in self._name_rule_keys:
                if callable(g.get(key)):
                    g[key] = _freeze_rule(g[key], g["param_names"])
        return sd

    # -- gradients ----------------------------------------------------------------------------

    def _intake(self, value_clip: bool = True, defer: Optional[Deferral] = None, *,
                skip_nonfinite: bool = False, check_finite: bool = False) -> Intake:
        """Each group's parameters that have a gradient, and their gradients.

        The gradients are after ``maximize`` (negation), unscaling (``rescale_grad``, a
        group's ``loss_scale``, and a :class:`torch.amp.GradScaler`'s scale when the optimizer
        says ``_step_supports_amp_scaling``), ``clip_grad_value`` (unless ``value_clip=False``:
        the optimizer applies it itself), ``clip_grad_norm_per_tensor`` and, last, global
        ``max_grad_norm`` clipping, whose norm is taken over every gradient of every group.
        New tensors are made only for the transforms in use; ``p.grad`` itself is never
        written. An offloaded optimizer reads host copies of the gradients (``self.host``).

        With ``defer``, a group it accepts (unless element-wise clipping comes before a norm
        clipping) keeps its raw gradients, and the scalar transforms (sign, unscaling, both
        norm clippings) come in ``scalars`` as one float per tensor that the consumer
        multiplies the gradient by (then clamps, for element-wise clipping) as it reads it (the
        fused CPU kernels do, which saves a pass over the gradients and a copy of them); the
        norms the clippings need are those of the scaled gradients, from one read of the raw
        ones.

        With ``skip_nonfinite``, the result is empty and ``skipped`` when the GradScaler found
        an inf/NaN, when the global clipping norm is not finite, or (``check_finite``, without
        global clipping) when a gradient holds an inf/NaN.
        """
        self._refresh_hyperparameters()
        if skip_nonfinite and _found_inf(self):
            return _skipped()
        staged = settle_together([self._collect(group, value_clip, defer)
                                  for group in self.param_groups])
        finite = True
        if any(s.group.get("max_grad_norm") is not None for s in staged):
            total = _clip_by_global_norm(staged)
            finite = not skip_nonfinite or bool(torch.isfinite(total))  # a host read: opt-in
        elif check_finite:
            test = _torch_any_nonfinite if defer is None or defer.any_nonfinite is None \
                else defer.any_nonfinite
            finite = not any(test(g) for s in staged for g in s.grads)
        if skip_nonfinite and not finite:
            return _skipped()
        return Intake([s for s in staged if s.params])

    def _unscale(self, group: Dict[str, Any]) -> float:
        """The factor a group's raw gradients are unscaled by: ``rescale_grad``, divided by the
        group's ``loss_scale`` and by a GradScaler's scale (when the optimizer takes it)."""
        amp = getattr(self, "grad_scale", None) if self._step_supports_amp_scaling else None
        factor = group.get("rescale_grad", 1.0)
        if amp is not None:
            factor = factor * (1.0 / float(amp))
        return factor / group.get("loss_scale", 1.0)

    def _collect(self, group: Dict[str, Any], value_clip: bool,
                 defer: Optional[Deferral]) -> Steps:
        """One group's gradients, transformed (or, deferred, their scalars) but for the global
        clipping (a :class:`GroupGrads`), as steps: for sharded parameters, they yield the
        gradients' sums to total over the shards (see ``scaleopt._sharding``)."""
        idx, params, grads = [], [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients "
                                   f"(parameter {self._param_label(group, i)})")
            idx.append(i)
            params.append(p)
            grads.append(p.grad if self.host is None else self.host.host_grad(p))
        item = GroupGrads(group, idx, params, grads)
        if any_dtensor(params):  # from here on the local shards, norms totalled over them
            item.shard_sums = ShardSums(params)
            item.grads = grads = local(grads)
        clamp = group.get("clip_grad_value") if value_clip else None
        per_tensor = group.get("clip_grad_norm_per_tensor")
        norm_clip = per_tensor is not None or group.get("max_grad_norm") is not None
        item.deferred = (bool(grads) and defer is not None and defer.accepts(group, params)
                         and not (clamp is not None and norm_clip))
        unscale = self._unscale(group)
        if item.deferred:
            item.scalars, item.norms = yield from _deferred_scalars(
                group, grads, unscale, clamp, defer, item.shard_sums)
        elif grads:
            if group.get("maximize", False):
                grads = torch._foreach_neg(grads)
            grads = _blocks.scale(grads, unscale)
            grads = _blocks.clip_by_value(grads, clamp)
            if item.shard_sums is None:
                item.grads = _blocks.clip_by_tensor_norm(grads, per_tensor)
            elif norm_clip:  # whole-tensor norms: one reduction, shared with the global clip
                norms = yield item.shard_sums.norms_request(grads)
                if per_tensor is not None:
                    coefs = _blocks.clip_coef(norms, per_tensor)
                    grads = _blocks.scale_each(grads, coefs)
                    norms = norms * coefs
                item.grads, item.grad_norms = grads, norms
            else:
                item.grads = grads
        return item

    @staticmethod
    def _param_label(group: Dict[str, Any], i: int) -> str:
        names = group.get("param_names")
        return repr(names[i]) if names else f"#{i}"

    def _closure_loss(self, closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


def _deferred_scalars(group: Dict[str, Any], grads: List[Tensor], unscale: float, clamp: Any,
                      defer: Deferral, shard_sums: Optional[ShardSums] = None) -> Steps:
    """A deferred group's scalars before global clipping (None when all multipliers are 1 and
    nothing clips), and the raw gradients' norms where a clipping needs them, as steps (which
    return them)."""
    base = (-1.0 if group.get("maximize", False) else 1.0) * unscale
    per_tensor, global_clip = group.get("clip_grad_norm_per_tensor"), group.get("max_grad_norm")
    if base == 1.0 and per_tensor is None and global_clip is None and clamp is None:
        return None, None
    sums = norms = None
    if per_tensor is not None or global_clip is not None:
        sums = defer.sums_of_squares(grads)
        if shard_sums is not None:  # over the whole tensors
            local_sums = _blocks.sq_norms(grads).double() if sums is None else sums
            sums = yield shard_sums.request(local_sums, range(len(grads)))
        norms = _blocks.norms(grads) if sums is None else sums.sqrt().to(torch.float32)
    mults = [base] * len(grads)
    if per_tensor is not None:
        coefs = _blocks.clip_coef(norms * unscale, per_tensor).tolist()
        mults = [base * c for c in coefs]
    return GradScalars(mults, sums, clamp), norms


def _clip_by_global_norm(staged: List[GroupGrads]) -> Tensor:
    """``max_grad_norm``: scale the gradients of the groups that set it by ``c / max(||g||,
    c)``, ``||g||`` (returned) over every gradient of every group (deferred ones: into their
    scalars)."""
    total = _blocks.global_norm([t for s in staged if not s.deferred and s.grad_norms is None
                                 for t in s.grads])
    scaled = [(s.norms * torch.tensor(s.scalars.mults, dtype=s.norms.dtype).abs()).square().sum()
              for s in staged if s.deferred and s.norms is not None]
    scaled += [s.grad_norms.square().sum() for s in staged if s.grad_norms is not None]
    if scaled:
        total = (total.square() + torch.stack(scaled).sum().to(total.device)).sqrt()
    for s in staged:
        if s.group.get("max_grad_norm") is None or not s.grads:
            continue
        coef = _blocks.clip_coef(total, s.group["max_grad_norm"])
        if s.deferred:
            c = float(coef)  # a CPU scalar: deferred groups are host ones
            s.scalars = s.scalars._replace(mults=[m * c for m in s.scalars.mults])
        else:
            s.grads = _blocks.scale(s.grads, coef)
            if s.grad_norms is not None:
                s.grad_norms = s.grad_norms * coef
    return total


def _found_inf(opt: Any) -> bool:
    """Whether a GradScaler handed the optimizer an inf/NaN found in the gradients."""
    found = getattr(opt, "found_inf", None) if opt._step_supports_amp_scaling else None
    return found is not None and float(found) != 0.0


def _skipped() -> Intake:
    out = Intake()
    out.skipped = True
    return out


def _torch_any_nonfinite(t: Tensor) -> bool:
    return not bool(torch.isfinite(t).all())
