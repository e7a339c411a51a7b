"""The step-time model (course_lib.cost.step_time): its GEMMs are the model's, its terms follow their
formulas, and with one fitted constant it predicts the published runs (course_lib.cost.published)."""

import dataclasses

import pytest

from course_lib.cost import published, step_time
from course_lib.cost.planner import Cluster, Layout, predict
from course_lib.model import configs

LLAMA, DSV3 = published.get("Llama 3 405B, 16,384 H100s, 8K"), published.get("DeepSeek-V3")


@pytest.mark.parametrize("name", ["llama-3.1-405b", "qwen2.5-72b", "deepseek-v3", "gpt-oss-120b"])
def test_the_gemms_of_a_layer_are_its_active_matmul_parameters(name):
    """Σ n·k·(times a token uses it) over layer_gemms = the layer's active parameters less its vector gains
    (two RMSNorms; MLA's norms of the compressed q and kv). A GEMM left out or counted twice shows here."""
    cfg = configs.get(name)
    for i in sorted({0, cfg.n_layers - 1, cfg.first_k_dense}):
        gains = 2 * cfg.d_model + (cfg.q_lora_rank + cfg.kv_lora_rank if cfg.is_mla else 0)
        counted = sum(n * k * times for _, n, k, times in step_time.layer_gemms(cfg, i))
        assert counted == cfg.layer_params(i, active=True) - gains, f"{name} layer {i}"


def test_a_gemm_takes_the_slower_of_its_compute_and_its_memory_traffic():
    peak, eta, bw = 1e15, 0.5, 1e12
    big = step_time._gemm_seconds(8192, 8192, 8192, peak, eta, bw, 2)
    assert big == pytest.approx(2 * 8192**3 / (peak * eta), rel=1e-12), "a square 8192 GEMM is compute-bound"
    vector = step_time._gemm_seconds(1, 8192, 8192, peak, eta, bw, 2)
    assert vector == pytest.approx(2 * (8192 + 8192**2 + 8192) / bw, rel=1e-12), "one row: memory-bound"


def test_no_input_is_an_end_to_end_efficiency():
    """Cluster has no MFU; its one efficiency is the GEMMs' η, and it scales the GEMM term alone."""
    fields = {f.name for f in dataclasses.fields(Cluster)}
    assert "mfu" not in fields and "gemm_efficiency" in fields
    cfg = configs.get(LLAMA.model)
    ly = LLAMA.layout()
    full, half = (
        step_time.rank_pass_seconds(cfg, LLAMA.cluster(eta), ly, range(8), LLAMA.seq_len)["parts"] for eta in (0.6, 0.3)
    )
    # all but k and v are compute-bound: 8 KV heads of 128 over tp = 8 leave them 128 columns, memory-bound
    assert half["gemm"] == pytest.approx(2 * full["gemm"], rel=0.01) and half["gemm"] < 2 * full["gemm"]
    assert half["memory"] == full["memory"] and half["tp"] == full["tp"]


def test_causal_attention_sees_half_the_keys_and_the_schedules_follow_their_formulas():
    cfg = configs.get(LLAMA.model)
    ly = LLAMA.layout()
    s, eta = 8192, step_time.GEMM_EFFICIENCY["H100"]
    got = step_time.rank_pass_seconds(cfg, LLAMA.cluster(), ly, [0], s)["parts"]["attention"]
    # QKᵀ and P·V forward: 2 · s queries · s/2 keys (the causal half) · H/tp heads · (d_qk + d_v), at η · bf16 peak
    flops = 2 * s * (s / 2) * cfg.n_heads / ly.tp * 2 * cfg.head_dim
    assert got == pytest.approx(flops / (eta * 989.4e12), rel=1e-9)
    one, two = (
        predict(cfg, LLAMA.cluster(), dataclasses.replace(ly, virtual_stages=v), LLAMA.global_batch, LLAMA.seq_len)
        for v in (1, 2)
    )
    assert two.seconds["bubble"] == pytest.approx(one.seconds["bubble"] / 2, rel=1e-9), "(p − 1)/(v·m): v = 2 halves it"
    assert two.seconds["compute"] == pytest.approx(one.seconds["compute"], rel=1e-12)


def test_the_published_runs_are_predicted_within_15_percent_with_the_fitted_efficiency():
    """The acceptance of the planner (BENCHMARKS.md shows the table): the stored η is the fit's, and every
    calibration run's predicted step time is within ±15% of what its paper's figure implies."""
    eta, errors = published.fit_efficiency(configs.get)
    assert eta == step_time.GEMM_EFFICIENCY["H100"], f"GEMM_EFFICIENCY is not the fit's {eta}: refit and store it"
    assert max(map(abs, errors)) <= 0.15, [f"{run.name}: {e:+.0%}" for run, e in zip(published.CALIBRATION, errors)]
    measured_one_gpu = {"bf16": 775 / 989.4, "fp8": 1410 / 1978.9}  # ./course gpu-check, one H100 (BENCHMARKS.md)
    assert eta < min(measured_one_gpu.values()), "at scale a GEMM sustains less than alone on one GPU"


def test_deepseek_v3_terms_against_the_measured_breakdown():
    """Zhao et al. (ISCA 2025) Table 4 splits DeepSeek-V3's 19.9 s step on 2,048 H800s: the overlapped
    1F1B phase 13.95 s; the DualPipe bubble 2.06 s; the phases that run one chunk alone (1F, 1B, 1W)
    1.13 + 1.99 + 0.48 s. The model's compute, bubble and exposed all-to-all land within 20% of each."""
    p = DSV3.predicted(configs.get(DSV3.model))
    assert p.seconds["compute"] == pytest.approx(13.95, rel=0.2)
    assert p.seconds["bubble"] == pytest.approx(2.06, rel=0.3)
    assert p.seconds["ep"] == pytest.approx(1.13 + 1.99 + 0.48, rel=0.2)


def test_unmeasured_parts_borrow_the_h100s_efficiency_and_say_so():
    assert step_time.efficiency("H800") == (step_time.GEMM_EFFICIENCY["H100"], True)
    assert step_time.efficiency("B200") == (step_time.GEMM_EFFICIENCY["H100"], False)
    with pytest.raises(ValueError, match="precision='fp16'"):
        Cluster("H100", 8, precision="fp16")
    with pytest.raises(ValueError, match="DualPipe needs an even number"):
        predict(configs.get("deepseek-v3"), Cluster("H800", 96), Layout(dp=32, pp=3, schedule="dualpipe"), 96, 4096)
