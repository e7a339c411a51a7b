"""The course's ZeRO as a DCP state dict of DTensors: saved sharded, loaded at any world size.

:class:`course_lib.parallel.data.zero.Zero` keeps each unit's parameters in one flat buffer of
``numel`` elements padded to ``padded = c·N``, ``c = ceil(numel/N)``; rank r owns elements
``[r·c, (r+1)·c)``, the fp32 master weights and Adam moments of that slice included. Cut off the
padding and this is exactly how a DTensor with placement ``Shard(0)`` on a 1-D mesh of N ranks
splits a vector of ``numel`` elements: torch.chunk's rule, chunks of ``ceil(numel/N)`` with the
last ones short or empty (the docstring of ``torch.distributed.tensor.Shard``: "follows the
``torch.chunk(dim)`` semantic"; it also warns that uneven sharding is experimental, which is why
``tests/checkpoint/test_checkpoint.py`` checks the rule against torch.chunk and ``distribute_tensor``). So each of
Zero's shards *is* the local tensor of a DTensor over the unpadded unit, and DCP, which reshards
DTensors, reshards ZeRO: a checkpoint written by 4 ranks loads on 2, each reading the ranges its
new shard covers.

The DTensors made here are views of Zero's own buffers, so ``dcp.load`` writes straight into the
optimizer (no second copy of the state); :func:`load_zero_state` then re-forms what Zero derives
from the shards (stages 1-2 keep every parameter: all-gathered again).

One exception, ZeRO-Offload (``Zero(..., offload=True)``): the master weights and Adam moments stay
on the host on purpose, while a DTensor's local tensor must sit on its mesh's device (the mesh is
Zero's group, NCCL's GPUs), where ``full_tensor`` all-gathers it. Those entries are therefore
*copies* on ``zero.device`` (on a CPU-only machine the same tensors, no copy), and
:func:`load_zero_state` copies what ``dcp.load`` wrote into them back to the host shards.

Entries, for each unit u (``layers.0``, ...):

    model.<u>                flat parameters in compute precision (bf16 or fp32)
    optim.<u>.master         fp32 master weights (only when Zero keeps them: bf16 or offload)
    optim.<u>.exp_avg        Adam's m, fp32
    optim.<u>.exp_avg_sq     Adam's v, fp32
    optim.step               AdamW's step count t (its bias corrections use it)

Stage 0 (no sharding) gives replicated DTensors: DCP writes them once, every rank reads them whole.
This module only reads Zero's layout (its units' ``numel``, ``shard_numel`` and ``in_local``,
``Zero.shard_index`` and ``Zero.param_shard_of``); zero.py itself knows nothing of checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from course_lib.parallel.data.zero import Zero


def _mesh(zero: Zero) -> DeviceMesh:
    group = zero.group if zero.group is not None else dist.group.WORLD
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(
            "checkpointing a Zero over a sub-group (data parallel inside a larger mesh) is not supported "
            "here: DCP would see the same keys from every data-parallel group; run Zero on the whole world"
        )
    return DeviceMesh.from_group(group, zero.device.type)


def _real(zero: Zero, u) -> tuple[int, int]:
    """(first element, count) of the unpadded unit that this rank's shard holds."""
    if zero.stage == 0:
        return 0, u.numel
    start = zero.shard_index * u.shard_numel
    return start, max(0, min(u.shard_numel, u.numel - start))


def zero_state_dict(zero: Zero) -> dict:
    """{key: DTensor view of Zero's buffers, or the step count}: the entries listed in the module doc."""
    mesh = _mesh(zero)
    placement = [Replicate()] if zero.stage == 0 else [Shard(0)]
    state = {}
    for u in zero.units:
        _, count = _real(zero, u)

        def dtensor(local_shard: torch.Tensor, u=u, count=count) -> DTensor:
            # an offloaded (host) shard is copied to the mesh's device (module doc); else .to is the tensor itself
            local = local_shard[:count].to(zero.device)
            # run_check=False: the shape is stated, not gathered; the shards are uneven (torch.chunk's rule)
            return DTensor.from_local(local, mesh, placement, run_check=False, shape=torch.Size([u.numel]), stride=(1,))

        state[f"model.{u.name}"] = dtensor(zero.param_shard_of(u))
        if zero.master is not None:
            state[f"optim.{u.name}.master"] = dtensor(u.in_local(zero.master))
        state[f"optim.{u.name}.exp_avg"] = dtensor(u.in_local(zero.exp_avg))
        state[f"optim.{u.name}.exp_avg_sq"] = dtensor(u.in_local(zero.exp_avg_sq))
    state["optim.step"] = zero.step_count
    return state


@torch.no_grad()
def load_zero_state(zero: Zero, state: dict) -> None:
    """After ``dcp.load`` filled ``state`` (from :func:`zero_state_dict` of this ``zero``): restore
    the step count, and for stages 1-2 all-gather the loaded parameter shards into the full buffers
    the forward pass reads. Stage 3 keeps only its shard; stage 0 loaded every element. Collective.
    Offloaded shards, which ``state`` holds as device copies (module doc), are copied back to the host."""
    zero.step_count = int(state["optim.step"])
    for u in zero.units:
        _, count = _real(zero, u)
        for name, host in (("master", zero.master), ("exp_avg", zero.exp_avg), ("exp_avg_sq", zero.exp_avg_sq)):
            loaded = state.get(f"optim.{u.name}.{name}")
            if host is None or not isinstance(loaded, DTensor):
                continue
            mine = u.in_local(host)[:count]
            if loaded.to_local().data_ptr() != mine.data_ptr():  # a copy: the shard lives elsewhere
                mine.copy_(loaded.to_local())
    if zero.stage in (1, 2):
        for u in zero.units:
            dist.all_gather_single(u.full, zero.param_shard_of(u), group=zero.group)


@torch.no_grad()
def full_state(zero: Zero) -> dict[str, torch.Tensor]:
    """{key: the whole unpadded vector}, gathered on every rank (collective): for comparing a run's
    state with another's, or with a checkpoint read by :func:`course_lib.checkpoint.sharded.read_full`."""
    out = {}
    for key, value in zero_state_dict(zero).items():
        out[key] = value.full_tensor().clone() if isinstance(value, DTensor) else value
    return out
