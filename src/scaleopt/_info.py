"""What runs here: versions, the C kernels, Triton, CUDA devices, threads, and which
implementation each param group of an optimizer takes (:func:`info`, ``scaleopt info``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from typing import Any, Dict, List, Optional

import torch

from . import _native, _triton
from ._base import ScaleOptimizer
from ._dispatch import implementation
from ._layerwise import LayerwiseAdam
from .adamw import AdamW, named_path, takes_fused
from .muon import _as_adamw
from .offload import OffloadAdam


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def c_kernels() -> Dict[str, Any]:
    """Whether the C kernels are built and used, and if not, why."""
    disabled = os.environ.get("SCALEOPT_NATIVE", "1") == "0"
    built = importlib.util.find_spec("scaleopt._kernels") is not None
    used = _native.available()
    if used:
        why = None
    elif disabled:
        why = "turned off by SCALEOPT_NATIVE=0"
    elif not built:
        why = ("not built: the install found no C compiler (or ran without one), so the CPU "
               "steps take the PyTorch paths; reinstall with a C compiler (gcc or clang) for "
               "the fused kernels")
    else:
        why = "built but not loadable on this machine"
    # the compact state's AVX-512 loops (SCALEOPT_AVX512=0 or compact_simd(False): the portable)
    return {"built": built, "used": used, "why_not": why, "avx512": _native.compact_simd()}


def group_implementations(optimizer: torch.optim.Optimizer) -> List[str]:
    """Per param group of ``optimizer``, the implementation its step takes now (before the
    state exists: the answer for its parameters as they are)."""
    out = []
    for group in optimizer.param_groups:
        params = group["params"]
        if not isinstance(optimizer, ScaleOptimizer):
            out.append(f"{type(optimizer).__module__}.{type(optimizer).__name__}'s own step")
        elif isinstance(optimizer, OffloadAdam):
            kernel = _native.available() and _native.kernels_allowed(group)
            out.append("native (host)" if kernel else "single (host)")
        elif isinstance(optimizer, AdamW) or group.get("algorithm") == "adamw":
            group = group if isinstance(optimizer, AdamW) else _as_adamw(group)  # Muon's part
            out.append(named_path(group) or (
                "fused (torch)" if takes_fused(group, params) else
                "multi (torch foreach)" if group["foreach"] else
                "single (torch for-loop)" if group["foreach"] is False else
                "torch's choice"))
        elif group.get("algorithm") == "muon":
            out.append("Newton-Schulz (bfloat16 matmuls), matrices whole on one rank each")
        else:
            on_host = getattr(optimizer, "host", None) is not None
            impl = implementation(group, params, on_host=on_host,
                                  kernels=isinstance(optimizer, LayerwiseAdam))
            out.append(impl.value + (" (host)" if on_host else ""))
    return out


def info(optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """What runs here, as a dict: ``scaleopt``, ``torch``, ``python`` and ``triton`` versions
    (None where not installed), the C kernels (:func:`c_kernels`), whether Triton's kernels run
    on CUDA tensors here, the CUDA devices, torch's intra-op threads and the cores this process
    may use, and, for an ``optimizer``, the implementation each of its param groups takes.

    >>> import scaleopt
    >>> sorted(scaleopt.info())[:3]
    ['c_kernels', 'cores', 'cuda_devices']
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    out: Dict[str, Any] = {
        "scaleopt": _version("scaleopt"), "torch": torch.__version__,
        "python": platform.python_version(), "triton": _version("triton"),
        "c_kernels": c_kernels(),
        "triton_kernels_on_cuda": _triton.available() and bool(cuda),
        "cuda_devices": cuda, "threads": torch.get_num_threads(), "cores": cores,
    }
    if optimizer is not None:
        out["optimizer"] = type(optimizer).__name__
        out["groups"] = group_implementations(optimizer)
    return out
