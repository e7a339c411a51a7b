"""Grader of lab 11: fault tolerance and reproducibility, graded by attacking the learner's loop.

The learner's ``train`` runs on 2 ranks; the grader injects faults through the functions the loop
is given (``compute_loss``, ``write_shards``), which it wraps inside each rank's process:

* **kill and resume** — a rank SIGKILLs itself at a random step (drawn from a fixed seed, named in
  the feedback); the job is restarted with ``resume=True``. The final parameters, AdamW moments and
  step counts, learning rate, guard state, next batch and next random numbers must equal those of
  an uninterrupted run bit for bit, and so must the losses after the resume: nothing in the loop
  depends on the kill, so exact equality is the only right answer;
* **killed save** — rank 0 dies in the save of step 9, after DCP wrote the shards (its own cut to
  half, as a crash in mid-write leaves it) and before the commit; the previous checkpoint (step 6)
  must be the newest valid one, and the restarted job must resume from it and end bit-identical;
* **damaged shards** — the newest checkpoint's shard truncated, altered by one bit, or deleted:
  ``verify_checkpoint`` must refuse it with a message naming the file, and ``latest_checkpoint``
  must fall back to the one before; a restarted job resumes from that one;
* **NaN and spike** — one rank's loss is NaN at one step and 1000x at another: both steps are
  skipped on every rank (the decision taken on the mean over ranks), training finishes, the
  replicas stay identical and finite;
* **2 -> 1 ranks** — a 2-rank checkpoint resumed on one rank continues the data (the same global
  batches as the uninterrupted run), the schedule and the optimizer's step count;
* **deterministic mode** — the flags and seeds it must set; a rank-order sum at 4 ranks equal to
  ((x0 + x1) + x2) + x3 bit for bit; and two runs started from differently scrambled random
  states giving identical losses and parameters.

Unit checks (commit, guard, deterministic mode) also run on course_lib's own checkpoint commit,
SpikeGuard, deterministic mode and rank-order all-reduce in tests/test_lab_checks.py; the attacks
need the lab's loop and run on the reference solution in tests/test_labs.py, on planted bugs in
tests/test_lab11_fault_tolerance.py (course_lib's own loop meets the same attacks in
tests/test_checkpoint_resume.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from course_lib.checkpoint.commit import sha256
from course_lib.dist import RankError, device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task

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
MANIFEST = "MANIFEST.json"
STEPS, SAVE_EVERY, KEEP = 12, 3, 2
KILL_SEED = 2026  # the kill step and the victim are drawn from it: a fixed draw, so that grading repeats
LAUNCH_S = 60  # one 2-rank run of 12 steps takes ~2 s on the course machine


def adapter(lab_dir: Path) -> Adapter:
    """The learner's loop and its pieces, from ``resilient.py``."""
    return Adapter.of_file(Path(lab_dir) / "resilient.py", ROLES)


# ------------------------------------------------------------------------- the fault injectors


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


def _wrap_write_shards(module, rank: int, save: int) -> None:
    """Rank ``rank`` dies in its ``save``-th call of write_shards (from 1), after DCP wrote the files,
    with its own shard cut to half: the state a crash in the middle of writing leaves."""
    original, calls = module.write_shards, [0]

    def write_shards(state, directory):
        original(state, directory)
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] == save:
            for shard in Path(directory).glob(f"__{rank}_*.distcp"):
                data = shard.read_bytes()
                shard.write_bytes(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)

    module.write_shards = write_shards


def _scramble(seed: int) -> None:
    """Leave the generators wherever some earlier code might have: a different history per run."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.rand(seed % 7 + 1)  # host: advances the CPU generator, the state deterministic_mode must reset


def _rank(impl: Adapter, root, steps: int, faults: dict, kw: dict):
    """One rank's run of the learner's ``train`` with ``faults`` injected; (summary, targets seen)."""
    rank, module = dist.get_rank(), impl.module("train")
    seen: list = []
    if "scramble" in faults:
        _scramble(faults["scramble"] + rank)
    _wrap_compute_loss(module, rank, faults, seen)
    if "kill_save" in faults:
        _wrap_write_shards(module, *faults["kill_save"])
    return impl["train"](None if root is None else str(root), steps, **kw), seen


def _run(impl, world_size, root, steps, faults=None, **kw):
    """The learner's ``train`` on ``world_size`` ranks with ``faults``: [(summary, targets seen) per rank]."""
    return launch(_rank, world_size, impl, root, steps, faults or {}, kw, timeout=LAUNCH_S)


def _run_until_killed(impl, world_size, root, steps, faults, what, **kw) -> None:
    try:
        _run(impl, world_size, root, steps, faults, **kw)
    except RankError:
        return
    raise AssertionError(f"{what}, yet the run finished: call compute_loss and write_shards as given")


def _manifest_step(path) -> int | None:
    try:
        return json.loads((Path(path) / MANIFEST).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AssertionError(f"{path}/{MANIFEST} must be JSON with the checkpoint's 'step': {e}") from None


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


def _differing_losses(ref: dict, got: dict, after: int) -> list[int]:
    """The steps after ``after`` whose loss differs from the reference's."""
    return [s for s in range(after + 1, ref["step"] + 1) if got["losses"].get(s) != ref["losses"][s]]


def _check_identical(reference, resumed, what: str) -> None:
    for rank, ((ref, _), (got, _)) in enumerate(zip(reference, resumed)):
        problems = _differences(ref, got)
        assert not problems, f"{what}: rank {rank}: " + "; ".join(problems)
        start = _manifest_step_of(got)
        bad = _differing_losses(ref, got, start)
        assert not bad, f"{what}: the losses of steps {bad[:3]} differ from the uninterrupted run's"


def _manifest_step_of(summary: dict) -> int:
    name = summary["resumed_from"]
    return int(name.rsplit("_", 1)[-1]) if name else 0


# -------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("train")
    for name in (*ROLES, "CorruptCheckpointError", "compute_loss", "write_shards"):
        assert getattr(module, name, None) is not None, f"resilient.py must define {name}"


def _commit_rank(impl: Adapter, root: str) -> None:
    rank = dist.get_rank()
    dev = device()  # a rank checkpoints tensors where it trains them
    state = {"w": torch.arange(1000.0, device=dev), f"mine.{rank}": torch.full((10 + rank,), float(rank), device=dev)}
    for step in (2, 4, 6):
        state["w"] += 1
        impl["commit_checkpoint"](root, step, state, keep=KEEP)
        # no rank may return before the commit is visible to all
        committed = sorted(p.name for p in Path(root).iterdir() if not p.name.startswith("."))
        assert f"step_{step:08d}" in committed, (
            f"rank {rank} returned from commit_checkpoint(step={step}) before step_{step:08d} existed: "
            "end with a barrier after the rename"
        )


def check_commit(impl: Adapter) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        launch(_commit_rank, 2, impl, str(root), timeout=LAUNCH_S)
        entries = sorted(p.name for p in root.iterdir())
        assert entries == ["step_00000004", "step_00000006"], (
            f"after commits of steps 2, 4 and 6 with keep=2, {root.name}/ holds {entries}: expected the two newest "
            "committed checkpoints step_00000004 and step_00000006 and nothing else (no temporary directories left)"
        )
        for name in entries:
            path = root / name
            manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).exists() else None
            assert manifest is not None, f"{name} has no {MANIFEST}: write it before the rename"
            on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
            assert sorted(manifest.get("files", {})) == on_disk, (
                f"{name}/{MANIFEST} lists {sorted(manifest.get('files', {}))}, the directory holds {on_disk}: "
                "list every file (both ranks' shards and .metadata)"
            )
            for file, entry in manifest["files"].items():
                assert entry.get("bytes") == (path / file).stat().st_size and entry.get("sha256") == sha256(
                    path / file
                ), f"{name}/{MANIFEST}: the bytes or sha256 of {file} do not match the file"
        assert _manifest_step(root / "step_00000006") == 6, "the manifest's 'step' must be the step saved"
        latest = impl["latest_checkpoint"](root)
        assert latest is not None and Path(latest).name == "step_00000006", (
            f"latest_checkpoint returned {latest}, expected step_00000006"
        )
        # what dead saves leave: a temporary directory, and a step directory that was never committed
        shutil.copytree(root / "step_00000006", root / ".tmp-step_00000008")
        shutil.copytree(root / "step_00000006", root / "step_00000008")
        (root / "step_00000008" / MANIFEST).unlink()
        latest = impl["latest_checkpoint"](root)
        assert latest is not None and Path(latest).name == "step_00000006", (
            f"with an uncommitted step_00000008 (no manifest) beside step_00000006, latest_checkpoint returned "
            f"{latest}: a directory without a valid manifest is not a checkpoint"
        )


def _damage(path: Path, kind: str) -> str:
    """Damage one shard of the checkpoint at ``path`` in place; its name."""
    shard = sorted(path.glob("*.distcp"))[-1]
    if kind == "deleted":
        shard.unlink()
        return shard.name
    data = bytearray(shard.read_bytes())
    if kind == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x10  # one bit
    shard.write_bytes(bytes(data))
    return shard.name


def check_damaged_shards(impl: Adapter) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _run(impl, 2, root, 6, save_every=SAVE_EVERY, keep=KEEP)
        newest = root / "step_00000006"
        assert newest.exists() and (root / "step_00000003").exists(), (
            f"a 6-step run saving every 3 steps should leave step_00000003 and step_00000006; found "
            f"{sorted(p.name for p in root.iterdir())}"
        )
        impl["verify_checkpoint"](newest)  # an intact checkpoint passes
        for kind in ("truncated", "altered", "deleted"):
            copy = Path(tmp) / kind
            shutil.copytree(root, copy)
            name = _damage(copy / newest.name, kind)
            try:
                impl["verify_checkpoint"](copy / newest.name)
            except Exception as e:
                assert name in str(e), (
                    f"verify_checkpoint refused a {kind} shard but its message does not name it ({name}): {e}"
                )
            else:
                raise AssertionError(f"verify_checkpoint accepted a checkpoint whose shard {name} was {kind}")
            latest = impl["latest_checkpoint"](copy)
            assert latest is not None and Path(latest).name == "step_00000003", (
                f"with step_00000006's shard {kind}, latest_checkpoint returned {latest}: skip a checkpoint that "
                "fails verification and fall back to step_00000003"
            )
        resumed = _run(impl, 2, Path(tmp) / "altered", 9, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        assert resumed[0][0]["resumed_from"] == "step_00000003", (
            f"train(resume=True) beside a damaged step_00000006 resumed from {resumed[0][0]['resumed_from']}, "
            "not step_00000003: resume from latest_checkpoint"
        )


def check_killed_save(impl: Adapter) -> None:
    reference = _run(impl, 2, None, STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        faults = {"kill_save": (0, 3)}  # the third save: step 9
        _run_until_killed(
            impl, 2, root, STEPS, faults, "rank 0 was killed in the save of step 9", save_every=SAVE_EVERY, keep=KEEP
        )
        latest = impl["latest_checkpoint"](root)
        assert latest is not None, (
            "after a save killed at step 9, latest_checkpoint found nothing: step 6 was committed"
        )
        step = _manifest_step(latest)
        assert step == 6, (
            f"rank 0 died inside the save of step 9 (its shard half written); latest_checkpoint returned the "
            f"checkpoint of step {step}: a save is a checkpoint only once its manifest is written and it is renamed"
        )
        resumed = _run(impl, 2, root, STEPS, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        _check_identical(reference, resumed, "resumed after a killed save")


def check_kill_and_resume(impl: Adapter) -> None:
    draw = random.Random(KILL_SEED)
    kill_at, victim = draw.randrange(SAVE_EVERY + 1, STEPS), draw.randrange(2)
    if kill_at % SAVE_EVERY == 0:
        kill_at += 1  # between two saves, so that a resume has steps to redo
    reference = _run(impl, 2, None, STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _run_until_killed(
            impl,
            2,
            root,
            STEPS,
            {"kill": (victim, kill_at)},
            f"rank {victim} was SIGKILLed at step {kill_at}",
            save_every=SAVE_EVERY,
            keep=KEEP,
        )
        resumed = _run(impl, 2, root, STEPS, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        want = kill_at // SAVE_EVERY * SAVE_EVERY
        got = _manifest_step_of(resumed[0][0])
        assert got == want, (
            f"rank {victim} was killed after {kill_at} steps; the restarted job resumed from step {got}, "
            f"not from the last checkpoint (step {want})"
        )
        _check_identical(reference, resumed, f"killed (rank {victim} at step {kill_at}) and resumed")


def check_resume_on_one_rank(impl: Adapter) -> None:
    reference = _run(impl, 2, None, STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _run(impl, 2, root, 6, save_every=SAVE_EVERY, keep=KEEP)
        (got, seen), *_ = _run(impl, 1, root, STEPS, save_every=SAVE_EVERY, keep=KEEP, resume=True)
        assert got["resumed_from"] == "step_00000006", (
            f"one rank resuming a 2-rank run resumed from {got['resumed_from']}, not step_00000006"
        )
        batches = impl.module("train").batches_from(6, 0, 1)
        want = [next(batches)[1] for _ in range(STEPS - 6)]
        assert len(seen) == len(want) and all(torch.equal(a, b) for a, b in zip(seen, want)), (
            "resumed on one rank, the run must see the global batches of steps 6-11, whole: the data position "
            "is the step, at any world size"
        )
        ref = reference[0][0]
        assert got["lr"] == ref["lr"], (
            f"the learning rate at the end is {got['lr']}, not {ref['lr']}: restore the scheduler"
        )
        steps = {int(s["step"]) for s in got["optimizer"].values()}
        assert steps == {STEPS}, f"AdamW's step count is {steps} after 12 steps: restore the optimizer's state"


def check_guard(impl: Adapter) -> None:
    guard = impl["SpikeGuard"](factor=3.0, window=4, min_history=2)
    losses = [5.0, 100.0, float("nan"), 4.0, float("inf"), 4.5, 20.0, 12.0, -float("inf"), 4.0, 3.0, 13.0]
    # 100 is taken (history of 1 < min_history); 20 > 3·median(5, 100, 4, 4.5) = 14.25; after 12 joins,
    # the history is (4, 4.5, 12, 4), median 4.25: 13 > 12.75 is skipped, 12 was not (< 14.25)
    want = [True, True, False, True, False, True, False, True, False, True, True, False]
    saved = None
    for i, (loss, decision) in enumerate(zip(losses, want)):
        if i == 6:
            saved = guard.state_dict()
        got = guard.check(loss)
        assert got == decision, (
            f"SpikeGuard(factor=3, window=4, min_history=2).check({loss}) after {losses[:i]} returned {got}: "
            f"{'skip' if not decision else 'take'} it (NaN and ±inf always skip; a spike is above 3 × the median "
            "of the last 4 *accepted* losses, once 2 are known)"
        )
    assert list(guard.skipped) == [2, 4, 6, 8, 11], f"skipped must list the calls that were skipped: {guard.skipped}"
    fresh = impl["SpikeGuard"](factor=3.0, window=4, min_history=2)
    fresh.load_state_dict(saved)
    again = [fresh.check(loss) for loss in losses[6:]]
    assert again == want[6:] and list(fresh.skipped) == list(guard.skipped), (
        "a guard loaded from state_dict() must decide as the one that saved it: save the history and the counts"
    )


def check_nan_and_spike(impl: Adapter) -> None:
    steps = 10
    try:
        runs = _run(impl, 2, None, steps, {"nan": (1, 5), "spike": (0, 7)})
    except RankError as e:  # one rank stepped (all-gathering gradients) while the other skipped: mismatched collectives
        raise AssertionError(
            f"with rank 1's loss NaN at step index 5 the run broke ({str(e).splitlines()[0][:120]}): the ranks called "
            "different collectives, as when one skips and the other steps; decide on the mean loss over the ranks"
        ) from None
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
    differ = [n for n in runs[0][0]["params"] if not torch.equal(runs[0][0]["params"][n], runs[1][0]["params"][n])]
    assert not differ, (
        f"after the skipped steps the replicas differ in {differ[:2]}: every rank must take the same decision"
    )


def _determinism_rank(impl: Adapter, seed: int) -> dict:
    rank = dist.get_rank()
    _scramble(100 + rank)
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


def check_two_runs(impl: Adapter) -> None:
    first = _run(impl, 2, None, 8, {"scramble": 1})
    second = _run(impl, 2, None, 8, {"scramble": 5})
    for rank, ((a, _), (b, _)) in enumerate(zip(first, second)):
        assert a["losses"] == b["losses"], (
            f"two runs of train(seed=0) on rank {rank}, started from differently seeded random generators, gave "
            "different losses: deterministic_mode must seed every generator the run draws from"
        )
        differ = [n for n in a["params"] if not torch.equal(a["params"][n], b["params"][n])]
        assert not differ, f"two deterministic runs end with different parameters {differ[:2]}"
        assert all(math.isfinite(v) for v in a["losses"].values()), "the losses must be finite"


TASKS = [
    Task("resilient.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: atomic commit, manifest with checksums, keep the newest n", 2, check_commit),
    Task("Task 1: a save killed half-way leaves the previous checkpoint loadable", 2, check_killed_save, timeout=150),
    Task("Task 1: a truncated, altered or missing shard refused, naming it", 2, check_damaged_shards, timeout=150),
    Task("Task 2: SIGKILL at a random step, restart: bit-identical", 4, check_kill_and_resume, timeout=150),
    Task("Task 2: a 2-rank checkpoint resumed on 1 rank", 1, check_resume_on_one_rank, timeout=150),
    Task("Task 3: the spike guard's decisions", 1, check_guard),
    Task("Task 3: a NaN and a spike skipped, training finishes", 2, check_nan_and_spike, timeout=90),
    Task("Task 4: deterministic mode and a rank-order sum", 1, check_deterministic_mode),
    Task("Task 4: two deterministic runs identical", 2, check_two_runs, timeout=90),
]
