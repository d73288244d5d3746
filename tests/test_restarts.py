"""A run survives a dead worker: `scaleopt train --workers N` (and a `torchrun --max-restarts`
launch) whose worker is killed by its process id at a random step starts its workers again
from the newest checkpoint that verifies, ends with the numbers of a run that never failed,
and says that it restarted, from which step and how much work it did again; a worker that dies
again and again ends the run with a clear message after --max-restarts. Every process ends by
its own id."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from scaleopt.cli import main
from scaleopt.cli.launch import free_port

#: kills workers and torchrun launches: the slow run (pytest -m slow)
pytestmark = pytest.mark.slow

RUN = ["--workers", "2", "--shard", "--steps", "60", "--checkpoint-every", "10",
       "--train-size", "8192", "--batch-size", "256", "--width", "64", "--no-progress",
       "--threads", "1"]
DEADLINE_S = 240


def _numbers(result):
    """A run's history without its times."""
    return [{k: v for k, v in h.items() if k != "time_s"} for h in result["history"]]


@pytest.fixture(scope="module")
def never_failed(tmp_path_factory):
    """The same run, never interrupted."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(["train", *RUN, "--out", str(out)]) == 0
    return json.loads((out / "result.json").read_text())


def _json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _latest(run):
    try:
        return int((run / "checkpoints" / "latest").read_text().strip().split("-")[1])
    except (OSError, ValueError, IndexError):
        return -1


def _start(argv, run):
    return subprocess.Popen(argv + ["--out", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _kill_worker(proc, run, restart, after_checkpoint, rng):
    """Kill worker 1 of the workers' start number ``restart`` (SIGKILL, by the process id
    the run folder names) once the checkpoint of ``after_checkpoint`` is written, a random
    moment later; its process id."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before a worker could be killed"
        info = _json(run / "workers.json")
        if info and info["restart"] == restart and _latest(run) >= after_checkpoint:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the run did not reach its checkpoint in time")
    time.sleep(rng.uniform(0.0, 0.15))
    os.kill(info["pids"][1], signal.SIGKILL)
    return info["pids"]


def _finish(proc):
    """The run's exit status and output; a run that outlives the deadline is killed (its whole
    process group, by id) and fails the test."""
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run did not end in time; its output:\n{out[-2000:]}\n{err[-6000:]}")
    return proc.returncode, out, err


def _gone(pids):
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_it_never_died(tmp_path,
                                                                           never_failed):
    rng = random.Random()
    checkpoint = rng.choice([10, 20, 30])
    run = tmp_path / "run"
    proc = _start([sys.executable, "-m", "scaleopt", "train", *RUN], run)
    pids = _kill_worker(proc, run, 0, checkpoint, rng)
    code, out, err = _finish(proc)
    assert code == 0, err[-3000:]
    result = json.loads((run / "result.json").read_text())
    [restart] = result["restarts"]
    died = f"worker 1 (pid {pids[1]}) was killed by SIGKILL"
    assert restart["cause"] == died and restart["at_step"] >= checkpoint, (checkpoint, restart)
    assert restart["from_step"] == 10 * (restart["at_step"] // 10), restart
    assert restart["redone_steps"] == restart["at_step"] - restart["from_step"]
    assert result["redone_steps"] == restart["redone_steps"] and result["resumed_at"] is None
    assert f"{died} at step {restart['at_step']}; restarting the 2 workers" in err
    assert f"restart 1: {died} at step {restart['at_step']}; resumed from step" in out
    assert result["complete"] and result["steps"] == 60
    assert _numbers(result) == _numbers(never_failed)  # the same numbers, to the last bit
    assert result["test_accuracy"] == never_failed["test_accuracy"]
    assert _gone(pids) and not (run / "workers.json").exists()


def test_a_worker_that_dies_again_and_again_ends_the_run_after_the_limit(tmp_path):
    rng = random.Random()
    run = tmp_path / "run"
    proc = _start([sys.executable, "-m", "scaleopt", "train", *RUN, "--max-restarts", "1"], run)
    first = _kill_worker(proc, run, 0, 10, rng)
    second = _kill_worker(proc, run, 1, 10, rng)
    code, out, err = _finish(proc)
    assert code == 1, err[-3000:]
    assert "restarting the 2 workers from the checkpoint of step" in err
    assert (f"worker 1 (pid {second[1]}) was killed by SIGKILL at step" in err
            and "after 1 restart (--max-restarts 1): the run ends here; continue it with "
                f"--resume {run}" in err), err[-3000:]
    assert "Traceback" not in err and not (run / "result.json").exists()
    assert _gone(first + second)


def test_a_torchrun_launch_restarted_by_torchrun_resumes_from_its_run_folder(tmp_path,
                                                                             never_failed):
    port = free_port()
    rng = random.Random()
    run = tmp_path / "run"
    # (torchrun's store outlives the workers it restarts: the restarted group must not read
    # the first group's addresses from it, launch.init_torchrun_group)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "scaleopt", "train", *[a for a in RUN if a not in ("--workers", "2")]]
    proc = _start(torchrun, run)
    pids = _kill_worker(proc, run, 0, rng.choice([10, 20]), rng)
    code, out, err = _finish(proc)
    assert code == 0, err[-3000:]
    assert f"restart 1 by torchrun: resuming the run in {run}" in err
    result = json.loads((run / "result.json").read_text())
    assert result["torchrun_restarts"] == 1 and result["resumed_at"] in (10, 20, 30, 40, 50)
    assert result["complete"] and _numbers(result) == _numbers(never_failed)
    assert _gone(pids)
