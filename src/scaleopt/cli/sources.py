"""The ``stdlib`` dataset: the larger corpus, Python's standard library as it ships with Python.

Its bytes are the sources of the standard library's modules (every ``*.py`` file under the
interpreter's ``stdlib`` directory, in path order, without the ``test``/``tests``/``idle_test``
folders and ``site-packages``), each preceded by a line naming its path, followed by Python's
reference documentation (the ``text`` dataset's topics): about 12.5 MB with Python 3.11,
under the Python Software Foundation License. The bytes depend on the Python release;
:func:`corpus` gives them with their identity (size, SHA-256, release), which a run records.

Held out are whole files, chosen in the order of their paths' SHA-256 (a fixed, content-blind
order), among files of at most :data:`MAX_FILE` bytes: the test part takes files until it holds
:data:`TEST_BYTES`, then the development part until :data:`DEV_BYTES`; everything else trains.
Source files repeat one another (licence headers, idioms, copied functions), so the held-out
text is then deduplicated against the training bytes: every line that a 64-byte window found in
the training bytes touches is removed from the held-out parts, until no 64-byte window of either
part occurs in the training bytes (:func:`_deduplicated`). The functions have
:mod:`.text`'s signatures (``kind`` is ignored: this corpus has one split).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from . import text
from .text import bits_per_byte  # noqa: F401  (the same interface as .text)

#: the held-out parts' sizes before deduplication, and the largest file that may be held out
TEST_BYTES, DEV_BYTES, MAX_FILE = 65_536, 32_768, 16_384
#: folders of the standard library that are not its modules
SKIPPED = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
WINDOW = text.WINDOW


@functools.lru_cache(maxsize=1)
def _files() -> List[Tuple[str, bytes]]:
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if not SKIPPED.intersection(rel.parts):
            out.append((rel.as_posix(), f.read_bytes()))
    if not out:
        raise ValueError(f"--dataset stdlib reads the standard library's sources, and {root} "
                         f"has none")
    return out


def _document(path: str, body: bytes) -> bytes:
    return f"# file: {path}\n".encode() + body


def held_files(files: List[Tuple[str, bytes]]) -> Dict[str, List[int]]:
    """The files held out, by index into ``files``: ``{"test": [...], "dev": [...]}``."""
    order = sorted(range(len(files)), key=lambda i: hashlib.sha256(files[i][0].encode()).digest())
    held: Dict[str, List[int]] = {"test": [], "dev": []}
    sizes = {"test": 0, "dev": 0}
    for i in (i for i in order if len(files[i][1]) <= MAX_FILE):
        name = "test" if sizes["test"] < TEST_BYTES else "dev" if sizes["dev"] < DEV_BYTES else None
        if name is None:
            break
        held[name].append(i)
        sizes[name] += len(files[i][1])
    return {k: sorted(v) for k, v in held.items()}


@functools.lru_cache(maxsize=1)
def _parts() -> Tuple[bytes, bytes, bytes, Dict[str, Any]]:
    """Training, development and test bytes, and the corpus's identity."""
    import platform

    files, docs, whole = _files(), text.corpus()[0], _whole()
    held = held_files(files)
    out = set(held["test"]) | set(held["dev"])
    train = b"\n".join(_document(*files[i]) for i in range(len(files)) if i not in out) + b"\n" + docs
    dev, test = (b"\n".join(_document(*files[i]) for i in held[k]) for k in ("dev", "test"))
    dev, test = _deduplicated(train, [dev, test])
    identity = {"name": "Python's standard library sources and reference documentation",
                "bytes": len(whole), "sha256": hashlib.sha256(whole).hexdigest(),
                "files": len(files), "python": platform.python_version()}
    return train, dev, test, identity


def window_hashes(data: bytes, n: int = WINDOW) -> Tensor:
    """A 64-bit polynomial hash of every ``n``-byte window of ``data`` (``n`` a power of two;
    equal windows, equal hashes; int64 arithmetic wraps), built by doubling the window."""
    h = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    if len(h) < n:
        return torch.zeros(0, dtype=torch.long)
    width, power = 1, 1_000_003
    while width < n:  # windows of 2w from windows of w: h[i] * P^w + h[i + w]
        h = h[:-width] * power + h[width:]
        width, power = 2 * width, power * power % (1 << 63)
    return h


def _deduplicated(train: bytes, parts: List[bytes]) -> List[bytes]:
    """``parts`` without every line that a window occurring in ``train`` touches, repeated until
    none occurs (removing a line can make a new window at the join)."""
    seen = torch.unique(window_hashes(train))  # sorted
    out = []
    for part in parts:
        while True:
            h = window_hashes(part)
            found = seen[torch.searchsorted(seen, h).clamp(max=len(seen) - 1)] == h
            starts = found.nonzero().flatten()
            if not len(starts):
                break
            t = torch.frombuffer(bytearray(part), dtype=torch.uint8)
            line = torch.cat([torch.zeros(1, dtype=torch.long), (t == 10).long().cumsum(0)[:-1]])
            touched = torch.zeros(len(part) + 1, dtype=torch.long)  # bytes under a hit window
            touched.index_add_(0, starts, torch.ones_like(starts))
            touched.index_add_(0, starts + WINDOW, -torch.ones_like(starts))
            dropped = set(line[touched.cumsum(0)[:len(part)] > 0].unique().tolist())
            part = b"\n".join(x for i, x in enumerate(part.split(b"\n")) if i not in dropped)
        out.append(part)
    return out


@functools.lru_cache(maxsize=1)
def _whole() -> bytes:
    return b"\n".join(_document(p, b) for p, b in _files()) + b"\n" + text.corpus()[0]


def corpus() -> Tuple[bytes, Dict[str, Any]]:
    """The whole corpus's bytes (before the split) and its identity."""
    return _whole(), dict(_parts()[3])


def splits(kind: str = "files") -> Tuple[Tensor, Tensor]:
    """The training bytes and the held-out bytes (development, a blank line, test)."""
    train, dev, test, _ = _parts()
    return text._tensor(train), text._tensor(dev + b"\n\n" + test)


def heldout(kind: str = "files") -> Tuple[Tensor, Tensor]:
    """The development part and the test part."""
    _, dev, test, _ = _parts()
    return text._tensor(dev), text._tensor(test)


def load(train_size: int, context: int, split: str = "validation",
         kind: str = "files") -> Tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """As :func:`.text.load`, on this corpus."""
    return text.loaded(splits(), heldout(), train_size, context, split)


def unigram_bits_per_byte(split: str = "validation", kind: str = "files") -> float:
    """As :func:`.text.unigram_bits_per_byte`, on this corpus."""
    return text.unigram(splits(), heldout(), split)
