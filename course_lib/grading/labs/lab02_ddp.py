"""Grader of lab 02: bucketed DDP with hook-driven overlap and no_sync.

Graded against torch itself: the broadcast state, the bucket plan (torch's own assignment
function and the buckets torch DDP builds for the course model), gradients and parameters
bit-equal to ``torch.nn.parallel.DistributedDataParallel`` at 2, 3 and 4 ranks, overlap read from
trace spans (each bucket's all-reduce launched before backward has finished and waited for only
after), and no_sync (no all-reduce inside, and accumulation still bit-equal to torch).

A data-parallel group need not be the world (lab 10 builds DP on sub-groups of a mesh): the broadcast
and the gradients are also graded on 4 ranks split into the groups {0, 1} and {2, 3}, whose data differ,
so a ``src=0``, a collective without ``group=`` or a 1/W from the world's size loses points. no_sync is
also graded as a context manager: an exception inside the block reaches the caller and leaves
synchronisation on, and a nested no_sync leaves it off until the outer block ends.

Torch DDP's first iteration uses a single bucket (it does not know the gradient order yet) and
rebuilds its buckets at the next forward; the reference takes that warm-up step before any
comparison, so from then on its buckets are the ones the lab asks for.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``ddp.py``; tests/grading/test_lab_checks.py passes course_lib's own
``DistributedDataParallel`` (and its bucket rule and broadcast, through shims for the lab's signatures).

Every comparison is bit-equal (no tolerance): the same buckets, the same layout inside each bucket,
the same g·(1/W) copy-in and the same gloo all-reduce perform the same float operations in the same
order as torch DDP, so any difference at all is a mistake.

What each rank runs is in _lab02_ranks.py; the checks here launch it and compare.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.dist import LaunchTimeout, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab02_ranks import (
    CAP_MB,
    PAIRS_TIMEOUT_S,
    _against_torch,
    _broadcast,
    _no_sync,
    _no_sync_as_context,
    _overlap,
    _torch_buckets,
    _world_then_pairs,
)

ROLES = ("broadcast_parameters", "plan_buckets", "DDP")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's functions and class, from ``ddp.py``."""
    return Adapter.of_file(Path(lab_dir) / "ddp.py", ROLES)


# ------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("DDP")
    for name in ROLES:
        assert hasattr(module, name), f"ddp.py must define {name}"


def check_broadcast(impl: Adapter) -> None:
    """Every rank ends with its group's first rank's parameters and buffers, bit for bit (a broadcast
    copies, it computes nothing): on the world of 2 ranks, and on 4 ranks as the groups {0, 1} and
    {2, 3}, where the first rank of {2, 3} is global rank 2 and each group must keep its own model."""
    results = launch(_broadcast, 2, impl, False, timeout=60)
    assert results[0][1] == results[1][1], (
        "after broadcast_parameters the ranks still hold different models: broadcast every parameter and "
        "buffer from rank 0 (dist.broadcast(t, src=0))"
    )
    try:  # the solution takes about a second; a broadcast on the world from two sources never ends
        results = launch(_broadcast, 4, impl, True, timeout=PAIRS_TIMEOUT_S)
    except LaunchTimeout:
        raise AssertionError(
            f"broadcast_parameters(module, group) on 4 ranks as the groups {{0, 1}} and {{2, 3}} did not finish "
            f"within {PAIRS_TIMEOUT_S} s: pass group=group to dist.broadcast (a broadcast on the world from two "
            "sources waits forever)"
        ) from None
    for members in ((0, 1), (2, 3)):
        first = results[members[0]][0]
        for r in members:
            _, got, error = results[r]
            assert error is None or not error.startswith("_WorldBroadcast"), (
                f"broadcast_parameters(module, group) on the group of global ranks {list(members)}: "
                f"{error.split(': ', 1)[1]} (a broadcast on the world from each group's first rank never completes)"
            )
            assert error is None, (
                f"broadcast_parameters(module, group) on the group of global ranks {list(members)} raised on rank "
                f"{r}: {error} — src of dist.broadcast is a global rank: the group's first is "
                "dist.get_global_rank(group, 0)"
            )
            assert got == first, (
                f"on the group of global ranks {list(members)} (4 ranks as two groups), rank {r} does not hold "
                f"rank {members[0]}'s model after broadcast_parameters(module, group): broadcast inside the group "
                "(group=group) from its first rank, dist.get_global_rank(group, 0)"
            )


def check_plan_rule(impl: Adapter) -> None:
    # host: sizes for a pure function, checked in the grader's own process (no rank, no collective)
    g = torch.Generator().manual_seed(2)
    for cap in (1, 100, 1000, 5000, 10**9):
        sizes = [int(n) for n in torch.randint(1, 400, (30,), generator=g)]  # host: drawn with g
        # host: placeholders for torch's bucket rule, which reads only their sizes (in bucket order)
        tensors = [torch.empty(n) for n in reversed(sizes)]
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, [cap * 4], [], list(range(len(sizes))))
        expected = [[len(sizes) - 1 - i for i in b] for b in expected]
        got = impl["plan_buckets"]([4 * n for n in sizes], cap * 4)
        assert got == expected, (
            f"plan_buckets with a cap of {cap * 4} B gives {len(got)} buckets starting {got[:2]}, torch's rule "
            f"{len(expected)} starting {expected[:2]}: walk from the last tensor, close a bucket once its size is >= the cap"
        )


def check_bucket_order(impl: Adapter) -> None:
    mine, theirs = launch(_torch_buckets, 2, impl, timeout=60)[0]
    assert len(mine) == len(theirs), (
        f"the tiny model at {CAP_MB} MiB should have {len(theirs)} buckets, yours has {len(mine)}"
    )
    assert mine == theirs, f"bucket contents/order differ from torch DDP's: yours start {mine[0]}, torch's {theirs[0]}"


def check_gradients(impl: Adapter) -> None:
    """Gradients and parameters bit-equal to torch DDP at 2, 3 and 4 ranks, and on 4 ranks split into the
    data-parallel groups {0, 1} and {2, 3} (each with its own rows): the average is over the group."""
    # W = 3 as well: at W = 2 and 4, dividing after the sum happens to give the same bits (1/W is a
    # power of two); at 3 only torch's order, g·(1/W) then SUM, does.
    four = launch(_world_then_pairs, 4, impl, 3, timeout=60)  # first: a mistake on a sub-group fails in one launch
    _same_as_torch(4, [world for world, _ in four])
    for rank, (diffs, params) in enumerate(pairs for _, pairs in four):
        bad = [n for n in diffs if n] + ([params] if params else [])
        # bit-equal, as above: torch DDP on the same group does the same float operations
        assert not bad, (
            f"DDP(module, group=group) on the group of global ranks {[0, 1] if rank < 2 else [2, 3]} (4 ranks as "
            f"two groups), rank {rank}: {bad[0]} elements differ from torch DDP on that group: average over the "
            "group, not the world (group=self.group in the all-reduce, 1/W with W = self.world_size)"
        )
    for world in (2, 3):
        _same_as_torch(world, launch(_against_torch, world, impl, 3, False, timeout=60))


def _same_as_torch(world: int, results) -> None:
    for rank, (diffs, params) in enumerate(results):
        for step, n in enumerate(diffs):
            # bit-equal: same buckets, layout, g·(1/W) and gloo all-reduce as torch = the same float ops in order
            assert n == 0, (
                f"{world} ranks, rank {rank}, step {step}: {n} gradient elements differ from torch DDP (must be "
                "bit-equal): check the 1/W pre-division, the layout inside each bucket, and the copy back"
            )
        assert params == 0, f"{world} ranks: after 3 AdamW steps {params} parameter elements differ from torch DDP"


def check_overlap(impl: Adapter) -> None:
    spans, last_grad, n_buckets = launch(_overlap, 2, impl, timeout=60)[0]
    reduces = [s for s in spans if s.name == "all_reduce"]
    assert len(reduces) == n_buckets, f"one all-reduce per bucket per backward: {len(reduces)} for {n_buckets} buckets"
    early = [s for s in reduces if s.start < last_grad]
    assert len(early) == n_buckets - 1, (
        f"only {len(early)} of {n_buckets} all-reduces started before backward computed its last gradient: launch "
        "each bucket from the hook that fills it, not at the end"
    )
    assert all(s.end >= last_grad for s in reduces), (
        "an all-reduce finished before backward had computed every gradient: use async_op=True and wait in finish()"
    )


def check_no_sync(impl: Adapter) -> None:
    for rank, (calls, local_diff) in enumerate(launch(_no_sync, 2, impl, timeout=60)):
        assert calls == 0, f"rank {rank}: {calls} all-reduces inside no_sync(); it must not communicate"
        # bit-equal: the same local backward of the same model on the same rows, with nothing added
        assert local_diff == 0, f"rank {rank}: inside no_sync() .grad should be the rank's own local gradient"
    for rank, (diffs, params) in enumerate(launch(_against_torch, 4, impl, 2, True, timeout=60)):
        # bit-equal: both accumulate the same two local gradients in .grad, then all-reduce like check_gradients
        assert all(n == 0 for n in diffs) and params == 0, (
            f"rank {rank}: accumulation over 2 micro-batches (first inside no_sync) differs from torch DDP's"
        )


def check_no_sync_as_context(impl: Adapter) -> None:
    """no_sync() as a context manager: an exception inside the block reaches the caller and the next
    backward communicates again (one all-reduce per bucket: the previous state restored in a finally);
    inside nested blocks, a backward after the inner block ended still communicates nothing, and after
    the outer one it does again (restore the previous value, not True)."""
    for rank, (reached, calls, n) in enumerate(launch(_no_sync_as_context, 2, impl, timeout=60)):
        assert reached, (
            f"rank {rank}: an exception raised inside `with ddp.no_sync():` did not reach the caller: let it "
            "propagate (restore the state in a finally, do not catch it)"
        )
        assert calls["after the exception"] == n, (
            f"rank {rank}: after an exception inside `with ddp.no_sync():`, the next backward issued "
            f"{calls['after the exception']} all-reduces for {n} buckets: restore require_sync in a finally, so "
            "that it is restored when the block raises"
        )
        assert calls["nested"] == 0, (
            f"rank {rank}: inside `with ddp.no_sync():` after a nested no_sync() ended, a backward issued "
            f"{calls['nested']} all-reduces: on exit restore the previous value of require_sync, not True"
        )
        assert calls["after both"] == n, (
            f"rank {rank}: after nested no_sync() blocks ended, a backward issued {calls['after both']} all-reduces "
            f"for {n} buckets: synchronisation must be back on"
        )


TASKS = [
    Task("ddp.py imports and defines broadcast_parameters, plan_buckets, DDP", 1, check_setup, setup=True),
    Task("Task 1: every rank starts from its group's first rank's parameters and buffers", 1, check_broadcast),
    Task("Task 2: plan_buckets follows torch's rule", 1, check_plan_rule),
    Task("Task 2: buckets (count, order, contents) equal torch DDP's", 1, check_bucket_order),
    Task(
        "Tasks 3+4: gradients and parameters bit-equal to torch DDP at 2, 3 and 4 ranks and on sub-groups",
        4,
        check_gradients,
        needs=(check_broadcast, check_bucket_order),  # DDP() broadcasts; the bits depend on the buckets
    ),
    Task("Task 3: all-reduces overlap backward (trace spans)", 2, check_overlap),
    Task(
        "Task 5: no_sync communicates nothing and accumulates like torch",
        2,
        check_no_sync,
        needs=(check_gradients,),  # the synchronised micro-batch is Tasks 3+4's backward
    ),
    Task(
        "Task 5: no_sync restores sync after an exception, and when nested",
        1,
        check_no_sync_as_context,
        needs=(check_overlap,),  # counts Task 3's one all-reduce per bucket outside the block
    ),
]
