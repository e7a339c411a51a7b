"""Lab 11: a training loop that survives faults, and proves it.

You complete the marked functions (Tasks 1-5); everything else is given. The grader does not read
your code: it attacks it. It SIGKILLs a rank at a random step and restarts the job, kills a save
half-way, hands you truncated and altered shards, makes one rank's loss NaN, resumes your 2-rank
checkpoint on 1 rank, and runs you twice in deterministic mode. See README.md for the points.

The set-up: the tiny course model (22,688 parameters), data parallel over the ranks with AdamW and
a warm-up + cosine schedule, on the course's synthetic language. "Token dropout" replaces 10% of
the input tokens with random ones drawn from each rank's torch generator, so that a resumed run
that forgets a random state differs as visibly as one that forgets the weights.

Checkpoints go through ``torch.distributed.checkpoint`` (DCP, lecture 08): ``write_shards`` and
``read_shards`` below are given. DCP writes each rank's shard and an index, but promises neither
atomicity nor integrity: that is your commit protocol (Task 1).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import random
import shutil
import statistics
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from course_lib import dist as cdist
from course_lib.checkpoint.commit import fsync_dir  # given: fsync a directory, so a rename in it is durable
from course_lib.checkpoint.commit import sha256 as sha256_file  # given: the hex sha256 of a file's bytes
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.model import config as configs
from course_lib.model.transformer import Transformer
from course_lib.optim.schedules import warmup_cosine_lambda

MODEL = dict(d_model=32, d_ff=64, n_heads=4, n_kv_heads=2, max_seq_len=16)  # 22,688 parameters
SEQ_LEN, N_SEQ, GLOBAL_BATCH, DATA_SEED = 16, 48, 8, 7  # 6 steps per epoch
LR, WEIGHT_DECAY, WARMUP_STEPS, TOTAL_STEPS = 3e-3, 0.1, 3, 24
GUARD = dict(factor=3.0, window=20, min_history=3)  # skip a loss above 3x the median of the last 20
MANIFEST = "MANIFEST.json"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint whose files do not match its manifest, or that has none."""


# ------------------------------------------------------------------------------------- given


def make_model() -> Transformer:
    """The tiny course model, initialised from torch's global generator (seed it first)."""
    return Transformer(configs.get("tiny", **MODEL))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)


def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over 3 steps, cosine decay to 10% at step 24 (course_lib.optim.schedules)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_lambda(WARMUP_STEPS, TOTAL_STEPS))


def batches_from(step: int, rank: int, world_size: int):
    """This rank's (x, y) for steps ``step``, ``step + 1``, ... (forever, epoch after epoch).

    Global batches of 8 sequences in an order fixed by DATA_SEED: the batch of step s is the same
    at any world size (rank r gets rows [r·8/N, (r+1)·8/N) of it). Pass the step to resume from.
    """
    if GLOBAL_BATCH % world_size:
        raise ValueError(f"the global batch {GLOBAL_BATCH} does not split over {world_size} ranks: use 1, 2, 4 or 8")
    data = make_dataset(MarkovLanguage(), N_SEQ * SEQ_LEN + 1, SEQ_LEN, seed=DATA_SEED)
    stream = data.batches(GLOBAL_BATCH // world_size, rank, world_size, seed=DATA_SEED, epochs=None)
    return itertools.islice(stream, step, None)


def augment(x: torch.Tensor, p: float = 0.1) -> torch.Tensor:
    """Token dropout: replace a fraction p of the tokens by random ones, from torch's global generator."""
    # host: batches come on the CPU, and the CPU generator's state is what the checkpoint saves and restores
    mask = torch.rand(x.shape) < p
    return torch.where(mask, torch.randint(0, 16, x.shape), x)  # host: as the mask, from the CPU generator


def compute_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's mean next-token cross-entropy on its micro-batch. (The grader wraps this function.)"""
    return model.loss(x, y)


def write_shards(state: dict, directory: Path) -> None:
    """DCP's save of ``state`` into ``directory``: every rank writes its own ``__<rank>_0.distcp``, rank 0
    also ``.metadata``. Collective. ``sync_files``: each file is fsynced before the call returns.
    (The grader wraps this function to kill a save half-way.)"""
    dcp.save(state, storage_writer=FileSystemWriter(directory, sync_files=True))


def read_shards(state: dict, directory: Path) -> None:
    """DCP's load into ``state`` in place: tensors are filled, other values replaced. Collective."""
    dcp.load(state, storage_reader=FileSystemReader(str(directory)))


def summary(model, optimizer, scheduler, guard, step, losses, batches, optimizer_steps, resumed_from) -> dict:
    """What the grader compares between runs (returned by ``train``)."""
    return {
        "step": step,
        "losses": dict(losses),
        "skipped": list(guard.skipped),
        "optimizer_steps": optimizer_steps,
        "resumed_from": resumed_from,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": optimizer.state_dict()["state"],
        "lr": scheduler.get_last_lr(),
        "guard": guard.state_dict(),
        "next_batch": next(batches),
        "rng": (torch.rand(4), random.random()),  # host: the CPU generator's next draws, restored on resume
    }


# ------------------------------------------------------------------- Task 1: the atomic commit


def step_dir(root, step: int) -> Path:
    """``<root>/step_00000012``: names sort in step order."""
    return Path(root) / f"step_{step:08d}"


def commit_checkpoint(root, step: int, state: dict, keep: int) -> Path:
    """Save ``state`` as ``<root>/step_XXXXXXXX`` atomically, then keep only the newest ``keep``. Collective.

    1. write the shards into a temporary directory (a name ``latest_checkpoint`` ignores);
    2. when every rank's shard is on disk, write ``MANIFEST.json`` there: {"step": step, "files":
       {name: {"bytes": size, "sha256": hex digest}} for every other file}, fsynced;
    3. rename the directory to its final name and fsync ``root``: the checkpoint now exists, whole;
    4. remove all but the newest ``keep`` committed checkpoints, and leftovers of saves that died.
    No rank may return before the checkpoint is committed. Returns the final directory.
    """
    raise NotImplementedError('Task 1: atomic commit (temp directory, manifest with checksums, rename), keep the last n')


def committed_checkpoints(root) -> list[Path]:
    """The ``step_XXXXXXXX`` directories under ``root``, oldest first (given)."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def verify_checkpoint(path) -> dict:
    """Check every file of ``path`` against its manifest; return the manifest.

    Raise :class:`CorruptCheckpointError` when the manifest is missing, or a file is missing, has
    another size (truncated, appended) or another sha256 (altered). The message must name the file.
    """
    raise NotImplementedError('Task 1: verify a checkpoint against its manifest, naming the bad file')


def latest_checkpoint(root) -> Path | None:
    """The newest checkpoint under ``root`` that passes :func:`verify_checkpoint`, or None."""
    raise NotImplementedError('Task 1: the newest committed checkpoint that verifies')


# --------------------------------------------------------------------------- Task 2: resume


def capture(model, optimizer, scheduler, guard, step: int) -> dict:
    """Everything a resumed run needs, as a state dict for DCP.

    Tensors as tensors (the model's and the optimizer's, from ``get_state_dict``: it also creates
    the optimizer's state when the optimizer has not stepped yet, so a fresh one can be loaded
    into). The rest — the step (the data position), the scheduler, the guard and this rank's
    random states (torch, Python's ``random``) — pickled under a key of this rank's own.
    """
    raise NotImplementedError("Task 2: the state to save: model, optimizer, schedule, guard, step and this rank's RNGs")


def restore(path, model, optimizer, scheduler, guard) -> int:
    """Load the checkpoint at ``path`` into the objects and this rank's random states; return its step.

    Verify the checkpoint first. Collective.
    """
    raise NotImplementedError('Task 2: verify, read, and put every piece back; return the step to resume from')


# ------------------------------------------------------------------- Task 3: the spike guard


class SpikeGuard:
    """skip ⇔ the loss is NaN or ±inf, or (at least ``min_history`` accepted losses are known and
    the loss exceeds ``factor`` × their median). ``history``: the last ``window`` *accepted* losses.

    ``check(loss)`` returns True to take the step; False to skip it, recording the call's number
    (0, 1, 2, ...) in ``skipped``. Every rank must decide the same: pass the mean over the ranks.
    """

    def __init__(self, factor: float, window: int, min_history: int):
        self.factor, self.window, self.min_history = factor, window, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.calls = 0
        self.skipped: list[int] = []

    def check(self, loss: float) -> bool:
        raise NotImplementedError('Task 3: skip a non-finite loss or one above factor x the median of the history')

    def state_dict(self) -> dict:
        return {"history": list(self.history), "calls": self.calls, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.calls, self.skipped = state["calls"], list(state["skipped"])


# --------------------------------------------------------------- Task 4: deterministic mode


def deterministic_mode(seed: int) -> None:
    """From now on in this process: seeded generators (torch, Python's ``random``, NumPy),
    deterministic algorithms (an op without a deterministic kernel raises), cuDNN deterministic and
    not benchmarking, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS needs it to be deterministic)."""
    raise NotImplementedError('Task 4: seeds, deterministic algorithms, cuDNN and cuBLAS settings')


def all_reduce_in_rank_order(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, always as ((x_0 + x_1) + x_2) + ..., the same bits on
    every rank whatever the world size or the collective library's algorithm. Return it."""
    raise NotImplementedError('Task 4: a sum over the ranks in a fixed order (gather, then add in rank order)')


# ---------------------------------------------------------------------- Task 5: the loop


def train(root, steps: int, *, save_every: int = 3, keep: int = 2, resume: bool = False, seed: int = 0) -> dict:
    """Train to ``steps`` steps on every rank of the default group; return :func:`summary`.

    ``root``: checkpoints go there every ``save_every`` steps, the newest ``keep`` kept (None: no
    checkpoints). ``resume``: first continue from the newest valid checkpoint under ``root``, if any.
    A step is one global batch consumed: a step the guard skips still counts (its batch is used
    up) but updates nothing. The run is deterministic: the same arguments give the same bits.
    Batches come on the CPU: draw ``augment``'s random tokens there, then move them to ``device``.
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), cdist.device()
    deterministic_mode(seed)  # same initial weights on every rank...
    model = make_model().to(device)
    optimizer, guard = make_optimizer(model), SpikeGuard(**GUARD)
    scheduler = make_scheduler(optimizer)
    torch.manual_seed(seed * 1000 + 1 + rank)  # ...then each rank its own stream for token dropout
    random.seed(seed * 1000 + 1 + rank)
    step, losses, optimizer_steps, resumed_from = 0, {}, 0, None
    batches = None  # batches_from(...) once the step to start from is known
    raise NotImplementedError("Task 5: resume; the loop with the guard, a rank-order gradient average, and the checkpoints")
    return summary(model, optimizer, scheduler, guard, step, losses, batches, optimizer_steps, resumed_from)
