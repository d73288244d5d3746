"""Muon on FSDP2 and HSDP shards (real gloo process groups on 127.0.0.1): each matrix iterated
whole by one rank, one exchange each way per step, the results one process's."""

from __future__ import annotations

import pytest
import torch

import scaleopt

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
    all-to-alls inside the shard group of a replica that iterates matrices (none in one that
    iterates none) and one all-gather over the replicas."""
    want = M.train_reference(name, 3)
    got = W.run_workers(M.train_hsdp, 4, tmp_path, name, 3, timeout=180)
    iterating = {r // 2 for r, rank in enumerate(got) if rank["iterated"]}  # mesh (2, 2)
    for r, rank in enumerate(got):
        assert all(torch.equal(a, b) for a, b in zip(rank["full"], want)), name
        assert rank["collectives"] == ({"c10d.alltoall_base_": 2, "c10d.allgather_": 1}
                                       if r // 2 in iterating else {"c10d.allgather_": 1})
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


#: what a step of each layout of the matrices exchanges on each rank: two all-to-alls inside
#: the group of ranks that cut the matrices (over two mesh dimensions for FSDP x TP), none in
#: a replica that iterates none of them, and one all-gather over the replicas
MATRIX_LAYOUTS = [("tp", 2, "Muon"), ("hsdp-tp", 4, "Muon"),
                  pytest.param("fsdp2-tp", 4, "Muon", marks=pytest.mark.slow),
                  pytest.param("fsdp-tp", 4, "Muon", marks=pytest.mark.slow),
                  pytest.param("fsdp-tp-strided", 4, "Muon", marks=pytest.mark.slow),
                  pytest.param("fsdp2-tp", 4, "Muon(bfloat16 state)", marks=pytest.mark.slow),
                  pytest.param("hsdp-fsdp-tp", 8, "Muon", marks=pytest.mark.slow)]


@pytest.mark.parametrize("placements,world,name", MATRIX_LAYOUTS)
def test_matrices_on_every_mesh_are_iterated_once_as_one_process(placements, world, name,
                                                                 tmp_path):
    """Tensor parallelism's placements (column-wise Shard(0), row-wise Shard(1)), each under
    HSDP's Replicate(), and FSDP x TP on a 2 x 2 mesh (Shard(0), Shard(1)), also as FSDP2
    places it over torch's own tensor parallelism (an interleaved _StridedShard): the owner
    joins the blocks into the matrix one process holds, every rank ends with one process's
    bits (bfloat16 momentum too: its stochastic rounding draws by each element's place in the
    whole matrix), and each matrix is iterated once per step in the whole mesh."""
    model = M.model_of()
    opt = M.OPTIMIZERS[name](list(model.named_parameters()))
    M.train_reference(name, 3, model=model, opt=opt)
    want = [model.up.weight.detach(), model.down.weight.detach()]
    got = W.run_workers(M.train_tensor_parallel, world, tmp_path, name, 3, placements,
                        timeout=240)
    if placements == "fsdp2-tp":  # what FSDP2 makes of tensor parallelism's blocks
        assert got[0]["placements"] == ["(Shard(dim=0), Shard(dim=1))",
                                        "(_StridedShard(dim=0, sf=2), Shard(dim=0))"]
    iterated = sorted(shape for rank in got for shape in rank["iterated"])
    assert iterated == sorted(3 * [tuple(w.shape) for w in want])  # once per step, all ranks
    copies = 2 if placements.startswith("hsdp") else 1
    group = world // copies
    iterating = {r // group for r, rank in enumerate(got) if rank["iterated"]}
    for r, rank in enumerate(got):
        assert all(torch.equal(a, b) for a, b in zip(rank["full"], want)), placements
        want_counts = {"c10d.alltoall_base_": 2} if r // group in iterating else {}
        if copies > 1:
            want_counts["c10d.allgather_"] = 1
        assert rank["collectives"] == want_counts, (r, placements)


@pytest.mark.slow
def test_lamb_on_fsdp2_over_tensor_parallelism_takes_whole_norms(tmp_path):
    """The trust ratio of a matrix that FSDP2 cuts into interleaved blocks over tensor
    parallelism's (a _StridedShard, which torch 2.13 does not count as a shard) sums its norm
    over both mesh dimensions: one process's weights, to the sums' order."""
    model = M.model_of()
    opt = scaleopt.LAMB([model.up.weight, model.down.weight], lr=0.01)
    for t in range(3):
        for p, g in zip(model.parameters(), M.full_grads(model, t)):
            p.grad = g
        opt.step()
    got = W.run_workers(M.lamb_fsdp_tp, 4, tmp_path, timeout=180)
    for rank in got:
        for a, b in zip(rank, (model.up.weight.detach(), model.down.weight.detach())):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_owners_balanced_by_measured_pace_give_the_same_bits(tmp_path):
    """exchange_balance="measured" on HSDP 2 x 2: each rank times its iteration in the
    exchanges of steps 2 and 3, the paces are shared once at step 3 (an all-gather in the
    shard group and one over the replicas) and every rank holds the same four; the bits are
    one process's, and later steps take only the exchange's collectives."""
    want = M.train_reference("Muon", 4)
    got = W.run_workers(M.measured_balance, 4, tmp_path, timeout=180)
    for rank in got:
        assert all(torch.equal(a, b) for a, b in zip(rank["full"], want))
        (paces,) = rank["paces"]
        assert len(paces) == 4 and all(p > 0 for p in paces)
        assert paces == got[0]["paces"][0]
        gathers = [step.get("c10d.allgather_", 0) for step in rank["collectives"]]
        assert gathers == [1, 1, 3, 1]  # the replicas' results; at step 3 the paces too


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


def test_a_matrix_of_partial_sums_is_refused_at_construction_naming_its_placement(tmp_path):
    """A Partial() placement holds no block of the matrix that an exchange could join: a clear
    error when the optimizer is made, naming the parameter and the placement."""
    for error in W.run_workers(M.refused_partial, 2, tmp_path, timeout=120):
        assert error is not None and "'w'" in error and "Partial" in error, error


#: a stack's placements: (name, world, collectives per rank of the last step). Cut by its
#: leading dimensions alone, each matrix lies whole on one rank and is iterated there: no
#: collective (with copies, one all-gather gives each replica the others' results);
#: cut through its matrices, two all-to-alls in the group of ranks that cut them
STACK_LAYOUTS = [
    ("rows", 2, {"c10d.alltoall_base_": 2}),
    pytest.param("ep-fsdp", 4, {"c10d.alltoall_base_": 2}, marks=pytest.mark.slow),
    pytest.param("ep-fsdp-experts", 4, {}, marks=pytest.mark.slow),
    pytest.param("hsdp-ep", 4, {"c10d.allgather_": 1}, marks=pytest.mark.slow),
    pytest.param("fsdp-tp", 4, {"c10d.alltoall_base_": 2}, marks=pytest.mark.slow),
    pytest.param("hsdp-ep-fsdp", 8, {"c10d.alltoall_base_": 2, "c10d.allgather_": 1},
                 marks=pytest.mark.slow)]


@pytest.mark.parametrize("where,world,collectives", STACK_LAYOUTS)
def test_a_stack_on_every_mesh_is_iterated_once_as_one_process(where, world, collectives,
                                                               tmp_path):
    """A [8, 32, 48] stack of experts cut by expert parallelism, by FSDP2 through its matrices,
    by both (EP x FSDP), by FSDP x TP, with HSDP's copies: each expert's matrix is iterated
    once per step in the whole mesh, the stack is one process's bits on every rank, and the
    step's collectives are counted."""
    got = W.run_workers(M.stack_placed, world, tmp_path, "float32", where, timeout=240)
    alone = got[0]["alone"]
    assert sorted(s for rank in got for s in rank["iterated"]) == 3 * 8 * [(32, 48)]
    for r, rank in enumerate(got):
        assert torch.equal(rank["full"], alone), (r, where)
        counts = dict(collectives)
        if "c10d.alltoall_base_" in counts and not any(
                got[q]["iterated"] for q in range(world) if q // 4 == r // 4):
            counts.pop("c10d.alltoall_base_")  # its replica iterates nothing
        assert rank["collectives"] == counts, (r, where)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_a_stack_cut_by_its_experts_is_iterated_where_it_lies_as_one_process(state_dtype,
                                                                           tmp_path):
    """Expert parallelism (and FSDP2) cut a [8, 32, 48] stack by its leading dimension, so each
    rank holds whole matrices: each iterates its own, with no collective in the step, and the
    stack and its stored momentum are one process's, bit for bit."""
    got = W.run_workers(M.stack_placed, 2, tmp_path, state_dtype, timeout=120)
    assert [len(rank["iterated"]) for rank in got] == [3 * 4, 3 * 4]  # its own 4 experts
    for rank in got:
        assert torch.equal(rank["full"], rank["alone"])
        assert rank["collectives"] == {}
        assert rank["stored"] == {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "int8": torch.int8}[state_dtype]


@pytest.mark.parametrize("state_dtype,saved,resumed", [
    # 3 processes: the slow run
    pytest.param("int8", "ep", "ep", marks=pytest.mark.slow),
    pytest.param("bfloat16", "ep", "rows", marks=pytest.mark.slow)])
def test_a_stacks_checkpoint_of_two_ranks_resumes_on_three_as_one_process_goes_on(
        state_dtype, saved, resumed, tmp_path):
    """A stack of experts and its compact momentum saved by DCP on 2 ranks (4 whole experts
    each) resume on 3 (experts split 3, 3, 2; or every expert's rows cut) and go on as one
    process does, bit for bit."""
    W.run_workers(M.stack_checkpointed, 2, tmp_path / "save", state_dtype, saved, 0, 2,
                  timeout=120)
    got = W.run_workers(M.stack_checkpointed, 3, tmp_path / "resume", state_dtype, resumed, 2,
                        2, str(tmp_path / "save"), timeout=120)
    want = M.stack_alone(state_dtype, 4)
    assert not torch.equal(want, M.stack_alone(state_dtype, 2))
    for rank in got:
        assert torch.equal(rank, want)


@pytest.mark.parametrize("shape,where,reading", [
    pytest.param((2, 4, 32, 48), "ep-fsdp", "stack", marks=pytest.mark.slow),
    ((64, 2, 3, 3), "rows", "flatten")])
def test_four_dimensional_stacks_and_cut_kernels_step_as_one_process(shape, where, reading,
                                                                    tmp_path):
    """A [2, 4, 32, 48] stack cut over a 2 x 2 mesh by its leading dimensions and its rows,
    and a convolution kernel read as one [64, 18] matrix and cut through its channels: the
    bits of one process."""
    world = 4 if where == "ep-fsdp" else 2
    got = W.run_workers(M.stack_placed, world, tmp_path, "float32", where, shape, reading,
                        timeout=240)
    for rank in got:
        assert torch.equal(rank["full"], rank["alone"]), (shape, where)
    matrices = 8 if reading == "stack" else 1
    assert len([s for rank in got for s in rank["iterated"]]) == 3 * matrices
