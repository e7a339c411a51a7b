"""Course_lib's implementations in the shape of the labs' roles, for tests/grading/test_lab_checks.py.

Where a lab's interface and course_lib's differ, a shim here maps one onto the other, so the lab's
checks test course_lib's code (course_lib keeps its own API):

* lab 02 — ``plan_buckets`` takes sizes in registration order and walks them backwards, the
  library's ``assign_buckets`` takes them in bucket order; the lab has a ``broadcast_parameters``
  function, the library broadcasts inside ``DistributedDataParallel``'s constructor.
* lab 04 — the lab gives ``DenseMLP`` (GeLU(X·A)·B without bias) and ``ParallelMLP`` (A
  column-parallel, B row-parallel); course_lib's own TP MLP is the course model's SwiGLU. The
  lab's given DenseMLP is used as it is, and ParallelMLP is its forward over course_lib's
  ColumnParallelLinear and RowParallelLinear.
* lab 11 — the lab's ``deterministic_mode(seed)`` switches the process over for good; course_lib's
  is a context manager that puts everything back on exit: the shim enters it and never leaves.
* lab 08 — the lab's ``quantize`` takes ``amax=`` (delayed scaling: an earlier step's amax); course_lib
  takes delayed scaling as the recipe "delayed" with an ``AmaxHistory``.
* lab 10 — the lab's ``check_layout`` refuses a pipeline size that does not divide the blocks (its
  stages are uniform); course_lib's only needs ``pp <= n_layers`` (its stages may be uneven): the shim
  adds that one rule to course_lib's. The lab's ``coordinates(rank, layout)`` is course_lib's Mesh grid (computed here as the Mesh
  lays it out, since a Mesh built inside a launched rank creates process groups); its ``build`` returns
  a part with ``.stage`` and ``.groups``, and ``step(part, ...)`` is a function: course_lib's
  ``Composed`` with its mesh's groups, and its ``step`` method.

The adapters load this file by its path in each rank (``tests`` is not a package on the ranks'
sys.path), so it imports nothing from the test suite.
"""

from pathlib import Path

import torch
import torch.nn as nn

from course_lib.experiments.lecture08 import reproducibility
from course_lib.grading.adapter import load
from course_lib.parallel import compose
from course_lib.parallel.compose import Composed
from course_lib.parallel.data.ddp import DistributedDataParallel, assign_buckets
from course_lib.parallel.tensor.sharded_layers import ColumnParallelLinear, RowParallelLinear
from course_lib.precision import fp8_scaling


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


# The lab's DenseMLP is given code, the same in the starter and the solution: use it as it stands.
DenseMLP = load(Path(__file__).resolve().parents[1] / "labs" / "lab04_tensor_parallel" / "tensor_parallel.py").DenseMLP


class ParallelMLP(DenseMLP):
    """DenseMLP's forward, Z = g(GeLU(f(X)·A_i)·B_i), over course_lib's column- and row-parallel layers."""

    def __init__(self, dense: DenseMLP, group):
        nn.Module.__init__(self)  # not DenseMLP's: the layers come from ``dense``, sharded
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, group)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, group)


def quantize(x, fmt="e4m3", recipe="tensor", *, block=128, amax=None):
    """Lab 08's role: the lab's ``amax=`` (an earlier step's amax) is course_lib's delayed scaling with that
    amax as its whole history; without it, course_lib's quantize as it is."""
    if amax is None:
        return fp8_scaling.quantize(x, fmt, recipe, block=block)
    if recipe != "tensor":
        raise ValueError("course_lib's delayed scaling keeps one amax per tensor")
    history = fp8_scaling.AmaxHistory(1)
    history.update(amax)
    return fp8_scaling.quantize(x, fmt, "delayed", block=block, history=history)


_ENTERED = []  # a context left open must stay referenced: a collected generator would run its exit


def deterministic_mode(seed: int) -> None:
    """Lab 11's role: course_lib's deterministic mode, entered for the rest of the process."""
    context = reproducibility.deterministic_mode(seed)
    context.__enter__()
    _ENTERED.append(context)


def coordinates(rank: int, layout) -> tuple[int, int, int]:
    """Lab 10's role: (d, s, t) of ``rank`` on course_lib.dist.Mesh's grid [dp, pp, cp, tp] (cp = 1)."""
    grid = torch.arange(layout.world_size).view(layout.dp, layout.pp, 1, layout.tp)  # host: only its indices are read
    d, s, _, t = (grid == rank).nonzero()[0].tolist()
    return d, s, t


class ComposedPart(Composed):
    """Lab 10's part: course_lib's Composed, with the lab's ``groups`` (its mesh's, by axis)."""

    @property
    def groups(self) -> dict:
        return {axis: self.mesh.group(axis) for axis in ("dp", "pp", "tp")}


def build(model, layout, global_batch: int) -> ComposedPart:
    """Lab 10's role: course_lib's composition of ``model`` on this rank."""
    return ComposedPart(model, layout, global_batch)


def step(part: ComposedPart, tokens, targets):
    """Lab 10's role: the composition's step, as a function."""
    return part.step(tokens, targets)


def check_layout(layout, cfg, global_batch) -> None:
    """Lab 10's rules: course_lib's, plus pp dividing the blocks (the lab's stages are uniform)."""
    compose.check_layout(layout, cfg, global_batch)
    if cfg.n_layers % layout.pp:
        raise ValueError(
            f"{layout.pp} equal stages need a multiple of {layout.pp} blocks; the model has {cfg.n_layers}"
        )
