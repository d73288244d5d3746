"""The built-in data: generated on the fly, the same on every run, nothing downloaded."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

#: dataset name -> description (for --help)
DATASETS = {
    "spirals": "points on 5 interleaved noisy spiral arms in the plane, 5 classes (default)",
    "spirals2": "the classic two-spiral problem, 2 classes",
    "topics": "bags of 32 words from a 32,768-word vocabulary, 5 classes told apart by a few "
              "topic words; an embedding-bag model, whose parameters sit in one large table",
    "text": "Python's reference documentation (0.45 MB of real English text, shipped with "
            "Python), byte by byte: the gpt model predicts each next byte",
    "stdlib": "Python's standard library: its modules' sources and the reference documentation "
              "(about 12.5 MB, shipped with Python), byte by byte, for the gpt model",
}
#: the datasets of bytes (the gpt model's)
TEXTS = ("text", "stdlib")

#: model name -> description (for --help); each dataset has one model
MODELS = {
    "mlp": "the MLP (spirals), or an embedding bag (topics)",
    "gpt": "a byte-level GPT-2-style transformer (pre-LN blocks: attention and MLP), on text",
}


def model_of(dataset: str) -> str:
    """The model that trains on ``dataset``."""
    return "gpt" if dataset in TEXTS else "mlp"


def corpus_of(dataset: str):
    """The module that holds a text dataset's corpus and splits (:mod:`.text` or
    :mod:`.sources`, with the same functions)."""
    from . import sources, text

    return sources if dataset == "stdlib" else text

#: the ``topics`` data: vocabulary, words per document, classes, topic words per class and the
#: share of a document's words drawn from its class's topic words (the rest: Zipf background)
TOPICS = dict(vocab=32768, length=32, classes=5, topic_words=256, share=0.06)


def spirals(n: int, seed: int, arms: int = 5, turns: float = 1.5,
            noise: float = 0.02) -> Tuple[Tensor, Tensor]:
    """``n`` points on ``arms`` interleaved spiral arms of ``turns`` turns, Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(n, generator=g)
    label = torch.randint(0, arms, (n,), generator=g)
    angle = r * turns * 2 * math.pi + label * (2 * math.pi / arms)
    xy = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], 1)
    return xy + noise * torch.randn(n, 2, generator=g), label


def topics(n: int, seed: int, vocab: int, length: int, classes: int, topic_words: int,
           share: float) -> Tuple[Tensor, Tensor]:
    """``n`` documents of ``length`` word ids: each word is, with probability ``share``, one of
    its class's ``topic_words`` (the same sets for every seed), else a word drawn from a Zipf
    distribution over the whole vocabulary. A document without topic words cannot be told apart,
    which caps the attainable accuracy (about 0.89 with the defaults)."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    words = perm[:classes * topic_words].view(classes, topic_words)
    rest = perm[classes * topic_words:]  # the background words, most frequent first
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, classes, (n,), generator=g)
    zipf = 1.0 / torch.arange(1, len(rest) + 1, dtype=torch.float64)
    background = rest[torch.multinomial(zipf, n * length, replacement=True, generator=g)]
    background = background.view(n, length)
    topic = words[label.unsqueeze(1), torch.randint(0, topic_words, (n, length), generator=g)]
    pick = torch.rand(n, length, generator=g) < share
    return torch.where(pick, topic, background), label


def load(name: str, train_size: int, test_size: int = 16384, context: int = 64,
         split: str = "validation", text_split: str = "topics"):
    """``(x_train, y_train, x_test, y_test, classes)`` of a built-in dataset, evaluated on
    ``split``: ``"validation"`` (text: the whole validation bytes; the generated datasets: the
    test set), or a study's ``"dev"`` split that selects and ``"test"`` split that reports
    (text: :func:`text.heldout`'s parts; the generated datasets: a set drawn from another seed,
    and the test set). ``text_split``: the text's split (:data:`.text.SPLITS`)."""
    if name in TEXTS:
        return corpus_of(name).load(train_size, context, split, text_split)
    held_seed = 3 if split == "dev" else 2
    if name == "topics":
        x, y = topics(train_size, seed=1, **TOPICS)
        xt, yt = topics(test_size, seed=held_seed, **TOPICS)
        return x, y, xt, yt, TOPICS["classes"]
    if name == "spirals":
        kw = dict(arms=5, turns=1.5, noise=0.02)
    elif name == "spirals2":
        kw = dict(arms=2, turns=2.5, noise=0.03)
    else:
        raise ValueError(f"unknown dataset {name!r} (choose one of {sorted(DATASETS)})")
    x, y = spirals(train_size, seed=1, **kw)
    xt, yt = spirals(test_size, seed=held_seed, **kw)
    return x, y, xt, yt, kw["arms"]

