"""The atomic commit: a checkpoint directory exists complete, or not at all (lecture 08b).

torch.distributed.checkpoint (DCP) writes one file per rank plus a ``.metadata`` index, but a job
killed half-way leaves a directory that *looks* like a checkpoint: some shard files, maybe a
truncated one, maybe no index. DCP does not promise more (its docs: the writer may leave partial
files behind on failure). The classic remedy, used by databases and by every training framework
that survives preemption, is write-then-rename: POSIX ``rename`` of a directory is atomic within a
file system, so readers see either the old name space or the new one.

    1. every rank writes into ``<root>/.tmp-step_XXXXXXXX-<id>/`` (a name :func:`latest` ignores);
    2. barrier: all shards are on disk (DCP's writer fsyncs each file);
    3. the ranks hash the files (each a 1/N share: hashing costs a read of every byte, so it is
       spread like the writing was) and rank 0 writes ``MANIFEST.json``: size and sha256 of every
       file, fsynced;
    4. rank 0 renames the directory to ``<root>/step_XXXXXXXX/`` and fsyncs ``<root>``;
    5. barrier: no rank goes on (or prunes) before the commit is visible.

A crash before 4 leaves only a ``.tmp-`` directory; :func:`latest` skips it and :func:`prune`
removes it. The manifest also catches what happens *after* the commit (a copy cut short, a flipped
bit on disk): :func:`verify` refuses a checkpoint whose files do not match it, naming the file.

Functions here run on every rank of the default process group, or in a single process when
torch.distributed is not initialised (the same code: rank 0 of 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

MANIFEST = "MANIFEST.json"
FORMAT = "course-checkpoint/1"
_COMMITTED = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-"


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files do not match its manifest, or that was never committed."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``<root>/step_XXXXXXXX``: eight digits, so names sort in step order."""
    if not isinstance(step, int) or not 0 <= step < 10**8:
        raise ValueError(f"step must be an int in [0, 1e8), got {step!r}")
    return Path(root) / f"step_{step:08d}"


def rank_world() -> tuple[int, int]:
    """(rank, world size), (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def _agree(obj):
    """Rank 0's ``obj`` on every rank (collective)."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj) -> list:
    if rank_world()[1] == 1:
        return [obj]
    out = [None] * rank_world()[1]
    dist.all_gather_object(out, obj)
    return out


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new file, a rename) durable: fsync the directory itself."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_share(directory: Path, names: Sequence[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} for this rank's share of ``names`` (every N-th, from its rank)."""
    rank, world = rank_world()
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256(directory / n)} for n in names[rank::world]}


def write_manifest(directory: Path, fields: dict) -> dict:
    """Write ``MANIFEST.json`` into ``directory`` durably (temp file, fsync, rename). Rank 0 only."""
    manifest = {"format": FORMAT, **fields}
    partial = directory / (MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, directory / MANIFEST)
    fsync_dir(directory)
    return manifest


def commit(
    root: str | os.PathLike,
    step: int,
    write: Callable[[Path], None],
    *,
    kind: str = "full",
    refs: Sequence[str] = (),
    info: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Run ``write(tmp_dir)`` on every rank, then commit the result as ``<root>/step_XXXXXXXX``.

    ``kind`` and ``refs`` (names of checkpoints this one needs: an incremental's base) go into the
    manifest with ``info``; :func:`prune` never removes a checkpoint that a kept one refers to.
    ``keep``: prune to the newest ``keep`` checkpoints after the commit. Collective.
    """
    rank, world = rank_world()
    root, final = Path(root), step_dir(root, step)
    # The ranks must agree on one temp name: rank 0 draws it (and creates the folder) and sends it.
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    tmp = Path(_agree(str(tmp)))
    write(tmp)
    _barrier()  # every rank's files are on disk (DCP fsyncs them) before anyone hashes
    names = sorted(p.name for p in tmp.iterdir()) if rank == 0 else None
    names = _agree(names)
    files = {}
    for share in _all_gather(_hash_share(tmp, names)):
        files.update(share)
    if rank == 0:
        fields = dict(step=step, kind=kind, refs=list(refs), world_size=world, info=info or {}, files=files)
        write_manifest(tmp, {**fields, "created": time.time()})
        if final.exists():  # the same step saved again (a run resumed from an older checkpoint)
            old = root / f"{_TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)  # out of the way under a name latest() ignores...
            os.rename(tmp, final)  # ...so that at every moment one of the two is loadable
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
        if keep is not None:
            prune(root, keep)
    _barrier()
    return final


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a committed checkpoint (not checked against the files: see :func:`verify`)."""
    path = Path(path)
    where = path / MANIFEST
    if not where.exists():
        raise CorruptCheckpoint(
            f"{path} has no {MANIFEST}: it was never committed (a save killed before its rename leaves "
            f"a {_TMP_PREFIX}* directory like this one); load a committed checkpoint, see latest(root)"
        )
    try:
        manifest = json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise CorruptCheckpoint(f"{where} is not valid JSON ({e}); load an older checkpoint with latest(root)") from e
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _check_file(path: Path, expected: dict) -> str | None:
    """Why ``path`` does not match its manifest entry, or None."""
    if not path.exists():
        return f"shard {path.name} is missing from {path.parent}"
    size = path.stat().st_size
    if size < expected["bytes"]:
        return (
            f"shard {path.name} is truncated ({size} of {expected['bytes']} bytes): the copy or the "
            "write that produced it did not finish"
        )
    if size != expected["bytes"]:
        return f"shard {path.name} has {size} bytes where the manifest says {expected['bytes']}: it was altered"
    if sha256(path) != expected["sha256"]:
        return f"shard {path.name} is corrupted: its sha256 differs from the manifest's (its bytes changed on disk)"
    return None


def verify(path: str | os.PathLike, share: tuple[int, int] = (0, 1)) -> dict:
    """Check every file of a committed checkpoint against its manifest; return the manifest.

    Raises :class:`CorruptCheckpoint` naming the first bad file and why on its first line, the
    checkpoint and what to do on the next. ``share=(r, n)`` checks only every
    n-th file from the r-th (the ranks split the reading, see :func:`verify_collective`).
    """
    path = Path(path)
    manifest = read_manifest(path)
    r, n = share
    for name in sorted(manifest["files"])[r::n]:
        problem = _check_file(path / name, manifest["files"][name])
        if problem:
            raise CorruptCheckpoint(
                f"{problem}.\nCheckpoint {path} cannot be loaded: load an older one (latest(root) skips "
                "checkpoints that fail this check)"
            )
    return manifest


def verify_collective(path: str | os.PathLike) -> dict:
    """:func:`verify`, with the files split over the ranks; every rank raises the same error."""
    rank, world = rank_world()
    try:
        verify(path, share=(rank, world))
        problem = None
    except CorruptCheckpoint as e:
        problem = str(e)
    problems = [p for p in _all_gather(problem) if p]
    if problems:
        raise CorruptCheckpoint(problems[0])
    return read_manifest(path)


def verify_per_rank(path: str | os.PathLike, kind: str) -> dict:
    """:func:`verify_collective` for a checkpoint whose entries are per rank (incremental, quantized):
    it must be of ``kind`` and have been saved at this run's world size. Returns the manifest."""
    path = Path(path)
    manifest = verify_collective(path)
    if manifest["kind"] != kind:
        raise ValueError(f"{path} is a {manifest['kind']} checkpoint, not a {kind} one")
    if manifest["world_size"] != rank_world()[1]:
        raise ValueError(
            f"{path} holds {manifest['world_size']} ranks' {kind} shards and this run has {rank_world()[1]}: "
            "load it at the world size that saved it, then save a full checkpoint, which DCP can reshard"
        )
    return manifest


def committed(root: str | os.PathLike) -> list[Path]:
    """The committed checkpoint directories under ``root``, oldest first (temp ones excluded)."""
    root = Path(root)
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _COMMITTED.match(p.name))


def latest(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (with the bases it refers to), or None.

    Unfinished saves (``.tmp-*``) are never candidates; a committed checkpoint that fails
    :func:`verify` is skipped. Each call reads every byte of the candidates it checks: cheap for the
    course's models, and what makes a bad newest checkpoint fall back to the one before it.
    """
    for path in reversed(committed(root)):
        try:
            manifest = verify(path)
            for ref in manifest["refs"]:
                verify(path.parent / ref)
        except CorruptCheckpoint:
            continue
        return path
    return None


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Keep the newest ``keep`` committed checkpoints (and the bases they refer to); remove the rest
    and any unfinished ``.tmp-*`` saves. Returns the names removed.

    Call it from one process while no save is in flight (``commit(keep=...)`` does so on rank 0):
    a ``.tmp-`` directory is then certainly the leftover of a save that died.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (never prune the checkpoint you would resume from), got {keep!r}")
    root = Path(root)
    dirs = committed(root)
    kept = dirs[-keep:]
    needed = {p.name for p in kept}
    for p in kept:
        try:
            needed.update(read_manifest(p)["refs"])
        except CorruptCheckpoint:
            pass  # a kept checkpoint that cannot be read refers to nothing we can know
    removed = []
    for p in dirs:
        if p.name not in needed:
            shutil.rmtree(p)
            removed.append(p.name)
    for p in root.iterdir() if root.exists() else ():
        if p.name.startswith(_TMP_PREFIX):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
