"""FP8 scaling: the two formats, a scale per group of elements (five recipes), quantize and dequantize.

Part 1 of three on FP8 training (then :mod:`course_lib.precision.fp8_gemm`, the GEMM on quantized
operands, and :mod:`course_lib.precision.fp8_linear`, the layer). Tested in tests/precision/test_fp8.py.

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
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.precision.formats import FORMATS, FloatFormat

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPES",
    "AmaxHistory",
    "dequantize",
    "expand_scale",
    "fp8_format",
    "quantize",
    "scale_from_amax",
    "sync_amax",
]

E4M3: FloatFormat = FORMATS["fp8_e4m3"]  # max 448, eps 2^-3, u 2^-4, smallest normal 2^-6
E5M2: FloatFormat = FORMATS["fp8_e5m2"]  # max 57344, eps 2^-2, u 2^-3, smallest normal 2^-14
RECIPES = ("tensor", "delayed", "row", "tile", "block")


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
    FP8 dispatch (:mod:`course_lib.parallel.expert.dispatch`) calls ``quantize(x, "e4m3", "tile", block=block)``.
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
