"""course_lib.cost.flops against measurement: the 6N + 12·L·H·Q·T rule against the matmul FLOPs that
torch's FlopCounterMode counts in a real forward + backward of the course model, and the arithmetic
intensity formula against a counted matmul and the bytes of its tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.cost import flops, hardware, roofline
from course_lib.measure.flop_counter import count_training_flops
from course_lib.model import configs
from course_lib.model.transformer import Transformer

VARIANTS = {
    "tiny": {},
    "tiny, multi-query, tied embeddings, 1 layer": {"n_kv_heads": 1, "tie_embeddings": True, "n_layers": 1},
    "tiny, multi-head attention, 3 layers": {"n_kv_heads": 4, "n_layers": 3},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seq_len", [64, 24])
def test_training_flops_formula_equals_the_counted_matmuls(variant, seq_len):
    """Tolerance 0: FlopCounterMode counts each mm/bmm as 2·m·n·k from its shapes, the formula
    counts the same matmuls (6 per weight per token, 12·H·Q·T per layer per token for attention),
    and both are integers. Elementwise work is in neither."""
    cfg = configs.get("tiny", **VARIANTS[variant])
    torch.manual_seed(0)
    model = Transformer(cfg)
    batch = 2
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    counted = count_training_flops(model, tokens, tokens)
    predicted = flops.train_flops_per_token(cfg, seq_len) * batch * seq_len
    assert sum(counted.values()) == predicted, (
        f"{variant}, T={seq_len}: FlopCounterMode counted {counted}, the formula 6N + 12·L·H·Q·T gives "
        f"{predicted}; look at matmul_params (which matrices does one token multiply with?) and the "
        f"attention term"
    )
    # The weights' matmuls are mm, the attention's bmm: each half of the formula on its own.
    assert counted["mm"] == 6 * flops.matmul_params(cfg) * batch * seq_len, "6N: the weight matmuls"
    assert counted["bmm"] == flops.attention_flops_per_token(cfg, seq_len) * batch * seq_len, "attention matmuls"


def test_matmul_params_is_n_active_minus_the_norm_gains():
    cfg = configs.get("tiny")
    model = Transformer(cfg)
    in_matmuls = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in name)
    assert flops.matmul_params(cfg) == in_matmuls == 102_400


def test_attention_term_is_palm_s_and_twice_kaplan_s():
    cfg = configs.get("llama-3.1-405b")
    L, H, Q, T = cfg.n_layers, cfg.n_heads, cfg.head_dim, 8192
    assert flops.attention_flops_per_token(cfg, T) == 12 * L * H * Q * T, "PaLM, Appendix B: 12·L·H·Q·T"
    kaplan = 6 * L * T * H * Q  # Kaplan et al. 2020 Table 1 counts only the QKᵀ scores
    assert flops.attention_flops_per_token(cfg, T) == 2 * kaplan
    assert flops.train_flops_per_token(cfg, T, attention=False) == 6 * flops.matmul_params(cfg)
    # For a 405B model at 8k context the attention matmuls add about 10% to 6N.
    assert 0.05 < flops.attention_flops_per_token(cfg, T) / (6 * flops.matmul_params(cfg)) < 0.15


def test_sliding_and_linear_layers_see_fewer_keys():
    gpt = configs.get("gpt-oss-20b")  # alternating sliding (128 keys) and full layers
    full = sum(kind == "full" for kind in gpt.layer_types)
    sliding = gpt.n_layers - full
    per_key = 6 * gpt.n_heads * 2 * gpt.head_dim
    assert flops.attention_flops_per_token(gpt, 4096) == per_key * (full * 4096 + sliding * gpt.sliding_window)
    qwen = configs.get("qwen3-next-80b-a3b")  # Gated DeltaNet layers have no T × T term
    full = sum(kind == "full" for kind in qwen.layer_types)
    assert flops.attention_flops_per_token(qwen, 1000) == 6 * qwen.n_heads * 2 * qwen.head_dim * 1000 * full


def test_mfu_is_achieved_over_peak():
    # PaLM 540B (Chowdhery et al. 2022, §4.1): 238.3k tokens/s on 6144 TPU v4 chips of 275 TFLOP/s
    # (bf16), 6N + attention ≈ 6·540.35e9·(1 + small) FLOPs per token -> MFU 46.2%. 6N alone gives 45%.
    six_n = 6 * 540.35e9
    assert flops.mfu(238.3e3, six_n, 6144 * 275e12) == pytest.approx(0.4571, abs=1e-3)
    with pytest.raises(ValueError, match="peak"):
        flops.mfu(1.0, 1.0, 0.0)


@pytest.mark.parametrize("m, n, k", [(64, 64, 64), (2048, 192, 64), (1, 4096, 4096), (130, 4096, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_arithmetic_intensity_equals_counted_flops_over_tensor_bytes(m, n, k, dtype):
    a, b = torch.ones(m, k, dtype=dtype), torch.ones(k, n, dtype=dtype)
    with FlopCounterMode(display=False) as counter:
        c = a @ b
    moved = a.nbytes + b.nbytes + c.nbytes  # read A and B once, write C once
    assert counter.get_total_flops() == flops.matmul_flops(m, n, k)
    assert flops.arithmetic_intensity(m, n, k, a.element_size()) == counter.get_total_flops() / moved


def test_intensity_limits_and_the_ridge_point():
    # Square matmuls: n/6 FLOP/byte in fp32, n/3 in bf16 (up to rounding of the division).
    assert flops.arithmetic_intensity(4096, 4096, 4096, 4) == pytest.approx(4096 / 6, rel=1e-12)
    assert flops.arithmetic_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3, rel=1e-12)
    # A matrix-vector product tends to 2 / bytes_per_element FLOP/byte: 1 in bf16.
    assert math.isclose(flops.arithmetic_intensity(1, 8192, 8192, 2), 1.0, rel_tol=1e-3)
    # The H100's figures come from the one table (course_lib.cost.hardware), never typed here.
    peak, bandwidth = hardware.H100.peak_flops("bf16"), hardware.H100.hbm_bytes_per_s.value
    ridge = roofline.ridge_point(peak, bandwidth)
    assert 290 < ridge < 300, "H100 SXM: 989.4 TFLOP/s dense bf16 over 3.35 TB/s is about 295 FLOP/byte"
    assert roofline.roofline_flops(1.0, peak, bandwidth) == bandwidth, "1 FLOP/byte: the memory roof, 1 x bandwidth"
    assert roofline.roofline_flops(1e4, peak, bandwidth) == peak, "far right of the ridge: the compute roof"
    with pytest.raises(ValueError):
        flops.arithmetic_intensity(0, 1, 1, 2)
