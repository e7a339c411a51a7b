"""The same code on GPUs, for the parallel strategies, the model and the checkpoints: what a CPU can show.

A laptop runs every rank on the CPU over gloo, where a tensor on the wrong device, a blocking receive
crossing a send, or a CUDA call in a CPU rank all pass unnoticed. These tests make each of those
visible without a GPU:

* placement is the caller's job: Zero, DDP and the composed trainer refuse a model that is not on
  ``course_lib.dist.device()`` (a model on the ``meta`` device stands in for "not there") and say how
  to fix it, instead of silently moving the parameters and leaving the batches behind;
* crossing point-to-point messages are posted as one ``batch_isend_irecv`` (one NCCL group): the
  pipeline's 1F1B batches a send to its neighbour with the receive from it, and every ring-attention
  hop batches its sends and receives (a spy on ``dist.batch_isend_irecv`` records what was posted);
* a function given ``meta`` tensors returns ``meta`` tensors: it made its own tensors on its inputs'
  device (a CPU constant would have raised);
* offloaded ZeRO shards stay on the host, enter the checkpoint's DTensors as device copies, and what
  a load writes into such copies reaches the host shards;
* a CPU rank never asks CUDA for its random state (that opens a CUDA context on GPU 0).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from course_lib.checkpoint import resume
from course_lib.checkpoint.zero_state import load_zero_state, zero_state_dict
from course_lib.dist import device, launch
from course_lib.model import configs
from course_lib.model.moe import Routing, sequence_balance_loss
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Composed, Layout
from course_lib.parallel.context import ring_attention as ra
from course_lib.parallel.data.ddp import DistributedDataParallel
from course_lib.parallel.data.zero import Zero
from course_lib.parallel.pipeline import executor, schedules


def _refusals() -> dict[str, str]:
    """The message each wrapper gives for a model on the meta device ("" if it accepted it)."""
    out = {}
    for name, make in {
        "Zero": lambda: Zero(nn.Sequential(nn.Linear(4, 4, device="meta")), 1),
        "DDP": lambda: DistributedDataParallel(nn.Linear(4, 4, device="meta")),
        "Composed": lambda: Composed(_meta_transformer(), Layout(), 2),
    }.items():
        try:
            make()
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    return out


def _meta_transformer() -> Transformer:
    with torch.device("meta"):
        return Transformer(configs.get("tiny"))


def _offload_round_trip() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)).to(device())
    zero = Zero(model, 1, lr=1e-2, precision="bf16", offload=True)  # bf16: a master copy too
    state = zero_state_dict(zero)
    key = f"optim.{zero.units[0].name}.exp_avg"
    shared = state[key].to_local().data_ptr() == zero.exp_avg.data_ptr()  # CPU: the same tensor, no copy
    # what dcp.load does to a device copy: write into it; load_zero_state must carry it to the host shard
    copies = {}
    for k, v in state.items():
        if isinstance(v, DTensor) and k.startswith("optim."):
            local = v.to_local().clone().fill_(7.0)
            copies[k] = DTensor.from_local(
                local, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
            )
    load_zero_state(zero, {**state, **copies})
    return {
        "shared": shared,
        "host": {t.device.type for t in (zero.master, zero.exp_avg, zero.exp_avg_sq)},
        "exp_avg": zero.exp_avg.tolist(),
        "master": zero.master.tolist(),
    }


def _one_rank() -> tuple[dict, dict]:
    return _refusals(), _offload_round_trip()


def test_placement_is_the_callers_job_and_offloaded_shards_come_home():
    refusals, offload = launch(_one_rank, 1, timeout=120)[0]
    for name, message in refusals.items():
        assert message, f"{name} accepted a model on the meta device: it must refuse a model off device()"
        assert "course_lib.dist.device()" in message and "meta" in message, (
            f"{name}'s refusal must say where the model is and name the fix (model.to(course_lib.dist.device())): "
            f"{message!r}"
        )
    assert offload["host"] == {"cpu"}, f"offloaded master weights and moments must stay on the host: {offload['host']}"
    assert offload["shared"], "on a CPU rank the checkpoint's DTensors must be Zero's own buffers (no copy)"
    assert set(offload["exp_avg"]) == {7.0} and set(offload["master"]) == {7.0}, (
        "load_zero_state must copy what dcp.load wrote into the device copies back to the host shards"
    )


# ------------------------------------------------------------------ crossing sends, batched


def _spy() -> list[list[tuple[str, int]]]:
    """Record every batch posted through dist.batch_isend_irecv as [(send | recv, peer), ...]."""
    batches, original = [], dist.batch_isend_irecv

    def spy(ops):
        batches.append([("send" if "isend" in op.op.__name__ else "recv", op.peer) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = spy
    return batches


def _two_ranks() -> dict:
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    batches = _spy()
    blocking = []
    for name in ("recv", "send"):  # a blocking call would cross a send under NCCL
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _n=name, _o=original, **k: (blocking.append(_n), _o(*a, **k))[1])

    torch.manual_seed(0)
    stage = nn.Linear(8, 8).to(device())
    xs = [torch.randn(2, 8, device=device()) for _ in range(4)]
    schedule = schedules.build("1f1b", 2, 4)
    executor.run_step(schedule, {rank: stage}, xs, xs, lambda y, t: (y - t).pow(2).mean(), (2, 8))
    pipeline = list(batches)

    batches.clear()
    q, k, v = (torch.randn(1, 2, 4, 8, device=device(), requires_grad=True) for _ in range(3))
    ra.ring_attention(q, k, v).sum().backward()
    return {"pipeline": pipeline, "ring": list(batches), "blocking": blocking, "other": other}


def test_crossing_messages_are_posted_as_one_batch():
    for rank, r in enumerate(launch(_two_ranks, 2, timeout=120)):
        other = r["other"]
        assert not r["blocking"], f"rank {rank} called blocking {r['blocking']}: post p2p through batch_isend_irecv"
        crossing = [b for b in r["pipeline"] if ("send", other) in b and ("recv", other) in b]
        assert crossing, (
            f"rank {rank}: 1F1B's steady state sends to its neighbour and then receives from it; the two must be "
            f"posted in one batch (NCCL deadlocks on a crossing pair otherwise). Batches: {r['pipeline']}"
        )
        assert r["ring"] and all({"send", "recv"} == {kind for kind, _ in b} for b in r["ring"]), (
            f"rank {rank}: each ring hop must post its sends and receives together: {r['ring']}"
        )


# ------------------------------------------------------------------ tensors made on the inputs' device


def test_sequence_balance_loss_counts_on_the_routings_device():
    t, k, e, s = 8, 2, 4, 4
    routing = Routing(
        *(torch.empty(t, k, dtype=dt, device="meta") for dt in (torch.long, torch.float, torch.bool)),
        torch.empty(t, e, device="meta"),
        torch.empty(t, e, device="meta"),
    )
    assert sequence_balance_loss(routing, e, s).device.type == "meta", "the counts must be made on the routing's device"


def test_ring_positions_are_made_on_the_sharded_tensors_device():
    assert ra.positions(8, 1, 2, device="meta").device.type == "meta"
    x = torch.arange(8.0).view(1, 8, 1)
    assert ra.shard(x, 1, 2, dim=1).flatten().tolist() == [2.0, 3.0, 4.0, 5.0]


def test_a_cpu_rank_never_asks_cuda_for_its_random_state(monkeypatch):
    if device().type != "cpu":  # an accelerator's rank: its own generator's state is saved
        assert device().type in pickle.loads(resume.rng_state()), "the accelerator's RNG state is missing"
        return

    def no_cuda(*args, **kwargs):
        raise AssertionError("rng_state() asked CUDA for its state on a CPU rank: that opens a CUDA context")

    # a machine with a GPU that this run does not use (COURSE_BACKEND=gloo, or more ranks than GPUs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_cuda)
    resume.set_rng_state(resume.rng_state())
