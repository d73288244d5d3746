"""Launching a run's workers: a port on 127.0.0.1, the spawned processes, the stop flag that
Ctrl-C sets, and the end of a process group."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist
import torch.multiprocessing as mp

#: set when a run in this process is asked to stop (Ctrl-C): its loop ends at a step boundary
STOP = threading.Event()

#: how long a collective may wait for the other ranks
TIMEOUT = datetime.timedelta(seconds=120)


def busy_cores_hint(threads: Optional[int], workers: int, load: Optional[float] = None,
                    cores: Optional[int] = None) -> Optional[str]:
    """A hint when the run's threads outnumber the cores other work leaves free (by the
    one-minute load average), where a run can be several times slower than with fewer threads;
    None otherwise."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = cores or 1
    per_worker = threads if threads is not None else max(1, cores // workers)
    used, free = per_worker * workers, max(0.0, cores - load)
    fit = max(1, int(free) // workers)
    if load < 1.0 or used <= free + 0.5 or fit >= per_worker:  # or fewer threads cannot help
        return None
    return (f"the load average is {load:.1f} on {cores} core{'s' if cores != 1 else ''}, so about "
            f"{free:.0f} {'is' if round(free) == 1 else 'are'} free for this run's {used} "
            f"thread{'s' if used != 1 else ''}; threads that wait for cores can make it several "
            f"times slower: if it is, try --threads {fit}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def under_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def end_group() -> None:
    """Destroy the process group once what held it is gone: an FSDP2 model and optimizer, freed
    on return but kept by reference cycles until a collection, would otherwise take the group's
    gloo threads down at interpreter exit, which can abort the process."""
    gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def interruptible(event: Any) -> Iterator[None]:
    """The first Ctrl-C (SIGINT) sets ``event``: the run ends after its current step, writes its
    results so far (and a checkpoint with --checkpoint-every) and the command exits 130. A
    second Ctrl-C raises KeyboardInterrupt at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()
        print("\nstopping after this step (Ctrl-C again to abort) ...", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker(rank: int, target: Callable[..., None], world: int, port: int, device: str,
            stop: Any, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it sets ``stop``
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend(device), rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        target(rank, world, stop, *args)
        dist.barrier()  # no rank leaves the group while another still uses it
    finally:
        end_group()


def start_method() -> str:
    """How the workers start: on Linux from a fork server that has imported torch and scaleopt
    once (each worker starts in a fraction of a fresh interpreter's time; nothing in the server
    has started a thread or CUDA), elsewhere as fresh interpreters."""
    if sys.platform.startswith("linux"):
        mp.set_forkserver_preload(["torch", "torch.distributed", "scaleopt", "scaleopt.cli"])
        return "forkserver"
    return "spawn"


def shared_step() -> Any:
    """An integer the workers of :func:`spawn` can write and this process read (the step a run
    has reached), -1 until one writes it."""
    return mp.get_context(start_method()).Value("q", -1, lock=False)


def torchrun_restart() -> int:
    """How many times ``torchrun`` has restarted this launch's workers (0 on the first start,
    and outside torchrun)."""
    if not under_torchrun():
        return 0
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


#: the markers of a worker that failed because another one died: its collectives lost their
#: peer (gloo's and NCCL's errors), not an error of its own
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "DistBackendError",
             "DistNetworkError", "NCCL communicator was aborted", "Broken pipe")


def init_torchrun_group(backend_name: str) -> None:
    """The process group of a ``torchrun`` launch (its environment says where). After torchrun
    restarted the workers, the group's keys in torchrun's store are put under a prefix of
    their own: the store outlives the workers, and a new group that read the first group's
    entries would try to connect to the addresses of workers that are gone."""
    restart = torchrun_restart()
    if not restart:
        dist.init_process_group(backend_name, timeout=TIMEOUT)
        return
    store, rank, world = next(dist.rendezvous("env://", timeout=TIMEOUT))
    dist.init_process_group(backend_name, store=dist.PrefixStore(f"restart-{restart}", store),
                            rank=rank, world_size=world, timeout=TIMEOUT)


def lost_a_peer(error: BaseException) -> bool:
    """Whether a worker's ``error`` (from :func:`spawn`) says that a worker died: one killed or
    ended by a signal or an exit code (out of memory, a lost node), or one whose collectives
    lost the other."""
    if isinstance(error, mp.ProcessExitedException):
        return True
    return isinstance(error, mp.ProcessRaisedException) and any(m in str(error) for m in LOST_PEER)


def spawn(target: Callable[..., None], world: int, device: str, *args: Any,
          started: Optional[Callable[[list], None]] = None) -> None:
    """Run ``target(rank, world, stop, *args)`` in ``world`` new processes, each one rank of a
    process group on 127.0.0.1 (gloo, or NCCL on ``cuda``). ``stop`` is an event that the first
    Ctrl-C here sets; a second one ends the workers and raises KeyboardInterrupt. A worker's
    error comes back as ``torch.multiprocessing.ProcessRaisedException``, a worker that dies
    as ``ProcessExitedException`` (the others are ended). ``started(pids)``: called with the
    workers' process ids once they run."""
    method = start_method()
    stop = mp.get_context(method).Event()
    context = None
    try:
        with interruptible(stop):
            context = mp.start_processes(
                _worker, args=(target, world, free_port(), device, stop, args), nprocs=world,
                join=False, start_method=method)
            if started is not None:
                started([p.pid for p in context.processes])
            while not context.join(timeout=1.0):
                pass
    except KeyboardInterrupt:  # a second Ctrl-C: no worker is left behind
        for p in context.processes if context is not None else ():
            p.terminate()
        raise
