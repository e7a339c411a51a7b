"""Lab 08's grader can fail: planted bugs in copies of the reference solution lose their task's points.

tests/labs/test_labs.py proves that the solution scores full marks and the starter nothing; a check that
passed everything would satisfy both. Here each case copies solutions/lab08_fp8/fp8.py, plants one
mistake a learner makes with FP8, and requires that the check of the task it belongs to fails — and,
where it matters, that the other tasks' checks still pass (each task is graded on its own).
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab08_fp8 as lab08

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab08_fp8" / "fp8.py"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "scale_is_amax_not_amax_over_max": (
        [("s = torch.where(a > 0, a / f.max, torch.ones_like(a))", "s = torch.where(a > 0, a, torch.ones_like(a))")],
        {lab08.check_per_tensor},
        {lab08.check_amax_per_group, lab08.check_linear_forward, lab08.check_linear_backward},
    ),
    "tiles_asserted_not_refused": (  # the contract says ValueError; an assert is the learner's own check
        [
            (
                'raise ValueError(f"block={block} does not divide the last dimension {cols}")',
                'assert False, f"block={block} does not divide the last dimension {cols}"',
            )
        ],
        {lab08.check_amax_per_group},
        {lab08.check_per_tensor},
    ),
    "no_saturation": (
        [(".clamp(-f.max, f.max).to(f.dtype)", ".to(f.dtype)")],
        {lab08.check_saturation},
        {lab08.check_per_tensor},  # with x's own amax nothing overflows: only the saturation check can tell
    ),
    "per_tensor_scale_where_tiles_were_asked": (
        [
            (
                "return x.reshape(*x.shape[:-1], cols // bc, bc).abs().amax(-1)",
                "return x.abs().amax().expand(*x.shape[:-1], cols // bc)",
            )
        ],
        {lab08.check_amax_per_group, lab08.check_outlier},
        {lab08.check_per_tensor, lab08.check_expand_scale, lab08.check_linear_forward},
    ),
    "expand_scale_repeats_instead_of_interleaving": (
        [
            (
                "s.repeat_interleave(rows // s.shape[0], 0).repeat_interleave(cols // s.shape[1], 1)",
                "s.repeat(rows // s.shape[0], cols // s.shape[1])",
            )
        ],
        {lab08.check_expand_scale},
        {lab08.check_per_tensor, lab08.check_amax_per_group},
    ),
    "forward_multiplies_fp32_x": (
        [("y = fp8_matmul((qx, sx), (qw, sw))", "y = x2.float() @ dequantize(qw, sw).T")],
        {lab08.check_linear_forward},
        {lab08.check_linear_backward},
    ),
    "backward_gradient_in_e4m3": (
        [("qg, sg = quantize(g2, ctx.grad_fmt, ", "qg, sg = quantize(g2, E4M3, ")],
        {lab08.check_linear_backward},
        {lab08.check_linear_forward},
    ),
    "backward_uses_fp32_x": (
        [
            ("ctx.save_for_backward(qx, sx, qw, sw)", "ctx.save_for_backward(qx, sx, qw, sw, x2.detach().float())"),
            ("qx, sx, qw, sw = ctx.saved_tensors", "qx, sx, qw, sw, x_fp32 = ctx.saved_tensors"),
            ("dw = fp8_matmul((qg.t(), sg.t()), (qx.t(), sx.t()))", "dw = dequantize(qg, sg).T @ x_fp32"),
        ],
        {lab08.check_linear_backward},
        {lab08.check_linear_forward},
    ),
    "weight_quantized_once_not_from_the_master_copy": (  # a fresh layer is right; training is not
        [
            (
                "return _FP8LinearFunction.apply(x, self.weight, self.bias, self.recipe, self.grad_fmt)",
                "if not hasattr(self, 'w0'):\n"
                "            self.w0 = self.weight.detach().clone()\n"
                "        stale = self.weight + (self.w0 - self.weight).detach()\n"
                "        return _FP8LinearFunction.apply(x, stale, self.bias, self.recipe, self.grad_fmt)",
            )
        ],
        {lab08.check_fp8_training},
        {lab08.check_linear_forward, lab08.check_linear_backward},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task_and_only_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab08, tmp_path)
