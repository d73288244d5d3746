"""Choose the Triton kernels' launch table on a CUDA GPU: every candidate configuration timed
for each kernel and state form on the BERT-base set and the 1B set, in one call, against the
device-to-device copy measured in the same run; the fastest configuration of each kernel
written as a table the package reads (``scaleopt._triton_launch``).

    python tools/triton_sweep.py OUT_DIR [--budget 330] [--jobs 16] [--sets base,1b]
    python tools/triton_sweep.py OUT_DIR --compile-only   # fill Triton's cache, time nothing
    SCALEOPT_TRITON_LAUNCH=OUT_DIR/triton_launch.json python train.py   # launch by it
    cp OUT_DIR/triton_launch.json src/scaleopt/                         # make it the default

The candidates (:data:`CHUNKS`, :data:`BLOCKS`, :data:`WARPS`: a chunk of elements per
program, a tile of elements, the warps of a program; and the package's table's own launches,
e.g. the int8 kernels' single warps) are tried for all kernels at once: a
step of LAMB, one of LANS and one of AdamW (Triton, float32 weights and gradients) on each set
and state form, every launch timed by CUDA events and its time given to its kernel and its tensors'
form. First every candidate's kernels are compiled in ``--jobs`` processes on tiny tensors of
the same kinds (Triton's cache on disk is shared: the timing process then compiles nothing).
The choice (:func:`choose`): per state form, the chunk whose kernels' best times, each
relative to the package's table's on the same set, add up to the least (the kernels of a form
share its chunk table); per kernel, the tile and warps that are fastest at that chunk, summed
over the sets the same way. Writes ``triton_launch.json`` (the table) and ``sweep.json``
(every time, the copy's bandwidth, each kernel's bandwidth as a share of it with the old
table and the new) to OUT_DIR, and prints the comparison. Exits 3 where there is no CUDA
device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from scaleopt import _triton_launch as L

NO_CUDA = 3
#: elements per program, elements per tile, warps per program
CHUNKS = (2048, 4096, 8192, 16384)
BLOCKS = (512, 1024, 2048, 4096)
WARPS = (2, 4, 8)
#: Triton's pipeline stages: the kernels' tiles are unrolled (``tl.static_range``), with no
#: loop for Triton to pipeline, so the stages are not swept
STAGES = 3
#: the state forms and the ``state_dtype`` that gives each
STATE = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8"}
OPTIMIZERS = ("LAMB", "LANS", "AdamW")

Candidate = Tuple[int, int, int]  # (chunk, block, warps)


def candidates() -> List[Candidate]:
    """Every (chunk, block, warps) with the block no larger than the chunk; first the
    package's own (LAMB's float32 apply's, then any other kernel's of its table, e.g. the
    int8 kernels' single warps), then the cheapest to compile first
    (:func:`compile_cost`), so that a sweep stopped by its time has compiled and timed as
    many as it could."""
    every = [(c, b, w) for c, b, w in itertools.product(CHUNKS, BLOCKS, WARPS) if b <= c]
    table = L.load(str(L.DEFAULT))
    default = _as_candidate(table, "lamb_apply", "float32")
    own = sorted({_as_candidate(table, k, f) for k in L.KERNELS for f in L.FORMS} - {default},
                 key=compile_cost)
    first = [default] + own
    return first + sorted((c for c in every if c not in first), key=compile_cost)


def compile_cost(candidate: Candidate) -> Tuple[float, ...]:
    """What orders the candidates by the time their kernels take to compile: a program's
    code is its tiles unrolled (``chunk / block`` of them), each ``block / (32 warps)``
    elements a thread, so its size goes with ``chunk / warps``."""
    chunk, block, warps = candidate
    return chunk / warps, chunk, -block


def _as_candidate(table: L.Table, kernel: str, form: str) -> Candidate:
    launch = table.launch(kernel, form)
    return table.chunk(form), launch.block, launch.warps


def table_of(candidate: Candidate) -> L.Table:
    chunk, block, warps = candidate
    return L.uniform(chunk=chunk, block=block, warps=warps, stages=STAGES)


# -- the choice (no GPU: tested with given times) --------------------------------------------

def choose(times: Dict[Tuple[str, str, str, Candidate], float], default: L.Table) -> L.Table:
    """The launch table from ``times`` {(set, kernel, form, candidate): seconds} (the median
    of a kernel's time in a step), each relative to ``default``'s candidate on the same set.
    A kernel and form with no time keeps ``default``'s launch; a form with none its chunk."""
    chunks, launches = dict(default.chunks), dict(default.launches)
    sets = sorted({s for s, _, _, _ in times})
    for form in L.FORMS:
        def score(kernel: str, candidate: Candidate) -> float:
            base = _as_candidate(default, kernel, form)
            total = 0.0
            for s in sets:
                t, t0 = times.get((s, kernel, form, candidate)), times.get((s, kernel, form, base))
                if t is None or not t0:
                    return float("inf")
                total += t / t0
            return total

        timed = {(k, c) for _, k, f, c in times if f == form}
        kernels = sorted({k for k, _ in timed})
        if not kernels:
            continue

        def best_at(kernel: str, chunk: int) -> Tuple[float, Candidate]:
            """The least score at ``chunk`` and its candidate (ties: the default's)."""
            base = _as_candidate(default, kernel, form)
            at = [c for k, c in timed if k == kernel and c[0] == chunk]
            best = min(((score(kernel, c), c != base, c) for c in at),
                       default=(float("inf"), True, None))
            return best[0], best[2]

        form_chunks = sorted({c[0] for _, c in timed})
        totals = {chunk: sum(best_at(k, chunk)[0] for k in kernels) for chunk in form_chunks}
        chunk = min(form_chunks, key=lambda c: (totals[c], c != default.chunk(form)))
        if totals[chunk] == float("inf"):
            continue
        chunks[form] = chunk
        for kernel in L.KERNELS:
            s, c = best_at(kernel, chunk) if kernel in kernels else (float("inf"), None)
            if c is None or s == float("inf"):  # no time at this chunk: the default's tile
                old = default.launch(kernel, form)
                block = old.block if chunk % old.block == 0 else min(chunk, old.block)
                launches[(kernel, form)] = L.Launch(block, old.warps, old.stages)
            else:
                launches[(kernel, form)] = L.Launch(c[1], c[2], STAGES)
    return L.check(L.Table(chunks, launches))


def bandwidths(times, table: L.Table, sizes: Dict[str, Dict[Tuple[str, str], float]],
               copy: Dict[str, float]) -> Dict[str, Dict[str, Any]]:
    """Per set, per kernel and form, with ``table``'s candidate: the time, the bytes it must
    move over that time (``sizes``: bytes moved per set, kernel and form), and that as a share
    of the copy's bandwidth on the same set."""
    out: Dict[str, Dict[str, Any]] = {}
    for s in sorted({s for s, _, _, _ in times}):
        for kernel, form in sorted({(k, f) for t, k, f, _ in times if t == s}):
            t = times.get((s, kernel, form, _as_candidate(table, kernel, form)))
            moved = sizes.get(s, {}).get((kernel, form))
            if t and moved:
                out.setdefault(s, {})[f"{kernel} {form}"] = dict(
                    ms=1e3 * t, gb_s=moved / t / 1e9, of_copy=moved / t / copy[s])
    return out


# -- on the GPU ------------------------------------------------------------------------------

def _optimizer(name: str, named, form: str):
    import scaleopt

    cls = getattr(scaleopt, name)
    return cls(named, lr=1e-3, implementation="triton", state_dtype=STATE[form])


def _tiny_set():
    """A tensor in each kind the sets' launches take: one large enough for compact moments,
    one that keeps float32 moments (under ``_compact.MIN_NUMEL``); sizes multiples of 16
    (aligned) and int8 rows of whole blocks, as the sets'."""
    return [("w", (16, 256)), ("b", (256,))]


def _params(shapes, device: str = "cuda"):
    """The set's parameters with gradients, made on ``device`` (on the GPU: the 1B set's
    billion random numbers would take seconds on the host)."""
    import torch

    torch.manual_seed(0)
    named = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device) * 0.02)
        p.grad = torch.randn(shape, device=device) * 1e-3
        named.append((name, p))
    return named


def _compile(candidate: Candidate, device: str = "cuda") -> None:
    """Compile a candidate's kernels (in a process of :func:`warm`): a LAMB, a LANS and an
    AdamW step per state form on tiny tensors (on the CPU: the interpreter's runs, which
    compile nothing, in the suite)."""
    import torch

    from scaleopt import _triton

    _triton.LAUNCH = table_of(candidate)
    for form in L.FORMS:
        for name in OPTIMIZERS:
            _optimizer(name, _params(_tiny_set(), device), form).step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def warm(cands: List[Candidate], jobs: int, deadline: float = float("inf"),
         device: str = "cuda") -> List[Candidate]:
    """The candidates' kernels compiled into Triton's cache, in ``jobs`` processes, one
    candidate a task in their order, until ``deadline`` (``time.monotonic()``): those
    compiled, in their order (the rest left: timing them would compile them in the timing
    process, one kernel at a time; one that fails to compile is left and said)."""
    if device.startswith("cuda"):
        os.environ.pop("TRITON_INTERPRET", None)
    else:  # (the processes read it when they import Triton)
        os.environ["TRITON_INTERPRET"] = "1"
    done = set()
    pool = multiprocessing.get_context("spawn").Pool(jobs)
    try:
        results = pool.imap_unordered(_compile_one, [(c, device) for c in cands])
        for _ in cands:
            left = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            candidate, error = results.next(timeout=left)
            if error is None:
                done.add(candidate)
            else:  # (left out, and said: the others are timed)
                print(f"candidate {candidate} did not compile: {error}", flush=True)
    except multiprocessing.TimeoutError:
        pass
    finally:
        pool.terminate()
        pool.join()
    return [c for c in cands if c in done]


def _compile_one(job: Tuple[Candidate, str]) -> Tuple[Candidate, Any]:
    """(candidate, None) once its kernels are compiled, or (candidate, the error)."""
    candidate, device = job
    try:
        _compile(candidate, device)
    except Exception as exc:  # noqa: BLE001 (reported by the sweep, which goes on)
        return candidate, f"{type(exc).__name__}: {str(exc)[:300]}"
    return candidate, None


class _Clock:
    """Each launch of ``_triton._run`` between CUDA events (on the host clock where the
    tensors are not on a GPU: the interpreter's runs in the suite), by (kernel, form)."""

    def __init__(self, device: str = "cuda"):
        from scaleopt import _triton

        self.module, self.real, self.events = _triton, _triton._run, []
        self.cuda = device.startswith("cuda")

    def __enter__(self):
        import torch

        def run(name, programs, *args, **kwargs):
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                self.real(name, programs, *args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                self.real(name, programs, *args, **kwargs)
                end = time.perf_counter()
            self.events.append((name, kwargs.get("FORM"), start, end))

        self.module._run = run
        return self

    def __exit__(self, *exc):
        self.module._run = self.real

    def take(self) -> Dict[Tuple[str, str], float]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        out: Dict[Tuple[str, str], float] = {}
        forms = {v: k for k, v in _format_forms().items()}
        for name, form, start, end in self.events:
            if name != "totals":
                key = (name, forms[form])
                seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
                out[key] = out.get(key, 0.0) + seconds
        self.events.clear()
        return out


def _format_forms():
    from scaleopt import _format

    return _format.MOMENT_FORMS


def measure(sets: Dict[str, Any], cands: List[Candidate], rounds: int, deadline: float,
            device: str = "cuda"):
    """{(set, kernel, form, candidate): median seconds} for ``sets`` {name: [(name, shape)]},
    the bytes each kernel moves per set and form, the copy's bandwidth per set, and the
    candidates left untimed (out of time)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sass_budget
    from scaleopt import _triton
    from scaleopt.cli.bench_gpu import copy_bandwidth

    times, sizes, copy, skipped = {}, {}, {}, []
    kinds = dict(W_SPLIT=0, G_KIND=0, W16_KIND=0)
    for s, shapes in sets.items():
        numel = sum(torch.Size(x).numel() for _, x in shapes)
        copy[s] = copy_bandwidth(4 * numel, device)
        named = _params(shapes, device)
        for form in L.FORMS:
            for name in OPTIMIZERS:
                opt = _optimizer(name, named, form)
                opt.step()  # the state made
                # a compact form's step also runs its small tensors' float32 moments: only
                # the launches of the form stepped are its times (not the float32 form's)
                counts = {key: n for key, n in _numels(opt).items() if key[1] == form}
                for kernel, f in counts:
                    c = dict(kinds, FORM=_format_forms()[f])
                    sizes.setdefault(s, {})[(kernel, f)] = counts[(kernel, f)] * sum(
                        sass_budget.moved(kernel, c))
                for cand in cands:
                    if time.monotonic() > deadline:
                        skipped.append((s, form, name, cand))
                        continue
                    _triton.LAUNCH = table_of(cand)
                    opt.step()  # the plan and tables for this table
                    with _Clock(device) as clock:
                        per_round = []
                        for _ in range(rounds):
                            opt.step()
                            per_round.append(clock.take())
                    for key in counts:
                        times[(s, *key, cand)] = statistics.median(r[key] for r in per_round)
                del opt
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
        del named
    return times, sizes, copy, skipped


def _numels(opt) -> Dict[Tuple[str, str], int]:
    """Elements each (kernel, form) of ``opt``'s step handles (its tensors by their
    moments' form; LAMB's kernels, LANS's and sum_squares, or AdamW's one)."""
    import torch

    name = type(opt).__name__.lower()
    out: Dict[Tuple[str, str], int] = {}
    kernels = (["adam_apply"] if name == "adamw" else
               [f"{name}_sums", f"{name}_apply"] + (["sum_squares"] if name == "lans" else []))
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            form = ("int8" if st["exp_avg"].dtype == torch.int8 else
                    "bfloat16" if st["exp_avg"].dtype == torch.bfloat16 else "float32")
            for k in kernels:
                out[(k, form)] = out.get((k, form), 0) + p.numel()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for triton_launch.json and sweep.json")
    ap.add_argument("--sets", default="base,1b", help="parameter sets (default: base,1b)")
    ap.add_argument("--budget", type=float, default=330.0,
                    help="seconds for compiling and timing (default: 330)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="compiling processes (default: the CPU count, at most 16)")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per candidate")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile every candidate's kernels into Triton's cache, time nothing")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to sweep")
        return NO_CUDA
    started = time.monotonic()
    deadline = started + args.budget
    cands = candidates()
    # compiling takes at most half the budget (all of it with --compile-only)
    ready = warm(cands, args.jobs, deadline if args.compile_only else started + args.budget / 2)
    compiled = time.monotonic() - started
    print(f"compiled {len(ready)} of {len(cands)} candidates' kernels in {compiled:.0f} s "
          f"({args.jobs} processes)", flush=True)
    if args.compile_only:
        return 0
    left_out = len(cands) - len(ready)
    cands = ready
    from scaleopt.benchmarking import SIZES, bert_shapes

    sets = {s: bert_shapes(*SIZES[s]) for s in args.sets.split(",")}
    times, sizes, copy, skipped = measure(sets, cands, args.rounds, deadline)
    default = L.load(str(L.DEFAULT))
    chosen = choose(times, default)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    L.save(chosen, str(out / "triton_launch.json"))
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  candidates=len(cands), not_compiled=left_out, compile_s=compiled,
                  seconds=time.monotonic() - started, skipped=len(skipped),
                  copy_gb_s={s: b / 1e9 for s, b in copy.items()},
                  before=bandwidths(times, default, sizes, copy),
                  after=bandwidths(times, chosen, sizes, copy), table=chosen.as_dict(),
                  times=[[s, k, f, list(c), t] for (s, k, f, c), t in sorted(times.items())])
    (out / "sweep.json").write_text(json.dumps(report, indent=1))
    print(summary(report))
    return 0


def summary(report: Dict[str, Any]) -> str:
    """The comparison as markdown: per set, kernel and form, the package's table's time and
    share of the copy against the chosen one's."""
    return "\n".join([f"{report['device']}: {report['candidates']} candidates timed "
                      f"({report.get('not_compiled', 0)} not compiled in time), "
                      f"{report['seconds']:.0f} s ({report['skipped']} runs skipped for time); "
                      "copy " + ", ".join(f"{s} {b:.0f} GB/s"
                                          for s, b in report["copy_gb_s"].items()), ""]
                     + comparison(report["before"], report["after"]))


def comparison(before: Dict[str, Any], after: Dict[str, Any]) -> List[str]:
    """The rows of :func:`bandwidths` with the package's table (``before``) and the chosen one
    (``after``) side by side, as a markdown table's lines."""
    lines = ["| set | kernel, form | ms, the package's table | of copy | ms, chosen | of copy |",
             "|---|---|---:|---:|---:|---:|"]
    for s, rows in before.items():
        for key, b in rows.items():
            a = after.get(s, {}).get(key, {})
            lines.append(f"| {s} | {key} | {b['ms']:.3f} | {100 * b['of_copy']:.0f}% | "
                         f"{a.get('ms', float('nan')):.3f} | {100 * a.get('of_copy', 0):.0f}% |")
    return lines


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
