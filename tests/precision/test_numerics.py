"""course_lib.precision.formats: format table vs torch.finfo and vs rounding, fp4 emulation, loss scaling."""

import math

import pytest
import torch
import torch.nn as nn

from course_lib.cost import alignment
from course_lib.precision import formats as numerics
from course_lib.precision import scaling
from course_lib.precision.formats import FORMATS
from course_lib.precision.scaling import DynamicLossScaler

TORCH_FORMATS = [n for n, f in FORMATS.items() if f.dtype is not None]
LOW_PRECISION = [n for n in FORMATS if n != "fp32"]


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_bit_layout_formulas_reproduce_torch_finfo(name):
    f, fi = FORMATS[name], torch.finfo(FORMATS[name].dtype)
    assert f.bits == fi.bits
    assert (f.max, f.eps, f.smallest_normal) == (fi.max, fi.eps, fi.smallest_normal), (
        f"{name}: the layout (E={f.exponent_bits}, M={f.mantissa_bits}, bias={f.bias}, {f.specials}) gives "
        f"max {f.max}, eps {f.eps}, tiny {f.smallest_normal}; torch.finfo says {fi.max}, {fi.eps}, {fi.tiny}"
    )
    row = numerics.format_table([name])[0]
    assert row["source"] == "torch.finfo" and row["max"] == fi.max and row["eps"] == fi.eps


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_table_agrees_with_values_measured_by_rounding(name):
    row = numerics.format_table([name])[0]
    rnd = lambda v: numerics.round_to_format(torch.tensor([v], dtype=torch.float64), name).item()
    eps, sub, mx = row["eps"], row["smallest_subnormal"], row["max"]
    assert rnd(1 + eps) == 1 + eps and rnd(1 + eps / 2) == 1.0 and rnd(1 + 0.75 * eps) == 1 + eps, (
        f"{name}: eps is the gap above 1 (1 + eps/2 is a tie and rounds to even, i.e. to 1)"
    )
    assert rnd(sub) == sub and rnd(sub / 2) == 0.0 and rnd(0.75 * sub) == sub, (
        f"{name}: {sub} must be the smallest positive value (half of it ties to 0)"
    )
    assert rnd(mx) == mx
    above = rnd(mx * (1 + eps))
    if FORMATS[name].specials == "ieee":
        assert above == math.inf, f"{name}: above max an IEEE format overflows to inf"
    else:
        assert above == mx, f"{name}: no inf, so values above max saturate to max"
    assert numerics.representable_values(name)[-1].item() == mx
    assert numerics.representable_values(name)[1].item() == sub


def test_fp4_e2m1_from_its_bit_layout():
    row = numerics.format_table(["fp4_e2m1"])[0]
    assert row["source"] == "bit layout"
    assert (row["max"], row["smallest_normal"], row["smallest_subnormal"], row["eps"]) == (6.0, 1.0, 0.5, 0.5)
    assert numerics.representable_values("fp4_e2m1").tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6], (
        "the OCP Microscaling spec lists E2M1's magnitudes as 0, 0.5, 1, 1.5, 2, 3, 4, 6"
    )
    x = torch.tensor([0.2, 0.25, 0.3, 1.25, 1.3, 2.5, 3.5, 5.0, 5.1, 100.0, -0.74, -0.76])
    assert numerics.round_to_format(x, "fp4_e2m1").tolist() == [0, 0, 0.5, 1, 1.5, 2, 4, 4, 6, 6, -0.5, -1], (
        "nearest value, ties to the even mantissa, saturation at ±6"
    )


@pytest.mark.parametrize("name", [n for n in TORCH_FORMATS if n != "fp32"])
def test_emulated_rounding_equals_torch_casts(name):
    """The emulation that fp4 relies on must reproduce torch's casts exactly where torch has the format."""
    f = FORMATS[name]
    g = torch.Generator().manual_seed(0)
    lo, hi = math.log2(f.smallest_subnormal) - 2, math.log2(f.max) + 1
    x = torch.exp2(lo + (hi - lo) * torch.rand(50_000, generator=g, dtype=torch.float64)).float()
    x = x * (torch.randint(0, 2, x.shape, generator=g) * 2 - 1)
    grid = numerics.representable_values(name, positive_only=False)
    midpoints = ((grid[1:] + grid[:-1]) / 2).float()  # the ties: ties-to-even decides them
    x = torch.cat([x, grid.float(), midpoints, torch.tensor([math.inf, -math.inf, 0.0])])
    torch_cast, emulated = numerics.round_to_format(x, name), numerics.round_to_format(x, name, emulate=True)
    bad = torch_cast != emulated
    assert not bad.any(), (
        f"{name}: emulation differs from torch's cast at {x[bad][:4].tolist()}: torch "
        f"{torch_cast[bad][:4].tolist()}, emulated {emulated[bad][:4].tolist()}"
    )


@pytest.mark.parametrize("name", list(FORMATS))
def test_measured_relative_error_within_unit_roundoff(name):
    r = numerics.relative_rounding_error(name, n=50_000, seed=1)
    u = FORMATS[name].unit_roundoff
    assert r["bound"] == u == 2.0 ** -(FORMATS[name].mantissa_bits + 1)
    assert r["max"] <= r["tight_bound"] <= u, f"{name}: round-to-nearest error {r['max']:.3g} exceeds u/(1+u)"
    assert r["max"] > 0.97 * r["tight_bound"], f"{name}: the bound should be nearly reached by 50k samples"
    assert 0.2 * u < r["mean"] < 0.6 * u, f"{name}: mean relative error {r['mean']:.3g} is implausible for u={u:.3g}"


def test_bad_format_names_are_explained():
    with pytest.raises(ValueError, match="choose one of"):
        numerics.round_to_format(torch.zeros(1), "fp6")
    with pytest.raises(ValueError, match="no NaN"):
        numerics.round_to_format(torch.tensor([math.nan]), "fp4_e2m1")
    with pytest.raises(ValueError, match="16 bits or fewer"):
        numerics.representable_values("fp32")


# ---- dynamic loss scaling ---------------------------------------------------------------------------


def _run_scaler(scaler, inf_steps, n_steps=12):
    """Tiny regression where the gradient of chosen steps is poisoned with inf."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    scales, stepped, params = [], [], []
    for step in range(n_steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if step in inf_steps:
            loss = loss * torch.tensor(math.inf)  # what an fp16 overflow in backward looks like
        scaler.scale(loss).backward()
        before = model.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        stepped.append(not torch.equal(before, model.weight.detach()))
        scales.append(float(scaler.get_scale()))
        params.append(model.weight.detach().clone())
    return scales, stepped, params


def test_loss_scaler_matches_torch_gradscaler():
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = _run_scaler(DynamicLossScaler(**kw), inf_steps={2, 3, 9})
    theirs = _run_scaler(torch.amp.GradScaler("cpu", **kw), inf_steps={2, 3, 9})
    assert ours[0] == theirs[0], f"scale after each step: ours {ours[0]}, GradScaler {theirs[0]}"
    assert ours[1] == theirs[1], "the same steps must be skipped"
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2])), "unscaled updates must be bit-equal"


def test_loss_scaler_state_machine():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    scales, stepped, _ = _run_scaler(scaler, inf_steps={2, 3, 9})
    # 0,1 clean; 2,3 overflow (halve twice, count reset); 4,5,6 clean -> grow at 6; 7,8 clean; 9 overflow; 10,11 clean
    assert stepped == [True, True, False, False, True, True, True, True, True, False, True, True], (
        "an overflowing step must leave the weights untouched"
    )
    assert scales == [1024, 1024, 512, 256, 256, 256, 512, 512, 512, 256, 256, 256], (
        "overflow halves the scale at once; growth needs growth_interval clean steps in a row"
    )
    assert [h["action"] for h in scaler.history][:3] == ["step", "step", "overflow: skip step, back off"]


def test_loss_scaler_misuse_is_explained():
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="before step"):
        scaler.update()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="twice"):
        scaler.unscale_(opt)
    with pytest.raises(ValueError, match="growth_factor > 1"):
        DynamicLossScaler(growth_factor=0.5)


def test_unscaled_gradients_are_exact():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([3e-8, 1.0, 7.5]) * 2.0**16
    scaling.DynamicLossScaler().unscale_(torch.optim.SGD([p], lr=1.0))
    assert torch.equal(p.grad, torch.tensor([3e-8, 1.0, 7.5])), "dividing by a power of two is exact"


# ---- shape alignment --------------------------------------------------------------------------------


def test_tile_utilisation():
    assert alignment.pad_to_multiple(4095, 8) == 4096 and alignment.pad_to_multiple(64, 8) == 64
    assert alignment.tile_utilisation(4096, 4096, 4096) == 1.0
    assert alignment.tile_utilisation(4097, 4096, 4096) == pytest.approx(4097 / (4096 + 128))
    assert alignment.tile_utilisation(100, 100, 100, tile=(16, 16, 16)) == pytest.approx(1e6 / 112**3)
