"""The model configuration: one frozen dataclass for every transformer the course talks about.

:class:`ModelConfig` describes a decoder-only transformer (dense, MoE, MLA, hybrid attention) and
derives from its fields what later chapters compute with: parameters (:meth:`ModelConfig.n_params`,
:meth:`~ModelConfig.n_active_params`), KV-cache bytes per token (:meth:`~ModelConfig.kv_cache_bytes_per_token`,
MLA's latent cache as in DeepSeek-V2 §2.1), the fixed-size state of linear-attention layers. The
named configurations (the course's ``tiny`` and ``small``, and six published architectures from their
technical reports) are :mod:`course_lib.model.configs`; ``course_lib.model.transformer.Transformer``
builds any of them.

    >>> from course_lib.model import configs
    >>> cfg = configs.get("tiny")                  # or configs.get("tiny", n_layers=4)
    >>> dataclasses.replace(cfg, n_kv_heads=1)     # a variant, validated again

Fields left as ``None`` (``n_kv_heads``, ``head_dim``, ``d_ff``, ``moe_d_ff``) are derived once at
construction. ``dataclasses.replace`` keeps derived values, so when you change ``d_model`` or
``n_heads`` through it, pass ``head_dim=None`` (and ``d_ff=None``) to derive them again;
``configs.get(name, **overrides)`` builds from the registry's own arguments and has no such trap.
Tested in tests/model/test_configs.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


def swiglu_hidden(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU width that keeps the MLP at the classic 8·d² parameters (two d x 4d matrices).

    A SwiGLU MLP has three matrices instead of two, so LLaMA (Touvron et al. 2023, §2.2) shrinks the
    hidden width to 2/3·4·d, then rounds up to a multiple (LLaMA uses 256) so the matmuls stay aligned.
    """
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer (dense, MoE, MLA, hybrid attention).

    Attention: ``n_heads`` query heads of width ``head_dim``; ``n_kv_heads`` K/V heads shared by
    groups of ``n_heads / n_kv_heads`` query heads (GQA, Ainslie et al. 2023). MLA (DeepSeek-V2 §2.1)
    is on when ``kv_lora_rank > 0``. Layer ``i`` uses full attention when
    ``(i + 1) % full_attention_interval == 0``, otherwise sliding-window attention (``sliding_window``
    tokens, gpt-oss) or linear attention (Gated DeltaNet, the ``linear_*`` fields, Qwen3-Next).

    Feed-forward: SwiGLU of width ``d_ff``. MoE is on when ``n_routed_experts > 0``: layers from
    ``first_k_dense`` on replace the dense MLP by ``n_shared_experts`` always-on experts plus the
    top-``n_activated_experts`` of ``n_routed_experts`` routed ones, each a SwiGLU of width ``moe_d_ff``.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None: = n_heads (multi-head attention)
    head_dim: int | None = None  # None: d_model // n_heads (MLA: qk_nope + qk_rope)
    d_ff: int | None = None  # None: swiglu_hidden(d_model)
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Mixture of experts
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    n_activated_experts: int = 0  # top-k among the routed experts
    moe_d_ff: int | None = None  # None: = d_ff
    first_k_dense: int = 0
    # Multi-head latent attention (0 = off)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Attention layer pattern
    full_attention_interval: int = 1
    sliding_window: int = 0
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also emits a sigmoid gate on the output
    linear_n_k_heads: int = 0
    linear_n_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0
    # Multi-token prediction (DeepSeek-V3 §2.2): number of extra sequential prediction modules
    mtp_depth: int = 0
    source: str = ""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self._check_numbers()
        self._derive_and_check_attention()
        self._derive_and_check_ffn()
        self._check_layer_pattern()

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # the dataclass is frozen; deriving defaults is allowed

    def _check_numbers(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.type.startswith("int"):  # annotations are strings (from __future__ import annotations)
                continue
            is_int = isinstance(value, int) and not isinstance(value, bool)
            _require(is_int or (value is None and "None" in f.type), f"{f.name}={value!r} must be an int")
            _require(value is None or value >= 0, f"{f.name}={value} is negative; sizes and counts are >= 0")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "full_attention_interval"):
            _require(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be a positive integer")
        _require(self.rope_theta > 0, f"rope_theta={self.rope_theta} must be > 0: RoPE angles are theta^(-2i/d)")
        _require(self.norm_eps > 0, f"norm_eps={self.norm_eps} must be > 0: it keeps RMSNorm's 1/rms finite")

    def _derive_and_check_attention(self) -> None:
        if self.n_kv_heads is None:
            self._set("n_kv_heads", self.n_heads)
        _require(
            0 < self.n_kv_heads <= self.n_heads and self.n_heads % self.n_kv_heads == 0,
            f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: grouped-query "
            f"attention shares each K/V head among n_heads/n_kv_heads query heads; choose n_kv_heads "
            f"dividing n_heads (n_kv_heads=n_heads is plain multi-head attention, 1 is multi-query)",
        )
        mla = {name: getattr(self, name) for name in _MLA_FIELDS}
        if self.is_mla:
            _require(
                self.qk_nope_head_dim and self.qk_rope_head_dim and self.v_head_dim,
                f"MLA is on (kv_lora_rank={self.kv_lora_rank}) but {mla}: MLA needs all three head widths "
                f"qk_nope_head_dim, qk_rope_head_dim, v_head_dim (DeepSeek-V2 §2.1.3)",
            )
            _require(
                self.qk_rope_head_dim % 2 == 0,
                f"qk_rope_head_dim={self.qk_rope_head_dim} is odd: RoPE rotates channel pairs; make it even",
            )
            if self.head_dim is None:
                self._set("head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        else:
            _require(
                not any(mla.values()),
                f"MLA fields {mla} are set but kv_lora_rank=0 (MLA off); set kv_lora_rank > 0 to use MLA "
                f"or leave them all 0",
            )
        if self.head_dim is None:
            _require(
                self.d_model % self.n_heads == 0,
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}, so head_dim cannot "
                f"default to d_model // n_heads; pass head_dim explicitly or change n_heads",
            )
            self._set("head_dim", self.d_model // self.n_heads)
        _require(
            self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim={self.head_dim} must be even: RoPE rotates each head as two halves "
            f"(rotate_half), so it needs an even number of channels",
        )

    def _derive_and_check_ffn(self) -> None:
        if self.d_ff is None:
            self._set("d_ff", swiglu_hidden(self.d_model))
        _require(self.d_ff > 0, f"d_ff={self.d_ff} must be > 0")
        if not self.is_moe:
            unused = (self.n_shared_experts, self.n_activated_experts, self.first_k_dense, self.moe_d_ff)
            _require(
                unused == (0, 0, 0, None),
                f"MoE fields are set (n_shared_experts={self.n_shared_experts}, n_activated_experts="
                f"{self.n_activated_experts}, first_k_dense={self.first_k_dense}, moe_d_ff={self.moe_d_ff}) "
                f"but n_routed_experts=0; set n_routed_experts > 0 for a mixture of experts",
            )
            return
        if self.moe_d_ff is None:
            self._set("moe_d_ff", self.d_ff)
        _require(self.moe_d_ff > 0, f"moe_d_ff={self.moe_d_ff} must be > 0")
        _require(
            0 < self.n_activated_experts <= self.n_routed_experts,
            f"n_activated_experts={self.n_activated_experts} must be in 1..n_routed_experts="
            f"{self.n_routed_experts}: each token is sent to its top-k routed experts",
        )
        _require(
            self.first_k_dense <= self.n_layers,
            f"first_k_dense={self.first_k_dense} exceeds n_layers={self.n_layers}",
        )

    def _check_layer_pattern(self) -> None:
        linear = {name: getattr(self, name) for name in _LINEAR_FIELDS}
        _require(
            all(linear.values()) or not any(linear.values()),
            f"linear-attention fields are partly set {linear}: Gated DeltaNet needs all five, or none",
        )
        _require(
            not (self.sliding_window and any(linear.values())),
            "sliding_window and linear attention are both set; the non-full layers are one kind or the other",
        )
        if self.full_attention_interval > 1:
            _require(
                self.sliding_window > 0 or any(linear.values()),
                f"full_attention_interval={self.full_attention_interval} leaves layers that are not full "
                f"attention, but neither sliding_window nor the linear_* fields say what they are",
            )
        else:
            _require(
                self.sliding_window == 0 and not any(linear.values()),
                "sliding_window / linear_* are set but full_attention_interval=1 makes every layer full "
                "attention; set full_attention_interval > 1 (gpt-oss: 2, Qwen3-Next: 4)",
            )

    # ------------------------------------------------------------------ structure
    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def layer_types(self) -> tuple[str, ...]:
        """'full', 'sliding' or 'linear' for each layer (the rule of HF's gpt-oss and Qwen3-Next configs)."""
        other = "sliding" if self.sliding_window else "linear"
        every = self.full_attention_interval
        return tuple("full" if (i + 1) % every == 0 else other for i in range(self.n_layers))

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_k_dense

    # ------------------------------------------------------------------ counting
    def _attention_params(self, kind: str) -> int:
        d = self.d_model
        if kind == "linear":  # Gated DeltaNet, laid out as in HF's Qwen3NextGatedDeltaNet
            kd = self.linear_n_k_heads * self.linear_k_head_dim
            vd = self.linear_n_v_heads * self.linear_v_head_dim
            return (
                d * (2 * kd + 2 * vd)  # in_proj: q, k, v and the output gate z
                + d * 2 * self.linear_n_v_heads  # in_proj: per-head write strength beta and decay alpha
                + (2 * kd + vd) * self.linear_conv_kernel  # depthwise causal conv over q, k, v
                + 2 * self.linear_n_v_heads  # A_log and dt_bias
                + self.linear_v_head_dim  # gated RMSNorm weight, shared by heads
                + vd * d  # out_proj
            )
        if self.is_mla:  # DeepSeek-V2 §2.1.2-2.1.3: low-rank q and kv, plus a decoupled RoPE part
            h, qk = self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            rq = self.q_lora_rank  # 0: queries are not compressed (DeepSeek-V2-Lite)
            q = d * rq + rq + rq * h * qk if rq else d * h * qk
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + h * self.v_head_dim * d
        q_out = self.n_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        return d * q_out + 2 * d * self.n_kv_heads * self.head_dim + self.n_heads * self.head_dim * d

    def _ffn_params(self, moe: bool, active: bool) -> int:
        d = self.d_model
        if not moe:
            return 3 * d * self.d_ff
        experts = (self.n_activated_experts if active else self.n_routed_experts) + self.n_shared_experts
        return 3 * d * self.moe_d_ff * experts + d * self.n_routed_experts  # + router

    def _block_params(self, kind: str, moe: bool, active: bool) -> int:
        return 2 * self.d_model + self._attention_params(kind) + self._ffn_params(moe, active)

    def layer_params(self, i: int = 0, active: bool = False) -> int:
        """Parameters of block ``i`` (its norms, attention and feed-forward): one ZeRO-3/FSDP unit."""
        if not 0 <= i < self.n_layers:
            raise ValueError(f"layer {i} does not exist: this model has layers 0..{self.n_layers - 1}")
        return self._block_params(self.layer_types[i], self.is_moe_layer(i), active)

    def _count(self, active: bool, include_mtp: bool) -> int:
        d, v = self.d_model, self.vocab_size
        n = v * d + d  # output head + final norm
        if not (active or self.tie_embeddings):
            n += v * d  # the embedding table, when it is a separate matrix
        for i, kind in enumerate(self.layer_types):
            n += self._block_params(kind, self.is_moe_layer(i), active)
        if include_mtp:  # per module: 3 norms, a 2d->d projection, one block; embedding/head shared
            n += self.mtp_depth * (3 * d + 2 * d * d + self._block_params("full", self.is_moe, active))
        return n

    def n_params(self, include_mtp: bool = False) -> int:
        """Total parameters.

        Exact for the course model (``Transformer``; a test checks it against ``numel``). Per layer::

            2·d (two RMSNorms) + attention + feed-forward
            attention, GQA  = d·H·hd·(2 if output gate) + 2·d·Hkv·hd + H·hd·d
            attention, MLA  = d·rq + rq + rq·H·(dn+dr) + d·(rkv+dr) + rkv + rkv·H·(dn+dv) + H·dv·d
            attention, Gated DeltaNet = d·(2K+2V) + 2d·Hv + (2K+V)·conv + 2Hv + dv + V·d
            feed-forward    = 3·d·d_ff  (dense SwiGLU: gate, up, down)
                            = 3·d·moe_d_ff·(n_routed + n_shared) + d·n_routed  (MoE: experts + router)

        plus ``V·d`` embedding, ``V·d`` output head (once if tied) and ``d`` final norm. For the published
        configs the count is analytic and leaves out terms below 0.05% of the total: biases (Qwen2.5's
        QKV bias, gpt-oss's attention, router and expert biases), gpt-oss's per-head attention sinks,
        Qwen3-Next's per-head q/k norms and shared-expert gate, DeepSeek's router bias.
        ``include_mtp`` adds the multi-token-prediction modules, which are dropped at inference and
        excluded from the headline totals (DeepSeek-V3's 671B).
        """
        return self._count(active=False, include_mtp=include_mtp)

    def n_active_params(self, include_mtp: bool = False) -> int:
        """Parameters one token's forward pass multiplies with (MoE: only the top-k routed experts).

        Follows the gpt-oss model card's convention: the output head counts, the embedding table does
        not (a lookup reads one row). For a dense model this is ``n_params()`` minus the embedding
        table, or all of ``n_params()`` when the table is tied to the output head.
        """
        return self._count(active=True, include_mtp=include_mtp)

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of KV cache each token of context adds, summed over layers (bf16 by default).

        GQA layer: 2·Hkv·hd elements (a K and a V per KV head). MLA layer: rkv + dr elements (the latent
        c_kv and the shared RoPE key, DeepSeek-V2 §2.1.2-2.1.3). Linear-attention layers keep a fixed-size
        state and add nothing per token. Sliding-window layers are counted like full ones, which is the
        cost for contexts up to ``sliding_window`` tokens (they stop growing after that).
        """
        return bytes_per_element * sum(self._kv_elements_per_token(kind) for kind in self.layer_types)

    def _kv_elements_per_token(self, kind: str) -> int:
        if kind == "linear":
            return 0
        if kind == "full" and self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim

    def kv_cache_bytes(self, context: int, bytes_per_element: int = 2) -> int:
        """Bytes of KV cache one sequence of ``context`` tokens holds: full and MLA layers keep every
        token, sliding-window layers the last ``sliding_window`` (gpt-oss: half the layers stop growing
        at 128), linear layers none (their fixed state is :meth:`linear_state_bytes`)."""
        if context < 0:
            raise ValueError(f"context={context} must be >= 0 tokens")
        kept = {"full": context, "sliding": min(context, self.sliding_window), "linear": 0}
        return bytes_per_element * sum(self._kv_elements_per_token(k) * kept[k] for k in self.layer_types)

    def linear_state_bytes(self, bytes_per_element: int = 4) -> int:
        """Bytes of recurrent state one sequence holds in the Gated DeltaNet layers, whatever its length:
        per layer an S of d_k x d_v per value head, plus the causal conv's last (kernel - 1) inputs of
        the q, k, v channels (Qwen3-Next; fp32 by default, as the recurrence accumulates in fp32)."""
        channels = 2 * self.linear_n_k_heads * self.linear_k_head_dim + self.linear_n_v_heads * self.linear_v_head_dim
        per_layer = self.linear_n_v_heads * self.linear_k_head_dim * self.linear_v_head_dim
        per_layer += channels * max(0, self.linear_conv_kernel - 1)
        return bytes_per_element * per_layer * self.layer_types.count("linear")


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_LINEAR_FIELDS = (
    "linear_n_k_heads",
    "linear_n_v_heads",
    "linear_k_head_dim",
    "linear_v_head_dim",
    "linear_conv_kernel",
)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
