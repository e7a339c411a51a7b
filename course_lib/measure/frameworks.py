"""Frameworks beside course_lib (lecture 09): one model, one data stream, one seed, through a framework's
API and through course_lib's, with the results side by side.

    deepspeed_versus_zero(stage)   DeepSpeed ZeRO under ``accelerate launch`` (the course's shipped config,
                                   solutions/accelerate/deepspeed_zeroN.yaml) and course_lib's ZeRO, in the
                                   same processes: both loss curves and a census of the model-state bytes
                                   each rank holds (course_lib.dist.census.held_bytes, the same count for both)
    fabric_versus_ddp()            Lightning Fabric's "ddp" strategy and course_lib's DDP: losses and final
                                   parameters; and what Fabric's "fsdp" and "deepspeed" strategies say on a CPU
    fsdp2_versus_zero3()           torch's FSDP2 (``fully_shard`` per block) and course_lib's ZeRO-3
    accelerate_launch(...)         run a script or module under ``accelerate launch`` as a learner would

The pipeline (``measure.pipeline.versus_torch``), Megatron-Core TP (``measure.tensor_parallel.
versus_megatron_core``) and vLLM (``inference.vllm``) comparisons live with their own subjects.

This file is also the program ``deepspeed_versus_zero`` launches:
``accelerate launch --config_file solutions/accelerate/deepspeed_zero2.yaml -m course_lib.measure.frameworks``.
It reuses the lab 3 script (solutions/lab03_zero/train_deepspeed.py: its data, model and course-side
training loop), so the lecture, the lab and tests/test_deepspeed.py train exactly the same thing.

**One rule for the device of every side-by-side** (:func:`framework_devices`): the course decides, once,
in :mod:`course_lib.dist.runtime` — ``device()`` (cpu under gloo, cuda:<local rank> under NCCL) and
``backend()`` — and every framework is told that choice instead of guessing its own:

    course (device, backend)   DeepSpeed DS_ACCELERATOR   accelerate backend   Fabric accelerator   Megatron init
    cpu, gloo                  "cpu"                      "gloo"               "cpu"                on the CPU
    cuda:r, nccl               "cuda"                     "nccl"               "cuda"               on cuda:r

Left alone, DeepSpeed (and accelerate) pick CUDA whenever a GPU is visible and put rank r on cuda:r:
on a 1-GPU machine running 2 ranks, where the course keeps its ranks on the CPU over gloo (NCCL refuses
two ranks on one GPU), rank 1 would ask for a cuda:1 that does not exist, and rank 0 would train on the
GPU while the course's batches sit on the CPU. The lab script applies the rule before DeepSpeed is
imported and checks that the engine landed on the course's device
(``use_course_device``, ``check_engine_device``); tests/test_device_frameworks.py checks the mapping
and that the lab script's copy agrees with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import backend, device, launch
from course_lib.dist.census import held_bytes
from course_lib.measure.quantized_kv import EXTENSIONS
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.ddp import DistributedDataParallel
from course_lib.parallel.data.zero import Zero

__all__ = [
    "FABRIC_GPU",
    "FrameworkDevices",
    "accelerate_launch",
    "deepspeed_versus_zero",
    "fabric_versus_ddp",
    "framework_devices",
    "fsdp2_versus_zero3",
]

ROOT = Path(__file__).resolve().parents[2]
LAB03_SCRIPT = ROOT / "solutions" / "lab03_zero" / "train_deepspeed.py"
RESULT = "FRAMEWORKS_RESULT "  # the line the launched program's rank 0 prints its JSON result on

# What Fabric's two sharded strategies would be given on a GPU machine (a CPU refuses both, see
# fabric_versus_ddp): FSDP wrapping each transformer block, DeepSpeed ZeRO-3; bf16 mixed precision.
FABRIC_GPU = {
    "fsdp": 'Fabric(accelerator="cuda", devices=8, strategy=FSDPStrategy(auto_wrap_policy={Block}, '
    'sharding_strategy="FULL_SHARD"), precision="bf16-mixed")',
    "deepspeed": 'Fabric(accelerator="cuda", devices=8, strategy=DeepSpeedStrategy(stage=3), precision="bf16-mixed")',
}


# ------------------------------------------------------------------------------- the device rule


@dataclass(frozen=True)
class FrameworkDevices:
    """What each framework is told so that it computes where the course's ranks do (module doc)."""

    device: torch.device  # where both sides' models and batches live
    backend: str  # the process group's backend (accelerate's InitProcessGroupKwargs)
    deepspeed: str  # DS_ACCELERATOR
    fabric: str  # Lightning Fabric's accelerator=
    megatron_cpu_init: bool  # Megatron-Core's ModelParallelConfig(use_cpu_initialization=)


def framework_devices(on: torch.device | str | None = None, backend_name: str | None = None) -> FrameworkDevices:
    """The rule of the module doc, as a pure function of the course's choice (default: this rank's
    ``course_lib.dist.device()`` and ``backend()``). A CPU device goes with gloo and an accelerator with
    its own backend; any other pair is refused, since no framework could then agree with both."""
    on = device() if on is None else torch.device(on)
    backend_name = backend() if backend_name is None else backend_name
    if (on.type == "cpu") != (backend_name == "gloo"):
        raise ValueError(
            f"device {on} with backend {backend_name!r}: the course pairs the CPU with gloo and an accelerator with "
            "its own backend (nccl for CUDA); take both from course_lib.dist (device(), backend())"
        )
    return FrameworkDevices(on, backend_name, on.type, on.type, on.type == "cpu")


# ------------------------------------------------------------------------------- accelerate launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(
    target: str, *args, config: str, module: bool = False, num_processes: int | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG [-m] TARGET ARGS`` from the repository root; its output.

    A free port each time (two launches never collide), the temp folder under build/tmp/ (inherited
    when the caller's TMPDIR already is, as under ./course and pytest), and torch's JIT-built C++ ops
    (DeepSpeed's shared-memory op) cached in build/torch_extensions/ beside quanto's: the first start
    builds it (about a minute), later ones load it. A non-zero exit raises with the output's tail.
    """
    env = dict(os.environ)
    tmp = Path(env.get("TMPDIR", tempfile.gettempdir())).resolve()
    own_tmp = ROOT / "build" not in tmp.parents  # then a folder of our own under build/tmp/, removed after
    if own_tmp:
        (ROOT / "build" / "tmp").mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="frameworks-", dir=ROOT / "build" / "tmp"))
    env.update(TMPDIR=str(tmp), TORCH_EXTENSIONS_DIR=env.get("TORCH_EXTENSIONS_DIR", str(EXTENSIONS)))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    cmd += ["--main_process_port", str(_free_port()), *(["-m"] if module else []), target, *map(str, args)]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        if own_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:])} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out


def deepspeed_versus_zero(stage: int = 2, steps: int = 4, timeout: float = 300) -> dict:
    """DeepSpeed ZeRO-``stage`` under accelerate launch (2 CPU ranks) and course_lib's ZeRO-``stage``.

    Returns {"ranks", "distributed_type", "stage", "deepspeed": {"losses", "state_bytes"},
    "course": {"losses", "state_bytes"}, "n_params", "stdout"}; ``state_bytes`` is per rank, a census of
    the distinct storages reachable from the model and the optimizer after ``steps`` steps.
    """
    config = f"solutions/accelerate/deepspeed_zero{stage}.yaml"
    out = accelerate_launch(
        "course_lib.measure.frameworks", "--steps", steps, config=config, module=True, timeout=timeout
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if len(lines) != 1:
        raise RuntimeError(f"expected one {RESULT.strip()} line from rank 0:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return {**json.loads(lines[0][len(RESULT) :]), "stdout": out.stdout}


def _lab03():
    """solutions/lab03_zero/train_deepspeed.py as a module (a script, not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("train_deepspeed", LAB03_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _per_rank(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _deepspeed_main(steps: int) -> None:
    """The launched side of deepspeed_versus_zero: runs on every rank under accelerate launch."""
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, InitProcessGroupKwargs

    lab = _lab03()
    rule = framework_devices()
    on = lab.use_course_device()  # DS_ACCELERATOR = rule.deepspeed, before accelerate imports DeepSpeed
    # Name the backend: accelerate 1.15 finds none for DeepSpeed on a CPU-only machine and would report
    # one process per rank (see the lab script); course_lib picks gloo or nccl.
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=rule.backend)])
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        raise SystemExit("no DeepSpeed plugin: launch with --config_file solutions/accelerate/deepspeed_zeroN.yaml")
    stage, ds_config = plugin.zero_stage, plugin.deepspeed_config
    net = lab._model("tiny", 0)
    n_params = sum(p.numel() for p in net.parameters())
    engine, _ = accelerator.prepare(net, DummyOptim(net.parameters()))  # the optimizer is the JSON's
    lab.check_engine_device(engine, on)
    losses = []
    for x, y in lab.batches(ds_config["train_micro_batch_size_per_gpu"], steps):
        loss = lab.next_token_loss(engine(x), y)
        accelerator.backward(loss)  # DeepSpeed's backward and its optimizer step
        losses.append(lab._mean(loss))
    # What DeepSpeed holds: the module's parameters and gradients, and its ZeRO optimizer object (flat fp32
    # partitions, gradient partitions, the wrapped torch optimizer's moments), each storage counted once.
    zero_opt = engine.optimizer
    master = getattr(zero_opt, "single_partition_of_fp32_groups", None) or getattr(
        zero_opt, "fp32_partitioned_groups_flat", []
    )
    ds_bytes = _per_rank(
        {
            "total": held_bytes(engine.module, zero_opt, max_depth=8),
            "module": held_bytes(engine.module),  # parameters and any .grad
            "fp32 master partition": held_bytes(master),
        }
    )
    course = lab.train_course(stage, steps, ds_config, "tiny")
    course_bytes = _per_rank(course["state_bytes"])
    accelerator.wait_for_everyone()
    engine.destroy()  # release ZeRO's hooks while every rank is still here (see the lab script)
    if accelerator.is_main_process:
        result = {
            "ranks": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "device": str(on),
            "stage": stage,
            "n_params": n_params,
            "deepspeed": {"losses": losses, "state_bytes": ds_bytes},
            "course": {"losses": course["losses"], "state_bytes": course_bytes},
        }
        print(RESULT + json.dumps(result), flush=True)
    accelerator.end_training()


# ----------------------------------------------------------------------------------- Lightning Fabric


def _batches(steps: int, micro_batch: int = 4, seq_len: int = 32, seed: int = 0) -> list:
    """This rank's micro-batch of each of ``steps`` global batches of the course language."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = make_dataset(
        MarkovLanguage(), n_tokens=micro_batch * world * steps * seq_len + 1, seq_len=seq_len, seed=seed
    )
    return [(x.to(device()), y.to(device())) for x, y in data.batches(micro_batch, rank, world, seed=seed)][:steps]


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


def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO beside course_lib ZeRO (run under accelerate launch)")
    parser.add_argument("--steps", type=int, default=4)
    _deepspeed_main(parser.parse_args().steps)


if __name__ == "__main__":
    main()
