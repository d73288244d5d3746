"""The shared optimizer base: param groups, names, validation, and where gradients come from.

The rooms beside it: ``_checks`` (argument checks), ``_params`` (parameters in, name rules),
``_intake`` (the gradient intake).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._checks import (check_betas, check_bool, check_choice, check_name_rule, check_number,
                      check_optional_bool, checked_value_clip, near_misses)
from . import _compact
from ._compact import STATE_DTYPES
from ._compile import eager
from ._intake import Deferral, Intake, take
from ._loading import TAG, StateSpec, check_state_dict, tag
from ._params import (BOOKKEEPING_KEYS, freeze_rule, match_names, normalize_group,
                      normalize_params, param_label, rule_is_set)


class InPlace:
    """The gradient source of an optimizer whose update runs where its parameters are: the
    gradients are ``p.grad`` as they are. (The other source is an offloaded optimizer's
    :class:`~scaleopt._host.HostPipeline`: host copies, taken as backward makes them.)"""

    #: whether the update runs in host memory, whatever the parameters' device
    on_host = False

    def grad(self, p: Tensor) -> Tensor:
        return p.grad

    def track(self, params: List[Tensor]) -> None:
        """New parameters of the optimizer (nothing to prepare here)."""

    def attach(self, optimizer: Any) -> None:
        """Become ``optimizer``'s source (a copy's: nothing to do for this one)."""

    def stepping(self) -> Any:
        """Around a step: nothing to do here (a context that ``torch.compile`` traces through)."""
        return contextlib.nullcontext()

    def __reduce__(self) -> str:
        return "IN_PLACE"  # the one instance, also in copies and pickles


IN_PLACE = InPlace()


#: The policies for non-finite gradients (:attr:`ScaleOptimizer.nonfinite`).
NONFINITE = ("propagate", "skip")


def lr_of(group: Dict[str, Any]) -> Any:
    """A group's learning rate: the number, or a tensor learning rate of any one-element shape
    as a 0-d tensor (the form torch's foreach scalars take)."""
    lr = group["lr"]
    return lr.reshape(()) if isinstance(lr, Tensor) else lr


def lr_number(group: Dict[str, Any]) -> float:
    """A group's learning rate as a Python number (for updates computed on the host)."""
    return float(lr_of(group))


def _options_by_optimizer() -> Dict[str, Tuple[str, ...]]:
    """Each public scaleopt optimizer's keyword arguments, by class name (the classes of
    ``scaleopt``'s own modules, not the front-ends of :mod:`scaleopt.compat`)."""
    out, todo = {}, [ScaleOptimizer]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        module = cls.__module__
        if (module.startswith("scaleopt.") and ".compat" not in module
                and not module.rsplit(".", 1)[1].startswith("_")
                and not cls.__name__.startswith("_")):
            out[cls.__name__] = tuple(k for k in inspect.signature(cls.__init__).parameters
                                      if k not in ("self", "params"))
    return dict(sorted(out.items()))


#: Names other frameworks (and scaleopt's front-ends for them) give options.
PORTED_NAMES = {"learning_rate": "lr", "epsilon": "eps", "wd": "weight_decay",
                "weight_decay_rate": "weight_decay", "use_nesterov": "nesterov",
                "multi_precision": "master_weights", "clip_gradient": "clip_grad_value",
                "clipvalue": "clip_grad_value", "clipnorm": "clip_grad_norm_per_tensor",
                "global_clipnorm": "max_grad_norm", "beta1": "betas", "beta2": "betas",
                "beta_1": "betas", "beta_2": "betas",
                "exclude_from_weight_decay_fn": "exclude_from_weight_decay"}


def _read_by_grad_scaler(frame: Any) -> bool:
    """Whether ``frame`` is a :class:`torch.amp.GradScaler`'s ``step`` (or a subclass's)."""
    return (frame is not None and frame.f_code.co_name == "step"
            and isinstance(frame.f_locals.get("self"), torch.amp.GradScaler))


class ScaleOptimizer(torch.optim.Optimizer):
    """Base class of the scaleopt optimizers.

    On top of :class:`torch.optim.Optimizer` it gives every optimizer:

    * ``params`` as tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or group
      dicts; names are kept in each group's ``param_names`` as torch does;
    * validation of every hyperparameter of every group, at construction and in
      :meth:`add_param_group`, raising ``ValueError``/``TypeError`` that name the argument;
    * group keys that are not options kept as :mod:`torch.optim` keeps them (``lr_scale``,
      ``layer_id``, ``name``: trainers annotate their groups and their schedulers read them),
      saved and loaded with the group and unused by the update; a key that looks like a
      misspelt option, that is another framework's name for one (``learning_rate``), or that is
      an option of another scaleopt optimizer only, is warned about once per optimizer and key,
      naming the option it may have meant;
    * ``foreach`` and ``fused`` in every group, as :mod:`torch.optim` means them (``None``: the
      optimizer chooses; ``foreach=True``: multi-tensor ops; ``foreach=False`` with ``fused``
      not True: the per-tensor loop; ``fused=True``: the fused kernels, an error where none can
      run); an optimizer without such a path says so when asked for it;
    * name rules (``exclude_from_*``): a regex, a list of regexes (``re.search`` on the name) or a
      callable on the name. A callable is written into :meth:`state_dict` as the equivalent list of
      anchored names, so checkpoints load with ``weights_only=True``;
    * the gradient intake shared by all optimizers (:meth:`_intake`, ``scaleopt._intake``):
      ``maximize``, ``rescale_grad``, element-wise ``clip_grad_value``,
      ``clip_grad_norm_per_tensor`` and global ``max_grad_norm`` clipping. It never modifies
      ``p.grad``.

    Where the gradients come from is the one thing the base class asks of an offloaded
    optimizer: its gradient source (``_grad_source``), :data:`IN_PLACE` (``p.grad`` as it is)
    or a :class:`~scaleopt._host.HostPipeline` (host copies), also told of new parameters and
    attached again to a copy.
    """

    #: Group keys holding name rules.
    _name_rule_keys: Tuple[str, ...] = ()
    #: Extra group options a subclass (e.g. a front-end) adds to the defaults.
    _extra_defaults: Dict[str, Any] = {}
    #: Option -> the argument name users of a subclass know it by (front-ends), for errors.
    _arg_names: Dict[str, str] = {}
    #: Whether the optimizer has a multi-tensor path (``foreach=True``) and fused kernels
    #: (``fused=True``); asking for one it lacks is a ``ValueError``.
    _multi_tensor = True
    _fused_kernels = False
    #: Whether the step takes a GradScaler's scale and inf flag (``grad_scale``, ``found_inf``)
    #: instead of gradients the scaler unscaled in place (see :meth:`_intake`).
    _takes_amp_scale = False

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch's :class:`~torch.amp.GradScaler` reads this in its ``step`` to hand the step its
        scale and inf flag rather than unscale ``p.grad`` in place first: it is True for that
        reader where the optimizer takes them. Trainers also read the attribute, to ask whether
        the gradients are still scaled when they clip (Lightning refuses ``gradient_clip_val``
        for such optimizers, even under bfloat16 where nothing is scaled); they are told False,
        and unscale through the GradScaler before clipping, after which the scaler hands the
        step no scale. Both ways the step sees each gradient unscaled once."""
        return type(self)._takes_amp_scale and _read_by_grad_scaler(sys._getframe(1))

    #: What a parameter's state holds, checked by :meth:`load_state_dict` (``scaleopt._loading``).
    _state_spec = StateSpec("none", (), ())

    def _state_shape(self, p: Tensor) -> Tuple[int, ...]:
        """The shape of ``p``'s shaped state tensors in a state dict (a DTensor's: its global
        shape, as its state is a DTensor too)."""
        return tuple(p.shape)

    def _arg(self, key: str) -> str:
        return self._arg_names.get(key, key)

    #: Where the step's gradients come from (see :class:`InPlace`).
    _grad_source: Any = IN_PLACE

    @property
    def host(self) -> Any:
        """The :class:`~scaleopt._host.HostPipeline` of an offloaded optimizer (its gradients,
        masters and weights go through host memory), else None."""
        return self._grad_source if self._grad_source.on_host else None

    def __init__(self, params: Any, defaults: Dict[str, Any], *,
                 nonfinite: str = "propagate") -> None:
        groups = normalize_params(params)
        self.nonfinite = nonfinite
        #: steps skipped for an inf/NaN gradient under ``nonfinite="skip"``
        self.skipped_steps = 0
        super().__init__(groups, {"foreach": None, "fused": None, **defaults,
                                  **self._extra_defaults})
        self._attach()

    @property
    def nonfinite(self) -> str:
        """What a step does with an inf/NaN gradient: ``"propagate"`` (the default, as torch's
        optimizers: nothing is checked and the values flow into the update) or ``"skip"``
        (the step changes nothing and is counted in ``skipped_steps``). See
        :doc:`/robustness`."""
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, value: str) -> None:
        check_choice("nonfinite", value, NONFINITE)
        self._nonfinite = value

    def _attach(self) -> None:
        """Set up what is not part of the pickled state (called by ``__init__`` and after
        unpickling or copying). Subclasses extend it."""

    def _refresh_hyperparameters(self) -> None:
        """Called at the start of every step, before gradients are read. Front-ends override it."""

    # -- groups -------------------------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        group = normalize_group(param_group)
        for key in sorted(set(group) - set(self.defaults) - BOOKKEEPING_KEYS):
            self._hint(key)
        filled = dict(self.defaults)
        filled.update(group)
        for i, p in enumerate(filled["params"]):
            if not isinstance(p, Tensor):
                raise TypeError(
                    f"{type(self).__name__} can only optimize Tensors, got {type(p).__name__}"
                )
            if p.is_complex():
                raise ValueError(f"{type(self).__name__} does not support complex parameters")
            if not p.is_floating_point():
                raise TypeError(f"{type(self).__name__} optimizes floating-point tensors only, got "
                                f"a {p.dtype} parameter, {param_label(filled, i)}")
        self._validate_group(filled)
        for key in self._name_rule_keys:
            if rule_is_set(filled.get(key)) and "param_names" not in filled:
                raise ValueError(
                    f"{self._arg(key)} is a rule on parameter names, but the parameters have no names: "
                    f"pass model.named_parameters() or groups with 'param_names'"
                )
        super().add_param_group(group)
        self._grad_source.track(self.param_groups[-1]["params"])

    def _hint(self, key: Any) -> None:
        """Warn, once per optimizer and key, where a group key that is not one of this
        optimizer's options looks like a misspelling of one, is another framework's name for
        one (:data:`PORTED_NAMES`) or is an option of another scaleopt optimizer; the key is
        kept either way."""
        hinted = self.__dict__.setdefault("_hinted", set())  # the keys warned about
        if not isinstance(key, str) or key in hinted:
            return
        name = type(self).__name__
        close = near_misses(key, [k for k in self.defaults if k not in self._not_options])
        owners = [cls for cls, options in _options_by_optimizer().items() if key in options]
        ported = PORTED_NAMES.get(key)
        if close:
            why = f"did you mean {close[0]!r}?"
        elif ported in self.defaults:
            why = f"did you mean {ported!r}? ({key!r} is its name in other frameworks)"
        elif owners:
            why = f"it is an option of {', '.join(owners)}, not of {name}"
        else:
            return
        hinted.add(key)
        warnings.warn(f"param group key {key!r} is not an option of {name} and is kept in the "
                      f"group, unused by the update: {why}", UserWarning, stacklevel=3)

    #: Defaults that are bookkeeping rather than options a user would misspell.
    _not_options: Tuple[str, ...] = ("algorithm",)

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
            group["clip_grad_value"] = checked_value_clip(group["clip_grad_value"])
        if "maximize" in group:
            check_bool(self._arg("maximize"), group["maximize"])
        self._validate_paths(group)
        for key in self._name_rule_keys:
            check_name_rule(self._arg(key), group.get(key))

    def _validate_paths(self, group: Dict[str, Any]) -> None:
        """``foreach`` and ``fused``: each None or a bool, not both True, and only for a path
        this optimizer has (subclasses check that the fused kernels can take the group)."""
        for key in ("foreach", "fused"):
            check_optional_bool(key, group.get(key))
        name = type(self).__name__
        if group.get("fused") and group.get("foreach"):
            raise ValueError("fused=True and foreach=True cannot be set together")
        if group.get("foreach") and not self._multi_tensor:
            raise ValueError(f"foreach=True: {name} has no multi-tensor path (its update runs "
                             f"one tensor at a time); pass foreach=None or False")
        if group.get("fused") and not self._fused_kernels:
            raise ValueError(f"fused=True: {name} has no fused kernels; pass fused=None or False")

    def _validate_adam_group(self, group: Dict[str, Any]) -> None:
        """Checks shared by the Adam-family optimizers: betas, eps, weight_decay and
        ``state_dtype``."""
        a = self._arg
        check_betas(group["betas"], (a("betas[0]"), a("betas[1]")))
        check_number(a("eps"), group["eps"])
        check_number(a("weight_decay"), group["weight_decay"])
        if "state_dtype" in group:
            self._check_state_dtype(group)

    def _computes_in_float32(self, group: Dict[str, Any], p: Tensor) -> bool:
        """Whether ``p``'s update runs in float32: a float32 parameter, or a float16/bfloat16
        one with float32 master weights."""
        return p.dtype == torch.float32 or (
            bool(group.get("master_weights")) and p.dtype in (torch.bfloat16, torch.float16))

    def _check_state_dtype(self, group: Dict[str, Any]) -> None:
        """``state_dtype``: one of :data:`scaleopt._compact.STATE_DTYPES`, and other than
        float32 only for parameters whose update runs in float32."""
        name = self._arg("state_dtype")
        check_choice(name, group["state_dtype"], STATE_DTYPES)
        if group["state_dtype"] == "float32":
            return
        for i, p in enumerate(group["params"]):
            if _compact.form_for(group["state_dtype"], self._state_shape(p)) == "int8":
                _compact.check_layout(p, f"parameter {param_label(group, i)}")
            if not self._computes_in_float32(group, p):
                hint = (" (pass master_weights=True for float32 master weights)"
                        if "master_weights" in group and p.dtype != torch.float64 else "")
                raise ValueError(
                    f"{name}={group['state_dtype']!r} stores moments that the update computes "
                    f"in float32, and {type(self).__name__} updates the {p.dtype} parameter "
                    f"{param_label(group, i)} in {p.dtype}{hint}")

    #: Attributes a copy or an unpickled optimizer does not take over: ``_attach`` rebuilds them
    #: (torch's hooks, ``_optimizer_*``, are not copied either, as in torch). A gradient source
    #: is copied as its options, and attached to the copy.
    _not_pickled: Tuple[str, ...] = ("_master_weights", "_steps_in_backward", "_backward_piece")

    def __getstate__(self) -> Dict[str, Any]:
        # An instance attribute shadowing a method is a wrapper put there by someone else (an LR
        # scheduler wraps ``step``): it is bound to this optimizer, so a copy leaves it behind
        # and steps itself, as torch's optimizers do.
        return {k: v for k, v in self.__dict__.items()
                if k not in self._not_pickled and not k.startswith("_optimizer_")
                and not (callable(v) and callable(getattr(type(self), k, None)))}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        unpickled = "defaults" in state  # not torch's load_state_dict, which passes no defaults
        options = set(state["defaults"] if unpickled else self.defaults)
        if unpickled:  # pickles of earlier releases
            state.setdefault("_nonfinite", "propagate")
            state.setdefault("skipped_steps", 0)
        super().__setstate__(state)
        if "differentiable" not in options:  # torch adds it; these optimizers have no such option
            self.defaults.pop("differentiable", None)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        for st in self.state.values():  # checkpoints of torch < 1.12 and of many ports
            if isinstance(st, dict) and "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        if unpickled:
            self._attach()
            self._grad_source.attach(self)

    # -- names --------------------------------------------------------------------------------

    @eager
    def _rule_flags(self, group: Dict[str, Any], key: str) -> Tuple[bool, ...]:
        """Per parameter of ``group``: whether the name rule ``group[key]`` selects it."""
        rule = group.get(key)
        if not rule_is_set(rule):
            return (False,) * len(group["params"])
        return match_names(rule, group["param_names"])

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict, with name rules written as lists of names and a ``"scaleopt"``
        entry saying which class saved it and the kind of state it holds."""
        sd = super().state_dict()
        sd[TAG] = dict(tag(self), skipped_steps=self.skipped_steps)
        # counters that point into one buffer (the Triton path's) are saved as tensors of their
        # own; a value that is not a parameter's dict (a hook's) passes through as torch's does
        for k, st in sd["state"].items():
            step = st.get("step") if isinstance(st, dict) else None
            if torch.is_tensor(step) and step.untyped_storage().nbytes() != step.element_size():
                sd["state"][k] = dict(st, step=step.clone())
        for g in sd["param_groups"]:
            for key in self._name_rule_keys:
                if callable(g.get(key)):
                    g[key] = freeze_rule(g[key], g["param_names"])
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's ``load_state_dict``, after checking that ``state_dict`` fits this optimizer:
        every state tensor shaped as its parameter and floating-point, the keys this optimizer
        needs, the kind of state (where the state dict says which class saved it), finite,
        non-negative step counters and non-negative second moments. A misfit raises ``ValueError`` naming the parameter and the
        key, and nothing is loaded."""
        check_state_dict(self, state_dict)
        aside = _compact.set_aside(self, state_dict)
        super().load_state_dict(state_dict)
        _compact.put_back(self, aside)
        saved = state_dict.get(TAG)
        if isinstance(saved, dict) and isinstance(saved.get("skipped_steps"), int):
            self.skipped_steps = saved["skipped_steps"]

    # -- gradients ----------------------------------------------------------------------------

    def _intake(self, value_clip: bool = True, defer: Optional[Deferral] = None, *,
                amp_skip: bool = False) -> Intake:
        """Each group's parameters that have a gradient, and their gradients, transformed (see
        :func:`scaleopt._intake.take`)."""
        return take(self, value_clip, defer, amp_skip=amp_skip)

    def _closure_loss(self, closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()


