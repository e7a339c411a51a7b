"""Lecture 06's recomputation bytes on the device the code runs on (issue 28).

``course_lib.experiments.lecture06.recompute_memory`` runs where it is told (default: ``course_lib.dist.device()``, cuda:0
in a notebook on a GPU machine), and its byte model adds the device kernel's own extra: CUDA's fp32
SDPA kernel (memory-efficient attention) pads its log-sum-exp to 32 rows and returns two int64 RNG
scalars, where the CPU's kernel keeps a·s·b values exactly. No GPU here: the CUDA term's arithmetic
and its wiring into ``model_vs_measurement`` are checked with a stand-in measurement, and the CPU
results are checked to stay exactly what they were.
"""

import pytest
import torch

from course_lib.cost.activations import recompute_kernel_extra, recompute_peak_bytes, sdpa_extra_bytes
from course_lib.experiments.lecture06 import recompute_memory
from course_lib.model import configs

TINY = configs.get("tiny")
RNG_SCALARS = 2 * 8  # the seed and offset the CUDA kernel returns, int64 each


@pytest.mark.parametrize(("seq_len", "padded"), [(16, 32), (32, 32), (33, 64), (64, 64)])
def test_cuda_log_sum_exp_is_padded_to_32_rows(seq_len, padded):
    batch, a = 2, TINY.n_heads
    got = sdpa_extra_bytes(TINY, batch, seq_len, "flash", "cuda")
    assert got == 4 * a * batch * (padded - seq_len) + RNG_SCALARS, (
        f"s={seq_len}: CUDA's kernel keeps [b, a, ⌈s/32⌉·32] fp32 log-sum-exp values (here {padded} rows) "
        f"and two int64 scalars; the extra over the CPU's a·s·b should be {4 * a * batch * (padded - seq_len)} + 16, "
        f"got {got}"
    )


def test_the_cpu_and_the_math_kernel_add_nothing():
    assert sdpa_extra_bytes(TINY, 2, 16, "flash", "cpu") == 0
    assert sdpa_extra_bytes(TINY, 2, 16, "math", "cuda") == 0  # the math kernel is the same ops everywhere
    with pytest.raises(ValueError, match="measure it"):
        sdpa_extra_bytes(TINY, 2, 16, "flash", "mps")


def test_the_extra_counts_the_blocks_that_keep_the_kernel_outputs():
    one = sdpa_extra_bytes(TINY, 2, 16, "flash", "cuda")
    cfg = configs.get("tiny", n_layers=3)
    # "full" keeps only its input; "none" and "selective" keep o and the log-sum-exp; the peak adds the
    # last block's recomputed full set E, which always holds them
    assert recompute_kernel_extra(cfg, 2, 16, "none", device_type="cuda") == {"saved": 3 * one, "peak": 3 * one}
    assert recompute_kernel_extra(cfg, 2, 16, "full", device_type="cuda") == {"saved": 0, "peak": one}
    mixed = ["selective", "full", "none"]
    assert recompute_kernel_extra(cfg, 2, 16, mixed, device_type="cuda") == {"saved": 2 * one, "peak": 2 * one}
    assert recompute_kernel_extra(cfg, 2, 16, mixed, device_type="cpu") == {"saved": 0, "peak": 0}


def test_model_vs_measurement_adds_the_kernel_of_the_device_it_measured_on(monkeypatch):
    seen = []

    def stand_in(cfg, batch, seq_len, policy, attention, device=None):
        seen.append(device)
        return {"saved": 1, "peak": 2, "saved_hooks": 3}

    monkeypatch.setattr(recompute_memory, "measure_recompute", stand_in)
    rows = recompute_memory.model_vs_measurement(TINY, 2, 16, attention="flash", device="cuda")
    assert seen == [torch.device("cuda")] * 3, f"measure_recompute must run on the device asked for, got {seen}"
    for row in rows:
        model = recompute_peak_bytes(TINY, 2, 16, row["policy"], "flash")
        extra = recompute_kernel_extra(TINY, 2, 16, row["policy"], "flash", "cuda")
        assert row["model_saved"] == model["saved"] + extra["saved"]
        assert row["model_peak"] == model["peak"] + extra["peak"] > model["peak"]  # every peak holds one E
    assert [r["model_saved"] > recompute_peak_bytes(TINY, 2, 16, r["policy"])["saved"] for r in rows] == [
        r["policy"] != "full" for r in rows
    ], "the blocks that keep the attention kernel's outputs keep CUDA's extra too"


def test_build_honours_the_device_it_is_given():
    model = recompute_memory.build(TINY, "selective", device=torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_cpu_measurement_is_the_model_byte_for_byte():
    row = recompute_memory.model_vs_measurement(TINY, 2, 16, ("selective",), device="cpu")[0]
    assert (row["measured_saved"], row["measured_peak"]) == (row["model_saved"], row["model_peak"])
    model = recompute_peak_bytes(TINY, 2, 16, "selective")
    assert (row["model_saved"], row["model_peak"]) == (model["saved"], model["peak"]), "the CPU's numbers changed"
