"""Multi-head latent attention: its parameters are what ModelConfig counts, its cache holds only the
latent and the RoPE key, and attending through the cache equals attending over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from course_lib.model import configs
from course_lib.model.layers import rope_cos_sin
from course_lib.model.mla import MLA, LatentCache

MLA_FIELDS = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_parameters_are_what_the_config_counts(q_lora_rank):
    cfg = configs.get("tiny", q_lora_rank=q_lora_rank, **MLA_FIELDS)
    layer = MLA(cfg)
    d = cfg.d_model  # a block = two norms + attention + the dense SwiGLU
    assert sum(p.numel() for p in layer.parameters()) == cfg.layer_params(0) - 2 * d - 3 * d * cfg.d_ff


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_cache_holds_latent_and_rope_key_and_changes_nothing(q_lora_rank):
    cfg = configs.get("tiny", q_lora_rank=q_lora_rank, **MLA_FIELDS)
    torch.manual_seed(0)
    layer = MLA(cfg)
    x = torch.randn(2, 12, cfg.d_model)
    cos, sin = rope_cos_sin(12, cfg.qk_rope_head_dim, cfg.rope_theta)
    whole = layer(x, cos, sin)
    cache = LatentCache()
    parts = [layer(x[:, :5], cos[:5], sin[:5], cache)]  # prefill 5 tokens, then decode one at a time
    for i in range(5, 12):
        parts.append(layer(x[:, i : i + 1], cos[i : i + 1], sin[i : i + 1], cache))
    stepped = torch.cat(parts, dim=1)
    # the same products, summed over a different number of keys per call (masked ones are zeros in
    # the full run): fp32 reordering over <= 12 keys, bounded by 1e-5 of the largest output
    assert (stepped - whole).abs().max() <= 1e-5 * whole.abs().max(), "attention through the cache must not change"
    per_token = cfg.kv_cache_bytes_per_token(4) // cfg.n_layers  # fp32 here
    assert cache.nbytes() == 2 * 12 * per_token, f"cache {cache.nbytes()} B; (rkv + dr) x 4 B per token = {per_token}"
    assert per_token == (32 + 8) * 4
