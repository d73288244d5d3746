"""Where this process runs and when it should stop: alone, as one of the workers the command
started, or as one rank of a ``torchrun`` launch; the stop flag that Ctrl-C and SIGTERM set;
the end of a process group. What the run itself (trainer.py) needs to know of its processes;
launch.py starts and supervises them."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
import threading
from typing import Any, Iterator

import torch.distributed as dist

#: set when a run in this process is asked to stop (Ctrl-C, SIGTERM): its loop ends at a step
#: boundary
STOP = threading.Event()

#: how long a collective may wait for the other ranks (``SCALEOPT_TIMEOUT`` seconds, default
#: 120)
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("SCALEOPT_TIMEOUT") or 120))

#: what this rank's run is doing (the collectives it is in, for a message when a peer is lost)
DOING = ["starting"]


def doing(what: str) -> None:
    """Note what the run does now (the collectives it takes part in), for :data:`DOING`."""
    DOING[0] = what

#: the signals that ask a run to stop after its current step: Ctrl-C, and what a cluster sends
#: a job before it kills it (preemption, a time limit)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def under_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def torchrun_restart() -> int:
    """How many times ``torchrun`` has restarted this launch's workers (0 on the first start,
    and outside torchrun)."""
    if not under_torchrun():
        return 0
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def end_group() -> None:
    """Destroy the process group once what held it is gone: an FSDP2 model and optimizer, freed
    on return but kept by reference cycles until a collection, would otherwise take the group's
    gloo threads down at interpreter exit, which can abort the process."""
    gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def interruptible(event: Any) -> Iterator[None]:
    """The first Ctrl-C (SIGINT) or SIGTERM sets ``event``: the run ends after its current step,
    writes its results so far (and a checkpoint with --checkpoint-every) and the command exits
    130. A second one here raises KeyboardInterrupt at once (a spawned worker takes SIGTERM
    itself: :func:`launch._worker`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    received = []  # the signals this process got (another may have set ``event`` first)

    def handler(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt
        event.set()
        why = "" if signum == signal.SIGINT else f"{signal.Signals(signum).name}: "
        print(f"\n{why}stopping after this step (Ctrl-C again to abort) ...", file=sys.stderr)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
