"""Muon on FSDP2 and HSDP shards (real gloo process groups on 127.0.0.1): each matrix iterated
whole by one rank, one exchange each way per step, the results one process's."""

from __future__ import annotations

import pytest
import torch

import dgc_workers as W
import muon_workers as M

# the one-process references run at the workers' thread count (conftest.as_workers)
pytestmark = pytest.mark.usefixtures("as_workers")
NAMES = sorted(M.OPTIMIZERS)
CLIPPING = "Muon(match_rms_adamw, plain momentum, clipping)"


@pytest.fixture(scope="module")
def references(as_workers):
    return {name: M.train_reference(name, 3) for name in NAMES}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sharded_muon_is_one_process_bit_for_bit_with_one_exchange_each_way(
        world, references, tmp_path):
    """63 and 96 rows over 2 and 3 ranks (uneven; the 40-row embedding and head, AdamW's, too):
    the same gradients give the same bits as one process, momentum stored in float32, bfloat16
    or int8 alike. The exception is global clipping: its norm is summed from the shards' sums
    in another order, so the clipped gradients differ in their last bits, and the bfloat16
    iteration can round an element of the update the other way: a weight moves by at most one
    bfloat16 step of its update (2^-8 relative, times the learning rate) per step."""
    (got,) = [r for r in W.run_workers(M.train_sharded, world, tmp_path, NAMES, 3, timeout=180)
              if r is not None]
    for name in NAMES:
        want = references[name]
        if name == CLIPPING:
            for a, b in zip(got[name], want):
                torch.testing.assert_close(a, b, rtol=0, atol=3 * 0.2 * 1e-2 * 2 ** -8 * 10)
        else:
            assert all(torch.equal(a, b) for a, b in zip(got[name], want)), name
        # the rows travel in one all_to_all to the matrices' owners and one back (per run with
        # exchange_buckets: the two matrices in two runs); no all-reduce but the clipping's one
        collectives = got[name + " collectives"]
        assert collectives.pop("c10d.alltoall_base_") == (4 if "buckets" in name else 2), name
        assert collectives == ({"c10d.allreduce_": 1} if name == CLIPPING else {}), name


def test_compact_momentum_is_stored_as_one_process_stores_it(tmp_path):
    names = ["Muon(int8 state)", "Muon(bfloat16 state)"]
    (got,) = [r for r in W.run_workers(M.train_sharded, 2, tmp_path, names, 2, timeout=120)
              if r is not None]
    for name in names:
        model = M.model_of()
        opt = M.OPTIMIZERS[name](list(model.named_parameters()))
        M.train_reference(name, 2, model=model, opt=opt)
        for p, st in zip(model.parameters(), got[name + " state"]):
            for key, value in opt.state[p].items():
                assert torch.equal(st[key], value), (name, key)
        buf = opt.state[model.up.weight]["momentum_buffer"]
        assert buf.dtype == (torch.int8 if "int8" in name else torch.bfloat16)


@pytest.mark.parametrize("name", ["Muon", pytest.param("Muon(int8 state)", marks=pytest.mark.slow),
                                  pytest.param("offload(Muon, int8 state)",
                                               marks=pytest.mark.slow)])
def test_hsdp_iterates_each_matrix_once_in_the_whole_mesh_as_one_process(name, tmp_path):
    """A (2 replicas x 2 shards) mesh: every rank ends with one process's bits, each matrix is
    iterated by one rank of the four (not once per replica), and a step takes the two
    all-to-alls inside the shard groups and one all-gather over the replicas."""
    want = M.train_reference(name, 3)
    got = W.run_workers(M.train_hsdp, 4, tmp_path, name, 3, timeout=180)
    for rank in got:
        assert all(torch.equal(a, b) for a, b in zip(rank["full"], want)), name
        assert rank["collectives"] == {"c10d.alltoall_base_": 2, "c10d.allgather_": 1}
    iterated = sorted(shape for rank in got for shape in rank["iterated"])
    model = M.model_of()
    matrices = sorted(tuple(p.shape) for p in (model.up.weight, model.down.weight))
    assert iterated == sorted(3 * matrices)  # each matrix once per step, over all ranks
    assert sum(1 for rank in got if rank["iterated"]) == len(matrices)  # by as many ranks


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_three_as_one_process_goes_on(tmp_path):
    """DCP reshards the int8 momentum (codes and scales laid out as the matrix) 2 -> 3 ranks."""
    name = "Muon(int8 state)"
    W.run_workers(M.save_after, 2, tmp_path / "save", name, 2, timeout=120)
    (got,) = [r for r in W.run_workers(M.resume, 3, tmp_path / "resume", name, 2, 2,
                                       str(tmp_path / "save"), timeout=120) if r is not None]
    want = M.train_reference(name, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_nan_in_one_ranks_rows_skips_the_step_on_every_rank(tmp_path):
    (got,) = [r for r in W.run_workers(M.skip_on_one_rank, 2, tmp_path, timeout=120)
              if r is not None]
    before, after, counts = got
    assert counts == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("placements,world", [("tp", 2), ("hsdp-tp", 4)])
def test_tensor_parallel_matrices_are_iterated_whole_as_one_process(placements, world, tmp_path):
    """Tensor parallelism's placements: a column-wise Shard(0) and a row-wise Shard(1) matrix on
    one mesh dimension (one exchange for both), and Shard(1) under HSDP's Replicate(): the
    owner joins the column blocks into the matrix one process holds, so every rank ends with
    one process's bits."""
    model = M.model_of()
    opt = M.OPTIMIZERS["Muon"](list(model.named_parameters()))
    M.train_reference("Muon", 3, model=model, opt=opt)
    want = [model.up.weight.detach(), model.down.weight.detach()]
    got = W.run_workers(M.train_tensor_parallel, world, tmp_path, "Muon", 3, placements,
                        timeout=180)
    for rank in got:
        assert all(torch.equal(a, b) for a, b in zip(rank["full"], want)), placements
        assert rank["collectives"] == ({"c10d.alltoall_base_": 2} if placements == "tp" else
                                       {"c10d.alltoall_base_": 2, "c10d.allgather_": 1})


def test_a_matrix_cut_along_two_mesh_dimensions_is_refused_naming_its_placement(tmp_path):
    """FSDP x TP ((Shard(0), Shard(1)) on a 2 x 2 mesh): a clear error, on every rank, that
    names the placement and says why."""
    got = W.run_workers(M.train_tensor_parallel, 4, tmp_path, "Muon", 1, "fsdp-tp", timeout=120)
    for rank in got:
        assert "Shard(dim=0), Shard(dim=1)" in rank["error"], rank
        assert "cut along 2 mesh dimensions" in rank["error"] and "FSDP x TP" in rank["error"]


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [("offload(Muon, int8 state)", "Muon(int8 state)"),
                                           ("Muon(int8 state)", "offload(Muon, int8 state)")])
def test_an_offloaded_muons_checkpoint_resumes_resharded_in_the_on_device_one(saved, resumed,
                                                                             tmp_path):
    """offload(Muon) on FSDP2's host shards saves a DCP checkpoint on 2 ranks that Muon (not
    offloaded) resumes on 3, and the other way round, and goes on as one process does, bit
    for bit."""
    W.run_workers(M.save_after, 2, tmp_path / "save", saved, 2, timeout=120)
    (got,) = [r for r in W.run_workers(M.resume, 3, tmp_path / "resume", resumed,
                                       2, 2, str(tmp_path / "save"), timeout=120)
              if r is not None]
    want = M.train_reference("Muon(int8 state)", 4)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_stack_whose_matrices_are_cut_is_refused_at_construction_naming_its_placement(
        tmp_path):
    """A stack's matrices are each iterated by one process: a stack cut through its matrices
    (or a flattened parameter cut at all) over 2 ranks is refused when the optimizer is made,
    naming the parameter and its placement; by default it takes AdamW."""
    for rank in W.run_workers(M.stack_split, 2, tmp_path, timeout=120):
        assert len(rank["errors"]) == 2 and rank["algorithms"] == ["adamw"], rank
        for error in rank["errors"]:
            assert "'experts' (shape (8, 16, 24))" in error, error
            assert "split over ranks (placements (Shard(dim=1),))" in error, error


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_a_stack_cut_by_its_experts_is_iterated_where_it_lies_as_one_process(state_dtype,
                                                                           tmp_path):
    """Expert parallelism (and FSDP2) cut a [8, 32, 48] stack by its leading dimension, so each
    rank holds whole matrices: each iterates its own, with no collective in the step, and the
    stack and its stored momentum are one process's, bit for bit."""
    for rank in W.run_workers(M.stack_over_experts, 2, tmp_path, state_dtype, timeout=120):
        assert torch.equal(rank["full"], rank["alone"])
        assert rank["collectives"] == {}
        assert rank["stored"] == {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "int8": torch.int8}[state_dtype]
