"""Muon's step as a share of a training step: a forward and backward of a model with the sizes
of ``scaleopt bench``'s BERT-like set, then the optimizer's step, timed round by round.

    python benchmarks/muon_share.py                       # 'small' set, 8 x 128 tokens, 2 threads
    python benchmarks/muon_share.py --batch 32 --rounds 5

The model: word and position embeddings (hidden 512, vocabulary 30522), 4 pre-norm Transformer
encoder layers (8 heads, feed-forward 2048), a final norm and an output layer tied to the word
embeddings; a masked-LM-like loss on random tokens. Muon takes the layers' matrices (the
attention's packed input projection, its output, the feed-forward's two), AdamW the
embeddings, norms and biases, as ``scaleopt bench --muon`` does; ``torch.optim.AdamW(fused=True)``
on the same model is the baseline. The share is the optimizer's median step over the median
forward-backward plus that step.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import scaleopt
from scaleopt.benchmarking import SIZES, interleaved
from scaleopt.cli import options


class Encoder(nn.Module):
    def __init__(self, hidden: int, layers: int, vocab: int, inter: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(512, hidden)
        layer = nn.TransformerEncoderLayer(hidden, hidden // 64, inter, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        return self.norm(self.encoder(x)) @ self.embed.weight.T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_size(ap, SIZES, default="small", help="the model's sizes (default: small)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: 128)")
    options.add_threads(ap, "intra-op threads (default: 2)", default=2)
    options.add_rounds(ap, 5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden, layers, vocab, inter = SIZES[args.size]
    model = Encoder(hidden, layers, vocab, inter)
    named = list(model.named_parameters())
    optimizers = {
        "torch.AdamW(fused=True)": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
        "scaleopt.Muon": scaleopt.Muon(named, lr=0.02, adamw_lr=1e-4,
                                       exclude_from_muon=r"embed|position"),
    }
    tokens = torch.randint(0, vocab, (args.batch, args.seq))
    targets = torch.randint(0, vocab, (args.batch, args.seq))

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()

    forward_backward()
    for opt in optimizers.values():
        opt.step()  # the state made
    times = interleaved({"forward-backward": forward_backward,
                         **{name: opt.step for name, opt in optimizers.items()}}, args.rounds)
    fb = statistics.median(times["forward-backward"])
    params = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for g in optimizers["scaleopt.Muon"].param_groups
                   if g["algorithm"] == "muon" for p in g["params"])
    print(f"{args.size} sizes: {params / 1e6:.1f}M parameters ({matrices / 1e6:.1f}M in Muon's "
          f"matrices), {args.batch} x {args.seq} tokens, {args.threads} threads, torch "
          f"{torch.__version__}, {args.rounds} rounds")
    print(f"forward-backward: {fb * 1e3:.1f} ms (median)")
    for name in optimizers:
        step = statistics.median(times[name])
        print(f"{name:24s} step {step * 1e3:8.1f} ms: {100 * step / (fb + step):5.1f}% of a "
              f"training step, {step / fb:.2f}x the forward-backward")


if __name__ == "__main__":
    main()
