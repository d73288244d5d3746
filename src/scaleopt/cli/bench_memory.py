"""``scaleopt bench --memory``: the measured peak memory of a whole training step (forward,
backward, step), in bytes per parameter, for each optimizer and mode.

Each configuration runs in a process of its own, so that nothing one leaves behind counts
for the next. On the CPU the measure is the process's resident set (``VmRSS``) and its peak
(``VmHWM``, reset by writing ``5`` to ``/proc/self/clear_refs``), read from
``/proc/self/status``. Two things make it exact enough: glibc's mmap threshold is fixed at
128 KiB (``MALLOC_MMAP_THRESHOLD_=131072``, set for the child), so every tensor larger than
that is its own mapping, given back to the system when freed; and every code path runs first
on a model of the same kind and size, then freed (libraries loaded, thread pools and the
libraries' caches for its shapes made), so that what the measured steps add is the model's
and the optimizer's. The check of the method is the first row: the
model alone reads 4.00 bytes per float32 parameter (2.00 per bfloat16 one). On CUDA the
measure is ``torch.cuda.max_memory_allocated``.

For each configuration the table gives, per parameter: ``held`` (what lives between steps:
weights, optimizer state and masters; the gradients are freed by ``zero_grad``), the
gradients (after a backward), the step's peak (the highest point of forward, backward and
step, activations excluded: the activations of the same forward and backward, measured
apart on the model alone, are subtracted where the peak falls in the backward), and the
step's transients (that peak above held plus gradients). The models' largest tensor holds at
most 5% of the parameters (``matrices``: 24 matrices of 1024 x 1024 and their norms' scales;
``llama``: a llama-like stack of 12 layers of width 768 over bytes, 85M parameters, its
largest matrices 1.9% of them).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import platform
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

#: glibc's threshold above which an allocation is its own mapping (given back when freed)
MMAP_THRESHOLD = 131072
#: the models, by name: (width, layers) of the measured size and of the warm-up
MODELS = ("matrices", "llama")


# -- models ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x) * self.weight


class Matrices(nn.Module):
    """``layers`` square matrices of ``width``, each followed by a norm with a scale (a 1-D
    parameter, for the AdamW part of Muon)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.norms = nn.ModuleList(RMSNorm(width) for _ in range(layers))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = norm(torch.relu(layer(x)))
        return x.float().square().mean()

    def batch(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(4, self.width, generator=torch.Generator().manual_seed(1)).to(dtype)


class Llama(nn.Module):
    """A llama-like decoder: RMSNorm, attention (q, k, v, o) and a SwiGLU MLP per layer, over
    bytes: its token embedding (256 x width, tied to the head) is 0.2% of the parameters, so
    that no tensor dominates (a 32,000-token embedding would be a quarter)."""

    def __init__(self, width: int, layers: int, vocab: int = 256) -> None:
        super().__init__()
        hidden = (8 * width // 3 + 127) // 128 * 128
        self.embedding = nn.Parameter(torch.randn(vocab, width) * 0.02)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.attn_norm, block.mlp_norm = RMSNorm(width), RMSNorm(width)
            block.q, block.k, block.v, block.o = (nn.Linear(width, width, bias=False)
                                                  for _ in range(4))
            block.gate, block.up = (nn.Linear(width, hidden, bias=False) for _ in range(2))
            block.down = nn.Linear(hidden, width, bias=False)
            self.blocks.append(block)
        self.final_norm = RMSNorm(width)
        self.width, self.heads, self.vocab = width, max(1, width // 64), vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding[tokens].to(self.final_norm.weight.dtype)
        b, t, d = x.shape
        for blk in self.blocks:
            h = blk.attn_norm(x)
            q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for f in (blk.q, blk.k, blk.v))
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk.o(a.transpose(1, 2).reshape(b, t, d))
            h = blk.mlp_norm(x)
            x = x + blk.down(nn.functional.silu(blk.gate(h)) * blk.up(h))
        logits = self.final_norm(x) @ self.embedding.to(x.dtype).T
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())

    def batch(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, 16), generator=torch.Generator().manual_seed(1))


def build_model(kind: str, tiny: bool, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    if kind == "matrices":
        model = Matrices(64, 3) if tiny else Matrices(1024, 24)
    else:
        model = Llama(64, 2) if tiny else Llama(768, 12)
    return model.to(dtype)


# -- configurations --------------------------------------------------------------------------------


def configurations() -> Dict[str, Tuple[torch.dtype, Callable[[Any], Any], Dict[str, Any]]]:
    """name -> (parameter dtype, optimizer builder on ``named_parameters``, how it steps)."""
    import scaleopt

    f32, bf16 = torch.float32, torch.bfloat16
    inb = {"in_backward": True}
    c: Dict[str, Tuple[torch.dtype, Callable[[Any], Any], Dict[str, Any]]] = {
        "model alone (float32)": (f32, None, {}),
        "model alone (bfloat16)": (bf16, None, {}),
        "torch.AdamW(fused=True)": (f32, lambda n: torch.optim.AdamW(
            [p for _, p in n], lr=1e-3, fused=True), {}),
        "torch.AdamW(fused=True), bf16 params": (bf16, lambda n: torch.optim.AdamW(
            [p for _, p in n], lr=1e-3, fused=True), {}),
        "scaleopt.AdamW": (f32, lambda n: scaleopt.AdamW(n, lr=1e-3), {}),
        "scaleopt.LAMB": (f32, lambda n: scaleopt.LAMB(n, lr=1e-3), {}),
        "scaleopt.LANS": (f32, lambda n: scaleopt.LANS(n, lr=1e-3), {}),
        "scaleopt.Muon": (f32, lambda n: scaleopt.Muon(n, lr=0.02), {}),
        "scaleopt.Muon(state_dtype=int8)": (f32, lambda n: scaleopt.Muon(
            n, lr=0.02, state_dtype="int8"), {}),
        "scaleopt.Muon, bf16 params": (bf16, lambda n: scaleopt.Muon(n, lr=0.02), {}),
    }
    for name in ("AdamW", "LAMB", "LANS"):
        cls = getattr(scaleopt, name)
        for state in ("float32", "bfloat16", "int8"):
            c[f"scaleopt.{name}(master_weights, state_dtype={state}), bf16 params"] = (
                bf16, lambda n, cls=cls, state=state: cls(n, lr=1e-3, master_weights=True,
                                                          state_dtype=state), {})
    c["scaleopt.AdamW(master_weights, implementation=native), bf16 params"] = (
        bf16, lambda n: scaleopt.AdamW(n, lr=1e-3, master_weights=True, implementation="native"),
        {})
    c["scaleopt.Muon(master_weights, state_dtype=int8), bf16 params"] = (
        bf16, lambda n: scaleopt.Muon(n, lr=0.02, master_weights=True, state_dtype="int8"), {})
    c["scaleopt.offload(Muon, state_dtype=int8), bf16 params"] = (bf16, lambda n: scaleopt.offload(
        scaleopt.Muon, n, lr=0.02, state_dtype="int8"), {})
    c["scaleopt.offload(LAMB, state_dtype=int8), bf16 params"] = (bf16, lambda n: scaleopt.offload(
        scaleopt.LAMB, n, lr=1e-3, state_dtype="int8"), {})
    c["scaleopt.OffloadAdam(state_dtype=int8), bf16 params"] = (bf16, lambda n: scaleopt.OffloadAdam(
        n, lr=1e-3, state_dtype="int8"), {})
    try:  # a peer, where installed (a benchmark extra)
        from torchao.optim import AdamW8bit

        for dtype, tag in ((f32, ""), (bf16, ", bf16 params")):
            c[f"torchao.optim.AdamW8bit{tag}"] = (dtype, lambda n: AdamW8bit(
                [p for _, p in n], lr=1e-3), {})
    except ImportError:
        pass
    if hasattr(scaleopt, "step_in_backward"):
        for name in ("AdamW", "LAMB", "LANS"):
            cls = getattr(scaleopt, name)
            c[f"scaleopt.{name}(master_weights, state_dtype=int8), bf16 params, in backward"] = (
                bf16, lambda n, cls=cls: cls(n, lr=1e-3, master_weights=True,
                                             state_dtype="int8"), inb)
        c["scaleopt.Muon(master_weights, state_dtype=int8), bf16 params, in backward"] = (
            bf16, lambda n: scaleopt.Muon(n, lr=0.02, master_weights=True, state_dtype="int8"),
            inb)
        c["scaleopt.LAMB(master_weights, state_dtype=int8), bf16 params, in backward, exact "
          "clipping"] = (bf16, lambda n: scaleopt.LAMB(n, lr=1e-3, master_weights=True,
                                                      state_dtype="int8", max_grad_norm=1.0),
                         dict(inb, clip="exact"))
        c["scaleopt.offload(Muon, state_dtype=int8), bf16 params, in backward"] = (
            bf16, lambda n: scaleopt.offload(scaleopt.Muon, n, lr=0.02, state_dtype="int8"), inb)
        c["scaleopt.Muon, in backward"] = (f32, lambda n: scaleopt.Muon(n, lr=0.02), inb)
        c["scaleopt.Muon(state_dtype=int8), in backward"] = (f32, lambda n: scaleopt.Muon(
            n, lr=0.02, state_dtype="int8"), inb)
        c["scaleopt.LAMB, in backward, exact clipping"] = (f32, lambda n: scaleopt.LAMB(
            n, lr=1e-3, max_grad_norm=1.0), dict(inb, clip="exact"))
        c["scaleopt.offload(LAMB, state_dtype=int8), bf16 params, in backward"] = (
            bf16, lambda n: scaleopt.offload(scaleopt.LAMB, n, lr=1e-3, state_dtype="int8"), inb)
    return c


# -- one configuration, in its own process ---------------------------------------------------------


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class Meter:
    """The process's memory now and its peak since :meth:`reset` (host: resident set; CUDA:
    the caching allocator's allocated bytes)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def now(self) -> int:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return _status("VmRSS")

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status("VmHWM")


def _train_step(model: nn.Module, opt: Any, batch: torch.Tensor, stepper: Any,
                meter: Optional[Meter] = None) -> Dict[str, int]:
    """One step (forward, backward, step, ``zero_grad``); with ``meter``, the points measured."""
    out: Dict[str, int] = {}
    if meter is not None:
        meter.reset()
    if stepper is not None and stepper.clip == "exact":
        stepper.backward(lambda: model(batch))
    else:
        model(batch).backward()
    if meter is not None:
        out["backward_peak"], out["after_backward"] = meter.peak(), meter.now()
        meter.reset()
    if opt is not None and stepper is None:
        opt.step()
    if meter is not None:
        out["step_peak"] = meter.peak()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    return out


def _make(name: str, model_kind: str, tiny: bool, device: str) -> Tuple[nn.Module, Any, Any]:
    import scaleopt

    dtype, builder, how = configurations()[name]
    model = build_model(model_kind, tiny, dtype).to(device)
    opt = builder(list(model.named_parameters())) if builder is not None else None
    stepper = None
    if how.get("in_backward"):
        stepper = scaleopt.step_in_backward(opt, clip=how.get("clip"))
    return model, opt, stepper


def measure_one(name: str, model_kind: str, device: str) -> Dict[str, Any]:
    """The measured bytes of configuration ``name`` (run in a process of its own)."""
    meter = Meter(device)
    # warm-up: the same code on a model of the same size (the libraries' caches for its
    # shapes made: oneDNN's primitives, compiled kernels), then all of it freed
    model, opt, stepper = _make(name, model_kind, False, device)
    for _ in range(3):
        _train_step(model, opt, model.batch(next(model.parameters()).dtype).to(device), stepper)
    if stepper is not None:
        stepper.remove()
    del model, opt, stepper
    base = meter.now()
    model, opt, stepper = _make(name, model_kind, False, device)
    params = sum(p.numel() for p in model.parameters())
    made = meter.now()
    batch = model.batch(next(model.parameters()).dtype).to(device)
    if opt is None:  # the model alone: its weights, its gradients and the activations
        model(batch).backward()
        grads = meter.now()
        meter.reset()
        model(batch).backward()  # into the gradients that exist: what it adds is activations
        peak = meter.peak()
        return dict(name=name, params=params, weights=made - base, grads=grads - made,
                    activations=peak - grads)
    for _ in range(2):  # the state made
        _train_step(model, opt, batch, stepper)
    held = meter.now()
    points = _train_step(model, opt, batch, stepper, meter)
    from scaleopt import state_bytes

    try:
        counted = state_bytes(opt).per_rank
    except RuntimeError:  # a peer's state of tensor subclasses: measured, not counted
        counted = None
    return dict(name=name, params=params, held=held - base, state_bytes=counted,
                after_backward=points["after_backward"] - base,
                backward_peak=points["backward_peak"] - base,
                step_peak=points["step_peak"] - base)


def child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    return env


def run_one(name: str, model_kind: str, device: str, threads: int) -> Dict[str, Any]:
    """:func:`measure_one` in a new process (with the allocator's settings)."""
    code = ("import json, sys, torch; torch.set_num_threads(int(sys.argv[4])); "
            "from scaleopt.cli.bench_memory import measure_one; "
            "print('RESULT ' + json.dumps(measure_one(sys.argv[1], sys.argv[2], sys.argv[3])))")
    done = subprocess.run([sys.executable, "-c", code, name, model_kind, device, str(threads)],
                          env=child_env(), capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"measuring {name!r} failed:\n{done.stderr[-3000:]}")


# -- the table --------------------------------------------------------------------------------------


def rows(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per configuration, bytes per parameter: held, gradients, the step's peak with the
    activations excluded, and its transients."""
    alone = {r["name"]: r for r in results if "activations" in r}
    out = []
    for r in results:
        if "failed" in r:
            out.append(dict(name=r["name"], failed=r["failed"]))
            continue
        n = r["params"]
        if "activations" in r:
            out.append(dict(name=r["name"], params=n, weights=r["weights"] / n,
                            grads=r["grads"] / n, activations=r["activations"] / n))
            continue
        act = max(a["activations"] for a in alone.values()) if alone else 0
        held, after = r["held"] / n, r["after_backward"] / n
        peak = max(r["step_peak"], r["backward_peak"] - act) / n
        out.append(dict(name=r["name"], params=n, held=held, grads=after - held, peak=peak,
                        transients=peak - after, state_bytes=None if r["state_bytes"] is None
                        else r["state_bytes"] / n))
    return out


def format_table(table: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lines = [f"peak memory of a training step, bytes per parameter ({meta['params']:,} "
             f"parameters, model {meta['model']}, {meta['measure']}, torch {meta['torch']}, "
             f"{meta['threads']} threads)",
             f"{'configuration':<72} {'held':>6} {'grads':>6} {'peak':>6} {'trans.':>6}"]
    for r in table:
        if "failed" in r:
            lines.append(f"{r['name']:<72} failed: {r['failed']}")
        elif "weights" in r:
            lines.append(f"{r['name']:<72} {r['weights']:>6.2f} {r['grads']:>6.2f}   "
                         f"(weights, gradients; activations {r['activations']:.2f})")
        else:
            lines.append(f"{r['name']:<72} {r['held']:>6.2f} {r['grads']:>6.2f} "
                         f"{r['peak']:>6.2f} {r['transients']:>6.2f}")
    return "\n".join(lines)


def run(model_kind: str = "matrices", device: str = "cpu", threads: int = 2,
        only: Optional[List[str]] = None, out: Optional[pathlib.Path] = None,
        echo: Callable[[str], None] = print) -> Dict[str, Any]:
    names = [n for n in configurations()
             if n.startswith("model alone") or not only or any(o in n for o in only)]
    results = []
    for name in names:
        try:
            results.append(run_one(name, model_kind, device, threads))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # reported, the others run
            if name.startswith("model alone"):
                raise
            results.append(dict(name=name, failed=str(exc).strip().splitlines()[-1][:200]))
        echo(f"  measured {name}")
    table = rows(results)
    meta = dict(model=model_kind, device=device, threads=threads, torch=torch.__version__,
                params=results[0]["params"], machine=platform.machine(),
                measure=("torch.cuda.max_memory_allocated" if device.startswith("cuda") else
                         f"VmHWM/VmRSS, MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"))
    echo(format_table(table, meta))
    report = dict(meta=meta, rows=table, raw=results)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps(report, indent=1))
    return report
