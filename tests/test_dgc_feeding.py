"""The DGC hook at momentum 0 as gradient compression for any optimizer: top-k with error
feedback over DDP, feeding AdamW, LAMB, LANS and Muon (real gloo process groups)."""

from __future__ import annotations

import pytest
import torch

import dgc_workers as W

pytestmark = pytest.mark.usefixtures("as_workers")


def _nothing_lost(got):
    """On every rank, what the optimizer was given over the steps plus the ranks' mean
    residual is the sum of the dense mean gradients."""
    for rank in got:
        for p in range(len(rank["params"])):
            given = sum(step[p] for step in rank["given"])
            dense = sum(step[p] for step in rank["dense"])
            torch.testing.assert_close(given + rank["residual"][p], dense, rtol=1e-5,
                                       atol=1e-6)


@pytest.mark.parametrize("optimizer", ["AdamW", pytest.param("LAMB", marks=pytest.mark.slow),
                                       pytest.param("LANS", marks=pytest.mark.slow), "Muon"])
def test_what_the_optimizer_is_given_plus_what_is_kept_is_the_mean_gradient(optimizer,
                                                                         tmp_path):
    """At 99% sparsity each optimizer is given the ranks' mean of the selected accumulated
    entries: over the steps, what it was given plus the ranks' mean residual is the sum of
    the dense mean gradients (nothing is lost, only delayed), every rank is given the same,
    and the ranks send over 20x fewer bytes than a dense all-reduce."""
    got = W.run_workers(W.hook_feeding, 2, tmp_path, optimizer, 0.99, timeout=120)
    _nothing_lost(got)
    for rank in got:
        assert any((step[0] == 0).float().mean() > 0.9 for step in rank["given"])
        assert rank["telemetry"]["bytes_sent"] * 20 < rank["telemetry"]["dense_bytes"]
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)


def test_int8_values_lose_nothing_either(tmp_path):
    """Values sent in 8 bits: their rounding error stays in the residuals, so what AdamW was
    given plus the ranks' mean residual is still the sum of the dense mean gradients, at
    about 1 + 4 bytes per sent pair."""
    got = W.run_workers(W.hook_feeding, 2, tmp_path, "AdamW", 0.99, 4, torch.int8,
                        timeout=120)
    _nothing_lost(got)
    for rank in got:
        tel = rank["telemetry"]
        assert tel["bytes_sent"] < tel["selected"] * 6  # float32 values: 8 per pair
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["AdamW", pytest.param("Muon", marks=pytest.mark.slow)])
def test_at_no_sparsity_the_optimizer_trains_as_over_ddps_own_all_reduce(optimizer, tmp_path):
    """At sparsity 0 the hook sends every entry (dense): the optimizer's run is the one over
    DDP's all-reduce."""
    sparse = W.run_workers(W.hook_feeding, 2, tmp_path / "hook", optimizer, 0.0, timeout=120)
    dense = W.run_workers(W.dense_feeding, 2, tmp_path / "ddp", optimizer, timeout=120)
    for a, b in zip(sparse[0]["params"], dense[0]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
