"""course_lib.checkpoint — fault tolerance: save sharded training state, survive a crash, resume exactly.

Built on PyTorch's Distributed Checkpoint (``torch.distributed.checkpoint``, DCP), the engine large
runs use for sharded model and optimizer state, plus what DCP does not give by itself and a course
should teach (lecture 08b). Reading order:

* :mod:`~course_lib.checkpoint.commit`      — the atomic commit (temp directory, manifest of sizes
  and sha256, rename), :func:`verify` with a clear :class:`CorruptCheckpoint`, :func:`latest`,
  :func:`prune` (keep the last k);
* :mod:`~course_lib.checkpoint.sharded`     — save/load of a state dict of DTensors through DCP,
  resharding to another world size on load;
* :mod:`~course_lib.checkpoint.zero_state`  — the course's ZeRO (lecture 02) as DTensors: each
  rank's flat shard is the local piece of a ``Shard(0)`` DTensor over the unpadded unit;
* :mod:`~course_lib.checkpoint.resume`      — the data position and the RNG states, so that a resumed
  run sees exactly the batches and random draws it would have seen;
* :mod:`~course_lib.checkpoint.incremental` — only the blocks that changed since a base (Check-N-Run);
* :mod:`~course_lib.checkpoint.quantized`   — int8 blockwise-absmax copies of the fp32 state.

The byte counts are formulas in :mod:`course_lib.cost.checkpoint`, with the optimal checkpoint
interval (Young 1974, Daly 2006); :mod:`course_lib.experiments.lecture08.checkpoint_runs` runs, kills, resumes and
reshards training for the lecture and the tests.

    state = {**zero_state_dict(zero), **resume.state_dict(train)}
    sharded.save(root, train.step, state, keep=3)            # every rank; atomic
    ...
    path = latest(root)                                       # newest checkpoint that verifies
    sharded.load(path, state); load_zero_state(zero, state); train = resume.restore(state)
"""

from course_lib.checkpoint import commit, incremental, quantized, resume, sharded
from course_lib.checkpoint.commit import CorruptCheckpoint, latest, prune, read_manifest, verify
from course_lib.checkpoint.resume import TrainState
from course_lib.checkpoint.zero_state import full_state, load_zero_state, zero_state_dict

__all__ = [
    "CorruptCheckpoint",
    "TrainState",
    "commit",
    "full_state",
    "incremental",
    "latest",
    "load_zero_state",
    "prune",
    "quantized",
    "read_manifest",
    "resume",
    "sharded",
    "verify",
    "zero_state_dict",
]
