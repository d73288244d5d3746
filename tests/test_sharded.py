"""Sharded training: the optimizers on FSDP2 (DTensor) parameters, on real gloo process groups
(2 and 3 processes on 127.0.0.1, short timeouts), equal to one process on the full tensors."""

from __future__ import annotations

import pytest
import torch

import dgc_workers as W
import sharded_workers as S

NAMES = sorted(S.OPTIMIZERS)


@pytest.fixture(scope="module")
def references():
    return {name: S.train_reference(name, steps=4) for name in NAMES}


@pytest.mark.parametrize("world", [2, 3])
def test_every_optimizer_on_fsdp2_equals_one_process(world, references, tmp_path):
    # 63 rows over 2 and 3 ranks (uneven), a 2-element bias over 3 ranks (an empty shard)
    (got,) = [r for r in W.run_workers(S.train_sharded, world, tmp_path, NAMES, 4, timeout=180)
              if r is not None]
    for name in NAMES:
        for a, b in zip(got[name], references[name]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name, most", [("LAMB", 1), ("LANS", 2)])
def test_one_reduction_of_all_norms_per_step(name, most, tmp_path):
    counts = W.run_workers(S.count_collectives, 2, tmp_path, name, timeout=60)[0]
    for step in counts:
        assert sum(step.values()) <= most, step
