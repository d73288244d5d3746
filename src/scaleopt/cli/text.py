"""The ``text`` dataset and its model: real English text that ships with Python, and a small
GPT-2-style transformer that predicts it byte by byte.

The corpus is Python's own reference documentation as ``pydoc`` shows it (the module
``pydoc_data.topics``, in every CPython install, under the Python Software Foundation License):
about 0.45 MB of prose and code examples in UTF-8. Its bytes are the same on every run of the same
install; :func:`corpus` gives them with their identity (name, size, SHA-256), which a run records.
The first 90% of the bytes train; the last 10% (cut where the 90% falls, mid-topic) validate.
For a study that selects on one split and reports another, :func:`heldout` cuts the validation
bytes in two at the last topic boundary before their middle: a development part (which starts
mid-topic; about a quarter of them) and a test part of whole topics that no training window
touches.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any, Dict, Tuple

import torch
from torch import Tensor

#: the share of the corpus's bytes that trains (the rest, at the end, validates)
TRAIN_SHARE = 0.9
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


def splits() -> Tuple[Tensor, Tensor]:
    """The training and validation bytes, as int64 tensors."""
    text, _ = corpus()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * TRAIN_SHARE)
    return data[:cut], data[cut:]


def heldout() -> Tuple[Tensor, Tensor]:
    """The validation bytes in two: the development part (up to the last topic boundary
    before their middle) and the test part (whole topics from that boundary on)."""
    _, validation = splits()
    begin = len(corpus()[0]) - len(validation)
    starts = [s for s in _topic_starts() if s > begin]
    cut = max(s for s in starts if s <= begin + len(validation) // 2) - begin
    return validation[:cut], validation[cut:]


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


def load(train_size: int, context: int,
         split: str = "validation") -> Tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """``(x, y, x_test, y_test, classes)`` as :func:`scaleopt.cli.data.load` gives them:
    ``train_size`` training windows and the evaluation split ``split``: the whole validation
    bytes (``"validation"``), or :func:`heldout`'s ``"dev"`` or ``"test"`` part."""
    train, validation = splits()
    x, y = windows(train, train_size, context, seed=1)
    if split != "validation":
        validation = heldout()[split != "dev"]
    return (x, y) + tiled(validation, context) + (VOCAB,)


def unigram_bits_per_byte(split: str = "validation") -> float:
    """The baseline: bits per byte of an evaluation split (``"validation"``, or
    :func:`heldout`'s ``"dev"`` or ``"test"``) under the training split's byte frequencies
    (add-one smoothed), i.e. a model that ignores all context."""
    train, test = splits()
    if split != "validation":
        test = heldout()[split != "dev"]
    p = torch.bincount(train, minlength=VOCAB).double() + 1
    return float(-(p / p.sum()).log2()[test[1:]].mean())


def bits_per_byte(loss: float) -> float:
    """A cross-entropy in nats per byte, in bits per byte."""
    return loss / math.log(2)

