"""Lab 08's Tasks 1 and 2: per-tensor scale, cast and dequantize; the fine-grained groups of DeepSeek-V3.

Graded here (lab08_fp8.py holds the task list): the learner's quantize and dequantize against the
round-to-nearest bound, saturation, the amax of every 1 x 128 tile and 128 x 128 block, every
element's scale (transposes included) and an outlier that costs only its own group. Each task on its
own: :func:`course_lib_for` puts course_lib's version of the other roles into the learner's module.

Tolerances are derived from the formats (course_lib.precision.formats): round to nearest in e4m3
errs by at most u = 2^-4 of the value, in e5m2 by 2^-3, and below the smallest normal by half the
subnormal spacing, 2^-(b+M) (2^-10 for e4m3, 2^-17 for e5m2), times the scale. fp32 arithmetic
around them adds multiples of U = 2^-24: a sum of n terms in any order is within γ_n·Σ|terms| of
the exact one, γ_n = nU/(1 - nU) (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1).
"""

import math
from contextlib import contextmanager

import torch

from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.precision import fp8_scaling

U = 2.0**-24  # unit roundoff of fp32
# Every check runs in the grader's own process, not on ranks: on the host, where the learner's functions
# and FP8Linear are called with the same numbers on every machine (and _train's autocast is the CPU's).
GRADER = torch.device("cpu")
FORMATS = {"e4m3": fp8_scaling.E4M3, "e5m2": fp8_scaling.E5M2}
# course_lib's implementation of each role, put in the learner's module while another role is graded
LIBRARY = {
    "quantize": fp8_scaling.quantize,
    "dequantize": fp8_scaling.dequantize,
    "amax_per_group": fp8_scaling._amax,
    "expand_scale": fp8_scaling.expand_scale,
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


def _check_quantized(impl: Adapter, x: torch.Tensor, fmt: str, recipe: str) -> None:
    """The learner's quantize and dequantize on x against the bound; the groups are course_lib's."""
    f = FORMATS[fmt]
    where = f"{fmt}, recipe {recipe!r}, x {tuple(x.shape)}"
    q, s = impl["quantize"](x, fmt, recipe)
    assert isinstance(q, torch.Tensor) and q.dtype == f.dtype and q.shape == x.shape, (
        f"{where}: q must be a {f.dtype} tensor of x's shape (cast with .to(fmt.dtype)); got "
        f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}"
    )
    amax = fp8_scaling._amax(x.float(), recipe, 128)
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
    top = fp8_scaling._amax(qf, recipe, 128)
    assert torch.equal(top[amax > 0], torch.full_like(top[amax > 0], f.max)), (
        f"{where}: the largest |q| of a group is {top.max().item():g}, not the format's max {f.max:g}: "
        "s = amax / max maps each group's amax onto the max (a scale of amax would map it onto 1)"
    )
    x_hat = impl["dequantize"](q, s)
    assert isinstance(x_hat, torch.Tensor) and x_hat.dtype == torch.float32 and x_hat.shape == x.shape, (
        f"{where}: dequantize must return fp32 values of q's shape"
    )
    s_full = fp8_scaling.expand_scale(s, x.shape)
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
    f = fp8_scaling.E4M3
    x = torch.randn(256, 256, generator=torch.Generator(device=GRADER).manual_seed(40), device=GRADER)
    x[3, 5] = 1e4 * x.abs().max()  # per tensor, everything else would fall below 448·2^-6 / 1e4: subnormal or 0
    for recipe, hit in (("tile", (slice(3, 4), slice(0, 128))), ("block", (slice(0, 128), slice(0, 128)))):
        s = fp8_scaling.scale_from_amax(impl["amax_per_group"](x, recipe, 128), f)
        s_full = impl["expand_scale"](s, x.shape)
        x_hat = (x / s_full).clamp(-f.max, f.max).to(f.dtype).float() * s_full
        rest = torch.ones_like(x, dtype=torch.bool)
        rest[hit] = False
        err = (x_hat - x).abs()
        # away from the outlier's group every scale is its own group's: the bound of round to nearest
        bound = _roundtrip_bound(
            x, fp8_scaling.expand_scale(fp8_scaling.scale_from_amax(fp8_scaling._amax(x, recipe, 128), f), x.shape), f
        )
        assert (err <= bound)[rest].all(), (
            f"recipe {recipe!r}: an outlier 10⁴ times the rest at [3, 5] damaged elements outside its own "
            f"{'1 x 128 tile' if recipe == 'tile' else '128 x 128 block'}: each group needs its own amax and scale"
        )
