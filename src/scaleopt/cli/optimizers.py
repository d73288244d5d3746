"""The optimizers the command knows by name, with the learning rates they train the default model at."""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, NamedTuple

import torch
from torch import nn

import scaleopt


class Choice(NamedTuple):
    help: str
    lr: float  # a learning rate that trains the default model at batch 1024
    #: ``(model, cfg) -> optimizer``, for a run's configuration (``cli.train.Config``)
    make: Callable[[nn.Module, Any], torch.optim.Optimizer]
    offloadable: bool = False
    #: whether it takes ``state_dtype`` (the Adam family)
    compact_state: bool = False
    #: a learning rate that trains the gpt model (``--model gpt``) at its default batch of 64
    gpt_lr: float = 1e-2
    #: whether it takes ``betas`` (Adam's moments; Muon's AdamW part)
    betas: bool = False
    #: how its learning rate usually grows with the batch size: "sqrt" (the adaptive
    #: optimizers, as the LAMB paper scales them) or "linear" (SGD, Goyal et al. 2017)
    scaling: str = "sqrt"
    #: whether it clips the gradients itself (``max_grad_norm``); torch's optimizers do not,
    #: and the trainer clips for them (``torch.nn.utils.clip_grad_norm_``)
    clips: bool = True


def _groups(model: nn.Module, cfg: Any):
    return scaleopt.param_groups(model, weight_decay=cfg.weight_decay)


def _options(cfg: Any, **more: Any) -> Dict[str, Any]:
    """The options every scaleopt optimizer of the command takes from ``cfg``: the rate, the
    clipping, the betas where given (and ``more``)."""
    options = dict(lr=cfg.resolved_lr(), max_grad_norm=cfg.max_grad_norm, **more)
    if cfg.betas is not None:
        options["betas"] = tuple(cfg.betas)
    return options


#: the choices of ``--state-dtype``
STATE_DTYPES = scaleopt.STATE_DTYPES


def _layerwise(cls: type) -> Callable[[nn.Module, Any], torch.optim.Optimizer]:
    def make(model, cfg):
        options = _options(cfg, state_dtype=cfg.state_dtype)
        if cfg.offload:
            return scaleopt.offload(cls, _groups(model, cfg), **options)
        return cls(_groups(model, cfg), **options)
    return make


def _adamw(model, cfg):
    cls = scaleopt.OffloadAdam if cfg.offload else scaleopt.AdamW
    return cls(_groups(model, cfg), **_options(cfg, state_dtype=cfg.state_dtype))


def _edge_matrices(model: nn.Module) -> list:
    """The names of the embedding tables and of the first and the last matrix of ``model``
    (its input and output layers, which Muon leaves to AdamW), as anchored patterns."""
    names = [n for n, p in model.named_parameters() if p.ndim == 2]
    tables = [f"{n}.weight" if n else "weight" for n, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return sorted({f"^{re.escape(n)}$" for n in names[:1] + names[-1:] + tables})


def _muon(model, cfg):
    """Muon for the hidden matrices, AdamW for the rest, at one learning rate (the update
    scaled to AdamW's RMS, as Moonlight does)."""
    return scaleopt.Muon(_groups(model, cfg), **_options(
        cfg, adjust_lr_fn="match_rms_adamw", state_dtype=cfg.state_dtype,
        exclude_from_muon=_edge_matrices(model)))


OPTIMIZERS: Dict[str, Choice] = {
    "lamb": Choice("scaleopt.LAMB (layer-wise trust ratio)", 1e-2, _layerwise(scaleopt.LAMB),
                   True, True, gpt_lr=2e-2, betas=True),
    "lans": Choice("scaleopt.LANS (normalised gradients, two trust-ratio parts)", 1e-2,
                   _layerwise(scaleopt.LANS), True, True, gpt_lr=2e-2, betas=True),
    "adamw": Choice("scaleopt.AdamW", 3e-3, _adamw, True, True, gpt_lr=1e-2, betas=True),
    "muon": Choice("scaleopt.Muon (orthogonalized momentum for the hidden matrices, AdamW for "
                   "the rest)", 3e-3, _muon, compact_state=True, gpt_lr=1e-2, betas=True),
    "offload-adam": Choice("scaleopt.OffloadAdam (state and update on the host)", 3e-3,
                           lambda m, cfg: scaleopt.OffloadAdam(
                               _groups(m, cfg), **_options(cfg, state_dtype=cfg.state_dtype)),
                           compact_state=True, gpt_lr=1e-2, betas=True),
    "momentum": Choice("scaleopt.Momentum (heavy ball, coupled L2)", 0.1,
                       lambda m, cfg: scaleopt.Momentum(_groups(m, cfg),
                                                        **_options(cfg, momentum=0.9)),
                       gpt_lr=0.1, scaling="linear"),
    "torch-adamw": Choice("torch.optim.AdamW, the baseline", 3e-3,
                          lambda m, cfg: torch.optim.AdamW(
                              _groups(m, cfg), lr=cfg.resolved_lr(),
                              weight_decay=cfg.weight_decay, betas=tuple(cfg.betas or (0.9, 0.999))),
                          gpt_lr=1e-2, betas=True, clips=False),
    "torch-sgd": Choice("torch.optim.SGD with momentum 0.9, the baseline", 0.1,
                        lambda m, cfg: torch.optim.SGD(_groups(m, cfg), lr=cfg.resolved_lr(),
                                                       momentum=0.9),
                        gpt_lr=0.1, scaling="linear", clips=False),
}


def build(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names (with its options: learning rate, weight decay, offload)."""
    choice = OPTIMIZERS[cfg.optimizer]
    if cfg.offload and not choice.offloadable:
        raise ValueError(f"--offload applies to lamb, lans and adamw, not {cfg.optimizer}")
    return choice.make(model, cfg)


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


def dgc_options(cfg: Any) -> Dict[str, Any]:
    """The DGC options of ``cfg`` (``--dgc-*``), for DGCMomentum and the DGC hook."""
    from ..dgc import PAPER_SPARSITY

    return dict(sparsity=cfg.dgc_sparsity or list(PAPER_SPARSITY),
                rampup_begin_step=cfg.dgc_rampup_begin_step, rampup_step=cfg.dgc_rampup(),
                min_numel=cfg.dgc_min_numel, value_dtype=getattr(torch, cfg.dgc_value_dtype))
