"""Train the course model with DeepSpeed ZeRO (through accelerate) and with course_lib's ZeRO, side by side.

    accelerate launch --config_file labs/accelerate/deepspeed_zero2.yaml labs/lab03_zero/train_deepspeed.py
    (deepspeed_zero1.yaml, deepspeed_zero3.yaml likewise; --steps N, --model tiny|small)

The accelerate config names a DeepSpeed JSON (``labs/deepspeed/zeroN.json``): ZeRO stage,
micro-batch, and the optimizer ("AdamW" with ``torch_adam``: torch's own AdamW, so no fused Adam
is JIT-compiled). The script trains with it, then trains ``course_lib.parallel.data.zero.Zero`` of the same
stage on the same model, data and seed in the same processes, and prints both loss curves.

On CPU the run is fp32 (DeepSpeed's CPU accelerator has no fp16, and the comparison is cleanest
without rounding). The first DeepSpeed start on a machine JIT-builds a small shared-memory
communication op (about a minute); later starts reuse the build.

Both sides run on the course's device and backend (``course_lib.dist.device()`` and ``backend()``:
CPU ranks over gloo, or one GPU per rank over NCCL), and DeepSpeed is told the same: ``DS_ACCELERATOR``
is the course device's type (:func:`use_course_device`; the rule is stated in
``course_lib/experiments/third_party.py``). Left to itself, DeepSpeed picks CUDA whenever a GPU is present and
puts rank r on cuda:r, even where the course's ranks stay on the CPU (4 ranks on a 1-GPU machine).

The functions ``train_course`` and ``train_deepspeed`` run inside an initialised process group
(``course_lib.dist.launch``, torchrun or accelerate launch): tests and benchmarks call them too.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import backend, device, shutdown
from course_lib.dist.timing import clock
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.zero import Zero

CONFIG_DIR = Path(__file__).resolve().parent.parent / "deepspeed"  # labs/deepspeed (labs/deepspeed)


def load_config(stage: int) -> dict:
    """The DeepSpeed JSON config of ``stage`` (1, 2 or 3) shipped with the course."""
    path = CONFIG_DIR / f"zero{stage}.json"
    if not path.exists():
        raise ValueError(f"no DeepSpeed config for ZeRO stage {stage!r} at {path}: the course ships stages 1, 2, 3")
    return json.loads(path.read_text())


def deepspeed_accelerator(on: torch.device) -> str:
    """DeepSpeed's name (``DS_ACCELERATOR``) for the course's device: its type, "cpu" only when the course's
    ranks compute on the CPU. The same rule as course_lib.experiments.third_party.framework_devices."""
    return torch.device(on).type


def use_course_device() -> torch.device:
    """Tell DeepSpeed the course's device before it is imported, and return that device.

    A ``DS_ACCELERATOR`` already set to something else is refused: the engine would then put the model on
    one device while the course's batches and collectives use another.
    """
    on = device()
    want = deepspeed_accelerator(on)
    have = os.environ.setdefault("DS_ACCELERATOR", want)
    if have != want:
        raise RuntimeError(
            f"DS_ACCELERATOR={have!r}, but the course's ranks compute on {on} (backend {backend()!r}): unset "
            f"DS_ACCELERATOR or set it to {want!r}; COURSE_BACKEND chooses the course's device"
        )
    return on


def check_engine_device(engine, on: torch.device) -> None:
    """DeepSpeed's engine must compute where the course's ranks do."""
    if torch.device(engine.device) != on:
        raise RuntimeError(
            f"DeepSpeed put the model on {engine.device}, the course's device is {on}: "
            f"DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r} must name {deepspeed_accelerator(on)!r}"
        )


def batches(micro_batch: int, steps: int, seed: int = 0, seq_len: int = 32):
    """This rank's part of each global batch (course_lib.data keeps global batches world-size independent)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ds = make_dataset(MarkovLanguage(), n_tokens=micro_batch * world * steps * seq_len + 1, seq_len=seq_len, seed=seed)
    return [(x.to(device()), y.to(device())) for x, y in ds.batches(micro_batch, rank, world, seed=seed)][:steps]


def _mean(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks: the number a training curve plots."""
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _model(name: str, seed: int, overrides: dict | None = None) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(configs.get(name, **(overrides or {}))).to(device())


def train_course(
    stage: int, steps: int, ds_config: dict, model: str = "tiny", seed: int = 0, overrides: dict | None = None
) -> dict:
    """course_lib ZeRO with the optimizer settings of ``ds_config``: {"losses", "step_s", "state_bytes"}."""
    opt = ds_config["optimizer"]["params"]
    net = _model(model, seed, overrides)
    zero = Zero(net, stage, lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=opt["weight_decay"])
    losses, times = [], []
    for x, y in batches(ds_config["train_micro_batch_size_per_gpu"], steps, seed):
        start = clock()
        loss = next_token_loss(net(x), y)
        loss.backward()
        zero.step()
        zero.zero_grad()
        times.append(clock() - start)
        losses.append(_mean(loss))
    return {"losses": losses, "step_s": times, "state_bytes": zero.model_state_bytes()["total"]}


def train_deepspeed(
    stage: int,
    steps: int,
    ds_config: dict | None = None,
    model: str = "tiny",
    seed: int = 0,
    overrides: dict | None = None,
) -> dict:
    """DeepSpeed ZeRO via ``deepspeed.initialize`` in this process group: {"losses", "step_s"}."""
    on = use_course_device()
    import deepspeed

    cfg = dict(ds_config or load_config(stage))
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": stage}
    net = _model(model, seed, overrides)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    check_engine_device(engine, on)
    losses, times = [], []
    for x, y in batches(cfg["train_micro_batch_size_per_gpu"], steps, seed):
        start = clock()
        loss = next_token_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(clock() - start)
        losses.append(_mean(loss))
    engine.destroy()
    return {"losses": losses, "step_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    args = parser.parse_args()

    on = use_course_device()  # before accelerate imports DeepSpeed
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, InitProcessGroupKwargs

    # Name the backend: accelerate 1.15 finds none for DeepSpeed on a machine without a GPU and then
    # reports 1 process per rank (each rank would train alone); course_lib picks gloo or nccl.
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=backend())])
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        raise SystemExit(
            "no DeepSpeed plugin: launch with --config_file labs/accelerate/deepspeed_zero{1,2,3}.yaml"
        )
    stage, ds_config = plugin.zero_stage, plugin.deepspeed_config
    say = accelerator.print
    # The device is the course's (accelerate's own guess, accelerator.device, says cuda:0 on a GPU machine
    # even where the course's ranks stay on the CPU; nothing here uses it).
    say(f"{accelerator.num_processes} ranks, {accelerator.distributed_type}, DeepSpeed ZeRO-{stage}, device {on}")

    net = _model(args.model, 0)
    engine, _ = accelerator.prepare(net, DummyOptim(net.parameters()))  # the optimizer comes from the JSON
    check_engine_device(engine, on)
    ds_losses = []
    for x, y in batches(ds_config["train_micro_batch_size_per_gpu"], args.steps):
        loss = next_token_loss(engine(x), y)
        accelerator.backward(loss)  # DeepSpeed's backward and its step
        ds_losses.append(_mean(loss))

    course = train_course(stage, args.steps, ds_config, args.model)["losses"]
    say(f"{'step':>4} {'DeepSpeed':>10} {'course_lib':>10}")
    for i, (a, b) in enumerate(zip(ds_losses, course)):
        say(f"{i:>4} {a:>10.6f} {b:>10.6f}")
    diff = max(abs(a - b) for a, b in zip(ds_losses, course))
    say(f"ZeRO-{stage}: max |loss difference| over {args.steps} steps = {diff:.2e}")
    # End while every rank is still here, as course_lib.dist.shutdown ends the course's runs. accelerate
    # lets go of DeepSpeed's engine (free_memory destroys it: ZeRO's hooks, and the garbage collection
    # DeepSpeed had paused), then garbage is collected around destroy_process_group. end_training()
    # destroyed the group with the engine, and the gloo work objects in its reference cycles, still
    # alive: freed at interpreter exit instead, they aborted a rank now and then after a correct run
    # ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    del engine
    accelerator.free_memory()
    shutdown()


if __name__ == "__main__":
    main()
