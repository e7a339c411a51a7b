"""Lab 11, Task 5: the attacks on the learner's loop ``train``, which calls the pieces of Tasks 1-4.

The learner's ``train`` runs on 2 ranks; the grader injects faults through the functions the loop
is given (``compute_loss``, ``write_shards``), which it wraps inside each rank's process:

* **kill and resume** — a rank SIGKILLs itself at a random step (drawn from a fixed seed, named in
  the feedback); the job is restarted with ``resume=True``. The final parameters, AdamW moments and
  step counts, learning rate, guard state, next batch and next random numbers must equal those of
  an uninterrupted run bit for bit, and so must the losses after the resume: nothing in the loop
  depends on the kill, so exact equality is the only right answer;
* **a damaged newest checkpoint** — ``train(resume=True)`` beside a step 6 whose shard was altered
  resumes from step 3, saves step 6 again over the damaged one, and ends as an uninterrupted run;
* **2 -> 1 ranks** — the loop resumed on one rank sees the same global batches as the
  uninterrupted run, with its schedule and step count;
* **NaN and spike** — one rank's loss is NaN at one step and 1000x at another: both steps are
  skipped on every rank (the decision taken on the mean over ranks), training finishes, the
  replicas stay identical and finite, and the skipped steps advance neither AdamW nor the schedule;
* **two deterministic runs** from differently scrambled generators: identical losses and parameters.

Each check declares (``needs``) the checks of the tasks ``train`` calls, so a failure there names that
task; what ``train`` returns is :func:`summary`'s dict, whose types are checked first with feedback
that says what was expected (losses keyed 1..steps, ``resumed_from`` a directory name).
"""

from __future__ import annotations

import os
import random
import re
import signal
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.dist import RankError, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.labs._lab11_commit import wrap_write_shards
from course_lib.grading.labs._lab11_common import KEEP, LAUNCH_S, SAVE_EVERY, STEPS, scramble

KILL_SEED = 2026  # the kill step and the victim are drawn from it: a fixed draw, so that grading repeats


def _wrap_compute_loss(module, rank: int, faults: dict, seen: list) -> None:
    """Replace the module's compute_loss by one that counts its calls (0, 1, ...: the step index of
    this run) and injects this rank's faults; ``seen`` collects the targets it was called with."""
    original, calls = module.compute_loss, [0]

    def compute_loss(model, x, y):
        call = calls[0]
        calls[0] += 1
        if faults.get("kill") == (rank, call):
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no clean-up: a node that died
        seen.append(y.clone())
        loss = original(model, x, y)
        if faults.get("nan") == (rank, call):
            return loss * float("nan")
        if faults.get("spike") == (rank, call):
            return loss * 1000.0
        return loss

    module.compute_loss = compute_loss


def _rank(impl: Adapter, root, steps: int, faults: dict, kw: dict):
    """One rank's run of the learner's ``train`` with ``faults`` injected; (summary, targets seen)."""
    rank, module = dist.get_rank(), impl.module("train")
    seen: list = []
    if "scramble" in faults:
        scramble(faults["scramble"] + rank)
    _wrap_compute_loss(module, rank, faults, seen)
    if "kill_save" in faults:
        wrap_write_shards(module, *faults["kill_save"])
    return impl["train"](None if root is None else str(root), steps, **kw), seen


def _run(impl, world_size, root, steps, faults=None, **kw):
    """The learner's ``train`` on ``world_size`` ranks with ``faults``: [(summary, targets seen) per rank],
    each summary's types checked against the contract of ``summary``."""
    runs = launch(_rank, world_size, impl, root, steps, faults or {}, kw, timeout=LAUNCH_S)
    for got, _ in runs:
        _check_contract(got, steps, resumed=kw.get("resume", False))
    return runs


# ----------------------------------------------------------------------------- what train returns


def _span(keys) -> str:
    keys = sorted(keys, key=lambda k: (0, k, "") if isinstance(k, int) else (1, 0, repr(k)))
    if keys and all(isinstance(k, int) for k in keys) and keys == list(range(keys[0], keys[-1] + 1)):
        return f"{{{keys[0]}..{keys[-1]}}}"
    return "{" + ", ".join(map(repr, keys[:6])) + (", ..." if len(keys) > 6 else "") + "}"


def resumed_step(summary: dict) -> int:
    """The step of the checkpoint a run resumed from (0 for a fresh start), from ``resumed_from``:
    a directory's name; a full path is taken by its last part."""
    name = summary["resumed_from"]
    if name is None:
        return 0
    if not isinstance(name, (str, os.PathLike)):
        raise AssertionError(
            f"train returned resumed_from={name!r} ({type(name).__name__}): it must be the name of the checkpoint "
            "directory it resumed from, a str such as 'step_00000006' (path.name), or None for a fresh start"
        )
    m = re.fullmatch(r"step_(\d+)", Path(name).name)
    if not m:
        raise AssertionError(f"train returned resumed_from={name!r}: expected a checkpoint's name, step_XXXXXXXX")
    return int(m[1])


def _check_contract(got: dict, steps: int, resumed: bool) -> None:
    start = resumed_step(got) if resumed else 0
    keys, want = set(got["losses"]), set(range(start + 1, steps + 1))
    ok = want <= keys <= set(range(1, steps + 1)) if resumed else keys == want
    assert ok, (
        f"your losses are keyed {_span(keys)}; expected {_span(want)}: key each step's loss by the step number "
        "after it, 1 for the first step (see summary's docstring)"
    )


# ----------------------------------------------------------------------------- comparisons


def _differences(ref: dict, got: dict) -> list[str]:
    """What differs between two summaries, each naming what to look at; [] when bit-identical."""
    out = []
    if got["step"] != ref["step"]:
        out.append(f"the run ended at step {got['step']}, not {ref['step']}")
    differ = [n for n in ref["params"] if not torch.equal(ref["params"][n], got["params"][n])]
    if differ:
        out.append(f"parameters {differ[:2]} differ: the model or the optimizer state was not restored exactly")
    missing = torch.tensor(float("nan"))  # host: launch returns the ranks' summaries on the host
    moments = [
        f"{i}.{k}"
        for i, state in ref["optimizer"].items()
        for k, v in state.items()
        if not torch.equal(v, got["optimizer"].get(i, {}).get(k, missing))
    ]
    if moments and not differ:
        out.append(f"AdamW's state {moments[:2]} differs: save and load the optimizer's moments and step")
    if got["lr"] != ref["lr"]:
        out.append(f"the learning rate is {got['lr']}, not {ref['lr']}: restore the scheduler")
    if not torch.equal(got["next_batch"][0], ref["next_batch"][0]):
        out.append("the next batch differs: resume the data where it stopped (the step is the data position)")
    if not (torch.equal(got["rng"][0], ref["rng"][0]) and got["rng"][1] == ref["rng"][1]):
        out.append("the next random numbers differ: save and restore each rank's torch and Python random states")
    if got["guard"] != ref["guard"]:
        out.append("the spike guard's state differs: save and restore its history")
    return out


def _check_identical(reference, resumed, what: str) -> None:
    for rank, ((ref, _), (got, _)) in enumerate(zip(reference, resumed)):
        problems = _differences(ref, got)
        assert not problems, f"{what}: rank {rank}: " + "; ".join(problems)
        start = resumed_step(got)
        bad = [s for s in range(start + 1, ref["step"] + 1) if got["losses"].get(s) != ref["losses"][s]]
        assert not bad, f"{what}: the losses of steps {bad[:3]} differ from the uninterrupted run's"


# -------------------------------------------------------------------------------- checks


def check_kill_and_resume(impl: Adapter) -> None:
    """A rank SIGKILLed at a random step, the job restarted with resume=True: it resumes from the
    last checkpoint and ends bit-identical to the uninterrupted run."""
    draw = random.Random(KILL_SEED)
    kill_at, victim = draw.randrange(SAVE_EVERY + 1, STEPS), draw.randrange(2)
    if kill_at % SAVE_EVERY == 0:
        kill_at += 1  # between two saves, so that a resume has steps to redo
    reference = _run(impl, 2, None, STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        try:
            _run(impl, 2, root, STEPS, {"kill": (victim, kill_at)}, save_every=SAVE_EVERY, keep=KEEP)
        except RankError:
            pass
        else:
            raise AssertionError(
                f"rank {victim} was SIGKILLed at step {kill_at}, yet the run finished: call compute_loss as given"
            )
        resumed = _run(impl, 2, root, STEPS, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        want, got = kill_at // SAVE_EVERY * SAVE_EVERY, resumed_step(resumed[0][0])
        assert got == want, (
            f"rank {victim} was killed after {kill_at} steps; the restarted job resumed from step {got}, "
            f"not from the last checkpoint (step {want})"
        )
        _check_identical(reference, resumed, f"killed (rank {victim} at step {kill_at}) and resumed")


def check_resume_past_damage(impl: Adapter) -> None:
    """train(resume=True) beside a damaged newest checkpoint resumes from the one before, saves that
    step again over the damaged directory, and ends bit-identical to an uninterrupted run."""
    steps = 9
    reference = _run(impl, 2, None, steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _run(impl, 2, root, 6, save_every=SAVE_EVERY, keep=KEEP)
        shard = sorted((root / "step_00000006").glob("*.distcp"))[-1]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10  # one bit
        shard.write_bytes(bytes(data))
        try:
            resumed = _run(impl, 2, root, steps, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        except RankError as e:
            if "rename" in e.rank_traceback or "Directory not empty" in e.rank_traceback:
                raise AssertionError(
                    "resumed from step_00000003 past a damaged step_00000006, the save of step 6 failed on a rename "
                    "(os.rename does not replace a directory that is not empty): in commit_checkpoint, move an "
                    "existing step_XXXXXXXX aside first"
                ) from None
            raise
        got = resumed_step(resumed[0][0])
        assert got == 3, (
            f"train(resume=True) beside a damaged step_00000006 resumed from step {got}, not step_00000003: "
            "resume from latest_checkpoint"
        )
        _check_identical(reference, resumed, "resumed past a damaged step_00000006")


def check_resume_on_one_rank(impl: Adapter) -> None:
    """The loop resumed on one rank from a 2-rank checkpoint sees the global batches of the steps after
    it, whole, and ends with the uninterrupted run's learning rate and AdamW step count."""
    reference = _run(impl, 2, None, STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _run(impl, 2, root, 6, save_every=SAVE_EVERY, keep=KEEP)
        (got, seen), *_ = _run(impl, 1, root, STEPS, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        assert resumed_step(got) == 6, (
            f"one rank resuming a 2-rank run resumed from {got['resumed_from']}, not step_00000006"
        )
        batches = impl.module("train").batches_from(6, 0, 1)
        want = [next(batches)[1] for _ in range(STEPS - 6)]
        assert len(seen) == len(want) and all(torch.equal(a, b) for a, b in zip(seen, want)), (
            "resumed on one rank, the run must see the global batches of steps 6-11, whole: the data position "
            "is the step, at any world size"
        )
        ref = reference[0][0]
        assert got["lr"] == ref["lr"], f"the learning rate at the end is {got['lr']}, not {ref['lr']}"
        steps = {int(s["step"]) for s in got["optimizer"].values()}
        assert steps == {STEPS}, f"AdamW's step count is {steps} after 12 steps, not {STEPS}"


def _schedule_after(module, optimizer_steps: int) -> list[float]:
    """The given schedule's learning rate after ``optimizer_steps`` optimizer steps."""
    optimizer = module.make_optimizer(torch.nn.Linear(1, 1))  # host: a stand-in, for its learning rate only
    scheduler = module.make_scheduler(optimizer)
    for _ in range(optimizer_steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()


def check_nan_and_spike(impl: Adapter) -> None:
    """Rank 1's loss NaN at step index 5, rank 0's 1000x at 7: both skipped on both ranks, 10 steps
    done, replicas finite and identical; a skipped step advances neither AdamW nor the schedule."""
    steps = 10
    try:
        runs = _run(impl, 2, None, steps, {"nan": (1, 5), "spike": (0, 7)})
    except RankError as e:
        text = e.rank_traceback
        died = "exited with code" in text  # gloo aborts the process on a size mismatch: no Python traceback
        if "NotImplementedError" in text or "AssertionError" in text or not (died or "gloo" in text.lower()):
            raise
        # one rank stepped (all-gathering gradients) while the other skipped: gloo fails, or aborts a rank
        said = text.strip().splitlines()[-1].rsplit("] ", 1)[-1].split(". ")[0].strip()  # gloo's words, no path
        raise AssertionError(
            f"with rank 1's loss NaN at step index 5, rank {e.rank} "
            + ("died in a collective" if died else f"failed in a gloo collective ({said})")
            + ": the ranks called different collectives, as when one skips and the other steps; decide on the mean "
            "loss over the ranks"
        ) from None
    module = impl.module("train")
    for rank, (got, _) in enumerate(runs):
        assert got["step"] == steps, f"rank {rank} stopped at step {got['step']} of {steps}"
        bad = [n for n, p in got["params"].items() if not torch.isfinite(p).all()]
        assert not bad, (
            f"rank 1's loss was NaN at step index 5: rank {rank}'s parameters {bad[:2]} are no longer finite: "
            "check the loss, averaged over the ranks, before stepping"
        )
        assert got["skipped"] == [5, 7], (
            f"rank {rank} skipped steps {got['skipped']}; expected [5, 7] (index 5: NaN on rank 1; index 7: rank 0's "
            "loss x1000): decide on the mean loss over the ranks, so every rank skips the same steps"
        )
        assert got["optimizer_steps"] == steps - 2, (
            f"rank {rank} made {got['optimizer_steps']} optimizer steps in {steps} steps with 2 skipped"
        )
        adam = {int(s["step"]) for s in got["optimizer"].values()}
        assert adam == {steps - 2}, (
            f"after {steps} steps with 2 skipped, AdamW's step count is {sorted(adam)}, not {steps - 2}: a skipped "
            "step must not call optimizer.step()"
        )
        want = _schedule_after(module, steps - 2)
        assert got["lr"] == want, (
            f"after {steps} steps with 2 skipped the learning rate is {got['lr']}, the schedule's after "
            f"{steps - 2} optimizer steps is {want}"
            + (" (and after 10 is exactly yours)" if got["lr"] == _schedule_after(module, steps) else "")
            + ": a skipped step must not advance the schedule either (step it with the optimizer)"
        )
    differ = [n for n in runs[0][0]["params"] if not torch.equal(runs[0][0]["params"][n], runs[1][0]["params"][n])]
    assert not differ, (
        f"after the skipped steps the replicas differ in {differ[:2]}: every rank must take the same decision"
    )


def check_two_runs(impl: Adapter) -> None:
    """Two runs of train(seed=0) started from differently scrambled generators: identical losses
    and parameters."""
    first = _run(impl, 2, None, 8, {"scramble": 1})
    second = _run(impl, 2, None, 8, {"scramble": 5})
    for rank, ((a, _), (b, _)) in enumerate(zip(first, second)):
        assert a["losses"] == b["losses"], (
            f"two runs of train(seed=0) on rank {rank}, started from differently seeded random generators, gave "
            "different losses: deterministic_mode must seed every generator the run draws from"
        )
        differ = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
        assert not differ, f"two deterministic runs end with different parameters {differ[:2]}"
