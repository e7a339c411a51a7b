"""Crossing sends posted together (course_lib.dist.p2p) and the clock that waits for the device."""

import pytest
import torch
import torch.distributed as dist

from course_lib.dist import counter, device, launch, trace
from course_lib.dist.p2p import exchange, exchange_and_wait
from course_lib.dist.timing import clock, time_calls

ELEMENTS = 1 << 20  # 4 MiB of fp32: far above NCCL's eager threshold, where unpaired crossing sends hang


def _swap_with_neighbours():
    """Every rank sends to its right and receives from its left, all at once (at N = 2 both
    neighbours are the same rank: the crossing pair)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = torch.full((ELEMENTS,), float(rank), device=device())
    got = torch.empty(ELEMENTS, device=device())
    batches, batch = [], dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: batches.append(len(ops)) or batch(ops)  # watch how the ops are posted
    with counter.count() as c, trace.record() as tl:
        exchange_and_wait([(mine, (rank + 1) % n)], [(got, (rank - 1) % n)])
    dist.batch_isend_irecv = batch
    assert batches == [2], f"rank {rank}: the send and the receive must go out as ONE batch (NCCL group), got {batches}"
    peers = sorted((s.name, s.meta["peer"]) for s in tl.spans)
    return got[:3].tolist(), c.calls("isend"), c.calls("irecv"), c.bytes("isend"), peers


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_delivers_and_is_counted_as_isend_irecv(world):
    results = launch(_swap_with_neighbours, world, timeout=60)
    for rank, (head, sends, recvs, sent, peers) in enumerate(results):
        left, right = (rank - 1) % world, (rank + 1) % world
        assert head == [float(left)] * 3, f"rank {rank} must receive its left neighbour's tensor"
        assert (sends, recvs, sent) == (1, 1, 4 * ELEMENTS), "batch_isend_irecv posts dist.isend/irecv: counted as such"
        assert peers == sorted([("isend", right), ("irecv", left)]), "the timeline names each message's global peer"


def _subgroup_peers():
    group = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return None
    other = 3 - dist.get_rank()
    got = torch.empty(2, device=device())
    with trace.record() as tl:
        for w in exchange([(torch.ones(2, device=device()), other)], [(got, other)], group=group):
            w.wait()
    return sorted(s.meta["peer"] for s in tl.spans)


def test_peers_in_a_subgroup_are_reported_as_global_ranks():
    assert launch(_subgroup_peers, 3, timeout=60)[1:] == [[2, 2], [1, 1]]


def test_nothing_to_exchange_posts_nothing():
    assert exchange([], []) == []


def test_time_calls_times_each_call_after_the_warmup():
    calls = []
    samples = time_calls(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(samples) == 3 and len(calls) == 5 and all(s >= 0 for s in samples)
    assert clock() <= clock(), "a monotonic clock"
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_calls(lambda: None, repeats=0)
