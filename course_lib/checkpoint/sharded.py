"""Sharded save and load through torch.distributed.checkpoint, with resharding (lecture 08b).

PyTorch's Distributed Checkpoint (DCP, ``torch.distributed.checkpoint``; docs: "Getting Started with
Distributed Checkpoint") is what torchtitan and other large-scale trainers use. Its model:

* a state dict maps names to tensors and picklable objects; a tensor may be a **DTensor**, whose
  global shape and placement on a device mesh say which piece of the whole this rank holds;
* ``dcp.save`` has every rank write the pieces it holds (a plan agreed collectively, so a
  replicated tensor is written once) into its own file ``__<rank>_0.distcp``; the coordinator
  adds ``.metadata``, the global index of which chunk of which tensor lies where;
* ``dcp.load`` works in place: each rank asks for the slices its *own* DTensors cover, and reads
  them from whichever files hold them. The loading world need not be the saving world: that is
  resharding, and it costs nothing extra to write.

DCP does not make a save atomic nor check what it reads; :mod:`course_lib.checkpoint.commit` adds
both, and every save here goes through it. The names of the state dict are the caller's: ZeRO's
shards come from :mod:`course_lib.checkpoint.zero_state`, the data position and RNG states from
:mod:`course_lib.checkpoint.resume`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from course_lib.checkpoint.commit import CorruptCheckpoint, commit, verify, verify_collective


@contextlib.contextmanager
def _one_process_is_fine():
    """Without a process group DCP saves and loads in this one process, as meant here (a test, a
    notebook, :func:`read_full`), and warns that it assumes so each time: not worth a learner's attention."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*assuming the intent", category=UserWarning)
        yield


def write(state: dict, directory: Path) -> None:
    """DCP's save of ``state`` into ``directory`` (collective; no commit: see :func:`save`)."""
    # sync_files: fsync each shard before DCP reports it written, so the manifest hashes what is on disk
    with _one_process_is_fine():
        dcp.save(state, storage_writer=FileSystemWriter(directory, sync_files=True))


def save(root: str | os.PathLike, step: int, state: dict, *, keep: int | None = None, info: dict | None = None) -> Path:
    """Save ``state`` (DTensors, tensors, objects) as the committed checkpoint ``<root>/step_XXXXXXXX``.

    Collective: every rank passes its own state dict, with the same keys for the shared entries.
    ``keep``: then remove all but the newest ``keep`` checkpoints. Returns the directory.
    """
    return commit(root, step, lambda d: write(state, d), kind="full", info=info, keep=keep)


def entries(path: str | os.PathLike) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
    """{key: (global shape, dtype)} of the tensors a checkpoint holds, None for its objects."""
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (m.size, m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None for k, m in md.items()}


def _check_fits(path: Path, state: dict) -> None:
    """The requested keys exist, with the same global shape: else say what differs and why."""
    saved = entries(path)
    missing = sorted(set(state) - set(saved))
    if missing:
        raise KeyError(
            f"checkpoint {path} has no entries {missing[:4]}{' ...' if len(missing) > 4 else ''}: it was "
            "saved from another model or with other state (it holds "
            f"{sorted(saved)[:4]}...); build the same model and state dict as the run that saved it"
        )
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and saved[key] is not None:
            shape = value.shape  # a DTensor's .shape is its global shape: resharding keeps it
            if tuple(shape) != tuple(saved[key][0]):
                raise ValueError(
                    f"{key}: the checkpoint holds global shape {tuple(saved[key][0])}, this run "
                    f"{tuple(shape)}; a different model configuration (resharding changes who holds "
                    "which piece, never the global shape)"
                )


def read(path: str | os.PathLike, state: dict) -> dict:
    """DCP's load into ``state`` in place, without the manifest checks (see :func:`load`)."""
    path = Path(path)
    _check_fits(path, state)
    with _one_process_is_fine():
        dcp.load(state, storage_reader=FileSystemReader(str(path)))
    return state


def load(path: str | os.PathLike, state: dict) -> dict:
    """Load a full checkpoint into ``state`` in place, at any world size; return its manifest.

    First every file is checked against the manifest (the ranks share the reading), so a truncated
    or altered shard raises :class:`~course_lib.checkpoint.commit.CorruptCheckpoint` instead of
    being read. DTensors receive the slices of their own placement; objects (ints, bytes) are
    replaced by the saved ones. Collective.
    """
    manifest = verify_collective(path)
    if manifest["kind"] != "full":
        raise CorruptCheckpoint(
            f"{path} is a {manifest['kind']} checkpoint: load it with course_lib.checkpoint.{manifest['kind']}.load"
        )
    read(path, state)
    return manifest


def read_full(path: str | os.PathLike) -> dict:
    """Everything a checkpoint holds, as whole tensors and objects, in this one process.

    For inspection and tests: DCP assembles each tensor from all ranks' chunks (``no_dist``).
    Checks the manifest first, like :func:`load`.
    """
    verify(path)
    # host: one process assembles every rank's chunks for inspection; no rank's device is involved
    state = {k: torch.empty(m[0], dtype=m[1]) if m is not None else None for k, m in entries(path).items()}
    with _one_process_is_fine():
        dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return state


def local(value):
    """The piece of ``value`` this rank holds: a DTensor's local tensor, anything else as is."""
    return value.to_local() if isinstance(value, DTensor) else value
