"""The one place where the course chooses a device and a communication backend.

Everything else in ``course_lib`` asks this module for ``device()`` and never mentions CUDA, NCCL
or gloo itself, so the same code runs on a 2-core laptop (CPU ranks talking over gloo) and on GPUs
(NCCL), unchanged.

The rule:
    * an accelerator present and one device per local rank  ->  its default backend ("nccl" for
      CUDA), device <type>:<local rank>
    * otherwise                                               ->  backend "gloo", device cpu

The accelerator is asked through ``torch.accelerator`` (device-agnostic PyTorch, lecture 07), and
its collective backend through ``torch.distributed.get_default_backend_for_device``: CUDA gives
NCCL, Intel's XPU gives XCCL, and an out-of-tree device that registers itself (Huawei's
``torch_npu`` registers "npu" with the HCCL backend) is picked up the same way, with no change here.
NCCL refuses to put two ranks on one GPU, which is why a 1-GPU machine running 4 ranks falls back
to gloo+cpu. ``COURSE_BACKEND=gloo`` (or the accelerator's backend, such as ``nccl``) overrides
the rule, for example to run CPU ranks on a GPU machine.

Two ways in, one initialisation path:
    * ``course_lib.dist.launch`` spawns ranks itself and calls :func:`init` with a store;
    * a script started by ``accelerate launch`` or ``torchrun`` calls :func:`init` with no
      arguments; it reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment those
      launchers set.
"""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


def local_world_size() -> int:
    """Ranks on this machine (launchers set LOCAL_WORLD_SIZE; a lone process counts as 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def accelerator_type() -> str | None:
    """The accelerator's device type ("cuda", "xpu", "npu", ...), or None on a CPU-only machine."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def _accelerator_backend() -> str | None:
    kind = accelerator_type()
    return None if kind is None else dist.get_default_backend_for_device(kind)


def backend() -> str:
    """The accelerator's backend ("nccl" on CUDA) when every local rank can have a device of its own,
    "gloo" otherwise."""
    native = _accelerator_backend()
    forced = os.environ.get("COURSE_BACKEND")
    if forced:
        allowed = ["gloo", native or "nccl"]
        if forced not in allowed:
            raise ValueError(f"COURSE_BACKEND={forced!r}: use {' or '.join(repr(a) for a in allowed)}")
        return forced
    if native is not None and torch.accelerator.device_count() >= local_world_size():
        return native
    return "gloo"


def device() -> torch.device:
    """The device this rank computes on: its own accelerator under the accelerator's backend, the CPU
    under gloo."""
    if backend() != "gloo":
        return torch.device(accelerator_type() or "cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def synchronize() -> None:
    """Wait for queued device work (a no-op on CPU) — needed before reading a wall clock."""
    if device().type != "cpu":
        torch.accelerator.synchronize(device())


def init(
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the process group; with no arguments, from a launcher's environment variables.

    ``timeout_s`` bounds every collective: a rank waiting longer raises instead of hanging.
    Already initialised (for example by accelerate's ``PartialState``)? Then nothing is done.
    """
    if dist.is_initialized():
        return
    if rank is None:
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"course_lib.dist.init() found no launcher environment (missing {', '.join(missing)}): "
                "start the script with `accelerate launch` or `torchrun`, or run the function with "
                "course_lib.dist.launch(fn, world_size)"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # gloo picks a network interface by resolving the host name; on a laptop or a container that
    # can be an unreachable address. Loopback is always right for single-machine runs.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    be = backend()
    if be != "gloo":
        torch.accelerator.set_device_index(device().index)
    dist.init_process_group(
        be,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def shutdown() -> None:
    """Leave the process group (safe to call twice).

    Garbage is collected first: reference cycles (a DDP bucket's future whose callback refers back to
    the bucket, say) keep gloo work objects and their tensors alive until the interpreter's final
    collection, and gloo's threads releasing them then, with the interpreter half torn down, abort
    the process ("terminate called without an active exception", SIGABRT after the script's last
    line: measured 3 of 8 lab 02 runs under accelerate launch, none of 18 with the collection;
    pytorch/pytorch#179291 describes the same race).
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
