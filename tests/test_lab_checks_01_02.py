"""Lab 02's grader checks, run against course_lib's own DDP: one check proves the lab and the library.

Lab 01 has no counterpart here: course_lib has no ring collectives of its own (its code calls
torch.distributed's), so its checks only grade the learner's ``collectives.py``.

The lab's roles and the library differ in two signatures, bridged by the shims below (test code
only, so course_lib keeps its own API): the lab's ``plan_buckets`` takes sizes in registration
order and walks them backwards, the library's ``assign_buckets`` takes them in bucket order; the lab
has a ``broadcast_parameters`` function, the library broadcasts inside ``DistributedDataParallel``'s
constructor. ``DDP`` itself is the library's class: ``DistributedDataParallel(module,
bucket_cap_mb=...)`` is the lab's call.
"""

import pytest
import torch.nn as nn

from course_lib.grading.adapter import Adapter
from course_lib.grading.labs import lab02_ddp as lab02
from course_lib.parallel.data.ddp import DistributedDataParallel, assign_buckets


def plan_buckets(nbytes: list[int], cap_bytes: int) -> list[list[int]]:
    """The lab's role: sizes in registration order, buckets from the last tensor backwards."""
    last = len(nbytes) - 1
    return [[last - i for i in bucket] for bucket in assign_buckets(nbytes[::-1], cap_bytes)]


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """The lab's role: the library broadcasts rank 0's parameters and buffers when it wraps a module.

    The wrapper is dropped; the gradient hooks it registered stay on ``module`` (only check_broadcast
    uses this role, and it runs no backward).
    """
    DistributedDataParallel(module, group=group)


# The shims are found by this module's name, in the ranks too (they inherit the caller's sys.path).
LIBRARY = Adapter.of_library(
    broadcast_parameters=f"{__name__}:broadcast_parameters",
    plan_buckets=f"{__name__}:plan_buckets",
    DDP="course_lib.parallel.data.ddp:DistributedDataParallel",
)


def test_the_adapter_covers_every_role_of_lab02():
    assert sorted(LIBRARY.roles()) == sorted(lab02.ROLES)


@pytest.mark.parametrize(
    "check",
    [
        lab02.check_broadcast,
        lab02.check_plan_rule,
        lab02.check_bucket_order,
        lab02.check_gradients,
        lab02.check_overlap,
        lab02.check_no_sync,
    ],
    ids=lambda c: c.__name__,
)
def test_course_lib_passes_lab02_check(check):
    check(LIBRARY)
