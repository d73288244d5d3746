"""Code that ``torch.compile`` runs eagerly, without importing ``torch._dynamo`` at import time."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """``torch.compiler.disable(fn)``, made at ``fn``'s first call, as torch.optim does, so that
    ``import scaleopt`` costs no import of ``torch._dynamo`` (about a second)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)  # type: ignore[return-value]
