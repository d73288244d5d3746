"""The ``scaleopt`` command: ``train``, ``study large-batch`` and ``bench``.

Exit codes: 0 success; 2 bad arguments or values (with a message naming the option);
3 the training diverged (the loss became inf or NaN); 130 interrupted by Ctrl-C (the run stops
after its current step and writes its results so far); 1 any other failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import sys
from typing import Any, List, Optional

from .. import __version__
from .. import info as scaleopt_info
from . import bench, checkpoint, data, launch, optimizers, report, study, train
from .train import Config, Diverged, WorkersLost

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DIVERGED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1)


def _non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


def _plain(doc: str) -> str:
    """A docstring as help text: without reStructuredText's double backticks."""
    return doc.replace("``", "")


def _add_model_options(p: argparse.ArgumentParser, d: Config, gpt: dict) -> None:
    """The data and the model; ``gpt``: the defaults of ``--model gpt`` that differ."""
    g = p.add_argument_group("data and model")
    g.add_argument("--dataset", default=d.dataset, choices=sorted(data.DATASETS),
                   help="; ".join(f"{k}: {v}" for k, v in data.DATASETS.items())
                   + f" (default: {d.dataset}; text with --model gpt)")
    g.add_argument("--model", default=d.model, choices=sorted(data.MODELS),
                   help="; ".join(f"{k}: {v}" for k, v in data.MODELS.items())
                   + " (default: the dataset's; gpt with --dataset text)")
    g.add_argument("--train-size", type=_positive_int, default=d.train_size,
                   help=f"training examples, generated (default: {d.train_size}; the test set has "
                        f"16384); text: windows of --context bytes at random offsets of the "
                        f"training split, the same on every run (default: {gpt['train_size']})")
    g.add_argument("--width", type=_positive_int, default=d.width,
                   help=f"hidden width of the 2-hidden-layer MLP (default: {d.width}), or the "
                        f"gpt model's width, a multiple of 32 (default: {gpt['width']})")
    g.add_argument("--layers", type=_positive_int, default=gpt["layers"],
                   help=f"the gpt model's decoder blocks (default: {gpt['layers']})")
    g.add_argument("--context", type=_positive_int, default=gpt["context"],
                   help=f"the gpt model's sequence length in bytes (default: {gpt['context']})")
    g.add_argument("--measure-noise", action="store_true",
                   help="measure the gradient noise scale B_simple along the run (about 100 "
                        "times: the step's batch in two halves, from their gradients' norms)")
    g.add_argument("--evals", type=_positive_int, default=d.evals,
                   help=f"evaluations on the held-out data along the run (default: "
                        f"{d.evals}; gpt: {gpt['evals']})")
    g.add_argument("--eval-spacing", choices=train.EVAL_SPACINGS, default=d.eval_spacing,
                   help="evaluate every total/evals steps (even), or at total * 2^(-i/3) for "
                        "i = 0 ... evals - 1 (log: a third of an octave apart, for curves read "
                        f"early, as the study does) (default: {d.eval_spacing}"
                        + (f"; gpt: {gpt['eval_spacing']}" if "eval_spacing" in gpt else "")
                        + ")")


def _add_schedule_options(g: Any, d: Config, epochs: int) -> None:
    """What every run is trained with: epochs, decay, the LR schedule, the seed."""
    g.add_argument("--epochs", type=_positive_int, default=epochs,
                   help=f"passes over the training set (default: {epochs}; gpt: 1)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"decay of weight matrices; biases and norms get none (default: {d.weight_decay})")
    g.add_argument("--warmup", type=float, default=d.warmup,
                   help="linear warm-up: a fraction of the steps if below 1, else a number of "
                        f"steps (default: {d.warmup})")
    g.add_argument("--schedule", choices=optimizers.SCHEDULES, default=d.schedule,
                   help=f"learning-rate decay after warm-up (default: {d.schedule})")
    g.add_argument("--seed", type=int, default=d.seed, help=f"model and batch order seed (default: {d.seed})")
    g.add_argument("--max-grad-norm", type=float, metavar="NORM",
                   help="clip the gradients to this global norm before each step (the "
                        "optimizer's own max_grad_norm; for torch's, clip_grad_norm_) "
                        "(default: no clipping)")
    g.add_argument("--betas", type=float, nargs=2, metavar=("BETA1", "BETA2"),
                   help="Adam's betas, for the optimizers with Adam moments (Muon: its AdamW "
                        "part) (default: each optimizer's)")


def _add_system_options(p: argparse.ArgumentParser) -> Any:
    g = p.add_argument_group("system")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    g.add_argument("--threads", type=_positive_int, help="intra-op threads (default: torch's)")
    return g


def _add_output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", help="folder for the results (default: scaleopt-runs/<run>, a new "
                                 "folder for each run)")
    g.add_argument("--overwrite", action="store_true",
                   help="write into --out even if it holds an earlier run's results")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_train_options(p: argparse.ArgumentParser) -> None:
    """``train``'s options: one run, in one process or several."""
    d = Config()
    _add_model_options(p, d, train.GPT_DEFAULTS)
    g = p.add_argument_group("training")
    g.add_argument("--optimizer", default=d.optimizer, choices=list(optimizers.OPTIMIZERS),
                   type=str.lower, metavar="NAME",
                   help="; ".join(f"{k}: {c.help} (default lr {c.lr:g})"
                                  for k, c in optimizers.OPTIMIZERS.items())
                   + f" (default: {d.optimizer})")
    g.add_argument("--lr", type=float, help="peak learning rate (default: the optimizer's, above)")
    g.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help=f"global batch size, split over --workers (default: {d.batch_size}; "
                        f"gpt: {train.GPT_DEFAULTS['batch_size']} sequences)")
    g.add_argument("--steps", type=_positive_int, help="train this many steps instead of --epochs")
    _add_schedule_options(g, d, d.epochs)
    g.add_argument("--dev-split", action="store_true",
                   help="evaluate along the run on a test split and at the end on a "
                        "development split held apart from it (text: the validation bytes cut "
                        "in two at a topic boundary; the generated data: another draw), as "
                        "the large-batch study does to select on one and report the other")
    g = _add_system_options(p)
    _add_state_dtype(g, d)
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=False,
                   help="optimizer state and update on the host: OffloadAdam for adamw, "
                        "scaleopt.offload() for lamb and lans")
    g.add_argument("--workers", type=_positive_int, default=1,
                   help="train in N processes on torch.distributed (gloo on the CPU, NCCL "
                        "on GPUs), started by this command on 127.0.0.1; under torchrun "
                        "the launch decides (default: 1)")
    g.add_argument("--shard", action=argparse.BooleanOptionalAction, default=False,
                   help="FSDP2 (fully_shard) instead of DDP: each of the --workers holds "
                        "1/N of the parameters and of the optimizer state")
    g.add_argument("--replicas", type=_positive_int, default=1, metavar="R",
                   help="with --shard: HSDP, the workers split into R replicas that each shard "
                        "the model over workers/R processes and all-reduce the gradients "
                        "between them, or with --dgc exchange DGC's top-k instead; under "
                        "torchrun, one replica per node (--nnodes R) (default: 1)")
    _add_checkpoint_options(p)
    _add_dgc_options(p)
    _add_output_options(p)


def _add_state_dtype(g: Any, d: Config) -> None:
    g.add_argument("--state-dtype", choices=optimizers.STATE_DTYPES, default=d.state_dtype,
                   help="how lamb, lans, adamw and offload-adam store their moments: float32 "
                        "(8 bytes per parameter), bfloat16 (4) or int8 (about 2: 8-bit codes "
                        "with a scale per block of 256); the update computes in float32 "
                        f"(default: {d.state_dtype})")


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints (torch.distributed.checkpoint)")
    g.add_argument("--checkpoint-every", type=_positive_int, metavar="K",
                   help="write a checkpoint into the run folder every K steps; each rank "
                        "writes its own shards")
    g.add_argument("--stop-after", type=_positive_int, metavar="STEP",
                   help="end after this step with a checkpoint (the LR schedule still spans "
                        "the whole run); continue with --resume")
    g.add_argument("--keep-checkpoints", type=_positive_int, default=3, metavar="N",
                   help="keep the newest N checkpoints, removing older ones (default: 3)")
    g.add_argument("--max-restarts", type=_non_negative_int, default=3, metavar="N",
                   help="with --workers N: when a worker dies (killed, out of memory), end the "
                        "others and start them again from the newest checkpoint that verifies, "
                        "at most N times in a run (default: 3); under torchrun, its own "
                        "--max-restarts restarts the workers, and a restarted run resumes from "
                        "--out's newest checkpoint by itself")
    g.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest checkpoint that verifies "
                        "(or from the checkpoint folder given), with its options; --workers, "
                        "--shard, --offload, --threads, --device may differ (resharding as "
                        "needed), the rest must be the same")


def _add_dgc_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deep gradient compression (with --optimizer momentum)")
    g.add_argument("--dgc", action="store_true",
                   help="scaleopt.DGCMomentum: send only the largest accumulated gradients "
                        "(exactly k per tensor, one all-gather); the rest stays local")
    g.add_argument("--dgc-sparsity", type=float, nargs="+", metavar="S",
                   help="sparsity warm-up list; the last value holds (default: the paper's "
                        "0.75 0.9375 0.984375 0.996 0.999)")
    g.add_argument("--dgc-rampup-begin-step", type=int, default=0,
                   help="dense momentum SGD before this step (default: 0)")
    g.add_argument("--dgc-rampup-steps", type=_positive_int,
                   help="steps over which the sparsity list is walked, after "
                        "--dgc-rampup-begin-step (default: the first quarter of the run)")
    g.add_argument("--dgc-min-numel", type=int, default=16384,
                   help="smaller tensors are sent dense (default: 16384, as Paddle)")
    g.add_argument("--dgc-value-dtype", choices=("float32", "float16", "bfloat16"),
                   default="float32",
                   help="dtype of the gradient values sent; their rounding error stays in "
                        "the local residual (default: float32)")


def _add_study_options(s: argparse.ArgumentParser) -> None:
    """``study large-batch``'s options: the protocol, and what each run is trained with."""
    gpt = f"; gpt: {' '.join(map(str, study.GPT_BATCH_SIZES))}"
    g = s.add_argument_group("protocol")
    g.add_argument("--batch-sizes", type=_positive_int, nargs="+",
                   default=[64, 256, 1024, 4096, 8192], metavar="B",
                   help=f"batch sizes (default: 64 256 1024 4096 8192{gpt})")
    g.add_argument("--optimizers", nargs="+", default=["lamb", "lans", "adamw", "muon"],
                   metavar="NAME", type=str.lower,
                   help=f"optimizers to compare (default: lamb lans adamw muon; gpt: "
                        f"{' '.join(study.GPT_OPTIMIZERS)})")
    g.add_argument("--base-batch", type=_positive_int, default=1024,
                   help="the batch at which each optimizer's default rate is taken, scaled from "
                        "there by its rule to centre the smallest batch's grid (default: 1024; "
                        "gpt: 64)")
    g.add_argument("--grid", type=float, nargs="+", default=[0.5, 1.0, 2.0], metavar="F",
                   help="factors of each cell's centre rate tried at seed 0, log-spaced "
                        "(default: 0.5 1 2)")
    g.add_argument("--extensions", type=_non_negative_int, default=2, metavar="N",
                   help="points added one by one where the best rate lies on the grid's edge, "
                        "at most N per cell (default: 2)")
    g.add_argument("--seeds", type=_positive_int, default=3,
                   help="runs of each chosen rate, seeds 0 ... N-1 (default: 3)")
    g.add_argument("--targets", type=float, nargs="*", metavar="LOSS",
                   help="losses for the steps to a target, B_crit and B_simple (bits per byte "
                        f"for text) (default: none; gpt: {' '.join(map(str, study.GPT_TARGETS))})")
    g.add_argument("--jobs", type=_positive_int,
                   help="runs at once, each in a process of its own with cores/jobs threads "
                        "(default: the cores, one run per core; 1 with --workers)")
    g.add_argument("--quick", action="store_true",
                   help="the quick form: " + ", ".join(
                       f"{k.replace('_', ' ')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                       for k, v in study.QUICK.items()) + " (for the options not given): a "
                   "smoke test of the protocol, labelled as such, not evidence")
    d = Config()
    _add_model_options(s, d, study.GPT_STUDY)
    g = s.add_argument_group("training (every run)")
    _add_schedule_options(g, d, epochs=4)
    _add_state_dtype(g, d)
    g = _add_system_options(s)
    g.add_argument("--workers", type=_positive_int, default=1,
                   help="train each run in N processes (as scaleopt train --workers) (default: 1)")
    g.add_argument("--shard", action=argparse.BooleanOptionalAction, default=False,
                   help="FSDP2 over the --workers (as scaleopt train --shard)")
    _add_output_options(s)


def _config(args: argparse.Namespace, given: set, gpt: dict, **over):
    """The run's configuration from the options; a model or a dataset given alone brings the
    other, and the gpt model takes ``gpt``'s values for the options not given."""
    fields = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    values["progress"] = not args.no_progress
    if "model" in given and "dataset" not in given:
        values["dataset"] = "text" if args.model == "gpt" else values["dataset"]
    elif "model" not in given:
        values["model"] = data.model_of(values["dataset"])
    if values["model"] == "gpt":
        values.update({k: v for k, v in gpt.items() if k not in given and k in fields})
    values.update(over)
    return Config(**values)


def _given(parser: argparse.ArgumentParser, argv: List[str]) -> set:
    """The destinations of the options written on the command line ``argv`` (not defaults)."""
    actions = [a for a in parser._actions if a.option_strings]
    saved = [a.default for a in actions]
    try:
        for a in actions:
            a.default = argparse.SUPPRESS
        given, _ = parser.parse_known_args(argv)
    finally:
        for a, d in zip(actions, saved):
            a.default = d
    return set(vars(given))


def _resumed(args: argparse.Namespace, given: set):
    """The configuration of ``train --resume``: the checkpoint's, with the options given."""
    fields = {f.name for f in dataclasses.fields(Config)}
    values = {k: v for k, v in vars(args).items() if k in given and k in fields}
    if "no_progress" in given:
        values["progress"] = False
    merged = checkpoint.resumed_config(args.resume, values, _effective)
    return Config(**{k: v for k, v in merged.items() if k in fields})


def _effective(saved: dict) -> dict:
    """The values a run's options left at None took (compared with values given at resume)."""
    fields = {f.name for f in dataclasses.fields(Config)}
    cfg = Config(**{k: v for k, v in saved.items() if k in fields})
    return {"lr": cfg.resolved_lr(), "steps": cfg.total_steps(),
            "dgc_rampup_steps": cfg.dgc_rampup(), "dgc_sparsity": list(train.PAPER_SPARSITY)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="scaleopt",
        description="Train, compare and benchmark the scaleopt optimizers on built-in data "
                    "(generated, nothing is downloaded).",
        epilog="Exit codes: 0 success, 2 bad arguments, 3 training diverged, 130 interrupted "
               "(Ctrl-C: the results so far are written), 1 other failure.")
    ap.add_argument("--version", action="version", version=f"scaleopt {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    ap.commands = sub.choices  # name -> parser

    p = sub.add_parser("train", help="train the built-in model (the default run takes seconds)",
                       description="Train a 2-hidden-layer MLP on generated spiral data and "
                                   "report the test accuracy; writes result.json, history.csv "
                                   "and curves.png.")
    _add_train_options(p)

    p = sub.add_parser("study", help="studies: large-batch",
                       description="Run a study and write a table and a plot.")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    studies.required = True
    p.studies = studies.choices  # name -> parser
    s = studies.add_parser(
        "large-batch", help="the optimizers against batch size, each tuned at each batch, with seeds",
        description=_plain(study.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_study_options(s)

    p = sub.add_parser("bench", help="optimizer step time as ratios to torch's fused AdamW",
                       description=_plain(bench.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(p)

    p = sub.add_parser("info", help="what runs here: versions, C kernels, Triton, CUDA, threads",
                       description="Versions, whether the C kernels are built and used, "
                                   "Triton and the CUDA devices, threads, and which "
                                   "implementation each param group of an optimizer takes on "
                                   "the built-in model.")
    p.add_argument("--optimizer", default="lamb", choices=list(optimizers.OPTIMIZERS),
                   type=str.lower, metavar="NAME", help="the optimizer whose groups are shown "
                   f"({', '.join(optimizers.OPTIMIZERS)}; default: lamb)")
    p.add_argument("--offload", action="store_true", help="its offloaded form")
    p.add_argument("--device", default="cpu", help="where the model lives (cpu or cuda)")
    return ap


def _info(args: argparse.Namespace) -> int:
    """``scaleopt info``: what runs here, and the groups of ``--optimizer`` on the built-in
    model."""
    cfg = Config(optimizer=args.optimizer, offload=args.offload, device=args.device)
    train.check(cfg)
    model = data.make_model(2, 5, cfg.width).to(cfg.device)
    r = scaleopt_info(optimizers.build(model, cfg))
    kernels = r["c_kernels"]
    cuda = ", ".join(f"{i}: {n}" for i, n in enumerate(r["cuda_devices"])) or "none"
    print(f"scaleopt {r['scaleopt']}, torch {r['torch']}, Python {r['python']}, "
          f"Triton {r['triton'] or 'not installed'}")
    print("C kernels: " + ("built and used" if kernels["used"] else kernels["why_not"]))
    print("Triton kernels: " + ("run on the CUDA devices" if r["triton_kernels_on_cuda"] else
                                "not here (no CUDA device)" if r["triton"] else
                                "not installed (pip install scaleopt[gpu])"))
    print(f"CUDA devices: {cuda}")
    print(f"threads: {r['threads']} (torch's intra-op), {r['cores']} "
          f"core{'s' if r['cores'] != 1 else ''} for this process")
    print(f"{args.optimizer}{' (offloaded)' if args.offload else ''} on the built-in model "
          f"({cfg.device}): " + "; ".join(f"group {i}: {impl}"
                                          for i, impl in enumerate(r["groups"])))
    return EXIT_OK


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)  # exits with 2 on a usage error
    try:
        if args.command == "train":
            given = _given(parser.commands["train"], argv[argv.index("train") + 1:])
            return _train(args, given)
        if args.command == "study":
            argv_study = argv[argv.index(args.study) + 1:]
            return _study(args, _given(parser.commands["study"].studies[args.study], argv_study))
        if args.command == "info":
            return _info(args)
        bench.check_arguments(args)
        bench.run(args)
        return EXIT_OK
    except ValueError as exc:
        print(f"scaleopt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Diverged as exc:
        print(f"scaleopt {args.command}: training diverged: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except WorkersLost as exc:
        print(f"scaleopt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # a second Ctrl-C
        print(f"scaleopt {args.command}: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _train(args: argparse.Namespace, given: set) -> int:
    restarted = _restarted_by_torchrun(args)
    cfg = _resumed(args, given) if args.resume else _config(args, given, train.GPT_DEFAULTS)
    train.check(cfg)
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=train.default_out(cfg))
    if restarted is None and (not args.resume or "out" in given):  # a resumed run continues
        train.check_out(cfg.out, overwrite=args.overwrite)  # in its own folder
    checkpoint.check_writable(cfg.out)
    hint = launch.busy_cores_hint(cfg.threads, cfg.workers)
    if hint:
        print(f"scaleopt train: note: {hint}", file=sys.stderr)
    r = train.train(cfg)
    if not r:  # another rank of a torchrun launch: rank 0 reports
        return EXIT_OK
    _summary(cfg, r)
    failure = r.get("checkpoint_error") or r.get("write_error")
    if failure:
        print(f"scaleopt train: error: {failure}"
              + (f"; the run ended at step {r['steps']}, its results so far are written"
                 if not r.get("write_error") else ""), file=sys.stderr)
        return EXIT_FAILED
    if r["interrupted"]:
        print(f"interrupted at step {r['steps']} of {r['total_steps']}; the results so far are "
              f"written; " + _how_to_continue(cfg.out))
        return EXIT_INTERRUPTED
    return EXIT_OK


def _restarted_by_torchrun(args: argparse.Namespace) -> Optional[int]:
    """Under a ``torchrun`` that has restarted its workers (``--max-restarts``): the restart's
    number, and ``args.resume`` set to the run folder ``--out`` where it holds a checkpoint, so
    that the run goes on from its newest checkpoint that verifies (where none was written yet,
    it starts again). None otherwise."""
    restart = launch.torchrun_restart()
    if not restart or args.resume or not args.out:
        return None
    root = pathlib.Path(args.out) / checkpoint.CHECKPOINTS
    if any(p.name.startswith("step-") for p in (root.iterdir() if root.is_dir() else ())):
        args.resume = args.out
        checkpoint._note(f"restart {restart} by torchrun: resuming the run in {args.out}")
    else:
        args.overwrite = True  # its own folder, with no checkpoint yet
        checkpoint._note(f"restart {restart} by torchrun: no checkpoint yet, starting again")
    return restart


def _how_to_continue(out: str) -> str:
    if (pathlib.Path(out) / checkpoint.CHECKPOINTS / checkpoint.LATEST).is_file():
        return f"continue with --resume {out}"
    return "no checkpoint was written, so it cannot be resumed (pass --checkpoint-every K)"


def _summary(cfg: Config, r: dict) -> None:
    """The lines a finished (or stopped) run prints."""
    how = report.describe(r["config"], r["workers"])
    score = (f"validation {r['test_bits_per_byte']:.3f} bits per byte (the unigram baseline's "
             f"{r['unigram_bits_per_byte']:.3f}: {r['test_bits_per_byte'] / r['unigram_bits_per_byte']:.0%}), "
             f"next-byte accuracy {r['test_accuracy']:.4f}," if "test_bits_per_byte" in r else
             f"test accuracy {r['test_accuracy']:.4f}, test loss {r['test_loss']:.4f}")
    print(f"{cfg.optimizer}{f' ({how})' if how else ''} on {cfg.dataset}: {score} after "
          f"{r['steps']} steps ({r['epochs']:.1f} epochs) of batch {cfg.batch_size}, lr {r['lr']:g}"
          + (f"; resumed at step {r['resumed_at']}" if r["resumed_at"] is not None else "")
          + ("" if r["complete"] else f"; stopped before step {r['total_steps']}: "
             + _how_to_continue(cfg.out)))
    rate = (f"{r['samples_per_s'] * cfg.context:,.0f} tokens/s" if "tokens" in r
            else f"{r['samples_per_s']:,.0f} samples/s")
    line = (f"{r['time_s']:.1f} s, {r['steps_per_s']:.1f} steps/s, {rate}, "
            f"{r['parameters']:,} parameters, {r['threads']} thread{'s' if r['threads'] != 1 else ''}")
    if "dgc_density" in r:
        dense, sent = r["dense_bytes_sent_per_rank_per_step"], r["dgc_bytes_sent_per_rank_per_step"]
        grad, msg = (r["dense_payload_bytes_per_rank_per_step"],
                     r["dgc_payload_bytes_per_rank_per_step"])
        last = r["dgc_final_telemetry"]
        sent = r.get("dgc_bytes_sent_measured_per_rank_per_step", sent)
        line += (f"; DGC between {r.get('dgc_between', str(r['workers']) + ' workers')}: "
                 f"density {r['dgc_density']:.4f}, {sent:,.0f} bytes sent per rank per step "
                 f"(counted from the buffers sent) vs {dense:,.0f} for a dense all-reduce "
                 f"of the same tensors "
                 f"({dense / max(sent, 1):.0f}x fewer); payload {msg:,.0f} bytes per rank per "
                 f"step vs a {grad:,.0f}-byte gradient ({grad / max(msg, 1):.0f}x smaller); "
                 f"last step: {last['dense_bytes'] / max(last['bytes_sent'], 1):.0f}x fewer "
                 f"bytes sent, payload {last['dense_payload_bytes'] / max(last['payload_bytes'], 1):.0f}x "
                 f"smaller")
    elif "replica_allreduce_bytes_per_step" in r:
        line += (f"; {r['config']['replicas']} replicas: {r['replica_allreduce_bytes_per_step']:,} "
                 f"bytes of gradient shards all-reduced between them per step (about "
                 f"{r['replica_bytes_sent_per_rank_per_step']:,} sent per rank)")
    elif "allreduce_bytes_per_step" in r:
        line += (f"; {r['workers']} workers, {r['allreduce_bytes_per_step']:,} gradient bytes "
                 f"all-reduced per step (about {r['bytes_sent_per_rank_per_step']:,} sent per rank)")
    print(line)
    per_param = r["unsharded_optimizer_state_bytes"] / max(r["parameters"], 1)
    print(f"per rank: {r['param_bytes_per_rank']:,} bytes of parameters and "
          f"{r['optimizer_state_bytes_per_rank']:,} of optimizer state "
          f"({per_param:.2f} bytes per parameter, state_dtype {cfg.state_dtype})"
          + (f" ({r['workers']} shards; unsharded: {r['unsharded_param_bytes']:,} and "
             f"{r['unsharded_optimizer_state_bytes']:,})" if r["sharded"] else ""))
    if "noise_scale" in r:
        n = r["noise_scale"]
        print(f"gradient noise scale B_simple {n['b_simple']:.3g} examples"
              + (f" ({n['b_simple_tokens']:,.0f} tokens)" if "tokens" in r else "")
              + f" at the end (moving average of {len(n['history'])} measurements, one every "
                f"{n['every']} steps): batches well below it use their examples efficiently")
    for i, restart in enumerate(r.get("restarts", []), 1):
        print(f"restart {i}: {restart['cause']} at step {restart['at_step']}; resumed from "
              f"step {restart['from_step']}, {restart['redone_steps']} steps done again")
    if r["checkpoints"]:
        print(f"checkpoints: {len(r['checkpoints'])}, the last {r['checkpoints'][-1]}")
    if not r.get("write_error"):
        print(report.results_line(cfg.out, ["result.json", "history.csv"], "curves.png"))


#: what every run of a study is trained with unless given (both models)
STUDY_RUNS = dict(max_grad_norm=1.0, betas=list(study.STUDY_BETAS))


def _study_protocol(args: argparse.Namespace, given: set) -> study.Protocol:
    """The study's protocol from its options (the gpt model's and the quick form's defaults
    for the options not given)."""
    gpt = dict(study.GPT_STUDY, batch_sizes=study.GPT_BATCH_SIZES, optimizers=study.GPT_OPTIMIZERS,
               base_batch=train.GPT_DEFAULTS["batch_size"], targets=study.GPT_TARGETS)
    for key, value in STUDY_RUNS.items():
        if key not in given:
            setattr(args, key, value)
    if args.quick:
        gpt.update(study.QUICK)
        for key, value in study.QUICK.items():
            if key not in given:
                setattr(args, key, value)
    base = _config(args, given, gpt)
    if base.model == "gpt":
        for key in ("batch_sizes", "optimizers", "base_batch", "targets"):
            if key not in given and not (args.quick and key in study.QUICK):
                setattr(args, key, gpt[key])
    unknown = [n for n in args.optimizers if n not in optimizers.OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(optimizers.OPTIMIZERS)}")
    if not all(f > 0 and math.isfinite(f) for f in args.grid):
        raise ValueError(f"--grid factors must be positive, got {args.grid}")
    jobs = args.jobs or (1 if args.workers > 1 else os.cpu_count() or 1)
    if jobs > 1 and args.workers > 1:
        raise ValueError("--jobs runs several one-process runs at once: use it without --workers")
    p = study.Protocol(sorted(args.batch_sizes), args.optimizers, base, args.base_batch,
                       sorted(args.grid), args.extensions, args.seeds, args.targets or [], jobs,
                       args.quick)
    for name in p.names:
        for b in p.batch_sizes:
            train.check(p.config(name, b, p.default_lr(name), 0))
    return p


def _study(args: argparse.Namespace, given: set) -> int:
    p = _study_protocol(args, given)
    out = args.out or train.new_folder(pathlib.Path("scaleopt-runs") / "study-large-batch")
    train.check_out(out, overwrite=args.overwrite)
    rows = study.large_batch(p, out=out)
    print(open(f"{out}/study.md").read())
    print(report.results_line(out, ["study.json", "study.csv", "study.md"], "study.png"))
    if launch.STOP.is_set():
        print(f"interrupted after {len(rows)} run{'s' if len(rows) != 1 else ''}; the finished ones "
              f"are written")
        return EXIT_INTERRUPTED
    return EXIT_OK if rows else EXIT_FAILED


def console() -> None:
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the output's reader left (``scaleopt train | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    sys.exit(code)
