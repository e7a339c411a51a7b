"""A rank SIGKILLed at a random step, the run resumed from its last checkpoint: bit for bit the uninterrupted run.

Acceptance test of lecture 08b's fault tolerance (course_lib.checkpoint). Three launches of
course_lib.experiments.lecture08.checkpoint_runs.train at 2 ranks: uninterrupted; killed (rank and step drawn from a seeded
random.Random); resumed from latest(root). ZeRO-3 with bf16 parameters, fp32 master weights and Adam moments, and a
token dropout drawn from each rank's torch RNG: the parameters, the optimizer state, the data position and the RNG
streams must all be restored, or the resumed run drifts away from the uninterrupted one.

Why bit-identity is possible: at the same world size every operation after the resume is the operation the
uninterrupted run did, on the same bits (DCP copies tensors, it does not convert them), on the same batch (the data
position), with the same random draws (the RNG state); nothing depends on wall-clock or on the process.
"""

import pytest
import torch

from course_lib.checkpoint.commit import step_dir
from course_lib.experiments.lecture08 import checkpoint_runs

pytestmark = [pytest.mark.slow, pytest.mark.launch_heavy]  # fault injection: a rank SIGKILLed and resumed

STEPS, EVERY = 12, 3


def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path):
    run = checkpoint_runs.kill_and_resume(
        str(tmp_path), world_size=2, steps=STEPS, save_every=EVERY, seed=0, stage=3, precision="bf16"
    )
    kill_at, victim = run["kill_at"], run["victim"]
    last = step_dir(tmp_path, kill_at // EVERY * EVERY).name
    assert run["resumed_from"] == last, (
        f"rank {victim} was killed after step {kill_at}; the newest checkpoint is {last}, the resume loaded "
        f"{run['resumed_from']}"
    )
    for rank, (ref, res) in enumerate(zip(run["reference"], run["resumed"])):
        assert res["step"] == ref["step"] == STEPS
        assert all(torch.equal(a, b) for a, b in zip(res["next_batch"], ref["next_batch"])), (
            f"rank {rank}: the next batch after step {STEPS} differs: the data position (TrainState.step) was not "
            "restored, so the resumed run read other batches"
        )
        assert torch.equal(res["rng"], ref["rng"]), (
            f"rank {rank}: the torch RNG stream differs from the uninterrupted run's: save and restore each rank's "
            "RNG state (resume.state_dict / resume.restore)"
        )
        for key in ref["state"]:
            what = "parameters" if key.startswith("model.") else "optimizer state"
            assert checkpoint_runs.same(res["state"][key], ref["state"][key]), (
                f"rank {rank}: {what} {key!r} after resuming differ from the uninterrupted run; everything the "
                "step reads must be restored: parameter shards, fp32 master weights, Adam moments and step count"
            )
        resumed_steps = sorted(res["losses"])
        assert resumed_steps == list(range(int(last[-8:]) + 1, STEPS + 1))
        assert all(res["losses"][s] == ref["losses"][s] for s in resumed_steps), (
            "the losses after the resume must equal the uninterrupted run's exactly"
        )
