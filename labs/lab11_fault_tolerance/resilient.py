"""Lab 11: a training loop that survives faults, and proves it.

You complete the marked functions, Tasks 1-5; everything else is given. Tasks 1-4 are graded on
their own, each by the grader's own small loop around your functions: Task 1 (the commit) is killed
half-way and handed truncated and altered shards, and its fsyncs and renames are recorded; Task 2
(capture and restore) is compared, right after ``restore``, with the state it captured; Tasks 3
and 4 are unit-checked. Task 5, the loop ``train``, puts them together, and the grader attacks it:
it SIGKILLs a rank at a random step and restarts the job, makes one rank's loss NaN, resumes your
2-rank checkpoint on 1 rank, and runs you twice in deterministic mode. See README.md for the points.

The set-up: the tiny course model (22,688 parameters), data parallel over the ranks with AdamW and
a warm-up + cosine schedule, on the course's synthetic language. "Token dropout" replaces 10% of
the input tokens with random ones drawn from each rank's torch generator, so that a resumed run
that forgets a random state differs as visibly as one that forgets the weights.

Checkpoints go through ``torch.distributed.checkpoint`` (DCP, lecture 08): ``write_shards`` and
``read_shards`` below are given. DCP writes each rank's shard and an index, but promises neither
atomicity nor integrity: that is your commit protocol (Task 1).
"""

# Your code goes in the fenced "Task N — your code" regions of this file:
#   line 166: Task 1: shards into a temp directory, MANIFEST.json fsynced, rename to step_XXXXXXXX, fsync root, keep the newest `keep`; return the final directory
#   line 185: Task 1: compare every file with MANIFEST.json; raise CorruptCheckpointError naming the bad file, else return the manifest (a dict)
#   line 192: Task 1: return the newest step_ directory (a Path) that passes verify_checkpoint, or None
#   line 209: Task 2: return a DCP state dict: "model" and "optim" from get_state_dict, and under f"loop.{rank}" the pickled step, scheduler, guard and torch/Python/NumPy random states
#   line 221: Task 2: verify, read the shards into a state dict shaped like capture's, put back the model, optimizer, scheduler, guard and RNG states; return the saved step (an int)
#   line 246: Task 3: return False (appending the call's number to skipped) for a non-finite loss or one above factor x median(history) once min_history are known; else append the loss to history and return True; count the call either way
#   line 265: Task 4: seed torch, random and NumPy with seed; set deterministic algorithms, cuDNN deterministic and not benchmarking, CUBLAS_WORKSPACE_CONFIG; returns None
#   line 273: Task 4: overwrite tensor with ((x_0 + x_1) + x_2) + ... (gather, then add in rank order) on every rank; return it
#   line 300: Task 5: resume, then loop to `steps` (guard on the mean loss, rank-order gradient average, optimizer and schedule on taken steps only, a checkpoint every save_every); return summary(...)

from __future__ import annotations

import itertools
import random
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from course_lib import dist as cdist
from course_lib.checkpoint.commit import fsync_dir  # given: fsync a directory, so a rename in it is durable
from course_lib.checkpoint.commit import sha256 as sha256_file  # given: the hex sha256 of a file's bytes
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.optim.lr_schedules import warmup_cosine_lambda

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
    """Linear warm-up over 3 steps, cosine decay to 10% at step 24 (course_lib.optim.lr_schedules)."""
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
    """What the grader compares between runs (returned by ``train``). What ``train`` passes:

    * ``step`` (int): the steps done, ``steps`` at the end;
    * ``losses`` (dict int -> float): the mean loss over the ranks of each step this run did, keyed by
      the step number *after* that step: 1, 2, ..., steps for a fresh run; start+1, ..., steps for a
      run resumed at step ``start`` (a skipped step has its loss too);
    * ``batches``: the iterator of :func:`batches_from` the loop drew from (its next batch is compared);
    * ``optimizer_steps`` (int): the optimizer steps this run took (the skipped steps not counted);
    * ``resumed_from`` (str or None): the *name* of the checkpoint directory this run resumed from,
      e.g. ``"step_00000006"`` (``path.name``), or None for a fresh start.
    """
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
    3. rename the directory to its final name and fsync ``root``: the checkpoint now exists, whole.
       A ``step_XXXXXXXX`` of this step may exist already (a run resumed from an older checkpoint
       saves this step again): replace it, so that one of the two is committed at every moment;
    4. remove all but the newest ``keep`` committed checkpoints, and leftovers of saves that died.
    No rank may return before the checkpoint is committed. Returns the final directory.
    (The grader records the order of your ``os.fsync`` and ``os.rename`` calls: a power cut after the
    rename must find the manifest on disk, and the rename itself made durable by fsyncing ``root``.)
    """
    # ━━ Task 1 — your code: shards into a temp directory, MANIFEST.json fsynced, rename to step_XXXXXXXX, fsync root, keep the newest `keep`; return the final directory ━━
    raise NotImplementedError('Task 1: shards into a temp directory, MANIFEST.json fsynced, rename to step_XXXXXXXX, fsync root, keep the newest `keep`; return the final directory')
    # ━━ end of Task 1 ━━


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
    # ━━ Task 1 — your code: compare every file with MANIFEST.json; raise CorruptCheckpointError naming the bad file, else return the manifest (a dict) ━━
    raise NotImplementedError('Task 1: compare every file with MANIFEST.json; raise CorruptCheckpointError naming the bad file, else return the manifest (a dict)')
    # ━━ end of Task 1 ━━


def latest_checkpoint(root) -> Path | None:
    """The newest checkpoint under ``root`` that passes :func:`verify_checkpoint`, or None."""
    # ━━ Task 1 — your code: return the newest step_ directory (a Path) that passes verify_checkpoint, or None ━━
    raise NotImplementedError('Task 1: return the newest step_ directory (a Path) that passes verify_checkpoint, or None')
    # ━━ end of Task 1 ━━


# --------------------------------------------------------------------------- Task 2: resume


def capture(model, optimizer, scheduler, guard, step: int) -> dict:
    """Everything a resumed run needs, as a state dict for DCP.

    Tensors as tensors (the model's and the optimizer's, from ``get_state_dict``: it also creates
    the optimizer's state when the optimizer has not stepped yet, so a fresh one can be loaded
    into). The rest — the step (the data position), the scheduler, the guard and this rank's
    random states (torch, Python's ``random`` and NumPy's: the loop here draws only from torch's, but
    a data loader or an augmentation may draw from the others) — pickled under a key of this rank's own.
    """
    # ━━ Task 2 — your code: return a DCP state dict: "model" and "optim" from get_state_dict, and under f"loop.{rank}" the pickled step, scheduler, guard and torch/Python/NumPy random states ━━
    raise NotImplementedError('Task 2: return a DCP state dict: "model" and "optim" from get_state_dict, and under f"loop.{rank}" the pickled step, scheduler, guard and torch/Python/NumPy random states')
    # ━━ end of Task 2 ━━


def restore(path, model, optimizer, scheduler, guard) -> int:
    """Load the checkpoint at ``path`` into the objects and this rank's random states; return its step.

    Verify the checkpoint first (``verify_checkpoint``). Collective. Right after it returns, everything
    :func:`capture` saved — parameters, AdamW's state and learning rates, the schedule, the guard, the
    torch, Python and NumPy random states — equals what it was when the checkpoint was captured.
    """
    # ━━ Task 2 — your code: verify, read the shards into a state dict shaped like capture's, put back the model, optimizer, scheduler, guard and RNG states; return the saved step (an int) ━━
    raise NotImplementedError("Task 2: verify, read the shards into a state dict shaped like capture's, put back the model, optimizer, scheduler, guard and RNG states; return the saved step (an int)")
    # ━━ end of Task 2 ━━


# ------------------------------------------------------------------- Task 3: the spike guard


class SpikeGuard:
    """skip ⇔ the loss is NaN or ±inf, or (at least ``min_history`` accepted losses are known and
    the loss exceeds ``factor`` × their median). ``history``: the last ``window`` *accepted* losses.
    The guard judges from the call where ``len(history) == min_history`` on; a loss equal to
    ``factor`` × median is taken (only a loss strictly above it is a spike).

    ``check(loss)`` returns True to take the step; False to skip it, recording the call's number
    (0, 1, 2, ...) in ``skipped``. Every rank must decide the same: pass the mean over the ranks.
    """

    def __init__(self, factor: float, window: int, min_history: int):
        self.factor, self.window, self.min_history = factor, window, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.calls = 0
        self.skipped: list[int] = []

    def check(self, loss: float) -> bool:
        # ━━ Task 3 — your code: return False (appending the call's number to skipped) for a non-finite loss or one above factor x median(history) once min_history are known; else append the loss to history and return True; count the call either way ━━
        raise NotImplementedError("Task 3: return False (appending the call's number to skipped) for a non-finite loss or one above factor x median(history) once min_history are known; else append the loss to history and return True; count the call either way")
        # ━━ end of Task 3 ━━

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
    # ━━ Task 4 — your code: seed torch, random and NumPy with seed; set deterministic algorithms, cuDNN deterministic and not benchmarking, CUBLAS_WORKSPACE_CONFIG; returns None ━━
    raise NotImplementedError('Task 4: seed torch, random and NumPy with seed; set deterministic algorithms, cuDNN deterministic and not benchmarking, CUBLAS_WORKSPACE_CONFIG; returns None')
    # ━━ end of Task 4 ━━


def all_reduce_in_rank_order(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, always as ((x_0 + x_1) + x_2) + ..., the same bits on
    every rank whatever the world size or the collective library's algorithm. Return it."""
    # ━━ Task 4 — your code: overwrite tensor with ((x_0 + x_1) + x_2) + ... (gather, then add in rank order) on every rank; return it ━━
    raise NotImplementedError('Task 4: overwrite tensor with ((x_0 + x_1) + x_2) + ... (gather, then add in rank order) on every rank; return it')
    # ━━ end of Task 4 ━━


# ---------------------------------------------------------------------- Task 5: the loop


def train(root, steps: int, *, save_every: int = 3, keep: int = 2, resume: bool = False, seed: int = 0) -> dict:
    """Train to ``steps`` steps on every rank of the default group; return :func:`summary`.

    ``root``: checkpoints go there every ``save_every`` steps, the newest ``keep`` kept (None: no
    checkpoints). ``resume``: first continue from the newest valid checkpoint under ``root``, if any.
    A step is one global batch consumed: a step the guard skips still counts (its batch is used
    up, its loss is logged) but updates nothing: no optimizer step, and the schedule does not advance
    either (the learning rate is a function of the optimizer steps taken). The run is deterministic:
    the same arguments give the same bits. Batches come on the CPU: draw ``augment``'s random tokens
    there, then move them to ``device``. What to return: :func:`summary` (its docstring says the types).
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), cdist.device()
    deterministic_mode(seed)  # same initial weights on every rank...
    model = make_model().to(device)
    optimizer, guard = make_optimizer(model), SpikeGuard(**GUARD)
    scheduler = make_scheduler(optimizer)
    torch.manual_seed(seed * 1000 + 1 + rank)  # ...then each rank its own stream for token dropout
    random.seed(seed * 1000 + 1 + rank)
    step, losses, optimizer_steps, resumed_from = 0, {}, 0, None
    # ━━ Task 5 — your code: resume, then loop to `steps` (guard on the mean loss, rank-order gradient average, optimizer and schedule on taken steps only, a checkpoint every save_every); return summary(...) ━━
    raise NotImplementedError('Task 5: resume, then loop to `steps` (guard on the mean loss, rank-order gradient average, optimizer and schedule on taken steps only, a checkpoint every save_every); return summary(...)')
    # ━━ end of Task 5 ━━
