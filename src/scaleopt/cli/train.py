"""``scaleopt train``: one training run, in this process or in N processes on torch.distributed."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import data, optimizers


class Diverged(RuntimeError):
    """The training loss became inf or NaN."""


@dataclasses.dataclass
class Config:
    optimizer: str = "lamb"
    dataset: str = "spirals"
    train_size: int = 131072
    batch_size: int = 1024
    epochs: int = 8
    steps: Optional[int] = None  # overrides epochs
    lr: Optional[float] = None  # None: the optimizer's default
    weight_decay: float = 0.01
    warmup: float = 0.1  # a fraction of the steps (< 1) or a number of steps
    schedule: str = "cosine"
    width: int = 256
    seed: int = 0
    offload: bool = False
    workers: int = 1
    shard: bool = False  # FSDP2: each rank holds 1/workers of the parameters and the state
    checkpoint_every: Optional[int] = None  # DCP checkpoints into out/checkpoints every K steps
    stop_after: Optional[int] = None  # end after this step, with a checkpoint (see --resume)
    resume: Optional[str] = None  # a run directory: continue from its last checkpoint
    device: str = "cpu"
    threads: Optional[int] = None
    out: Optional[str] = None
    progress: bool = True
    evals: int = 16  # test-set evaluations over the run
    dgc: bool = False  # Deep Gradient Compression momentum (with --optimizer momentum)
    dgc_sparsity: Optional[List[float]] = None  # None: the paper's warm-up list
    dgc_rampup_begin_step: int = 0
    dgc_rampup_steps: Optional[int] = None  # None: the first quarter of the run
    dgc_min_numel: int = 16384
    dgc_value_dtype: str = "float32"  # dtype of the values sent (the indices are int32)

    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else optimizers.OPTIMIZERS[self.optimizer].lr

    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * (self.train_size // self.batch_size)

    def dgc_rampup(self) -> int:
        """Steps over which DGC walks its sparsity list: the first quarter of the run unless
        given (the paper warms up over the first epochs)."""
        if self.dgc_rampup_steps is not None:
            return self.dgc_rampup_steps
        return max(1, (self.total_steps() - self.dgc_rampup_begin_step) // 4)

    def warmup_steps(self) -> int:
        total = self.total_steps()
        return int(self.warmup * total) if self.warmup < 1 else min(int(self.warmup), total)


def check(cfg: Config) -> None:
    """Raise ``ValueError`` with a clear message for a configuration that cannot run."""
    if cfg.optimizer not in optimizers.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of "
                         f"{', '.join(optimizers.OPTIMIZERS)}")
    if cfg.dataset not in data.DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(data.DATASETS)}")
    for name in ("train_size", "batch_size", "epochs", "width", "workers", "evals"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.steps is not None and cfg.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.batch_size > cfg.train_size:
        raise ValueError(f"--batch-size {cfg.batch_size} is larger than the training set "
                         f"({cfg.train_size} examples; see --train-size)")
    if cfg.batch_size % cfg.workers:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of --workers {cfg.workers}")
    lr = cfg.resolved_lr()
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr must be a positive number, got {lr}")
    if not (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    if not cfg.warmup >= 0:
        raise ValueError(f"--warmup must be >= 0, got {cfg.warmup}")
    if cfg.schedule not in optimizers.SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; choose one of {optimizers.SCHEDULES}")
    if cfg.offload and not optimizers.OPTIMIZERS[cfg.optimizer].offloadable:
        raise ValueError(f"--offload applies to lamb, lans and adamw, not {cfg.optimizer}")
    if cfg.shard and cfg.dgc:
        raise ValueError("--shard with --dgc: DGC compresses the gradient exchange of replicated "
                         "data parallelism (each rank holds every parameter); sharded parameters "
                         "have no such exchange. Use one or the other")
    if cfg.shard and cfg.workers < 2 and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("--shard splits the parameters and the optimizer state over the "
                         "processes: use it with --workers 2 or more (or under torchrun)")
    for name in ("checkpoint_every", "stop_after"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.dgc:
        if cfg.optimizer != "momentum":
            raise ValueError("--dgc is DGC momentum SGD: use it with --optimizer momentum")
        if cfg.workers < 2 and int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise ValueError("--dgc compresses the gradients the workers exchange: use it with "
                             "--workers 2 or more (one process exchanges nothing)")
        for sp in cfg.dgc_sparsity or ():
            if not 0 <= sp < 1:
                raise ValueError(f"--dgc-sparsity values must be in [0, 1), got {sp}")
        if cfg.dgc_rampup_begin_step < 0 or cfg.dgc_rampup() < 1 or cfg.dgc_min_numel < 0:
            raise ValueError("--dgc-rampup-begin-step and --dgc-min-numel must be >= 0, "
                             "--dgc-rampup-steps >= 1")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    if cfg.device != "cpu" and not cfg.device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {cfg.threads}")


def default_out(cfg: Config, root: str = "scaleopt-runs") -> str:
    """A new folder for the run: named by what it trains and how, with a number added when a
    folder of that name already holds a run."""
    tag = "-".join([cfg.optimizer] + [w for w, on in (("offload", cfg.offload),
                                                      ("shard", cfg.shard), ("dgc", cfg.dgc)) if on]
                   + [cfg.dataset, f"b{cfg.batch_size}"]
                   + ([f"w{cfg.workers}"] if cfg.workers > 1 else []))
    return new_folder(pathlib.Path(root) / f"train-{tag}")


def new_folder(base: pathlib.Path) -> str:
    """``base``, or ``base-2``, ``base-3``, ... : the first that holds no run."""
    path, n = base, 1
    while holds_a_run(path):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def holds_a_run(path: pathlib.Path) -> bool:
    """Whether ``path`` holds a run's or a study's results (or checkpoints)."""
    from .checkpoint import CHECKPOINTS

    return any((path / name).exists()
               for name in ("result.json", CHECKPOINTS, "study.json", "bench.json"))


def check_out(out: str, overwrite: bool = False) -> None:
    """Before any training: ``out`` must be a folder this process can write, and must not hold
    an earlier run unless ``overwrite``. Creates it."""
    path = pathlib.Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if holds_a_run(path) and not overwrite:
        raise ValueError(f"--out {out} holds an earlier run's results: choose another folder, "
                         f"pass --overwrite, or continue it with --resume {out}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the folder ({exc.strerror})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"--out {out}: this process cannot write there")


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


def _evaluate(model, x, y, batch: int = 8192):
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            out = model(x[i:i + batch])
            loss += F.cross_entropy(out, y[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return loss / len(x), correct / len(x)


def _shard(model: torch.nn.Module) -> None:
    """FSDP2: each layer with parameters, then the whole model, sharded over the world."""
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    fully_shard(model)


def _tqdm():
    """tqdm's progress bar class, or None where tqdm is not installed (the cli extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _mean_over_ranks(value: torch.Tensor, world: int, stop: bool) -> Tuple[float, bool]:
    """The batch loss over the global batch (each rank has its slice of it), and whether any
    rank was asked to stop (in the same all-reduce, so that every rank stops at this step)."""
    both = torch.stack([value.detach().float().reshape(()), torch.tensor(float(stop))])
    if world > 1:
        dist.all_reduce(both)
    return both[0].item() / world, bool(both[1].item() > 0)


#: steps between the checks of several workers for a stop request (one tiny all-reduce)
STOP_CHECK_EVERY = 10

#: set when the run is asked to stop (Ctrl-C): the loop ends cleanly at a step boundary
_stop_request: Any = threading.Event()


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


def run(cfg: Config, rank: int = 0, world: int = 1, write: bool = True) -> Dict[str, Any]:
    """Train; on rank 0 return the results (and write them if ``write`` and ``cfg.out``).
    Raises :class:`Diverged`, and :class:`checkpoint.CheckpointError` for a checkpoint that
    cannot be resumed."""
    from . import checkpoint

    check(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device if not cfg.device.startswith("cuda") or world == 1
                          else f"cuda:{rank % torch.cuda.device_count()}")
    x, y, xt, yt, classes = data.load(cfg.dataset, cfg.train_size)
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    vocab = data.TOPICS["vocab"] if cfg.dataset == "topics" else 0
    model = data.make_model(x.shape[1], classes, cfg.width, seed=cfg.seed, vocab=vocab).to(device)
    if cfg.shard:
        _shard(model)
    lr = cfg.resolved_lr()
    if cfg.dgc:
        from ..dgc import PAPER_SPARSITY, DGCMomentum
        from ..groups import param_groups

        opt = DGCMomentum(param_groups(model, weight_decay=cfg.weight_decay), lr=lr, momentum=0.9,
                          sparsity=cfg.dgc_sparsity or list(PAPER_SPARSITY),
                          rampup_begin_step=cfg.dgc_rampup_begin_step,
                          rampup_step=cfg.dgc_rampup(), min_numel=cfg.dgc_min_numel,
                          value_dtype=getattr(torch, cfg.dgc_value_dtype))
    else:
        opt = optimizers.build(cfg.optimizer, model, lr, cfg.weight_decay, cfg.offload)
    total, warmup = cfg.total_steps(), cfg.warmup_steps()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optimizers.schedule(cfg.schedule, total, warmup))
    history: List[Dict[str, Any]] = []
    curve: List[Any] = []  # (step, training loss of the batch)
    step, before = 0, 0.0  # the first step to run; seconds trained before it
    if cfg.resume:
        path = checkpoint.find(cfg.resume)
        meta = checkpoint.read_meta(path)
        checkpoint.load(path, meta, model, opt)
        sched.load_state_dict(meta["scheduler"])
        step, before = meta["step"], meta["time_s"]
        history, curve = meta["history"], [tuple(c) for c in meta["train_curve"]]
    net = model
    if world > 1 and not cfg.dgc and not cfg.shard:  # DGC communicates in its step
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    per_rank = cfg.batch_size // world
    steps_per_epoch = cfg.train_size // cfg.batch_size
    numel = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(cfg.seed)  # the same batches on every rank
    eval_every = max(1, total // cfg.evals)
    log_every = max(1, total // 200)
    end = min(total, cfg.stop_after or total)
    interrupted = False
    bar = None
    tqdm = _tqdm() if rank == 0 and cfg.progress else None
    if tqdm is not None:
        bar = tqdm(total=total, initial=step, desc=f"{cfg.optimizer} b{cfg.batch_size}",
                   unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=0.5,
                   disable=None)  # None: a bar on a terminal, none in a log
    for _ in range(1 + max(0, step - 1) // steps_per_epoch):  # the epochs' orders so far
        perm = torch.randperm(cfg.train_size, generator=g)
    start = time.perf_counter() - before
    first = step
    loss_value = float("nan")
    dgc_totals: Dict[str, float] = {}
    checkpoints: List[str] = []
    while step < end:
        k = step % steps_per_epoch
        if k == 0 and step > 0:
            perm = torch.randperm(cfg.train_size, generator=g)
        idx = perm[k * cfg.batch_size:(k + 1) * cfg.batch_size][rank * per_rank:(rank + 1) * per_rank]
        idx = idx.to(device)
        loss = F.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if cfg.dgc:
            for key in ("bytes_sent", "dense_bytes", "payload_bytes", "dense_payload_bytes",
                        "selected", "numel"):
                dgc_totals[key] = dgc_totals.get(key, 0) + opt.telemetry[key]
        stop = world == 1 and _stop_request.is_set()  # one process: every step
        if step % log_every == 0 or step % eval_every == 0 or step == total:
            loss_value, stop = _mean_over_ranks(loss, world, _stop_request.is_set())
            if rank == 0:
                curve.append((step, loss_value))
            if not math.isfinite(loss_value):
                if bar is not None:
                    bar.close()
                raise Diverged(f"the training loss is {loss_value} at step {step}: lower --lr")
        elif world > 1 and step % STOP_CHECK_EVERY == 0:
            stop = _mean_over_ranks(loss, world, _stop_request.is_set())[1]
        if bar is not None:
            bar.update(1)
            if step % log_every == 0 or step == total:
                elapsed = time.perf_counter() - start
                bar.set_postfix(loss=f"{loss_value:.4f}",
                                samples_per_s=f"{(step - first) * cfg.batch_size / (elapsed - before):,.0f}")
        interrupted = stop and step < end
        if step % eval_every == 0 or step == total or interrupted:
            if rank == 0 or cfg.shard:  # a sharded model's forward needs every rank
                test_loss, test_acc = _evaluate(model, xt, yt)
            if rank == 0:
                history.append({"step": step, "epoch": step / steps_per_epoch,
                                "train_loss": loss_value, "lr": sched.get_last_lr()[0],
                                "test_loss": test_loss, "test_accuracy": test_acc,
                                "time_s": time.perf_counter() - start})
        if cfg.out and ((cfg.checkpoint_every and (step % cfg.checkpoint_every == 0
                                                   or interrupted))
                        or step == cfg.stop_after):
            meta = {"config": dataclasses.asdict(cfg), "total_steps": total,
                    "optimizer_class": type(opt).__name__, "parameters": checkpoint.shapes(model),
                    "scheduler": sched.state_dict(), "history": history, "train_curve": curve,
                    "time_s": time.perf_counter() - start, "world": world}
            checkpoints.append(checkpoint.save(cfg.out, step, model, opt, meta, rank, world))
        if interrupted:
            break
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    sizes = checkpoint.state_bytes(model, opt)
    if cfg.shard:  # the largest shard (the first ranks take the remainders)
        per_rank_bytes = torch.tensor([sizes["param_bytes_per_rank"],
                                       sizes["optimizer_state_bytes_per_rank"]])
        dist.all_reduce(per_rank_bytes, op=dist.ReduceOp.MAX)
        sizes["param_bytes_per_rank"], sizes["optimizer_state_bytes_per_rank"] = map(
            int, per_rank_bytes.tolist())
    if rank != 0:
        return {}
    last = history[-1]
    result = {
        "config": dataclasses.asdict(cfg),
        "lr": lr,
        "parameters": numel,
        "steps": step,
        "total_steps": total,
        "complete": step == total,
        "interrupted": interrupted,
        "resumed_at": first if cfg.resume else None,
        "epochs": step / steps_per_epoch,
        "train_loss": last["train_loss"],
        "test_loss": last["test_loss"],
        "test_accuracy": last["test_accuracy"],
        "time_s": elapsed,
        "steps_per_s": (step - first) / (elapsed - before),
        "samples_per_s": (step - first) * cfg.batch_size / (elapsed - before),
        "history": history,
        "train_curve": curve,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workers": world,
        "sharded": cfg.shard,
        "checkpoints": checkpoints,
        **sizes,
    }
    if cfg.dgc:
        result["dgc_bytes_sent_per_rank_per_step"] = dgc_totals["bytes_sent"] / (step - first)
        result["dense_bytes_sent_per_rank_per_step"] = dgc_totals["dense_bytes"] / (step - first)
        result["dgc_payload_bytes_per_rank_per_step"] = dgc_totals["payload_bytes"] / (step - first)
        result["dense_payload_bytes_per_rank_per_step"] = (dgc_totals["dense_payload_bytes"]
                                                           / (step - first))
        result["dgc_density"] = dgc_totals["selected"] / dgc_totals["numel"]
        result["dgc_final_telemetry"] = dict(opt.telemetry)
    elif world > 1 and not cfg.shard:
        # DDP all-reduces every gradient each step (ring all-reduce: each rank sends about
        # 2(N-1)/N of the gradient bytes)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        result["allreduce_bytes_per_step"] = grad_bytes
        result["bytes_sent_per_rank_per_step"] = int(2 * (world - 1) / world * grad_bytes)
    if cfg.out and write:
        from . import report

        report.write_run(result, cfg.out)
    return result


# ------------------------------------------------------------------------------------------------
# several processes
# ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_group() -> None:
    """Destroy the process group once what held it is gone: the run's FSDP2 model and
    optimizer, freed on return but kept by reference cycles until a collection, would otherwise
    take the group's gloo threads down at interpreter exit, which can abort the process."""
    gc.collect()
    dist.destroy_process_group()


def _worker(rank: int, cfg: Config, world: int, port: int, result_file: str, stop: Any) -> None:
    global _stop_request
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it sets ``stop``
    _stop_request = stop
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        if cfg.threads is None:  # share the cores between the processes
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        result = run(cfg, rank, world, write=False)
        if rank == 0:
            pathlib.Path(result_file).write_text(json.dumps(result))
        dist.barrier()  # no rank leaves the group while another still uses it
    finally:
        _end_group()


def train(cfg: Config) -> Dict[str, Any]:
    """Run ``cfg``: in this process, in ``cfg.workers`` processes started here, or as one rank
    of a ``torchrun`` launch (``WORLD_SIZE`` set in the environment)."""
    check(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun
        backend = "nccl" if cfg.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
        try:
            rank, world = dist.get_rank(), dist.get_world_size()
            check(dataclasses.replace(cfg, workers=world))
            with interruptible(_stop_request):
                result = run(dataclasses.replace(cfg, workers=world), rank, world)
            dist.barrier()  # no rank leaves the group while another still uses it
            return result
        finally:
            _end_group()
    if cfg.workers == 1:
        _stop_request.clear()
        with interruptible(_stop_request):
            return run(cfg)
    import tempfile

    import torch.multiprocessing as mp

    stop = mp.get_context("spawn").Event()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        context = None
        try:
            with interruptible(stop):
                context = mp.start_processes(
                    _worker, args=(cfg, cfg.workers, _free_port(), result_file, stop),
                    nprocs=cfg.workers, join=False, start_method="spawn")
                while not context.join(timeout=1.0):
                    pass
        except KeyboardInterrupt:  # a second Ctrl-C: no worker is left behind
            for p in context.processes if context is not None else ():
                p.terminate()
            raise
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            if "Diverged" in str(exc):
                raise Diverged(last) from None
            if "CheckpointError" in str(exc):
                from .checkpoint import CheckpointError

                raise CheckpointError(last.split(": ", 1)[-1]) from None
            raise
        result = json.loads(pathlib.Path(result_file).read_text())
    if cfg.out:
        from . import report

        report.write_run(result, cfg.out)
    return result
