"""Lab 08 — FP8 training: scaled 8-bit floats, DeepSeek-V3's fine-grained scales, an FP8 linear layer.

An FP8 number has 8 bits (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"):

    format   max      smallest normal   unit roundoff u   used for
    e4m3fn   448      2^-6              2^-4              weights and activations (3 mantissa bits)
    e5m2     57344    2^-14             2^-3              gradients (2 mantissa bits, fp16's range)

448 is a small range, so a tensor is stored as x ≈ q · s: FP8 values q and an fp32 *scale* s that
maps the largest |x| it covers (its amax) onto the format's max:

    s = amax / max,   q = saturate(round(x / s)) in FP8,   x̂ = dequantize(q, s) = q · s

Round to nearest errs by at most u·|x| for values in the normal range; below the smallest normal
the spacing of the subnormals takes over. Which elements share an s is the *recipe*:

* ``"tensor"`` — one s for the whole tensor (Transformer Engine's current scaling);
* ``"tile"``   — one s per 1 × 128 tile of each row: DeepSeek-V3's activations (report §3.3.2);
* ``"block"``  — one s per 128 × 128 block: DeepSeek-V3's weights.

You write:

1. ``quantize`` (the scale, the saturating cast) and ``dequantize``;
2. ``amax_per_group`` (the amax of every group that shares a scale) and ``expand_scale`` (every
   element's scale): the fine-grained recipes;
3. ``_FP8LinearFunction``: y = x̂ Ŵᵀ + b with e4m3 operands, and its backward with the output
   gradient in e5m2, dx = ĝ Ŵ̂ and dW = ĝᵀ x̂ from the FP8 values saved by the forward, accumulated
   in fp32 (``fp8_matmul``);
4. train with it: ``run.py`` and the grader train a small model whose hidden linears are your
   ``FP8Linear`` (``convert_to_fp8``, given) next to the same model in bf16.

Shapes: a tensor is seen as [R, C] with its leading dimensions flattened into R rows; C (and for
"block" R) must be a multiple of ``block`` = 128, or smaller than it (then it is one group).
"""

# Your code goes in the fenced "Task N — your code" regions of this file:
#   line 81: Task 2: return the fp32 amax of every 1 x 128 tile or 128 x 128 block (one per group)
#   line 96: Task 2: return every element's scale, [shape], for any recipe and its transpose
#   line 127: Task 1: return (q, s): s = amax / max, q = saturate(x / s) cast to FP8
#   line 134: Task 1: return x̂ = q · s in fp32, q's shape
#   line 149: Task 3: return a · bᵀ of two (q, s) operands, accumulated in fp32 (emulated)
#   line 177: Task 3: return y = x̂ Ŵᵀ + b in x's dtype; save the FP8 operands on ctx
#   line 192: Task 3: return (dx, dw, db, None, None) from the saved FP8 operands and an e5m2 gradient

import math

import torch
import torch.nn as nn

from course_lib.precision.formats import FORMATS, FloatFormat

E4M3: FloatFormat = FORMATS["fp8_e4m3"]  # .max 448, .unit_roundoff 2^-4, .dtype torch.float8_e4m3fn
E5M2: FloatFormat = FORMATS["fp8_e5m2"]  # .max 57344, .unit_roundoff 2^-3, .dtype torch.float8_e5m2
RECIPES = ("tensor", "tile", "block")


def fp8_format(fmt: str | FloatFormat) -> FloatFormat:
    """ "e4m3" or "e5m2" (or the FloatFormat itself) → the FloatFormat: .max, .dtype, .unit_roundoff."""
    if isinstance(fmt, FloatFormat):
        return fmt
    found = {"e4m3": E4M3, "e5m2": E5M2, "fp8_e4m3": E4M3, "fp8_e5m2": E5M2}.get(fmt)
    if found is None:
        raise ValueError(f"FP8 formats are 'e4m3' and 'e5m2', got {fmt!r}")
    return found


# ------------------------------------------------------------------------------ Task 2


def amax_per_group(x: torch.Tensor, recipe: str, block: int = 128) -> torch.Tensor:
    """max |x| over each group of elements that shares a scale, shaped as the scale.

    * "tensor": 0-d, the amax of the whole tensor;
    * "tile":   [..., C/block] for x [..., C]: one amax per 1 × block tile of each row;
    * "block":  [R/block, C/block] for a 2-D x [R, C]: one amax per block × block square.

    A dimension shorter than ``block`` is one group (bc = min(block, C)); a dimension that is longer
    and not a multiple of it is an error (raise a ValueError). Hint: reshape [R, C] to
    [R/br, br, C/bc, bc] and take the amax over dimensions 1 and 3.
    """
    # ━━ Task 2 — your code: return the fp32 amax of every 1 x 128 tile or 128 x 128 block (one per group) ━━
    raise NotImplementedError('Task 2: return the fp32 amax of every 1 x 128 tile or 128 x 128 block (one per group)')
    # ━━ end of Task 2 ━━


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The scale of every element of a tensor of ``shape``.

    The tensor is seen as [R, C] (leading dimensions flattened), the scale as [R/br, C/bc] (a 0-d
    scale as [1, 1]; a tile scale [..., C/bc] as [R, C/bc]); each scale entry covers a br × bc block,
    br and bc following from the two shapes. One rule serves every recipe and their transposes:
    the backward multiplies by Ŵ, whose scale is W's block scale transposed, and by x̂ᵀ, whose
    scale is x's tile scale transposed ([C/128, R]: one scale per 128 × 1 column piece).
    Hint: ``repeat_interleave`` along both dimensions.
    """
    # ━━ Task 2 — your code: return every element's scale, [shape], for any recipe and its transpose ━━
    raise NotImplementedError("Task 2: return every element's scale, [shape], for any recipe and its transpose")
    # ━━ end of Task 2 ━━


# ------------------------------------------------------------------------------ Task 1


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat = "e4m3",
    recipe: str = "tensor",
    *,
    block: int = 128,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x → (q, s): q the FP8 values ([x's shape], dtype fmt.dtype), s the fp32 scales, x ≈ q · s.

    * amax: ``amax_per_group(x, recipe, block)`` in fp32 — unless ``amax`` is given (delayed
      scaling passes an earlier step's amax; then some |x| / s may exceed the format's max);
    * s = amax / fmt.max, and s = 1 where the amax is 0 (an all-zero group);
    * q = x / s (each element divided by its own group's scale: ``expand_scale``), **saturated** to
      [-fmt.max, fmt.max], then cast to ``fmt.dtype``. Do not leave that to the cast: torch turns
      what lies beyond e5m2's max into inf, and e4m3fn's overflow is NaN or saturated depending
      on the torch version and the device.

    Work on ``x.detach().float()``: the scale is data, not part of the graph.
    """
    f = fp8_format(fmt)
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    # ━━ Task 1 — your code: return (q, s): s = amax / max, q = saturate(x / s) cast to FP8 ━━
    raise NotImplementedError('Task 1: return (q, s): s = amax / max, q = saturate(x / s) cast to FP8')
    # ━━ end of Task 1 ━━


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x̂ = q · s in fp32, each element times its own group's scale (``expand_scale``)."""
    # ━━ Task 1 — your code: return x̂ = q · s in fp32, q's shape ━━
    raise NotImplementedError("Task 1: return x̂ = q · s in fp32, q's shape")
    # ━━ end of Task 1 ━━


# ------------------------------------------------------------------------------ Task 3


def fp8_matmul(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """y = â b̂ᵀ [M, N] in fp32 from a = (q, s) [M, K] and b = (q, s) [N, K]: both hold K last.

    An emulation: dequantize both, one fp32 matmul. (On a Hopper GPU an FP8 GEMM multiplies the
    FP8 values on the tensor cores and applies the scales to fp32 partial sums every 128 elements
    of K: the same number up to the order of the fp32 additions.)
    """
    # ━━ Task 3 — your code: return a · bᵀ of two (q, s) operands, accumulated in fp32 (emulated) ━━
    raise NotImplementedError('Task 3: return a · bᵀ of two (q, s) operands, accumulated in fp32 (emulated)')
    # ━━ end of Task 3 ━━


# which quantize() recipe each operand uses: x and the output gradient along their rows (tiles),
# W in square blocks, so that Wᵀ's quantization is W's transposed (DeepSeek-V3 §3.3.2)
LINEAR_RECIPES = {
    "tensor": dict(x="tensor", w="tensor", grad="tensor"),
    "block": dict(x="tile", w="block", grad="tile"),
}


class _FP8LinearFunction(torch.autograd.Function):
    """y = x̂ Ŵᵀ + b; dx = ĝ Ŵ, dW = ĝᵀ x̂; all three GEMMs in FP8, accumulated in fp32.

    x̂ and Ŵ are e4m3 (recipes ``LINEAR_RECIPES[recipe]["x"]`` and ``["w"]``); ĝ is the output
    gradient in ``grad_fmt`` (e5m2: gradients need range more than precision), recipe ``["grad"]``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, recipe, grad_fmt):
        """x [..., K], weight [N, K], bias [N] or None → y [..., N] in x's dtype.

        Flatten x to [M, K]; quantize x and W to e4m3 with their recipes; y = fp8_matmul(x̂, Ŵ) (+ bias
        in fp32). Save the FP8 values and scales (not x or W: the backward must use what the forward
        multiplied, and FP8 halves the memory of the saved activations), the recipes and shapes.
        """
        # ━━ Task 3 — your code: return y = x̂ Ŵᵀ + b in x's dtype; save the FP8 operands on ctx ━━
        raise NotImplementedError("Task 3: return y = x̂ Ŵᵀ + b in x's dtype; save the FP8 operands on ctx")
        # ━━ end of Task 3 ━━

    @staticmethod
    def backward(ctx, grad_out):
        """grad_out [..., N] → (dx, dW, db, None, None).

        ĝ = quantize(grad_out as [M, N], grad_fmt, the grad recipe). Both GEMMs take operands with the
        contraction dimension last, so transpose q and s together:
          dx [M, K] = ĝ Ŵ   = fp8_matmul(ĝ, Ŵᵀ)     (contract over N);
          dW [N, K] = ĝᵀ x̂  = fp8_matmul(ĝᵀ, x̂ᵀ)    (contract over the M tokens).
        db = the sum of grad_out over the rows, in fp32, unquantized. Return None for what needs no
        gradient (``ctx.needs_input_grad``) and for recipe and grad_fmt.
        """
        # ━━ Task 3 — your code: return (dx, dw, db, None, None) from the saved FP8 operands and an e5m2 gradient ━━
        raise NotImplementedError('Task 3: return (dx, dw, db, None, None) from the saved FP8 operands and an e5m2 gradient')
        # ━━ end of Task 3 ━━


class FP8Linear(nn.Module):
    """nn.Linear with its three GEMMs in FP8; the weight and bias stay fp32 (the master copy) and are
    quantized afresh at every call. ``recipe``: "tensor" or "block" (DeepSeek-V3); ``grad_fmt``: the
    output gradient's format. (Given.)"""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, recipe: str = "block", grad_fmt: str = "e5m2"
    ):
        super().__init__()
        if recipe not in LINEAR_RECIPES:
            raise ValueError(f"unknown FP8Linear recipe {recipe!r}; choose one of {', '.join(LINEAR_RECIPES)}")
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        self.grad_fmt = fp8_format(grad_fmt)
        ref = nn.Linear(in_features, out_features, bias=bias)  # nn.Linear's initialisation
        self.weight = nn.Parameter(ref.weight.detach().float())
        self.bias = nn.Parameter(ref.bias.detach().float()) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self.recipe, self.grad_fmt)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe!r}"


# ------------------------------------------------------------------------------ Task 4 (given)


def convert_to_fp8(model: nn.Module, recipe: str = "block", skip: tuple[str, ...] = ("head",)) -> nn.Module:
    """Replace every nn.Linear inside ``model`` (in place) by an FP8Linear holding the same weights, except
    those whose names (as ``model.named_modules()`` gives them) are in ``skip``: DeepSeek-V3 keeps the
    embedding, the output head, the MoE gates, the normalisations and attention's own products in
    higher precision (report §3.3.1). Given."""
    for name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or name in skip:
            continue
        layer = FP8Linear(linear.in_features, linear.out_features, linear.bias is not None, recipe)
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model
