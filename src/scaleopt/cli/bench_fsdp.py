"""LAMB and LANS on FSDP2 shards: step time as paired ratios to torch.optim.AdamW(fused=True).

    scaleopt bench --world 2                             # 2 processes x 1 thread, 28.8M set
    python benchmarks/bench_fsdp.py --world 2 --threads 1 --rounds 15 [--size base]

Every rank holds 1/world of the BERT-like parameter set of ``scaleopt bench`` (``fully_shard``,
gloo on 127.0.0.1) with gradients on its shards. Each optimizer steps in turn, round after round;
a step's time is the slowest rank's (the ranks start together after a barrier). The baseline is
``torch.optim.AdamW(fused=True)`` on the same local shards (plain tensors: no collective at all);
the table gives the median step time and the median over rounds of the paired ratio, and, per
step, the collectives and the time spent in them, split into the time waiting for another rank
to reach a collective ("for ranks": the ranks' imbalance) and the time waiting for its bytes once
all had ("for bytes": the exchange not hidden).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import scaleopt
from scaleopt.cli import options
from scaleopt.cli.launch import free_port
from scaleopt.cli.world import TIMEOUT, end_group
from scaleopt.benchmarking import NO_DECAY, SIZES, bert_shapes, interleaved, muon, paired_ratio


def sharded_params(shapes, world, mesh=None):
    """The parameter set as one FSDP2 module: DTensors sharded on dim 0 (on ``mesh``, e.g.
    HSDP's 2-D one; None: the default 1-D one), with gradients."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    module = nn.Module()
    g = torch.Generator().manual_seed(0)
    names = []
    for name, shape in shapes:
        key = name.replace(".", "_")
        module.register_parameter(key, nn.Parameter(torch.randn(shape, generator=g) * 0.02))
        names.append(key)
    fully_shard(module, mesh=mesh)
    named = [(n, getattr(module, n)) for n in names]
    for _, p in named:
        local = torch.randn(p.to_local().shape, generator=g) * 1e-3
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride())
    return named


class EveryReplicaIterating:
    """scaleopt.Muon as it was before a matrix was iterated once in the whole mesh: on HSDP
    each replica's shard group iterates all of its matrices (the replicas ignored by the
    exchange), for a comparison in one run."""

    def __init__(self, named) -> None:
        self.opt = muon(named)

    def step(self) -> None:
        from scaleopt import _layout, _orthogonal

        real = _orthogonal.layout

        def without_replicas(p):
            got = real(p)
            return None if got is None else _layout.Layout(got.group, None, got.index)

        _orthogonal.layout = without_replicas
        try:
            self.opt.step()
        finally:
            _orthogonal.layout = real


def candidates(kind: str = "layerwise", replicas: int = 1):
    """The timed optimizers: LAMB, LANS and AdamW (``layerwise``), or Muon's rows (``muon``;
    with ``replicas`` > 1 also the one iterating in every replica); each with the fused AdamW
    baseline on the local shards."""
    def local_fused_adamw(named):
        ps = []
        for _, p in named:
            q = nn.Parameter(p.to_local().detach().clone())
            q.grad = p.grad.to_local().clone()
            ps.append(q)
        return torch.optim.AdamW(ps, lr=1e-3, fused=True)

    if kind == "muon":
        rows = {"torch.AdamW(fused=True), local shards": local_fused_adamw,
                "scaleopt.Muon": muon,
                "scaleopt.Muon(exchange_buckets=4)": lambda n: muon(n, exchange_buckets=4),
                "scaleopt.Muon(exchange_balance=measured)": lambda n: muon(
                    n, exchange_balance="measured"),
                "scaleopt.Muon(state_dtype=int8)": lambda n: muon(n, state_dtype="int8")}
        if replicas > 1:
            rows["scaleopt.Muon, every replica iterating"] = EveryReplicaIterating
        return rows
    return {
        "torch.AdamW(fused=True), local shards": local_fused_adamw,
        "scaleopt.AdamW": lambda n: scaleopt.AdamW(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB": lambda n: scaleopt.LAMB(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LANS": lambda n: scaleopt.LANS(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB(max_grad_norm=1.0)": lambda n: scaleopt.LAMB(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, max_grad_norm=1.0),
    }


class _TimedWork:
    """An asynchronous collective's handle whose ``wait`` (where the step waits on it) is
    timed; ``record`` is the collective's entry in its clock's ``calls``."""

    def __init__(self, work, clock, record) -> None:
        self.work, self.clock, self.record = work, clock, record

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        t1 = time.perf_counter()
        self.clock.seconds += t1 - t0
        self.record[2:] = [t0, t1]
        return out


class CollectiveClock:
    """Counts the collectives scaleopt issues (the norms' all-reduces, Muon's all-to-alls and
    all-gathers) and the time the step spends in them (in a blocking call, or waiting on an
    asynchronous one: the exchange that is not hidden), and the time in Muon's iteration.

    ``calls`` keeps, per collective, [its group's ranks, when it was issued, when the step
    began to wait on it, when the wait ended] (``time.perf_counter``, one clock for the
    processes of one machine), so that :func:`split_waits` can tell the time spent waiting for
    another rank to reach the collective from the time spent waiting for its bytes."""

    NAMES = ("all_reduce", "all_to_all_single", "all_gather")

    def __init__(self):
        from scaleopt import _orthogonal

        self.real = {name: getattr(dist, name) for name in self.NAMES}
        self.iteration = _orthogonal.newton_schulz
        self.count, self.seconds, self.iterating, self.calls = 0, 0.0, 0.0, []

    def _timed(self, real):
        def timed(*args, **kwargs):
            group = kwargs.get("group") or dist.group.WORLD
            t0 = time.perf_counter()
            out = real(*args, **kwargs)
            t1 = time.perf_counter()
            self.seconds += t1 - t0
            self.count += 1
            record = [tuple(dist.get_process_group_ranks(group)), t0, t0, t1]
            self.calls.append(record)
            return _TimedWork(out, self, record) if kwargs.get("async_op") else out
        return timed

    def _iteration(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.iteration(*args, **kwargs)
        self.iterating += time.perf_counter() - t0
        return out

    def __enter__(self):
        from scaleopt import _orthogonal

        self.count, self.seconds, self.iterating, self.calls = 0, 0.0, 0.0, []
        for name, real in self.real.items():
            setattr(dist, name, self._timed(real))
        _orthogonal.newton_schulz = self._iteration
        return self

    def __exit__(self, *exc):
        from scaleopt import _orthogonal

        for name, real in self.real.items():
            setattr(dist, name, real)
        _orthogonal.newton_schulz = self.iteration


def split_waits(calls, everyone=None) -> tuple:
    """(seconds this rank waited for another rank to reach a collective, seconds it waited for
    the collectives' bytes once every rank of the group had issued it), from a
    :class:`CollectiveClock`'s ``calls`` on this rank and :func:`issued` of every rank
    (``everyone``; None: gathered here, a collective on all ranks). The first is the ranks'
    imbalance; the second is the exchange that the step did not hide."""
    if everyone is None:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, issued(calls))
    last = {}
    for rank_calls in everyone:
        for key, when in rank_calls:
            last[key] = max(last.get(key, when), when)
    peers = transfer = 0.0
    for (key, _), (_, _, start, end) in zip(issued(calls), calls):
        arrived = min(max(last[key], start), end)  # when this rank's group was all there
        peers += arrived - start
        transfer += end - arrived
    return peers, transfer


def issued(calls) -> list:
    """[((a group's ranks, the how-manieth collective of that group), when it was issued)] for
    a :class:`CollectiveClock`'s ``calls``: the same key names the same collective on every
    rank of the group."""
    seen, out = {}, []
    for ranks, when, _, _ in calls:
        n = seen[ranks] = seen.get(ranks, -1) + 1
        out.append(((ranks, n), when))
    return out


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _slowest_rank(step):
    """(the slowest rank's seconds of one step, the ranks' started together; (its collectives'
    count, and the slowest rank's seconds in them, iterating, waiting for another rank to reach
    a collective, and waiting for the collectives' bytes))."""
    dist.barrier()
    with CollectiveClock() as clock:
        t0 = time.perf_counter()
        step()
        elapsed = time.perf_counter() - t0
    peers, transfer = split_waits(clock.calls)
    return slowest(elapsed), (clock.count, slowest(clock.seconds), slowest(clock.iterating),
                              slowest(peers), slowest(transfer))


def worker(rank, world, port, shapes, threads, rounds, queue, kind="layerwise", replicas=1):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    mesh = None
    if replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (replicas, world // replicas),
                                mesh_dim_names=("replicate", "shard"))
    opts = {name: make(sharded_params(shapes, world, mesh))
            for name, make in candidates(kind, replicas).items()}
    measured = interleaved({name: opt.step for name, opt in opts.items()}, rounds, warmup=1,
                           timer=_slowest_rank)  # (the first round makes the state)
    times = {name: [seconds for seconds, _ in m] for name, m in measured.items()}
    # per round: (collectives, seconds in them, iterating, waiting for peers, for bytes)
    comms = {name: [c for _, c in m] for name, m in measured.items()}
    if rank == 0:
        queue.put((times, comms))
    dist.barrier()
    del opts  # what holds the group goes first
    end_group()


def _result(queue, procs, limit: float = 1800.0):
    """Rank 0's results from ``queue``, or an error as soon as a worker has died without them
    (its traceback is on stderr) or after ``limit`` seconds."""
    import queue as queues

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=2.0)
        except queues.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"benchmark worker(s) {dead} failed (exit codes "
                                   f"{[procs[r].exitcode for r in dead]}; see above)")
    raise RuntimeError(f"no results from the benchmark workers after {limit:.0f} s")


def run(shapes, world: int, threads: int, rounds: int, label: str,
        kind: str = "layerwise", replicas: int = 1) -> dict:
    """Time the candidates (of ``kind``, see :func:`candidates`) on ``world`` processes (HSDP
    with ``replicas`` > 1); print the table; return the results."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, shapes, threads, rounds, queue,
                                              kind, replicas))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        times, comms = _result(queue, procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    base = times["torch.AdamW(fused=True), local shards"]
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    layout = (f"HSDP over {replicas} replicas x {world // replicas} shards"
              if replicas > 1 else f"FSDP2 over {world} processes")
    print(f"BERT-like {label} set: {numel / 1e6:.1f}M parameters in {len(shapes)} tensors, "
          f"{layout} x {threads} thread(s) (gloo), torch {torch.__version__}, {rounds} rounds")
    print(f"{'optimizer':40s} {'median ms':>9s} {'x fused AdamW':>14s} {'collectives':>12s} "
          f"{'in them ms':>11s} {'for ranks':>10s} {'for bytes':>10s} {'iterating ms':>13s}")
    rows = {}
    for name, ts in times.items():
        per_round = comms[name]
        rows[name] = dict(median_ms=statistics.median(ts) * 1e3,
                          ratio=paired_ratio(ts, base), collectives=per_round[-1][0],
                          collective_ms=statistics.median(c[1] for c in per_round) * 1e3,
                          iteration_ms=statistics.median(c[2] for c in per_round) * 1e3,
                          peers_ms=statistics.median(c[3] for c in per_round) * 1e3,
                          transfer_ms=statistics.median(c[4] for c in per_round) * 1e3,
                          rounds_s=list(ts), collective_s=[c[1] for c in per_round],
                          iteration_s=[c[2] for c in per_round],
                          transfer_s=[c[4] for c in per_round])
        print(f"{name:40s} {rows[name]['median_ms']:9.1f} {rows[name]['ratio']:14.2f} "
              f"{per_round[-1][0]:12d} {rows[name]['collective_ms']:11.2f} "
              f"{rows[name]['peers_ms']:10.2f} {rows[name]['transfer_ms']:10.2f} "
              f"{rows[name]['iteration_ms']:13.1f}")
    return dict(parameters=numel, tensors=len(shapes), world=world, threads=threads,
                replicas=replicas, rounds=rounds, torch=torch.__version__, rows=rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_world(ap, 2, "processes (default: 2)")
    options.add_threads(ap, "intra-op threads per process (default: 1)", default=1)
    options.add_rounds(ap, 10)
    options.add_size(ap, SIZES, default="small", help="the parameter set (default: small)")
    args = ap.parse_args(argv)
    run(bert_shapes(*SIZES[args.size]), args.world, args.threads, args.rounds, repr(args.size))


if __name__ == "__main__":
    main()
