"""The ``text`` dataset and its model: real English text that ships with Python, and a small
GPT-2-style transformer that predicts it byte by byte.

The corpus is Python's own reference documentation as ``pydoc`` shows it (the module
``pydoc_data.topics``, in every CPython install, under the Python Software Foundation License):
about 0.45 MB of prose and code examples in UTF-8. Its bytes are the same on every run of the same
install; :func:`corpus` gives them with their identity (name, size, SHA-256), which a run records.

Its topics repeat one another (a topic on ``if`` is a part of the one on compound statements),
so held-out text is chosen by content, not by position (``"topics"``, the default split): topics
that share a 64-byte window are joined into one group, and whole groups are held out, so that
no 64-byte window of the held-out text occurs in the training bytes. Going through the groups
from the end of the topics' order, a group goes to the test part if it fits there within
:data:`TEST_SHARE` of the corpus's bytes, else to the development part if it fits within
:data:`DEV_SHARE`, else it trains; the training bytes keep the topics' order. The earlier split (``"tail"``)
cut the last 10% of the bytes off for validation and its tail (whole topics) for the test part;
its held-out parts share text with training, and it is kept only to repeat runs made on it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Dict, Tuple

import torch
from torch import Tensor

#: the share of the corpus's bytes that trains in the ``"tail"`` split (the rest, at the end,
#: validates)
TRAIN_SHARE = 0.9
#: the splits (:func:`splits`): whole groups of topics held out (the default), or the tail
SPLITS = ("topics", "tail")
#: the ``"topics"`` split: the window that groups topics, and the most of the bytes the test and
#: the development parts may hold
WINDOW, TEST_SHARE, DEV_SHARE = 64, 0.08, 0.04
#: tokens are bytes
VOCAB = 256


def corpus() -> Tuple[bytes, Dict[str, Any]]:
    """The corpus's bytes and its identity: ``{"name", "bytes", "sha256", "python"}`` (read
    and hashed once per process)."""
    text, identity = _corpus()
    return text, dict(identity)


@functools.lru_cache(maxsize=1)
def _corpus() -> Tuple[bytes, Dict[str, Any]]:
    import platform

    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its documentation topics
        raise ValueError("--dataset text reads Python's documentation topics "
                         "(pydoc_data.topics), which this Python does not have") from None
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return text, {"name": "pydoc_data.topics (Python's reference documentation)",
                  "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest(),
                  "python": platform.python_version()}


def _tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def splits(kind: str = "topics") -> Tuple[Tensor, Tensor]:
    """The training and validation bytes of split ``kind`` (:data:`SPLITS`), as int64
    tensors; the validation bytes are :func:`heldout`'s two parts, development then test."""
    if kind == "tail":
        data = _tensor(corpus()[0])
        cut = int(len(data) * TRAIN_SHARE)
        return data[:cut], data[cut:]
    train, dev, test = _topic_split()
    return _tensor(train), _tensor(dev + b"\n\n" + test)


def heldout(kind: str = "topics") -> Tuple[Tensor, Tensor]:
    """The held-out bytes in two: the development part and the test part. ``"topics"``: whole
    groups of topics (:func:`_topic_split`); ``"tail"``: the validation bytes cut at the last
    topic boundary before their middle (the development part starts mid-topic)."""
    if kind != "tail":
        _, dev, test = _topic_split()
        return _tensor(dev), _tensor(test)
    _, validation = splits("tail")
    begin = len(corpus()[0]) - len(validation)
    starts = [s for s in _topic_starts() if s > begin]
    cut = max(s for s in starts if s <= begin + len(validation) // 2) - begin
    return validation[:cut], validation[cut:]


@functools.lru_cache(maxsize=1)
def _topic_split() -> Tuple[bytes, bytes, bytes]:
    """The ``"topics"`` split's training, development and test bytes (each its topics joined
    by blank lines, in the topics' order)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    texts = [topics[k].encode("utf-8") for k in keys]
    group = list(range(len(keys)))

    def root(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    first: Dict[bytes, int] = {}
    for i, t in enumerate(texts):  # topics that share a window: one group
        for j in range(len(t) - WINDOW + 1):
            k = first.setdefault(t[j:j + WINDOW], i)
            if k != i:
                group[root(i)] = root(k)
    members: Dict[int, list] = {}
    for i in range(len(keys)):
        members.setdefault(root(i), []).append(i)
    total = sum(map(len, texts))
    parts: Dict[str, list] = {"test": [], "dev": []}
    for m in sorted(members.values(), key=min, reverse=True):
        size = sum(len(texts[i]) for i in m)
        for name, share in (("test", TEST_SHARE), ("dev", DEV_SHARE)):
            held = sum(len(texts[i]) for i in parts[name])
            if held + size <= share * total:
                parts[name] += m
                break
    out = {name: sorted(idx) for name, idx in parts.items()}
    held = set(out["test"]) | set(out["dev"])
    join = b"\n\n".join
    return (join(texts[i] for i in range(len(keys)) if i not in held),
            join(texts[i] for i in out["dev"]), join(texts[i] for i in out["test"]))


@functools.lru_cache(maxsize=1)
def _topic_starts() -> Tuple[int, ...]:
    """The byte offsets at which the corpus's topics begin."""
    from pydoc_data.topics import topics

    starts, at = [], 0
    for k in sorted(topics):
        starts.append(at)
        at += len(topics[k].encode("utf-8")) + 2  # the "\n\n" between topics
    return tuple(starts)


def windows(source: Tensor, n: int, context: int, seed: int) -> Tuple[Tensor, Tensor]:
    """``n`` windows of ``context + 1`` bytes at random offsets of ``source`` (the same for a
    seed): inputs ``(n, context)`` and next-byte targets ``(n, context)``."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, len(source) - context, (n,), generator=g)
    w = source[start.unsqueeze(1) + torch.arange(context + 1)]
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def tiled(source: Tensor, context: int) -> Tuple[Tensor, Tensor]:
    """``source`` cut into consecutive windows (each byte predicted once): the validation set."""
    n = (len(source) - 1) // context
    x = source[:n * context].view(n, context)
    y = source[1:n * context + 1].view(n, context)
    return x, y


def load(train_size: int, context: int, split: str = "validation",
         kind: str = "topics") -> Tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """``(x, y, x_test, y_test, classes)`` as :func:`scaleopt.cli.data.load` gives them:
    ``train_size`` training windows and the evaluation split ``split``: the whole validation
    bytes (``"validation"``), or :func:`heldout`'s ``"dev"`` or ``"test"`` part, of the split
    ``kind`` (:data:`SPLITS`)."""
    return loaded(splits(kind), heldout(kind), train_size, context, split)


def loaded(split_bytes: Tuple[Tensor, Tensor], held: Tuple[Tensor, Tensor], train_size: int,
           context: int, split: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """:func:`load` from a corpus's ``(train, validation)`` bytes and its ``(dev, test)``."""
    train, validation = split_bytes
    x, y = windows(train, train_size, context, seed=1)
    if split != "validation":
        validation = held[split != "dev"]
    return (x, y) + tiled(validation, context) + (VOCAB,)


def unigram_bits_per_byte(split: str = "validation", kind: str = "topics") -> float:
    """The baseline: bits per byte of an evaluation split (``"validation"``, or
    :func:`heldout`'s ``"dev"`` or ``"test"``) of the split ``kind`` under the training
    bytes' frequencies (add-one smoothed), i.e. a model that ignores all context."""
    return unigram(splits(kind), heldout(kind), split)


def unigram(split_bytes: Tuple[Tensor, Tensor], held: Tuple[Tensor, Tensor], split: str) -> float:
    """:func:`unigram_bits_per_byte` from a corpus's bytes, as :func:`loaded` takes them."""
    train, test = split_bytes
    if split != "validation":
        test = held[split != "dev"]
    p = torch.bincount(train, minlength=VOCAB).double() + 1
    return float(-(p / p.sum()).log2()[test[1:]].mean())


def bits_per_byte(loss: float) -> float:
    """A cross-entropy in nats per byte, in bits per byte."""
    return loss / math.log(2)

