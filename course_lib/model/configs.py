"""The named model configurations: the course's two small models and six published architectures.

``tiny`` and ``small`` are Llama-style models sized to train on 2 CPU cores. The published ones carry
the numbers of their technical reports and released ``config.json`` files, each cited in its
``source`` field, so that later chapters do their arithmetic (parameters, active parameters, KV-cache
bytes) from real numbers instead of round guesses:

    deepseek-v3          DeepSeek-AI, DeepSeek-V3 Technical Report (2024) §4.2
    qwen2.5-72b          Qwen team, Qwen2.5 Technical Report (2024) Table 1
    llama-3.1-405b       Dubey et al., The Llama 3 Herd of Models (2024) Table 3
    gpt-oss-120b, -20b   OpenAI, gpt-oss-120b & gpt-oss-20b Model Card (2025) Table 1
    qwen3-next-80b-a3b   Qwen team, Qwen3-Next blog and model card (2025)

:class:`~course_lib.model.config.ModelConfig` is the dataclass they build;
``course_lib.model.transformer.Transformer`` builds the model, the published ones scaled down
(``get(name, d_model=64, n_layers=4, ...)``) or at full size on the meta device.

    >>> from course_lib.model import configs
    >>> configs.names()
    ('tiny', 'small', 'deepseek-v3', 'qwen2.5-72b', 'llama-3.1-405b', 'gpt-oss-120b', ...)
    >>> cfg = configs.get("tiny", n_layers=4)

Tested in tests/model/test_configs.py (each published count against its headline figure).
"""

from __future__ import annotations

from course_lib.model.config import ModelConfig, swiglu_hidden
from course_lib.model.tokenizer import VOCAB_SIZE

_COURSE = "course model, sized to train on 2 CPU cores; vocab_size = course_lib.model.tokenizer.VOCAB_SIZE"

# Both gpt-oss models share one layer design (model card Table 1).
_GPT_OSS_LAYER = dict(
    vocab_size=201_088,
    d_model=2880,
    n_heads=64,
    n_kv_heads=8,
    head_dim=64,
    d_ff=2880,
    max_seq_len=131_072,
    rope_theta=150_000.0,
    norm_eps=1e-5,
    n_activated_experts=4,
    moe_d_ff=2880,
    full_attention_interval=2,
    sliding_window=128,
)

_REGISTRY: dict[str, dict] = {
    "tiny": dict(
        vocab_size=VOCAB_SIZE,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=swiglu_hidden(64),
        max_seq_len=64,
        source=_COURSE,
    ),
    "small": dict(
        vocab_size=VOCAB_SIZE,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=swiglu_hidden(128),
        max_seq_len=128,
        source=_COURSE,
    ),
    "deepseek-v3": dict(
        vocab_size=129_280,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        d_ff=18_432,
        max_seq_len=163_840,
        rope_theta=10_000.0,
        norm_eps=1e-6,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=8,
        moe_d_ff=2048,
        first_k_dense=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mtp_depth=1,
        source="DeepSeek-V3 Technical Report (arXiv:2412.19437) §4.2 'Hyper-Parameters'; config.json of "
        "deepseek-ai/DeepSeek-V3; headline 671B total / 37B activated (report abstract)",
    ),
    "qwen2.5-72b": dict(
        vocab_size=152_064,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        d_ff=29_568,
        max_seq_len=131_072,
        rope_theta=1_000_000.0,
        norm_eps=1e-5,
        source="Qwen2.5 Technical Report (arXiv:2412.15115) Table 1; config.json of Qwen/Qwen2.5-72B; "
        "headline 72.7B parameters (model card); KV 327 KB/token (Zhao et al., Insights into DeepSeek-V3, ISCA 2025, Table 1)",
    ),
    "llama-3.1-405b": dict(
        vocab_size=128_256,
        d_model=16_384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        d_ff=53_248,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        source="The Llama 3 Herd of Models (arXiv:2407.21783) Table 3; config.json of "
        "meta-llama/Llama-3.1-405B; headline 405B; KV 516 KB/token (Zhao et al., Insights into DeepSeek-V3, ISCA 2025, Table 1)",
    ),
    "gpt-oss-120b": dict(
        _GPT_OSS_LAYER,
        n_layers=36,
        n_routed_experts=128,
        source="gpt-oss-120b & gpt-oss-20b Model Card (OpenAI, Aug 2025) Table 1; config.json of "
        "openai/gpt-oss-120b; headline 116.83B total / 5.13B active (OpenAI, Introducing gpt-oss: ~117B / ~5.1B)",
    ),
    "gpt-oss-20b": dict(  # the 120b's layer, fewer of them and fewer experts
        _GPT_OSS_LAYER,
        n_layers=24,
        n_routed_experts=32,
        source="gpt-oss-120b & gpt-oss-20b Model Card (OpenAI, Aug 2025) Table 1; config.json of "
        "openai/gpt-oss-20b; headline 20.91B total / 3.61B active (OpenAI, Introducing gpt-oss: ~21B / ~3.6B)",
    ),
    "qwen3-next-80b-a3b": dict(
        # d_ff (intermediate_size) is unused: every layer is MoE. The shared expert has the routed
        # experts' width (shared_expert_intermediate_size = moe_intermediate_size = 512).
        vocab_size=151_936,
        d_model=2048,
        n_layers=48,
        n_heads=16,
        n_kv_heads=2,
        head_dim=256,
        d_ff=5120,
        max_seq_len=262_144,
        rope_theta=10_000_000.0,
        norm_eps=1e-6,
        n_routed_experts=512,
        n_shared_experts=1,
        n_activated_experts=10,
        moe_d_ff=512,
        full_attention_interval=4,
        attn_output_gate=True,
        linear_n_k_heads=16,
        linear_n_v_heads=32,
        linear_k_head_dim=128,
        linear_v_head_dim=128,
        linear_conv_kernel=4,
        mtp_depth=1,
        source="Qwen3-Next blog and model card (Qwen team, Sep 2025); config.json of "
        "Qwen/Qwen3-Next-80B-A3B-Instruct; headline 80B total / 3B activated (model card; NVIDIA Developer Blog, Qwen3-Next hybrid MoE)",
    ),
}


def names() -> tuple[str, ...]:
    """Names accepted by :func:`get`, course models first."""
    return tuple(_REGISTRY)


def get(name: str, **overrides) -> ModelConfig:
    """The named configuration, optionally with fields overridden (validated like any other)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model config {name!r}; known configs: {', '.join(names())}")
    return ModelConfig(**{**_REGISTRY[name], **overrides})
