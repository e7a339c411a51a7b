"""DeepSpeed ZeRO under ``accelerate launch`` beside course_lib's ZeRO (lecture 09; Rajbhandari et al., *ZeRO*,
2020): one model, one data stream, one seed, through DeepSpeed and through course_lib, in the same processes,
with both loss curves and a census of the model-state bytes each rank holds
(:func:`course_lib.dist.census.held_bytes`, the same count for both).

This file is also the program :func:`deepspeed_versus_zero` launches:
``accelerate launch --config_file solutions/accelerate/deepspeed_zero2.yaml -m course_lib.experiments.lecture09.deepspeed_vs_zero``.
It reuses the lab 3 script (solutions/lab03_zero/train_deepspeed.py: its data, model and course-side
training loop), so the lecture, the lab and tests/experiments/test_deepspeed.py train exactly the same thing. Every
framework is told the course's device (:func:`course_lib.experiments.third_party.framework_devices`).

Lightning Fabric and torch's FSDP2 are :mod:`course_lib.experiments.lecture09.fabric_fsdp_vs_course`; the
pipeline (:mod:`course_lib.experiments.lecture03.pipeline_runs`), Megatron-Core TP
(:mod:`course_lib.experiments.lecture02.tp_collectives`) and vLLM (``inference.vllm``) comparisons live with
their own subjects. Tested in tests/experiments/test_frameworks.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch.distributed as dist

from course_lib.dist import shutdown
from course_lib.dist.census import held_bytes
from course_lib.experiments.third_party import ROOT, accelerate_launch, framework_devices

__all__ = ["deepspeed_versus_zero"]

LAB03_SCRIPT = ROOT / "solutions" / "lab03_zero" / "train_deepspeed.py"
RESULT = "FRAMEWORKS_RESULT "  # the line the launched program's rank 0 prints its JSON result on


def deepspeed_versus_zero(stage: int = 2, steps: int = 4, timeout: float = 300) -> dict:
    """DeepSpeed ZeRO-``stage`` under accelerate launch (2 CPU ranks) and course_lib's ZeRO-``stage``.

    Returns {"ranks", "distributed_type", "stage", "deepspeed": {"losses", "state_bytes"},
    "course": {"losses", "state_bytes"}, "n_params", "stdout"}; ``state_bytes`` is per rank, a census of
    the distinct storages reachable from the model and the optimizer after ``steps`` steps.
    """
    config = f"solutions/accelerate/deepspeed_zero{stage}.yaml"
    out = accelerate_launch(
        "course_lib.experiments.lecture09.deepspeed_vs_zero",
        "--steps",
        steps,
        config=config,
        module=True,
        timeout=timeout,
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
    # End as the lab's train_deepspeed.py does, and says why: accelerate lets go of the engine (and
    # destroys it), then course_lib.dist.shutdown collects garbage around destroy_process_group.
    del engine, zero_opt, master
    accelerator.free_memory()
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
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO beside course_lib ZeRO (run under accelerate launch)")
    parser.add_argument("--steps", type=int, default=4)
    _deepspeed_main(parser.parse_args().steps)


if __name__ == "__main__":
    main()
