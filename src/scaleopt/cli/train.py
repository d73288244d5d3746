"""``scaleopt train``: one training run, in this process, in N processes it starts, or as one
rank of a ``torchrun`` launch; its options, and the configuration they make (with ``--model
gpt``'s defaults, or a checkpoint's with ``--resume``)."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Any, Dict, Optional

from ..dgc import PAPER_SPARSITY
from . import checkpoint, config, launch, optimizers, options, report, resume, trainer, world
from .config import Config
from .options import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train the built-in model (the default run takes seconds)",
                       description="Train a 2-hidden-layer MLP on generated spiral data and "
                                   "report the test accuracy; writes result.json, history.csv "
                                   "and curves.png.")
    d = Config()
    config.add_model_options(p, config.GPT_DEFAULTS)
    g = p.add_argument_group("training")
    options.add_optimizer(g, optimizers.OPTIMIZERS, "; ".join(
        f"{k}: {c.help} (default lr {c.lr:g})" for k, c in optimizers.OPTIMIZERS.items())
        + f" (default: {d.optimizer})")
    g.add_argument("--lr", type=float, help="peak learning rate (default: the optimizer's, above)")
    g.add_argument("--batch-size", type=options.positive_int,
                   help=f"global batch size, split over --workers (default: {d.batch_size}; "
                        f"gpt: {config.GPT_DEFAULTS['batch_size']} sequences)")
    g.add_argument("--steps", type=options.positive_int,
                   help="train this many steps instead of --epochs")
    config.add_schedule_options(g, d.epochs)
    g.add_argument("--dev-split", action="store_true", default=None,
                   help="evaluate along the run on a test split and at the end on a "
                        "development split held apart from it (text: the validation bytes cut "
                        "in two at a topic boundary; the generated data: another draw), as "
                        "the large-batch study does to select on one and report the other")
    g = config.add_system_options(p)
    config.add_state_dtype(g)
    options.add_offload(g, "optimizer state and update on the host: OffloadAdam for adamw, "
                           "scaleopt.offload() for lamb and lans")
    options.add_workers(g, "train in N processes on torch.distributed (gloo on the CPU, NCCL "
                           "on GPUs), started by this command on 127.0.0.1; under torchrun "
                           "the launch decides")
    options.add_replicas(g, "with --shard: HSDP, the workers split into R replicas that each "
                            "shard the model over workers/R processes and all-reduce the "
                            "gradients between them, or with --dgc exchange DGC's top-k "
                            "instead; under torchrun, one replica per node (--nnodes R) "
                            "(default: 1)")
    _add_checkpoint_options(p)
    _add_dgc_options(p)
    config.add_run_output(p)
    p.set_defaults(func=command)
    return p


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    g.add_argument("--checkpoint-every", type=options.positive_int, metavar="K",
                   help="write a checkpoint into the run folder every K steps; each rank "
                        "writes its own shards")
    g.add_argument("--stop-after", type=options.positive_int, metavar="STEP",
                   help="end after this step with a checkpoint (the LR schedule still spans "
                        "the whole run); continue with --resume")
    g.add_argument("--keep-checkpoints", type=options.positive_int, metavar="N",
                   help="keep the newest N checkpoints, removing older ones (default: 3)")
    g.add_argument("--max-restarts", type=options.non_negative_int, metavar="N",
                   help="with --workers N: when a worker dies (killed, out of memory), end the "
                        "others and start them again from the newest checkpoint that verifies, "
                        "at most N times in a run (default: 3); under torchrun, its own "
                        "--max-restarts restarts the workers, and a restarted run resumes from "
                        "--out's newest checkpoint by itself")
    options.add_resume(g, "RUN_DIR",
                       "continue the run in RUN_DIR from its newest checkpoint that verifies "
                       "(or from the checkpoint folder given), with its options; --workers, "
                       "--shard, --offload, --threads, --device may differ (resharding as "
                       "needed), the rest must be the same")


def _add_dgc_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deep gradient compression")
    g.add_argument("--dgc", action="store_true", default=None,
                   help="send only the largest accumulated gradients (exactly k per tensor, "
                        "one all-gather); the rest stays local: scaleopt.DGCMomentum with "
                        "--optimizer momentum, else top-k with error feedback feeding the "
                        "optimizer (the DGC hook at momentum 0 over DDP; with --shard "
                        "--replicas R, scaleopt.dgc.ReplicaCompression between the replicas)")
    g.add_argument("--dgc-sparsity", type=float, nargs="+", metavar="S",
                   help="sparsity warm-up list; the last value holds (default: the paper's "
                        "0.75 0.9375 0.984375 0.996 0.999)")
    g.add_argument("--dgc-rampup-begin-step", type=int,
                   help="dense momentum SGD before this step (default: 0)")
    g.add_argument("--dgc-rampup-steps", type=options.positive_int,
                   help="steps over which the sparsity list is walked, after "
                        "--dgc-rampup-begin-step (default: the first quarter of the run)")
    g.add_argument("--dgc-min-numel", type=int,
                   help="smaller tensors are sent dense (default: 16384, as Paddle)")
    g.add_argument("--powersgd", type=options.positive_int, metavar="RANK",
                   help="instead: DDP's all-reduce through torch's PowerSGD hook at this rank "
                        "(error feedback, warm start, from the second step; one bucket; "
                        "not checkpointed)")
    g.add_argument("--dgc-value-dtype", choices=("float32", "float16", "bfloat16", "int8"),
                   help="dtype of the gradient values sent (int8: each tensor's values "
                        "scaled by their largest magnitude, the scale sent too); their "
                        "rounding error stays in the local residual (default: float32)")


def _resumed(args: argparse.Namespace, given: set) -> Config:
    """The configuration of ``train --resume``: the checkpoint's, with the options given."""
    values = {k: v for k, v in vars(args).items() if k in given and k in config.FIELDS}
    if "no_progress" in given:
        values["progress"] = False
    merged = resume.resumed_config(args.resume, values, _effective)
    return Config(**{k: v for k, v in merged.items() if k in config.FIELDS})


def _effective(saved: dict) -> dict:
    """The values a run's options left at None took (compared with values given at resume)."""
    cfg = Config(**{k: v for k, v in saved.items() if k in config.FIELDS})
    return {"lr": cfg.resolved_lr(), "steps": cfg.total_steps(),
            "dgc_rampup_steps": cfg.dgc_rampup(), "dgc_sparsity": list(PAPER_SPARSITY)}


def command(args: argparse.Namespace) -> int:
    """``scaleopt train``: check, train, print the summary; the exit code."""
    given = options.given(args)
    restarted = _restarted_by_torchrun(args, given)
    cfg = _resumed(args, given) if args.resume else config.configured(args, given, config.GPT_DEFAULTS)
    config.check(cfg)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=config.default_out(cfg))
    if restarted is None and (not args.resume or "out" in given):  # a resumed run continues
        config.check_out(cfg.out, overwrite=bool(args.overwrite))  # in its own folder
    checkpoint.check_writable(cfg.out)
    hint = launch.busy_cores_hint(cfg.threads, cfg.workers)
    if hint:
        print(f"scaleopt train: note: {hint}", file=sys.stderr)
    r = train(cfg)
    if not r:  # another rank of a torchrun launch: rank 0 reports
        return EXIT_OK
    report.summary(cfg, r)
    failure = r.get("checkpoint_error") or r.get("write_error")
    if failure:
        print(f"scaleopt train: error: {failure}"
              + (f"; the run ended at step {r['steps']}, its results so far are written"
                 if not r.get("write_error") else ""), file=sys.stderr)
        return EXIT_FAILED
    if r["interrupted"]:
        print(f"interrupted at step {r['steps']} of {r['total_steps']}; the results so far are "
              f"written; " + report.how_to_continue(cfg.out))
        return EXIT_INTERRUPTED
    return EXIT_OK


def _restarted_by_torchrun(args: argparse.Namespace, given: set) -> Optional[int]:
    """Under a ``torchrun`` that has restarted its workers (``--max-restarts``): the restart's
    number, and ``args.resume`` set to the run folder ``--out`` where it holds a checkpoint, so
    that the run goes on from its newest checkpoint that verifies (where none was written yet,
    it starts again). None otherwise."""
    restart = world.torchrun_restart()
    if not restart or args.resume or not args.out:
        return None
    root = pathlib.Path(args.out) / checkpoint.CHECKPOINTS
    if any(p.name.startswith("step-") for p in (root.iterdir() if root.is_dir() else ())):
        args.resume = args.out
        given.add("resume")
        checkpoint._note(f"restart {restart} by torchrun: resuming the run in {args.out}")
    else:
        args.overwrite = True  # its own folder, with no checkpoint yet
        checkpoint._note(f"restart {restart} by torchrun: no checkpoint yet, starting again")
    return restart


def train(cfg: Config) -> Dict[str, Any]:
    """Run ``cfg``: in this process, in ``cfg.workers`` processes started here, or as one rank
    of a ``torchrun`` launch (``WORLD_SIZE`` set in the environment)."""
    config.check(cfg)
    if world.under_torchrun():
        return launch.torchrun_rank(cfg)
    if cfg.workers == 1:
        world.STOP.clear()
        with world.interruptible(world.STOP):
            return trainer.run(cfg)
    result = launch.workers(cfg)
    if cfg.out:
        report.write_run(result, cfg.out)
    return result
