"""The options several commands (and the scripts in benchmarks/) share, each defined once here
with its one validation, and how a command knows which options were given.

The commands' parsers leave every option's default at None and say the real default in its
help: an option is given exactly when its value is not None (:func:`given`), and the command
fills in the defaults afterwards (:func:`fill`). ``scaleopt train --model gpt`` takes the gpt
model's defaults for the options not given, and ``--resume`` the checkpoint's values; both need
to know what the user wrote, not what a default made of it.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Iterable, Set

#: the commands' exit codes (the epilog of ``scaleopt --help`` says them)
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

#: the namespace entries that are not options: the command, the study and the function
#: that runs the command
NOT_OPTIONS = frozenset({"command", "study", "func"})


def whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def plain(doc: str) -> str:
    """A docstring as help text: without reStructuredText's double backticks."""
    return doc.replace("``", "")


def given(args: argparse.Namespace) -> Set[str]:
    """The destinations of the options written on the command line: those not None (the
    commands' parsers default every option to None)."""
    return {k for k, v in vars(args).items() if v is not None and k not in NOT_OPTIONS}


def fill(args: argparse.Namespace, defaults: Dict[str, Any]) -> None:
    """Set the options not given to ``defaults``' values."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


# ------------------------------------------------------------------------------------------------
# the shared options
# ------------------------------------------------------------------------------------------------


def check_device(device: str) -> None:
    """``--device``'s one check (``ValueError``): cpu, or cuda where there is a CUDA device."""
    import torch

    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")


def add_device(g: Any, help: str, default: Any = None) -> None:
    """``--device`` (checked by :func:`check_device` where the command runs)."""
    g.add_argument("--device", default=default, help=help)


def add_threads(g: Any, help: str, default: Any = None) -> None:
    g.add_argument("--threads", type=positive_int, default=default, help=help)


def add_rounds(g: Any, default: Any = None, help: str = "timed steps per candidate") -> None:
    """``--rounds`` (a benchmark checks it is at least 1 with its other sizes, and says so
    as a usage error)."""
    g.add_argument("--rounds", type=int, default=default,
                   help=help + (f" (default: {default})" if default is not None else ""))


def add_size(g: Any, sizes: Iterable[str], help: str = "the parameter set",
             default: Any = None) -> None:
    g.add_argument("--size", choices=sorted(sizes), default=default, help=help)


def add_replicas(g: Any, help: str, default: Any = None) -> None:
    """``--replicas R``: HSDP's replicas (training, and Muon's sharded benchmark)."""
    g.add_argument("--replicas", type=positive_int, metavar="R", default=default, help=help)


def add_world(g: Any, default: int, help: str) -> None:
    """``--world N``: the processes a benchmark shards its set over (checked with its sizes)."""
    g.add_argument("--world", type=int, default=default, help=help)


def add_output(g: Any, what: str = "the results", folder: str = "<run>") -> None:
    """``--out`` and ``--overwrite``."""
    g.add_argument("--out", help=f"folder for {what} (default: scaleopt-runs/{folder}, a new "
                                 f"folder for each run)")
    g.add_argument("--overwrite", action="store_true", default=None,
                   help="write into --out even if it holds an earlier run's results")


def add_resume(g: Any, metavar: str, help: str) -> None:
    """``--resume DIR``: continue a run (``scaleopt train``) or a study from what it wrote."""
    g.add_argument("--resume", metavar=metavar, help=help)


def add_optimizer(g: Any, names: Iterable[str], help: str) -> None:
    """``--optimizer NAME``, any case."""
    g.add_argument("--optimizer", choices=list(names), type=str.lower, metavar="NAME", help=help)


def add_optimizers(g: Any, help: str) -> None:
    """``--optimizers NAME ...``, any case (a study's, or those a study's measurement takes)."""
    g.add_argument("--optimizers", nargs="+", metavar="NAME", type=str.lower, help=help)


def add_tuned(g: Any, name: str, metavar: str, what: str, also: str, batches: int,
               alone: str) -> None:
    """``--NAMEs`` and ``--NAME-batches``: a setting a study tunes beside the rate at its
    largest batch sizes."""
    g.add_argument(f"--{name}s", type=float, nargs="+", metavar=metavar,
                   help=f"{what} crossed with the rate grid{also} at the --{name}-batches "
                        f"largest batch sizes (default: none, {alone} alone everywhere)")
    g.add_argument(f"--{name}-batches", type=non_negative_int, metavar="N",
                   help=f"the largest batch sizes at which --{name}s are tried (default: "
                        f"{batches})")


def add_offload(g: Any, help: str) -> None:
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, help=help)


def add_workers(g: Any, help: str) -> None:
    """``--workers N`` and ``--shard``."""
    g.add_argument("--workers", type=positive_int, help=help + " (default: 1)")
    g.add_argument("--shard", action=argparse.BooleanOptionalAction,
                   help="FSDP2 (fully_shard) instead of DDP: each of the --workers holds "
                        "1/N of the parameters and of the optimizer state")

