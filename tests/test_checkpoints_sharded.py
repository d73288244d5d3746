"""Sharded checkpoints: torch.distributed.checkpoint (DCP) of every optimizer's state on FSDP2,
resharded between world sizes, on real gloo process groups."""

from __future__ import annotations

import pytest
import torch

from scaleopt import _compact
import dcp_workers as D
import dgc_workers as W
import sharded_workers as S

# the one-process references run at the workers' thread count (conftest.as_workers)
pytestmark = pytest.mark.usefixtures("as_workers")
NAMES = list(S.OPTIMIZERS)  # every optimizer, option set and front-end of the sharded tests
EXACT = ["LAMB", "LANS(decay_moved_weight, bounds)", "LAMB(bf16, master_weights)", "OffloadAdam",
         "LAMB(int8 state)", "AdamW(bfloat16 state)", "LAMB(bf16, master_weights, int8 state)"]


def _rank0(results):
    (out,) = [r for r in results if r is not None]
    return out


@pytest.mark.slow
def test_saved_at_two_ranks_resumed_at_three_continues_the_run(tmp_path):
    keys = W.run_workers(D.save_after, 2, tmp_path / "save", NAMES, 2, str(tmp_path / "ck"),
                         timeout=240)[0]
    # split masters are saved as float32 masters
    assert "master_param" in keys["LAMB(bf16, master_weights)"]
    assert not any("master_lo" in k for k in keys.values())
    # each rank wrote its own shards: the host state of the offloaded optimizers was not gathered
    for name in ("OffloadAdam", "offload(LAMB)", "mindspore.AdamOffload"):
        files = sorted((tmp_path / "ck" / D.folder(name)).glob("*.distcp"))
        sizes = [f.stat().st_size for f in files]
        assert len(files) == 2 and max(sizes) < 0.7 * sum(sizes), (name, sizes)
    got = _rank0(W.run_workers(D.resume_from, 3, tmp_path / "load", NAMES, 2, 2,
                               str(tmp_path / "ck"), timeout=240))
    for name in NAMES:
        _close(got[name]["params"], name, 4)


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


def _close(got, name, steps):
    S.assert_same_run(got, S.train_reference(name, steps)[0], name)


def _one_process(name, first, steps, full=None):
    """``name`` in this process (no process group) on the full tensors, from ``full`` (a full
    model and optimizer state dict) if given: the model, the optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model = S.model_of(name)
    opt = S.OPTIMIZERS[name](list(model.named_parameters()))
    if full is not None:
        set_model_state_dict(model, full[0])
        set_optimizer_state_dict(model, opt, full[1])
    for t in range(first, first + steps):
        opt.zero_grad()
        S.backward(model, t)
        opt.step()
    return model, opt


@pytest.mark.slow  # every optimizer's full state dict (the same size resume stays)
def test_a_full_state_dict_of_a_sharded_run_resumes_in_one_process(tmp_path):
    full = _rank0(W.run_workers(D.save_full_after, 2, tmp_path, NAMES, 2, timeout=240))
    for name in NAMES:
        msd, osd = full[name]
        # full tensors, keyed by parameter name, with the split masters as float32 masters
        assert set(osd["state"]) == set(msd) == {n for n, _ in S.model_of(name).named_parameters()}
        for n, st in osd["state"].items():
            for k, v in st.items():
                if k != "step":  # int8 scales: one per block of each row
                    shape = (_compact.grid(msd[n].shape) if k.endswith("_scale")
                             else msd[n].shape)
                    assert type(v) is torch.Tensor and v.shape == shape, (name, n, k)
        model, _ = _one_process(name, 2, 2, full[name])
        _close(list(model.parameters()), name, 4)


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_in_a_sharded_run(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    full = {}
    for name in NAMES:
        model, opt = _one_process(name, 0, 2)
        full[name] = (get_model_state_dict(model), get_optimizer_state_dict(model, opt))
    torch.save(full, tmp_path / "full.pt")
    got = _rank0(W.run_workers(D.resume_from_full, 3, tmp_path / "load", NAMES, 2, 2,
                               str(tmp_path / "full.pt"), timeout=240))
    for name in NAMES:
        _close(got[name]["params"], name, 4)
