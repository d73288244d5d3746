"""Steps in backward on FSDP2, HSDP and DDP (real gloo process groups on 127.0.0.1): on FSDP2
each module's shards step after its reduce-scatter, as one piece, under DDP each bucket after
its all-reduce; the weights are the ordinary distributed step's bits (and one process's where
the ordinary sharded step gives one process's)."""

from __future__ import annotations

import pytest
import torch

import dgc_workers as W
import in_backward_workers as B

# the one-process references run at the workers' thread count (conftest.as_workers)
pytestmark = pytest.mark.usefixtures("as_workers")
NAMES = sorted(B.OPTIMIZERS)
#: FSDP modules of the model that hold parameters (muon_workers.shard), and those of them that
#: hold Muon's matrices (up, down)
MODULES, MATRIX_MODULES = 5, 2
#: the optimizer's own collectives per piece: LAMB's trust-ratio sums (with global clipping
#: the gradients' whole-tensor norms first, which LANS always takes), Muon's rows to the
#: matrices' owners and back (in a piece that holds a matrix)
PER_PIECE = {"LAMB": {"c10d.allreduce_": 1}, "LANS": {"c10d.allreduce_": 2},
             "Muon": {"c10d.alltoall_base_": 2}, "AdamW": {}}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    (got,) = [r for r in W.run_workers(B.train_sharded, 2, tmp_path_factory.mktemp("fsdp"),
                                       NAMES, 3, timeout=240) if r is not None]
    return got


@pytest.mark.parametrize("name", NAMES)
def test_a_step_in_backward_on_fsdp2_is_the_ordinary_sharded_steps_bits(name, sharded):
    """3 steps of 2 micro-batches, accumulated, on 2 ranks: the weights equal the ordinary
    FSDP2 step's bit for bit, and no gradient is left."""
    got, ordinary = sharded[name], sharded[name + " ordinary"]
    assert all(torch.equal(a, b) for a, b in zip(got, ordinary)), name
    assert sharded[name + " grads left"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_on_fsdp2_the_steps_are_one_process_training_alike(name, sharded):
    """Every rank trains on the same micro-batches, so the reduced gradient is one process's
    gradient: AdamW's and Muon's weights are one process's bits; LAMB's and LANS's trust
    ratios sum their norms from the shards' sums (another order), a few ulps from it."""
    want = B.train_reference(name, 3)
    if name.startswith(("AdamW", "Muon", "offload(Muon")):
        assert all(torch.equal(a, b) for a, b in zip(sharded[name], want)), name
    else:
        for a, b in zip(sharded[name], want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_each_fsdp2_modules_shards_step_together_in_one_piece(name, sharded):
    """With bucket_bytes=0 a piece is one module's shards (never a part of one); with the
    default 4 MiB bucket this small model steps in one piece. Each piece makes the
    optimizer's collectives once (so a step makes them once per piece); FSDP2's own are
    those of the ordinary step, twice with exact clipping (its two passes)."""
    pieces = sharded[name + " pieces"]
    assert pieces == (MODULES if "one tensor a piece" in name else 1)
    got = dict(sharded[name + " collectives"])
    ordinary = dict(sharded[name + " ordinary collectives"])
    passes = 2 if "exact" in name else 1
    for op in ("c10d._allgather_base_", "c10d._reduce_scatter_base_"):
        assert got.pop(op) == passes * ordinary.pop(op), op
    kind = name.split("(")[1] if name.startswith("offload(") else name
    per_piece = dict(next(v for k, v in PER_PIECE.items() if kind.startswith(k)))
    if kind.startswith("LAMB") and "clipping" in name:
        per_piece["c10d.allreduce_"] += 1
    if kind.startswith("Muon"):
        pieces = min(pieces, MATRIX_MODULES)
    measuring = {"c10d.allreduce_": 1} if "exact" in name else {}  # the first pass's norms
    want = {op: n * pieces + measuring.get(op, 0) for op, n in per_piece.items()}
    assert got == want, name


@pytest.mark.parametrize("name", ["LAMB", "Muon(int8 state, one tensor a piece)"])
def test_a_dcp_checkpoint_resumes_steps_in_backward_on_fsdp2_exactly(name, tmp_path):
    """Saved with DCP after 2 of 3 steps and loaded into a new FSDP2 model and optimizer already
    stepping in backward (DCP makes an empty optimizer's state with a step of zero gradients
    and learning rates first): the third step gives the bits of the run that never stopped."""
    (got,) = [r for r in W.run_workers(B.resumed_from_dcp, 2, tmp_path, name, 3, 2,
                                       timeout=180) if r is not None]
    assert all(torch.equal(a, b) for a, b in zip(got["resumed"], got["straight"])), name


@pytest.mark.slow
def test_on_hsdp_a_step_in_backward_is_the_ordinary_steps_bits(tmp_path):
    """2 replicas of 2 shards: the same bits as the ordinary HSDP step (and Muon's as one
    process's), each matrix still iterated once in the mesh."""
    names = ["LAMB", "LANS(clipping, exact)", "Muon(int8 state, one tensor a piece)",
             "offload(Muon)"]
    (got,) = [r for r in W.run_workers(B.train_sharded, 4, tmp_path, names, 3, (2, 2),
                                       timeout=300) if r is not None]
    for name in names:
        assert all(torch.equal(a, b) for a, b in zip(got[name], got[name + " ordinary"])), name
        assert got[name + " grads left"] == 0
        if "Muon" in name:
            want = B.train_reference(name, 3)
            assert all(torch.equal(a, b) for a, b in zip(got[name], want)), name


@pytest.fixture(scope="module", params=[False, True], ids=["synced", "no_sync"])
def ddp(request, tmp_path_factory):
    (got,) = [r for r in W.run_workers(B.train_ddp, 2, tmp_path_factory.mktemp("ddp"), NAMES,
                                       3, request.param, timeout=240) if r is not None]
    return got


@pytest.mark.parametrize("name", NAMES)
def test_under_ddp_each_bucket_steps_after_its_all_reduce_the_ordinary_steps_bits(name, ddp):
    """Each rank its own micro-batches, 2 accumulated per step (all-reduced each, or inside
    DDP's no_sync()), 4 DDP buckets: the weights equal the ordinary DDP step's bit for bit; one
    piece per bucket; DDP's all-reduces are the ordinary step's (twice with exact clipping's
    two passes, and nothing more: the pieces' norms are whole on every rank); no gradient is
    left (DDP's views of its buckets let go)."""
    assert all(torch.equal(a, b) for a, b in zip(ddp[name], ddp[name + " ordinary"])), name
    buckets = ddp[name + " ordinary collectives"]["c10d.allreduce_"]
    assert buckets > 1
    assert ddp[name + " pieces"] == buckets
    passes = 2 if "exact" in name else 1
    assert ddp[name + " collectives"] == {"c10d.allreduce_": passes * buckets}
    assert ddp[name + " grads left"] == 0


def test_ddp_set_up_wrongly_is_refused_and_a_missing_ddp_is_warned_of(tmp_path):
    (got,) = [r for r in W.run_workers(B.ddp_refusals, 2, tmp_path, timeout=120)
              if r is not None]
    assert any("ddp=model" in m for m in got["no ddp="]), got["no ddp="]
    assert got["not DDP"].startswith("TypeError") and "DistributedDataParallel" in got["not DDP"]
    assert got["copies"].startswith("ValueError") and "gradient_as_bucket_view=True" in got[
        "copies"]
    assert got["outside"].startswith("ValueError") and "every parameter" in got["outside"]
