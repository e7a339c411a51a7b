"""Lab 11, Task 1: the atomic commit, graded on its own with the grader's own loop of saves.

No check here calls the learner's ``train``: 2 ranks commit small state dicts of their own
(a shared tensor and one per rank) with the learner's ``commit_checkpoint``, and the grader reads
the result with the learner's ``verify_checkpoint`` and ``latest_checkpoint``:

* **commit** — steps 2, 4, 6 with ``keep=2``: only the newest two remain, each with a manifest that
  lists every file's bytes and sha256; a leftover ``.tmp-`` and a ``step_`` directory without a
  manifest are no checkpoints; no rank returns before the commit is visible;
* **killed save** — rank 0 dies in the save of step 9, after DCP wrote the files (its own shard cut
  to half); step 6 stays the newest valid checkpoint, and a restarted save of step 9 succeeds
  beside the dead save's leftovers;
* **damaged shards** — truncated, altered by one bit, deleted, or the manifest gone: verify raises
  ``CorruptCheckpointError`` naming the file and latest falls back; a step saved again over the
  damaged directory (what a run resumed from the previous checkpoint does) replaces it;
* **durability order** — the grader's process records each ``os.fsync`` (with the path of its file
  descriptor) and ``os.rename``: the manifest must be in the directory and fsynced before the rename
  to ``step_XXXXXXXX``, and ``root`` fsynced after it. No crash test observes this (the page cache
  survives a SIGKILL); a power cut would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint.commit import sha256
from course_lib.dist import RankError, device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.grading.labs._lab11_common import KEEP, LAUNCH_S, MANIFEST, entries, manifest_step


def wrap_write_shards(module, rank: int, save: int) -> None:
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


def _state(rank: int, step: int) -> dict:
    dev = device()  # a rank checkpoints tensors where it trains them
    return {
        "w": torch.arange(1000.0, device=dev) + step,
        f"mine.{rank}": torch.full((10 + rank,), float(rank + step), device=dev),
    }


def _rename_hint(e: Exception, root: Path, step: int) -> str:
    return (
        f"commit_checkpoint(step={step}) raised {type(e).__name__}: {e} — {root.name}/step_{step:08d} already "
        "existed (a run resumed from an older checkpoint saves that step again, and os.rename will not replace "
        "a directory that is not empty): move the old one aside under a .tmp- name, rename, then remove it"
    )


def _save_rank(impl: Adapter, root: str, steps, kill_in=None) -> None:
    """This rank commits ``steps`` with the learner's commit_checkpoint; ``kill_in``: (rank, n-th save)."""
    rank = dist.get_rank()
    if kill_in is not None:
        wrap_write_shards(impl.module("commit_checkpoint"), *kill_in)
    for step in steps:
        existed = (Path(root) / f"step_{step:08d}").exists()
        try:
            impl["commit_checkpoint"](root, step, _state(rank, step), keep=KEEP)
        except OSError as e:
            if existed:
                raise AssertionError(_rename_hint(e, Path(root), step)) from None
            raise
        # no rank may return before the commit is visible to all
        committed = [name for name in entries(root) if not name.startswith(".")]
        assert f"step_{step:08d}" in committed, (
            f"rank {rank} returned from commit_checkpoint(step={step}) before step_{step:08d} existed: "
            "end with a barrier after the rename"
        )


def _save(impl: Adapter, root: Path, steps, kill_in=None) -> None:
    launch(_save_rank, 2, impl, str(root), tuple(steps), kill_in, timeout=LAUNCH_S)


def check_commit(impl: Adapter) -> None:
    """Commits of steps 2, 4, 6 with keep=2 leave the newest two, each with a full, true manifest;
    latest_checkpoint ignores leftovers of dead saves."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _save(impl, root, (2, 4, 6))
        names = entries(root)
        assert names == ["step_00000004", "step_00000006"], (
            f"after commits of steps 2, 4 and 6 with keep=2, {root.name}/ holds {names}: expected the two newest "
            "committed checkpoints step_00000004 and step_00000006 and nothing else (no temporary directories left)"
        )
        for name in names:
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
        assert manifest_step(root / "step_00000006") == 6, "the manifest's 'step' must be the step saved"
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


def check_killed_save(impl: Adapter) -> None:
    """Rank 0 dies inside the save of step 9: step 6 stays the newest valid checkpoint, and the
    restarted job's save of step 9 succeeds beside the dead save's leftovers and removes them."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        try:
            _save(impl, root, (3, 6, 9), kill_in=(0, 3))
        except RankError:
            pass
        else:
            raise AssertionError(
                "rank 0 was killed in the save of step 9, yet the saves finished: call write_shards as given"
            )
        latest = impl["latest_checkpoint"](root)
        assert latest is not None, (
            f"after a save killed at step 9, latest_checkpoint found nothing in {entries(root)}: step 6 was committed"
        )
        step = manifest_step(latest)
        assert step == 6, (
            f"rank 0 died inside the save of step 9 (its shard half written); latest_checkpoint returned the "
            f"checkpoint of step {step}: a save is a checkpoint only once its manifest is written and it is renamed"
        )
        leftovers = [name for name in entries(root) if name.startswith(".")]
        try:
            _save(impl, root, (9,))  # the restarted job saves step 9 again
        except RankError as e:
            if "FileExistsError" not in e.rank_traceback:
                raise
            raise AssertionError(
                f"the restarted job's save of step 9 raised FileExistsError: the killed save left {leftovers} in "
                f"{root.name}/; a save must clear what a dead save of the same step left (no save is in flight then)"
            ) from None
        latest = impl["latest_checkpoint"](root)
        assert latest is not None and Path(latest).name == "step_00000009", (
            f"the restarted job's save of step 9 (beside the killed save's leftovers) left {entries(root)}, and "
            f"latest_checkpoint returned {latest}: a save must succeed where a dead save of the same step left files"
        )
        assert entries(root) == ["step_00000006", "step_00000009"], (
            f"after the restarted save of step 9 with keep=2, {root.name}/ holds {entries(root)}: remove the "
            "leftovers of saves that died (no save is in flight once this one is committed)"
        )


def _damage(path: Path, kind: str) -> str:
    """Damage one file of the checkpoint at ``path`` in place; its name."""
    if kind == "manifest deleted":
        (path / MANIFEST).unlink()
        return MANIFEST
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
    """A truncated, altered or missing shard, or a missing manifest: verify_checkpoint raises
    CorruptCheckpointError naming the file, latest_checkpoint falls back; a step saved again over the
    damaged directory replaces it."""
    expected = getattr(impl.module("verify_checkpoint"), "CorruptCheckpointError", RuntimeError)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        _save(impl, root, (3, 6))
        newest = root / "step_00000006"
        impl["verify_checkpoint"](newest)  # an intact checkpoint passes
        for kind in ("truncated", "altered", "deleted", "manifest deleted"):
            copy = Path(tmp) / kind.replace(" ", "_")
            shutil.copytree(root, copy)
            name = _damage(copy / newest.name, kind)
            damage = f"{name} {kind.split()[-1]}"  # e.g. "__1_0.distcp truncated", "MANIFEST.json deleted"
            what = f"verify_checkpoint of step_00000006 with {damage}"
            e = raises(expected, impl["verify_checkpoint"], copy / newest.name, what=what)
            assert name in str(e), f"{what} raised, but its message does not name {name}: {e}"
            latest = impl["latest_checkpoint"](copy)
            assert latest is not None and Path(latest).name == "step_00000003", (
                f"with step_00000006's {damage}, latest_checkpoint returned {latest}: skip a checkpoint that "
                "fails verification and fall back to step_00000003"
            )
        altered = Path(tmp) / "altered"
        _save(impl, altered, (6,))  # a run resumed from step 3 saves step 6 again, over the damaged one
        latest = impl["latest_checkpoint"](altered)
        assert latest is not None and Path(latest).name == "step_00000006", (
            f"step 6 saved again over a damaged step_00000006: latest_checkpoint returned {latest}, not the new "
            "step_00000006: replace the directory that was there"
        )


# ------------------------------------------------------------------------------ durability order


def _record_rank(impl: Adapter, root: str) -> list[tuple]:
    """Commit step 2 with os.fsync/os.rename/os.replace/os.sync recorded in this process (the learner's
    module may also hold them under their own names): [("fsync", path) | ("rename", src, dst, had manifest)]."""
    module, events = impl.module("commit_checkpoint"), []
    real = {name: getattr(os, name) for name in ("fsync", "rename", "replace", "sync")}

    def fsync(fd):
        try:
            where = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        except OSError:
            where = "?"
        events.append(("fsync", os.path.realpath(where)))
        return real["fsync"](fd)

    def moving(name):
        def move(src, dst, *args, **kwargs):
            src, dst = os.path.realpath(os.fsdecode(src)), os.path.realpath(os.fsdecode(dst))
            events.append(("rename", src, dst, os.path.exists(os.path.join(src, MANIFEST))))
            return real[name](src, dst, *args, **kwargs)

        return move

    def sync():
        events.append(("fsync", "*"))  # everything: os.sync() flushes every file system
        return real["sync"]()

    fakes = {"fsync": fsync, "rename": moving("rename"), "replace": moving("replace"), "sync": sync}
    for name, fake in fakes.items():
        setattr(os, name, fake)
        for attr, value in vars(module).items():  # from os import fsync, rename
            if value is real[name]:
                setattr(module, attr, fake)
    impl["commit_checkpoint"](root, 2, _state(dist.get_rank(), 2), keep=KEEP)
    return events


def check_durable_commit(impl: Adapter) -> None:
    """The order of the commit's fsyncs and renames, recorded: before the rename to step_XXXXXXXX the
    manifest is in the directory and fsynced; after it, root is fsynced (the rename made durable)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        root.mkdir()
        events = launch(_record_rank, 2, impl, str(root), timeout=LAUNCH_S)
        final, root_path = os.path.realpath(root / "step_00000002"), os.path.realpath(root)
        for rank_events in events:
            commits = [i for i, e in enumerate(rank_events) if e[0] == "rename" and e[2] == final]
            if not commits:
                continue
            i = commits[-1]
            src, had_manifest = rank_events[i][1], rank_events[i][3]
            assert had_manifest, (
                f"commit_checkpoint renamed {Path(src).name} to step_00000002 before {MANIFEST} was in it: write "
                "the manifest first, so that a crash right after the rename never leaves a checkpoint without one"
            )
            synced = [e[1] for e in rank_events[:i] if e[0] == "fsync"]
            assert any(p == "*" or Path(p).name.startswith(MANIFEST) for p in synced), (
                f"commit_checkpoint renamed {Path(src).name} to step_00000002 without fsyncing {MANIFEST} first "
                "(f.flush(); os.fsync(f.fileno())): after a power cut the checkpoint could exist with an empty manifest"
            )
            after = [e[1] for e in rank_events[i + 1 :] if e[0] == "fsync"]
            assert any(p in ("*", root_path) for p in after), (
                f"commit_checkpoint renamed into step_00000002 and never fsynced {root.name}/ after it: a rename is "
                "durable only once its directory is fsynced (fsync_dir(root))"
            )
            return
        raise AssertionError(
            "no rank renamed a directory to step_00000002 with os.rename (or os.replace): commit by writing into a "
            "temporary directory and renaming it"
        )
