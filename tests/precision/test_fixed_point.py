"""course_lib.precision.fixed_point: the grid, the two roundings, exact integer GEMMs, and the worked
example of lecture 05 (round to nearest stalls a fixed-point SGD, stochastic rounding does not)."""

import pytest
import torch

from course_lib.experiments.lecture05.fixed_point_regression import train_regression
from course_lib.precision.fixed_point import from_fixed, int8_matmul, to_fixed, ulp


def test_nearest_rounding_is_within_half_an_ulp_and_saturates():
    x = torch.linspace(-3, 3, 1001)
    q = to_fixed(x, 8, bits=16)
    assert q.dtype == torch.int16
    assert (from_fixed(q, 8) - x).abs().max() <= ulp(8) / 2, "round to nearest is off by at most half the grid spacing"
    big = to_fixed(torch.tensor([1e6, -1e6]), 8, bits=16)
    assert big.tolist() == [32767, -32768], "values beyond the range saturate at the integer limits"


def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 0.3 * ulp(4))  # 0.3 of an ulp: nearest always gives 0
    assert to_fixed(x, 4).eq(0).all()
    mean = from_fixed(to_fixed(x, 4, rounding="stochastic", generator=g), 4).mean().item()
    # a Bernoulli(0.3) mean over n = 2e5 draws has standard deviation sqrt(0.21 / n) ≈ 1.0e-3 ulp:
    # 5 of them (5e-3 ulp) fails once in ~3.5 million runs; rounding to nearest would be off by 0.3 ulp
    assert abs(mean / ulp(4) - 0.3) < 5e-3, f"E[stochastic round(x)] should be x: got {mean / ulp(4):.4f} ulp for 0.3"


def test_int8_gemm_with_int32_accumulation_is_exact():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (8, 1000), dtype=torch.int8, generator=g)
    b = torch.randint(-128, 128, (1000, 6), dtype=torch.int8, generator=g)
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.double(), a.double() @ b.double()), "int8 products summed in int32 are exact integers"
    with pytest.raises(TypeError, match="int8 operands"):
        int8_matmul(a.float(), b)


def test_round_to_nearest_stalls_fixed_point_sgd_and_stochastic_rounding_does_not():
    nearest = train_regression("nearest")
    stochastic = train_regression("stochastic")
    # Nearest: once every |lr · gradient| < ulp/2 = 2^-9 the weights never change again (exactly)
    assert all(torch.equal(w, nearest["weights"][-1]) for w in nearest["weights"][-100:]), (
        "with round to nearest, the last 100 updates should all round back to the same weights"
    )
    # Measured (any CPU): nearest stalls at MSE 0.124, stochastic reaches 5.6e-4, the float optimum is 0.
    # A factor 10 apart is far from both; a stochastic rounding that was biased would stall like nearest.
    assert stochastic["loss"][-1] < nearest["loss"][-1] / 10, (
        f"final MSE: nearest {nearest['loss'][-1]:.4f}, stochastic {stochastic['loss'][-1]:.4f}: small updates "
        "rounded stochastically should keep the weights moving on average"
    )
