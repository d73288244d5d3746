"""DGC between HSDP replicas: 2 replicas x 2 shards on real gloo process groups (4 processes).

The model is fully_shard-ed on the mesh's shard dimension; DGCMomentum(mesh=) exchanges the
top-k of each local shard between the replicas. Checked against an independent reading of the
algorithm in one process, against plain HSDP with torch's momentum SGD, and through checkpoints.
"""

from __future__ import annotations

import math

import pytest
import torch

import dgc_workers as W
import hsdp_workers as H

#: HSDP on 4 gloo processes (2 replicas x 2 shards): the slow run (pytest -m slow)
# the one-process references run at the workers' thread count (conftest.as_workers)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("as_workers")]

SHAPE = (2, 2)  # (replicas, shards)
OPTIONS = dict(lr=0.05, momentum=0.9, sparsity=[0.9, 0.99], rampup_begin_step=1, rampup_step=2,
               min_numel=4096, selection="topk", local_grad_clip_norm=0.02)
STEPS = 5


def _sparsity(t, o):
    """The warm-up as the docs state it: dense before rampup_begin_step, then the list walked."""
    if t < o["rampup_begin_step"]:
        return None
    walked = int((t - o["rampup_begin_step"]) * len(o["sparsity"]) / o["rampup_step"])
    return o["sparsity"][min(walked, len(o["sparsity"]) - 1)]


def _rows(n_rows, shards, j):
    size = -(-n_rows // shards)  # FSDP2: equal chunks of dim 0, the last ones shorter or empty
    return min(j * size, n_rows), min((j + 1) * size, n_rows)


def reference(shape, steps, o):
    """The DGC paper's algorithm per shard, between replicas, in one process: each replica's
    gradient is the mean of its ranks' (the reduce-scatter), clipped to c / sqrt(replicas) by
    the whole tensor's norm; momentum correction and accumulation per replica and shard, exactly
    k = ceil(density * shard size) entries of largest |v| exchanged and averaged, masking."""
    replicas, shards = shape
    model = H.model_of()
    params = list(model.parameters())
    u = {}
    v = {}
    for t in range(steps):
        grads = []
        for rank in range(replicas * shards):
            model.zero_grad()
            H.loss_of(model, rank, t).backward()
            grads.append([p.grad.clone() for p in params])
        s = _sparsity(t, o)
        c = o["local_grad_clip_norm"] / math.sqrt(replicas)
        with torch.no_grad():
            for pi, p in enumerate(params):
                g = [sum(grads[i * shards + j][pi] for j in range(shards)) / shards
                     for i in range(replicas)]
                g = [gi * (c / max(float(gi.norm()), c)) for gi in g]
                for j in range(shards):
                    lo, hi = _rows(p.shape[0], shards, j)
                    step = _shard_step([gi[lo:hi].reshape(-1) for gi in g], p.numel(), s, o,
                                       [u.setdefault((i, j, pi), torch.zeros((hi - lo) * p[0].numel()))
                                        for i in range(replicas)],
                                       [v.setdefault((i, j, pi), torch.zeros((hi - lo) * p[0].numel()))
                                        for i in range(replicas)])
                    p[lo:hi] -= o["lr"] * step.view_as(p[lo:hi])
    return [p.detach() for p in params]


def _shard_step(g, whole, s, o, u, v):
    replicas, n, m = len(g), g[0].numel(), o["momentum"]
    k = n if s is None else min(n, max(1, math.ceil((1 - s) * n)))
    # sparse unless small, warming up, empty, or the all-gather of k (int32, float32) pairs
    # would move more than a ring all-reduce of the values
    sparse = (s is not None and whole >= o["min_numel"] and n > 0
              and (replicas - 1) * k * 8 < 2 * (replicas - 1) / replicas * n * 4)
    if not sparse:
        mean = sum(g) / replicas
        for ui in u:
            ui.mul_(m).add_(mean)
        return u[0].clone()
    total = torch.zeros(n)
    for gi, ui, vi in zip(g, u, v):
        ui.mul_(m).add_(gi)
        vi.add_(ui)
        idx = torch.topk(vi.abs(), k).indices
        total.index_add_(0, idx, vi[idx])
        vi[idx] = 0
        ui[idx] = 0
    return total / replicas


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return W.run_workers(H.train, 4, tmp_path_factory.mktemp("hsdp"), SHAPE, STEPS, OPTIONS,
                         timeout=180)


def test_the_replicas_of_each_shard_stay_bit_identical_every_step(run):
    by_shard = {}
    for r in run:
        by_shard.setdefault(r["coordinate"][1], []).append(r["history"])
    assert sorted(by_shard) == [0, 1] and all(len(h) == 2 for h in by_shard.values())
    for a, b in by_shard.values():
        for step_a, step_b in zip(a, b):
            assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))
    # the shards are uneven, and one is empty: the (1, 63) matrix has one row for two shards
    shard1 = [r for r in run if r["coordinate"][1] == 1][0]["history"][-1]
    assert [tuple(x.shape) for x in shard1[2:4]] == [(31, 512), (31,)]
    assert shard1[4].numel() == 0


def test_it_agrees_with_an_independent_reading_of_the_algorithm(run):
    expected = reference(SHAPE, STEPS, OPTIONS)
    assert run[0]["step"] == STEPS
    for got, want in zip(run[0]["full"], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    start = H.model_of()
    assert any(not torch.equal(a, b) for a, b in zip(run[0]["full"], start.parameters()))


def test_it_sends_exactly_k_per_shard_between_the_replicas(run):
    tel = run[0]["telemetry"]
    # the last step is at 99%: the two large matrices' shards send ceil(1% of their size)
    sparse = [256 * 64, 32 * 512]  # rank 0's shards of the (512, 64) and (63, 512) matrices
    k = sum(math.ceil(0.01 * n) for n in sparse)
    dense = 256 + 32 + 1 * 63 + 1  # the biases' and the small matrix's shards on rank 0
    assert tel["selected"] == k + dense
    assert tel["numel"] == sum(sparse) + dense
    # an all-gather of k (int32, float32) pairs to the one other replica, against a ring
    # all-reduce (2 (N-1)/N of the values) of everything for dense HSDP
    assert tel["bytes_sent"] == 8 * k + 4 * dense
    assert tel["dense_bytes"] == 4 * (sum(sparse) + dense)
    # counted from the buffers handed to the collectives: the same
    assert tel["buffer_bytes"] == 8 * k + 4 * dense
    assert tel["bytes_sent_measured"] == tel["bytes_sent"]


def test_dense_it_is_plain_hsdp_with_momentum_sgd(tmp_path):
    """At density 1.0, and before the warm-up ends, DGC between the replicas is plain HSDP."""
    got = W.run_workers(H.dense_three_ways, 4, tmp_path, SHAPE, 3, 0.05, 0.9, 4096,
                        timeout=180)[0]
    for name in ("density 1.0", "before the warm-up"):
        for a, b in zip(got[name], got["plain HSDP"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_resume_on_the_same_mesh_continues_bit_for_bit(tmp_path, run):
    resumed = W.run_workers(H.train, 4, tmp_path, SHAPE, STEPS, OPTIONS, 3, timeout=180)
    for a, b in zip(run, resumed):
        assert a["coordinate"] == b["coordinate"]
        for x, y in zip(a["history"][-1], b["history"][-1]):
            assert torch.equal(x, y)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    return W.run_workers(H.refusals, 4, tmp_path_factory.mktemp("refusals"), OPTIONS,
                         timeout=180)


def test_a_resume_on_another_mesh_resets_the_residuals_with_a_warning(refusals):
    for r in refusals:
        r = r["another mesh"]
        assert r["reset"] and r["finite"] and r["step"] == 2
        assert any("reset" in w and "workers" in w for w in r["warnings"]), r["warnings"]


def test_layouts_with_nothing_to_compress_are_refused_by_name(refusals):
    out = refusals[0]
    assert out["plain HSDP"].startswith("ValueError") and "already all-reduces" in out["plain HSDP"]
    assert "one replica" in out["one replica"] and "nothing" in out["one replica"]
    assert out["no mesh"].startswith("TypeError") and "mesh=mesh" in out["no mesh"]
    assert "not both" in out["mesh and group"]
    assert "not sharded" in out["plain tensors"]
    assert out["a 1-D mesh"].startswith("TypeError") and "2-D" in out["a 1-D mesh"]


def test_a_dead_replica_peer_is_a_clear_error_not_a_hang(tmp_path):
    results = W.run_workers(H.die_after_one_step, 4, tmp_path, timeout=90)
    # rank 1 is rank 3's peer in the other replica (the same shard)
    assert results[1]["error"] and "peer rank may have died" in results[1]["error"]


# -- ReplicaCompression: top-k with error feedback between the replicas, for any optimizer ---


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    return W.run_workers(H.replica_feeding, 4, tmp_path_factory.mktemp("fed"), SHAPE, "AdamW",
                         0.99, 4, timeout=180)


def test_any_optimizer_is_given_the_replicas_mean_and_nothing_is_lost(fed):
    """AdamW on a model sharded in each replica, the replica exchange compressed to 1%: over
    the steps, what it was given plus the replicas' mean residual is the sum of the mean
    gradients over all ranks; every rank is given the same; the bytes are k pairs."""
    for rank in fed:
        for p in range(len(rank["full"])):
            given = sum(step[p] for step in rank["given"])
            dense = sum(step[p] for step in rank["dense"])
            torch.testing.assert_close(given + rank["residual"][p], dense, rtol=1e-5, atol=1e-6)
        assert (rank["given"][-1][0] == 0).float().mean() > 0.9  # the (512, 64) matrix: top 1%
        tel = rank["telemetry"]
        assert tel["bytes_sent"] * 20 < tel["dense_bytes"]
    for r in fed[1:]:
        for a, b in zip(fed[0]["full"], r["full"]):
            assert torch.equal(a, b)


def test_replica_compression_at_no_sparsity_is_plain_hsdp(tmp_path):
    sparse = W.run_workers(H.replica_feeding, 4, tmp_path / "c", SHAPE, "LAMB", 0.0, 3,
                           timeout=180)[0]
    plain = W.run_workers(H.plain_hsdp, 4, tmp_path / "p", SHAPE, "LAMB", 3, timeout=180)[0]
    for a, b in zip(sparse["full"], plain["full"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_replica_compression_resumes_bit_for_bit_from_each_ranks_state(tmp_path, fed):
    resumed = W.run_workers(H.replica_feeding, 4, tmp_path, SHAPE, "AdamW", 0.99, 4, 2,
                            timeout=180)
    for a, b in zip(fed, resumed):
        for x, y in zip(a["full"], b["full"]):
            assert torch.equal(x, y)
