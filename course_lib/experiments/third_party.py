"""How the experiments run third-party frameworks beside course_lib: on the course's device, with their
C++ extensions built in this checkout, under ``accelerate launch`` as a learner would.

Used by the framework comparisons of lecture 09 (:mod:`course_lib.experiments.lecture09`), Megatron-Core's
tensor parallelism beside course_lib's (:mod:`course_lib.experiments.lecture02.tp_collectives`) and
transformers' quantized cache (:mod:`course_lib.experiments.lecture06.quanto_side_by_side`).

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
(``use_course_device``, ``check_engine_device``). Tested in tests/experiments/test_device_frameworks.py (the mapping,
and that the lab script's copy agrees with it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from course_lib.dist import backend, device

__all__ = ["EXTENSIONS", "ROOT", "FrameworkDevices", "accelerate_launch", "framework_devices"]

ROOT = Path(__file__).resolve().parents[2]

# Where quanto and DeepSpeed build their C++ extensions: build/ of this checkout (kept between runs: a build
# costs ~25-60 s), never ~/.cache or /tmp. TORCH_EXTENSIONS_DIR, when set, wins.
EXTENSIONS = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / "build" / "torch_extensions"))


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
