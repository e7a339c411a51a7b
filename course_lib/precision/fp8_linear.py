"""The FP8 linear layer: y = x Wᵀ + b and its backward in FP8, and the swap of a model's linears.

Part 3 of three on FP8 training: the layer quantizes with :mod:`course_lib.precision.fp8_scaling`
and multiplies with :func:`course_lib.precision.fp8_gemm.fp8_matmul`. Tested in tests/precision/test_fp8.py and,
for whole training runs, tests/experiments/test_fp8_training.py.

**The layer.** :class:`FP8Linear` runs y = x Wᵀ + b with e4m3 x and W and its backward with an
e5m2 output gradient (the "hybrid" format of Micikevicius et al. 2022 and of Transformer Engine;
DeepSeek-V3 uses e4m3 for everything, its fine-grained scales giving it the range). Both input and
weight gradients are computed from the fp8 values saved by the forward and accumulate in fp32; the
weights stay fp32 (the master copy) and are quantized at every call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from course_lib.precision.formats import FloatFormat
from course_lib.precision.fp8_gemm import fp8_matmul
from course_lib.precision.fp8_scaling import E4M3, fp8_format, quantize

__all__ = ["LINEAR_RECIPES", "FP8Linear", "convert_to_fp8_training"]

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
