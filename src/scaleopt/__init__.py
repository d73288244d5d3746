"""scaleopt: PyTorch optimizers for training at scale."""

from ._compact import STATE_DTYPES
from ._info import info
from ._memory import StateBytes, state_bytes
from .adamw import AdamW
from .dgc import DGCMomentum
from .groups import param_groups
from .in_backward import StepsInBackward, step_in_backward
from .lamb import LAMB
from .lans import LANS
from .momentum import Momentum
from .muon import Muon
from .noise import GradientNoiseScale
from .offload import OffloadAdam, offload

__version__ = "0.1.0"

__all__ = [
    "LAMB", "LANS", "AdamW", "Muon", "Momentum", "OffloadAdam", "DGCMomentum", "offload", "step_in_backward",
    "StepsInBackward", "param_groups",
    "GradientNoiseScale", "info", "state_bytes", "StateBytes", "STATE_DTYPES", "__version__",
]
