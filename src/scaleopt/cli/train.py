"""``scaleopt train``: one training run, in this process or in N processes on torch.distributed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..dgc import PAPER_SPARSITY, DGCMomentum
from .._sharding import local_piece
from ..groups import param_groups
from ..noise import GradientNoiseScale
from . import checkpoint, data, launch, optimizers, report


class Diverged(RuntimeError):
    """The training loss became inf or NaN."""


@dataclasses.dataclass
class Config:
    optimizer: str = "lamb"
    dataset: str = "spirals"
    model: str = "mlp"  # "gpt" with dataset "text" (data.model_of)
    train_size: int = 131072
    batch_size: int = 1024
    epochs: int = 8
    steps: Optional[int] = None  # overrides epochs
    lr: Optional[float] = None  # None: the optimizer's default
    weight_decay: float = 0.01
    #: clip the gradients to this global norm (None: no clipping)
    max_grad_norm: Optional[float] = None
    #: (beta1, beta2) of the optimizers that have them (None: each optimizer's default)
    betas: Optional[Tuple[float, float]] = None
    #: evaluate along the run on a test split and once at the end on a development split
    #: held apart from it (data.load's "test" and "dev"), for a study that selects on one
    #: and reports the other
    dev_split: bool = False
    warmup: float = 0.1  # a fraction of the steps (< 1) or a number of steps
    schedule: str = "cosine"
    width: int = 256
    layers: int = 2  # gpt: decoder blocks
    context: int = 64  # gpt: bytes per sequence (a training example)
    seed: int = 0
    offload: bool = False
    state_dtype: str = "float32"  # how the optimizer stores its moments (scaleopt._compact)
    workers: int = 1
    shard: bool = False  # FSDP2: each rank holds 1/workers of the parameters and the state
    replicas: int = 1  # with shard: HSDP, the workers split into this many replicas
    checkpoint_every: Optional[int] = None  # DCP checkpoints into out/checkpoints every K steps
    max_restarts: int = 3  # --workers N: restarts after a worker dies, from the last checkpoint
    keep_checkpoints: int = 3  # the newest N checkpoints are kept
    stop_after: Optional[int] = None  # end after this step, with a checkpoint (see --resume)
    resume: Optional[str] = None  # a run directory: continue from its last checkpoint
    device: str = "cpu"
    threads: Optional[int] = None
    out: Optional[str] = None
    progress: bool = True
    evals: int = 16  # test-set evaluations over the run
    #: "even": every total/evals steps; "log": at total * 2^(-i/3), i = 0 ... evals - 1 (a
    #: third of an octave apart, the first at total/2^((evals-1)/3)), for curves read early
    eval_spacing: str = "even"
    measure_noise: bool = False  # the gradient noise scale along the run (scaleopt.noise)
    dgc: bool = False  # Deep Gradient Compression momentum (with --optimizer momentum)
    dgc_sparsity: Optional[List[float]] = None  # None: the paper's warm-up list
    dgc_rampup_begin_step: int = 0
    dgc_rampup_steps: Optional[int] = None  # None: the first quarter of the run
    dgc_min_numel: int = 16384
    dgc_value_dtype: str = "float32"  # dtype of the values sent (the indices are int32)

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        choice = optimizers.OPTIMIZERS[self.optimizer]
        return choice.gpt_lr if self.model == "gpt" else choice.lr

    def steps_per_epoch(self) -> int:
        return self.train_size // self.batch_size

    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * self.steps_per_epoch()

    def dgc_rampup(self) -> int:
        """Steps over which DGC walks its sparsity list: the first quarter of the run unless
        given (the paper warms up over the first epochs)."""
        if self.dgc_rampup_steps is not None:
            return self.dgc_rampup_steps
        return max(1, (self.total_steps() - self.dgc_rampup_begin_step) // 4)

    def noise_every(self) -> int:
        """Steps between measurements of the gradient noise scale (about 100 in a run)."""
        return max(1, self.total_steps() // 100)

    def eval_steps(self) -> set:
        """The steps after which the run evaluates (the last step always)."""
        total = self.total_steps()
        if self.eval_spacing == "log":
            return {max(1, round(total * 2 ** (-i / 3))) for i in range(self.evals)}
        every = max(1, total // self.evals)
        return set(range(every, total + 1, every)) | {total}

    def warmup_steps(self) -> int:
        total = self.total_steps()
        return int(self.warmup * total) if self.warmup < 1 else min(int(self.warmup), total)


#: the choices of ``--eval-spacing``
EVAL_SPACINGS = ("even", "log")

#: the gpt model's defaults, where they differ from the MLP's (the command takes them for the
#: options not given): 512 steps of 64 sequences of 64 bytes, about a minute on 2 cores
GPT_DEFAULTS = dict(train_size=32768, batch_size=64, epochs=1, width=128, layers=2, context=64,
                    evals=8)


def check(cfg: Config) -> None:
    """Raise ``ValueError`` with a clear message for a configuration that cannot run."""
    if cfg.optimizer not in optimizers.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of "
                         f"{', '.join(optimizers.OPTIMIZERS)}")
    if cfg.dataset not in data.DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of {', '.join(data.DATASETS)}")
    _check_model(cfg)
    for name in ("train_size", "batch_size", "epochs", "width", "layers", "workers", "evals"):
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
    _check_clipping_and_betas(cfg)
    if not cfg.warmup >= 0:
        raise ValueError(f"--warmup must be >= 0, got {cfg.warmup}")
    if cfg.eval_spacing not in EVAL_SPACINGS:
        raise ValueError(f"unknown --eval-spacing {cfg.eval_spacing!r}; choose one of "
                         f"{', '.join(EVAL_SPACINGS)}")
    if cfg.schedule not in optimizers.SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; choose one of {optimizers.SCHEDULES}")
    if cfg.offload and not optimizers.OPTIMIZERS[cfg.optimizer].offloadable:
        raise ValueError(f"--offload applies to lamb, lans and adamw, not {cfg.optimizer}")
    if cfg.state_dtype not in optimizers.STATE_DTYPES:
        raise ValueError(f"unknown --state-dtype {cfg.state_dtype!r}; choose one of "
                         f"{', '.join(optimizers.STATE_DTYPES)}")
    if cfg.state_dtype != "float32" and not optimizers.OPTIMIZERS[cfg.optimizer].compact_state:
        raise ValueError(f"--state-dtype {cfg.state_dtype} applies to lamb, lans, adamw and "
                         f"offload-adam (Adam moments), not {cfg.optimizer}")
    _check_replicas(cfg)
    if cfg.shard and cfg.workers < 2 and not launch.under_torchrun():
        raise ValueError("--shard splits the parameters and the optimizer state over the "
                         "processes: use it with --workers 2 or more (or under torchrun)")
    for name in ("checkpoint_every", "stop_after", "keep_checkpoints"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.dgc:
        if cfg.optimizer != "momentum":
            raise ValueError("--dgc is DGC momentum SGD: use it with --optimizer momentum")
        if cfg.workers < 2 and not launch.under_torchrun():
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


def _check_clipping_and_betas(cfg: Config) -> None:
    if cfg.max_grad_norm is not None and not (math.isfinite(cfg.max_grad_norm)
                                              and cfg.max_grad_norm > 0):
        raise ValueError(f"--max-grad-norm must be a positive number, got {cfg.max_grad_norm}")
    if cfg.max_grad_norm is not None and cfg.dgc:
        raise ValueError("--max-grad-norm clips the averaged gradient, which DGC never forms "
                         "(each worker sends its own largest values): use one without the other")
    if cfg.betas is None:
        return
    if not optimizers.OPTIMIZERS[cfg.optimizer].betas:
        raise ValueError(f"--betas applies to the optimizers with Adam moments "
                         f"({', '.join(n for n, c in optimizers.OPTIMIZERS.items() if c.betas)}), "
                         f"not {cfg.optimizer}")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ValueError(f"--betas takes two numbers in [0, 1), got {list(cfg.betas)}")


def _check_model(cfg: Config) -> None:
    """The model trains on its dataset; the gpt model's sizes; what --measure-noise needs."""
    if cfg.model not in data.MODELS:
        raise ValueError(f"unknown model {cfg.model!r}; choose one of {', '.join(data.MODELS)}")
    if data.model_of(cfg.dataset) != cfg.model:
        raise ValueError(f"--model {cfg.model} does not train on --dataset {cfg.dataset}: the "
                         f"gpt model trains on text, the mlp on the other datasets")
    if cfg.model == "gpt" and (cfg.width % 32 or cfg.context < 2):
        raise ValueError(f"--model gpt needs a --width that is a multiple of 32 (heads of 32 "
                         f"dimensions) and a --context of at least 2; got {cfg.width} and "
                         f"{cfg.context}")
    if cfg.measure_noise:
        if cfg.dgc:
            raise ValueError("--measure-noise reads the gradients averaged over the workers, "
                             "and --dgc does not average them: use one without the other")
        if cfg.batch_size % (2 * cfg.workers):
            raise ValueError(f"--measure-noise splits each worker's batch into two halves: "
                             f"--batch-size must be a multiple of {2 * cfg.workers}")


def _check_replicas(cfg: Config) -> None:
    """--replicas: HSDP's replicas of a sharded model, a divisor of the workers; --dgc on a
    sharded model compresses the exchange between them, so it needs two or more."""
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else cfg.workers
    if cfg.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {cfg.replicas}")
    if cfg.replicas > 1 and not cfg.shard:
        raise ValueError("--replicas splits sharded workers into replicas (HSDP): use it with "
                         "--shard")
    if world % cfg.replicas:
        raise ValueError(f"--replicas {cfg.replicas} must divide the {world} workers: each "
                         f"replica shards the model over the same number of them")
    if cfg.shard and cfg.dgc and cfg.replicas < 2:
        raise ValueError("--shard with --dgc: DGC compresses the gradient exchange between "
                         "replicas, and a model sharded over every worker has none: give "
                         "--replicas 2 or more (HSDP: each replica shards the model, DGC "
                         "between the replicas), or train DGC without --shard (DDP)")


def default_out(cfg: Config, root: str = "scaleopt-runs") -> str:
    """A new folder for the run: named by what it trains and how, with a number added when a
    folder of that name already holds a run."""
    tag = "-".join([cfg.optimizer] + [w for w, on in (("offload", cfg.offload),
                                                      ("shard", cfg.shard), ("dgc", cfg.dgc)) if on]
                   + [cfg.dataset, f"b{cfg.batch_size}"]
                   + ([f"w{cfg.workers}"] if cfg.workers > 1 else [])
                   + ([f"r{cfg.replicas}"] if cfg.replicas > 1 else []))
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
    return any((path / name).exists()
               for name in ("result.json", checkpoint.CHECKPOINTS, "study.json", "bench.json"))


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


def _loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits ``(..., classes)`` against targets ``(...)``: of each example's
    class, or of each next byte of a sequence."""
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction=reduction)


def _evaluate(model, x, y, batch: int = 2 ** 16):
    """Mean test loss and accuracy over every target (every byte of a sequence), in chunks of
    at most ``batch`` targets."""
    model.eval()
    loss, correct = 0.0, 0
    rows = max(1, batch // (y[0].numel()))
    with torch.no_grad():
        for i in range(0, len(x), rows):
            out = model(x[i:i + rows])
            loss += _loss(out, y[i:i + rows], reduction="sum").item()
            correct += (out.argmax(-1) == y[i:i + rows]).sum().item()
    model.train()
    return loss / y.numel(), correct / y.numel()


def _shard(model: torch.nn.Module, mesh: Any = None) -> None:
    """FSDP2: each layer with parameters (the gpt model: each block), then the whole model,
    sharded over the world (or on ``mesh``: the 2-D mesh of HSDP, or its shard dimension)."""
    from torch.distributed.fsdp import fully_shard

    for m in getattr(model, "blocks", model):
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def make_model(cfg: Config, inputs: int, classes: int) -> torch.nn.Module:
    """The model ``cfg`` trains (on CPU, initialised from ``cfg.seed``)."""
    if cfg.model == "gpt":
        from .text import GPT

        torch.manual_seed(cfg.seed)
        return GPT(cfg.width, cfg.layers, cfg.context)
    vocab = data.TOPICS["vocab"] if cfg.dataset == "topics" else 0
    return data.make_model(inputs, classes, cfg.width, seed=cfg.seed, vocab=vocab)


def hsdp_mesh(cfg: Config, world: int, device: torch.device) -> Any:
    """The (replicate, shard) mesh of ``--replicas`` (None for one replica). Ranks of a replica
    are consecutive: under torchrun, the processes of one node."""
    if cfg.replicas < 2:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (cfg.replicas, world // cfg.replicas),
                            mesh_dim_names=("replicate", "shard"))


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


@dataclasses.dataclass
class Trainer:
    """One run's parts (made by :func:`build`) and where it stands (moved on by :func:`loop`)."""

    cfg: Config
    rank: int
    world: int
    #: training and test data on the run's device: x, y, test x, test y
    data: Tuple[torch.Tensor, ...]
    model: torch.nn.Module
    #: the model as trained: DDP-wrapped over several workers (not with DGC or sharding)
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    #: the next step to run; the step the run started at; seconds trained before it
    step: int = 0
    first: int = 0
    before: float = 0.0
    history: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    #: (step, training loss of the batch)
    curve: List[Any] = dataclasses.field(default_factory=list)
    checkpoints: List[str] = dataclasses.field(default_factory=list)
    dgc_totals: Dict[str, float] = dataclasses.field(default_factory=dict)
    interrupted: bool = False
    #: the step of the last evaluation (on every rank)
    evaluated_at: int = -1
    #: why a checkpoint could not be written (the run ended there), or None
    checkpoint_error: Optional[str] = None
    elapsed: float = 0.0
    #: the gradient noise scale's estimator (with --measure-noise) and its measurements
    noise: Any = None
    noise_history: List[Dict[str, float]] = dataclasses.field(default_factory=list)
    reached: Any = None  # a shared integer: the step rank 0 has finished (launch.shared_step)
    #: with ``cfg.dev_split``: the development split's x and y, and its loss at the end
    dev: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    dev_loss: Optional[float] = None


def run(cfg: Config, rank: int = 0, world: int = 1, write: bool = True,
        stop: Any = launch.STOP, reached: Any = None) -> Dict[str, Any]:
    """Train; on rank 0 return the results (and write them if ``write`` and ``cfg.out``).
    ``stop``: an event that ends the run after the current step; ``reached``: a shared integer
    that rank 0 sets to each step it finishes. Raises :class:`Diverged`, and
    :class:`checkpoint.CheckpointError` for a checkpoint that cannot be resumed."""
    check(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    trainer = build(cfg, rank, world)
    if cfg.out and (cfg.checkpoint_every or cfg.stop_after):
        checkpoint.check_space(cfg.out, 2 * checkpoint.estimated_bytes(trainer.model))
    trainer.reached = reached if rank == 0 else None
    loop(trainer, stop)
    result = results(trainer)
    if result and cfg.out and write:
        write_results(result, cfg.out)
    return result


def write_results(result: Dict[str, Any], out: str) -> None:
    """The run's files; a failure to write them (a full disk) is put in ``result``."""
    try:
        report.write_run(result, out)
    except OSError as exc:
        result["write_error"] = f"cannot write the results into {out}: {exc}"


def _optimizer(cfg: Config, model: torch.nn.Module, mesh: Any) -> torch.optim.Optimizer:
    if not cfg.dgc:
        return optimizers.build(model, cfg)
    return DGCMomentum(param_groups(model, weight_decay=cfg.weight_decay), lr=cfg.resolved_lr(),
                       momentum=0.9, sparsity=cfg.dgc_sparsity or list(PAPER_SPARSITY),
                       rampup_begin_step=cfg.dgc_rampup_begin_step, rampup_step=cfg.dgc_rampup(),
                       min_numel=cfg.dgc_min_numel, value_dtype=getattr(torch, cfg.dgc_value_dtype),
                       mesh=mesh)


def build(cfg: Config, rank: int, world: int) -> Trainer:
    """The data, model, optimizer and schedule of a run (at its last checkpoint with
    ``cfg.resume``), on this rank's device."""
    device = torch.device(cfg.device if not cfg.device.startswith("cuda") or world == 1
                          else f"cuda:{rank % torch.cuda.device_count()}")
    x, y, xt, yt, classes = data.load(cfg.dataset, cfg.train_size, context=cfg.context,
                                      split="test" if cfg.dev_split else "validation")
    model = make_model(cfg, x.shape[1], classes).to(device)
    mesh = hsdp_mesh(cfg, world, device) if cfg.shard else None
    if cfg.shard:  # with DGC, FSDP2 inside each replica and DGC between them
        _shard(model, mesh["shard"] if mesh is not None and cfg.dgc else mesh)
    opt = _optimizer(cfg, model, mesh)
    schedule = optimizers.schedule(cfg.schedule, cfg.total_steps(), cfg.warmup_steps())
    net = model
    if world > 1 and not cfg.dgc and not cfg.shard:  # DGC communicates in its step
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    trainer = Trainer(cfg, rank, world, tuple(t.to(device) for t in (x, y, xt, yt)), model, net,
                      opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    if cfg.dev_split:
        trainer.dev = tuple(t.to(device) for t in data.load(
            cfg.dataset, cfg.train_size, context=cfg.context, split="dev")[2:4])
    if cfg.measure_noise:
        trainer.noise = GradientNoiseScale(model.parameters())
    if cfg.resume:
        path = checkpoint.chosen(cfg.resume)
        meta = checkpoint.read_meta(path)
        checkpoint.load(path, meta, model, opt)
        trainer.sched.load_state_dict(meta["scheduler"])
        trainer.step = trainer.first = meta["step"]
        trainer.before, trainer.history = meta["time_s"], meta["history"]
        trainer.curve = [tuple(c) for c in meta["train_curve"]]
        if trainer.noise is not None and "noise" in meta:
            trainer.noise.load_state_dict(meta["noise"]["state"])
            trainer.noise_history = meta["noise"]["history"]
    return trainer


def _progress_bar(t: Trainer, total: int) -> Any:
    """A progress bar on rank 0 (on a terminal; none in a log, or without tqdm)."""
    tqdm = _tqdm() if t.rank == 0 and t.cfg.progress else None
    if tqdm is None:
        return None
    return tqdm(total=total, initial=t.step, desc=f"{t.cfg.optimizer} b{t.cfg.batch_size}",
                unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=0.5, disable=None)


def _train_step(t: Trainer, batch: torch.Tensor) -> torch.Tensor:
    """One optimizer step on the global batch ``batch`` (this rank takes its slice); this
    rank's loss. A step that measures the gradient noise scale takes the batch in two halves
    (each rank its slice of each, the gradients accumulated)."""
    x, y = t.data[0], t.data[1]
    t.opt.zero_grad(set_to_none=True)
    if t.noise is not None and t.step % t.cfg.noise_every() == 0:
        loss = _measured_backward(t, batch.view(2, t.world, -1)[:, t.rank])
    else:
        idx = batch.view(t.world, -1)[t.rank]
        loss = _loss(t.net(x[idx]), y[idx])
        loss.backward()
    if t.cfg.max_grad_norm is not None and not optimizers.OPTIMIZERS[t.cfg.optimizer].clips:
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.cfg.max_grad_norm)
    t.opt.step()
    t.sched.step()
    t.step += 1
    if t.cfg.dgc:
        for key in ("bytes_sent", "bytes_sent_measured", "dense_bytes", "payload_bytes",
                    "dense_payload_bytes",
                    "selected", "numel"):
            t.dgc_totals[key] = t.dgc_totals.get(key, 0) + t.opt.telemetry[key]
    return loss


def _measured_backward(t: Trainer, halves: torch.Tensor) -> torch.Tensor:
    """The backward of a batch in two halves (this rank's slice of each), measuring the
    gradient noise scale from the halves' gradients and their sum (``t.noise``); the loss."""
    x, y = t.data[0], t.data[1]
    t.noise.begin()
    total = 0.0
    for part in halves:
        loss = _loss(t.net(x[part]), y[part]) / len(halves)
        loss.backward()
        t.noise.accumulated()
        total = total + loss.detach()
    m = t.noise.end(micro_batch=len(halves[-1]) * t.world)
    if t.rank == 0:
        t.noise_history.append({"step": t.step, "g2": m["g2"], "trace": m["trace"],
                                "b_simple": m["b_simple"]})
    return total


def _evaluated(t: Trainer, loss_value: float, start: float) -> None:
    """The test loss and accuracy now, in the history (every rank of a sharded model evaluates:
    its forward needs them all)."""
    t.evaluated_at = t.step
    if t.rank == 0 or t.cfg.shard:
        test_loss, test_acc = _evaluate(t.model, t.data[2], t.data[3])
    if t.rank == 0:
        t.history.append({"step": t.step, "epoch": t.step / t.cfg.steps_per_epoch(),
                          "train_loss": loss_value, "lr": t.sched.get_last_lr()[0],
                          "test_loss": test_loss, "test_accuracy": test_acc,
                          "time_s": time.perf_counter() - start})
        if t.noise_history:
            t.history[-1]["b_simple"] = t.noise_history[-1]["b_simple"]


def _save(t: Trainer, start: float) -> None:
    cfg = t.cfg
    meta = {"config": dataclasses.asdict(cfg), "total_steps": cfg.total_steps(),
            "optimizer_class": type(t.opt).__name__, "parameters": checkpoint.shapes(t.model),
            "scheduler": t.sched.state_dict(), "history": t.history, "train_curve": t.curve,
            "time_s": time.perf_counter() - start, "world": t.world}
    if t.noise is not None:
        meta["noise"] = {"state": t.noise.state_dict(), "history": t.noise_history}
    t.checkpoints.append(checkpoint.save(cfg.out, t.step, t.model, t.opt, meta, t.rank, t.world,
                                         keep=cfg.keep_checkpoints))


def loop(t: Trainer, stop: Any) -> None:
    """Train from ``t.step`` to the end of the run (or ``cfg.stop_after``, or a stop request,
    seen by every rank at the same step), evaluating, logging and checkpointing on the way."""
    cfg, total = t.cfg, t.cfg.total_steps()
    steps_per_epoch = cfg.steps_per_epoch()
    g = torch.Generator().manual_seed(cfg.seed)  # the same batches on every rank
    evals, log_every = cfg.eval_steps(), max(1, total // 200)
    end = min(total, cfg.stop_after or total)
    bar = _progress_bar(t, total)
    for _ in range(1 + max(0, t.step - 1) // steps_per_epoch):  # the epochs' orders so far
        perm = torch.randperm(cfg.train_size, generator=g)
    start = time.perf_counter() - t.before
    loss_value = float("nan")
    while t.step < end:
        k = t.step % steps_per_epoch
        if k == 0 and t.step > 0:
            perm = torch.randperm(cfg.train_size, generator=g)
        batch = perm[k * cfg.batch_size:(k + 1) * cfg.batch_size]
        loss = _train_step(t, batch.to(t.data[0].device))
        step = t.step
        if t.reached is not None:
            t.reached.value = step
        stopping = t.world == 1 and stop.is_set()  # one process: every step
        if step % log_every == 0 or step in evals or step == total:
            loss_value, stopping = _mean_over_ranks(loss, t.world, stop.is_set())
            if t.rank == 0:
                t.curve.append((step, loss_value))
            if not math.isfinite(loss_value):
                if bar is not None:
                    bar.close()
                raise Diverged(f"the training loss is {loss_value} at step {step}: lower --lr")
        elif t.world > 1 and step % STOP_CHECK_EVERY == 0:
            stopping = _mean_over_ranks(loss, t.world, stop.is_set())[1]
        if bar is not None:
            bar.update(1)
            if step % log_every == 0 or step == total:
                rate = (step - t.first) * cfg.batch_size / (time.perf_counter() - start - t.before)
                bar.set_postfix(loss=f"{loss_value:.4f}", samples_per_s=f"{rate:,.0f}")
        t.interrupted = stopping and step < end
        if step in evals or step == total or t.interrupted:
            _evaluated(t, loss_value, start)
        if cfg.out and ((cfg.checkpoint_every and (step % cfg.checkpoint_every == 0
                                                   or t.interrupted))
                        or step == cfg.stop_after):
            try:
                _save(t, start)
            except checkpoint.CheckpointWriteError as exc:  # on every rank: the run ends here
                t.checkpoint_error, t.interrupted = str(exc), step < total
        if t.interrupted:
            break
    if t.evaluated_at != t.step:  # stopped between evaluations
        _evaluated(t, loss_value, start)
    if t.dev is not None and (t.rank == 0 or cfg.shard):
        t.dev_loss = _evaluate(t.model, *t.dev)[0]
    t.elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()


def _traffic(t: Trainer) -> Dict[str, Any]:
    """What the workers sent per step: DGC's telemetry, or DDP's all-reduced gradient bytes."""
    steps = t.step - t.first
    if t.cfg.dgc:
        d = t.dgc_totals
        return {"dgc_bytes_sent_per_rank_per_step": d["bytes_sent"] / steps,
                "dgc_bytes_sent_measured_per_rank_per_step": d["bytes_sent_measured"] / steps,
                "dgc_between": (f"{t.cfg.replicas} replicas of {t.world // t.cfg.replicas} shards"
                                if t.cfg.shard else f"{t.world} workers"),
                "dense_bytes_sent_per_rank_per_step": d["dense_bytes"] / steps,
                "dgc_payload_bytes_per_rank_per_step": d["payload_bytes"] / steps,
                "dense_payload_bytes_per_rank_per_step": d["dense_payload_bytes"] / steps,
                "dgc_density": d["selected"] / d["numel"],
                "dgc_final_telemetry": dict(t.opt.telemetry)}
    if t.cfg.shard and t.cfg.replicas > 1:
        # HSDP: each rank all-reduces its gradient shards with the same shard's replicas
        shard_bytes = sum(local_piece(p).numel() * p.element_size() for p in t.model.parameters())
        r = t.cfg.replicas
        return {"replica_allreduce_bytes_per_step": shard_bytes,
                "replica_bytes_sent_per_rank_per_step": int(2 * (r - 1) / r * shard_bytes)}
    if t.world > 1 and not t.cfg.shard:
        # DDP all-reduces every gradient each step (ring all-reduce: each rank sends about
        # 2(N-1)/N of the gradient bytes)
        grad_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters())
        return {"allreduce_bytes_per_step": grad_bytes,
                "bytes_sent_per_rank_per_step": int(2 * (t.world - 1) / t.world * grad_bytes)}
    return {}


def _sizes(t: Trainer) -> Dict[str, int]:
    """Parameter and optimizer-state bytes per rank (sharded: the largest shard's, as the first
    ranks take the remainders)."""
    sizes = checkpoint.state_bytes(t.model, t.opt)
    if t.cfg.shard:
        per_rank_bytes = torch.tensor([sizes["param_bytes_per_rank"],
                                       sizes["optimizer_state_bytes_per_rank"]])
        dist.all_reduce(per_rank_bytes, op=dist.ReduceOp.MAX)
        sizes["param_bytes_per_rank"], sizes["optimizer_state_bytes_per_rank"] = map(
            int, per_rank_bytes.tolist())
    return sizes


def results(t: Trainer) -> Dict[str, Any]:
    """The run's results on rank 0 (an empty dict on the others)."""
    cfg, sizes = t.cfg, _sizes(t)
    if t.rank != 0:
        return {}
    last, steps, seconds = t.history[-1], t.step - t.first, t.elapsed - t.before
    return {
        "config": dataclasses.asdict(cfg), "lr": cfg.resolved_lr(),
        "parameters": sum(p.numel() for p in t.model.parameters()),
        "steps": t.step, "total_steps": cfg.total_steps(),
        "complete": t.step == cfg.total_steps(), "interrupted": t.interrupted,
        "resumed_at": t.first if cfg.resume else None, "epochs": t.step / cfg.steps_per_epoch(),
        "train_loss": last["train_loss"], "test_loss": last["test_loss"],
        "test_accuracy": last["test_accuracy"], "time_s": t.elapsed,
        "steps_per_s": steps / seconds, "samples_per_s": steps * cfg.batch_size / seconds,
        "history": t.history, "train_curve": t.curve, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "workers": t.world, "sharded": cfg.shard,
        "checkpoints": t.checkpoints, "checkpoint_error": t.checkpoint_error,
        **sizes, **_traffic(t), **_torchrun_restarts(), **_text(t), **_noise(t), **_dev(t),
    }


def _dev(t: Trainer) -> Dict[str, Any]:
    """The development split's loss at the end (with ``--dev-split``), in bits per byte too
    for text."""
    if t.dev_loss is None:
        return {}
    from . import text

    return {"dev_loss": t.dev_loss, **({"dev_bits_per_byte": text.bits_per_byte(t.dev_loss)}
                                       if t.cfg.dataset == "text" else {})}


def _text(t: Trainer) -> Dict[str, Any]:
    """A text run's corpus, its validation loss in bits per byte, and the unigram baseline's."""
    if t.cfg.dataset != "text":
        return {}
    from . import text

    return {"corpus": text.corpus()[1], "tokens": t.step * t.cfg.batch_size * t.cfg.context,
            "test_bits_per_byte": text.bits_per_byte(t.history[-1]["test_loss"]),
            "unigram_bits_per_byte": text.unigram_bits_per_byte()}


def _noise(t: Trainer) -> Dict[str, Any]:
    """The gradient noise scale (--measure-noise): its last moving-average estimate, in
    examples (and, for text, in tokens), and the measurements along the run."""
    if t.noise is None:
        return {}
    b = t.noise.b_simple
    per_example = t.cfg.context if t.cfg.dataset == "text" else 1
    return {"noise_scale": {"b_simple": b, "b_simple_tokens": b * per_example,
                            "every": t.cfg.noise_every(), "beta": t.noise.beta,
                            "history": t.noise_history}}


def _torchrun_restarts() -> Dict[str, int]:
    """How often torchrun restarted the workers of this run (under torchrun, where it did)."""
    n = launch.torchrun_restart()
    return {"torchrun_restarts": n} if n else {}


# ------------------------------------------------------------------------------------------------
# several processes
# ------------------------------------------------------------------------------------------------


def _rank(rank: int, world: int, stop: Any, cfg: Config, result_file: str,
          reached: Any = None) -> None:
    """One of the command's workers (see :func:`launch.spawn`)."""
    if cfg.threads is None:  # share the cores between the processes
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    result = run(cfg, rank, world, write=False, stop=stop, reached=reached)
    if rank == 0:
        pathlib.Path(result_file).write_text(json.dumps(result))


class WorkersLost(RuntimeError):
    """Workers died more often than ``--max-restarts`` allows; the message says when and how."""


def _torchrun(cfg: Config) -> Dict[str, Any]:
    """``cfg`` as one rank of a ``torchrun`` launch."""
    launch.init_torchrun_group(launch.backend(cfg.device))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = dataclasses.replace(cfg, workers=world)
        check(cfg)
        pids: List[Any] = [None] * world
        dist.all_gather_object(pids, os.getpid())  # this node's and the others' (their ids)
        if rank == 0:
            _write_pids(cfg, pids, launch.torchrun_restart())
        with launch.interruptible(launch.STOP):
            result = run(cfg, rank, world)
        dist.barrier()  # no rank leaves the group while another still uses it
        if rank == 0:
            _remove_pids(cfg)
        return result
    finally:
        launch.end_group()


#: where a run's workers' process ids are written while they run (``scaleopt train
#: --workers N``): {"pids": [...], "restart": n}
WORKERS_FILE = "workers.json"


def _how_it_died(exc: BaseException) -> str:
    if isinstance(exc, mp.ProcessExitedException):
        how = (f"killed by {exc.signal_name}" if exc.signal_name
               else f"ended with exit code {exc.exit_code}")
        return f"worker {exc.error_index} (pid {exc.error_pid}) was {how}"
    return (f"worker {exc.error_index} (pid {exc.error_pid}) lost its connection to another worker "
            f"(which died)")


def _workers(cfg: Config) -> Dict[str, Any]:
    """``cfg`` in ``cfg.workers`` processes started here; rank 0's results. A worker that dies
    (killed, out of memory) ends the others; they are started again from the newest checkpoint
    that verifies (or from the start of the run where there is none yet), at most
    ``cfg.max_restarts`` times, and ``restarts`` in the results says when and what was redone."""
    try:
        return _workers_restarted(cfg)
    finally:
        _remove_pids(cfg)  # (also when the run ends with an error)


def _workers_restarted(cfg: Config) -> Dict[str, Any]:
    reached, restarts, attempt = launch.shared_step(), [], cfg
    while True:
        with tempfile.TemporaryDirectory() as tmp:
            result_file = os.path.join(tmp, "result.json")
            try:
                launch.spawn(_rank, cfg.workers, cfg.device, attempt, result_file, reached,
                             started=lambda pids: _write_pids(cfg, pids, len(restarts)))
                result = json.loads(pathlib.Path(result_file).read_text())
                break
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
                if not launch.lost_a_peer(exc):
                    _raise_cause(exc)
                died = _how_it_died(exc)
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
        result["resumed_at"] = (checkpoint.read_meta(pathlib.Path(cfg.resume))["step"]
                                if cfg.resume else None)
    return result


def _raise_cause(exc: BaseException) -> None:
    """A worker's own error, as this process's: divergence and checkpoint errors by their
    classes, others as they came."""
    text = str(exc)
    last = text.strip().splitlines()[-1]
    if "Diverged" in text:
        raise Diverged(last) from None
    if "CheckpointError" in text:
        raise checkpoint.CheckpointError(last.split(": ", 1)[-1]) from None
    raise exc


def _restart_point(cfg: Config) -> Tuple[Config, int]:
    """Where workers that died start again: the newest checkpoint of the run folder that
    verifies, else where the run began (its ``--resume`` checkpoint, or step 0)."""
    if cfg.out:
        try:
            path = checkpoint.find(cfg.out)
        except checkpoint.CheckpointError:
            path = None
        if path is not None:
            return dataclasses.replace(cfg, resume=str(path)), checkpoint.read_meta(path)["step"]
    start = checkpoint.read_meta(pathlib.Path(cfg.resume))["step"] if cfg.resume else 0
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


def train(cfg: Config) -> Dict[str, Any]:
    """Run ``cfg``: in this process, in ``cfg.workers`` processes started here, or as one rank
    of a ``torchrun`` launch (``WORLD_SIZE`` set in the environment)."""
    check(cfg)
    if launch.under_torchrun():
        return _torchrun(cfg)
    if cfg.workers == 1:
        launch.STOP.clear()
        with launch.interruptible(launch.STOP):
            return run(cfg)
    result = _workers(cfg)
    if cfg.out:
        report.write_run(result, cfg.out)
    return result
