"""What besides the weights a resumed run needs to see exactly the batches it would have seen.

Model and optimizer state are not enough. A run resumed at step s must also draw the batches of
steps s, s+1, ... (not those of 0, 1, ...: re-reading the first batches silently biases training)
and continue the random streams (dropout masks, sampled noise) where they were. For the course's
data this is small: :meth:`course_lib.data.TokenDataset.batches` draws each epoch's permutation
from ``seed`` alone and cuts global batches of G sequences, so the batch of step s depends only on
(seed, G, s), at any world size; resuming is ``itertools.islice(ds.batches(...), s, None)``, as its
docstring says. :class:`TrainState` holds those three numbers.

Random number generators are per rank (each rank draws its own dropout masks). Their states are
saved under per-rank keys; a run resumed at the same world size continues every stream exactly.
At another world size N streams cannot become M, so each rank is reseeded from (seed, step, rank)
and the run is reproducible from then on, but no longer equal to the uninterrupted one there.
"""

from __future__ import annotations

import itertools
import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib.data import TokenDataset
from course_lib.dist import device


@dataclass
class TrainState:
    """Optimizer steps done (= global batches consumed) and what fixes the order of the batches."""

    step: int
    seed: int
    global_batch: int

    def batches(self, dataset: TokenDataset, rank: int, world_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches from step ``self.step`` on, epoch after epoch (forever); on the host, as
        :mod:`course_lib.data` draws them: move each to ``course_lib.dist.device()``."""
        if self.global_batch % world_size:
            raise ValueError(
                f"global batch {self.global_batch} does not split over world_size={world_size}: the "
                "order of the data depends on the global batch, so keep it and choose a world size that divides it"
            )
        stream = dataset.batches(self.global_batch // world_size, rank, world_size, seed=self.seed, epochs=None)
        # islice draws and drops the first `step` batches: O(step) cheap index gathers, not a forward pass
        return itertools.islice(stream, self.step, None)

    def epoch(self, dataset: TokenDataset) -> int:
        """The epoch the next batch belongs to (``batches`` drops each epoch's incomplete last batch)."""
        return self.step // (len(dataset) // self.global_batch)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> bytes:
    """This process's random states, pickled: torch's CPU generator, Python's, and the generator of
    the rank's accelerator (``course_lib.dist.device()``, e.g. "cuda": its own GPU's) when it computes
    on one. A rank on the CPU (gloo) never touches CUDA: asking for its state would open a CUDA
    context on GPU 0 in every such process, even on a machine whose GPUs the course does not use."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    dev = device()
    if dev.type != "cpu":
        states[dev.type] = torch.get_device_module(dev.type).get_rng_state(dev)
    return pickle.dumps(states)


def set_rng_state(blob: bytes) -> None:
    """Restore what :func:`rng_state` saved; the accelerator's state only where this rank computes on it."""
    states = pickle.loads(blob)
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    dev = device()
    if dev.type != "cpu" and dev.type in states:
        torch.get_device_module(dev.type).set_rng_state(states[dev.type], dev)


def state_dict(train: TrainState, rng: bool = True) -> dict:
    """Entries for a checkpoint: the data position, and (``rng``) this rank's random states.

    To load, pass a state dict made the same way (any values: DCP replaces them) with
    ``rng=False`` when the checkpoint was written at another world size (its manifest says which).
    """
    out = {"train.step": train.step, "train.seed": train.seed, "train.global_batch": train.global_batch}
    if rng:
        out[f"rng.{_rank()}"] = rng_state()  # a per-rank key: DCP writes it from this rank only
    return out


def restore(state: dict) -> TrainState:
    """The loaded data position; sets this rank's random states (or reseeds them, see the module doc)."""
    train = TrainState(int(state["train.step"]), int(state["train.seed"]), int(state["train.global_batch"]))
    key = f"rng.{_rank()}"
    if key in state:
        set_rng_state(state[key])
    else:  # another world size: deterministic, distinct per rank, never the streams of step 0
        seed = ((train.seed * 1_000_003 + train.step) * 65_537 + _rank()) % 2**63
        torch.manual_seed(seed)
        random.seed(seed)
    return train
