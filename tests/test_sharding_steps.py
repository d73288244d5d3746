"""Sums over shards for several param groups at once (scaleopt._sharding.total): the requests
the groups make at the same phase of a step travel in one all-reduce, and each gets its own
totals back. On a real one-rank gloo group, where a total is its partial sum, so that any mix-up
of entries shows; the counts on several ranks are in test_sharded.py."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from scaleopt._sharding import ShardSums, total, total_one


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_one_phase_is_one_all_reduce_and_each_request_gets_its_totals(one_rank_mesh):
    sharded = [distribute_tensor(torch.randn(6, 2), one_rank_mesh, [Shard(0)]) for _ in range(3)]
    replicated = distribute_tensor(torch.randn(3), one_rank_mesh, [Replicate()])
    first = ShardSums(sharded[:2] + [torch.randn(2), replicated])  # two sharded, two not
    second = ShardSums(sharded[2:])
    pieces = [torch.randn(5), torch.randn(7)]
    a = torch.arange(8, dtype=torch.float64)
    b = torch.tensor([5.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    c = torch.tensor([9.0, 4.0], dtype=torch.float64)
    requests = [first.request(a, [0, 1, 2, 3, 3, 2, 1, 0]), None, second.request(c, [0, 0]),
                first.request(b, [3, 0, 2, 1]), second.norms_request(pieces[:1]),
                second.norms_request(pieces[1:])]
    mode = CommDebugMode()
    with mode:
        got = total(requests)
    assert sum(mode.get_comm_counts().values()) == 1  # all groups' sums in one all-reduce
    assert got[1] is None  # a group that asks for nothing gets nothing
    for answer, expected in zip([got[0], got[2], got[3]], [a, c, b]):
        torch.testing.assert_close(answer, expected, rtol=1e-6, atol=0)
    for answer, piece in zip(got[4:], pieces):  # norms: the totals' square roots
        torch.testing.assert_close(answer, torch.linalg.vector_norm(piece).reshape(1),
                                   rtol=1e-6, atol=0)


def test_nothing_asked_reduces_nothing(one_rank_mesh):
    mode = CommDebugMode()
    with mode:
        assert total([None, None]) == [None, None]
        assert total_one(None) is None
    assert sum(mode.get_comm_counts().values()) == 0


def test_sums_of_unsharded_tensors_come_back_as_they_are(one_rank_mesh):
    replicated = distribute_tensor(torch.randn(4), one_rank_mesh, [Replicate()])
    sums = torch.tensor([3.0, 1.5], dtype=torch.float64)
    mode = CommDebugMode()
    with mode:
        got = total_one(ShardSums([replicated, torch.randn(2)]).request(sums, [0, 1]))
    assert sum(mode.get_comm_counts().values()) == 0  # nothing sharded: no collective
    assert got.tolist() == [3.0, 1.5]


def _functional_case(n=3):
    torch.manual_seed(0)
    shapes = [(6, 4), (5,), (2, 3)][:n]
    return ([torch.randn(s) for s in shapes], [torch.randn(s) for s in shapes])


def _run_functional(fn, weights, grads, **kwargs):
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    fn(weights, grads, m, v, [torch.tensor(0.0) for _ in weights], lrs=[0.1] * len(weights),
       weight_decays=[0.01] * len(weights), adapt=[True] * len(weights), beta1=0.9,
       beta2=0.999, eps=1e-6, **kwargs)
    return weights + m + v


@pytest.mark.parametrize("name", ["lamb", "lans"])
@pytest.mark.parametrize("implementation", ["multi", "native"])
def test_the_functional_forms_total_local_shards_over_the_dtensors_given(one_rank_mesh, name,
                                                                         implementation):
    """``sharded_as``: the lists are local shards of these DTensors, whose trust ratios' norms
    are totalled over the shards, in one all-reduce for LAMB (two for LANS: the gradients'
    norms first): on one rank, the numbers of the whole tensors."""
    import scaleopt

    if implementation == "native" and not scaleopt._native.available():
        pytest.skip("kernels not built")
    fn = getattr(getattr(scaleopt, name), name)
    weights, grads = _functional_case()
    whole = _run_functional(fn, [w.clone() for w in weights], grads,
                            implementation=implementation)
    dtensors = [distribute_tensor(w.clone(), one_rank_mesh, [Shard(0)]) for w in weights]
    pieces = [d.to_local() for d in dtensors]
    mode = CommDebugMode()
    with mode:
        sharded = _run_functional(fn, pieces, grads, implementation=implementation,
                                  sharded_as=dtensors)
    assert sum(mode.get_comm_counts().values()) == (1 if name == "lamb" else 2)
    for a, b in zip(whole, sharded):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="sharded_as: 1 tensors for 3"):
        _run_functional(fn, pieces, grads, sharded_as=dtensors[:1])


@pytest.mark.parametrize("name", ["lamb", "lans"])
@pytest.mark.parametrize("implementation", ["single", "multi", "native"])
def test_the_functional_forms_take_each_gradient_times_its_multiplier(name, implementation):
    """``grad_multipliers``: the update of the gradients times those numbers (powers of two:
    exactly), however the path applies them (the kernels as they read the gradients)."""
    import scaleopt

    if implementation == "native" and not scaleopt._native.available():
        pytest.skip("kernels not built")
    fn = getattr(getattr(scaleopt, name), name)
    weights, grads = _functional_case()
    factors = [0.5, 4.0, -2.0]
    scaled = _run_functional(fn, [w.clone() for w in weights],
                             [g * f for g, f in zip(grads, factors)],
                             implementation=implementation)
    deferred = _run_functional(fn, [w.clone() for w in weights], grads,
                               implementation=implementation, grad_multipliers=factors)
    for a, b in zip(scaled, deferred):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="grad_multipliers: 2 numbers for 3"):
        _run_functional(fn, weights, grads, grad_multipliers=factors[:2])
