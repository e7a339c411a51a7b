"""FP8 on a GPU, checked on a CPU: torch._scaled_mm's CUDA rules and tensors that follow their inputs.

torch's CPU kernel for ``_scaled_mm`` takes layouts, shapes and output types that CUDA's kernels refuse
(cuBLASLt wants the second operand column-major and K, N multiples of 16; the row-wise kernels write
bf16 only). :func:`course_lib.precision.fp8_gemm.check_scaled_mm_args` holds every call to CUDA's rules, so
these tests prove on a laptop that (1) the check rejects each broken rule with a message that names it,
and (2) every call fp8_matmul and FP8Linear make, the backward's transposed operands included, passes
it. Device placement is checked with a trap: under ``torch.device("meta")`` as the default device, a
factory that forgets ``device=`` makes a meta tensor, which then fails against the CPU inputs.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.precision import fp8_gemm, fp8_linear, fp8_scaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _operands(m=32, k=64, n=48, dtypes=(E4M3, E4M3)):
    """a [M, K] row-major and b [K, N] column-major (b [N, K] row-major, transposed): CUDA's layout."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtypes[0])
    b = torch.randn(n, k, generator=g).to(dtypes[1]).t()
    return a, b


def test_the_canonical_calls_pass():
    a, b = _operands()
    one = torch.tensor(1.0)
    fp8_gemm.check_scaled_mm_args(a, b, one, one, torch.float32)  # tensor-wise: any high-precision output
    fp8_gemm.check_scaled_mm_args(a, b, torch.ones(32, 1), torch.ones(1, 48), torch.bfloat16)  # row-wise: bf16
    fp8_gemm.check_scaled_mm_args(*_operands(dtypes=(E5M2, E4M3)), one, one, torch.float32)  # a gradient GEMM


@pytest.mark.parametrize(
    "case, match",
    [
        ("second operand row-major", "column-major"),
        ("first operand column-major", "row-major"),
        ("K = 24", "multiples of 16"),
        ("N = 40", "multiples of 16"),
        ("row-wise into fp32", "bf16"),
        ("row-wise b scale [N, 1]", r"\[1, N\]"),
        ("bf16 scales", "fp32"),
        ("e5m2 x e5m2", "e5m2"),
    ],
)
def test_each_cuda_rule_is_enforced_on_cpu(case, match):
    a, b = _operands()
    sa, sb, out = torch.tensor(1.0), torch.tensor(1.0), torch.float32
    if case == "second operand row-major":
        b = b.contiguous()  # what FP8Linear's backward passed before: Ŵᵀᵀ = Ŵ, row-major
    elif case == "first operand column-major":
        a = a.t().contiguous().t()  # ĝᵀ as a view
    elif case == "K = 24":
        a, b = _operands(k=24)
    elif case == "N = 40":
        a, b = _operands(n=40)
    elif case == "row-wise into fp32":
        sa, sb = torch.ones(32, 1), torch.ones(1, 48)
    elif case == "row-wise b scale [N, 1]":
        sa, sb, out = torch.ones(32, 1), torch.ones(48, 1), torch.bfloat16
    elif case == "bf16 scales":
        sa, sb = sa.bfloat16(), sb.bfloat16()
    elif case == "e5m2 x e5m2":
        a, b = _operands(dtypes=(E5M2, E5M2))
    with pytest.raises(ValueError, match=match):
        fp8_gemm.check_scaled_mm_args(a, b, sa, sb, out)


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Every torch._scaled_mm call, checked against CUDA's rules before the CPU kernel runs it."""
    calls, real = [], torch._scaled_mm

    def spy(mat1, mat2, scale_a, scale_b, *args, out_dtype=None, **kwargs):
        fp8_gemm.check_scaled_mm_args(mat1, mat2, scale_a, scale_b, out_dtype or mat1.dtype)
        calls.append((tuple(mat1.shape), tuple(mat2.shape), scale_a.numel(), out_dtype))
        return real(mat1, mat2, scale_a, scale_b, *args, out_dtype=out_dtype, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def test_fp8_linear_tensor_recipe_backward_calls_scaled_mm_as_cuda_requires(scaled_mm_calls):
    """y = x̂Ŵᵀ, dx = ĝŴ, dW = ĝᵀx̂: the backward's operands are transposed views; each call must still
    hand cuBLASLt a row-major first and a column-major second operand."""
    torch.manual_seed(0)
    layer = fp8_linear.FP8Linear(64, 96, recipe="tensor")
    x = torch.randn(48, 64, requires_grad=True)
    layer(x).backward(torch.randn(48, 96))
    assert [c[:2] for c in scaled_mm_calls] == [((48, 64), (64, 96)), ((48, 96), (96, 64)), ((96, 48), (48, 64))], (
        "forward, dx and dW should each be one torch._scaled_mm call"
    )
    assert x.grad is not None and layer.weight.grad is not None


def test_row_wise_scales_reach_the_kernel_only_with_a_bf16_output(scaled_mm_calls):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    qa, qb = fp8_scaling.quantize(a, "e4m3", "row"), fp8_scaling.quantize(b, "e4m3", "row")
    y32 = fp8_gemm.fp8_matmul(qa, qb, backend="scaled_mm")
    y16 = fp8_gemm.fp8_matmul(qa, qb, backend="scaled_mm", out_dtype=torch.bfloat16)
    assert [(c[2], c[3]) for c in scaled_mm_calls] == [(1, torch.float32), (32, torch.bfloat16)], (
        "fp32 out: a tensor-wise call with unit scales, the row scales applied after; bf16 out: the row-wise kernel"
    )
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    # bf16 (8 significant bits) rounds once, |Δ| ≤ 2^-8|y|, plus the fp32 orderings of the two paths (each ≤ (K + 2)U of Σ|ab|)
    mag = fp8_scaling.dequantize(*qa).abs() @ fp8_scaling.dequantize(*qb).abs().T
    assert ((y16.float() - y32).abs() <= 2**-8 * y32.abs() + 2 * 66 * 2**-24 * mag).all()


def test_shapes_cuda_cannot_take_are_emulated_or_refused():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 24, generator=g), torch.randn(40, 24, generator=g)  # K = 24, N = 40
    qa, qb = fp8_scaling.quantize(a, "e4m3", "tensor"), fp8_scaling.quantize(b, "e4m3", "tensor")
    assert not fp8_gemm.scaled_mm_supports(qa, qb)
    with pytest.raises(ValueError, match="multiples"):
        fp8_gemm.fp8_matmul(qa, qb, backend="scaled_mm")
    assert torch.equal(fp8_gemm.fp8_matmul(qa, qb), fp8_gemm.fp8_matmul(qa, qb, backend="emulate")), "auto must emulate"


def test_tensor_core_emulation_accumulates_on_the_inputs_device():
    """Under a meta default device, an accumulator made without ``device=`` would be a meta tensor."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(16, 256, generator=g), torch.rand(16, 256, generator=g)
    qa, qb = fp8_scaling.quantize(a, "e4m3", "tensor"), fp8_scaling.quantize(b, "e4m3", "tensor")
    want = fp8_gemm.fp8_matmul(qa, qb, backend="tensor_core")
    with torch.device("meta"):
        got = fp8_gemm.fp8_matmul(qa, qb, backend="tensor_core")
    assert got.device.type == "cpu" and torch.equal(got, want)


def test_amax_history_lives_on_the_amaxes_device():
    with torch.device("meta"):
        history = fp8_scaling.AmaxHistory(3)  # built under another default device: must not keep a meta buffer
    for step in range(4):
        fp8_scaling.quantize(torch.full((4, 16), float(step + 1)), "e4m3", "delayed", history=history)
    assert history.values.device.type == "cpu" and history.values.tolist() == [2.0, 3.0, 4.0]
    assert fp8_scaling.AmaxHistory(2, device="meta").values.device.type == "meta", "device= must be honoured"
    with pytest.raises(ValueError, match="device"):
        history.update(torch.tensor(1.0, device="meta"))
