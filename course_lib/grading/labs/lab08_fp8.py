"""Grader of lab 08: FP8 quantization, per tensor and block-wise, an FP8 linear layer, FP8 training.

Graded (each task on its own: a check uses course_lib's pieces for everything but the role it grades):

* per-tensor quantization, e4m3 and e5m2: s = amax / max, the amax lands on the format's max, every
  element within the round-to-nearest bound, an all-zero group harmless, dequantize = q · s; and a
  scale that is too small (an earlier step's amax) saturates instead of making inf or NaN;
* the fine-grained groups of DeepSeek-V3: the amax of every 1 × 128 tile and 128 × 128 block
  (exact), every element's scale for each recipe and its transpose (exact), and an outlier that
  costs only its own tile or block;
* the FP8 linear layer: y = x̂ Ŵᵀ + b from e4m3 operands, dx = ĝ Ŵ and dW = ĝᵀ x̂ from the forward's
  FP8 values and an e5m2 output gradient, each equal to the same GEMM on course_lib's quantized
  operands up to fp32 summation error, for the per-tensor and the block-wise recipe;
* training: a small language model whose hidden linears are the learner's FP8Linear follows the same
  model under bf16 autocast, on the same data and seed.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``fp8.py``; tests/grading/test_lab_checks.py passes course_lib's own
(course_lib.precision.fp8_scaling and fp8_linear, with a shim for the lab's ``amax=`` argument in tests/lab_shims.py).

The checks live beside this file: Tasks 1 and 2 (scales, groups) in _lab08_scaling.py, Tasks 3 and 4
(the layer, training) in _lab08_linear.py; the tolerances, derived from the formats, are explained there.
"""

from pathlib import Path

from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab08_linear import check_fp8_training, check_linear_backward, check_linear_forward
from course_lib.grading.labs._lab08_scaling import (
    check_amax_per_group,
    check_expand_scale,
    check_outlier,
    check_per_tensor,
    check_saturation,
)

ROLES = ("quantize", "dequantize", "amax_per_group", "expand_scale", "FP8Linear")
NAMES = (*ROLES, "fp8_format", "fp8_matmul", "_FP8LinearFunction", "convert_to_fp8")  # what check_setup wants


def adapter(lab_dir: Path) -> Adapter:
    """The learner's quantization, groups and layer, from ``fp8.py``."""
    return Adapter.of_file(Path(lab_dir) / "fp8.py", ROLES)


def check_setup(impl: Adapter) -> None:
    module = impl.module("quantize")
    for name in NAMES:
        assert callable(getattr(module, name, None)), f"fp8.py must define {name}"


TASKS = [
    Task("fp8.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: per-tensor scale, cast and dequantize (e4m3, e5m2)", 2, check_per_tensor),
    Task("Task 1: overflow saturates", 1, check_saturation),
    Task("Task 2: the amax of every 1x128 tile and 128x128 block", 2, check_amax_per_group),
    Task("Task 2: every element's scale, transposes included", 1, check_expand_scale),
    Task("Task 2: an outlier costs only its own tile or block", 1, check_outlier),
    Task("Task 3: FP8Linear forward y = x̂ Ŵᵀ + b", 2, check_linear_forward),
    Task("Task 3: FP8Linear backward, e5m2 gradient, saved FP8 operands", 3, check_linear_backward),
    Task(
        "Task 4: FP8 training follows bf16",
        3,
        check_fp8_training,
        timeout=120,
        needs=(check_linear_forward, check_linear_backward),  # Task 4 trains Task 3's layer
    ),
]
