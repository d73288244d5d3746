"""scaleopt's optimizers in torchtitan's trainer, named in its config like its own.

torchtitan (0.3) builds its optimizers from ``OptimizersContainer.Config``: each
``ParamGroupConfig`` names an optimizer (``"AdamW"``, ``"Adam"``, ``"DistMuon"``, from a fixed
table) and its keyword arguments, and every group also gets ``fused``/``foreach`` from the
container's ``implementation``. :class:`ScaleOptimizersContainer` is that container with
scaleopt's optimizers added to the table (:data:`OPTIMIZERS`); :func:`optimizer_config` makes
its config, as torchtitan's ``default_adamw`` does for AdamW::

    from scaleopt.integrations.torchtitan import optimizer_config

    def llama3_8b_lamb():  # a config function, in a module passed as --module
        config = llama3_8b()
        config.optimizer = optimizer_config("LAMB", lr=2e-3, weight_decay=0.01)
        return config

Groups with different optimizers are one config with several ``ParamGroupConfig``
(:func:`optimizer_config` takes ``param_groups=`` for that). This module imports without
torchtitan; the names that need it raise ``ImportError`` saying so when used.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence

import scaleopt

#: The names a ``ParamGroupConfig.optimizer_name`` may give, besides torchtitan's own.
OPTIMIZERS: Dict[str, Callable[..., Any]] = {
    "LAMB": scaleopt.LAMB,
    "LANS": scaleopt.LANS,
    "scaleopt.AdamW": scaleopt.AdamW,  # "AdamW" stays torch's, as torchtitan resolves it
    "Muon": scaleopt.Muon,
    "Momentum": scaleopt.Momentum,
    "OffloadAdam": scaleopt.OffloadAdam,
    "OffloadLAMB": functools.partial(scaleopt.offload, scaleopt.LAMB),
    "OffloadLANS": functools.partial(scaleopt.offload, scaleopt.LANS),
}

_NEEDS = ("scaleopt.integrations.torchtitan needs torchtitan (pip install "
          "'scaleopt[torchtitan]', or torchtitan>=0.3 itself)")


@functools.lru_cache(maxsize=None)
def _container() -> type:
    try:
        from dataclasses import dataclass

        from torchtitan.components.optimizer import OptimizersContainer
    except ImportError as e:
        raise ImportError(_NEEDS) from e

    class ScaleOptimizersContainer(OptimizersContainer):
        """torchtitan's ``OptimizersContainer``, whose optimizer names also include
        :data:`OPTIMIZERS`."""

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            pass

        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
            if name in OPTIMIZERS:
                return OPTIMIZERS[name]
            try:
                return OptimizersContainer._resolve_optimizer_factory(name)
            except NotImplementedError:
                raise NotImplementedError(
                    f"Optimizer {name!r} not added: torchtitan's names and scaleopt's "
                    f"{sorted(OPTIMIZERS)}") from None

    ScaleOptimizersContainer.__module__ = __name__
    return ScaleOptimizersContainer


def optimizer_config(name: str, *, titan_implementation: str = "fused",
                     param_groups: Optional[Sequence[Any]] = None, **kwargs: Any) -> Any:
    """A ``ScaleOptimizersContainer.Config`` whose one group (pattern ``.*``) takes optimizer
    ``name`` (a key of :data:`OPTIMIZERS` or one of torchtitan's) with ``kwargs``; or, with
    ``param_groups``, those ``ParamGroupConfig`` instead (``name`` and ``kwargs`` unused).

    ``titan_implementation`` is torchtitan's ``optimizer.implementation`` (``"fused"``,
    ``"foreach"``, ``"for-loop"``): it puts ``fused``/``foreach`` into every group, which
    scaleopt's optimizers take as :mod:`torch.optim` does (docs/migrating.md). ``fused`` runs
    the C kernels on CPUs and the Triton kernels on GPUs; an optimizer without fused kernels
    (``Momentum``) needs ``"foreach"`` or ``"for-loop"``. ``implementation=`` in ``kwargs``
    is scaleopt's own, exact switch (``"single"``, ``"multi"``, ``"native"``,
    ``"triton"``): it takes the place of both flags in its groups."""
    from torchtitan.components.optimizer import ParamGroupConfig

    if param_groups is None:
        if "implementation" in kwargs:  # the optimizer's own switch: no flags beside it
            kwargs = dict(kwargs, fused=None, foreach=None)
        param_groups = [ParamGroupConfig(pattern=r".*", optimizer_name=name,
                                         optimizer_kwargs=dict(kwargs))]
    return _container().Config(param_groups=list(param_groups),
                               implementation=titan_implementation)


def __getattr__(attr: str) -> Any:
    if attr == "ScaleOptimizersContainer":
        return _container()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
