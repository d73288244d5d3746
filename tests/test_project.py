"""The project's promises about itself: CI runs the README's test command, the main job is `scaleopt`."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", quick, flags=re.S)


def test_quickstart_is_two_commands_and_ci_runs_the_test_one():
    cmds = readme_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "pytest" in cmds[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmds[1] in ci


def test_the_default_run_leaves_out_the_slow_tests_and_ci_runs_them_after_it():
    """The README's test command is the default run (``-m 'not slow'`` from pyproject.toml);
    .ci/run runs it and then the tests marked slow, so CI runs every test."""
    ini = (ROOT / "pyproject.toml").read_text().split("[tool.pytest.ini_options]", 1)[1]
    assert re.search(r"""^addopts = ".*-m 'not slow'.*"$""", ini, flags=re.M)
    assert re.search(r'^markers = \[\n\s+"slow: ', ini, flags=re.M)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("python -m pytest -q -m slow") > ci.index(readme_commands()[1])


#: the conditions under which .ci/run runs the tests marked bits once more (docs/robustness.md),
#: as its two runs set them: a thread count, an MKL path, one of torch's or scaleopt's kernels
RUNS = [["OMP_NUM_THREADS=3", "MKL_CBWR=COMPATIBLE", "SCALEOPT_AVX512=0"],
        ["OMP_NUM_THREADS=1", "MKL_ENABLE_INSTRUCTIONS=AVX2", "ATEN_CPU_CAPABILITY=default"]]
CONDITIONS = ["OMP_NUM_THREADS=1", "OMP_NUM_THREADS=3", "MKL_CBWR=COMPATIBLE",
              "MKL_ENABLE_INSTRUCTIONS=AVX2", "ATEN_CPU_CAPABILITY=default", "SCALEOPT_AVX512=0"]


def test_ci_runs_the_bit_tests_again_under_each_condition_the_docs_name():
    """After the default and the slow runs, .ci/run runs the tests marked ``bits`` again, in
    runs that together set every condition the docs' table of what equal bits assume names,
    each once, and never MKL's two paths (either replaces the other) in one run."""
    ci = (ROOT / ".ci" / "run").read_text()
    loop = ci.split("for conditions in ", 1)[1].split("; do", 1)
    runs = [r.split() for r in loop[0].replace("\\\n", " ").split('"')[1::2]]
    assert runs == RUNS
    assert sorted(c for run in runs for c in run) == sorted(CONDITIONS)
    assert all(sum(c.startswith("MKL_") for c in run) == 1 for run in runs)
    assert all(sum(c.startswith("OMP_NUM_THREADS=") for c in run) == 1 for run in runs)
    assert 'env $conditions python -m pytest -q -n 2 -p no:cacheprovider -m "bits and not slow"' \
        in loop[1].split("done", 1)[0]
    lines = ci.splitlines()
    assert ci.index("for conditions in ") > ci.index("python -m pytest -q -m slow")
    assert lines.index("python -m pytest -q -m slow") > lines.index(readme_commands()[1])
    robustness = (ROOT / "docs" / "robustness.md").read_text()
    assert all(f"`{c}`" in robustness for c in CONDITIONS)


@pytest.mark.slow  # (the default run keeps the quicker ones)
def test_the_bits_marker_falls_on_the_comparisons_of_bits():
    """The conftest marks a test ``bits`` by its name or its code: the sharded Muon test and
    the tests of the resumed runs are marked; the tests of bad arguments' errors are not."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "bits",
                          "tests/test_muon_sharded.py", "tests/test_validation.py",
                          "tests/test_checkpoints_sharded.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert any("test_sharded_muon_is_one_process_bit_for_bit" in i for i in ids), out.stdout
    assert any("test_saved_and_resumed_at_the_same_size_is_bit_identical" in i for i in ids)
    assert not any("test_validation.py" in i for i in ids)


def test_constraints_pin_torch():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_the_main_job_is_the_scaleopt_command():
    cmds = readme_commands()
    assert cmds[0].endswith("&& scaleopt train")


def test_importing_scaleopt_imports_no_compiler_and_no_command_dependencies():
    """``import scaleopt`` costs little over ``import torch``: torch._dynamo (about half a
    second) is imported at the first compiled-or-disabled call, as by torch.optim, the DTensor
    module (another half) only by whoever makes DTensors, and the command's plots only by the
    command."""
    code = ("import sys, scaleopt, scaleopt.compat.paddle, scaleopt.compat.mxnet, scaleopt.dgc; "
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', 'matplotlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_kernels_use_the_stable_abi_so_one_wheel_serves_every_python():
    from scaleopt import _native

    if not _native.available():
        pytest.skip("the C kernels are not built here (no C compiler at install)")
    import scaleopt._kernels

    assert scaleopt._kernels.__file__.endswith(".abi3.so")


@pytest.mark.slow
def test_the_sdist_carries_its_tests_and_they_run(tmp_path):
    """The source distribution holds the license, the tests with their helpers and golden
    cases, and the recipes they run; a test file runs from the unpacked sdist."""
    import tarfile

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "tree"
    for name in files:
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes((ROOT / name).read_bytes())
    for built in ("docs/_build/html/index.html", "docs/_build/_images/curves.png",
                  "src/scaleopt/_kernels.abi3.so", "src/scaleopt/__pycache__/lamb.cpython-311.pyc"):
        (tree / built).parent.mkdir(parents=True, exist_ok=True)  # as a work tree has them
        (tree / built).write_bytes(b"built")
    out = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
                          str(tmp_path / "dist"), str(tree)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("scaleopt-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path / "unpacked", filter="data")
    for needed in ("LICENSE", "constraints.txt", "src/scaleopt/csrc/kernels.c", "tests/conftest.py",
                   "tests/helpers/registry.py", "tests/helpers/oracle.py",
                   "tests/helpers/dgc_workers.py", "tests/helpers/sharded_workers.py", "docs/recipes/hf_trainer.py"):
        assert needed in names, needed
    assert any(n.startswith("tests/data/oracle/") for n in names)
    assert not [n for n in names if n.startswith("docs/_build") or n.endswith((".so", ".pyc"))]
    assert "tools/build_wheel.py" in names
    (root,) = (tmp_path / "unpacked").iterdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_oracle_lamb.py"], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert run.returncode == 0, run.stdout[-2000:]
    assert " passed" in run.stdout
