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
grader passes the learner's ``fp8.py``; tests/test_lab_checks.py passes course_lib's own
(course_lib.precision.fp8, with a shim for the lab's ``amax=`` argument in tests/lab_shims.py).

Tolerances are derived from the formats (course_lib.precision.formats): round to nearest in e4m3
errs by at most u = 2^-4 of the value, in e5m2 by 2^-3, and below the smallest normal by half the
subnormal spacing, 2^-(b+M) (2^-10 for e4m3, 2^-17 for e5m2), times the scale. fp32 arithmetic
around them adds multiples of U = 2^-24: a sum of n terms in any order is within γ_n·Σ|terms| of
the exact one, γ_n = nU/(1 - nU) (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1).
"""

import math
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.data import MarkovLanguage
from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.grading.grade import Task
from course_lib.precision import fp8

ROLES = ("quantize", "dequantize", "amax_per_group", "expand_scale", "FP8Linear")
NAMES = (*ROLES, "fp8_format", "fp8_matmul", "_FP8LinearFunction", "convert_to_fp8")  # what check_setup wants


def adapter(lab_dir: Path) -> Adapter:
    """The learner's quantization, groups and layer, from ``fp8.py``."""
    return Adapter.of_file(Path(lab_dir) / "fp8.py", ROLES)


U = 2.0**-24  # unit roundoff of fp32
# Every check runs in the grader's own process, not on ranks: on the host, where the learner's functions
# and FP8Linear are called with the same numbers on every machine (and _train's autocast is the CPU's).
GRADER = torch.device("cpu")
FORMATS = {"e4m3": fp8.E4M3, "e5m2": fp8.E5M2}
# course_lib's implementation of each role, put in the learner's module while another role is graded
LIBRARY = {
    "quantize": fp8.quantize,
    "dequantize": fp8.dequantize,
    "amax_per_group": fp8._amax,
    "expand_scale": fp8.expand_scale,
}


def half_subnormal_spacing(f) -> float:
    """2^-(b+M): round to nearest below the smallest normal errs by at most half the spacing 2^(1-b-M)."""
    return f.smallest_subnormal / 2


@contextmanager
def course_lib_for(impl: Adapter, graded: str, roles: tuple[str, ...]):
    """Within the block, the module implementing ``graded`` calls course_lib's version of ``roles``.

    The learner's ``quantize`` calls their ``amax_per_group``: grading Task 1 with course_lib's groups
    means a mistake in Task 2 costs Task 2's points only. For course_lib's adapter this changes nothing
    (its module already calls its own functions).
    """
    module = impl.module(graded)
    names = {role: attribute for role, _, attribute in impl.sources}
    saved = {}
    for role in roles:
        name = names[role]
        if hasattr(module, name):
            saved[name] = getattr(module, name)
            setattr(module, name, LIBRARY[role])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _data(shape, seed: int, spread: float = 3.0) -> torch.Tensor:
    """Gaussian values whose magnitudes span many binades (log-normal factor), some in the subnormals."""
    g = torch.Generator(device=GRADER).manual_seed(seed)
    return torch.randn(shape, generator=g, device=GRADER) * torch.exp(
        spread * torch.randn(shape, generator=g, device=GRADER)
    )


def _roundtrip_bound(x: torch.Tensor, s_full: torch.Tensor, f) -> torch.Tensor:
    """|x̂ - x| ≤ (u + 4U)|x| + 2^-(b+M)·s·(1 + U) for x within range of its scale.

    v = fl(x/s) errs by ≤ 2U relatively (a division, or a reciprocal and a product); rounding v to FP8
    by ≤ u·|v| in the normal range, ≤ 2^-(b+M) below it; clamping a v that rounding pushed past the
    max by ≤ 2U·|v|; x̂ = fl(q·s) by one more U. Collected: u + 4U of |x| (products of U's dropped,
    they are below 2^-40) and the subnormal term times s (and its own rounding).
    """
    return (f.unit_roundoff + 4 * U) * x.abs() + half_subnormal_spacing(f) * s_full * (1 + U)


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("quantize")
    for name in NAMES:
        assert callable(getattr(module, name, None)), f"fp8.py must define {name}"


def _check_quantized(impl: Adapter, x: torch.Tensor, fmt: str, recipe: str) -> None:
    """The learner's quantize and dequantize on x against the bound; the groups are course_lib's."""
    f = FORMATS[fmt]
    where = f"{fmt}, recipe {recipe!r}, x {tuple(x.shape)}"
    q, s = impl["quantize"](x, fmt, recipe)
    assert isinstance(q, torch.Tensor) and q.dtype == f.dtype and q.shape == x.shape, (
        f"{where}: q must be a {f.dtype} tensor of x's shape (cast with .to(fmt.dtype)); got "
        f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}"
    )
    amax = fp8._amax(x.float(), recipe, 128)
    assert isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.shape == amax.shape, (
        f"{where}: s must be fp32 and shaped as amax_per_group's result {tuple(amax.shape)}; got "
        f"{getattr(s, 'dtype', type(s))} {tuple(getattr(s, 'shape', ()))}"
    )
    want = torch.where(amax > 0, amax.double() / f.max, torch.ones_like(amax, dtype=torch.float64))
    # s = fl(amax / max): one rounding (U), or two if computed as amax · (1/max): 2U; 3U bounds both.
    err = ((s.double() - want).abs() / want).max().item()
    assert err <= 3 * U, (
        f"{where}: the scale is off by {err:.1e} relatively: s = amax / fmt.max ({f.max:g}), "
        "the number that *dequantizes* (x ≈ q · s), and s = 1 where the amax is 0"
    )
    qf = q.float()
    assert torch.isfinite(qf).all(), f"{where}: q holds NaN or inf: saturate x / s to ±fmt.max before the cast"
    # The amax element: amax / fl(amax / max) = max·(1 + δ), |δ| ≤ 3U, which rounds to max itself.
    top = fp8._amax(qf, recipe, 128)
    assert torch.equal(top[amax > 0], torch.full_like(top[amax > 0], f.max)), (
        f"{where}: the largest |q| of a group is {top.max().item():g}, not the format's max {f.max:g}: "
        "s = amax / max maps each group's amax onto the max (a scale of amax would map it onto 1)"
    )
    x_hat = impl["dequantize"](q, s)
    assert isinstance(x_hat, torch.Tensor) and x_hat.dtype == torch.float32 and x_hat.shape == x.shape, (
        f"{where}: dequantize must return fp32 values of q's shape"
    )
    s_full = fp8.expand_scale(s, x.shape)
    exact = qf.double() * s_full.double()
    # x̂ = fl(q·s): one fp32 rounding of an exact product, ≤ U·|q·s|.
    assert ((x_hat.double() - exact).abs() <= U * exact.abs()).all(), (
        f"{where}: dequantize(q, s) must be q · s in fp32, each element times its own group's scale"
    )
    bad = (x_hat.double() - x.double()).abs() > _roundtrip_bound(x.double(), s_full.double(), f)
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{where}: element {i} = {x[i].item():.4g} comes back as {x_hat[i].item():.4g}, beyond round to "
            f"nearest (u = {f.unit_roundoff:g} of the value plus half the subnormal spacing times s): "
            "q = round(x / s), each element divided by its own group's scale"
        )


def check_per_tensor(impl: Adapter) -> None:
    with course_lib_for(impl, "quantize", ("amax_per_group", "expand_scale")):
        for fmt, seed in (("e4m3", 1), ("e5m2", 2)):
            _check_quantized(impl, _data((64, 256), seed), fmt, "tensor")
            _check_quantized(impl, _data((2, 8, 128), seed + 10, spread=1.0), fmt, "tensor")
        x = _data((16, 384), 3, spread=1.0)
        x[1, :128] = 0  # an all-zero tile: s = 1 there, q = 0
        x[5] = 0
        for recipe in ("tile", "block"):  # the groups are course_lib's here: the scale must follow them
            _check_quantized(impl, x, "e4m3", recipe)
        zero = torch.zeros(4, 128, device=GRADER)
        q, s = impl["quantize"](zero, "e4m3", "tensor")
        assert s.item() == 1.0 and not q.float().any(), (
            "an all-zero tensor: s = 1 (not 0/448 = 0, then 0/0 = NaN), q = 0"
        )


def check_saturation(impl: Adapter) -> None:
    with course_lib_for(impl, "quantize", ("amax_per_group", "expand_scale")):
        for fmt, seed in (("e4m3", 4), ("e5m2", 5)):
            f = FORMATS[fmt]
            x = torch.randn(32, 256, generator=torch.Generator(device=GRADER).manual_seed(seed), device=GRADER)
            stale = x.abs().amax() / 4  # an earlier step's amax: a quarter of today's
            q, s = impl["quantize"](x, fmt, "tensor", amax=stale)
            want_s = stale.double() / f.max
            assert abs(s.item() - want_s.item()) <= 3 * U * want_s.item(), (
                f"{fmt}: with amax given, s = amax / max from that amax ({want_s.item():.4g}), got {s.item():.4g}"
            )
            qf = q.float()
            assert torch.isfinite(qf).all(), (
                f"{fmt}: with a scale from a smaller, earlier amax, x / s exceeds the max and the cast made "
                "inf or NaN: clamp x / s to [-fmt.max, fmt.max] before casting (saturation)"
            )
            over = (x / s).abs() > f.max
            assert over.any(), "grader: some values must overflow this scale"
            assert torch.equal(qf[over], f.max * x[over].sign()), (
                f"{fmt}: values beyond the max must saturate to ±{f.max:g} with their sign"
            )
            inside = ~over
            x_hat = qf * s
            bound = _roundtrip_bound(x.double(), s.double().expand_as(x), f)
            assert ((x_hat.double() - x.double()).abs() <= bound)[inside].all(), (
                f"{fmt}: values within range must still round to nearest: clamp, then cast"
            )


def _reference_amax(x: torch.Tensor, recipe: str, block: int) -> torch.Tensor:
    """Group by group, with loops: the amax of every tile or block (max is exact: no rounding)."""
    if recipe == "tensor":
        return x.abs().max()
    rows2 = x.reshape(-1, x.shape[-1])
    cols = x.shape[-1]
    bc = min(block, cols)
    br = 1 if recipe == "tile" else min(block, len(rows2))
    out = torch.empty(len(rows2) // br, cols // bc, device=x.device)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = rows2[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max()
    return out.reshape(*x.shape[:-1], cols // bc) if recipe == "tile" else out


AMAX_CASES = [  # (shape, recipe, expected scale shape)
    ((64, 256), "tensor", ()),
    ((2, 3, 384), "tile", (2, 3, 3)),
    ((8, 64), "tile", (8, 1)),  # a row shorter than 128 is one tile
    ((256, 384), "block", (2, 3)),
    ((64, 256), "block", (1, 2)),  # 64 rows: one block tall
]


def check_amax_per_group(impl: Adapter) -> None:
    amax_per_group = impl["amax_per_group"]
    for n, (shape, recipe, want_shape) in enumerate(AMAX_CASES):
        x = _data(shape, 20 + n, spread=1.0)
        got = amax_per_group(x, recipe, 128)
        want = _reference_amax(x, recipe, 128)
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == want_shape, (
            f"recipe {recipe!r} on x {shape}: the amax must be shaped {want_shape} (one per "
            f"{'tensor' if recipe == 'tensor' else '1 x 128 tile of each row' if recipe == 'tile' else '128 x 128 block'}); "
            f"got {tuple(getattr(got, 'shape', ()))}"
        )
        if not torch.equal(got, want):  # the max of absolute values is exact: no tolerance
            idx = tuple((got != want).nonzero()[0].tolist())
            raise AssertionError(
                f"recipe {recipe!r} on x {shape}: amax{list(idx)} is {got[idx].item():.4g}, the group's max |x| is "
                f"{want[idx].item():.4g}: reshape to [R/br, br, C/bc, bc] and reduce over br and bc"
            )
    for recipe, shape in (("tile", (8, 200)), ("block", (200, 256))):
        x = torch.ones(shape, device=GRADER)
        raises(
            ValueError,
            amax_per_group,
            x,
            recipe,
            128,
            what=f"recipe {recipe!r} on x {shape}, which 128 does not divide,",
        )


def _reference_expand(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    rows, cols = math.prod(shape[:-1]), shape[-1]
    s = scale.reshape(1, 1) if scale.dim() == 0 else scale.reshape(-1, scale.shape[-1])
    br, bc = rows // s.shape[0], cols // s.shape[1]
    out = torch.empty(rows, cols, device=scale.device)
    for i in range(rows):
        for j in range(0, cols, bc):
            out[i, j : j + bc] = s[i // br, j // bc]
    return out.reshape(shape)


EXPAND_CASES = [  # (scale shape, tensor shape, what it is)
    ((), (64, 256), "a per-tensor scale"),
    ((2, 3, 3), (2, 3, 384), "tile scales of a 3-D x"),
    ((256, 2), (256, 256), "tile scales"),
    ((2, 3), (256, 384), "block scales of W"),
    ((3, 2), (384, 256), "block scales of Wᵀ (transposed)"),
    ((3, 16), (384, 16), "tile scales of xᵀ (transposed: one per 128 x 1 column piece)"),
]


def check_expand_scale(impl: Adapter) -> None:
    for n, (scale_shape, shape, what) in enumerate(EXPAND_CASES):
        g = torch.Generator(device=GRADER).manual_seed(30 + n)
        scale = torch.rand(scale_shape, generator=g, device=GRADER) + 0.5
        got = impl["expand_scale"](scale, shape)
        want = _reference_expand(scale, shape)
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == shape, (
            f"{what}: expand_scale(scale {scale_shape}, {shape}) must have the tensor's shape {shape}"
        )
        assert torch.equal(got, want), (
            f"{what}: expand_scale(scale {scale_shape}, {shape}) puts a scale on the wrong elements: entry [i, j] "
            "covers rows i·br ... (i+1)·br - 1 and columns j·bc ... (j+1)·bc - 1 (repeat_interleave, both dimensions)"
        )


def check_outlier(impl: Adapter) -> None:
    """Quantize with the learner's groups and course_lib's scale and cast: the outlier's neighbours pay, no one else."""
    f = fp8.E4M3
    x = torch.randn(256, 256, generator=torch.Generator(device=GRADER).manual_seed(40), device=GRADER)
    x[3, 5] = 1e4 * x.abs().max()  # per tensor, everything else would fall below 448·2^-6 / 1e4: subnormal or 0
    for recipe, hit in (("tile", (slice(3, 4), slice(0, 128))), ("block", (slice(0, 128), slice(0, 128)))):
        s = fp8.scale_from_amax(impl["amax_per_group"](x, recipe, 128), f)
        s_full = impl["expand_scale"](s, x.shape)
        x_hat = (x / s_full).clamp(-f.max, f.max).to(f.dtype).float() * s_full
        rest = torch.ones_like(x, dtype=torch.bool)
        rest[hit] = False
        err = (x_hat - x).abs()
        # away from the outlier's group every scale is its own group's: the bound of round to nearest
        bound = _roundtrip_bound(x, fp8.expand_scale(fp8.scale_from_amax(fp8._amax(x, recipe, 128), f), x.shape), f)
        assert (err <= bound)[rest].all(), (
            f"recipe {recipe!r}: an outlier 10⁴ times the rest at [3, 5] damaged elements outside its own "
            f"{'1 x 128 tile' if recipe == 'tile' else '128 x 128 block'}: each group needs its own amax and scale"
        )


def _linear_case(impl: Adapter, recipe: str, seed: int):
    """The learner's FP8Linear [256 → 384] on x [4, 16, 256] and an upstream gradient; course_lib's references."""
    g = torch.Generator(device=GRADER).manual_seed(seed)
    k, n = 256, 384
    layer = impl["FP8Linear"](k, n, bias=True, recipe=recipe)
    assert isinstance(layer, nn.Module) and getattr(layer, "weight", None) is not None, (
        "FP8Linear must keep its weight as self.weight, an fp32 nn.Parameter [out, in] (given)"
    )
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g, device=GRADER) / k**0.5)
        layer.bias.copy_(torch.randn(n, generator=g, device=GRADER))
    x = torch.randn(4, 16, k, generator=g, device=GRADER).requires_grad_()
    upstream = torch.randn(4, 16, n, generator=g, device=GRADER) * 1e-3  # dL/dy: gradients are small
    y = layer(x)
    r = fp8.LINEAR_RECIPES[recipe]
    x_hat = fp8.dequantize(*fp8.quantize(x.detach().reshape(-1, k), "e4m3", r["x"])).double()
    w_hat = fp8.dequantize(*fp8.quantize(layer.weight.detach(), "e4m3", r["w"])).double()
    return layer, x, y, upstream, x_hat, w_hat, r


def _within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> float:
    """The largest |got - want| / tol: ≤ 1 passes."""
    return ((got.double() - want).abs() / tol).max().item()


def check_linear_forward(impl: Adapter) -> None:
    with course_lib_for(impl, "FP8Linear", tuple(LIBRARY)):
        for recipe, seed in (("tensor", 50), ("block", 51)):
            layer, x, y, _, x_hat, w_hat, r = _linear_case(impl, recipe, seed)
            assert isinstance(y, torch.Tensor) and y.shape == (4, 16, 384) and y.dtype == torch.float32, (
                f"recipe {recipe!r}: y must be [4, 16, 384] fp32 for x [4, 16, 256] (flatten x to [M, K], reshape back)"
            )
            assert y.requires_grad, "y must be part of the graph: _FP8LinearFunction.apply(x, weight, bias, ...)"
            b = layer.bias.detach().double()
            want = x_hat @ w_hat.T + b
            # K = 256 products summed in fp32 in any order: γ_K·Σ|x̂ ŵ|; scales applied to the operands
            # or to the sum: 2U more on each product; the bias: one addition, U. (K + 8)·U bounds it.
            tol = (256 + 8) * U * (x_hat.abs() @ w_hat.abs().T + b.abs())
            err = _within(y.detach().reshape(-1, 384), want, tol)
            if err > 1:
                alternatives = {
                    "x in fp32 (not quantized)": x.detach().reshape(-1, 256).double() @ w_hat.T + b,
                    "W in fp32 (not quantized)": x_hat @ layer.weight.detach().double().T + b,
                    "x per tensor (the block recipe's x is in 1 x 128 tiles)": fp8.dequantize(
                        *fp8.quantize(x.detach().reshape(-1, 256), "e4m3", "tensor")
                    ).double()
                    @ w_hat.T
                    + b,
                }
                hint = next(
                    (what for what, alt in alternatives.items() if _within(y.detach().reshape(-1, 384), alt, tol) <= 1),
                    f"quantize x with recipe {r['x']!r} and W with {r['w']!r}, both e4m3, then fp8_matmul, then + bias",
                )
                raise AssertionError(
                    f"recipe {recipe!r}: y differs from x̂ Ŵᵀ + b by {err:.3g} times the fp32 summation bound: {hint}"
                )


def check_linear_backward(impl: Adapter) -> None:
    with course_lib_for(impl, "FP8Linear", tuple(LIBRARY)):
        for recipe, seed in (("tensor", 60), ("block", 61)):
            layer, x, y, upstream, x_hat, w_hat, r = _linear_case(impl, recipe, seed)
            y.backward(upstream)
            g2 = upstream.reshape(-1, 384)
            g_hat = fp8.dequantize(*fp8.quantize(g2, "e5m2", r["grad"])).double()
            got = {"dx": x.grad, "dW": layer.weight.grad, "db": layer.bias.grad}
            for name, grad in got.items():
                assert grad is not None, f"recipe {recipe!r}: {name} is missing: backward must return dx, dW, db"
            dx, dw = got["dx"].reshape(-1, 256), got["dW"]
            assert got["dx"].shape == x.shape and dw.shape == layer.weight.shape, (
                "dx and dW must have x's and W's shapes"
            )
            # dx: N = 384 products per entry, dW: M = 64; each summed in fp32 (γ_n), the scales on the operands or
            # on the sum (2U per product): (n + 8)·U·Σ|terms|. db sums M = 64 fp32 values: (M + 1)·U·Σ|g|.
            checks = [
                ("dx", dx, g_hat @ w_hat, (384 + 8) * U * (g_hat.abs() @ w_hat.abs())),
                ("dW", dw, g_hat.T @ x_hat, (64 + 8) * U * (g_hat.abs().T @ x_hat.abs())),
                ("db", got["db"], g2.double().sum(0), (64 + 1) * U * g2.double().abs().sum(0)),
            ]
            g_e4m3 = fp8.dequantize(*fp8.quantize(g2, "e4m3", r["grad"])).double()
            hints = {
                "dx": [
                    ("the output gradient in e4m3 (it must be e5m2, grad_fmt)", g_e4m3 @ w_hat),
                    ("W in fp32 (use the saved Ŵ)", g_hat @ layer.weight.detach().double()),
                    ("the output gradient unquantized", g2.double() @ w_hat),
                ],
                "dW": [
                    ("the output gradient in e4m3 (it must be e5m2, grad_fmt)", g_e4m3.T @ x_hat),
                    (
                        "x in fp32 (use the saved x̂: the forward's FP8 values)",
                        g_hat.T @ x.detach().reshape(-1, 256).double(),
                    ),
                    ("the output gradient unquantized", g2.double().T @ x_hat),
                ],
                "db": [],
            }
            for name, grad, want, tol in checks:
                err = _within(grad, want, tol)
                if err > 1:
                    hint = next(
                        (
                            f"it matches one computed from {what}"
                            for what, alt in hints[name]
                            if _within(grad, alt, tol) <= 1
                        ),
                        "dx = ĝ Ŵ, dW = ĝᵀ x̂ with ĝ the e5m2 gradient and the forward's saved x̂, Ŵ; db = Σ_rows g",
                    )
                    raise AssertionError(
                        f"recipe {recipe!r}: {name} differs from the FP8 reference by {err:.3g} times the fp32 "
                        f"summation bound: {hint}"
                    )


class _TinyLM(nn.Module):
    """Next token from the last two: embeddings [2 × 64] → 128 → 256 → 256 → 16 logits (GeLU between)."""

    def __init__(self, n_symbols: int = 16, d: int = 64, hidden: int = 256):
        super().__init__()
        self.embed = nn.Embedding(n_symbols, d)
        self.fc1, self.fc2 = nn.Linear(2 * d, hidden), nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, n_symbols)  # DeepSeek-V3 keeps the output head in higher precision

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(self.embed(context).flatten(1))))))


TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR = 40, 512, 0.5
# Training: SGD with momentum 0.9 is linear in the gradients, so to first order each step's loss change
# is −lr·∇L·(its update) and inherits the update's relative error. The gradient of a weight leaves an
# FP8 layer as ĝᵀ x̂: an e5m2 and an e4m3 operand with independent zero-mean roundings, a relative error
# of about √(2^-6 + 2^-8) = 0.14 (tests/test_fp8.py, FP8Linear against fp32); fc1's gradient has come
# back through fc2's e5m2/e4m3 GEMM as well: √(0.14² + 0.14²) ≈ 0.2; bf16 (u = 2^-8) adds under 0.01.
# So the loss decrease of the FP8 run (first loss − mean of the last 5) is within 25 % of the bf16
# run's. Measured: within 1 %; an FP8 weight quantized once and never from the updated master copy
# keeps only a quarter of the decrease (off by 75 %).
TRAIN_RTOL = 0.25


def _train(make_linear, seed: int = 0, bf16: bool = False) -> list[float]:
    torch.manual_seed(seed)
    model = _TinyLM()
    if make_linear is not None:
        for name in ("fc1", "fc2"):
            old = getattr(model, name)
            new = make_linear(old.in_features, old.out_features)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.copy_(old.bias)
            setattr(model, name, new)
    stream = MarkovLanguage().sample(TRAIN_STEPS * TRAIN_BATCH + 2, seed=1)
    context, target = torch.stack([stream[:-2], stream[1:-1]], 1), stream[2:]
    opt = torch.optim.SGD(model.parameters(), lr=TRAIN_LR, momentum=0.9)
    losses = []
    for step in range(TRAIN_STEPS):
        batch = slice(step * TRAIN_BATCH, (step + 1) * TRAIN_BATCH)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(context[batch])
        loss = F.cross_entropy(logits.float(), target[batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_fp8_training(impl: Adapter) -> None:
    with course_lib_for(impl, "FP8Linear", tuple(LIBRARY)):
        ref = _train(None, bf16=True)
        ref_drop = ref[0] - sum(ref[-5:]) / 5
        assert ref_drop > 0.2, f"grader: the bf16 run must learn (its loss fell by {ref_drop:.3f})"
        for recipe in ("block", "tensor"):
            losses = _train(partial(impl["FP8Linear"], bias=True, recipe=recipe))
            assert all(math.isfinite(v) for v in losses), f"recipe {recipe!r}: the FP8 run's loss became NaN or inf"
            drop = losses[0] - sum(losses[-5:]) / 5
            assert abs(drop - ref_drop) <= TRAIN_RTOL * ref_drop, (
                f"recipe {recipe!r}: in {TRAIN_STEPS} SGD steps the FP8 model's loss fell by {drop:.3f} "
                f"({losses[0]:.3f} → {sum(losses[-5:]) / 5:.3f}), the bf16 model's by {ref_drop:.3f}: allowed ±"
                f"{TRAIN_RTOL:.0%}. Quantize the fp32 master weight afresh at every call, and return dW and db"
            )


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
