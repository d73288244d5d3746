"""Starting and supervising a run's processes: ``--workers N`` spawned here (a port on
127.0.0.1, the stop flag, restarts from the newest checkpoint when a worker dies, the workers'
process ids in the run folder), and a rank of a ``torchrun`` launch. A worker's failure reaches
this process as a record it writes (its error's class and message), never read from text."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import checkpoint, config, report, resume, trainer, world
from .config import Config


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


# ------------------------------------------------------------------------------------------------
# workers spawned here
# ------------------------------------------------------------------------------------------------


#: the markers of an error that says another worker died: its collectives lost their peer
#: (gloo's and NCCL's errors), not an error of the worker's own
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
             "Broken pipe", "Timed out waiting")


def lost_a_peer(error: BaseException) -> bool:
    """Whether a worker's own ``error`` says that another worker died (its collectives lost it):
    torch.distributed's backend and network errors, and gloo's and NCCL's words for it."""
    lost = (getattr(dist, "DistBackendError", ()), getattr(dist, "DistNetworkError", ()))
    return isinstance(error, lost) or any(m in str(error) for m in LOST_PEER)


def _failure_file(folder: str, rank: int) -> pathlib.Path:
    return pathlib.Path(folder) / f"failure-{rank}.json"


def _worker(rank: int, target: Callable[..., None], world_size: int, port: int, device: str,
            stop: Any, folder: str, args: tuple) -> None:
    """One spawned worker: Ctrl-C is the parent's (it sets ``stop``); SIGTERM (a cluster ending
    the job sends it to every process) sets ``stop`` too, a second one ends the worker. An
    error is recorded in ``folder`` for the parent (its class, message, and whether it only
    says that another worker died) and raised."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    received = []

    def on_term(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise SystemExit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(world.backend(device), rank=rank, world_size=world_size,
                                timeout=world.TIMEOUT)
        try:
            target(rank, world_size, stop, *args)
            dist.barrier()  # no rank leaves the group while another still uses it
        finally:
            world.end_group()
    except BaseException as exc:
        record = {"type": type(exc).__name__, "message": str(exc), "lost_peer": lost_a_peer(exc),
                  "doing": world.DOING[0]}
        _failure_file(folder, rank).write_text(json.dumps(record))
        raise


def start_method() -> str:
    """How the workers start: on Linux from a fork server that has imported torch and scaleopt
    once (each worker starts in a fraction of a fresh interpreter's time; nothing in the server
    has started a thread or CUDA; it ignores SIGTERM: :mod:`.forkserver`), elsewhere as fresh
    interpreters."""
    if sys.platform.startswith("linux"):
        mp.set_forkserver_preload(["scaleopt.cli.forkserver", "torch", "torch.distributed",
                                   "scaleopt", "scaleopt.cli"])
        return "forkserver"
    return "spawn"


def shared_step() -> Any:
    """An integer the workers of :func:`spawn` can write and this process read (the step a run
    has reached), -1 until one writes it."""
    return mp.get_context(start_method()).Value("q", -1, lock=False)


def spawn(target: Callable[..., None], world_size: int, device: str, folder: str, *args: Any,
          started: Optional[Callable[[list], None]] = None) -> None:
    """Run ``target(rank, world, stop, *args)`` in ``world_size`` new processes, each one rank
    of a process group on 127.0.0.1 (gloo, or NCCL on ``cuda``). ``stop`` is an event that the
    first Ctrl-C or SIGTERM here sets; a second one ends the workers and raises
    KeyboardInterrupt. A worker's error comes back as
    ``torch.multiprocessing.ProcessRaisedException`` (and its record in the folder ``folder``,
    see :func:`failure`), a worker that dies as ``ProcessExitedException`` (the others are
    ended). ``started(pids)``: called with the workers' process ids once they run."""
    method = start_method()
    stop = mp.get_context(method).Event()
    context = None
    try:
        with world.interruptible(stop):
            context = mp.start_processes(
                _worker, args=(target, world_size, free_port(), device, stop, folder, args),
                nprocs=world_size, join=False, start_method=method)
            if started is not None:
                started([p.pid for p in context.processes])
            while not context.join(timeout=1.0):
                pass
    except KeyboardInterrupt:  # a second Ctrl-C: no worker is left behind
        for p in context.processes if context is not None else ():
            p.kill()
        raise


def failure(folder: str, error: BaseException) -> Optional[Dict[str, Any]]:
    """The record of the worker that ``error`` (from :func:`spawn`) names, or None (a worker
    killed, or ended by an exit code, leaves none)."""
    path = _failure_file(folder, getattr(error, "error_index", -1))
    return json.loads(path.read_text()) if path.is_file() else None


class WorkersLost(RuntimeError):
    """Workers died more often than ``--max-restarts`` allows; the message says when and how."""


class PeerLost(WorkersLost):
    """A rank of a multi-node launch lost another (its collective failed or timed out): the
    message names the rank or ranks lost, what the run was doing and how to continue."""


#: how long a rank that lost a peer waits for the others to report to the rendezvous store
REPORT_S = 10.0


def lost_peers(rank: int, size: int, timeout_s: float = REPORT_S) -> str:
    """Who this rank lost, found through the rendezvous store: every rank whose collective
    failed says so there; the ranks that did not within ``timeout_s`` are the lost ones (a
    rank that cannot reach the store at all is the one cut off). A sentence. (The store's
    calls are made in a thread of their own: on a dead link they can block past any timeout.)"""
    found: Dict[str, Any] = {}

    def ask() -> None:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        store.set(f"scaleopt/lost/{rank}", "failed")
        deadline = time.monotonic() + timeout_s
        waiting = [r for r in range(size) if r != rank]
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not store.check([f"scaleopt/lost/{r}"])]
            time.sleep(0.2)
        found["waiting"] = waiting

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(timeout_s + 5.0)
    if "waiting" not in found:  # the store (on rank 0's node) does not answer either
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"rank {rank} lost every other rank: not even the rendezvous store at {where} "
                f"(rank 0's node) answers, so this rank's own link is probably down")
    waiting = found["waiting"]
    if not waiting:
        return (f"rank {rank} lost a peer: every rank reports a failed collective, none stopped "
                f"answering the store")
    names = ", ".join(str(r) for r in waiting)
    return (f"rank {rank} lost rank{'s' if len(waiting) > 1 else ''} {names}: "
            f"{'they' if len(waiting) > 1 else 'it'} did not report to the rendezvous store "
            f"within {timeout_s:.0f} s (cut off, or dead)")


#: where a run's workers' process ids are written while they run (``scaleopt train
#: --workers N``): {"pids": [...], "restart": n}
WORKERS_FILE = "workers.json"


def _rank(rank: int, world_size: int, stop: Any, cfg: Config, result_file: str,
          reached: Any = None) -> None:
    """One of the command's workers (see :func:`spawn`)."""
    if cfg.threads is None:  # share the cores between the processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result = trainer.run(cfg, rank, world_size, write=False, stop=stop, reached=reached)
    if rank == 0:
        pathlib.Path(result_file).write_text(json.dumps(result))


def _how_it_died(exc: BaseException, record: Optional[Dict[str, Any]] = None) -> str:
    if isinstance(exc, mp.ProcessExitedException):
        how = (f"killed by {exc.signal_name}" if exc.signal_name
               else f"ended with exit code {exc.exit_code}")
        return f"worker {exc.error_index} (pid {exc.error_pid}) was {how}"
    said = (record or {}).get("message", "").strip().splitlines()
    return (f"worker {exc.error_index} (pid {exc.error_pid}) lost its connection to another worker "
            f"(which died or stopped answering, or the network between them failed)"
            + (f" during {record['doing']}" if (record or {}).get("doing") else "")
            + (f"; the backend said: {said[0][:200]}" if said else ""))


def workers(cfg: Config) -> Dict[str, Any]:
    """``cfg`` in ``cfg.workers`` processes started here; rank 0's results. A worker that dies
    (killed, out of memory) ends the others; they are started again from the newest checkpoint
    that verifies (or from the start of the run where there is none yet), at most
    ``cfg.max_restarts`` times, and ``restarts`` in the results says when and what was redone."""
    try:
        return _workers_restarted(cfg)
    finally:
        _remove_pids(cfg)  # (also when the run ends with an error)


def _attempt(cfg: Config, attempt: Config, reached: Any,
             restart: int) -> Tuple[Optional[Dict[str, Any]], str]:
    """One start of the workers: rank 0's results, or None and how a worker died. A worker
    that failed by itself raises its error here, as this process's (divergence and checkpoint
    errors by their classes)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        try:
            spawn(_rank, cfg.workers, cfg.device, tmp, attempt, result_file, reached,
                  started=lambda pids: _write_pids(cfg, pids, restart))
            return json.loads(pathlib.Path(result_file).read_text()), ""
        except mp.ProcessExitedException as exc:
            return None, _how_it_died(exc)
        except mp.ProcessRaisedException as exc:
            record = failure(tmp, exc)
            if record is None:
                raise
            if record["lost_peer"]:
                return None, _how_it_died(exc, record)
            if record["type"] == "Diverged":
                raise trainer.Diverged(record["message"]) from None
            if record["type"] == "CheckpointError":
                raise checkpoint.CheckpointError(record["message"]) from None
            raise


def _workers_restarted(cfg: Config) -> Dict[str, Any]:
    reached, restarts, attempt = shared_step(), [], cfg
    while True:
        result, died = _attempt(cfg, attempt, reached, len(restarts))
        if result is not None:
            break
        at = reached.value
        if len(restarts) >= cfg.max_restarts:
            raise WorkersLost(
                f"{died} at step {at}, after {len(restarts)} restart"
                f"{'s' if len(restarts) != 1 else ''} (--max-restarts {cfg.max_restarts}): the "
                f"run ends here" + (f"; continue it with --resume {cfg.out}" if cfg.out else ""))
        attempt, start = _restart_point(cfg)
        restarts.append({"cause": died, "at_step": at, "from_step": start,
                         "redone_steps": max(0, at - start)})
        checkpoint._note(f"{died} at step {at}; restarting the {cfg.workers} workers from "
                         + (f"the checkpoint of step {start}" if attempt.resume else "the start")
                         + f" (restart {len(restarts)} of at most {cfg.max_restarts})")
    if restarts:
        result["restarts"] = restarts
        result["redone_steps"] = sum(r["redone_steps"] for r in restarts)
        result["resumed_at"] = (resume.read_meta(pathlib.Path(cfg.resume))["step"]
                                if cfg.resume else None)
    return result


def _restart_point(cfg: Config) -> Tuple[Config, int]:
    """Where workers that died start again: the newest checkpoint of the run folder that
    verifies, else where the run began (its ``--resume`` checkpoint, or step 0)."""
    if cfg.out:
        try:
            path = resume.find(cfg.out)
        except checkpoint.CheckpointError:
            path = None
        if path is not None:
            return dataclasses.replace(cfg, resume=str(path)), resume.read_meta(path)["step"]
    start = resume.read_meta(pathlib.Path(cfg.resume))["step"] if cfg.resume else 0
    return cfg, start


def _write_pids(cfg: Config, pids: List[int], restart: int) -> None:
    if cfg.out:
        with contextlib.suppress(OSError):
            checkpoint._write_atomically(pathlib.Path(cfg.out) / WORKERS_FILE,
                                         json.dumps({"pids": pids, "restart": restart}))


def _remove_pids(cfg: Config) -> None:
    if cfg.out:
        with contextlib.suppress(OSError):
            (pathlib.Path(cfg.out) / WORKERS_FILE).unlink()


# ------------------------------------------------------------------------------------------------
# torchrun
# ------------------------------------------------------------------------------------------------


def init_torchrun_group(backend_name: str) -> None:
    """The process group of a ``torchrun`` launch (its environment says where). After torchrun
    restarted the workers, the group's keys in torchrun's store are put under a prefix of
    their own: the store outlives the workers, and a new group that read the first group's
    entries would try to connect to the addresses of workers that are gone."""
    restart = world.torchrun_restart()
    if not restart:
        dist.init_process_group(backend_name, timeout=world.TIMEOUT)
        return
    store, rank, size = next(dist.rendezvous("env://", timeout=world.TIMEOUT))
    dist.init_process_group(backend_name, store=dist.PrefixStore(f"restart-{restart}", store),
                            rank=rank, world_size=size, timeout=world.TIMEOUT)


def torchrun_rank(cfg: Config) -> Dict[str, Any]:
    """``cfg`` as one rank of a ``torchrun`` launch."""
    init_torchrun_group(world.backend(cfg.device))
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        cfg = dataclasses.replace(cfg, workers=size)
        config.check(cfg)
        pids: List[Any] = [None] * size
        dist.all_gather_object(pids, os.getpid())  # this node's and the others' (their ids)
        if rank == 0:
            _write_pids(cfg, pids, world.torchrun_restart())
        try:
            with world.interruptible(world.STOP):
                result = trainer.run(cfg, rank, size)
            dist.barrier()  # no rank leaves the group while another still uses it
        except Exception as exc:
            if not lost_a_peer(exc):
                raise
            raise PeerLost(_peer_lost_message(cfg, rank, size, exc)) from None
        if rank == 0:
            _remove_pids(cfg)
        return result
    finally:
        world.end_group()


def _peer_lost_message(cfg: Config, rank: int, size: int, exc: BaseException) -> str:
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if cfg.out and (pathlib.Path(cfg.out) / report.CHECKPOINTS / report.LATEST).is_file():
        how = (f"continue it from its last checkpoint by starting every rank again with "
               f"`scaleopt train --resume {cfg.out}`")
    else:
        how = "no checkpoint was written, so it cannot be resumed (pass --checkpoint-every K)"
    return (f"{lost_peers(rank, size)}, during {world.DOING[0]} (after the process group's "
            f"timeout of {world.TIMEOUT.total_seconds():.0f} s; the backend said: "
            f"{said[:300]}). The run ends here; {how}")
