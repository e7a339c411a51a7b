"""ModelConfig: the published architectures must reproduce their published headline numbers.

A config whose parameter count misses its model card by more than a few percent has a wrong field
(a head count, an expert width, a forgotten shared expert), and every cost estimate built on it in
later chapters would inherit the error. So each test compares against a figure with its source.
"""

import dataclasses

import pytest
import torch

from course_lib.model import configs, tokenizer
from course_lib.model.config import ModelConfig

B = 1e9

# name, published total, tolerance, where the figure comes from
TOTALS = [
    ("deepseek-v3", 671 * B, 0.03, "DeepSeek-V3 Technical Report, abstract: 671B total parameters"),
    ("qwen2.5-72b", 72.7 * B, 0.03, "Qwen2.5-72B model card: 72.7B parameters"),
    ("llama-3.1-405b", 405 * B, 0.03, "Llama 3 Herd of Models, Table 3: 405B"),
    (
        "gpt-oss-120b",
        116.83 * B,
        0.03,
        "gpt-oss model card Table 1: 116.83B total (OpenAI, Introducing gpt-oss: ~117B)",
    ),
    ("gpt-oss-20b", 20.91 * B, 0.03, "gpt-oss model card Table 1: 20.91B total (OpenAI, Introducing gpt-oss: ~21B)"),
    (
        "qwen3-next-80b-a3b",
        80 * B,
        0.03,
        "Qwen3-Next model card: 80B in total (NVIDIA Developer Blog on Qwen3-Next: 80B)",
    ),
]

ACTIVE = [
    ("deepseek-v3", 37 * B, 0.03, "DeepSeek-V3 Technical Report, abstract: 37B activated per token"),
    ("gpt-oss-120b", 5.13 * B, 0.03, "gpt-oss model card Table 1: 5.13B active (OpenAI, Introducing gpt-oss: ~5.1B)"),
    ("gpt-oss-20b", 3.61 * B, 0.03, "gpt-oss model card Table 1: 3.61B active (OpenAI, Introducing gpt-oss: ~3.6B)"),
    # "A3B" is a rounded name and the card gives no finer figure. Our count is 3.56B (3.25B without
    # the output head): attention 1.54B (36 Gated DeltaNet + 12 gated-attention layers), 10 routed +
    # 1 shared expert 1.66B, routers 0.05B, output head 0.31B. transformers' own Qwen3-Next, counted
    # below (test_counts_equal_transformers_implementation), gives the same active total, so no
    # field is missing: "3B" cannot be a tight count. This row only guards the order of magnitude.
    ("qwen3-next-80b-a3b", 3 * B, 0.20, "Qwen3-Next model card: 3B activated (a rounded name)"),
]


def _rel(ours: float, published: float) -> float:
    return abs(ours - published) / published


@pytest.mark.parametrize("name, published, tol, source", TOTALS, ids=[t[0] for t in TOTALS])
def test_total_parameters_match_published(name, published, tol, source):
    ours = configs.get(name).n_params()
    assert _rel(ours, published) < tol, (
        f"{name}: n_params() = {ours / B:.2f}B but {source}; off by {_rel(ours, published):.1%} "
        f"(tolerance {tol:.0%}). Check the config's layer, head and expert sizes against its config.json."
    )


@pytest.mark.parametrize("name, published, tol, source", ACTIVE, ids=[a[0] for a in ACTIVE])
def test_active_parameters_match_published(name, published, tol, source):
    ours = configs.get(name).n_active_params()
    assert _rel(ours, published) < tol, (
        f"{name}: n_active_params() = {ours / B:.2f}B but {source}; off by {_rel(ours, published):.1%} "
        f"(tolerance {tol:.0%}). Active = shared experts + top-k routed experts + attention + output head."
    )


def _hf_config(name: str):
    """The published config as transformers' own config class, built here from our fields (offline)."""
    import transformers as hf  # heavy; only these tests need it

    c = configs.get(name)
    common = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        intermediate_size=c.d_ff,
        tie_word_embeddings=c.tie_embeddings,
    )
    moe = dict(num_experts_per_tok=c.n_activated_experts)
    if name == "deepseek-v3":
        mla = {f: getattr(c, f) for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")}
        return hf.DeepseekV3Config(
            **common,
            **moe,
            **mla,
            v_head_dim=c.v_head_dim,
            moe_intermediate_size=c.moe_d_ff,
            n_shared_experts=c.n_shared_experts,
            n_routed_experts=c.n_routed_experts,
            first_k_dense_replace=c.first_k_dense,
        )
    if name.startswith("gpt-oss"):
        return hf.GptOssConfig(
            **common, **moe, head_dim=c.head_dim, num_local_experts=c.n_routed_experts, sliding_window=c.sliding_window
        )
    if name.startswith("qwen3-next"):
        return hf.Qwen3NextConfig(
            **common,
            **moe,
            head_dim=c.head_dim,
            num_experts=c.n_routed_experts,
            moe_intermediate_size=c.moe_d_ff,
            shared_expert_intermediate_size=c.moe_d_ff * c.n_shared_experts,
            full_attention_interval=c.full_attention_interval,
            linear_num_key_heads=c.linear_n_k_heads,
            linear_num_value_heads=c.linear_n_v_heads,
            linear_key_head_dim=c.linear_k_head_dim,
            linear_value_head_dim=c.linear_v_head_dim,
            linear_conv_kernel_dim=c.linear_conv_kernel,
        )
    return (hf.Qwen2Config if name.startswith("qwen2.5") else hf.LlamaConfig)(**common)


PUBLISHED = [n for n in configs.names() if n not in ("tiny", "small")]


@pytest.mark.parametrize("name", PUBLISHED)
def test_counts_equal_transformers_implementation(name):
    """Our formulas against the parameters transformers' own implementation of the architecture allocates.

    The model is built on the meta device (shapes only, no memory), from a config made here: nothing is
    downloaded. Active parameters are read off the same module tree: everything but the embedding
    table, with each MoE layer's routed experts scaled by k/E (experts are stored as one fused tensor).
    Both sides are built from the same fields, so this pins the formulas; the published totals above
    pin the fields.
    """
    import transformers as hf

    cfg = configs.get(name)
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(_hf_config(name))
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    embedding = model.get_input_embeddings().weight.numel()
    k_over_e = cfg.n_activated_experts / cfg.n_routed_experts if cfg.is_moe else 0
    active = total - embedding - routed * (1 - k_over_e)
    # n_params() leaves out biases, attention sinks, q/k norms and the shared-expert gate (its
    # docstring lists them), each below 0.05% of the total: that omission is the whole tolerance.
    for what, ours, theirs in (("total", cfg.n_params(), total), ("active", cfg.n_active_params(), active)):
        assert _rel(ours, theirs) < 5e-4, (
            f"{name}: our {what} count {ours / B:.3f}B differs from transformers' {type(model).__name__} "
            f"({theirs / B:.3f}B) by {_rel(ours, theirs):.3%}; compare ModelConfig._attention_params / "
            f"_ffn_params with the module shapes (model.named_parameters())"
        )


def test_qwen3_next_non_embedding_parameters():
    cfg = configs.get("qwen3-next-80b-a3b")
    non_embedding = cfg.n_params() - 2 * cfg.vocab_size * cfg.d_model
    assert _rel(non_embedding, 79 * B) < 0.01, (
        f"Qwen3-Next model card: 79B non-embedding parameters; we count {non_embedding / B:.2f}B. "
        f"This figure pins the 36 Gated DeltaNet + 12 gated-attention layers and the 512 experts."
    )


def test_deepseek_v3_checkpoint_with_mtp_is_685b():
    cfg = configs.get("deepseek-v3")
    # The released checkpoint also holds the MTP module with its own copy of embedding and head.
    checkpoint = cfg.n_params(include_mtp=True) + 2 * cfg.vocab_size * cfg.d_model
    assert _rel(checkpoint, 685 * B) < 0.01, (
        f"DeepSeek-V3's Hugging Face card: 685B = 671B main model + 14B multi-token-prediction module; "
        f"we count {checkpoint / B:.1f}B. The MTP module is one more MoE block plus a 2d->d projection."
    )


@pytest.mark.parametrize("name, kb", [("deepseek-v3", 70), ("qwen2.5-72b", 327), ("llama-3.1-405b", 516)])
def test_kv_cache_bytes_per_token_match_deepseek_table(name, kb):
    ours = configs.get(name).kv_cache_bytes_per_token(bytes_per_element=2) / 1000
    assert abs(ours - kb) < 1, (
        f"{name}: {ours:.1f} KB of BF16 KV cache per token, but Zhao et al. (Insights into DeepSeek-V3, ISCA 2025, "
        f"Table 1) gives {kb} KB. GQA caches 2·n_kv_heads·head_dim per layer; MLA caches only "
        f"kv_lora_rank + qk_rope_head_dim."
    )


def test_attention_layer_patterns():
    gpt_oss = configs.get("gpt-oss-120b").layer_types
    assert gpt_oss[:4] == ("sliding", "full", "sliding", "full") and gpt_oss.count("full") == 18, (
        "gpt-oss alternates banded (128-token sliding window) and dense attention, starting with banded "
        f"(gpt-oss model card; config.json layer_types); got {gpt_oss[:4]}... with "
        f"{gpt_oss.count('full')} full layers of 36"
    )
    qwen = configs.get("qwen3-next-80b-a3b").layer_types
    assert qwen[:4] == ("linear", "linear", "linear", "full") and qwen.count("full") == 12, (
        "Qwen3-Next's layout is 12 x (3 x Gated DeltaNet -> 1 x gated attention) (model card); "
        f"got {qwen[:4]}... with {qwen.count('full')} full layers of 48"
    )


def test_moe_layers_of_deepseek_v3():
    cfg = configs.get("deepseek-v3")
    moe = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    assert moe[:3] == [False] * 3 and all(moe[3:]), (
        "DeepSeek-V3 report §4.2: all FFNs except those of the first three layers are MoE layers"
    )


def test_course_configs():
    tiny, small = configs.get("tiny"), configs.get("small")
    assert tiny.vocab_size == small.vocab_size == tokenizer.VOCAB_SIZE, (
        "the course models must use course_lib.model.tokenizer.VOCAB_SIZE, or the data's token ids overflow the embedding"
    )
    shape = lambda c: (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.max_seq_len)
    assert shape(tiny) == (64, 2, 4, 2, 64) and shape(small) == (128, 4, 4, 2, 128)
    assert not tiny.is_moe and not tiny.is_mla and set(tiny.layer_types) == {"full"}


def test_names_and_get():
    assert configs.names()[:2] == ("tiny", "small")
    assert {"deepseek-v3", "qwen2.5-72b", "llama-3.1-405b", "gpt-oss-120b", "gpt-oss-20b", "qwen3-next-80b-a3b"} <= set(
        configs.names()
    )
    for name in configs.names():
        assert configs.get(name).source, f"config {name!r} must say where its numbers come from (source=...)"
    with pytest.raises(ValueError, match="known configs: tiny, small"):
        configs.get("gpt-5")


def test_get_overrides_rederive_defaults():
    cfg = configs.get("tiny", d_model=128)
    assert cfg.head_dim == 32, "get(name, d_model=...) must derive head_dim again from the new d_model"


def test_replace_revalidates_and_config_is_frozen():
    cfg = configs.get("tiny")
    variant = dataclasses.replace(cfg, n_kv_heads=1)
    assert variant.n_kv_heads == 1 and cfg.n_kv_heads == 2
    with pytest.raises(ValueError, match="not a multiple of n_kv_heads=3"):
        dataclasses.replace(cfg, n_kv_heads=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3


BAD = [
    (dict(n_heads=8, n_kv_heads=3), "n_heads=8 is not a multiple of n_kv_heads=3: grouped-query attention"),
    (dict(d_model=64.0), "d_model=64.0 must be an int"),
    (dict(d_model=100, n_heads=3), "d_model=100 is not divisible by n_heads=3"),
    (dict(head_dim=15), "head_dim=15 must be even: RoPE rotates"),
    (dict(n_layers=0), "n_layers=0 must be a positive integer"),
    (dict(norm_eps=0.0), "norm_eps=0.0 must be > 0"),
    (dict(n_routed_experts=4, n_activated_experts=5), "n_activated_experts=5 must be in 1..n_routed_experts=4"),
    (dict(n_shared_experts=1), "but n_routed_experts=0"),
    (dict(kv_lora_rank=16), "MLA needs all three head widths"),
    (dict(q_lora_rank=16), "set kv_lora_rank > 0 to use MLA"),
    (dict(full_attention_interval=2), "neither sliding_window nor the linear_\\* fields"),
    (dict(sliding_window=16), "full_attention_interval=1 makes every layer full attention"),
    (dict(linear_n_k_heads=2), "Gated DeltaNet needs all five"),
]


@pytest.mark.parametrize("change, message", BAD, ids=[str(c) for c, _ in BAD])
def test_bad_configs_raise_readable_errors(change, message):
    base = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **change})


def test_kv_cache_of_one_sequence_caps_sliding_layers_and_skips_linear_ones():
    oss = configs.get("gpt-oss-120b")
    per_token = oss.kv_cache_bytes_per_token()
    assert oss.kv_cache_bytes(100) == 100 * per_token, "below the 128-token window every layer keeps every token"
    half = per_token // 2  # 18 full and 18 sliding layers of the same GQA shape
    assert oss.kv_cache_bytes(10_000) == 10_000 * half + 128 * half, (
        "gpt-oss: full layers keep all 10,000 tokens, sliding layers only the last sliding_window = 128"
    )
    qwen = configs.get("qwen3-next-80b-a3b")
    assert qwen.kv_cache_bytes(1000) == 1000 * qwen.kv_cache_bytes_per_token() == 1000 * 12 * 2 * 2 * 2 * 256, (
        "Qwen3-Next: only the 12 full-attention layers keep K and V (2 KV heads x 256, bf16)"
    )
    # 36 Gated DeltaNet layers: S of 128 x 128 per value head (32), conv over 2·16·128 + 32·128 channels
    assert qwen.linear_state_bytes(4) == 4 * 36 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3)
    assert configs.get("llama-3.1-405b").linear_state_bytes() == 0
