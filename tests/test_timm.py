"""timm as a client: LAMB, LANS, AdamW and Muon built on timm's layer-wise learning-rate decay
groups (``param_groups_layer_decay``: each group's ``lr_scale`` and its own weight decay), with
timm's cosine scheduler, which writes ``rate x lr_scale`` into each group at every step.

The job runs in a process of its own (tests/helpers/timm_job.py): with the timm installed
here, or else with timm 1.0.31 and torchvision 0.28.0 from ``.timm`` beside the checkout, where
.ci/run installs them (not into the venv: that torchvision is built for CUDA torch and, beside
torch's CPU build, breaks the HF Trainer's import).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "helpers" / "timm_job.py"


def timm_environment() -> dict:
    if importlib.util.find_spec("timm") is not None:
        return dict(os.environ)
    site = pathlib.Path(os.environ.get("SCALEOPT_TIMM_SITE", ROOT / ".timm"))
    if not (site / "timm").is_dir():
        pytest.skip("needs timm (with torchvision): .ci/run installs them in .timm")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.fixture(scope="module")
def runs() -> dict:
    job = subprocess.Popen([sys.executable, str(JOB)], env=timm_environment(), text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail("the timm job ran over 300 s")
    assert job.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["LAMB", "LANS", "AdamW", "Muon"])
def test_timms_layer_decay_reaches_each_groups_rate(runs, name):
    run = runs[name]
    scales = run["lr_scale"]
    # the decay is there: the deepest block's groups at 1.0, the embedding's at 0.75^7
    assert max(scales) == 1.0 and min(scales) == pytest.approx(0.75 ** 7)
    for rates, scheduled in zip(run["rates"], run["scheduled"]):
        assert len(rates) == len(scales) == len(scheduled)
        for rate, value, scale in zip(rates, scheduled, scales):
            assert rate == pytest.approx(value * scale, rel=1e-12)
    assert run["saved_lr_scale"] == scales  # kept in the state dict
    assert all(math.isfinite(x) for x in run["losses"])
    assert run["losses"][-1] < run["losses"][0], run["losses"]
