"""FP8 training: scaled 8-bit floats, fine-grained scales, FP8 GEMMs and an FP8 linear layer.

**The formats** (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; bit layouts in
:mod:`course_lib.precision.formats`):

    format   max      smallest normal   eps = 2^−M   unit roundoff u = 2^−(M+1)
    e4m3fn   448      2^−6              2^−3         2^−4    weights, activations (3 mantissa bits)
    e5m2     57344    2^−14             2^−2         2^−3    gradients (the range of fp16, 2 bits)

Round to nearest gives |round(v) − v| ≤ u·|v| for a normal v, and ≤ half the subnormal spacing,
2^(−b−M) (2^−10 for e4m3, 2^−17 for e5m2), below the smallest normal.

**Scaling.** 448 is a small range, so a tensor is stored as x ≈ q · s: fp8 values q and an fp32
scale s chosen so that the largest |x| it covers (its amax) lands on the format's max:

    s = amax / max,   q = saturate(round(x / s)),   x̂ = q · s
    |x̂ − x| ≤ u·|x| + 2^(−b−M) · s                 (the second term: subnormals, and zeros)

(Our s is Transformer Engine's ``scale_inv`` and DeepSeek's scaling factor: the number that
*dequantizes*, as torch._scaled_mm takes it.) The recipes differ in which elements share an s:

* ``"tensor"``  — one s per tensor from the tensor's own amax (dynamic or "current" scaling);
* ``"delayed"`` — one s per tensor from the max over an :class:`AmaxHistory` of the previous
  steps' amaxes, updated after use (Transformer Engine's ``DelayedScaling``,
  ``amax_compute_algo="max"``): no pass over the tensor before the cast, but a tensor that
  grows beyond its history saturates for one step;
* ``"row"``     — one s per row (torchao's and _scaled_mm's "rowwise");
* ``"tile"``    — one s per 1 × 128 tile of a row: DeepSeek-V3's activations (report §3.3.2,
  "fine-grained quantization": per token per 128 channels);
* ``"block"``   — one s per 128 × 128 block: DeepSeek-V3's weights. Square blocks make Wᵀ's
  quantization the transpose of W's, so the backward reuses it.

The finer the groups, the less one outlier costs: with one s per tensor, an element 10⁴ times the
rest pushes the rest down into the subnormals or to zero; with tiles only its own 128 neighbours
pay. ``pow2_scales=True`` rounds s up to a power of two (DeepSeek-V3 §3.3.3 for some activations;
the MX formats store only powers of two): multiplying by s is then exact, and amax/s ≤ max still.

**Overflow saturates**: x/s is clamped to ±max before the cast (Transformer Engine's casts
saturate too), so a delayed scale that is too small clips values instead of making inf.

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

**The layer.** :class:`FP8Linear` runs y = x Wᵀ + b with e4m3 x and W and its backward with an
e5m2 output gradient (the "hybrid" format of Micikevicius et al. 2022 and of Transformer Engine;
DeepSeek-V3 uses e4m3 for everything, its fine-grained scales giving it the range). Both input and
weight gradients are computed from the fp8 values saved by the forward and accumulate in fp32; the
weights stay fp32 (the master copy) and are quantized at every call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.precision.formats import FORMATS, FloatFormat

__all__ = [
    "E4M3",
    "E5M2",
    "LINEAR_RECIPES",
    "N_C",
    "RECIPES",
    "SCALED_MM_MULTIPLE",
    "AmaxHistory",
    "FP8Linear",
    "check_scaled_mm_args",
    "convert_to_fp8_training",
    "dequantize",
    "expand_scale",
    "fp8_format",
    "fp8_matmul",
    "quantize",
    "scale_from_amax",
    "scaled_mm_supports",
    "sync_amax",
]

E4M3: FloatFormat = FORMATS["fp8_e4m3"]  # max 448, eps 2^-3, u 2^-4, smallest normal 2^-6
E5M2: FloatFormat = FORMATS["fp8_e5m2"]  # max 57344, eps 2^-2, u 2^-3, smallest normal 2^-14
RECIPES = ("tensor", "delayed", "row", "tile", "block")
N_C = 128  # DeepSeek-V3 §3.3.2: promote the tensor cores' partial sums to fp32 every 128 elements of K
WGMMA_K = 32  # FP8 products one Hopper WGMMA instruction adds into its accumulator at a time
FP22_MANTISSA_BITS = 13  # the tensor cores' accumulator: "around 14 bits" of precision, 13 after the point
SCALED_MM_MULTIPLE = 16  # cuBLASLt's FP8 GEMM: K and N multiples of 16 (torch checks it on CUDA, not on CPU)


def fp8_format(fmt: str | FloatFormat) -> FloatFormat:
    """ "e4m3" / "e5m2" (or "fp8_e4m3", or a FloatFormat with a torch dtype) → the FloatFormat."""
    if isinstance(fmt, FloatFormat):
        f = fmt
    elif isinstance(fmt, str):
        f = FORMATS.get(fmt if fmt.startswith("fp8_") else f"fp8_{fmt}")
    else:
        f = None
    if f is None or f.dtype is None or f.bits != 8:
        raise ValueError(f"FP8 formats are 'e4m3' and 'e5m2', got {fmt!r}")
    return f


# ------------------------------------------------------------------------------ scales


class AmaxHistory:
    """The amaxes of the last ``length`` steps of one tensor (Transformer Engine's ``amax_history_len``).

    Delayed scaling takes s = max(history) / fmt.max, then records this step's amax. An empty history
    (the first step) uses the current amax, as torchao's delayed scaling initialised it;
    Transformer Engine starts from s = 1 instead. The values live on the device of the amaxes recorded
    (``device``, or that of the first amax): the max is taken where the tensors are, with no copy.
    """

    def __init__(self, length: int = 16, device: torch.device | str | None = None):
        if not (isinstance(length, int) and length >= 1):
            raise ValueError(f"the amax history needs length >= 1, got {length!r}")
        self.length = length
        self.values = torch.zeros(0, device=device)

    def __len__(self) -> int:
        return len(self.values)

    def max(self) -> torch.Tensor:
        return self.values.max()

    def update(self, amax: torch.Tensor) -> None:
        """Append this step's amax; the oldest falls out of a full window."""
        new = amax.detach().float().reshape(1)
        if not len(self.values):  # the first amax: the history takes its device (and owns a copy)
            self.values = new.clone()
        elif new.device != self.values.device:
            raise ValueError(
                f"this history's amaxes are on {self.values.device}, the new one is on {new.device}: "
                "keep one AmaxHistory per tensor, on that tensor's device"
            )
        else:
            self.values = torch.cat([self.values, new])[-self.length :]


def scale_from_amax(amax: torch.Tensor, fmt: str | FloatFormat, pow2_scales: bool = False) -> torch.Tensor:
    """s = amax / fmt.max, so that amax maps onto the largest fp8 value; 1 where amax is 0.

    ``pow2_scales``: s rounded *up* to a power of two, 2^⌈log2(amax/max)⌉, so that |x|/s ≤ max still
    (and dividing by s is exact). From frexp: s = m · 2^e with m ∈ [0.5, 1) is a power of two only
    when m = 0.5 (then s = 2^(e−1)); otherwise the next one up is 2^e.
    """
    f = fp8_format(fmt)
    s = amax.float() / f.max
    if pow2_scales:
        m, e = torch.frexp(s)
        s = torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))
    return torch.where(amax > 0, s, torch.ones_like(s))


def sync_amax(amax: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce MAX of ``amax`` (in place, and returned) over ``group``.

    Ranks that hold shards of one logical tensor (tensor parallel) or replicas that must round alike
    (data parallel) then agree on its scale, as Transformer Engine reduces amaxes over its
    ``amax_reduction_group``. The amax is fp32, which gloo reduces; gloo has no float8 reductions.
    """
    if amax.dtype != torch.float32:
        raise TypeError(f"sync_amax reduces fp32 amaxes, got {amax.dtype}")
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The scale of every element of a tensor of ``shape``: each scale entry covers a br × bc block.

    The tensor is seen as [R, C] (leading dimensions flattened), the scale as [R/br, C/bc] (a 0-d
    scale is [1, 1]); br and bc follow from the two shapes. One rule serves every recipe, and the
    transposes of the backward: Wᵀ's scale is W's scale transposed.
    """
    shape = tuple(shape)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    s = scale.reshape(1, 1) if scale.dim() == 0 else scale.reshape(-1, scale.shape[-1])
    if s.numel() == 0 or rows == 0:
        return scale.new_empty(shape)
    if rows % s.shape[0] or cols % s.shape[1]:
        raise ValueError(
            f"a scale of shape {tuple(scale.shape)} does not tile a tensor of shape {shape}: "
            "each scale must cover a whole block of rows x columns"
        )
    return s.repeat_interleave(rows // s.shape[0], 0).repeat_interleave(cols // s.shape[1], 1).reshape(shape)


def _amax(x: torch.Tensor, recipe: str, block: int) -> torch.Tensor:
    """max |x| over each group of elements that will share a scale; shaped as the scale."""
    if recipe in ("tensor", "delayed"):
        return x.abs().amax()
    if recipe == "row":
        return x.abs().amax(-1, keepdim=True)
    cols = x.shape[-1]
    bc = min(block, cols)  # a dimension shorter than the block is one block
    if cols % bc:
        raise ValueError(f"block={block} does not divide the last dimension {cols}: every scale covers a whole tile")
    if recipe == "tile":
        return x.reshape(*x.shape[:-1], cols // bc, bc).abs().amax(-1)
    if x.dim() != 2:
        raise ValueError(f"128 x 128 blocks are for 2-D weights; got a tensor of shape {tuple(x.shape)}")
    rows = x.shape[0]
    br = min(block, rows)
    if rows % br:
        raise ValueError(f"block={block} does not divide the {rows} rows: every scale covers a whole block")
    return x.reshape(rows // br, br, cols // bc, bc).abs().amax((1, 3))


# ------------------------------------------------------------------------------ quantize


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat = "e4m3",
    recipe: str = "tensor",
    *,
    block: int = 128,
    pow2_scales: bool = False,
    history: AmaxHistory | None = None,
    sync: bool = False,
    group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x → (q, s): float8 values of x's shape and fp32 scales, x ≈ q · s (see :func:`dequantize`).

    s per recipe (module docstring): "tensor" and "delayed" 0-d; "row" [..., 1]; "tile" [..., C/block];
    "block" [R/block, C/block] (2-D x). "delayed" needs ``history`` and records x's amax in it after
    use. ``sync=True`` all-reduces the amax (MAX) over ``group`` first (:func:`sync_amax`).

    q = clamp(x / s, −max, max) cast to the format: out-of-range values saturate. The expert-parallel
    the expert-parallel FP8 dispatch (:mod:`course_lib.parallel.expert.dispatch`) calls ``quantize(x, "e4m3", "tile", block=block)``.
    """
    f = fp8_format(fmt)
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if recipe == "delayed" and history is None:
        raise ValueError("delayed scaling takes its scale from past amaxes: pass history=AmaxHistory(n)")
    xf = x.detach().float()
    amax = _amax(xf, recipe, block)
    if sync:
        sync_amax(amax, group)
    if recipe == "delayed":
        used = history.max() if len(history) else amax  # the past decides; this step's amax is for the next
        history.update(amax)
        amax = used
    s = scale_from_amax(amax, f, pow2_scales)
    q = (xf / expand_scale(s, xf.shape)).clamp(-f.max, f.max).to(f.dtype)
    return q, s


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x̂ = q · s in fp32, each scale entry spread over its block (:func:`expand_scale`)."""
    return q.float() * expand_scale(scale, q.shape)


# ------------------------------------------------------------------------------ GEMM


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
    on |N(0, 1)| operands: 0.34 % and 0.013 %, tests/test_fp8.py). Left out: the hardware also
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


# ------------------------------------------------------------------------------ the layer

# which quantize() recipe each operand of FP8Linear uses: x and the output gradient along their rows
# (K in the forward, N in the input-gradient GEMM), W in square blocks (its transpose for free)
LINEAR_RECIPES = {
    "tensor": dict(x="tensor", w="tensor", grad="tensor"),
    "block": dict(x="tile", w="block", grad="tile"),  # DeepSeek-V3 §3.3.2
}


class _FP8LinearFunction(torch.autograd.Function):
    """y = x̂ Ŵᵀ + b; dx = ĝ Ŵ, dW = ĝᵀ x̂ with ĝ the output gradient in e5m2; all three accumulate in fp32.

    x̂, Ŵ are the fp8 values (and scales) saved by the forward: the backward never sees fp32 x or W.
    The bias and its gradient stay in fp32 (Σ over rows of the unquantized g).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, grad_fmt):
        r = LINEAR_RECIPES[recipe]
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize(x2, E4M3, r["x"])
        qw, sw = quantize(weight, E4M3, r["w"])
        y = fp8_matmul((qx, sx), (qw, sw))
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(qx, sx, qw, sw)
        ctx.recipe, ctx.grad_fmt, ctx.x_shape, ctx.x_dtype = r, grad_fmt, x.shape, x.dtype
        ctx.has_bias = bias is not None
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        qx, sx, qw, sw = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).float()
        qg, sg = quantize(g2, ctx.grad_fmt, ctx.recipe["grad"])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # [M, N] x [N, K]: K-major operands are ĝ and Ŵᵀ
            dx = fp8_matmul((qg, sg), (qw.t(), sw.t())).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # [N, M] x [M, K]: contraction over the tokens
            dw = fp8_matmul((qg.t(), sg.t()), (qx.t(), sx.t()))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db, None, None


class FP8Linear(nn.Module):
    """nn.Linear with its three GEMMs in FP8 (module docstring); fp32 master weight and bias.

    ``recipe``: "tensor" (one dynamic scale per tensor) or "block" (x and the gradient in 1 × 128 tiles,
    W in 128 × 128 blocks: DeepSeek-V3). ``grad_fmt``: the output gradient's format, e5m2 by default.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str = "block",
        grad_fmt: str | FloatFormat = "e5m2",
    ):
        super().__init__()
        if recipe not in LINEAR_RECIPES:
            raise ValueError(f"unknown FP8Linear recipe {recipe!r}; choose one of {', '.join(LINEAR_RECIPES)}")
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        self.grad_fmt = fp8_format(grad_fmt)
        ref = nn.Linear(in_features, out_features, bias=bias)  # the same initialisation as nn.Linear
        self.weight = nn.Parameter(ref.weight.detach().float())
        self.bias = nn.Parameter(ref.bias.detach().float()) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "block", grad_fmt: str | FloatFormat = "e5m2") -> FP8Linear:
        """An FP8Linear holding a copy of ``linear``'s weight and bias (fp32)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, grad_fmt)
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self.recipe, self.grad_fmt)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, recipe={self.recipe!r}, grad_fmt={self.grad_fmt.name}"
        )


# ------------------------------------------------------------------------------ a whole model


def convert_to_fp8_training(
    module: nn.Module,
    recipe: str = "block",
    *,
    skip: Iterable[str] | Callable[[str, nn.Linear], bool] = (),
    grad_fmt: str | FloatFormat = "e5m2",
) -> nn.Module:
    """Swap every ``nn.Linear`` inside ``module`` for an :class:`FP8Linear` (in place; returns ``module``).

    This is what DeepSeek-V3 §3.3.1 ("mixed precision framework") does to a model: the GEMMs of the
    linear layers run in FP8, while the embedding, the output head, the normalizations, attention's
    own products, the MoE gate and the optimizer stay in higher precision (BF16/FP32), because
    they are cheap or sensitive. ``skip`` keeps some linears as they are: qualified module names
    (``{"output"}``: the head, as ``model.named_modules()`` names it) or a predicate
    ``skip(name, linear) -> True`` to keep one (torchao's ``module_filter_fn`` is the opposite:
    True to convert). Modules that are not exactly ``nn.Linear`` (subclasses, FP8Linear itself) are
    left alone: their forward may not be x Wᵀ + b.

    Each FP8Linear takes over the linear's own ``weight`` and ``bias`` Parameters, not copies:
    the state-dict keys, tied weights (a head tied to the embedding) and an optimizer built
    before the swap all keep pointing at the master weights. Layers are built on the meta device,
    so the swap allocates nothing and draws nothing from torch's random generator (a run with
    and without the swap sees the same random numbers afterwards).
    """
    if type(module) is nn.Linear:
        raise TypeError("this swaps the linears inside a module; convert a lone nn.Linear with FP8Linear.from_linear")
    if recipe not in LINEAR_RECIPES:
        raise ValueError(f"unknown FP8Linear recipe {recipe!r}; choose one of {', '.join(LINEAR_RECIPES)}")
    if callable(skip):
        keep = skip
    else:
        names = set(skip)
        unknown = names - {name for name, _ in module.named_modules()}
        if unknown:
            raise ValueError(f"skip names modules that are not in the model: {sorted(unknown)} (see named_modules())")
        keep = lambda name, linear: name in names
    # every path to a linear (remove_duplicate=False: a module registered twice is swapped at both places)
    targets = [(n, m) for n, m in module.named_modules(remove_duplicate=False) if type(m) is nn.Linear]
    swapped: dict[int, FP8Linear] = {}  # one FP8Linear per linear, however many names lead to it
    for name, linear in targets:
        if keep(name, linear):
            continue
        if id(linear) not in swapped:
            with torch.device("meta"):  # no allocation, no random draws: the Parameters come from `linear`
                layer = FP8Linear(linear.in_features, linear.out_features, linear.bias is not None, recipe, grad_fmt)
            layer.weight, layer.bias = linear.weight, linear.bias
            swapped[id(linear)] = layer
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, swapped[id(linear)])
    return module
