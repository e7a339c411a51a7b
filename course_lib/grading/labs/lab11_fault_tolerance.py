"""Grader of lab 11: fault tolerance and reproducibility, one task at a time, then the loop attacked.

Tasks 1-4 are graded on their own; Task 5, the loop ``train`` that calls them all, is attacked:

* **Task 1, the atomic commit** (_lab11_commit.py) — the grader's own saves through the learner's
  ``commit_checkpoint``: keep the newest n with true manifests; a save killed half-way leaves the
  previous checkpoint the newest valid one; truncated, altered, deleted shards and a missing manifest
  refused with ``CorruptCheckpointError`` naming the file; a step saved again over an existing
  directory; and the order of fsyncs and renames, recorded in the grader's process;
* **Task 2, capture and restore** (_lab11_restore.py) — the grader's own training loop captures and
  restores: right after ``restore`` everything is back bit for bit (the first piece that differs is
  named), on 2 ranks and on 1;
* **Task 3, the spike guard** (here) — decisions on a sequence that tells apart the off-by-ones
  (judging from ``min_history`` losses on, strictly above ``factor`` × median, the window), and a
  guard reloaded from ``state_dict()``;
* **Task 4, deterministic mode** (here) — the flags and seeds, and a rank-order sum at 4 ranks equal
  to ((x0 + x1) + x2) + x3 bit for bit;
* **Task 5, the loop** (_lab11_loop.py) — a SIGKILL at a random step and a restart, a resume past a
  damaged newest checkpoint, a resume on one rank, a NaN and a spike, two deterministic runs. Each
  declares the checks of the tasks ``train`` calls as ``needs``.

Tasks 1, 3 and 4's checks also run on course_lib's own checkpoint commit, SpikeGuard, deterministic
mode and rank-order all-reduce in tests/grading/test_lab_checks.py (except the killed save, which injects its
fault through the lab's ``write_shards``); Task 2's and Task 5's need the lab's own ``capture``,
``restore`` and ``train``, and run on the reference solution in tests/labs/test_labs.py and on planted bugs
in tests/labs/test_lab11_fault_tolerance.py (course_lib's own loop meets the same attacks in
tests/checkpoint/test_checkpoint_resume.py).
"""

from __future__ import annotations

import math
import os
import random
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from course_lib.dist import device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab11_commit import (
    check_commit,
    check_damaged_shards,
    check_durable_commit,
    check_killed_save,
)
from course_lib.grading.labs._lab11_common import LAUNCH_S, scramble
from course_lib.grading.labs._lab11_loop import (
    check_kill_and_resume,
    check_nan_and_spike,
    check_resume_on_one_rank,
    check_resume_past_damage,
    check_two_runs,
)
from course_lib.grading.labs._lab11_restore import check_restore, check_restore_on_one_rank

ROLES = (
    "train",
    "commit_checkpoint",
    "latest_checkpoint",
    "verify_checkpoint",
    "capture",
    "restore",
    "SpikeGuard",
    "deterministic_mode",
    "all_reduce_in_rank_order",
)
__all__ = [
    "TASKS",
    "adapter",
    "check_commit",
    "check_damaged_shards",
    "check_deterministic_mode",
    "check_durable_commit",
    "check_guard",
    "check_kill_and_resume",
    "check_killed_save",
    "check_nan_and_spike",
    "check_restore",
    "check_restore_on_one_rank",
    "check_resume_on_one_rank",
    "check_resume_past_damage",
    "check_setup",
    "check_two_runs",
]


def adapter(lab_dir: Path) -> Adapter:
    """The learner's loop and its pieces, from ``resilient.py``."""
    return Adapter.of_file(Path(lab_dir) / "resilient.py", ROLES)


def check_setup(impl: Adapter) -> None:
    module = impl.module("train")
    for name in (*ROLES, "CorruptCheckpointError", "compute_loss", "write_shards"):
        assert getattr(module, name, None) is not None, f"resilient.py must define {name}"


def _guard_says(history: list[float], loss: float) -> tuple[bool, str]:
    """(take?, why) for SpikeGuard(factor=3, window=4, min_history=2) with ``history`` accepted before."""
    if not math.isfinite(loss):
        return False, "NaN and ±inf always skip"
    if len(history) < 2:
        return True, f"only {len(history)} accepted loss(es) known, fewer than min_history=2: not judged yet"
    limit = 3 * statistics.median(history)
    if loss > limit:
        return False, f"{loss} > 3 × median({history}) = {limit}, with {len(history)} ≥ min_history losses known"
    return True, f"{loss} ≤ 3 × median({history}) = {limit} (only a loss strictly above it is a spike)"


def check_guard(impl: Adapter) -> None:
    """SpikeGuard(factor=3, window=4, min_history=2) on a sequence that tells apart the off-by-ones:
    judging from len(history) == min_history on (10.0 after two 1.0s), a loss exactly 3 × median taken
    (3.0, 10.5), the window of the last 4 accepted losses (7.0), NaN and ±inf; then a guard reloaded
    from state_dict() decides as the one that saved it."""
    guard = impl["SpikeGuard"](factor=3.0, window=4, min_history=2)
    losses = [1.0, 1.0, 10.0, 3.0, float("nan"), 2.0, float("inf"), 4.0, 7.0, -float("inf"), 10.5, 17.0]
    history, want, saved = [], [], None
    for i, loss in enumerate(losses):
        if i == 6:
            saved = guard.state_dict()
        decision, why = _guard_says(history, loss)
        want.append(decision)
        got = guard.check(loss)
        assert got == decision, (
            f"SpikeGuard(factor=3, window=4, min_history=2).check({loss}) after {losses[:i]} returned {got}: "
            f"{'take' if decision else 'skip'} it — {why}"
        )
        if decision:
            history = [*history, loss][-4:]  # the last window=4 accepted losses
    skipped = [i for i, ok in enumerate(want) if not ok]
    assert list(guard.skipped) == skipped, f"skipped must list the calls that were skipped, {skipped}: {guard.skipped}"
    fresh = impl["SpikeGuard"](factor=3.0, window=4, min_history=2)
    fresh.load_state_dict(saved)
    again = [fresh.check(loss) for loss in losses[6:]]
    assert again == want[6:] and list(fresh.skipped) == list(guard.skipped), (
        "a guard loaded from state_dict() must decide as the one that saved it: save the history and the counts"
    )


def _determinism_rank(impl: Adapter, seed: int) -> dict:
    rank = dist.get_rank()
    scramble(100 + rank)
    torch.use_deterministic_algorithms(False)
    impl["deterministic_mode"](seed)
    flags = {
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "not cudnn.benchmark": not torch.backends.cudnn.benchmark,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG") in (":4096:8", ":16:8"),
    }
    draws = (torch.rand(3), random.random(), float(np.random.rand()))  # host: the CPU generator seeded by the mode
    x = _summand(rank).to(device())
    summed = impl["all_reduce_in_rank_order"](x.clone())
    return {"flags": flags, "draws": draws, "summed": summed}


def _summand(rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of the sum: magnitudes from 1e-3 to 1e5, both signs, so that float32 sums
    of the 4 parts round differently in different orders."""
    g = torch.Generator().manual_seed(rank)  # host: the same numbers on every machine (a rank moves them)
    return torch.randn(4096, generator=g) * 10.0 ** torch.randint(-3, 6, (4096,), generator=g)  # host: drawn with g


def _rank_order_sum(world: int) -> torch.Tensor:
    total = _summand(0)
    for r in range(1, world):
        total = total + _summand(r)
    return total


def check_deterministic_mode(impl: Adapter) -> None:
    seed, world = 17, 4
    results = launch(_determinism_rank, world, impl, seed, timeout=LAUNCH_S)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    want = (torch.rand(3), random.random(), float(np.random.rand()))  # host: a fresh seeded CPU generator
    for rank, out in enumerate(results):
        unset = [k for k, ok in out["flags"].items() if not ok]
        assert not unset, f"after deterministic_mode, rank {rank} lacks: {unset}"
        same = torch.equal(out["draws"][0], want[0]) and out["draws"][1:] == want[1:]
        assert same, (
            f"after deterministic_mode({seed}) rank {rank} draws other numbers than a fresh process seeded with "
            f"{seed}: seed torch, Python's random and NumPy"
        )
    ordered = _rank_order_sum(world)
    for rank, out in enumerate(results):
        assert torch.equal(out["summed"], ordered), (
            f"all_reduce_in_rank_order at {world} ranks: rank {rank}'s sum differs from ((x0 + x1) + x2) + x3 in "
            f"{int((out['summed'] != ordered).sum())} of {ordered.numel()} elements: gather every rank's tensor "
            "and add them in rank order (dist.all_reduce chooses its own order)"
        )


# the checks of the tasks train calls: a Task 5 row that fails names the first of them that fails too
PIECES = (check_commit, check_restore, check_guard, check_deterministic_mode)

TASKS = [
    Task("resilient.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: atomic commit, manifest with checksums, keep the newest n", 2, check_commit),
    Task("Task 1: a save killed half-way leaves the previous checkpoint loadable", 2, check_killed_save),
    Task("Task 1: a damaged checkpoint refused naming the file, and saved over", 2, check_damaged_shards),
    Task("Task 1: manifest fsynced before the rename, root fsynced after it", 1, check_durable_commit),
    Task("Task 2: right after restore, everything captured is back", 3, check_restore),
    Task("Task 2: a 2-rank checkpoint restored on 1 rank", 1, check_restore_on_one_rank),
    Task("Task 3: the spike guard's decisions, and a reloaded guard", 2, check_guard),
    Task("Task 4: deterministic mode and a rank-order sum", 2, check_deterministic_mode),
    Task("Task 5: SIGKILL at a random step, restart: bit-identical", 3, check_kill_and_resume, 150, needs=PIECES),
    Task("Task 5: resumed past a damaged newest checkpoint", 2, check_resume_past_damage, 150, needs=PIECES),
    Task("Task 5: a 2-rank run resumed on 1 rank", 1, check_resume_on_one_rank, 150, needs=PIECES),
    Task("Task 5: a NaN and a spike skipped on every rank", 2, check_nan_and_spike, 90, needs=PIECES[2:]),
    Task("Task 5: two deterministic runs identical", 2, check_two_runs, 90, needs=PIECES[3:]),
]
