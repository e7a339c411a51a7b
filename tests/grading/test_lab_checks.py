"""Every lab's graded checks, run on course_lib's own implementation: one check proves both.

Each grader's checks take an :class:`~course_lib.grading.adapter.Adapter` (role -> callable). The
grader builds it from the learner's file; here it points at course_lib, so every graded property of
a lab is also a test of the library, written once (tests/lab_shims.py bridges the two interfaces
where they differ).

Not run here: the setup checks (they inspect a learner's file for names); lab 01, since course_lib
has no ring collectives of its own (its code calls torch.distributed's); and lab 03's
``check_padding``: course_lib has no ``padded_size`` / ``shard_of`` functions (``_Unit`` pads
inline), so its padding is proven by the parity checks on the "odd" model, whose sizes 2 does not divide.
Lab 11's attacks (a SIGKILLed rank, a NaN, a 2 -> 1 resume, resuming past a damaged checkpoint, two
deterministic runs) attack the lab's own ``train`` loop, which the library does not have in that shape;
its killed save injects the fault through the lab's ``write_shards``, which the library never calls; and
Task 2's checks drive the lab's ``capture``/``restore``, which the library has in another shape. Its
commit (durability order and damaged shards included), verification, guard, deterministic mode and
rank-order sum meet the unit checks here, and its own loop (course_lib.experiments.lecture08.checkpoint_runs) meets the
same attacks in tests/checkpoint/test_checkpoint_resume.py.
Lab 10's traffic and cost-model checks (``traffic``, ``step_seconds``, ``pick``) grade the lab's own
alpha-beta model against the measured traffic of the lab's step; course_lib's planner
(course_lib.cost.planner) models a GPU cluster with another interface, so they run on the reference
solution in tests/labs/test_labs.py and on planted bugs in tests/labs/test_lab10_capstone.py.
"""

from functools import partial
from pathlib import Path

import pytest

from course_lib.grading.adapter import Adapter
from course_lib.grading.labs import lab02_ddp as lab02
from course_lib.grading.labs import lab03_zero as lab03
from course_lib.grading.labs import lab04_tensor_parallel as lab04
from course_lib.grading.labs import lab05_pipeline as lab05
from course_lib.grading.labs import lab06_sequence_parallel as lab06
from course_lib.grading.labs import lab07_moe as lab07
from course_lib.grading.labs import lab08_fp8 as lab08
from course_lib.grading.labs import lab09_kv_cache as lab09
from course_lib.grading.labs import lab10_capstone as lab10
from course_lib.grading.labs import lab11_fault_tolerance as lab11

SHIMS = str(Path(__file__).resolve().parents[1] / "lab_shims.py")

LIBRARY = {
    "lab02": Adapter.of_library(
        broadcast_parameters=f"{SHIMS}:broadcast_parameters",
        plan_buckets=f"{SHIMS}:plan_buckets",
        DDP="course_lib.parallel.data.ddp:DistributedDataParallel",
    ),
    "lab03": Adapter.of_library(
        ZeroAdamW="course_lib.parallel.data.zero:Zero",
        adamw_="course_lib.optim.optimizers:adamw_",
    ),
    "lab04": Adapter.of_library(
        f="course_lib.parallel.tensor.comms:copy_to_tensor_parallel_region",
        g="course_lib.parallel.tensor.comms:reduce_from_tensor_parallel_region",
        ColumnParallelLinear="course_lib.parallel.tensor.sharded_layers",
        RowParallelLinear="course_lib.parallel.tensor.sharded_layers",
        DenseMLP=f"{SHIMS}:DenseMLP",  # the lab's given reference, loaded by the shim
        ParallelMLP=f"{SHIMS}:ParallelMLP",
        VocabParallelEmbedding="course_lib.parallel.tensor.sharded_layers",
        vocab_parallel_cross_entropy="course_lib.parallel.tensor.sharded_layers",
    ),
    "lab05": Adapter.of_library(  # the lab's functions are the ones build() composes, same signatures
        one_f_one_b="course_lib.parallel.pipeline.schedules:_one_f_one_b",
        with_messages="course_lib.parallel.pipeline.schedules:with_messages",
        interleaved="course_lib.parallel.pipeline.schedules:_interleaved",
    ),
    "lab06": Adapter.of_library(
        merge_partials="course_lib.parallel.context.ring_attention",
        ring_attention="course_lib.parallel.context.ring_attention",
        ulysses_attention="course_lib.parallel.context.ulysses",
    ),
    "lab07": Adapter.of_library(  # the lab's router, loss, dispatch and combine have the library's signatures
        Router="course_lib.model.moe",
        switch_aux_loss="course_lib.model.moe",
        dispatch="course_lib.parallel.expert.dispatch",
        combine="course_lib.parallel.expert.dispatch",
    ),
    "lab08": Adapter.of_library(  # the lab's groups are course_lib's private _amax; amax= goes through a shim
        quantize=f"{SHIMS}:quantize",
        dequantize="course_lib.precision.fp8_scaling",
        amax_per_group="course_lib.precision.fp8_scaling:_amax",
        expand_scale="course_lib.precision.fp8_scaling",
        FP8Linear="course_lib.precision.fp8_linear",
    ),
    "lab09": Adapter.of_library(
        block_hash="course_lib.inference.paged",
        slot_mapping="course_lib.inference.paged",
        gather_blocks="course_lib.inference.paged",
        BlockPool="course_lib.inference.paged",
        PagedCache="course_lib.inference.paged",
    ),
    "lab10": Adapter.of_library(  # the composition; the traffic and the cost model are the lab's own
        coordinates=f"{SHIMS}:coordinates",
        check_layout=f"{SHIMS}:check_layout",  # + the lab's uniform stages: see tests/lab_shims.py
        build=f"{SHIMS}:build",
        step=f"{SHIMS}:step",
    ),
    "lab11": Adapter.of_library(  # the pieces; the attacks need the lab's own loop (see the module docstring)
        commit_checkpoint="course_lib.checkpoint.sharded:save",
        latest_checkpoint="course_lib.checkpoint.commit:latest",
        verify_checkpoint="course_lib.checkpoint.commit:verify",
        SpikeGuard="course_lib.optim.stability",
        deterministic_mode=f"{SHIMS}:deterministic_mode",
        all_reduce_in_rank_order="course_lib.dist.ordered",
    ),
}
GRADERS = {
    "lab02": lab02,
    "lab03": lab03,
    "lab04": lab04,
    "lab05": lab05,
    "lab06": lab06,
    "lab07": lab07,
    "lab08": lab08,
    "lab09": lab09,
    "lab10": lab10,
    "lab11": lab11,
}
NOT_IN_LIBRARY = {  # see the module docstring
    lab03.check_padding,
    lab10.check_traffic,
    lab10.check_pick,
    lab11.check_killed_save,
    lab11.check_restore,
    lab11.check_restore_on_one_rank,
    lab11.check_resume_past_damage,
    lab11.check_kill_and_resume,
    lab11.check_resume_on_one_rank,
    lab11.check_nan_and_spike,
    lab11.check_two_runs,
}
ROLES_NOT_IN_LIBRARY = {
    "lab03": {"padded_size", "shard_of"},
    "lab10": {"rank_parameters", "traffic", "step_seconds", "pick"},
    "lab11": {"train", "capture", "restore"},
}
CHECKS = [
    (lab, task.check)
    for lab, grader in GRADERS.items()
    for task in grader.TASKS
    if not task.setup and task.check not in NOT_IN_LIBRARY
]


def _name(check) -> str:
    if isinstance(check, partial):  # lab 03's per-stage checks
        return check.func.__name__.lstrip("_") + "".join(f"_{k}{v}" for k, v in check.keywords.items())
    return check.__name__


@pytest.mark.parametrize("lab", sorted(GRADERS))
def test_the_library_adapter_fills_the_labs_roles(lab):
    adapter = LIBRARY[lab]
    assert set(adapter.roles()) | ROLES_NOT_IN_LIBRARY.get(lab, set()) == set(GRADERS[lab].ROLES)
    for role in adapter.roles():
        assert callable(adapter[role]), f"{lab}: {role} must resolve to a callable"


@pytest.mark.parametrize(("lab", "check"), CHECKS, ids=[f"{lab}-{_name(check)}" for lab, check in CHECKS])
def test_course_lib_passes_the_labs_check(lab, check):
    check(LIBRARY[lab])
