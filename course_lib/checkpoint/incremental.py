"""Incremental checkpoints: only the blocks that changed since a full base checkpoint.

Check-N-Run (Eisenman et al., "Check-N-Run: a Checkpointing System for Training Deep Learning
Recommendation Models", NSDI 2022) observes that between two checkpoints of a recommendation model
only a small fraction of the embedding rows is touched, and writes just those, with a full
checkpoint from time to time. Here the unit of change is a block of ``block`` consecutive elements
of each tensor this rank holds (a ZeRO shard, see :mod:`course_lib.checkpoint.zero_state`); a block
counts as changed when any of its bits differ from the base (bitwise, so -0.0 vs 0.0 and NaN
payloads count too: the reconstruction must be exact, not merely close).

Each rank writes, per tensor, the indices of its changed blocks (int64) and their elements, under
keys of its own (``delta.<rank>.<key>.blocks`` / ``.values``); objects (step counts, RNG states)
are small and written whole. The manifest names the base (``refs``, so :func:`~course_lib.checkpoint.commit.prune`
keeps it) and records the sha256 of the base's manifest: if the base were re-written, applying the
deltas to it would build a state that never existed, so :func:`load` refuses.

What it costs: the diff needs the base in memory (:func:`snapshot`: one more copy of this rank's
state, on the host), and the saved bytes are those of
:func:`course_lib.cost.checkpoint.incremental_checkpoint_bytes`. Under AdamW every parameter with a
gradient moves each step, and both moments decay, so in full training almost every block changes;
the saving is real where most of the state is frozen (fine-tuning a few layers) or sparsely updated
(Check-N-Run's embedding tables). A restarted run has no base in memory: its next checkpoint must be
full (or :func:`snapshot` the base it loaded). Deltas are per rank: load at the saving world size.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from course_lib.checkpoint import sharded
from course_lib.checkpoint.commit import MANIFEST, CorruptCheckpoint, commit, rank_world, read_manifest, verify_per_rank

BLOCK = 1024


def snapshot(state: dict) -> dict[str, torch.Tensor]:
    """This rank's copy of the tensors of ``state`` (their local pieces): the base to diff against."""
    return {k: sharded.local(v).detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def changed_blocks(new: torch.Tensor, old: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Indices of the ``block``-element blocks of the flattened tensors whose bytes differ."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
            f"cannot diff {tuple(new.shape)} {new.dtype} against the base's {tuple(old.shape)} {old.dtype}: "
            "the base snapshot was taken from another state"
        )
    width = new.element_size()
    differs = (
        new.reshape(-1).view(torch.uint8).view(-1, width) != old.reshape(-1).view(torch.uint8).view(-1, width)
    ).any(1)
    pad = -differs.numel() % block
    return torch.nn.functional.pad(differs, (0, pad)).view(-1, block).any(1).nonzero().flatten()


def _elements(blocks: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Flat indices of the elements of ``blocks`` (the last block of a tensor may be short)."""
    idx = (blocks[:, None] * block + torch.arange(block, device=blocks.device)[None, :]).flatten()
    return idx[idx < numel]


def delta(state: dict, base: dict[str, torch.Tensor], block: int = BLOCK) -> dict:
    """This rank's entries of an incremental checkpoint: changed blocks and their elements per tensor,
    and the objects of ``state`` as they are."""
    rank, _ = rank_world()
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        if key not in base:
            raise KeyError(f"{key} is not in the base snapshot: take the snapshot from the state you save")
        now = sharded.local(value).detach()
        blocks = changed_blocks(now, base[key], block)
        out[f"delta.{rank}.{key}.blocks"] = blocks
        out[f"delta.{rank}.{key}.values"] = now.reshape(-1)[_elements(blocks, block, now.numel())].clone()
    return out


def _manifest_digest(path: Path) -> str:
    return hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()


def save(
    root: str | os.PathLike,
    step: int,
    state: dict,
    base_path: str | os.PathLike,
    base: dict[str, torch.Tensor],
    *,
    block: int = BLOCK,
    keep: int | None = None,
) -> Path:
    """Commit ``<root>/step_XXXXXXXX`` holding what changed in ``state`` since ``base`` (this rank's
    :func:`snapshot` taken when the full checkpoint ``base_path`` was saved). Collective."""
    base_path = Path(base_path)
    if base_path.parent.resolve() != Path(root).resolve():
        raise ValueError(f"the base {base_path} must be a checkpoint under the same root {root} (it is found by name)")
    if read_manifest(base_path)["kind"] != "full":
        raise ValueError(f"the base {base_path} must be a full checkpoint: deltas of deltas are not supported")
    entries = delta(state, base, block)
    info = {"block": block, "base_manifest_sha256": _manifest_digest(base_path)}
    return commit(
        root, step, lambda d: sharded.write(entries, d), kind="incremental", refs=[base_path.name], info=info, keep=keep
    )


def load(path: str | os.PathLike, state: dict) -> dict:
    """Rebuild the exact state of an incremental checkpoint in ``state``: load its base, then write
    the changed blocks over it. Needs the world size that saved it. Collective; returns the manifest."""
    path = Path(path)
    manifest = verify_per_rank(path, "incremental")
    rank = rank_world()[0]
    base_path = path.parent / manifest["refs"][0]
    if not base_path.exists() or _manifest_digest(base_path) != manifest["info"]["base_manifest_sha256"]:
        raise CorruptCheckpoint(
            f"the base {base_path.name} of incremental checkpoint {path.name} is missing or was re-written "
            "after the increment was made: the deltas no longer apply; load a full checkpoint"
        )
    sharded.load(base_path, state)
    block, saved = manifest["info"]["block"], sharded.entries(path)
    wanted = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            for part in ("blocks", "values"):
                name = f"delta.{rank}.{key}.{part}"
                if name not in saved:
                    raise KeyError(f"{path} has no {name}: it was saved from another state dict")
                # host: DCP reads the file into it; moved to the state's device below
                wanted[name] = torch.empty(saved[name][0], dtype=saved[name][1])
    sharded.read(path, wanted)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            flat = sharded.local(value).view(-1)  # the loaded tensors are contiguous: a view writes through
            blocks, values = wanted[f"delta.{rank}.{key}.blocks"], wanted[f"delta.{rank}.{key}.values"]
            blocks, values = blocks.to(flat.device), values.to(flat.device)  # read on the host (above)
            with torch.no_grad():
                flat[_elements(blocks, block, flat.numel())] = values
        else:
            state[key] = wanted[key]
    return manifest
