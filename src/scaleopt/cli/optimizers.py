"""The optimizers the command knows by name, with the learning rates they train the default model at."""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple

import torch
from torch import nn

import scaleopt


class Choice(NamedTuple):
    help: str
    lr: float  # a learning rate that trains the default model at batch 1024
    make: Callable[[nn.Module, float, float, bool], torch.optim.Optimizer]
    offloadable: bool = False


def _groups(model: nn.Module, weight_decay: float):
    return scaleopt.param_groups(model, weight_decay=weight_decay)


def _lamb(model, lr, wd, offload):
    if offload:
        return scaleopt.offload(scaleopt.LAMB, _groups(model, wd), lr=lr)
    return scaleopt.LAMB(_groups(model, wd), lr=lr)


def _lans(model, lr, wd, offload):
    if offload:
        return scaleopt.offload(scaleopt.LANS, _groups(model, wd), lr=lr)
    return scaleopt.LANS(_groups(model, wd), lr=lr)


def _adamw(model, lr, wd, offload):
    if offload:
        return scaleopt.OffloadAdam(_groups(model, wd), lr=lr)
    return scaleopt.AdamW(_groups(model, wd), lr=lr)


OPTIMIZERS: Dict[str, Choice] = {
    "lamb": Choice("scaleopt.LAMB (layer-wise trust ratio)", 1e-2, _lamb, True),
    "lans": Choice("scaleopt.LANS (normalised gradients, two trust-ratio parts)", 1e-2, _lans, True),
    "adamw": Choice("scaleopt.AdamW", 3e-3, _adamw, True),
    "offload-adam": Choice("scaleopt.OffloadAdam (state and update on the host)", 3e-3,
                           lambda m, lr, wd, off: scaleopt.OffloadAdam(_groups(m, wd), lr=lr)),
    "momentum": Choice("scaleopt.Momentum (heavy ball, coupled L2)", 0.1,
                       lambda m, lr, wd, off: scaleopt.Momentum(_groups(m, wd), lr=lr, momentum=0.9)),
    "torch-adamw": Choice("torch.optim.AdamW, the baseline", 3e-3,
                          lambda m, lr, wd, off: torch.optim.AdamW(
                              _groups(m, wd), lr=lr, weight_decay=wd)),
    "torch-sgd": Choice("torch.optim.SGD with momentum 0.9, the baseline", 0.1,
                        lambda m, lr, wd, off: torch.optim.SGD(_groups(m, wd), lr=lr, momentum=0.9)),
}


def build(name: str, model: nn.Module, lr: float, weight_decay: float,
          offload: bool = False) -> torch.optim.Optimizer:
    choice = OPTIMIZERS[name]
    if offload and not choice.offloadable:
        raise ValueError(f"--offload applies to lamb, lans and adamw, not {name}")
    return choice.make(model, lr, weight_decay, offload)


SCHEDULES = ("cosine", "linear", "constant")


def schedule(kind: str, total: int, warmup: int) -> Callable[[int], float]:
    """The LR multiplier at step ``s`` (0-based): linear warm-up over ``warmup`` steps, then
    cosine or linear decay to 0 at ``total``, or constant."""
    def factor(s: int) -> float:
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress
    return factor
