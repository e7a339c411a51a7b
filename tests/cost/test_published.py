"""The published runs: layouts that add up, and the step times their papers' figures imply."""

import pytest

from course_lib.cost import hardware, published
from course_lib.model import configs


def test_every_run_names_a_known_model_and_accelerator_and_its_source():
    for run in published.RUNS:
        configs.get(run.model)
        hardware.get(run.accelerator)
        assert run.source and ("Table" in run.source or "§" in run.source), run.name


@pytest.mark.parametrize(
    "start, seconds",
    [
        # Table 4: dp × batch per DP group × sequence = 16M tokens a step, at 430, 400 and 380 TFLOP/s per GPU
        ("Llama 3 405B, 8,192", 12.5),
        ("Llama 3 405B, 16,384 H100s, 8K", 6.7),
        ("Llama 3 405B, 16,384 H100s, 128K", 15.3),
        # Table 1: 180K H800 GPU-hours per 10^12 tokens, 15,360 x 4,096 tokens a step, 2,048 GPUs
        ("DeepSeek-V3", 19.9),
    ],
)
def test_published_step_seconds(start, seconds):
    """The step times lecture 04 derives by hand (Llama 3) and the GPU-hours figure gives (DeepSeek-V3),
    to the 0.05 s they are printed with."""
    run = published.get(start)
    assert run.step_seconds(configs.get(run.model)) == pytest.approx(seconds, abs=0.05)


def test_every_llama_row_steps_16m_tokens():
    for run in published.RUNS[:3]:
        assert run.tokens_per_step == 16 * 2**20, run.name


def test_deepseek_v3_implied_flop_rate_matches_the_hardware_paper():
    """Two sources, one check: the GPU-hours of the V3 report, through the course's FLOP count, give
    434 TFLOP/s per GPU; Zhao et al. (ISCA 2025, Table 4) measured 432 non-causal on the same cluster.
    1% covers their rounding and the step's non-matmul work, which neither count includes."""
    run = published.get("DeepSeek-V3")
    assert run.tflops_per_gpu(configs.get(run.model)) == pytest.approx(432, rel=0.01)


def test_a_layout_that_does_not_multiply_to_the_gpus_is_refused():
    run = published.get("DeepSeek-V3")
    with pytest.raises(ValueError, match="2048 GPUs"):
        published.PublishedRun(**{**run.__dict__, "dp": 64})
    with pytest.raises(KeyError, match="matches 3"):
        published.get("Llama")
