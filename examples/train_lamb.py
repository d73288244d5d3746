"""Train a small MLP classifier with scaleopt.LAMB on generated data (no download).

    python examples/train_lamb.py [--steps 300] [--batch-size 1024]

The data are two noisy spirals of 2.5 turns interleaved in the plane: a non-linear task, generated
the same way on every run. Prints the loss as it trains and the final
test accuracy of LAMB next to torch.optim.AdamW on the same model and batches.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import scaleopt


def spirals(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 5 * math.pi + 0.5
    label = torch.randint(0, 2, (n,), generator=g)
    angle = t + label * math.pi
    xy = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], 1) / 10
    xy = xy + 0.03 * torch.randn(n, 2, generator=g)
    return xy, label


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(2, 256), nn.LayerNorm(256), nn.GELU(),
        nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(),
        nn.Linear(256, 2),
    )


def train(name: str, steps: int, batch_size: int, lr: float, seed: int = 0) -> float:
    x, y = spirals(20000, seed=1)
    xt, yt = spirals(4000, seed=2)
    model = make_model(seed)
    if name == "LAMB":
        opt = scaleopt.LAMB(scaleopt.param_groups(model, weight_decay=0.01), lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(x), (batch_size,), generator=g)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, steps // 5) == 0:
            print(f"  {name:6s} step {step:4d}  loss {loss.item():.4f}")
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    print(f"  {name:6s} test accuracy {acc:.3f}  ({time.perf_counter() - start:.1f}s)")
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"spirals, batch {args.batch_size}, {args.steps} steps, lr {args.lr}")
    lamb = train("LAMB", args.steps, args.batch_size, args.lr)
    adamw = train("AdamW", args.steps, args.batch_size, args.lr)
    print(f"test accuracy: LAMB {lamb:.3f}, torch AdamW {adamw:.3f}")


if __name__ == "__main__":
    main()
