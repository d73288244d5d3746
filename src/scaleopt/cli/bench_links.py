"""``scaleopt bench --link RATE[,DELAY_MS] ...``: the step time of data-parallel training over
shaped links, dense against compressed.

    scaleopt bench --link 10mbit 100mbit 1gbit 10gbit           # 2 ranks on 2 nodes
    scaleopt bench --link 100mbit --world 4                      # 4 ranks on 4 nodes
    scaleopt bench --link 100mbit --world 4 --per-node 2         # 2 nodes of 2 ranks

For each link, a :class:`scaleopt.links.ShapedCluster` of ``world / per_node`` nodes (one
network namespace each, joined by veth links shaped with tbf to RATE; with DELAY_MS of delay
where the kernel has netem), ``world`` gloo processes of ``--threads`` threads, and in them
the same model (an MLP of ``--layers`` square ``--hidden`` x ``--hidden`` layers: 6.3M
parameters, 25 MB of float32 gradients by default) stepped by:

- DDP's all-reduce with momentum SGD (dense);
- DDP with torch's PowerSGD hook at rank 4 (error feedback, warm start), momentum SGD;
- DDP with the DGC hook (99.9%, momentum correction) and plain SGD (both hooks with all
  gradients in one bucket: with several, gloo may start a hook's chained collectives in
  another order on each rank);
- ``scaleopt.DGCMomentum`` (99.9%) on the unwrapped model;
- the same step with no communication at all (momentum SGD alone in each process): the floor.

Each round takes one step of each in turn (a barrier before and after each), after two
rounds not kept (DDP's buckets rebuilt, PowerSGD past its dense start); each row's time is the
median over rounds of rank 0's step and its ratio to the dense step of the same round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

#: the rows, in the order they are stepped
ROWS = ["dense all-reduce (DDP)", "PowerSGD rank 4 (DDP hook)", "DGC 99.9% (DDP hook)",
        "DGCMomentum 99.9%", "no communication"]
DENSE = ROWS[0]
#: with several ranks per node: FSDP2 inside each node, the nodes replicas (HSDP)
HSDP_ROWS = ["HSDP, all-reduce between nodes", "HSDP, DGCMomentum 99.9% between nodes"]
WARMUP = 2
PORT = 29500
#: the default model: 6 layers of 1024 x 1024 (6.3M parameters)
HIDDEN, LAYERS = 1024, 6


def parse_link(spec: str) -> Tuple[str, float]:
    """``RATE[,DELAY_MS]`` as (rate, delay in ms)."""
    from .. import links

    rate, _, delay = spec.partition(",")
    links.rate_bits(rate)
    try:
        delay_ms = float(delay) if delay else 0.0
    except ValueError:
        raise ValueError(f"--link {spec}: RATE[,DELAY_MS], e.g. 100mbit or 100mbit,5") from None
    return rate, delay_ms


def check(specs: List[str], world: int, per_node: int) -> List[Tuple[str, float]]:
    """``specs`` read as (rate, delay); ValueError for what cannot run here."""
    from .. import links

    parsed = [parse_link(s) for s in specs]
    if world % per_node or world < 2:
        raise ValueError(f"--world {world} --per-node {per_node}: at least 2 ranks, a "
                         f"multiple of the ranks per node")
    reason = links.unavailable()
    if reason is not None:
        raise ValueError(f"--link needs network namespaces: {reason}")
    if any(delay for _, delay in parsed) and links.netem_unavailable() is not None:
        raise ValueError(f"--link with a delay: {links.netem_unavailable()}")
    return parsed


def run(specs: List[str], world: int, per_node: int, rounds: int, hidden: int, layers: int,
        threads: int, timeout: float = 3600.0) -> Dict[str, Any]:
    """Every link of ``specs`` in turn: the results by link, as :func:`worker` writes them."""
    from .. import links

    parsed = check(specs, world, per_node)
    result: Dict[str, Any] = dict(world=world, per_node=per_node, nodes=world // per_node,
                                  rounds=rounds, hidden=hidden, layers=layers, threads=threads,
                                  torch=torch.__version__, links={})
    for spec, (rate, delay_ms) in zip(specs, parsed):
        with tempfile.TemporaryDirectory() as tmp, links.ShapedCluster(
                nodes=world // per_node, rate=rate, delay_ms=delay_ms) as cluster:
            argv = [sys.executable, "-c", "import sys; from scaleopt.cli.bench_links import "
                    "worker; worker(sys.argv[1], *map(int, sys.argv[2:]))", tmp, str(rounds),
                    str(hidden), str(layers), str(threads), str(per_node)]
            codes = cluster.run(per_node, argv, PORT, timeout)
            if codes != [0] * world:
                raise RuntimeError(f"--link {spec}: the ranks exited with {codes}")
            with open(os.path.join(tmp, "rank0.json")) as f:
                one = json.load(f)
            one["sent_per_node"] = [cluster.bytes_sent(k) for k in range(cluster.nodes)]
        result["links"][spec] = one
        _print(spec, one)
    return result


def _print(spec: str, one: Dict[str, Any]) -> None:
    print(f"link {spec}: {one['parameters']:,} parameters, {one['world']} ranks "
          f"x {one['threads']} thread(s), median of {len(one['rows'][DENSE]['step_s'])} rounds")
    print(f"  {'':38} {'step ms':>10} {'x dense':>8} {'bytes sent/rank':>16}")
    for name in one["rows"]:
        row = one["rows"][name]
        print(f"  {name:38} {row['median_ms']:10.1f} {row['ratio_to_dense']:8.3f} "
              f"{row['bytes_sent']:16,.0f}")


# --------------------------------------------------------------------------------------------
# a rank (run inside a node's namespace)
# --------------------------------------------------------------------------------------------


def model_of(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden),
                                                             nn.ReLU())][:-1])


def _steppers(hidden: int, layers: int, per_node: int = 1
              ) -> Dict[str, Tuple[Callable[[], None], Callable[[], float]]]:
    """Each row's step and the bytes this rank sent in its last step (counted or, for
    torch's own collectives, their ring's bytes)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    import scaleopt
    from scaleopt.dgc import DGCHookState, ddp_comm_hook

    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, hidden, generator=gen), torch.randn(64, hidden, generator=gen)
    numel = sum(p.numel() for p in model_of(hidden, layers).parameters())
    ring = _ring_bytes(numel, world)
    steps: Dict[str, Tuple[Callable[[], None], Callable[[], float]]] = {}

    def make(model: nn.Module, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return step

    dense = nn.parallel.DistributedDataParallel(model_of(hidden, layers))
    steps[ROWS[0]] = (make(dense, torch.optim.SGD(dense.parameters(), lr=1e-3, momentum=0.9)),
                      lambda: ring)
    # the hooks' chained collectives in one bucket: with several, gloo's threads may start
    # them in another order on each rank (a collective mismatch at 4 ranks)
    one_bucket = 1 + 4 * numel / 2 ** 20
    low = nn.parallel.DistributedDataParallel(model_of(hidden, layers), bucket_cap_mb=one_bucket)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                   start_powerSGD_iter=2)
    low.register_comm_hook(state, powersgd.powerSGD_hook)
    # P and Q of each matrix (rank 4) and the vectors dense, each all-reduced in a ring
    low_numel = sum(4 * sum(p.shape) if p.ndim == 2 else p.numel() for p in low.parameters())
    steps[ROWS[1]] = (make(low, torch.optim.SGD(low.parameters(), lr=1e-3, momentum=0.9)),
                      lambda: _ring_bytes(low_numel, world))
    hooked = nn.parallel.DistributedDataParallel(model_of(hidden, layers),
                                                 bucket_cap_mb=one_bucket)
    hook = DGCHookState(hooked, momentum=0.9, sparsity=[0.999], rampup_begin_step=0,
                        min_numel=16384)
    hooked.register_comm_hook(hook, ddp_comm_hook)
    steps[ROWS[2]] = (make(hooked, torch.optim.SGD(hooked.parameters(), lr=1e-3)),
                      lambda: hook.telemetry.get("bytes_sent", float("nan")))
    plain = model_of(hidden, layers)
    dgc = scaleopt.DGCMomentum(plain.parameters(), lr=1e-3, momentum=0.9, sparsity=[0.999],
                               rampup_begin_step=0)
    steps[ROWS[3]] = (make(plain, dgc), lambda: dgc.telemetry.get("bytes_sent", float("nan")))
    alone = model_of(hidden, layers)
    steps[ROWS[4]] = (make(alone, torch.optim.SGD(alone.parameters(), lr=1e-3, momentum=0.9)),
                      lambda: 0.0)
    if per_node > 1:
        steps.update(_hsdp_steppers(hidden, layers, per_node, make))
    return steps


def _ring_bytes(numel: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``numel`` float32 values over ``ranks``."""
    return 4 * numel * 2 * (ranks - 1) / ranks


def _hsdp_steppers(hidden: int, layers: int, per_node: int, make: Callable) -> Dict[str, Any]:
    """HSDP's rows: FSDP2 over the ranks of a node, the nodes replicas; the replicas'
    all-reduce dense, or DGCMomentum's exchange between them. Their bytes: those that cross
    the nodes' links (a ring all-reduce of this rank's shard over the replicas; DGC's
    telemetry)."""
    import torch.distributed as dist

    import scaleopt

    from . import models

    nodes = dist.get_world_size() // per_node
    mesh = models.hsdp_mesh(nodes, dist.get_world_size(), torch.device("cpu"))
    numel = sum(p.numel() for p in model_of(hidden, layers).parameters())
    shard_bytes = _ring_bytes(numel / per_node, nodes)
    both = []
    for where in (mesh, mesh["shard"]):  # HSDP on the 2-D mesh; FSDP2 in the node for DGC
        model = model_of(hidden, layers)
        models.shard(model, where)
        both.append(model)
    dense = torch.optim.SGD(both[0].parameters(), lr=1e-3, momentum=0.9)
    dgc = scaleopt.DGCMomentum(both[1].parameters(), lr=1e-3, momentum=0.9, sparsity=[0.999],
                               rampup_begin_step=0, mesh=mesh)
    return {HSDP_ROWS[0]: (make(both[0], dense), lambda: shard_bytes),
            HSDP_ROWS[1]: (make(both[1], dgc),
                           lambda: dgc.telemetry.get("bytes_sent", float("nan")))}


def worker(out: str, rounds: int, hidden: int, layers: int, threads: int,
           per_node: int = 1) -> None:
    """One rank: the rows' steps interleaved over ``WARMUP + rounds`` rounds; rank 0 writes
    ``rank0.json``."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    steps = _steppers(hidden, layers, per_node)
    times: Dict[str, List[float]] = {name: [] for name in steps}
    sent: Dict[str, float] = {}
    for r in range(WARMUP + rounds):
        for name in steps:
            step, count = steps[name]
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if r >= WARMUP:
                times[name].append(time.perf_counter() - t0)
            sent[name] = count()
    if dist.get_rank() == 0:
        rows = {}
        for name in steps:
            ratios = [t / d for t, d in zip(times[name], times[DENSE])]
            rows[name] = dict(median_ms=1e3 * statistics.median(times[name]),
                              ratio_to_dense=statistics.median(ratios),
                              step_s=times[name], bytes_sent=sent[name])
        numel = sum(p.numel() for p in model_of(hidden, layers).parameters())
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump(dict(parameters=numel, world=dist.get_world_size(), threads=threads,
                           rows=rows), f)
    dist.barrier()
    dist.destroy_process_group()


def write_plot(result: Dict[str, Any], path: str) -> Optional[str]:
    """``links.png``: each row's median step time against the link rate (log-log). Returns the
    path, or None where matplotlib is not installed."""
    from .. import links
    from .report import _plt

    plt = _plt()
    if plt is None:
        return None
    specs = list(result["links"])
    rates = [links.rate_bits(parse_link(s)[0]) / 1e6 for s in specs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in result["links"][specs[0]]["rows"]:
        ax.plot(rates, [result["links"][s]["rows"][name]["median_ms"] for s in specs], "o-",
                label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("step time (ms, median)")
    one = result["links"][specs[0]]
    ax.set_title(f"{one['parameters'] / 1e6:.1f}M parameters, {result['world']} ranks on "
                 f"{result['nodes']} nodes", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
