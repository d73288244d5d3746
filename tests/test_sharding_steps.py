"""Phased updates in lockstep (scaleopt._sharding.run_lockstep): the reductions the param groups ask
for at the same point of a step travel in one all-reduce, and each asker gets its own totals
back. On a real one-rank gloo group, where a total is its partial sum, so that any mix-up of
entries shows; the counts on several ranks are in test_sharded.py."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from scaleopt._sharding import ShardSums, run_lockstep, run_phases


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _asking(shard_sums, asks, log):
    """A phased update that asks for each of ``asks`` (sums, owners, root) in turn; returns the answers."""
    answers = []
    for sums, owners, root in asks:
        ask = (shard_sums.norms_request if root else shard_sums.request)
        answer = yield (ask(sums) if root else ask(sums, owners))
        log.append(len(answers))
        answers.append(answer)
    return answers


def test_each_round_of_reductions_is_one_all_reduce_and_each_asker_gets_its_totals(one_rank_mesh):
    sharded = [distribute_tensor(torch.randn(6, 2), one_rank_mesh, [Shard(0)]) for _ in range(3)]
    replicated = distribute_tensor(torch.randn(3), one_rank_mesh, [Replicate()])
    first = ShardSums(sharded[:2] + [torch.randn(2), replicated])  # two sharded, two not
    second = ShardSums(sharded[2:])
    pieces = [torch.randn(5), torch.randn(7)]
    asks = {
        "first": [(torch.arange(8, dtype=torch.float64), [0, 1, 2, 3, 3, 2, 1, 0], False),
                  (torch.tensor([5.0, -1.0, 2.0, 0.5], dtype=torch.float64), [3, 0, 2, 1], False)],
        "second": [(torch.tensor([9.0, 4.0], dtype=torch.float64), [0, 0], False),
                   (pieces[:1], None, True), (pieces[1:], None, True)],
        "none": [],  # a group that needs no total: done at once
    }
    log = []
    mode = CommDebugMode()
    with mode:
        got = run_lockstep([_asking(first, asks["first"], log),
                               _asking(second, asks["second"], log),
                               _asking(first, asks["none"], log)])
    # three rounds (the longest asker): one all-reduce each, the first carrying both groups' sums
    assert sum(mode.get_comm_counts().values()) == 3
    for answers, name in zip(got, asks):
        assert len(answers) == len(asks[name])
        for answer, (sums, _, root) in zip(answers, asks[name]):
            expected = torch.linalg.vector_norm(sums[0]).reshape(1) if root else sums
            torch.testing.assert_close(answer.to(expected.dtype), expected, rtol=1e-6, atol=0)
    assert log == [0, 0, 1, 1, 2]  # in lockstep: every asker answered before the next round


def test_run_phases_runs_one_asker_to_its_end(one_rank_mesh):
    shard_sums = ShardSums([distribute_tensor(torch.randn(4), one_rank_mesh, [Shard(0)])])
    sums = torch.tensor([3.0], dtype=torch.float64)
    mode = CommDebugMode()
    with mode:
        answers = run_phases(_asking(shard_sums, [(sums, [0], False)] * 2, []))
    assert sum(mode.get_comm_counts().values()) == 2
    assert [a.item() for a in answers] == [3.0, 3.0]


def test_an_error_in_one_group_ends_the_others_there():
    ended = []

    def waits():
        try:
            yield ShardSums([torch.randn(2)]).request(torch.zeros(1), [0])
            yield ShardSums([torch.randn(2)]).request(torch.zeros(1), [0])
        finally:
            ended.append("waiting")

    def fails():
        yield ShardSums([torch.randn(2)]).request(torch.zeros(1), [0])
        raise ValueError("bad group")

    with pytest.raises(ValueError, match="bad group"):
        run_lockstep([waits(), fails()])
    assert ended == ["waiting"]  # closed by run_lockstep, not left to the garbage collector
