"""Grader of lab 07: a top-k router with capacity, the Switch balancing loss, and expert parallelism.

Graded (each task on its own: a check uses course_lib's pieces for everything but the role it grades):

* the router's experts and gate weights equal a per-token float64 reference, for k = 1, 2, 3;
* its capacity: no expert keeps more than ⌈capacity_factor · T · k / E⌉ assignments, and the kept
  ones are the first that came, in token order (Switch Transformer, Fedus et al. 2021, §2.2);
* the auxiliary loss E · Σ f_i P_i equals the float64 reference, is exactly 1 at perfect balance and
  E when one expert takes everything, and its gradient reaches the router's scores (P) only;
* training a small MoE layer with the learner's loss evens out the expert load, against the same
  training without it;
* dispatch followed by combine, with unit gates and no expert between, gives every token back
  (times its number of kept assignments), over all-to-alls only, each rank receiving exactly the
  rows of its experts (2 ranks);
* the expert-parallel layer at 2 ranks — course_lib's router and experts, the learner's dispatch and
  combine — gives the outputs and gradients of the same layer computed on one rank.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``mixture_of_experts.py``, tests/grading/test_lab_checks.py passes course_lib's
own router, loss, dispatch and combine (course_lib.model.moe, course_lib.parallel.expert.dispatch).

The checks live beside this file: Tasks 1 and 2 (the router, the balancing loss) in _lab07_routing.py,
Task 3 (dispatch, combine, the expert-parallel layer) in _lab07_expert_parallel.py.
"""

from pathlib import Path

from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab07_expert_parallel import check_dispatch_combine_identity, check_expert_parallel
from course_lib.grading.labs._lab07_routing import (
    check_aux_loss,
    check_balance_improves,
    check_router_capacity,
    check_router_topk,
)

ROLES = ("Router", "switch_aux_loss", "dispatch", "combine")
NAMES = (*ROLES, "capacity", "Dispatched", "local_experts", "moe_forward")  # what check_setup wants in the file


def adapter(lab_dir: Path) -> Adapter:
    """The learner's router, loss, dispatch and combine, from ``mixture_of_experts.py``."""
    return Adapter.of_file(Path(lab_dir) / "mixture_of_experts.py", ROLES)


def check_setup(impl: Adapter) -> None:
    module = impl.module("Router")
    for name in NAMES:
        assert callable(getattr(module, name, None)), f"mixture_of_experts.py must define {name}"


TASKS = [
    Task("mixture_of_experts.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: top-k experts and gate weights", 2, check_router_topk),
    Task("Task 1: capacity, first come first served", 2, check_router_capacity),
    Task("Task 2: Switch auxiliary loss", 2, check_aux_loss),
    Task("Task 2: the loss evens out the expert load", 2, check_balance_improves, timeout=120),
    Task("Task 3: dispatch then combine gives the tokens back", 2, check_dispatch_combine_identity, timeout=120),
    Task("Task 3: expert parallel equals one rank, outputs and gradients", 3, check_expert_parallel, timeout=120),
]
