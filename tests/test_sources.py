"""The larger corpus, ``--dataset stdlib``: Python's standard library sources and documentation,
whole files held out and deduplicated against the training bytes."""

import hashlib
import json
import platform

import pytest
import torch

from scaleopt.cli import data, main, sources, text


def _bytes(t):
    return bytes(t.tolist())


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_no_64_byte_window_of_the_held_out_parts_occurs_in_the_training_bytes():
    """Checked directly (every training window looked up among the held-out ones, no hashing),
    over the whole training bytes."""
    train, _ = sources.splits()
    dev, test = (_bytes(t) for t in sources.heldout())
    train = _bytes(train)
    held = {p[i:i + 64] for p in (dev, test) for i in range(len(p) - 63)}
    assert len(held) > 50_000
    assert not any(train[i:i + 64] in held for i in range(len(train) - 63))


@pytest.mark.slow
def test_the_held_out_parts_are_lines_of_whole_files_that_training_does_not_hold():
    files = sources._files()
    held = sources.held_files(files)
    train = _bytes(sources.splits()[0])
    text_of_train = train.decode("utf-8")
    raw = {}
    for name, part in zip(("dev", "test"), sources.heldout()):
        assert len(held[name]) >= 5  # several files, not one
        raw[name] = b"\n".join(sources._document(*files[i]) for i in held[name])
        lines = set(raw[name].decode("utf-8").split("\n"))
        assert set(_bytes(part).decode("utf-8").split("\n")) <= lines  # removed, none made up
        assert len(part) > 0.5 * len(raw[name])  # most of the held-out text stays
        for i in held[name]:
            path, body = files[i]
            assert len(body) <= sources.MAX_FILE
            assert f"# file: {path}\n" not in text_of_train
    assert not set(held["dev"]) & set(held["test"])
    # the held-out files as they are do repeat training text: what the deduplication is for
    seen = torch.unique(sources.window_hashes(train))
    h = sources.window_hashes(raw["test"])
    assert bool((seen[torch.searchsorted(seen, h).clamp(max=len(seen) - 1)] == h).any())


def test_the_corpus_is_the_standard_library_and_names_itself():
    whole, identity = sources.corpus()
    assert identity["bytes"] == len(whole) > 5_000_000
    assert identity["sha256"] == hashlib.sha256(whole).hexdigest()
    assert identity["python"] == platform.python_version()
    assert whole.endswith(text.corpus()[0])  # the documentation too
    assert b"# file: json/decoder.py\n" in whole and b"def " in whole
    train, validation = sources.splits()
    dev, test = sources.heldout()
    assert torch.equal(validation, torch.cat([dev, torch.tensor([10, 10]), test]))
    assert len(test) <= sources.TEST_BYTES + sources.MAX_FILE
    assert len(dev) <= sources.DEV_BYTES + sources.MAX_FILE
    if platform.python_version() == "3.11.7":  # the release docs/large_batch.md names
        assert (len(train), len(dev), len(test)) == (12_491_392, 31_029, 46_414)


def test_window_hashes_are_equal_for_equal_windows_and_tell_random_ones_apart():
    g = torch.Generator().manual_seed(0)
    block = bytes(torch.randint(0, 256, (5000,), generator=g, dtype=torch.uint8).tolist())
    h = sources.window_hashes(block + b"xyz" + block)
    n = len(block) - 63
    at = len(block) + 3  # where the second copy starts
    assert torch.equal(h[:n], h[at:at + n])  # the same windows, the same hashes
    assert len(torch.unique(h[:n])) == n  # different windows, different hashes
    assert len(sources.window_hashes(b"short")) == 0


@pytest.mark.slow
def test_a_gpt_run_on_the_stdlib_learns_and_records_its_corpus(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--model", "gpt", "--dataset", "stdlib", "--width", "32", "--layers",
                 "1", "--context", "16", "--train-size", "2048", "--batch-size", "32",
                 "--no-progress", "--threads", "1", "--optimizer", "adamw", "--lr", "0.01", "--out", str(out)]) == 0
    r = json.loads((out / "result.json").read_text())
    assert r["corpus"] == sources.corpus()[1]
    assert r["test_bits_per_byte"] < r["unigram_bits_per_byte"] == sources.unigram_bits_per_byte()
    assert data.model_of("stdlib") == "gpt"


def test_the_stdlib_has_one_split(capsys):
    from scaleopt.cli.options import EXIT_USAGE

    assert main(["train", "--dataset", "stdlib", "--text-split", "tail", "--no-progress"]) == EXIT_USAGE
    assert "--dataset stdlib has one split" in capsys.readouterr().err
