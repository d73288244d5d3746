"""``scaleopt bench``: optimizer step time on a BERT-like parameter set, as ratios to
``torch.optim.AdamW(fused=True)``.

Every optimizer gets its own copy of the same parameters and gradients. Steps are timed
interleaved, round after round, in one process, so drifts in machine speed hit every optimizer
alike; the table gives the median step time and the median over rounds of its ratio to the fused
AdamW baseline's step in the same round (paired, which cancels most of the drift), and the
time of one in-place ``p += g`` over all tensors (12 bytes per float32 parameter) as the
memory-bandwidth reference. Rows with bfloat16 parameters also give their paired ratio to the
same optimizer's float32 row (``x fp32 row``). Peers (timm, torch-optimizer, pytorch-optimizer, DeepSpeed's CPU Adam)
are timed when installed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
from typing import Any, Callable, Dict, List, Tuple

import torch

import scaleopt

from . import bench_fsdp, bench_gpu, bench_links, bench_memory, bench_muon, options
from ..benchmarking import (NO_DECAY, SIZES, held_bytes, interleaved, make_params, paired_ratio,
                            shapes_of, size_options)
from .report import NO_PLOTS, write_bench_plot
from .config import check_out, new_folder

# the float32-parameter row each bfloat16 row is set against ("no slower than the fp32 step")
FP32_ROW = {
    "scaleopt.LAMB(bf16 params, master_weights)": "scaleopt.LAMB",
    "scaleopt.LANS(bf16 params, master_weights)": "scaleopt.LANS",
    "scaleopt.OffloadAdam(bf16 params)": "scaleopt.OffloadAdam",
    "scaleopt.offload(LAMB)(bf16 params)": "scaleopt.LAMB",
    # and each compact-state row against the same optimizer with float32 state
    "scaleopt.LAMB(state_dtype=bfloat16)": "scaleopt.LAMB",
    "scaleopt.LAMB(state_dtype=int8)": "scaleopt.LAMB",
    "scaleopt.LANS(state_dtype=int8)": "scaleopt.LANS",
    "scaleopt.AdamW(state_dtype=int8)": "scaleopt.AdamW",
    "scaleopt.OffloadAdam(state_dtype=int8)": "scaleopt.OffloadAdam",
    "scaleopt.LAMB(bf16 params, master_weights, state_dtype=int8)":
        "scaleopt.LAMB(bf16 params, master_weights)",
}


def candidates() -> Tuple[Dict[str, Callable], Dict[str, Callable]]:
    """(optimizers on parameters of the chosen dtype, optimizers on bfloat16 parameters)."""
    c: Dict[str, Callable] = {
        "torch.AdamW(fused=True)": lambda n: torch.optim.AdamW([p for _, p in n], lr=1e-3, fused=True),
        "torch.AdamW(foreach=True)": lambda n: torch.optim.AdamW([p for _, p in n], lr=1e-3, foreach=True),
        "scaleopt.AdamW": lambda n: scaleopt.AdamW(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB": lambda n: scaleopt.LAMB(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB(foreach=False)": lambda n: scaleopt.LAMB(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, foreach=False),
        "scaleopt.LANS": lambda n: scaleopt.LANS(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        # BERT's LAMB recipe clips by the global gradient norm
        "scaleopt.LAMB(max_grad_norm=1.0)": lambda n: scaleopt.LAMB(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, max_grad_norm=1.0),
        "scaleopt.OffloadAdam": lambda n: scaleopt.OffloadAdam(
            n, lr=1e-3, weight_decay=0.01, exclude_from_weight_decay=NO_DECAY),
        **_compact_rows(),
    }
    # bf16 parameters with fp32 master weights and moments (mixed-precision training); each
    # row is also compared with the float32 row of FP32_ROW
    low: Dict[str, Callable] = {
        "scaleopt.LAMB(bf16 params, master_weights)": lambda n: scaleopt.LAMB(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, master_weights=True),
        "scaleopt.LANS(bf16 params, master_weights)": lambda n: scaleopt.LANS(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, master_weights=True),
        "scaleopt.OffloadAdam(bf16 params)": lambda n: scaleopt.OffloadAdam(
            n, lr=1e-3, weight_decay=0.01, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.offload(LAMB)(bf16 params)": lambda n: scaleopt.offload(
            scaleopt.LAMB, n, lr=1e-3, exclude_from_weight_decay=NO_DECAY),
        "scaleopt.LAMB(bf16 params, master_weights, state_dtype=int8)": lambda n: scaleopt.LAMB(
            n, lr=1e-3, exclude_from_weight_decay=NO_DECAY, master_weights=True,
            state_dtype="int8"),
    }
    try:
        from timm.optim import Lamb as TimmLamb

        c["timm.optim.Lamb"] = lambda n: TimmLamb([p for _, p in n], lr=1e-3)
    except Exception:
        pass
    try:
        import torch_optimizer

        c["torch_optimizer.Lamb"] = lambda n: torch_optimizer.Lamb([p for _, p in n], lr=1e-3)
    except Exception:
        pass
    try:
        import pytorch_optimizer

        c["pytorch_optimizer.Lamb"] = lambda n: pytorch_optimizer.Lamb([p for _, p in n], lr=1e-3)
    except Exception:
        pass
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        c["deepspeed.DeepSpeedCPUAdam"] = lambda n: DeepSpeedCPUAdam([p for _, p in n], lr=1e-3)
    except Exception:
        pass
    return c, low


def _compact_rows() -> Dict[str, Callable]:
    """The optimizers with their moments in bfloat16 or 8 bits (``state_dtype``)."""
    def row(cls, state_dtype, **options):
        return lambda n: cls(n, lr=1e-3, exclude_from_weight_decay=NO_DECAY,
                             state_dtype=state_dtype, **options)
    return {
        "scaleopt.LAMB(state_dtype=bfloat16)": row(scaleopt.LAMB, "bfloat16"),
        "scaleopt.LAMB(state_dtype=int8)": row(scaleopt.LAMB, "int8"),
        "scaleopt.LANS(state_dtype=int8)": row(scaleopt.LANS, "int8"),
        "scaleopt.AdamW(state_dtype=int8)": row(scaleopt.AdamW, "int8"),
        "scaleopt.OffloadAdam(state_dtype=int8)": row(scaleopt.OffloadAdam, "int8",
                                                      weight_decay=0.01),
    }


def bandwidth_reference(named) -> float:
    """Seconds for one in-place ``p += g`` over all tensors (12 bytes per fp32 parameter): the
    median of ``torch.utils.benchmark``'s blocks (it warms up and waits for the device)."""
    from torch.utils import benchmark

    params = [p.detach() for _, p in named]
    grads = [p.grad for _, p in named]
    timer = benchmark.Timer("torch._foreach_add_(params, grads, alpha=0.0)",
                            globals={"torch": torch, "params": params, "grads": grads},
                            num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=0.2).median


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="optimizer step time as ratios to torch's fused AdamW",
                       description=options.plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=command)
    return p


def command(args: argparse.Namespace) -> int:
    if args.memory:
        memory(args)
        return options.EXIT_OK
    if args.link:
        link(args)
        return options.EXIT_OK
    check_arguments(args)
    run(args)
    return options.EXIT_OK


def add_arguments(ap: argparse.ArgumentParser) -> None:
    options.add_size(ap, SIZES,
                     help="BERT-like shapes: small = hidden 512, 4 layers (28.8M parameters, about "
                          "6 GiB with every optimizer); base = BERT-base (109.5M, about 22 GiB; "
                          "checked against the memory available before anything runs); 1b = "
                          "hidden 2048, 19 layers (1.02B; with --device cuda) (default: small, "
                          "base with --device cuda)")
    size_options(ap)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="parameter dtype of the main rows (default: float32)")
    options.add_threads(ap, "intra-op threads (per process with --world; default: 2, 1 with "
                            "--world)")
    options.add_world(ap, 1,
                      help="shard the set with FSDP2 over this many processes (gloo on 127.0.0.1) "
                           "and time LAMB, LANS and AdamW on the shards against torch's fused "
                           "AdamW on the same local shards (default: 1, no sharding)")
    options.add_device(ap, "cpu or cuda: on cuda, LAMB and LANS by the Triton kernels, torch's "
                           "multi-tensor ops and those compiled, one at a time against the fused "
                           "AdamW, with host time, bandwidth against a copy and peak memory "
                           "(default: cpu)", default="cpu")
    options.add_rounds(ap, 10, "timed steps per optimizer, interleaved")
    ap.add_argument("--muon", action="store_true",
                    help="time Muon instead: against torch.optim.Muon and the fused AdamW in one "
                         "process, or with --world N sharded against one process on the same "
                         "cores (see docs/muon.md)")
    options.add_replicas(ap, "with --muon --world N: HSDP, R replicas of N / R shards "
                             "(default: 1)", default=1)
    ap.add_argument("--memory", nargs="?", const="matrices", choices=bench_memory.MODELS,
                    metavar="MODEL",
                    help="measure instead the peak memory of a whole training step (forward, "
                         "backward, step) in bytes per parameter, each optimizer and mode in a "
                         "process of its own, on MODEL: matrices (the default: 24 matrices of "
                         "1024 x 1024, 25.2M parameters) or llama (a llama-like stack of 12 "
                         "layers of width 768 over bytes, 85M) (see docs/memory.md)")
    ap.add_argument("--link", nargs="+", metavar="RATE[,DELAY_MS]",
                    help="time instead data-parallel steps over links of these rates (tc's "
                         "notation: 10mbit, 1gbit; a delay in ms where the kernel has netem), "
                         "each in a cluster of network namespaces made for it (needs root): "
                         "dense all-reduce, PowerSGD, DGC (see docs/dgc.md)")
    ap.add_argument("--per-node", type=options.positive_int, default=1, metavar="K",
                    help="with --link: ranks per node (their traffic unshaped; default: 1)")
    ap.add_argument("--only", nargs="*", metavar="NAME",
                    help="time only optimizers whose name contains one of these (the fused "
                         "AdamW baseline always runs)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    options.add_output(ap, "bench.json", "bench-<size>")


def check_arguments(args: argparse.Namespace) -> None:
    if args.threads is None:
        args.threads = 2 if args.world == 1 else 1
    if args.size is None:
        args.size = "base" if args.device.startswith("cuda") else "small"
    for name in ("hidden", "layers", "vocab", "rounds", "world"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    options.check_device(args.device)
    if args.muon and (args.dtype != "float32" or args.only
                      or (args.world > 1 and args.device != "cpu")):
        raise ValueError("--muon times float32 steps of a fixed set of optimizers (sharded: on "
                         "the CPU): --dtype and --only do not apply")
    if args.replicas != 1 and not (args.muon and args.world > 1 and args.replicas > 1
                                   and args.world % args.replicas == 0):
        raise ValueError(f"--replicas {args.replicas}: HSDP for --muon with --world N, N a "
                         f"multiple of the replicas")
    if args.world > 1 and (args.device != "cpu" or args.dtype != "float32" or args.only):
        raise ValueError("--world times float32 CPU shards of a fixed set of optimizers: "
                         "--device, --dtype and --only do not apply")
    if args.only:
        names = _names(args)
        unknown = [o for o in args.only if not any(_contains(n, o) for n in names)]
        if unknown:
            raise ValueError(f"--only {' '.join(unknown)}: no optimizer's name contains "
                             f"{'it' if len(unknown) == 1 else 'them'}; the names: "
                             f"{', '.join(names)}")
    need, have = memory_need(args), available_memory(args.device)
    if have is not None and need > have:
        raise ValueError(f"this benchmark holds about {need / 2**30:.1f} GiB (every optimizer "
                         f"keeps its own parameters, gradients and state for the interleaved "
                         f"rounds) and {have / 2**30:.1f} GiB are available: choose a smaller "
                         f"--size or fewer optimizers with --only")
    if args.out is None:
        tag = args.size if args.hidden is None and args.layers is None else "custom"
        tag += "-muon" if args.muon else ""
        args.out = new_folder(pathlib.Path("scaleopt-runs") / f"bench-{tag}"
                              f"{f'-world{args.world}' if args.world > 1 else ''}")
    check_out(args.out, overwrite=args.overwrite)


#: bytes held per parameter by one timed optimizer: a float32 parameter, its gradient and two
#: moments (a bfloat16 row holds 14 with its split master)
BYTES_PER_PARAMETER = 16


def memory_need(args: argparse.Namespace) -> int:
    """Bytes the run holds at once: each timed optimizer keeps its own parameters, gradients
    and state (upper bound: float32 everything plus a master); on cuda, two at a time."""
    nparams = sum(torch.Size(s).numel() for _, s in shapes_of(args))
    if args.muon and args.device.startswith("cuda"):
        count = len(bench_muon.candidates())
    elif args.muon:  # its rows, and with --world the sharded ones and one process's
        count = len(bench_muon.candidates()) if args.world == 1 else 1 + len(
            bench_fsdp.candidates("muon", args.replicas))
    elif args.world > 1:
        count = len(bench_fsdp.candidates())  # its rows, over all processes together
    elif args.device.startswith("cuda"):
        count = 2
    else:
        same, low = candidates()
        count = len(selected(list(same) + list(low), args.only))
    return BYTES_PER_PARAMETER * nparams * count


def _names(args: argparse.Namespace) -> List[str]:
    """The optimizers ``--only`` chooses from on ``args.device``."""
    if args.device.startswith("cuda"):
        return list(bench_gpu.candidates(getattr(torch, args.dtype)))
    same, low = candidates()
    return list(same) + list(low)


def selected(names, only):
    """The optimizers ``--only`` selects (all of them without it; a name matches whatever its
    case, as ``--optimizer`` does); the fused AdamW baseline always runs."""
    return [k for k in names
            if not only or k.startswith("torch.AdamW(fused") or any(_contains(k, o) for o in only)]


def _contains(name: str, part: str) -> bool:
    return part.casefold() in name.casefold()


def available_memory(device: str = "cpu"):
    """Bytes of memory available now on ``device`` (the host: Linux's MemAvailable), or None
    where unknown."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory(args: argparse.Namespace) -> None:
    """``--memory``: the measured table of :mod:`scaleopt.cli.bench_memory`, into ``--out``
    (and ``--json``)."""
    if args.world != 1 or args.muon:
        raise ValueError("--memory measures one process's training step: --world and --muon "
                         "do not apply")
    out = pathlib.Path(args.out if args.out is not None else new_folder(
        pathlib.Path("scaleopt-runs") / f"bench-memory-{args.memory}"))
    check_out(str(out), overwrite=args.overwrite)
    report = bench_memory.run(args.memory, args.device, args.threads or 2, args.only, out)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'memory.json'}")


def link(args: argparse.Namespace) -> None:
    """``--link``: the table of :mod:`scaleopt.cli.bench_links`, into ``--out`` (and
    ``--json``)."""
    if args.muon or args.device != "cpu" or args.only:
        raise ValueError("--link times a fixed set of data-parallel steps on the CPU: --muon, "
                         "--device and --only do not apply")
    world = 2 if args.world == 1 else args.world
    bench_links.check(args.link, world, args.per_node)
    out = pathlib.Path(args.out if args.out is not None else new_folder(
        pathlib.Path("scaleopt-runs") / f"bench-links-world{world}"))
    check_out(str(out), overwrite=args.overwrite)
    result = bench_links.run(args.link, world, args.per_node, args.rounds,
                             args.hidden or bench_links.HIDDEN, args.layers or bench_links.LAYERS,
                             args.threads or 1)
    text = json.dumps(result, indent=1)
    (out / "links.json").write_text(text)
    if args.json:
        pathlib.Path(args.json).write_text(text)
    plot = bench_links.write_plot(result, str(out / "links.png"))
    print(f"wrote {out / 'links.json'}" + (f" and {plot}" if plot else f" ({NO_PLOTS})"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.memory or args.link:
        try:
            memory(args) if args.memory else link(args)
        except ValueError as exc:
            ap.error(str(exc))
        return
    try:
        check_arguments(args)
    except ValueError as exc:
        ap.error(str(exc))
    run(args)


def run(args: argparse.Namespace) -> dict:
    """Time the candidates; print the table; return (and write, with --json) the results."""
    if args.muon:
        if args.world > 1:
            result = bench_muon.sharded(shapes_of(args), args.world, args.threads, args.rounds,
                                        repr(args.size), args.replicas)
        else:
            result = bench_muon.one_process(shapes_of(args), args.threads, args.rounds,
                                            repr(args.size), args.device)
        _write(result, args)
        return result
    if args.world > 1 or args.device.startswith("cuda"):
        result = (bench_fsdp.run(shapes_of(args), args.world, args.threads, args.rounds,
                                 repr(args.size)) if args.world > 1 else
                  bench_gpu.run(shapes_of(args), repr(args.size), args.dtype, args.device,
                                args.rounds, args.only or ()))
        _write(result, args)
        return result
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = shapes_of(args)
    nparams = sum(torch.Size(s).numel() for _, s in shapes)
    same, low = candidates()
    every = {k: (v, dtype) for k, v in same.items()}
    every.update({k: (v, torch.bfloat16) for k, v in low.items()})
    # DeepSpeed's CPU Adam leaves its threads busy for a while after a step: time it last in
    # each round, so the in-place reference (not an optimizer) comes right after it
    every = dict(sorted(every.items(), key=lambda kv: "deepspeed" in kv[0]))
    chosen = {k: every[k] for k in selected(list(every), args.only)}
    opts, held = {}, {}
    for name, (make, pdtype) in chosen.items():
        named = make_params(shapes, pdtype, args.device)
        opts[name] = (make(named), named)
        opts[name][0].step()  # warm-up: allocate state
        held[name] = held_bytes(*opts[name])
    ref_times: List[float] = []
    times = interleaved({name: opt.step for name, (opt, _) in opts.items()}, args.rounds,
                        args.device, after_round=lambda: ref_times.append(
                            bandwidth_reference(opts["torch.AdamW(fused=True)"][1])))
    base = statistics.median(times["torch.AdamW(fused=True)"])
    ref = statistics.median(ref_times)
    print(f"BERT-like '{args.size}' set: {nparams / 1e6:.1f}M parameters in {len(shapes)} tensors, "
          f"{args.dtype}; torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds, "
          f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else platform.machine()}")
    print(f"memory: about {memory_need(args) / 2**30:.1f} GiB for {len(opts)} optimizers, each "
          f"with its own parameters, gradients and state")
    print(f"in-place p += g over all tensors: {ref * 1e3:.1f} ms "
          f"({12 * nparams / ref / 1e9:.1f} GB/s at 12 bytes per parameter)")
    print(f"{'optimizer':44s} {'median ms':>10s} {'x fused AdamW':>14s} {'state B/param':>13s} "
          f"{'x fp32 row':>11s}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        paired = paired_ratio(ts, times["torch.AdamW(fused=True)"])
        row = {"optimizer": name, "median_s": med, "ratio": paired, "ratio_of_medians": med / base,
               "model_bytes_per_param": held[name][0] / nparams,
               "state_bytes_per_param": held[name][1] / nparams}
        fp32 = FP32_ROW.get(name) if args.dtype == "float32" else None
        if fp32 in times:
            row["fp32_row"], row["ratio_to_fp32"] = fp32, paired_ratio(ts, times[fp32])
        rows.append(row)
        vs_fp32 = f"{row['ratio_to_fp32']:11.2f}" if "ratio_to_fp32" in row else ""
        print(f"{name:44s} {med * 1e3:10.1f} {paired:14.2f} {row['state_bytes_per_param']:13.1f} "
              f"{vs_fp32}".rstrip())
    result = {"size": args.size, "params": nparams, "tensors": len(shapes), "dtype": args.dtype,
              "threads": args.threads, "device": args.device, "machine": platform.machine(),
              "torch": torch.__version__,
              "rounds": args.rounds, "bandwidth_reference_s": ref, "rows": rows,
              "memory_estimate_bytes": memory_need(args)}
    _write(result, args)
    return result


def _write(result: dict, args: argparse.Namespace) -> None:
    """``bench.json`` and ``bench.png`` (the ratios and bytes per parameter; where matplotlib is
    installed) in the run folder, and ``--json FILE`` if given."""
    paths = [pathlib.Path(args.out) / "bench.json"] + ([pathlib.Path(args.json)] if args.json else [])
    for path in paths:
        path.write_text(json.dumps(result, indent=2))
    plot = write_bench_plot(result, str(pathlib.Path(args.out) / "bench.png"))
    print(f"results: {', '.join(map(str, paths + ([plot] if plot else [])))}"
          f"{'' if plot else f' ({NO_PLOTS})'}")


if __name__ == "__main__":
    main()
