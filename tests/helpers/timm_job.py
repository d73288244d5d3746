"""scaleopt's optimizers on timm's layer-wise learning-rate decay, driven by a timm scheduler:
the job tests/test_timm.py runs in a process of its own (timm and torchvision where that
process finds them). It prints one JSON line: per optimizer, each step's rate of every group
and the rate timm's scheduler computed, each group's ``lr_scale``, and the losses.

timm imports torchvision. Where torchvision's compiled operators do not load beside the
installed torch (torch's CPU build beside PyPI's torchvision, which is built for CUDA),
torchvision runs without them, except that two of its registrations (``nms``, ``qnms``)
assume the operators exist: their schemas are defined here first, so that torchvision
imports. Nothing timm does here (a ViT, its parameter groups, its scheduler) calls them.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch


def _torchvision_ops_load() -> bool:
    spec = importlib.util.find_spec("torchvision")
    library = next(pathlib.Path(spec.origin).parent.glob("_C*.so"), None)
    try:
        torch.ops.load_library(str(library))
        return True
    except (OSError, TypeError):
        return False


if not _torchvision_ops_load():
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for _op in ("nms", "qnms"):
        _LIBRARY.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import timm  # noqa: E402
import timm.optim  # noqa: E402
import timm.scheduler  # noqa: E402

import scaleopt  # noqa: E402

OPTIMIZERS = {"LAMB": dict(lr=2e-3), "LANS": dict(lr=2e-3), "AdamW": dict(lr=1e-3),
              "Muon": dict(lr=2e-2, adamw_lr=1e-3)}


def run(name: str, steps: int = 6) -> dict:
    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, img_size=32, num_classes=10)
    groups = timm.optim.param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.75)
    opt = getattr(scaleopt, name)(groups, **OPTIMIZERS[name])
    scheduler = timm.scheduler.CosineLRScheduler(opt, t_initial=steps, warmup_t=2,
                                                 warmup_lr_init=1e-5, t_in_epochs=False)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 32, 32, generator=data)
    y = torch.randint(0, 10, (16,), generator=data)
    out = {"lr_scale": [g["lr_scale"] for g in opt.param_groups], "rates": [],
           "scheduled": [], "losses": [], "version": timm.__version__}
    for t in range(steps):
        scheduler.step_update(t)
        out["rates"].append([g["lr"] for g in opt.param_groups])
        out["scheduled"].append(scheduler._get_values(t, on_epoch=False))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        out["losses"].append(loss.item())
    saved = opt.state_dict()["param_groups"]
    out["saved_lr_scale"] = [g["lr_scale"] for g in saved]
    return out


if __name__ == "__main__":
    print(json.dumps({name: run(name) for name in OPTIMIZERS}))
