"""The TF1 ``LAMBOptimizer`` (the code quoted in the LAMB article) with its names and semantics."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..lamb import LAMB as _LAMB
from ._common import GradientsAndVariables, as_float

__all__ = ["LAMBOptimizer"]


class LAMBOptimizer(GradientsAndVariables, _LAMB):
    r"""TF1-style ``LAMBOptimizer``: no bias correction, decay inside the trust ratio.

    .. math::
        m = \beta_1 m + (1-\beta_1) g,\quad v = \beta_2 v + (1-\beta_2) g^2,\quad
        u = \frac{m}{\sqrt{v}+\epsilon} + \lambda w,\quad
        w \leftarrow w - \eta\,\frac{\lVert w\rVert}{\lVert u\rVert}\,u

    The decay term is skipped when ``weight_decay_rate`` is 0 or a regex of
    ``exclude_from_weight_decay`` matches the name (``re.search``); the trust ratio (1 when a
    norm is 0) applies to every variable either way.

    Args:
        params: tensors, ``(name, tensor)`` pairs or group dicts.
        learning_rate (float, required), weight_decay_rate (0.01), beta_1 (0.9), beta_2 (0.999),
        epsilon (1e-6), exclude_from_weight_decay (list of regexes or None),
        name ("LAMBOptimizer").

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LAMBOptimizer(model.named_parameters(), learning_rate=0.01,
        ...                     exclude_from_weight_decay=["bias"])
        >>> grads = [torch.ones_like(p) for p in model.parameters()]
        >>> opt.apply_gradients(zip(grads, model.parameters()))

    Reference: the ``LAMBOptimizer`` of the LAMB article's TensorFlow 1 code (You et al., ICLR
    2020, https://arxiv.org/abs/1904.00962).
    """

    _arg_names = {
        "lr": "learning_rate",
        "betas[0]": "beta_1",
        "betas[1]": "beta_2",
        "eps": "epsilon",
        "weight_decay": "weight_decay_rate",
    }

    def __init__(
        self,
        params: Any,
        learning_rate: float,
        weight_decay_rate: float = 0.01,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-6,
        exclude_from_weight_decay: Optional[Sequence[str]] = None,
        name: str = "LAMBOptimizer",
    ) -> None:
        self.name = name
        super().__init__(
            params,
            lr=as_float("learning_rate", learning_rate),
            betas=(as_float("beta_1", beta_1), as_float("beta_2", beta_2)),
            eps=as_float("epsilon", epsilon),
            weight_decay=as_float("weight_decay_rate", weight_decay_rate),
            weight_decay_mode="update",
            bias_correction=False,
            always_adapt=True,
            exclude_from_weight_decay=list(exclude_from_weight_decay) if exclude_from_weight_decay else None,
        )
