"""Lightning Fabric's DDP and torch's FSDP2 beside course_lib's DDP and ZeRO-3 (lecture 09): one model, one data
stream, one seed, through the framework's API and through course_lib's, losses and final parameters compared
bit for bit. Every framework is told the course's device
(:func:`course_lib.experiments.third_party.framework_devices`).

    fabric_versus_ddp()    Lightning Fabric's "ddp" strategy and course_lib's DDP: losses and final
                           parameters; and what Fabric's "fsdp" and "deepspeed" strategies say on a CPU
    fsdp2_versus_zero3()   torch's FSDP2 (``fully_shard`` per block) and course_lib's ZeRO-3

The shared training loop of the experiments (:mod:`course_lib.experiments.small_run`) is not used here on
purpose: each step runs the framework's own calls (``fabric.backward``, FSDP's hooks) beside course_lib's,
interleaved, and that pairing is what the comparison shows. Tested in tests/experiments/test_frameworks.py.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from course_lib.dist import device, launch
from course_lib.experiments import small_run
from course_lib.experiments.third_party import framework_devices
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.ddp import DistributedDataParallel
from course_lib.parallel.data.zero import Zero

__all__ = ["FABRIC_GPU", "fabric_versus_ddp", "fsdp2_versus_zero3"]

# What Fabric's two sharded strategies would be given on a GPU machine (a CPU refuses both, see
# fabric_versus_ddp): FSDP wrapping each transformer block, DeepSpeed ZeRO-3; bf16 mixed precision.
FABRIC_GPU = {
    "fsdp": 'Fabric(accelerator="cuda", devices=8, strategy=FSDPStrategy(auto_wrap_policy={Block}, '
    'sharding_strategy="FULL_SHARD"), precision="bf16-mixed")',
    "deepspeed": 'Fabric(accelerator="cuda", devices=8, strategy=DeepSpeedStrategy(stage=3), precision="bf16-mixed")',
}


# ----------------------------------------------------------------------------------- Lightning Fabric


def _batches(steps: int, micro_batch: int = 4, seq_len: int = 32, seed: int = 0) -> list:
    """This rank's micro-batch of each of ``steps`` global batches of the course language."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = small_run.batches(steps, micro_batch * world, seq_len, seed, rank=rank, world_size=world)
    return [(x.to(device()), y.to(device())) for x, y in mine]


def _mean_over_ranks(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _adamw(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=False)  # one arithmetic for both sides


def _refusal(make) -> str:
    """The error a Fabric strategy raises on this machine, as ``Type: message``; '' if it runs."""
    try:
        make()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _fabric_rank(steps: int, lr: float, seed: int) -> dict:
    with warnings.catch_warnings():
        # With Slurm installed (a cluster's login node), Fabric warns in every run that `srun` is on the
        # PATH but unused: its hint for a Slurm job. These ranks are course_lib's launch's, not a job's.
        warnings.filterwarnings("ignore", message="The `srun` command is available", category=Warning)
        return _fabric_and_course(steps, lr, seed)


def _fabric_and_course(steps: int, lr: float, seed: int) -> dict:
    from lightning_fabric import Fabric  # lazily: a heavy optional package

    # The refusals are asked for with accelerator="cpu" on purpose, whatever this machine has.
    # Name DeepSpeed's accelerator (as the lab script does): asked for its "deepspeed" strategy below, Fabric
    # imports DeepSpeed, which otherwise logs a time-stamped warning while guessing it.
    rule = framework_devices()
    os.environ.setdefault("DS_ACCELERATOR", rule.deepspeed)
    cfg = configs.get("tiny")
    # Fabric finds LOCAL_RANK set (course_lib's launch started this rank) and the process group up, so it
    # spawns nothing and joins the group it finds: the same 2 gloo ranks run both trainings.
    fabric = Fabric(accelerator=rule.fabric, devices=dist.get_world_size(), strategy="ddp")
    fabric.launch()
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model, opt = fabric.setup(model, _adamw(model.parameters(), lr))  # moves the model to fabric.device
    torch.manual_seed(seed)
    ours = DistributedDataParallel(Transformer(cfg).to(device()))
    our_opt = _adamw(ours.parameters(), lr)
    losses = {"Fabric ddp": [], "course_lib DDP": []}
    for x, y in _batches(steps, seed=seed):
        loss = next_token_loss(model(x), y)  # through forward: torch DDP readies its reducer there
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses["Fabric ddp"].append(_mean_over_ranks(loss))
        loss = next_token_loss(ours(x), y)
        loss.backward()
        our_opt.step()
        our_opt.zero_grad()
        losses["course_lib DDP"].append(_mean_over_ranks(loss))
    theirs = dict(model.module.named_parameters())  # Fabric's wrapper hands back the original module
    bit_equal = all(torch.equal(theirs[k], p) for k, p in ours.module.named_parameters())
    refusals = {
        "fsdp": _refusal(lambda: Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy="fsdp")),
        "deepspeed": _refusal(
            lambda: Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy="deepspeed").launch()
        ),
    }
    return {
        "strategy": type(fabric.strategy).__name__,
        "world_size": fabric.world_size,
        "wrapper": type(model._forward_module).__name__,  # what Fabric's strategy put around the model
        "losses": losses,
        "parameters_bit_equal": bit_equal,
        "refusals": refusals,
    }


def fabric_versus_ddp(steps: int = 3, lr: float = 3e-3, seed: int = 0, world_size: int = 2) -> list[dict]:
    """Lightning Fabric's DDP strategy and course_lib's DDP train the course's tiny model side by side.

    Per rank: Fabric's strategy name and world size, both loss curves (averaged over ranks), whether the
    final parameters are bit-equal, and the errors Fabric's "fsdp" and "deepspeed" strategies raise on a
    CPU. Bit-equality is expected: Fabric wraps the model in torch's DistributedDataParallel, and course_lib's
    DDP reproduces torch's buckets, pre-division by W and summing all-reduce (parallel/data/ddp.py).
    """
    return launch(_fabric_rank, world_size, steps, lr, seed, timeout=240)


# ------------------------------------------------------------------------------------ torch FSDP2


def _fsdp2_rank(steps: int, lr: float, seed: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    cfg = configs.get("tiny")
    torch.manual_seed(seed)
    fsdp = Transformer(cfg).to(device())
    for block in fsdp.layers:
        fully_shard(block)  # one unit per block: gathered before its forward/backward, freed after
    fully_shard(fsdp)  # the root: embedding, final norm, output layer
    opt = _adamw(fsdp.parameters(), lr)
    torch.manual_seed(seed)
    ours = Transformer(cfg).to(device())
    zero = Zero(ours, 3, lr=lr, weight_decay=0.1)
    losses = {"torch FSDP2": [], "course_lib ZeRO-3": []}
    for x, y in _batches(steps, seed=seed):
        loss = next_token_loss(fsdp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses["torch FSDP2"].append(_mean_over_ranks(loss))
        loss = next_token_loss(ours(x), y)
        loss.backward()
        zero.step()
        zero.zero_grad()
        losses["course_lib ZeRO-3"].append(_mean_over_ranks(loss))
    theirs = {k: v.full_tensor() for k, v in fsdp.state_dict().items()}
    mine = zero.full_parameters()
    return {"losses": losses, "parameters_bit_equal": all(torch.equal(theirs[k], mine[k]) for k in mine)}


def fsdp2_versus_zero3(steps: int = 3, lr: float = 3e-3, seed: int = 0, world_size: int = 2) -> list[dict]:
    """torch's FSDP2 (``fully_shard`` per block, then the root) and course_lib's ZeRO-3, same model and data.

    Per rank: both loss curves and whether the full parameters after ``steps`` AdamW steps are bit-equal
    (lecture 02 shows why they are at W = 2: the same shards, divisions by 2, two-term sums).
    """
    return launch(_fsdp2_rank, world_size, steps, lr, seed, timeout=240)
