"""Sharded checkpoints: torch.distributed.checkpoint (DCP) of every optimizer's state on FSDP2,
resharded between world sizes, on real gloo process groups."""

from __future__ import annotations

import torch

import dcp_workers as D
import dgc_workers as W
import sharded_workers as S

NAMES = ["LAMB", "LANS(decay_moved_weight, bounds)", "LAMB(bf16, master_weights)",
         "OffloadAdam", "offload(LAMB)", "AdamW", "Momentum", "paddle.Lamb", "mxnet.LANS",
         "keras.Lamb", "mindspore.AdamOffload"]
EXACT = ["LAMB", "LANS(decay_moved_weight, bounds)", "LAMB(bf16, master_weights)", "OffloadAdam"]


def _rank0(results):
    (out,) = [r for r in results if r is not None]
    return out


def test_saved_at_two_ranks_resumed_at_three_continues_the_run(tmp_path):
    keys = W.run_workers(D.save_after, 2, tmp_path / "save", NAMES, 2, str(tmp_path / "ck"),
                         timeout=240)[0]
    # split masters are saved as float32 masters
    assert "master_param" in keys["LAMB(bf16, master_weights)"]
    assert not any("master_lo" in k for k in keys.values())
    got = _rank0(W.run_workers(D.resume_from, 3, tmp_path / "load", NAMES, 2, 2,
                               str(tmp_path / "ck"), timeout=240))
    for name in NAMES:
        want, _ = S.train_reference(name, 4)
        rtol, atol = (1e-2, 1e-2) if "bf16" in name else (1e-5, 1e-6)
        for a, b in zip(got[name]["params"], want):
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)


def test_saved_and_resumed_at_the_same_size_is_bit_identical(tmp_path):
    W.run_workers(D.save_after, 2, tmp_path / "save", EXACT, 2, str(tmp_path / "ck"),
                  timeout=240)
    resumed = _rank0(W.run_workers(D.resume_from, 2, tmp_path / "load", EXACT, 2, 2,
                                   str(tmp_path / "ck"), timeout=240))
    straight = _rank0(W.run_workers(D.straight, 2, tmp_path / "straight", EXACT, 4,
                                    timeout=240))
    for name in EXACT:
        for a, b in zip(resumed[name]["params"], straight[name]["params"]):
            assert torch.equal(a, b), name
        for key, st in straight[name]["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(resumed[name]["optim"]["state"][key][k], v), (name, key, k)
