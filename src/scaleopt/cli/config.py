"""A training run's configuration (what ``scaleopt train`` and each run of a study take), its
checks, and the folder its results go to."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
from typing import Any, Dict, List, Optional, Tuple

from . import checkpoint, data, optimizers, options, world


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
    #: the text dataset's split: "topics" (held-out text shares no 64-byte window with the
    #: training bytes) or "tail" (the earlier one, kept to repeat runs made on it)
    text_split: str = "topics"
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
    powersgd: Optional[int] = None  # DDP with torch's PowerSGD hook at this rank

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


#: the fields of a run's configuration (the options that make one)
FIELDS = frozenset(f.name for f in dataclasses.fields(Config))


def configured(args: argparse.Namespace, given: set, gpt: Dict[str, Any], **over: Any) -> Config:
    """The run's configuration from the options (those not given take Config's defaults); a
    model or a dataset given alone brings the other, and the gpt model takes ``gpt``'s values
    for the options not given."""
    values = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    values["progress"] = not args.no_progress
    if "model" in given and "dataset" not in given:
        values["dataset"] = "text" if args.model == "gpt" else Config.dataset
    elif "model" not in given:
        values["model"] = data.model_of(values.get("dataset", Config.dataset))
    if values["model"] == "gpt":
        values.update({k: v for k, v in gpt.items() if k not in given and k in FIELDS})
    values.update(over)
    return Config(**values)


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
    if cfg.text_split not in ("topics", "tail"):
        raise ValueError(f"--text-split must be topics or tail, got {cfg.text_split!r}")
    if cfg.dataset == "stdlib" and cfg.text_split != "topics":
        raise ValueError("--text-split chooses the text dataset's split; --dataset stdlib has "
                         "one split (whole files held out, deduplicated)")
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
    if cfg.shard and cfg.workers < 2 and not world.under_torchrun():
        raise ValueError("--shard splits the parameters and the optimizer state over the "
                         "processes: use it with --workers 2 or more (or under torchrun)")
    for name in ("checkpoint_every", "stop_after", "keep_checkpoints"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    if cfg.dgc:
        if cfg.workers < 2 and not world.under_torchrun():
            raise ValueError("--dgc compresses the gradients the workers exchange: use it with "
                             "--workers 2 or more (one process exchanges nothing)")
        for sp in cfg.dgc_sparsity or ():
            if not 0 <= sp < 1:
                raise ValueError(f"--dgc-sparsity values must be in [0, 1), got {sp}")
        if cfg.dgc_rampup_begin_step < 0 or cfg.dgc_rampup() < 1 or cfg.dgc_min_numel < 0:
            raise ValueError("--dgc-rampup-begin-step and --dgc-min-numel must be >= 0, "
                             "--dgc-rampup-steps >= 1")
    if cfg.powersgd is not None and (cfg.shard or cfg.dgc or cfg.measure_noise or (
            cfg.workers < 2 and not world.under_torchrun())):
        raise ValueError("--powersgd compresses DDP's all-reduce: use it with --workers 2 or "
                         "more, and without --shard, --dgc or --measure-noise")
    if cfg.powersgd is not None and (cfg.checkpoint_every or cfg.stop_after or cfg.resume):
        raise ValueError("--powersgd runs are not checkpointed: torch's PowerSGD state (its "
                         "error feedback per DDP bucket) has no state dict to resume from")
    options.check_device(cfg.device)
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
                         f"gpt model trains on text and stdlib, the mlp on the other datasets")
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
    size = int(os.environ["WORLD_SIZE"]) if world.under_torchrun() else cfg.workers
    if cfg.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {cfg.replicas}")
    if cfg.replicas > 1 and not cfg.shard:
        raise ValueError("--replicas splits sharded workers into replicas (HSDP): use it with "
                         "--shard")
    if size % cfg.replicas:
        raise ValueError(f"--replicas {cfg.replicas} must divide the {size} workers: each "
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
               for name in ("result.json", checkpoint.CHECKPOINTS, "study.json", "bench.json",
                            "memory.json"))


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
# what every run is trained with (``train`` and each run of ``study``)
# ------------------------------------------------------------------------------------------------


def add_model_options(p: argparse.ArgumentParser, gpt: Dict[str, Any]) -> None:
    """The data and the model; ``gpt``: the defaults of ``--model gpt`` that differ."""
    d = Config()
    g = p.add_argument_group("data and model")
    g.add_argument("--dataset", choices=sorted(data.DATASETS),
                   help="; ".join(f"{k}: {v}" for k, v in data.DATASETS.items())
                   + f" (default: {d.dataset}; text with --model gpt)")
    g.add_argument("--model", choices=sorted(data.MODELS),
                   help="; ".join(f"{k}: {v}" for k, v in data.MODELS.items())
                   + " (default: the dataset's; gpt with --dataset text)")
    g.add_argument("--train-size", type=options.positive_int,
                   help=f"training examples, generated (default: {d.train_size}; the test set has "
                        f"16384); text: windows of --context bytes at random offsets of the "
                        f"training split, the same on every run (default: {gpt['train_size']})")
    g.add_argument("--width", type=options.positive_int,
                   help=f"hidden width of the 2-hidden-layer MLP (default: {d.width}), or the "
                        f"gpt model's width, a multiple of 32 (default: {gpt['width']})")
    g.add_argument("--layers", type=options.positive_int,
                   help=f"the gpt model's decoder blocks (default: {gpt['layers']})")
    g.add_argument("--context", type=options.positive_int,
                   help=f"the gpt model's sequence length in bytes (default: {gpt['context']})")
    g.add_argument("--text-split", choices=["topics", "tail"],
                   help="the text's held-out parts: whole groups of topics that share no "
                        "64-byte window with the training bytes (topics, the default), or the "
                        "earlier tail of the corpus (tail: it shares text with training; kept "
                        "to repeat runs made on it); --dataset text only")
    g.add_argument("--measure-noise", action="store_true", default=None,
                   help="measure the gradient noise scale B_simple along the run (about 100 "
                        "times: the step's batch in two halves, from their gradients' norms)")
    g.add_argument("--evals", type=options.positive_int,
                   help=f"evaluations on the held-out data along the run (default: "
                        f"{d.evals}; gpt: {gpt['evals']})")
    g.add_argument("--eval-spacing", choices=EVAL_SPACINGS,
                   help="evaluate every total/evals steps (even), or at total * 2^(-i/3) for "
                        "i = 0 ... evals - 1 (log: a third of an octave apart, for curves read "
                        f"early, as the study does) (default: {d.eval_spacing}"
                        + (f"; gpt: {gpt['eval_spacing']}" if "eval_spacing" in gpt else "")
                        + ")")


def add_schedule_options(g: Any, epochs: int) -> None:
    """What every run is trained with: epochs, decay, the LR schedule, the seed, clipping and
    betas."""
    d = Config()
    g.add_argument("--epochs", type=options.positive_int,
                   help=f"passes over the training set (default: {epochs}; gpt: 1)")
    g.add_argument("--weight-decay", type=float,
                   help=f"decay of weight matrices; biases and norms get none (default: {d.weight_decay})")
    g.add_argument("--warmup", type=float,
                   help="linear warm-up: a fraction of the steps if below 1, else a number of "
                        f"steps (default: {d.warmup})")
    g.add_argument("--schedule", choices=optimizers.SCHEDULES,
                   help=f"learning-rate decay after warm-up (default: {d.schedule})")
    g.add_argument("--seed", type=int, help=f"model and batch order seed (default: {d.seed})")
    g.add_argument("--max-grad-norm", type=float, metavar="NORM",
                   help="clip the gradients to this global norm before each step (the "
                        "optimizer's own max_grad_norm; for torch's, clip_grad_norm_) "
                        "(default: no clipping)")
    g.add_argument("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"),
                   help="Adam's betas, for the optimizers with Adam moments (Muon: its AdamW "
                        "part) (default: each optimizer's)")


def add_state_dtype(g: Any) -> None:
    g.add_argument("--state-dtype", choices=optimizers.STATE_DTYPES,
                   help="how lamb, lans, adamw and offload-adam store their moments: float32 "
                        "(8 bytes per parameter), bfloat16 (4) or int8 (about 2: 8-bit codes "
                        "with a scale per block of 256); the update computes in float32 "
                        f"(default: {Config().state_dtype})")


def add_system_options(p: argparse.ArgumentParser) -> Any:
    """``--device`` and ``--threads`` of a run; the group, for more."""
    g = p.add_argument_group("system")
    options.add_device(g, "cpu or cuda (default: cpu)")
    options.add_threads(g, "intra-op threads (default: torch's)")
    return g


def add_run_output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    options.add_output(g)
    g.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
