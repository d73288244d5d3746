"""The built-in models: the MLP (spirals), the embedding bag (topics) and the byte-level GPT
(text), made by one :func:`make_model`, and how a run shards them (FSDP2, HSDP's mesh)."""

from __future__ import annotations

import math
from typing import Any, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import data
from .text import VOCAB


def make_model(cfg: Any, inputs: int = 2, classes: int = 5) -> nn.Module:
    """The model a run's configuration ``cfg`` trains (a :class:`config.Config`: its model,
    dataset, width, layers, context and seed), on the CPU, initialised from ``cfg.seed``;
    ``inputs`` and ``classes``: the data's features and classes (the MLP's and the embedding
    bag's; the gpt model reads bytes)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "gpt":
        return GPT(cfg.width, cfg.layers, cfg.context)
    if cfg.dataset == "topics":
        return bag_of_words(data.TOPICS["vocab"], cfg.width, classes)
    return mlp(inputs, classes, cfg.width)


def mlp(inputs: int, classes: int, width: int = 256) -> nn.Module:
    """A small MLP: two hidden layers of ``width`` with LayerNorm and GELU."""
    return nn.Sequential(
        nn.Linear(inputs, width), nn.LayerNorm(width), nn.GELU(),
        nn.Linear(width, width), nn.LayerNorm(width), nn.GELU(),
        nn.Linear(width, classes),
    )


def bag_of_words(vocab: int, width: int, classes: int) -> nn.Module:
    """The sum of the words' ``width``-dimensional embeddings, then a linear layer."""
    bag = nn.EmbeddingBag(vocab, width, mode="sum")
    nn.init.normal_(bag.weight, std=0.02)
    return nn.Sequential(bag, nn.Linear(width, classes))


class Block(nn.Module):
    """A pre-LayerNorm decoder block: causal self-attention and a 4x GELU MLP, each added to
    the residual stream."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: Tensor) -> Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.out(F.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """A byte-level GPT-2-style language model: token and position embeddings, ``layers``
    pre-LN blocks of ``width`` (heads of 32 dimensions), a final LayerNorm and a separate
    linear head onto the 256 bytes. Outputs ``(batch, context, 256)`` logits."""

    def __init__(self, width: int, layers: int, context: int):
        super().__init__()
        if width % 32:
            raise ValueError(f"--width of the gpt model must be a multiple of 32 (heads of 32 "
                             f"dimensions), got {width}")
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, width // 32) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:  # GPT-2's initialisation; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))



def shard(model: nn.Module, mesh: Any = None) -> None:
    """FSDP2: each layer with parameters (the gpt model: each block), then the whole model,
    sharded over the world (or on ``mesh``: the 2-D mesh of HSDP, or its shard dimension)."""
    from torch.distributed.fsdp import fully_shard

    for m in getattr(model, "blocks", model):
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hsdp_mesh(replicas: int, world: int, device: torch.device) -> Any:
    """The (replicate, shard) mesh of ``--replicas`` (None for one replica). Ranks of a replica
    are consecutive: under torchrun, the processes of one node."""
    if replicas < 2:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def parallel(cfg: Any, model: nn.Module, world: int, device: torch.device) -> Tuple[Any, Any]:
    """What the step runs the batch through (DDP over several workers; DGCMomentum and FSDP2
    communicate themselves) and, for ``--dgc`` with an optimizer other than momentum, the DGC
    hook's state: DDP's all-reduce replaced by top-k with error feedback (the hook at momentum
    0), the optimizer stepping on what it returns."""
    from ..dgc import DGCHookState, ddp_comm_hook
    from .optimizers import dgc_options

    if world == 1 or cfg.shard or (cfg.dgc and cfg.optimizer == "momentum"):
        return model, None
    # PowerSGD's chained collectives in one bucket: with several, gloo may start them in
    # another order on each rank
    one_bucket = 1 + 4 * sum(p.numel() for p in model.parameters()) / 2 ** 20
    net = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        **({"bucket_cap_mb": one_bucket} if cfg.powersgd else {}))
    if cfg.powersgd:
        powersgd(net, cfg.powersgd)
    if not cfg.dgc:
        return net, None
    hook = DGCHookState(net, momentum=0.0, **dgc_options(cfg))
    net.register_comm_hook(hook, ddp_comm_hook)
    return net, hook



def powersgd(net: nn.Module, rank: int) -> None:
    """torch's PowerSGD hook on the DDP model ``net`` (``--powersgd RANK``): error feedback,
    warm start, compressing from the second step."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    net.register_comm_hook(hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                              start_powerSGD_iter=2), hook.powerSGD_hook)
