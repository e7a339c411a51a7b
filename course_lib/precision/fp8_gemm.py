"""The FP8 GEMM: y = â b̂ᵀ from quantized operands, by torch._scaled_mm or emulated, and Hopper's accumulator.

Part 2 of three on FP8 training: the operands come from :func:`course_lib.precision.fp8_scaling.quantize`
as (q, s) pairs; :mod:`course_lib.precision.fp8_linear` runs a layer's three GEMMs with this one.
Tested in tests/precision/test_fp8.py (and on a GPU, tests/precision/test_device_fp8.py).

**The GEMM.** With K the contraction dimension and both operands holding it last (a [M, K],
b [N, K], as x and W of y = x Wᵀ), :func:`fp8_matmul` computes

    y_mn = Σ_c  s^a_{m,c} · s^b_{n,c} · Σ_{k ∈ chunk c} q^a_{mk} q^b_{nk}

with torch._scaled_mm where it takes the scales (tensor-wise or row-wise: then s does not vary
along K), and by emulation otherwise. :func:`check_scaled_mm_args` holds every call to the rules
CUDA's kernel enforces (cuBLASLt / CUTLASS, as torch checks them), which torch's CPU kernel does not:
the first operand row-major and the second column-major, K and N multiples of 16, fp32 scales of
shape () or [M, 1] and [1, N], not both operands e5m2, and a bf16 output for row-wise scales. So a
call that runs on a laptop is shaped for a GPU too. Hopper's tensor cores accumulate FP8 products in about 14
significant bits ("FP22": 1 sign, 8 exponent, 13 mantissa bits; DeepSeek-V3 §3.3.2 "increasing
accumulation precision", and "Insights into DeepSeek-V3", ISCA 2025, §3.1.1): DeepSeek measured a
maximum relative error of nearly 2 % for K = 4096. Their fix, *promotion*: every N_C = 128
elements of K (4 WGMMA instructions of K = 32) the partial sum is multiplied by its two scales and
added to an fp32 accumulator on the CUDA cores, which is also where the fine-grained scales apply.
``backend="tensor_core"`` emulates exactly that, with and without promotion.
"""

from __future__ import annotations

import torch

from course_lib.precision.fp8_scaling import dequantize, expand_scale

__all__ = ["N_C", "SCALED_MM_MULTIPLE", "check_scaled_mm_args", "fp8_matmul", "scaled_mm_supports"]

N_C = 128  # DeepSeek-V3 §3.3.2: promote the tensor cores' partial sums to fp32 every 128 elements of K
WGMMA_K = 32  # FP8 products one Hopper WGMMA instruction adds into its accumulator at a time
FP22_MANTISSA_BITS = 13  # the tensor cores' accumulator: "around 14 bits" of precision, 13 after the point
SCALED_MM_MULTIPLE = 16  # cuBLASLt's FP8 GEMM: K and N multiples of 16 (torch checks it on CUDA, not on CPU)


def scaled_mm_supports(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Can torch._scaled_mm take these operands? Tensor-wise (one each) or row-wise (a [M, 1], b [N, 1])
    scales, K and N multiples of :data:`SCALED_MM_MULTIPLE`, not both operands e5m2 (CUDA's rules).

    Those scales do not vary along K, so they factor out of the sum: y = (Σ_k q^a q^b) · s^a · s^b.
    Finer scales (1 × 128, 128 × 128) need a multiply per K-chunk inside the GEMM, which torch's CPU
    kernel rejects (ENVIRONMENT.md); :func:`fp8_matmul` emulates those, and any other shape too.
    """
    (qa, sa), (qb, sb) = a, b
    if qa.dim() != 2 or qb.dim() != 2:
        return False
    if qa.shape[1] % SCALED_MM_MULTIPLE or qb.shape[0] % SCALED_MM_MULTIPLE:
        return False
    if qa.dtype == qb.dtype == torch.float8_e5m2:
        return False
    tensorwise = sa.numel() == 1 and sb.numel() == 1
    rowwise = tuple(sa.shape) == (qa.shape[0], 1) and tuple(sb.shape) == (qb.shape[0], 1)
    return tensorwise or rowwise


def check_scaled_mm_args(
    mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> None:
    """ValueError unless ``torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=out_dtype)`` meets the
    rules CUDA's kernels enforce (torch's checks before cuBLASLt and CUTLASS; its CPU kernel takes more):

    * mat1 [M, K] row-major, mat2 [K, N] column-major (``b.t().contiguous().t()``): cuBLASLt's FP8
      GEMM takes only "TN" layouts;
    * K and N multiples of 16; M any;
    * float8 operands, not both e5m2 (cuBLASLt has no e5m2 × e5m2 FP8 GEMM);
    * fp32 scales, each one number (tensor-wise) or scale_a [M, 1] and scale_b [1, N] (row-wise);
    * row-wise: out_dtype bf16, the only output every CUDA row-wise kernel writes (CUTLASS on all but
      Hopper, where cuBLAS ≥ 12.9 would also write fp32).
    """
    f8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]:
        raise ValueError(f"_scaled_mm multiplies [M, K] by [K, N], got {tuple(mat1.shape)} and {tuple(mat2.shape)}")
    (m, k), n = mat1.shape, mat2.shape[1]
    if mat1.dtype not in f8 or mat2.dtype not in f8 or mat1.dtype == mat2.dtype == torch.float8_e5m2:
        raise ValueError(f"_scaled_mm on CUDA takes float8 operands, not both e5m2; got {mat1.dtype} and {mat2.dtype}")
    if not mat1.is_contiguous() or not mat2.t().is_contiguous():
        raise ValueError(
            f"cuBLASLt takes the first operand row-major and the second column-major; got strides {mat1.stride()} "
            f"and {mat2.stride()} for {tuple(mat1.shape)} and {tuple(mat2.shape)}: pass a.contiguous() and "
            "b.t().contiguous().t() (b [N, K] row-major, transposed)"
        )
    if k % SCALED_MM_MULTIPLE or n % SCALED_MM_MULTIPLE:
        raise ValueError(
            f"cuBLASLt's FP8 GEMM needs K and N multiples of {SCALED_MM_MULTIPLE}, got K={k}, N={n}: pad, or emulate"
        )
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"_scaled_mm's scales are fp32, got {scale_a.dtype} and {scale_b.dtype}")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return
    if tuple(scale_a.shape) != (m, 1) or tuple(scale_b.shape) != (1, n):
        raise ValueError(
            f"_scaled_mm takes one scale each (tensor-wise) or scale_a [M, 1] = [{m}, 1] and scale_b [1, N] = "
            f"[1, {n}] (row-wise); got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
        raise ValueError("row-wise scales must be contiguous")
    if out_dtype != torch.bfloat16:
        raise ValueError(
            f"row-wise _scaled_mm writes bf16 on CUDA (CUTLASS's kernel), not {out_dtype}: ask for bfloat16, or "
            "apply the row scales after a tensor-wise GEMM with unit scales (fp8_matmul does so for fp32)"
        )


def _round_toward_zero(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """fp32 x with its 23-bit mantissa cut to the top ``mantissa_bits`` bits (the tensor cores truncate).

    Zeroing the low 23 − M bits of an fp32 number's code rounds its magnitude down to the M-bit grid.
    """
    if not (x.dtype == torch.float32 and 0 <= mantissa_bits <= 23):
        raise ValueError(f"truncates fp32 to at most 23 mantissa bits, got {x.dtype} and {mantissa_bits}")
    return (x.view(torch.int32) & -(1 << (23 - mantissa_bits))).view(torch.float32)


def _scale_per_chunk(scale: torch.Tensor, shape: tuple[int, int], chunk: int) -> torch.Tensor:
    """[rows, K/chunk]: the one scale of each row's chunk of K; an error if it changes inside a chunk."""
    rows, k = shape
    full = expand_scale(scale, shape).reshape(rows, k // chunk, chunk)
    if not torch.equal(full, full[..., :1].expand_as(full)):
        raise ValueError(
            f"the scales change inside a chunk of {chunk} elements of K: an accumulator can apply one scale "
            "per chunk, so promote at least as often as the scale blocks change (n_c = block = 128)"
        )
    return full[..., 0]


def _tensor_core_matmul(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    n_c: int | None,
    accumulator_mantissa_bits: int | None,
) -> torch.Tensor:
    """An emulation of an FP8 GEMM on Hopper, with DeepSeek's promotion every ``n_c`` (None: never).

    Inside a chunk the products of fp8 values are added WGMMA_K = 32 at a time (each group's sum in
    fp32: a product of two fp8 values is exact in fp32) into the tensor cores' accumulator, which
    keeps ``accumulator_mantissa_bits`` (13 for FP22; None: fp32) and truncates the rest. At the end
    of a chunk its partial sum is promoted: multiplied by the chunk's two scales and added to fp32.

    Truncation loses less than one unit in the last place each time, 2^−13 of the running sum, so
    for positive products the relative error is below (number of truncations) · 2^−13:
    K/32 · 2^−13 ≈ 1.6 % for K = 4096 without promotion, N_C/32 · 2^−13 ≈ 0.05 % with it (measured
    on |N(0, 1)| operands: 0.34 % and 0.013 %, tests/precision/test_fp8.py). Left out: the hardware also
    truncates each product when it aligns the 32 to their largest exponent, part of DeepSeek's 2 %.
    """
    (qa, sa), (qb, sb) = a, b
    (m, k), n = qa.shape, qb.shape[0]
    chunk = k if n_c is None else n_c
    if k % chunk or chunk % WGMMA_K:
        raise ValueError(f"n_c={n_c} must divide K={k} and be a multiple of {WGMMA_K}, one WGMMA's K")
    sa_c, sb_c = _scale_per_chunk(sa, (m, k), chunk), _scale_per_chunk(sb, (n, k), chunk)
    # every WGMMA's sum of 32 products at once: [K/32, M, N]; what is sequential is the accumulator
    groups = torch.einsum("mgk,ngk->gmn", qa.float().reshape(m, -1, WGMMA_K), qb.float().reshape(n, -1, WGMMA_K))
    per_chunk = chunk // WGMMA_K
    out = torch.zeros(m, n, device=groups.device)
    for c in range(k // chunk):
        partial = torch.zeros(m, n, device=groups.device)
        for g in groups[c * per_chunk : (c + 1) * per_chunk]:
            partial = partial + g
            if accumulator_mantissa_bits is not None:
                partial = _round_toward_zero(partial, accumulator_mantissa_bits)
        out += partial * sa_c[:, c, None] * sb_c[None, :, c]  # promotion: dequantize, add in fp32
    return out


def fp8_matmul(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    *,
    backend: str = "auto",
    n_c: int | None = N_C,
    accumulator_mantissa_bits: int | None = FP22_MANTISSA_BITS,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """y = â b̂ᵀ [M, N] from a = (q, s) [M, K] and b = (q, s) [N, K], accumulated in fp32.

    ``backend``:
      "scaled_mm"   — torch._scaled_mm (tensor-wise or row-wise scales, K and N multiples of 16:
                      :func:`scaled_mm_supports`), called as CUDA requires (:func:`check_scaled_mm_args`):
                      a row-major, bᵀ column-major. Row-wise scales with a bf16 ``out_dtype`` go to the
                      row-wise kernel; with fp32 (the default) the kernel runs tensor-wise with unit scales,
                      fp32 out, and s^a · s^b multiply the result in fp32 afterwards (they factor out of the
                      sum), since CUDA's row-wise kernels write bf16 only;
      "emulate"     — dequantize both, fp32 matmul: the same number up to fp32 reordering, any scales;
      "tensor_core" — Hopper's limited accumulator (``accumulator_mantissa_bits``) with promotion to
                      fp32 every ``n_c`` elements of K (None: never), :func:`_tensor_core_matmul`;
      "auto"        — "scaled_mm" where it takes the operands, else "emulate".
    """
    if backend == "auto":
        backend = "scaled_mm" if scaled_mm_supports(a, b) else "emulate"
    (qa, sa), (qb, sb) = a, b
    if qa.shape[-1] != qb.shape[-1]:
        raise ValueError(f"a {tuple(qa.shape)} and b {tuple(qb.shape)} must share K, their last dimension (y = a bᵀ)")
    if backend == "scaled_mm":
        if not scaled_mm_supports(a, b):
            raise ValueError(
                "torch._scaled_mm takes tensor-wise or row-wise scales (these vary along K?), K and N multiples "
                f"of {SCALED_MM_MULTIPLE} (K={qa.shape[-1]}, N={qb.shape[0]}) and not two e5m2 operands: "
                "use backend='emulate'"
            )
        # cuBLASLt's layouts: a [M, K] row-major, bᵀ [K, N] column-major (b [N, K] row-major, transposed).
        # The backward's operands are transposed views (ĝᵀ, x̂ᵀ, Ŵᵀ): contiguous() copies only those.
        mat1, mat2 = qa.contiguous(), qb.contiguous().t()
        if sa.numel() == 1 and sb.numel() == 1:
            sa_mm, sb_mm = sa.reshape(()).float(), sb.reshape(()).float()
            check_scaled_mm_args(mat1, mat2, sa_mm, sb_mm, out_dtype)
            return torch._scaled_mm(mat1, mat2, sa_mm, sb_mm, out_dtype=out_dtype)
        sa_mm, sb_mm = sa.reshape(-1, 1).float().contiguous(), sb.reshape(1, -1).float().contiguous()
        if out_dtype == torch.bfloat16:
            check_scaled_mm_args(mat1, mat2, sa_mm, sb_mm, out_dtype)
            return torch._scaled_mm(mat1, mat2, sa_mm, sb_mm, out_dtype=out_dtype)
        one = sa_mm.new_ones(())  # the row scales factor out of the sum: apply them in fp32 after the GEMM
        check_scaled_mm_args(mat1, mat2, one, one, torch.float32)
        return (torch._scaled_mm(mat1, mat2, one, one, out_dtype=torch.float32) * sa_mm * sb_mm).to(out_dtype)
    if backend == "emulate":
        return (dequantize(qa, sa) @ dequantize(qb, sb).T).to(out_dtype)
    if backend == "tensor_core":
        return _tensor_core_matmul(a, b, n_c, accumulator_mantissa_bits).to(out_dtype)
    raise ValueError(f"unknown backend {backend!r}: 'auto', 'scaled_mm', 'emulate' or 'tensor_core'")
