"""The examples in the docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

MODULES = [
    "scaleopt.lamb",
    "scaleopt.lans",
    "scaleopt.compat.mxnet",
    "scaleopt.adamw",
    "scaleopt.momentum",
    "scaleopt.groups",
    "scaleopt.compat.paddle",
    "scaleopt.compat.keras",
    "scaleopt.compat.tf1",
    "scaleopt.offload",
    "scaleopt.compat.mindspore",
    "scaleopt.dgc.optimizer",
    "scaleopt._info",
    "scaleopt.muon",
    "scaleopt.noise",
    "scaleopt._memory",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    import torch

    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0


@pytest.mark.parametrize("name", ["LAMB", "LANS", "AdamW", "Muon", "Momentum", "OffloadAdam",
                                  "DGCMomentum", "GradientNoiseScale"])
def test_docstrings_name_every_argument(name):
    import inspect

    import scaleopt

    cls = getattr(scaleopt, name)
    doc = cls.__doc__
    for arg in inspect.signature(cls.__init__).parameters:
        if arg not in ("self",):
            assert arg in doc, f"{name} docstring does not describe {arg}"


def _snippets():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    for page in sorted((root / "docs").glob("*.md")) + [root / "README.md"]:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        for i, code in enumerate(blocks):
            yield pytest.param(code, id=f"{page.name}-{i}")


OPTIONAL = ("transformers", "lightning", "accelerate", "torchtitan")


@pytest.mark.slow  # every code block in a fresh interpreter
@pytest.mark.parametrize("code", list(_snippets()))
def test_every_code_block_of_the_docs_runs(code, tmp_path):
    """Each Python block of docs/*.md and README.md, as written, in a fresh process (a
    one-process torch.distributed group where a block uses torch.distributed, as torchrun
    would set up; the others as a plain ``python`` run, where e.g. HF's Trainer starts no
    process group)."""
    import os
    import re
    import signal
    import subprocess
    import sys

    from scaleopt.cli.launch import free_port

    port = free_port()
    env = dict(os.environ)
    if "torch.distributed" in code:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                   LOCAL_RANK="0")
    command = [sys.executable, "-c", code]
    launch = re.match(r"# run: torchrun --nproc-per-node (\d+)\n", code)
    if launch:  # a block written for several processes runs as its first line says
        (tmp_path / "block.py").write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", launch.group(1), "block.py"]
        env = dict(os.environ)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:  # the block's processes (torchrun's workers too) end with it, whatever happens
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    missing = [m for m in OPTIONAL if f"No module named '{m}'" in stderr]
    if missing:
        pytest.skip(f"needs the {'torchtitan' if missing[0] == 'torchtitan' else 'frameworks'} "
                    f"extra ({missing[0]})")
    assert proc.returncode == 0, stderr[-3000:]


_PLACE = re.compile(r"`(src/scaleopt/[\w/]+\.(?:py|c|h)):(\d+)`\s+\(`(\w+)`\)")


def test_the_development_pages_places_name_their_lines():
    """docs/development.md walks a step through ``file:line`` (``name``) places: each line
    still defines ``name`` (a Python ``def``/``class``, a C function or macro), so the walk
    cannot drift from the code as it changes."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "development.md").read_text()
    places = _PLACE.findall(text)
    assert len(places) >= 20
    assert len(places) == len(re.findall(r"`src/scaleopt/[\w/]+\.(?:py|c|h):\d+`", text))
    wrong = []
    for path, line, name in places:
        text = (root / path).read_text().splitlines()[int(line) - 1]
        defined = (re.match(rf"\s*(def|class)\s+{name}\b", text) if path.endswith(".py")
                   else re.search(rf"(^#define\s+{name}\b|\b{name}\()", text))
        if not defined:
            wrong.append(f"{path}:{line} does not define {name}: {text.strip()!r}")
    assert not wrong, "\n".join(wrong)
