"""The benchmark harness that ``scaleopt bench`` and the scripts in ``benchmarks/`` share: BERT-like
parameter sets by size, their parameters with gradients, rounds of steps timed interleaved,
the paired ratio against a baseline, and the bytes an optimizer holds."""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

import scaleopt

SIZES = {
    # name: (hidden, layers, vocab, intermediate)
    "small": (512, 4, 30522, 2048),
    "base": (768, 12, 30522, 3072),
    "1b": (2048, 19, 30522, 8192),
}


def size_options(ap: Any) -> None:
    """``--hidden``, ``--layers`` and ``--vocab``: each overrides that size of the set the
    command times (its ``--size``, or the 'small' set)."""
    ap.add_argument("--hidden", type=int, help="override the hidden size of the set")
    ap.add_argument("--layers", type=int, help="override the number of layers of the set")
    ap.add_argument("--vocab", type=int, help="override the vocabulary size of the set")


def cpu_options(ap: Any, rounds: int) -> None:
    """:func:`size_options`, and ``--threads`` (2) and ``--rounds``: a benchmark of one process
    on the CPU (:func:`cpu_shapes`)."""
    size_options(ap)
    from .cli import options

    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    options.add_rounds(ap, rounds)


def cpu_shapes(args: Any, native: bool = False) -> List[Tuple[str, Tuple[int, ...]]]:
    """:func:`shapes_of`, torch set to ``args.threads`` threads; with ``native``, a benchmark
    of the C kernels, which stops with a message where they are not built."""
    from . import _native

    if native and not _native.available():
        raise SystemExit("the C kernels are not built")
    torch.set_num_threads(args.threads)
    return shapes_of(args)


def shapes_of(args: Any) -> List[Tuple[str, Tuple[int, ...]]]:
    """The BERT-like shapes of ``args.size`` (or the 'small' set) with the overrides of
    :func:`size_options` (a hidden size brings its intermediate size, 4x)."""
    hidden, layers, vocab, inter = SIZES[getattr(args, "size", None) or "small"]
    if args.hidden is not None:
        hidden, inter = args.hidden, 4 * args.hidden
    layers = args.layers if args.layers is not None else layers
    vocab = args.vocab if args.vocab is not None else vocab
    return bert_shapes(hidden, layers, vocab, inter)


def bert_shapes(hidden: int, layers: int, vocab: int, inter: int) -> List[Tuple[str, Tuple[int, ...]]]:
    shapes = [
        ("embeddings.word_embeddings.weight", (vocab, hidden)),
        ("embeddings.position_embeddings.weight", (512, hidden)),
        ("embeddings.token_type_embeddings.weight", (2, hidden)),
        ("embeddings.LayerNorm.weight", (hidden,)),
        ("embeddings.LayerNorm.bias", (hidden,)),
    ]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            shapes += [(p + f"attention.self.{n}.weight", (hidden, hidden)),
                       (p + f"attention.self.{n}.bias", (hidden,))]
        shapes += [
            (p + "attention.output.dense.weight", (hidden, hidden)),
            (p + "attention.output.dense.bias", (hidden,)),
            (p + "attention.output.LayerNorm.weight", (hidden,)),
            (p + "attention.output.LayerNorm.bias", (hidden,)),
            (p + "intermediate.dense.weight", (inter, hidden)),
            (p + "intermediate.dense.bias", (inter,)),
            (p + "output.dense.weight", (hidden, inter)),
            (p + "output.dense.bias", (hidden,)),
            (p + "output.LayerNorm.weight", (hidden,)),
            (p + "output.LayerNorm.bias", (hidden,)),
        ]
    shapes += [("pooler.dense.weight", (hidden, hidden)), ("pooler.dense.bias", (hidden,))]
    return shapes


def make_params(shapes, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    named = []
    for name, shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device, dtype))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device, dtype)
        named.append((name, p))
    return named


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


NO_DECAY = [r"bias$", r"LayerNorm"]


def muon(named, **options):
    """The benchmarks' ``scaleopt.Muon``: the embeddings left to AdamW, as Muon's authors do."""
    return scaleopt.Muon(named, lr=0.02, adamw_lr=1e-3, exclude_from_muon=r"embeddings",
                         exclude_from_weight_decay=NO_DECAY, **options)


def interleaved(steps: Dict[str, Callable[[], Any]], rounds: int, device: str = "cpu",
                after_round: Optional[Callable[[], Any]] = None, *, warmup: int = 0,
                timer: Optional[Callable[[Callable[[], Any]], Any]] = None
                ) -> Dict[str, List[Any]]:
    """Each step's times over ``rounds`` rounds, the steps taken in turn in each round (so a
    drift of the machine's speed hits them alike; :func:`paired_ratio` compares them round by
    round), after ``warmup`` rounds that are not kept (state made, kernels compiled);
    ``after_round`` called after each round, untimed. ``timer(step)`` measures one step
    (default: its seconds between two waits for ``device``); what it returns is kept."""
    timer = timer or (lambda step: wall_seconds(step, device))
    times: Dict[str, List[Any]] = {name: [] for name in steps}
    for r in range(warmup + rounds):
        for name, step in steps.items():
            measured = timer(step)
            if r >= warmup:
                times[name].append(measured)
        if after_round is not None:
            after_round()
    return times


def wall_seconds(step: Callable[[], Any], device: str = "cpu") -> float:
    """The seconds of one step, the device waited for before and after."""
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def paired_ratio(times: List[float], baseline: List[float]) -> float:
    """The median over rounds of ``times[r] / baseline[r]``: both were timed in the same round."""
    return statistics.median(t / b for t, b in zip(times, baseline))


def paired_spread(times: List[float], baseline: List[float], digits: int = 3) -> str:
    """The interquartile range over rounds of ``times[r] / baseline[r]``, as ``"q1-q3"``."""
    ratios = sorted(t / b for t, b in zip(times, baseline))
    return f"{ratios[len(ratios) // 4]:.{digits}f}-{ratios[3 * len(ratios) // 4]:.{digits}f}"


def paired_cells(times: List[float], baseline: List[float], digits: int = 3,
                 width: int = 15) -> str:
    """A row's median milliseconds, its :func:`paired_ratio` to ``baseline`` and its
    :func:`paired_spread`, as the scripts' tables print them."""
    return (f"{statistics.median(times) * 1e3:>10.1f} {paired_ratio(times, baseline):>11.3f} "
            f"{paired_spread(times, baseline, digits):>{width}}")


@contextlib.contextmanager
def collectives() -> Iterator["collections.Counter[str]"]:
    """Counts the collectives issued inside (c10d's ops as the dispatcher sees them, by name:
    ``allreduce_``, ``_reduce_scatter_base_``, ...), waits not counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: "collections.Counter[str]" = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = str(func.overloadpacket)
            if name.startswith(("c10d.", "_c10d_functional.")) and "wait" not in name:
                counts[name.split(".", 1)[1]] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield counts


def held_bytes(opt: torch.optim.Optimizer, named) -> Tuple[int, int]:
    """(bytes of the parameters and their gradients, bytes the optimizer holds between steps
    besides them: :func:`scaleopt.state_bytes` on this process), each storage counted once."""
    model = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
             for _, p in named for p in (p, p.grad) if p is not None}
    return sum(model.values()), scaleopt.state_bytes(opt).per_rank
