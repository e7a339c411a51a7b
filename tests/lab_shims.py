"""Course_lib's implementations in the shape of the labs' roles, for tests/test_lab_checks.py.

Where a lab's interface and course_lib's differ, a shim here maps one onto the other, so the lab's
checks test course_lib's code (course_lib keeps its own API):

* lab 02 — ``plan_buckets`` takes sizes in registration order and walks them backwards, the
  library's ``assign_buckets`` takes them in bucket order; the lab has a ``broadcast_parameters``
  function, the library broadcasts inside ``DistributedDataParallel``'s constructor.
* lab 04 — the lab gives ``DenseMLP`` (GeLU(X·A)·B without bias) and ``ParallelMLP`` (A
  column-parallel, B row-parallel); course_lib's own TP MLP is the course model's SwiGLU. These
  are the lab's classes with course_lib's ColumnParallelLinear and RowParallelLinear inside.

The adapters load this file by its path in each rank (``tests`` is not a package on the ranks'
sys.path), so it imports nothing from the test suite.
"""

import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.data.ddp import DistributedDataParallel, assign_buckets
from course_lib.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def plan_buckets(nbytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Lab 02's role: sizes in registration order, buckets from the last tensor backwards."""
    last = len(nbytes) - 1
    return [[last - i for i in bucket] for bucket in assign_buckets(nbytes[::-1], cap_bytes)]


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """Lab 02's role: the library broadcasts rank 0's parameters and buffers when it wraps a module.

    The wrapper is dropped; the gradient hooks it registered stay on ``module`` (only check_broadcast
    uses this role, and it runs no backward).
    """
    DistributedDataParallel(module, group=group)


class DenseMLP(nn.Module):
    """Z = GeLU(X·A)·B, the dense reference of the lab (Megatron's Fig. 3a)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """Z = g(GeLU(f(X)·A_i)·B_i) with course_lib's column- and row-parallel layers."""

    def __init__(self, dense: DenseMLP, group):
        super().__init__()
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, group)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, group)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
