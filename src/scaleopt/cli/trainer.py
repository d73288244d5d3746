"""One training run as data flows: :func:`build` (the data, the model, the optimizer, the
schedule, a resumed checkpoint) -> :func:`loop` (steps, evaluations, checkpoints, the stop
flag) -> :func:`results`, in this process or as one rank of several."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..dgc import DGCMomentum, ReplicaCompression
from .._sharding import local_piece
from ..groups import param_groups
from ..noise import GradientNoiseScale
from . import checkpoint, data, models, optimizers, report, resume, world
from .config import Config, check


class Diverged(RuntimeError):
    """The training loss became inf or NaN."""


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


def _tqdm():
    """tqdm's progress bar class, or None where tqdm is not installed (the cli extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _mean_over_ranks(value: torch.Tensor, ranks: int, stop: bool) -> Tuple[float, bool]:
    """The batch loss over the global batch (each of ``ranks`` ranks has its slice of it), and
    whether any rank was asked to stop (in the same all-reduce, so that every rank stops at
    this step)."""
    both = torch.stack([value.detach().float().reshape(()), torch.tensor(float(stop))])
    if ranks > 1:
        world.doing("the all-reduce of the loss and the stop flag")
        dist.all_reduce(both)
    return both[0].item() / ranks, bool(both[1].item() > 0)


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
    hook: Any = None  # --dgc with an optimizer other than momentum: the DGC hook's state (DDP),
    # or ReplicaCompression (--shard --replicas R: top-k between the replicas)
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
        stop: Any = world.STOP, reached: Any = None) -> Dict[str, Any]:
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
    if not cfg.dgc or cfg.optimizer != "momentum":  # (others: the DGC hook, models.parallel)
        return optimizers.build(model, cfg)
    return DGCMomentum(param_groups(model, weight_decay=cfg.weight_decay), lr=cfg.resolved_lr(),
                       momentum=0.9, mesh=mesh, **optimizers.dgc_options(cfg))


def build(cfg: Config, rank: int, world: int) -> Trainer:
    """The data, model, optimizer and schedule of a run (at its last checkpoint with
    ``cfg.resume``), on this rank's device."""
    device = torch.device(cfg.device if not cfg.device.startswith("cuda") or world == 1
                          else f"cuda:{rank % torch.cuda.device_count()}")
    x, y, xt, yt, classes = data.load(cfg.dataset, cfg.train_size, context=cfg.context,
                                      split="test" if cfg.dev_split else "validation",
                                      text_split=cfg.text_split)
    model = models.make_model(cfg, x.shape[1], classes).to(device)
    mesh = models.hsdp_mesh(cfg.replicas, world, device) if cfg.shard else None
    if cfg.shard:  # with DGC, FSDP2 inside each replica and DGC between them
        models.shard(model, mesh["shard"] if mesh is not None and cfg.dgc else mesh)
    opt = _optimizer(cfg, model, mesh)
    schedule = optimizers.schedule(cfg.schedule, cfg.total_steps(), cfg.warmup_steps())
    net, hook = models.parallel(cfg, model, world, device)
    if cfg.shard and cfg.dgc and cfg.optimizer != "momentum":  # top-k between the replicas
        hook = ReplicaCompression(model, mesh, **optimizers.dgc_options(cfg))
    trainer = Trainer(cfg, rank, world, tuple(t.to(device) for t in (x, y, xt, yt)), model, net,
                      opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    trainer.hook = hook
    if cfg.dev_split:
        trainer.dev = tuple(t.to(device) for t in data.load(
            cfg.dataset, cfg.train_size, context=cfg.context, split="dev",
            text_split=cfg.text_split)[2:4])
    if cfg.measure_noise:
        trainer.noise = GradientNoiseScale(model.parameters())
    if cfg.resume:
        path = resume.chosen(cfg.resume)
        meta = resume.read_meta(path)
        checkpoint.load(path, meta, model, opt, hook=hook)
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
    world.doing(f"step {t.step + 1}'s forward and backward passes (the gradients' collectives)")
    if t.noise is not None and t.step % t.cfg.noise_every() == 0:
        loss = _measured_backward(t, batch.view(2, t.world, -1)[:, t.rank])
    else:
        idx = batch.view(t.world, -1)[t.rank]
        loss = _loss(t.net(x[idx]), y[idx])
        loss.backward()
    world.doing(f"step {t.step + 1}'s optimizer step (its collectives)")
    if isinstance(t.hook, ReplicaCompression):
        t.hook.exchange()
    if t.cfg.max_grad_norm is not None and not optimizers.OPTIMIZERS[t.cfg.optimizer].clips:
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.cfg.max_grad_norm)
    t.opt.step()
    t.sched.step()
    t.step += 1
    if t.cfg.dgc:
        telemetry = (t.hook or t.opt).telemetry
        for key in ("bytes_sent", "bytes_sent_measured", "dense_bytes", "payload_bytes",
                    "dense_payload_bytes",
                    "selected", "numel"):
            t.dgc_totals[key] = t.dgc_totals.get(key, 0) + telemetry[key]
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
    world.doing(f"the evaluation at step {t.step}")
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
    world.doing(f"writing the checkpoint of step {t.step}")
    meta = {"config": dataclasses.asdict(cfg), "total_steps": cfg.total_steps(),
            "optimizer_class": type(t.opt).__name__, "parameters": checkpoint.shapes(t.model),
            "scheduler": t.sched.state_dict(), "history": t.history, "train_curve": t.curve,
            "time_s": time.perf_counter() - start, "world": t.world}
    if t.noise is not None:
        meta["noise"] = {"state": t.noise.state_dict(), "history": t.noise_history}
    t.checkpoints.append(checkpoint.save(cfg.out, t.step, t.model, t.opt, meta, t.rank, t.world,
                                         keep=cfg.keep_checkpoints, hook=t.hook))


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
                "dgc_between": (f"{t.cfg.replicas} replicas of {t.world // t.cfg.replicas} "
                                f"shard{'s' * (t.world > t.cfg.replicas)}"
                                if t.cfg.shard else f"{t.world} workers"),
                "dense_bytes_sent_per_rank_per_step": d["dense_bytes"] / steps,
                "dgc_payload_bytes_per_rank_per_step": d["payload_bytes"] / steps,
                "dense_payload_bytes_per_rank_per_step": d["dense_payload_bytes"] / steps,
                "dgc_density": d["selected"] / d["numel"],
                "dgc_final_telemetry": dict((t.hook or t.opt).telemetry)}
    if t.cfg.shard and t.cfg.replicas > 1:
        # HSDP: each rank all-reduces its gradient shards with the same shard's replicas
        shard_bytes = sum(local_piece(p).numel() * p.element_size() for p in t.model.parameters())
        r = t.cfg.replicas
        return {"replica_allreduce_bytes_per_step": shard_bytes,
                "replica_bytes_sent_per_rank_per_step": int(2 * (r - 1) / r * shard_bytes)}
    if t.world > 1 and not t.cfg.shard and not t.cfg.powersgd:
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
        "cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "workers": t.world, "sharded": cfg.shard,
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
                                       if t.cfg.dataset in data.TEXTS else {})}


def _text(t: Trainer) -> Dict[str, Any]:
    """A text run's corpus, its validation loss in bits per byte, and the unigram baseline's."""
    if t.cfg.dataset not in data.TEXTS:
        return {}
    source = data.corpus_of(t.cfg.dataset)
    return {"corpus": source.corpus()[1], "tokens": t.step * t.cfg.batch_size * t.cfg.context,
            "test_bits_per_byte": source.bits_per_byte(t.history[-1]["test_loss"]),
            "unigram_bits_per_byte": source.unigram_bits_per_byte(kind=t.cfg.text_split)}


def _noise(t: Trainer) -> Dict[str, Any]:
    """The gradient noise scale (--measure-noise): its last moving-average estimate, in
    examples (and, for text, in tokens), and the measurements along the run."""
    if t.noise is None:
        return {}
    b = t.noise.b_simple
    per_example = t.cfg.context if t.cfg.dataset in data.TEXTS else 1
    return {"noise_scale": {"b_simple": b, "b_simple_tokens": b * per_example,
                            "every": t.cfg.noise_every(), "beta": t.noise.beta,
                            "history": t.noise_history}}


def _torchrun_restarts() -> Dict[str, int]:
    """How often torchrun restarted the workers of this run (under torchrun, where it did)."""
    n = world.torchrun_restart()
    return {"torchrun_restarts": n} if n else {}
