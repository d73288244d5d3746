"""One registry of optimizer configurations drives the generic tests (tests/test_matrix.py)."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

import torch

import scaleopt
from scaleopt.compat import keras, mindspore, mxnet, paddle, tf1


@dataclasses.dataclass
class OptimizerInfo:
    name: str
    make: Callable[[List], torch.optim.Optimizer]  # takes model.named_parameters() as a list
    has_foreach: bool = True  # whether a foreach flag selects fast vs reference path
    host_step: bool = False  # the step reads values on the host (offloaded, DGC's selection)
    #: (rtol, atol) of a comparison across devices or compilers, where the step's arithmetic
    #: allows no tighter one (None: the test's own)
    across: Optional[Tuple[float, float]] = None

    def __str__(self) -> str:  # pytest ids
        return self.name


# name rules as module-level functions: a lambda cannot be pickled (nor can an optimizer that
# holds one, as in torch.optim)
def _last_layer(name):
    return name.startswith("2.")


def _a_bias(name):
    return name.endswith("bias")


def _a_weight(name):
    return "weight" in name


def _keras_excluding_bias(named):
    opt = keras.Lamb(named, learning_rate=0.01, weight_decay=0.05)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


REGISTRY: List[OptimizerInfo] = [
    OptimizerInfo("LAMB", lambda n: scaleopt.LAMB(n, lr=1e-2)),
    OptimizerInfo("LAMB-exclude", lambda n: scaleopt.LAMB(
        n, lr=1e-2, exclude_from_weight_decay=["bias", r"^1\."],
        exclude_from_layer_adaptation=_last_layer)),
    OptimizerInfo("LAMB-decoupled-bounds", lambda n: scaleopt.LAMB(
        n, lr=1e-2, weight_decay=0.1, weight_decay_mode="decoupled", lower_bound=0.5,
        upper_bound=2.0, always_adapt=True)),
    OptimizerInfo("LAMB-l2-clip-nobc", lambda n: scaleopt.LAMB(
        n, lr=1e-2, weight_decay_mode="l2", bias_correction=False, max_grad_norm=0.1,
        clip_grad_value=0.05, clip_grad_norm_per_tensor=1.0, rescale_grad=0.5)),
    OptimizerInfo("LAMB-maximize", lambda n: scaleopt.LAMB(n, lr=1e-2, maximize=True)),
    OptimizerInfo("LANS", lambda n: scaleopt.LANS(n, lr=1e-2)),
    OptimizerInfo("LANS-moved-bounds-clip", lambda n: scaleopt.LANS(
        n, lr=1e-2, weight_decay=0.05, decay_moved_weight=True, lower_bound=0.5, upper_bound=3.0,
        clip_grad_value=0.3, exclude_from_weight_decay="bias", always_adapt=False,
        max_grad_norm=1.0)),
    OptimizerInfo("AdamW", lambda n: scaleopt.AdamW(n, lr=1e-2), has_foreach=False),
    OptimizerInfo("AdamW-foreach", lambda n: scaleopt.AdamW(n, lr=1e-2, foreach=True)),
    OptimizerInfo("AdamW-amsgrad-exclude-clip", lambda n: scaleopt.AdamW(
        n, lr=1e-2, amsgrad=True, exclude_from_weight_decay=r"bias$", max_grad_norm=0.5),
        has_foreach=False),
    # the iteration in bfloat16: another device's (or compiler's) matrix products may round an
    # element of an update the other way, one bfloat16 step (2^-8) of it, times the rate (at
    # most 0.02 sqrt(A/B) here), per step
    OptimizerInfo("Muon", lambda n: scaleopt.Muon(n, lr=0.02, adamw_lr=1e-2),
                  has_foreach=False, across=(1e-3, 2e-3)),
    OptimizerInfo("Muon-plain-rms-exclude-clip", lambda n: scaleopt.Muon(
        n, lr=1e-2, nesterov=False, adjust_lr_fn="match_rms_adamw", exclude_from_muon=r"^2\.",
        exclude_from_weight_decay="bias", max_grad_norm=0.5), has_foreach=False,
        across=(1e-3, 2e-3)),
    OptimizerInfo("Momentum-nesterov-l1", lambda n: scaleopt.Momentum(
        n, lr=0.1, nesterov=True, weight_decay=1e-3, weight_decay_mode="l1")),
    OptimizerInfo("paddle.Lamb", lambda n: paddle.Lamb(
        learning_rate=0.01, parameters=n, grad_clip=paddle.ClipGradByGlobalNorm(1.0),
        exclude_from_weight_decay_fn=_a_bias)),
    OptimizerInfo("paddle.AdamW", lambda n: paddle.AdamW(
        learning_rate=0.01, parameters=n, apply_decay_param_fun=_a_weight),
        has_foreach=False),
    OptimizerInfo("paddle.Momentum", lambda n: paddle.Momentum(
        learning_rate=0.1, momentum=0.9, parameters=n, weight_decay=paddle.L2Decay(1e-3),
        grad_clip=paddle.ClipGradByValue(0.5))),
    OptimizerInfo("keras.Lamb", _keras_excluding_bias),
    OptimizerInfo("mxnet.LAMB", lambda n: mxnet.LAMB(
        n, learning_rate=0.01, wd=0.01, clip_gradient=0.5, lower_bound=0.1,
        param_idx2name={i: f"p{i}_{'weight' if i % 2 == 0 else 'bias'}" for i in range(len(n))})),
    OptimizerInfo("mxnet.LANS", lambda n: mxnet.LANS(n, learning_rate=0.01, wd=0.01)),
    OptimizerInfo("tf1.LAMBOptimizer", lambda n: tf1.LAMBOptimizer(
        n, learning_rate=0.01, exclude_from_weight_decay=["bias"])),
    OptimizerInfo("OffloadAdam", lambda n: scaleopt.OffloadAdam(n, lr=1e-2, weight_decay=0.01),
                  has_foreach=False, host_step=True),
    OptimizerInfo("OffloadAdam-l2-amsgrad-clip-exclude", lambda n: scaleopt.OffloadAdam(
        n, lr=1e-2, weight_decay=0.05, decoupled=False, amsgrad=True, max_grad_norm=0.5,
        exclude_from_weight_decay=r"bias$", maximize=True), has_foreach=False, host_step=True),
    OptimizerInfo("OffloadAdam-nesterov-hat-scaled", lambda n: scaleopt.OffloadAdam(
        n, lr=1e-2, nesterov=True, eps_mode="hat", loss_scale=8.0, check_finite=True,
        num_threads=1), has_foreach=False, host_step=True),
    OptimizerInfo("offload(LAMB)", lambda n: scaleopt.offload(
        scaleopt.LAMB, n, lr=1e-2, exclude_from_weight_decay="bias", max_grad_norm=1.0),
        host_step=True),
    OptimizerInfo("offload(LANS)", lambda n: scaleopt.offload(scaleopt.LANS, n, lr=1e-2),
                  host_step=True),
    OptimizerInfo("DGCMomentum", lambda n: scaleopt.DGCMomentum(
        n, lr=0.05, sparsity=[0.5, 0.9], rampup_begin_step=1, rampup_step=2, min_numel=8,
        weight_decay=1e-3, local_grad_clip_norm=5.0), has_foreach=False, host_step=True),
    OptimizerInfo("paddle.DGCMomentumOptimizer", lambda n: paddle.DGCMomentumOptimizer(
        learning_rate=0.05, momentum=0.9, rampup_begin_step=0, sparsity=[0.75],
        parameters=n, use_nesterov=True, regularization=paddle.L1Decay(1e-4)),
        has_foreach=False, host_step=True),
    OptimizerInfo("mindspore.AdamOffload", lambda n: mindspore.AdamOffload(
        n, learning_rate=0.01, weight_decay=0.01, use_nesterov=True), has_foreach=False,
        host_step=True),
]


def set_foreach(opt: torch.optim.Optimizer, value: bool) -> None:
    for g in opt.param_groups:
        g["foreach"] = value
