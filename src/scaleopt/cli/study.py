"""``scaleopt study large-batch``: which optimizer trains best at each batch size, each tuned
at that batch size.

Every run trains on the same examples for the same number of epochs (a batch 4x larger takes 4x
fewer steps), with the same gradient clipping, weight decay, warm-up over the first share of the
examples and cosine decay; the Adam-family optimizers (LAMB, LANS, AdamW, Muon's AdamW part)
with the same betas. Each optimizer's peak learning rate is tuned at every batch size: a grid of
rates (factors of a centre rate, log-spaced) around its rate at the next smaller batch scaled by
its usual rule (square root for the adaptive optimizers, linear for SGD; the smallest batch
starts from the optimizer's default rate), extended by a point wherever the best lies on the
grid's edge. The rate with the lowest loss on a development split wins; it is then run with
more seeds, and the scores reported are those of a test split held apart from the development
split: the mean and spread over seeds, and between optimizers the differences paired by seed,
called a win only where they exceed their 95% interval. From the curves: the steps (and tokens)
to target losses at each batch size, McCandlish et al.'s fit S = S_min (1 + B_crit / B), and
the gradient noise scale B_simple measured at the same losses.

On the transformer (``--model gpt``: bytes of real text) the score is the loss in bits per byte.
``--quick`` is a smoke form (two optimizers, two batch sizes, one seed): not evidence.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import signal
import sys
import time
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

from . import (analysis, config, noise_scale, optimizers, options, report, study_journal,
               study_report, study_runs, world)
from .config import Config

#: ``--model gpt``'s study: 8,192 windows of 64 bytes (0.5M tokens, one epoch) for each run,
#: on a 3-block model; batch sizes over a 64x range
GPT_STUDY = dict(train_size=8192, epochs=1, width=128, layers=3, context=64, evals=16,
                 eval_spacing="log", measure_noise=True)
GPT_BATCH_SIZES = [4, 16, 64, 256]
GPT_OPTIMIZERS = ["lamb", "lans", "adamw", "muon", "momentum"]
#: the Adam-family optimizers' betas in the study (GPT-3's; every one the same)
STUDY_BETAS = (0.9, 0.95)
#: loss targets for the steps to a target, in bits per byte (gpt)
GPT_TARGETS = [3.6, 3.2]
#: the quick form: what it leaves out of the full protocol
QUICK = dict(optimizers=["lamb", "adamw"], batch_sizes=[8, 64], seeds=1, train_size=4096,
             layers=2)


def scaled_lr(lr: float, batch: int, from_batch: int, rule: str) -> float:
    """``lr`` at ``from_batch`` scaled to ``batch`` by ``rule`` ("sqrt" or "linear")."""
    ratio = batch / from_batch
    return lr * (ratio ** 0.5 if rule == "sqrt" else ratio)


@dataclasses.dataclass
class Protocol:
    """What a study runs. ``base``: every run's configuration but its optimizer, batch size,
    rate and seed; ``base_batch``: the batch at which each optimizer's default rate is taken;
    ``grid``: factors of a cell's centre rate (log-spaced); ``extensions``: points that may be
    added at an edge of a cell's grid; ``seeds``: runs of each chosen rate; ``targets``: losses
    (bits per byte for text) for the steps to a target; ``jobs``: runs at once."""

    batch_sizes: Sequence[int]
    names: Sequence[str]
    base: Config
    base_batch: int
    grid: Sequence[float] = (0.5, 1.0, 2.0)
    extensions: int = 2
    seeds: int = 3
    targets: Sequence[float] = ()
    jobs: int = 1
    quick: bool = False
    #: warm-up lengths (shares of the examples) crossed with the rate grid at the
    #: ``warmup_batches`` largest batch sizes, where the warm-up can bind; none: the base's
    warmups: Sequence[float] = ()
    warmup_batches: int = 2
    #: the Adam family's beta2s crossed with the rate grid (and the warm-ups) at the
    #: ``beta2_batches`` largest batch sizes; none: the base's betas alone
    beta2s: Sequence[float] = ()
    beta2_batches: int = 1
    #: rows already recorded (a resumed study), by :func:`.study_journal.run_key`: their runs
    #: are not run again
    known: Dict[Tuple[Any, ...], Dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: where each finished run's row is appended as it finishes (``runs.jsonl``), or None
    journal: Optional[str] = None
    #: run nothing: every run must be among :attr:`known` (:func:`replayed`)
    recorded_only: bool = False
    #: the clock's reading when the study's wall time, earlier sittings' included, was zero
    started: float = 0.0

    def default_lr(self, name: str) -> float:
        """``name``'s default rate, at ``base_batch``."""
        return dataclasses.replace(self.base, optimizer=name, lr=None).resolved_lr()

    def config(self, name: str, batch: int, lr: float, seed: int,
               warmup: Optional[float] = None, beta2: Optional[float] = None) -> Config:
        """One run's configuration (betas only for the optimizers that have them, the base's
        unless ``beta2`` is given; the base's warm-up unless ``warmup`` is given)."""
        betas = self.base.betas if optimizers.OPTIMIZERS[name].betas else None
        if betas and beta2 is not None:
            betas = (betas[0], beta2)
        return dataclasses.replace(self.base, optimizer=name, batch_size=batch, lr=lr, seed=seed,
                                   betas=betas, out=None, progress=False, dev_split=True,
                                   warmup=self.base.warmup if warmup is None else warmup)

    def warmups_at(self, batch: int) -> List[float]:
        """The warm-ups tried at ``batch``: :attr:`warmups` at the largest
        :attr:`warmup_batches` batch sizes, else the base's alone."""
        tuned = sorted(self.batch_sizes)[-self.warmup_batches:] if self.warmup_batches else []
        return list(self.warmups) if self.warmups and batch in tuned else [self.base.warmup]

    def settings_at(self, name: str, batch: int) -> List[Tuple[float, Optional[float]]]:
        """The (warm-up, beta2) pairs crossed with the rate grid at ``batch``: the warm-ups of
        :meth:`warmups_at`, and for an optimizer with betas :attr:`beta2s` at the largest
        :attr:`beta2_batches` batch sizes (else the base's beta2, or None)."""
        tuned = sorted(self.batch_sizes)[-self.beta2_batches:] if self.beta2_batches else []
        has = optimizers.OPTIMIZERS[name].betas and self.base.betas
        beta2s = (list(self.beta2s) if self.beta2s and has and batch in tuned
                  else [self.base.betas[1] if has else None])
        return [(w, b2) for b2 in beta2s for w in self.warmups_at(batch)]

    def step(self) -> float:
        """The ratio of neighbouring grid points (an extension's step)."""
        grid = sorted(self.grid)
        return grid[-1] / grid[-2] if len(grid) > 1 else 2.0

    def describe(self) -> Dict[str, Any]:
        """The protocol as the study's JSON records it."""
        return {"batch_sizes": list(self.batch_sizes), "optimizers": list(self.names),
                "base_batch": self.base_batch, "grid": list(self.grid),
                "extensions": self.extensions, "seeds": self.seeds,
                "targets": list(self.targets), "jobs": self.jobs, "quick": self.quick,
                "warmups": list(self.warmups), "warmup_batches": self.warmup_batches,
                **({"beta2s": list(self.beta2s), "beta2_batches": self.beta2_batches}
                   if self.beta2s else {}),
                "scaling": {n: optimizers.OPTIMIZERS[n].scaling for n in self.names},
                "default_lr": {n: self.default_lr(n) for n in self.names},
                "config": dataclasses.asdict(self.base)}


Wave = List[Config]
Chain = Generator[Wave, List[Dict[str, Any]], None]


def _chain(p: Protocol, name: str) -> Chain:
    """``name``'s runs, batch size by batch size: each yield is a wave of runs that can run at
    once, answered by their rows. A batch's seed runs go out with the next batch's grid."""
    centre, prev = p.default_lr(name), p.base_batch
    rule, seeds_out, batches = optimizers.OPTIMIZERS[name].scaling, [], sorted(p.batch_sizes)
    for b in batches:
        centre = scaled_lr(centre, b, prev, rule)
        grid = [p.config(name, b, centre * f, 0, w, b2) for w, b2 in p.settings_at(name, b)
                for f in p.grid]
        tried = yield seeds_out + grid
        tried = tried[len(seeds_out):]
        for _ in range(p.extensions):  # along the rate, at the best warm-up and beta2
            chosen = analysis.setting(min(tried, key=_dev_score))
            line = [r for r in tried if analysis.setting(r) == chosen]
            edge = _edge(line)
            if edge == 0:
                break
            rate = (max if edge > 0 else min)(r["lr"] for r in line) * p.step() ** edge
            tried = tried + (yield [p.config(name, b, rate, 0, *chosen)])
        best = min(tried, key=_dev_score)
        centre, prev = best["lr"], b
        seeds_out = [p.config(name, b, best["lr"], s, *analysis.setting(best))
                     for s in range(1, p.seeds)]
    if seeds_out:
        yield seeds_out


def _edge(tried: List[Dict[str, Any]]) -> int:
    """+1 if the best of ``tried`` (by the development loss) has the highest rate, -1 the
    lowest, 0 otherwise (inside, or every run diverged)."""
    best = min(tried, key=_dev_score)
    if not math.isfinite(_dev_score(best)):
        return 0
    rates = sorted(r["lr"] for r in tried)
    return 1 if best["lr"] == rates[-1] else -1 if best["lr"] == rates[0] else 0


def _dev_score(row: Dict[str, Any]) -> float:
    loss = row.get("dev_loss", math.nan)
    return loss if math.isfinite(loss) else math.inf


def large_batch(p: Protocol, out: Optional[str] = None,
                before_s: float = 0.0) -> List[Dict[str, Any]]:
    """Every run's row, in a fixed order; the study written into ``out`` if given (also when
    interrupted: the runs finished so far), each run journalled there as it finishes (see
    :func:`.study_journal.recorded`); ``before_s``: the wall time of earlier sittings."""
    start = p.started = time.perf_counter() - before_s
    world.STOP.clear()
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out) / "protocol.json").write_text(json.dumps(p.describe(), indent=1))
        p.journal = str(pathlib.Path(out) / "runs.jsonl")
    with world.interruptible(world.STOP):
        rows = (_run_inline if p.jobs == 1 else _run_pool)(p)
    rows.sort(key=lambda r: (list(p.names).index(r["optimizer"]), r["batch_size"], r["seed"],
                             r["lr"]))
    if out:
        study = {"title": study_report.title(p), "protocol": p.describe(), "rows": rows,
                 "complete": not world.STOP.is_set(),
                 "time_s": time.perf_counter() - start}
        study_report.write(study, out)
    return rows


def replayed(p: Protocol, rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The rows of the study ``p`` from runs already recorded (``rows``, e.g. a resumed
    study's journal): what ``p`` would have run and chosen, running nothing (``ValueError``
    where a run it needs is not among them)."""
    p = dataclasses.replace(p, known={study_journal.run_key(r): r for r in rows}, jobs=1,
                            journal=None, recorded_only=True)
    return large_batch(p)


def _run_inline(p: Protocol) -> List[Dict[str, Any]]:
    """The chains one after another, each run in this process."""
    rows: List[Dict[str, Any]] = []
    for name in p.names:
        chain, wave = _chain(p, name), None
        try:
            wave = next(chain)
            while True:
                done: List[Dict[str, Any]] = []
                for cfg in wave:
                    row = p.known.get(study_journal.run_key(cfg))
                    if row is None and p.recorded_only:
                        raise ValueError(f"not recorded: {study_runs.command_line(cfg)}")
                    if row is None:
                        row = None if world.STOP.is_set() else study_runs.cell(cfg)
                        if row is None:  # interrupted: the wave's finished runs are kept
                            return rows + done
                        study_journal.finished(p, row)
                    done.append(row)
                rows += done
                wave = chain.send(done)
        except StopIteration:
            pass
    return rows


def _pool_start(threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the study's: it stops the pool
    import torch

    torch.set_num_threads(threads)


def _run_pool(p: Protocol) -> List[Dict[str, Any]]:
    """Every chain at once, ``p.jobs`` runs at a time in processes of their own (one thread
    each unless ``--threads`` says otherwise)."""
    rows: List[Dict[str, Any]] = []
    threads = p.base.threads or max(1, (os.cpu_count() or 1) // p.jobs)
    pool = cf.ProcessPoolExecutor(p.jobs, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_pool_start, initargs=(threads,))
    waves: Dict[str, Tuple[Chain, List[Any]]] = {}
    running: Dict[cf.Future, Tuple[str, int]] = {}

    def submit(name: str, chain: Chain, wave: Wave) -> None:
        while True:  # the waves whose every run is recorded go by at once
            results: List[Any] = [p.known.get(study_journal.run_key(cfg)) for cfg in wave]
            rows.extend(r for r in results if r is not None)
            if any(r is None for r in results):
                break
            try:
                wave = chain.send(results)
            except StopIteration:
                return
        waves[name] = (chain, results)
        for i, cfg in enumerate(wave):
            if results[i] is None:
                running[pool.submit(study_runs.cell, dataclasses.replace(cfg, threads=threads))] = (
                    name, i)

    try:
        for name in p.names:
            chain = _chain(p, name)
            submit(name, chain, next(chain))
        while running and not world.STOP.is_set():
            done, _ = cf.wait(list(running), timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for future in done:
                name, i = running.pop(future)
                chain, results = waves[name]
                results[i] = future.result()
                if results[i] is not None:
                    study_journal.finished(p, results[i])
                rows.append(results[i])
                if all(r is not None for r in results):
                    try:
                        submit(name, chain, chain.send(results))
                    except StopIteration:
                        pass
    finally:
        for process in list(getattr(pool, "_processes", {}).values()):
            if world.STOP.is_set():
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)
    return rows


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------


#: the protocol's options' defaults, and what every run of a study is trained with unless given
#: (both models)
DEFAULTS = dict(batch_sizes=[64, 256, 1024, 4096, 8192], optimizers=["lamb", "lans", "adamw", "muon"],
                base_batch=1024, grid=[0.5, 1.0, 2.0], extensions=2, seeds=3, epochs=4,
                max_grad_norm=1.0, betas=list(STUDY_BETAS))


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("study", help="studies: large-batch, noise-scale",
                       description="Run a study and write a table and a plot.")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    studies.required = True
    s = studies.add_parser(
        "large-batch", help="the optimizers against batch size, each tuned at each batch, with seeds",
        description=options.plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_protocol_options(s)
    config.add_model_options(s, GPT_STUDY)
    g = s.add_argument_group("training (every run)")
    config.add_schedule_options(g, epochs=DEFAULTS["epochs"])
    config.add_state_dtype(g)
    g = config.add_system_options(s)
    options.add_workers(g, "train each run in N processes (as scaleopt train --workers)")
    config.add_run_output(s)
    options.add_resume(s.add_argument_group("resuming"), "DIR",
                       "continue the study in DIR (with the options it was started with; "
                       "--jobs and --threads may differ, though a run's thread count changes "
                       "the last digits of its losses, --targets too, and --warmups and "
                       "--beta2s may add settings to those tried): the runs it recorded are "
                       "not run again, a killed study loses only the runs that were in flight")
    s.set_defaults(func=command)
    noise_scale.add_parser(studies)
    return s


def _add_protocol_options(s: argparse.ArgumentParser) -> None:
    gpt = f"; gpt: {' '.join(map(str, GPT_BATCH_SIZES))}"
    g = s.add_argument_group("protocol")
    g.add_argument("--batch-sizes", type=options.positive_int, nargs="+", metavar="B",
                   help=f"batch sizes (default: 64 256 1024 4096 8192{gpt})")
    options.add_optimizers(g, f"optimizers to compare (default: lamb lans adamw muon; gpt: "
                              f"{' '.join(GPT_OPTIMIZERS)})")
    g.add_argument("--base-batch", type=options.positive_int,
                   help="the batch at which each optimizer's default rate is taken, scaled from "
                        "there by its rule to centre the smallest batch's grid (default: 1024; "
                        "gpt: 64)")
    g.add_argument("--grid", type=float, nargs="+", metavar="F",
                   help="factors of each cell's centre rate tried at seed 0, log-spaced "
                        "(default: 0.5 1 2)")
    g.add_argument("--extensions", type=options.non_negative_int, metavar="N",
                   help="points added one by one where the best rate lies on the grid's edge, "
                        "at most N per cell (default: 2)")
    options.add_tuned(g, "warmup", "SHARE", "warm-up lengths (shares of the examples)", "", 2,
                      "the --warmup")
    options.add_tuned(g, "beta2", "BETA2", "the Adam-family optimizers' beta2s",
                      " (and the warm-ups)", 1, "--betas")
    g.add_argument("--seeds", type=options.positive_int,
                   help="runs of each chosen rate, seeds 0 ... N-1 (default: 3)")
    g.add_argument("--targets", type=float, nargs="*", metavar="LOSS",
                   help="losses for the steps to a target, B_crit and B_simple (bits per byte "
                        f"for text) (default: none; gpt: {' '.join(map(str, GPT_TARGETS))})")
    g.add_argument("--jobs", type=options.positive_int,
                   help="runs at once, each in a process of its own with cores/jobs threads "
                        "(default: the cores, one run per core; 1 with --workers)")
    g.add_argument("--quick", action="store_true", default=None,
                   help="the quick form: " + ", ".join(
                       f"{k.replace('_', ' ')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                       for k, v in QUICK.items()) + " (for the options not given): a "
                   "smoke test of the protocol, labelled as such, not evidence")


def protocol_of(args: argparse.Namespace) -> Protocol:
    """The study's protocol from its options (the gpt model's and the quick form's defaults
    for the options not given)."""
    given = options.given(args)
    gpt = dict(GPT_STUDY, batch_sizes=GPT_BATCH_SIZES, optimizers=GPT_OPTIMIZERS,
               base_batch=config.GPT_DEFAULTS["batch_size"], targets=GPT_TARGETS)
    if args.quick:
        gpt.update(QUICK)
        options.fill(args, QUICK)
    options.fill(args, {k: v for k, v in DEFAULTS.items()
                        if k in ("epochs", "max_grad_norm", "betas")})
    base = config.configured(args, given, gpt, resume=None)  # --resume is the study's
    if base.model == "gpt":
        options.fill(args, {k: gpt[k] for k in ("batch_sizes", "optimizers", "base_batch", "targets")})
    options.fill(args, DEFAULTS)
    unknown = [n for n in args.optimizers if n not in optimizers.OPTIMIZERS]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; choose from {', '.join(optimizers.OPTIMIZERS)}")
    if not all(f > 0 and math.isfinite(f) for f in args.grid):
        raise ValueError(f"--grid factors must be positive, got {args.grid}")
    jobs = args.jobs or (1 if base.workers > 1 else os.cpu_count() or 1)
    if jobs > 1 and base.workers > 1:
        raise ValueError("--jobs runs several one-process runs at once: use it without --workers")
    if not all(0 <= w < 1 for w in args.warmups or []):
        raise ValueError(f"--warmups are shares of the examples in [0, 1), got {args.warmups}")
    if not all(0 <= b2 < 1 for b2 in args.beta2s or []):
        raise ValueError(f"--beta2s must lie in [0, 1), got {args.beta2s}")
    p = Protocol(sorted(args.batch_sizes), args.optimizers, base, args.base_batch,
                 sorted(args.grid), args.extensions, args.seeds, args.targets or [], jobs,
                 bool(args.quick), warmups=sorted(args.warmups or []),
                 warmup_batches=2 if args.warmup_batches is None else args.warmup_batches,
                 beta2s=sorted(args.beta2s or []), beta2_batches=1 if args.beta2_batches is None else args.beta2_batches)
    for name in p.names:
        for b in p.batch_sizes:
            config.check(p.config(name, b, p.default_lr(name), 0))
    return p


def command(args: argparse.Namespace) -> int:
    p = protocol_of(args)
    before = 0.0
    if args.resume:
        out = args.resume
        before = study_journal.resumed(p, out)
        print(f"resuming {out}: {len(p.known)} runs recorded", file=sys.stderr)
    else:
        out = args.out or config.new_folder(pathlib.Path("scaleopt-runs") / "study-large-batch")
        config.check_out(out, overwrite=bool(args.overwrite))
    rows = large_batch(p, out=out, before_s=before)
    print(open(f"{out}/study.md").read())
    print(report.results_line(out, ["study.json", "study.csv", "study.md"], "study.png"))
    if world.STOP.is_set():
        print(f"interrupted after {len(rows)} run{'s' if len(rows) != 1 else ''}; the finished ones "
              f"are written")
        return options.EXIT_INTERRUPTED
    return options.EXIT_OK if rows else options.EXIT_FAILED
