"""The built-in data: generated on the fly, the same on every run, nothing downloaded."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor, nn

#: dataset name -> description (for --help)
DATASETS = {
    "spirals": "points on 5 interleaved noisy spiral arms in the plane, 5 classes (default)",
    "spirals2": "the classic two-spiral problem, 2 classes",
}


def spirals(n: int, seed: int, arms: int = 5, turns: float = 1.5,
            noise: float = 0.02) -> Tuple[Tensor, Tensor]:
    """``n`` points on ``arms`` interleaved spiral arms of ``turns`` turns, Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(n, generator=g)
    label = torch.randint(0, arms, (n,), generator=g)
    angle = r * turns * 2 * math.pi + label * (2 * math.pi / arms)
    xy = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1)
    return xy + noise * torch.randn(n, 2, generator=g), label


def load(name: str, train_size: int, test_size: int = 16384):
    """``(x_train, y_train, x_test, y_test, classes)`` of a built-in dataset."""
    if name == "spirals":
        kw = dict(arms=5, turns=1.5, noise=0.02)
    elif name == "spirals2":
        kw = dict(arms=2, turns=2.5, noise=0.03)
    else:
        raise ValueError(f"unknown dataset {name!r} (choose one of {sorted(DATASETS)})")
    x, y = spirals(train_size, seed=1, **kw)
    xt, yt = spirals(test_size, seed=2, **kw)
    return x, y, xt, yt, kw["arms"]


def make_model(inputs: int, classes: int, width: int = 256, seed: int = 0) -> nn.Module:
    """A small MLP: two hidden layers with LayerNorm and GELU."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(inputs, width), nn.LayerNorm(width), nn.GELU(),
        nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(),
        nn.Linear(width, classes),
    )
