"""Sharded training: the optimizers on FSDP2 (DTensor) parameters, on real gloo process groups
(2 and 3 processes on 127.0.0.1, short timeouts), equal to one process on the full tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import scaleopt
from scaleopt import _native
import dgc_workers as W
import sharded_workers as S

# the one-process references run at the workers' thread count (conftest.as_workers)
pytestmark = pytest.mark.usefixtures("as_workers")
NAMES = sorted(S.OPTIMIZERS)


@pytest.fixture(scope="module")
def references(as_workers):
    return {name: S.train_reference(name, steps=4) for name in NAMES}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_optimizer_on_fsdp2_equals_one_process(world, references, tmp_path):
    # 63 rows over 2 and 3 ranks (uneven), a 2-element bias over 3 ranks (an empty shard)
    (got,) = [r for r in W.run_workers(S.train_sharded, world, tmp_path, NAMES, 4, timeout=180)
              if r is not None]
    for name in NAMES:
        weights, masters, state = references[name]
        # bfloat16 weights (given gradients): the float32 masters agree to round-off
        S.assert_same_run(got[name], weights, name)
        S.assert_same_run(got[name + " masters"], masters, name.replace("bf16", "float32"))
        if "state)" in name:  # the same stored moments: the blocks never depend on the mesh
            _same_compact_state(got[name + " state"], state, name)
        if "bf16" in name and _native.available():  # split masters, shard by shard
            assert all(got[name + " split"]), name
            for st in got[name + " state dict"].values():  # saved as float32 masters
                assert "master_lo" not in st and st["master_param"].dtype == torch.float32


def _same_compact_state(got, want, name):
    """The first weight's moments stored compactly, as one process stores them: the same
    dtypes and scales, and the same codes but for the rare value on a rounding boundary."""
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = got[0][key], want[0][key]
        assert a.dtype == b.dtype and a.dtype in (torch.int8, torch.uint8, torch.bfloat16), name
        assert ((a.float() - b.float()).abs() > 0).float().mean() < 0.01, (name, key)
        if a.dtype != torch.bfloat16:
            assert got[0][key + "_scale"].shape == (63, 2)
            torch.testing.assert_close(got[0][key + "_scale"], want[0][key + "_scale"],
                                       rtol=1e-4, atol=1e-9, msg=name)
    for st in got[1:]:  # the bias, the norm's and the small weight: float32 on every mesh
        assert st["exp_avg"].dtype == torch.float32, name


@pytest.mark.parametrize("name, most", [("LAMB", 1), ("LANS", 2), ("LAMB(clipping)", 2),
                                        ("LANS(clipping)", 2), ("OffloadAdam", 1),
                                        pytest.param("LAMB(two groups)", 1, marks=pytest.mark.slow),
                                        pytest.param("LAMB(int8 state)", 1, marks=pytest.mark.slow),
                                        ("LANS(int8 state)", 2),
                                        ("LANS(two groups, clipping)", 2)])
def test_one_reduction_of_all_norms_per_step(name, most, tmp_path):
    """However many groups: the groups' sums at each point of the step travel together."""
    counts, kernels = W.run_workers(S.count_collectives, 2, tmp_path, name, timeout=60)[0]
    for step in counts:
        assert sum(step.values()) <= most, step
    if _native.available() and name.startswith(("LAMB", "LANS")) and name != "LAMB(clipping)":
        # the fused kernels on the local shards, the sums totalled between their two passes
        assert kernels == [(name[:4].lower(), True)]


SKIPPING = ["LAMB", "LANS(two groups, clipping)", "AdamW", "Momentum", "offload(LAMB)",
            "OffloadAdam"]


def test_skip_is_agreed_over_the_ranks_when_one_shard_holds_a_nan(tmp_path):
    """A NaN that only the last rank sees: under nonfinite="skip" every rank skips (a rank that
    stepped alone would leave the model half updated)."""
    (ranks,) = [r for r in W.run_workers(S.skip_on_one_rank, 2, tmp_path, SKIPPING, timeout=120)
                if r is not None]
    for rank in ranks:
        assert rank == {name: (True, 1) for name in SKIPPING}


def test_dgc_refuses_sharded_parameters_with_a_reason(tmp_path):
    messages = W.run_workers(S.dgc_refuses_sharded, 2, tmp_path, timeout=60)[0]
    assert all(m is not None and "DDP" in m and "sharded" in m for m in messages), messages


def _views():
    """Parameters the kernels must not address as one block, each with a contiguous twin."""
    base = torch.randn(6, 10)
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    return {
        "sliced with gaps": base[:, :4],
        "transposed": base.t(),
        "storage offset": base.view(-1)[7:37].view(5, 6),
        "channels_last": cl,
        "zero-size": torch.randn(0, 3),
    }


@pytest.mark.parametrize("kind", sorted(_views()))
@pytest.mark.parametrize("make", [
    lambda ps, **k: scaleopt.LAMB(ps, lr=1e-2, weight_decay=0.1, **k),
    lambda ps, **k: scaleopt.LANS(ps, lr=1e-2, **k),
    lambda ps, **k: scaleopt.AdamW(ps, lr=1e-2, **k),
    lambda ps, **k: scaleopt.OffloadAdam(ps, lr=1e-2) if not k else torch.optim.AdamW(
        ps, lr=1e-2, weight_decay=0.0, foreach=False),
], ids=["LAMB", "LANS", "AdamW", "OffloadAdam"])
def test_views_the_kernels_cannot_take_get_the_reference_numbers(kind, make):
    view = _views()[kind]
    storage = view._base if view._base is not None else view
    before = storage.clone()
    p = nn.Parameter(view)  # shares the view's memory: only its own elements may change
    q = nn.Parameter(view.detach().clone().contiguous())
    opt, ref = make([p]), make([q], foreach=False)
    for t in range(3):
        g = torch.randn(view.shape, generator=torch.Generator().manual_seed(t))
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    outside = torch.ones_like(storage, dtype=torch.bool)
    if view._base is not None:
        outside.view(-1)[[i for i in range(storage.numel())
                          if i in _element_offsets(view, storage)]] = False
        assert torch.equal(storage[outside], before[outside])  # nothing written outside


def _element_offsets(view, storage):
    idx = torch.arange(storage.numel()).view(storage.shape)
    return set(torch.as_strided(idx.view(-1), view.shape, view.stride(),
                                view.storage_offset() - storage.storage_offset()).flatten()
               .tolist())


HSDP = ["LAMB", "LANS(decay_moved_weight, bounds)", "LAMB(clipping)", "OffloadAdam"]


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_keeps_replicas_identical_and_equals_one_process(tmp_path):
    ranks = W.run_workers(S.train_hsdp, 4, tmp_path, HSDP, 3, timeout=240)
    for name in HSDP:
        for a, b in zip(ranks[0][name + " full"], S.train_reference(name, 3)[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        by_shard = {}
        for r in ranks:  # the replicas of one shard hold the same bits
            (_, shard_index) = r["coordinate"]
            first = by_shard.setdefault(shard_index, r[name])
            assert all(torch.equal(a, b) for a, b in zip(first, r[name])), name


@pytest.mark.parametrize("name", ["LAMB(bounds, always_adapt, decoupled)",
                                  "LANS(decay_moved_weight, bounds)", "LAMB(clipping)"])
def test_tensor_parallel_placements_and_plain_tensors_in_one_group(name, tmp_path):
    # Shard(1) splits each row's norm over the ranks, Replicate() holds it whole on each
    (got,) = [r for r in W.run_workers(S.train_tensor_parallel, 2, tmp_path, name, 3, timeout=60)
              if r is not None]
    for a, b in zip(got, S.train_given(name, (7, 10), 3)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["LAMB", "LANS", "OffloadAdam"])
def test_the_kernel_step_on_shards_allocates_nothing_the_size_of_the_model(name, tmp_path):
    allocated, shard_bytes = W.run_workers(S.allocations_of_a_step, 2, tmp_path, name,
                                           timeout=60)[0]
    assert shard_bytes == 4 * 512 * 1024 * 4 // 2  # each rank holds half of 2M parameters
    if _native.available():
        assert allocated < 4096, allocated


def test_an_offloaded_optimizer_refuses_parameters_without_host_or_cuda_memory():
    p = nn.Parameter(torch.randn(4, 3, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        scaleopt.OffloadAdam([p])
    with pytest.raises(ValueError, match="meta"):
        scaleopt.offload(scaleopt.LAMB, [p])


@pytest.mark.parametrize("cls", [scaleopt.LAMB, scaleopt.LANS, scaleopt.AdamW])
def test_meta_parameters_step_without_touching_memory(cls):
    p = nn.Parameter(torch.randn(4, 3, device="meta"))
    p.grad = torch.randn(4, 3, device="meta")
    opt = cls([p])
    opt.step()
    assert opt.state[p]["exp_avg"].is_meta


@pytest.mark.parametrize("name", ["LAMB(clipping)", "LANS"])
def test_a_group_on_two_meshes(name, tmp_path):
    (got,) = [r for r in W.run_workers(S.train_on_two_meshes, 2, tmp_path, name, 3, timeout=60)
              if r is not None]
    for a, b in zip(got, S.train_given(name, (9, 5), 3)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["LAMB(clipping)", "LANS(clipping)",
                                  "LANS(decay_moved_weight, bounds)", "AdamW"])
def test_the_path_gpu_shards_take_reads_no_value_back(name, tmp_path):
    # a proxy on CPU for GPU shards: each read of a tensor value would wait for the device
    reads = W.run_workers(S.host_reads_of_a_step, 2, tmp_path, name, timeout=60)[0]
    assert reads == []


@pytest.mark.slow
def test_the_readme_sharded_example_runs_under_torchrun_on_two_processes(tmp_path):
    """The README's FSDP2 example, as written, under ``torchrun --nproc-per-node 2``: it trains,
    each rank holds half of the parameters, and it prints what the README says it prints."""
    import pathlib
    import re
    import subprocess
    import sys

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Sharded training (FSDP2)", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    (tmp_path / "sharded.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "sharded.py"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = (float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", done.stdout))
    assert last < first / 2
    held, total = (int(v) for v in re.search(r"holds (\d+) of (\d+)", done.stdout).groups())
    assert total == 32 * 128 + 128 + 128 * 4 + 4 and held == total // 2
    told = section.split("```", 2)[2]  # the text after the example
    assert f"{first:.3f}" in told and f"{last:.3f}" in told and f"{held:,} of" in told, done.stdout
