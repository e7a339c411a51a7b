"""Reproducibility (course_lib.experiments.lecture08.reproducibility): order effects in float32, exactness elsewhere,
seeds, and a deterministic mode that puts every setting back.

Nothing here compares digits across machines: each test compares runs on one machine with each
other, and float32 results with the error bound every order must respect.
"""

import os
import random

import pytest
import torch

from course_lib.experiments.lecture08 import reproducibility


def test_float32_sums_depend_on_the_order_exact_arithmetic_does_not():
    s = reproducibility.summation_orders(n=10_000, n_orders=8)
    assert len(set(s["float32"])) > 1, "8 orders of 10k float32 terms: the roundings cannot all agree"
    assert s["float32_repeat"] == s["float32"][0], "one order, summed twice: the same bits"
    assert len(set(s["float64"])) == 1 and s["float64"][0] == s["exact"], (
        "the terms are multiples of 2^-24 below 1: every partial sum is exact in float64, in any order"
    )
    assert set(s["int64"]) == {round(s["exact"] * 2**24)}, "integers add exactly in any order"
    for value in s["float32"]:  # Higham §4.2: |computed − exact| ≤ (n−1)·u·Σ|x|, whatever the order
        assert abs(value - s["exact"]) <= s["bound"], "a float32 sum broke the worst-case rounding bound"


def test_allreduce_algorithms_add_in_different_orders():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(4, 4096, generator=g)
    sums = reproducibility.allreduce_orders(grads)
    reference = grads.double().sum(0)
    # each element is 3 float32 additions of terms |g| < 6: error ≤ 3·u·Σ|g| (Higham §4.2), u = 2^-24
    bound = 3 * reproducibility.U32 * grads.abs().double().sum(0)
    for name, total in sums.items():
        assert ((total.double() - reference).abs() <= bound).all(), f"{name}: outside the rounding bound"
    differ = (sums["ring"] != sums["rank order"]).float().mean().item()
    assert 0.05 < differ, f"ring vs rank order differ in {differ:.0%} of elements; expected a sizeable share"
    exact = reproducibility.allreduce_orders((grads * 2**20).round().double())  # integers: exact in float64
    assert torch.equal(exact["ring"], exact["tree"]) and torch.equal(exact["ring"], exact["rank order"])
    with pytest.raises(ValueError, match="world_size"):
        reproducibility.allreduce_orders(torch.zeros(1, 8))


def test_the_same_seeds_repeat_a_run_bit_for_bit_and_either_seed_changes_it():
    first = reproducibility.seeded_losses(seed=0, data_seed=0, steps=10)
    assert torch.equal(first, reproducibility.seeded_losses(seed=0, data_seed=0, steps=10)), (
        "same model seed, same data seed, same machine: the losses must be identical to the bit"
    )
    assert not torch.equal(first, reproducibility.seeded_losses(seed=1, data_seed=0, steps=10)), "another init"
    assert not torch.equal(first, reproducibility.seeded_losses(seed=0, data_seed=1, steps=10)), "other batches"


def test_deterministic_mode_sets_everything_and_puts_it_back():
    before = reproducibility.precision_flags()
    env_before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    torch.manual_seed(123)
    random.seed(7)
    expected_torch, expected_py = torch.rand(3), random.random()
    torch.manual_seed(123)
    random.seed(7)
    with reproducibility.deterministic_mode(seed=5):
        inside = reproducibility.precision_flags()
        drawn = torch.rand(3)
        torch.manual_seed(5)
        assert torch.equal(drawn, torch.rand(3)), "the block starts from torch.manual_seed(seed)"
    assert inside["deterministic_algorithms"] and inside["cudnn.deterministic"] and not inside["cudnn.benchmark"]
    assert inside["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    fp32 = {k: v for k, v in inside.items() if k.endswith("fp32_precision") or k.endswith("allow_tf32")}
    assert fp32 and all(v in ("ieee", False) for v in fp32.values()), f"TF32/bf16 shortcuts must be off: {fp32}"
    assert reproducibility.precision_flags() == before, "every flag is restored on exit"
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == env_before
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py, (
        "after the block the RNGs continue as if it had never run"
    )


def test_deterministic_mode_restores_even_when_the_block_raises():
    before = reproducibility.precision_flags()
    with pytest.raises(RuntimeError, match="boom"), reproducibility.deterministic_mode():
        raise RuntimeError("boom")
    assert reproducibility.precision_flags() == before


def test_on_cpu_the_tf32_setting_changes_nothing_and_tf32_is_emulated():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g)
    exact = a.double() @ b.double()
    plain = a @ b
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # "TF32 allowed": no CPU has TF32 units
        assert torch.equal(a @ b, plain), "TF32 is a GPU tensor-core format; a CPU matmul must not change"
    finally:
        torch.set_float32_matmul_precision(saved)
    tf32 = reproducibility.tf32_matmul(a, b)
    scale = (a.abs().double() @ b.abs().double()).max().item()
    # inputs rounded to 10 mantissa bits: product error ≤ (2·2^-11 + 2^-22)·Σ|a||b|, plus fp32 accumulation
    assert (tf32.double() - exact).abs().max().item() <= (2 * 2**-11 + 128 * 2**-24) * scale
    assert (tf32.double() - exact).abs().max().item() > 20 * (plain.double() - exact).abs().max().item(), (
        "TF32 loses ~13 bits of every input: its error must dwarf fp32's"
    )
