"""``scaleopt bench --muon``: Muon's step against ``torch.optim.Muon`` and fused AdamW, and
sharded over FSDP2 against one process.

    scaleopt bench --muon                  # one process, 2 threads, 'small' set
    scaleopt bench --muon --world 2        # 2 processes x 1 thread against 1 process x 2 threads
    scaleopt bench --muon --device cuda    # one GPU, 'base' set

One process: every optimizer has its own copy of the BERT-like set of ``scaleopt bench``, the
steps interleaved round after round, each row's time as the median over rounds of its ratio
to ``torch.optim.AdamW(fused=True)``'s step in the same round, and to torch's Muon: the pair
``torch.optim.Muon`` (the matrices) + ``torch.optim.AdamW(fused=True)`` (the rest), as its docs
recommend. The embeddings are left to AdamW in every Muon row (``exclude_from_muon``).

With ``--world N``: scaleopt.Muon on FSDP2 shards over N processes x ``--threads``, against
scaleopt.Muon in this process on the whole set with N x ``--threads`` threads (the same
cores), and the time in the exchange (the two ``all_to_all_single`` per step); the exchange in
4 runs overlapped with the iteration (``exchange_buckets=4``) against one run, and how much of
the exchange is hidden: the time a rank waits for the collectives' bytes once every rank has
issued them, against one run's (the time it waits for a slower rank to reach a collective is
the ranks' imbalance, shown apart). With ``--replicas R``: HSDP, R replicas of N / R
shards, and also Muon as it was before each matrix was iterated once in the whole mesh (every
replica iterating all of its matrices), the iteration's time per rank and the step paired
with it round by round.

    scaleopt bench --muon --world 4 --replicas 2   # HSDP 2 x 2, 1 thread each
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict

import torch

from . import bench_fsdp
from ..benchmarking import held_bytes, interleaved, make_params, muon, paired_ratio


class TorchPair:
    """torch.optim.Muon for the matrices (not the embeddings) and torch's fused AdamW for the
    rest, stepped together."""

    def __init__(self, named) -> None:
        matrices = [p for n, p in named if p.ndim == 2 and "embeddings" not in n]
        rest = [p for n, p in named if not (p.ndim == 2 and "embeddings" not in n)]
        self.parts = [torch.optim.Muon(matrices, lr=0.02),
                      torch.optim.AdamW(rest, lr=1e-3, fused=True)]

    @property
    def state(self) -> dict:
        """Both parts' state (for the bytes held; made when asked, not in the timed step)."""
        return {p: s for part in self.parts for p, s in part.state.items()}

    @property
    def param_groups(self) -> list:
        """Both parts' groups (for the bytes held)."""
        return [g for part in self.parts for g in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()


def candidates() -> Dict[str, Callable]:
    return {
        "torch.AdamW(fused=True)": lambda n: torch.optim.AdamW([p for _, p in n], lr=1e-3,
                                                              fused=True),
        "torch.optim.Muon + torch.AdamW(fused)": TorchPair,
        "scaleopt.Muon": muon,
        "scaleopt.Muon(state_dtype=int8)": lambda n: muon(n, state_dtype="int8"),
        "scaleopt.Muon(ns_dtype=float32)": lambda n: muon(n, ns_dtype="float32"),
    }


def one_process(shapes, threads: int, rounds: int, label: str, device: str = "cpu") -> dict:
    torch.set_num_threads(threads)
    made = {}
    for name, make in candidates().items():
        named = make_params(shapes, torch.float32, device)
        made[name] = (make(named), named)
    for opt, _ in made.values():
        opt.step()  # the state made
    times = interleaved({name: opt.step for name, (opt, _) in made.items()}, rounds, device)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    base, pair = times["torch.AdamW(fused=True)"], times["torch.optim.Muon + torch.AdamW(fused)"]
    print(f"BERT-like {label} set: {numel / 1e6:.1f}M parameters in {len(shapes)} tensors, "
          f"float32; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if device.startswith('cuda') else f'{threads} threads'}"
          f", {rounds} rounds")
    print(f"{'optimizer':40s} {'median ms':>9s} {'x fused AdamW':>14s} {'x torch Muon':>13s} "
          f"{'state B/param':>14s}")
    rows = []
    for name, ts in times.items():
        model_bytes, held = (b / numel for b in held_bytes(*made[name]))
        row = dict(optimizer=name, median_s=statistics.median(ts), ratio=paired_ratio(ts, base),
                   ratio_to_torch_muon=paired_ratio(ts, pair), state_bytes_per_param=held,
                   model_bytes_per_param=model_bytes)
        rows.append(row)
        print(f"{name:40s} {row['median_s'] * 1e3:9.1f} {row['ratio']:14.2f} "
              f"{row['ratio_to_torch_muon']:13.2f} {held:14.2f}")
    return dict(kind="muon", params=numel, tensors=len(shapes), threads=threads,
                device=device, rounds=rounds, torch=torch.__version__, rows=rows)


def sharded(shapes, world: int, threads: int, rounds: int, label: str,
            replicas: int = 1) -> dict:
    """scaleopt.Muon on ``world`` x ``threads`` (HSDP with ``replicas`` > 1) against one process
    x ``world * threads``; the exchange in runs against one run (how much of it is hidden) and,
    on HSDP, against every replica iterating all of its matrices, paired round by round."""
    torch.set_num_threads(world * threads)
    named = make_params(shapes, torch.float32)
    opt = muon(named)
    opt.step()  # the state made
    alone = interleaved({"scaleopt.Muon": opt.step}, rounds)["scaleopt.Muon"]
    result = bench_fsdp.run(shapes, world, threads, rounds, label, kind="muon",
                            replicas=replicas)
    rows = result["rows"]
    row, bucketed = rows["scaleopt.Muon"], rows["scaleopt.Muon(exchange_buckets=4)"]
    one = statistics.median(alone) * 1e3
    result.update(one_process_threads=world * threads, one_process_median_ms=one,
                  sharded_over_one_process=row["median_ms"] / one,
                  exchange_share=row["collective_ms"] / row["median_ms"],
                  buckets_step_ratio=paired_ratio(bucketed["rounds_s"], row["rounds_s"]),
                  exchange_hidden=1 - bucketed["transfer_ms"] / row["transfer_ms"],
                  wait_ratio=bucketed["collective_ms"] / row["collective_ms"])
    print(f"scaleopt.Muon in one process x {world * threads} threads: {one:.1f} ms; sharded "
          f"{world} x {threads}: {row['median_ms']:.1f} ms ({result['sharded_over_one_process']:.2f}x), "
          f"{row['collectives']} collectives taking {100 * result['exchange_share']:.0f}% of the step")
    print(f"exchange in 4 runs: the step {result['buckets_step_ratio']:.2f}x one run's (paired); "
          f"waiting for the bytes {bucketed['transfer_ms']:.1f} ms against "
          f"{row['transfer_ms']:.1f} ms: {100 * result['exchange_hidden']:.0f}% of the exchange "
          f"hidden; waiting for the other ranks {bucketed['peers_ms']:.1f} against "
          f"{row['peers_ms']:.1f} ms; all waits {bucketed['collective_ms']:.1f} against "
          f"{row['collective_ms']:.1f} ms ({result['wait_ratio']:.2f}x)")
    measured = rows["scaleopt.Muon(exchange_balance=measured)"]
    result.update(balance_step_ratio=paired_ratio(measured["rounds_s"], row["rounds_s"]),
                  balance_peers_ratio=(measured["peers_ms"] / row["peers_ms"]
                                       if row["peers_ms"] else float("nan")))
    print(f"owners by measured pace: waiting for the other ranks {measured['peers_ms']:.1f} "
          f"against {row['peers_ms']:.1f} ms by cost ({result['balance_peers_ratio']:.2f}x), "
          f"for the bytes {measured['transfer_ms']:.1f} against {row['transfer_ms']:.1f} ms; "
          f"the step {result['balance_step_ratio']:.2f}x (paired)")
    if replicas > 1:
        old = rows["scaleopt.Muon, every replica iterating"]
        result.update(iteration_ratio=paired_ratio(row["iteration_s"], old["iteration_s"]),
                      step_ratio_to_every_replica=paired_ratio(row["rounds_s"], old["rounds_s"]))
        print(f"each matrix once in the mesh against every replica iterating all: iteration per "
              f"rank (slowest) {row['iteration_ms']:.1f} against {old['iteration_ms']:.1f} ms "
              f"({result['iteration_ratio']:.2f}x, paired), the step "
              f"{result['step_ratio_to_every_replica']:.2f}x")
    return result
