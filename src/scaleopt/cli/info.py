"""``scaleopt info``: what runs here (versions, the C kernels, Triton, CUDA, threads), and which
implementation each param group of an optimizer takes on the built-in model."""

from __future__ import annotations

import argparse
from typing import Any

from .. import info as scaleopt_info
from . import config, models, optimizers, options
from .config import Config


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("info", help="what runs here: versions, C kernels, Triton, CUDA, threads",
                       description="Versions, whether the C kernels are built and used, "
                                   "Triton and the CUDA devices, threads, and which "
                                   "implementation each param group of an optimizer takes on "
                                   "the built-in model.")
    options.add_optimizer(p, optimizers.OPTIMIZERS, "the optimizer whose groups are shown "
                          f"({', '.join(optimizers.OPTIMIZERS)}; default: lamb)")
    options.add_offload(p, "its offloaded form")
    options.add_device(p, "where the model lives (cpu or cuda) (default: cpu)")
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    cfg = Config(optimizer=args.optimizer or "lamb", offload=bool(args.offload),
                 device=args.device or "cpu")
    config.check(cfg)
    model = models.make_model(cfg).to(cfg.device)
    r = scaleopt_info(optimizers.build(model, cfg))
    kernels = r["c_kernels"]
    cuda = ", ".join(f"{i}: {n}" for i, n in enumerate(r["cuda_devices"])) or "none"
    print(f"scaleopt {r['scaleopt']}, torch {r['torch']}, Python {r['python']}, "
          f"Triton {r['triton'] or 'not installed'}")
    print("C kernels: " + ("built and used" if kernels["used"] else kernels["why_not"])
          + ("; compact state on their AVX-512 loops" if kernels["avx512"] else ""))
    print("Triton kernels: " + ("run on the CUDA devices" if r["triton_kernels_on_cuda"] else
                                "not here (no CUDA device)" if r["triton"] else
                                "not installed (pip install scaleopt[gpu])"))
    print(f"CUDA devices: {cuda}")
    print(f"threads: {r['threads']} (torch's intra-op), {r['cores']} "
          f"core{'s' if r['cores'] != 1 else ''} for this process")
    print(f"{cfg.optimizer}{' (offloaded)' if cfg.offload else ''} on the built-in model "
          f"({cfg.device}): " + "; ".join(f"group {i}: {impl}"
                                          for i, impl in enumerate(r["groups"])))
    return options.EXIT_OK
