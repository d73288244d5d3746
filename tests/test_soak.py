"""A long run holds nothing per step: every optimizer of the registry, in one process and on
FSDP2 shards (2 gloo ranks), keeps exactly as many live tensors after 300 steps (50 on the
shards) as after its first ones (benchmarks/bench_soak.py measures the same over thousands of
steps, with the resident memory and the host time per step)."""

from __future__ import annotations

import os
import sys

import pytest

import dgc_workers as W
import sharded_workers as S
from registry import REGISTRY

#: 300-step runs of every registry entry, and a sharded one: the slow run (pytest -m slow)
pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench_soak  # noqa: E402


@pytest.fixture(autouse=True)
def _no_compiled_graphs_of_earlier_tests():
    """The soak counts every tensor alive in the process: the fake tensors of graphs that
    earlier tests compiled (the suite's compiled-step tests) are released by torch's caches at
    times of their own, which would count as the soak's; they go before it starts."""
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


@pytest.mark.parametrize("info", REGISTRY, ids=str)
def test_no_tensor_stays_alive_per_step_in_one_process(info):
    model = bench_soak.model_of()
    row = bench_soak.soak(info.make, model, bench_soak.mlp_backward(model), steps=300, warm=50)
    assert row["tensors_end"] == row["tensors_start"], (info.name, row)


def soak_sharded(rank, world, tmp, names, steps, warm):
    """Each sharded configuration's live tensors after ``warm`` steps and at the end (on every
    rank: each checks its own)."""
    out = {}
    for name in names:
        model = S.shard(S.model_of(name))

        def backward(t, model=model):
            S.backward(model, t, rank, world, sharded=True)

        row = bench_soak.soak(S.OPTIMIZERS[name], model, backward, steps, warm)
        out[name] = (row["tensors_start"], row["tensors_end"])
    return out


def test_no_tensor_stays_alive_per_step_on_fsdp2_shards(tmp_path):
    names = sorted(S.OPTIMIZERS)
    results = W.run_workers(soak_sharded, 2, tmp_path, names, 50, 20, timeout=1200)
    for rank, rows in enumerate(results):
        for name in names:
            start, end = rows[name]
            assert end == start, (rank, name, start, end)

