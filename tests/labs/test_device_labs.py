"""The labs' reference solutions and graders on a rank's device, and their rings safe under NCCL.

What a CPU can show of code meant for GPUs:

* the rings of lab 01 (ring collectives) and lab 06 (ring attention) post each step's send and
  receive as one ``dist.batch_isend_irecv`` batch (isend + blocking recv crossing on one link can
  deadlock under NCCL at N = 2, where the left and the right neighbour are the same rank), and the
  communication counter still sees the isend bytes the graders count;
* lab 03's ZeRO buffers are made on the device of the model's parameters (the meta device shows it);
* the graders' data helpers put the tensors a rank touches on ``course_lib.dist.device()``.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import counter, launch
from course_lib.grading.adapter import Adapter, load
from course_lib.grading.labs import _lab03_ranks, _lab07_expert_parallel, _lab07_routing, lab04_tensor_parallel

ROOT = Path(__file__).resolve().parents[2]
LAB01 = ROOT / "solutions/lab01_collectives/collectives.py"
LAB03 = ROOT / "solutions/lab03_zero/zero.py"
LAB06 = ROOT / "solutions/lab06_sequence_parallel/sequence_parallel.py"


def _counting_batches() -> list[int]:
    """Wrap ``dist.batch_isend_irecv`` in this rank's process; the list gets each batch's op count."""
    sizes: list[int] = []
    original = dist.batch_isend_irecv

    def batched(ops):
        sizes.append(len(ops))
        return original(ops)

    dist.batch_isend_irecv = batched
    return sizes


def _ring_all_reduce_rank(impl: Adapter, numel: int):
    sizes = _counting_batches()
    g = torch.Generator().manual_seed(dist.get_rank())  # host: the same draw on every machine
    x = torch.randint(-9, 9, (numel,), generator=g).float()  # host: drawn with g (gloo ranks in this test)
    want = x.clone()
    dist.all_reduce(want)
    with counter.count() as c:
        got = impl["ring_all_reduce"](x.clone())
    return sizes, c.bytes("isend"), c.calls("send") + c.calls("recv"), torch.equal(got, want)


def test_lab01_ring_posts_each_step_as_one_batch():
    world, numel = 2, 1024
    impl = Adapter.of_file(LAB01, ("ring_all_reduce",))
    for rank, (sizes, sent, blocking, equal) in enumerate(launch(_ring_all_reduce_rank, world, impl, numel)):
        assert equal, f"rank {rank}: the ring all-reduce differs from dist.all_reduce"
        # 2(N-1) steps, each one batch of one isend and one irecv: nothing crosses outside a group
        assert sizes == [2] * (2 * (world - 1)), f"rank {rank}: batches of {sizes}"
        assert blocking == 0, f"rank {rank}: a blocking send/recv left beside the batches"
        # the grader's byte count still holds: batch_isend_irecv calls dist.isend, the counter sees it
        assert sent == 2 * (world - 1) * numel * 4 // world


def _ring_attention_rank(impl: Adapter):
    sizes = _counting_batches()
    g = torch.Generator().manual_seed(dist.get_rank())  # host: the same draw on every machine
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))  # host: drawn with g (gloo ranks)
    with counter.count() as c:
        impl["ring_attention_forward"](q, k, v)
    return sizes, c.calls("isend"), c.calls("send") + c.calls("recv")


def test_lab06_ring_attention_passes_blocks_in_one_batch():
    world = 2
    impl = Adapter.of_file(LAB06, ("ring_attention_forward",))
    for rank, (sizes, isends, blocking) in enumerate(launch(_ring_attention_rank, world, impl)):
        # N-1 steps, each one batch: K and V sent right, the next K and V received from the left
        assert sizes == [4] * (world - 1), f"rank {rank}: batches of {sizes}"
        assert isends == 2 * (world - 1) and blocking == 0


def test_lab03_zero_buffers_follow_the_model_device():
    zero = load(LAB03)
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    unit = zero.Unit(module, 2)
    assert unit.full.device.type == "meta", "Unit.full must be made where the parameters are"


def test_graders_draw_on_the_host_and_hand_the_rank_its_device(monkeypatch):
    meta = torch.device("meta")
    for grader in (_lab03_ranks, lab04_tensor_parallel, _lab07_expert_parallel):
        monkeypatch.setattr(grader, "device", lambda: meta)
    assert lab04_tensor_parallel._randn(0, 2, 3).device == meta
    assert lab04_tensor_parallel._tokens(0, 2, 3).device == meta
    assert all(p.device == meta for p in _lab03_ranks._model("odd").parameters())
    # the same numbers on every machine: drawn on the host before the move
    cpu = _lab07_routing.tokens(4, 0)
    assert cpu.device.type == "cpu" and torch.equal(cpu, _lab07_routing.tokens(4, 0))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
