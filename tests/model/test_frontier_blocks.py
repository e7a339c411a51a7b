"""Frontier building blocks in the course model (issue 10): MLA, Gated DeltaNet, sliding-window and gated
attention, the hybrid layer stack, multi-token prediction and GRPO's group-relative advantage.

Each model test builds a scaled-down copy of a published architecture and proves that
ModelConfig's parameter formulas are the calculators for it: numel == n_params(include_mtp=True).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.model import configs
from course_lib.model.config import ModelConfig
from course_lib.model.layers import rope_cos_sin
from course_lib.model.linear_attention import DeltaNetState, GatedDeltaNet, gated_delta_rule
from course_lib.model.mla import MLA
from course_lib.model.moe import MoE
from course_lib.model.transformer import Attention, Transformer, next_token_loss
from course_lib.optim.grpo import group_advantages, grpo_loss, kl_k3, train_toy

VOCAB = configs.get("tiny").vocab_size  # the course tokenizer's vocabulary
SMALL_MOE = dict(n_routed_experts=4, n_activated_experts=2)
# Published architectures shrunk to course size; every other field is the published config's.
MINI = {
    "qwen3-next-80b-a3b": dict(  # 3 Gated DeltaNet layers + 1 gated full-attention layer, all MoE, MTP
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        moe_d_ff=32,
        linear_n_k_heads=2,
        linear_n_v_heads=4,
        linear_k_head_dim=16,
        linear_v_head_dim=16,
        **SMALL_MOE,
    ),
    "deepseek-v3": dict(  # MLA everywhere, first layer dense, MoE with a shared expert, MTP depth 1
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        d_ff=128,
        moe_d_ff=32,
        first_k_dense=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        **SMALL_MOE,
    ),
    "gpt-oss-20b": dict(  # sliding-window and full attention alternating, MoE
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=64,
        moe_d_ff=64,
        sliding_window=8,
        **SMALL_MOE,
    ),
}
MIXERS = {  # the mixer each layer of the shrunk model must have
    "qwen3-next-80b-a3b": (GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, Attention),
    "deepseek-v3": (MLA, MLA, MLA),
    "gpt-oss-20b": (Attention, Attention, Attention, Attention),
}


def mini(name: str, **overrides) -> ModelConfig:
    return configs.get(name, vocab_size=VOCAB, max_seq_len=64, **{**MINI[name], **overrides})


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def tokens(batch=2, seq=24, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ whole models


@pytest.mark.parametrize("name", list(MINI))
def test_scaled_down_frontier_model_builds_counts_and_trains(name):
    cfg = mini(name)
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert numel(model) == cfg.n_params(include_mtp=True), (
        f"{name} (scaled down) holds {numel(model)} parameters but ModelConfig.n_params(include_mtp=True) = "
        f"{cfg.n_params(include_mtp=True)}: a module and its formula in config._attention_params/_ffn_params/"
        f"_count disagree"
    )
    for i, layer in enumerate(model.layers):
        assert numel(layer) == cfg.layer_params(i), f"{name} layer {i} ({cfg.layer_types[i]}) != layer_params({i})"
        assert type(layer.attention) is MIXERS[name][i], (
            f"{name} layer {i} is {cfg.layer_types[i]!r} but its mixer is {type(layer.attention).__name__}; "
            f"Block picks the mixer from cfg.layer_types[i] (and MLA when cfg.is_mla)"
        )
        assert isinstance(layer.feed_forward, MoE) == cfg.is_moe_layer(i), f"{name} layer {i}: MoE vs first_k_dense"
    if name == "qwen3-next-80b-a3b":
        assert cfg.layer_types == ("linear",) * 3 + ("full",), f"full_attention_interval=4: {cfg.layer_types}"
        assert model.layers[3].attention.gated, "Qwen3-Next's full-attention layers gate their output"
    if name == "deepseek-v3":
        assert model.rope_cos.shape[-1] == cfg.qk_rope_head_dim, "MLA's RoPE table is qk_rope_head_dim wide"

    x = tokens(seq=24)  # longer than gpt-oss's window of 8: the band mask is in use
    loss = model.loss(x[:, :-1], x[:, 1:])
    loss.backward()
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    no_grad = [n for n, p in model.named_parameters() if p.grad is None and ".experts." not in n]
    assert not no_grad, f"{name}: these parameters got no gradient (only unchosen routed experts may): {no_grad}"

    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(changed)
    # the positions before 10 compute the same numbers (the change only enters through masked or
    # not-yet-reached terms); 1e-5 allows for a kernel that sums blocks in another order
    assert torch.allclose(a[:, :10], b[:, :10], rtol=0, atol=1e-5), (
        f"{name}: changing token 10 changed logits at positions < 10; a mixer looks ahead (conv padding, mask)"
    )


@pytest.mark.parametrize("name", configs.names())
def test_published_configs_at_full_width_build_on_meta_with_the_counted_parameters(name):
    """Full widths, few layers (enough for every layer kind and the first MoE layer), at most 16
    experts (the count is linear in them): the formulas hold at the published sizes, on the meta
    device, which allocates nothing."""
    cfg = configs.get(name)
    n_layers = max(cfg.first_k_dense + 1, cfg.full_attention_interval)
    experts = dict(n_routed_experts=min(cfg.n_routed_experts, 16)) if cfg.is_moe else {}
    cfg = dataclasses.replace(cfg, n_layers=n_layers, **experts)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert numel(model) == cfg.n_params(include_mtp=True), (
        f"{name} at full width: numel {numel(model)} != n_params(include_mtp=True) {cfg.n_params(include_mtp=True)}"
    )


MLA_FIELDS = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize(
    "overrides",
    [dict(sliding_window=4, full_attention_interval=2), dict(attn_output_gate=True)],
    ids=["mla+sliding", "mla+gate"],
)
def test_combinations_no_model_uses_are_refused_clearly(overrides):
    with pytest.raises(NotImplementedError, match="no published model combines them"):
        Transformer(configs.get("tiny", **MLA_FIELDS, **overrides))


# ------------------------------------------------------------------------------ attention variants


def test_sliding_window_sees_exactly_the_last_window_tokens():
    cfg = configs.get("tiny", sliding_window=4, full_attention_interval=2)
    torch.manual_seed(0)
    attn = Attention(cfg, window=4)
    x = torch.randn(2, 12, cfg.d_model)
    cos, sin = rope_cos_sin(12, cfg.head_dim, cfg.rope_theta)
    changed = x.clone()
    changed[:, 0] += 1.0
    a, b = attn(x, cos, sin), attn(changed, cos, sin)
    # masked keys get weight exp(-inf) = 0: their change cannot reach the output (1e-6: summation order)
    assert torch.allclose(a[:, 4:], b[:, 4:], rtol=0, atol=1e-6), (
        "with window 4, query 4 sees keys 1..4 only: changing token 0 must not change positions >= 4 "
        "(mask: 0 <= i - j < window)"
    )
    assert not torch.allclose(a[:, 3], b[:, 3]), "query 3 sees keys 0..3 (window 4 includes itself and 3 before)"
    full = Attention(cfg)
    full.load_state_dict(attn.state_dict())
    # positions < 4 see every earlier key either way; the masked and causal kernels may sum differently
    torch.testing.assert_close(
        a[:, :4],
        full(x, cos, sin)[:, :4],
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"inside the window (positions < 4) sliding-window attention is causal attention: {m}",
    )


def test_output_gate_is_sigmoid_of_a_second_query_projection():
    cfg = configs.get("tiny", attn_output_gate=True)
    torch.manual_seed(0)
    gated = Attention(cfg)
    h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    assert numel(gated) == cfg.layer_params(0) - 2 * d - 3 * d * cfg.d_ff, "the gate doubles wq, as the config counts"
    w = gated.wq.weight.view(h, 2, hd, d)  # Qwen3-Next's layout: per head, query rows then gate rows
    plain = Attention(configs.get("tiny"))
    plain.wq.weight.data = w[:, 0].reshape(h * hd, d).clone()
    plain.wk.weight.data, plain.wv.weight.data = gated.wk.weight.data, gated.wv.weight.data
    plain.wo.weight.data = torch.eye(d)  # read the attention output y itself (h·hd = d here)
    x = torch.randn(2, 10, d)
    cos, sin = rope_cos_sin(10, hd, cfg.rope_theta)
    gate = torch.sigmoid(x @ w[:, 1].reshape(h * hd, d).T)
    expected = gated.wo(plain(x, cos, sin) * gate)
    # same products; the identity matmul adds exact zeros, so only fp32 rounding of gated.wo differs
    torch.testing.assert_close(
        gated(x, cos, sin),
        expected,
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"gated attention must be wo(y ⊙ sigmoid(G)), G from each head's second half of wq: {m}",
    )


LINEAR = dict(
    full_attention_interval=2,
    linear_n_k_heads=2,
    linear_n_v_heads=4,
    linear_k_head_dim=8,
    linear_v_head_dim=16,
    linear_conv_kernel=4,
)


def test_gated_delta_rule_is_the_papers_recurrence():
    """The loop computes S_t = α_t S_{t-1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t (Yang et al. 2024,
    eq. 10), written here with an explicit identity matrix, in float64."""
    g = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 7, 3, 5, 4
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(b, t, h, dv, generator=g, dtype=torch.float64)
    alpha, beta = torch.rand(b, t, h, generator=g, dtype=torch.float64), torch.rand(b, t, h, generator=g).double()
    o, last = gated_delta_rule(q, k, v, alpha, beta)
    s = torch.zeros(b, h, dv, dk, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    for i in range(t):
        a_, b_ = alpha[:, i, :, None, None], beta[:, i, :, None, None]
        kk = k[:, i, :, :, None] @ k[:, i, :, None, :]
        s = a_ * s @ (eye - b_ * kk) + b_ * v[:, i, :, :, None] @ k[:, i, :, None, :]
        # float64: the two forms differ only by rounding, ~1e-16 per step
        torch.testing.assert_close(
            o[:, i],
            (s @ q[:, i, :, :, None])[..., 0],
            rtol=1e-12,
            atol=1e-12,
            msg=f"step {i}: gated_delta_rule is not S_t = α S (I − β k kᵀ) + β v kᵀ, o = S q",
        )
    torch.testing.assert_close(last, s, rtol=1e-12, atol=1e-12, msg="the returned state is S_T")


def test_gated_deltanet_decodes_with_a_fixed_size_state():
    cfg = configs.get("tiny", **LINEAR)
    d = cfg.d_model
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg)
    assert numel(layer) == cfg.layer_params(0) - 2 * d - 3 * d * cfg.d_ff, (
        "GatedDeltaNet's parameters must be what ModelConfig._attention_params('linear') counts"
    )
    x = torch.randn(2, 16, d)
    whole = layer(x)
    state = DeltaNetState()
    parts, sizes = [layer(x[:, :5], state)], []  # prefill 5 tokens, then one token at a time
    for i in range(5, 16):
        parts.append(layer(x[:, i : i + 1], state))
        sizes.append(state.nbytes())
    stepped = torch.cat(parts, dim=1)
    # the recurrence runs the same ops in the same order; only the conv sums its 4 taps per call
    # instead of over the whole sequence: fp32 reordering, bounded by 1e-5 of the largest output
    assert (stepped - whole).abs().max() <= 1e-5 * whole.abs().max(), (
        f"decoding through DeltaNetState differs from the full-sequence forward by "
        f"{(stepped - whole).abs().max():.2e}: check that the conv state keeps the last kernel-1 inputs"
    )
    per_sequence = cfg.linear_state_bytes(4) // cfg.layer_types.count("linear")  # one layer's, fp32
    assert sizes == [sizes[0]] * len(sizes) and sizes[0] == 2 * per_sequence, (
        f"state bytes per decode step {sizes}; expected constant 2 sequences x {per_sequence} B "
        f"(ModelConfig.linear_state_bytes: conv's last kernel-1 inputs + S per value head): a linear-attention layer's state must not grow with t"
    )


# ------------------------------------------------------------------------------ multi-token prediction


def test_mtp_term_is_the_cross_entropy_of_the_tokens_two_ahead():
    cfg = configs.get("tiny", mtp_depth=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert numel(model.mtp) == cfg.n_params(include_mtp=True) - cfg.n_params(), (
        "the MTP modules hold 3 norms, a 2d->d projection and a block each; embedding and head are shared"
    )
    seq = tokens(seq=17)
    inputs, targets = seq[:, :-1], seq[:, 1:]
    terms = model.loss_terms(inputs, targets)
    with torch.no_grad():  # by hand: position i combines h_i and Emb(t_{i+1}) and predicts t_{i+2}
        t = inputs.shape[1]
        m = model.mtp[0]
        h0 = model.hidden(inputs)
        x = m.proj(torch.cat([m.hnorm(h0[:, : t - 1]), m.enorm(model.tok_embeddings(seq[:, 1:t]))], dim=-1))
        h1 = m.block(x, model.rope_cos[: t - 1], model.rope_sin[: t - 1])
        logp = model.output(m.norm(h1)).log_softmax(-1)
        by_hand = -logp.gather(-1, seq[:, 2:, None]).mean()
    # cross_entropy and log_softmax + gather: the same fp32 terms, averaged in another order
    torch.testing.assert_close(
        terms["mtp_1"],
        by_hand,
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"the MTP loss must be the cross-entropy of t_(i+2) from [h_i ; Emb(t_(i+1))]: {m}",
    )
    total = model.loss(inputs, targets)
    torch.testing.assert_close(total, terms["main"] + 0.3 * terms["mtp_1"], msg="loss = main + λ/D · Σ_k L^k")


def test_inference_ignores_the_mtp_modules():
    torch.manual_seed(0)
    with_mtp = Transformer(configs.get("tiny", mtp_depth=1))
    without = Transformer(configs.get("tiny"))
    result = without.load_state_dict(with_mtp.state_dict(), strict=False)
    assert not result.missing_keys and all(k.startswith("mtp.") for k in result.unexpected_keys)
    x = tokens()
    assert torch.equal(with_mtp(x), without(x)), "forward (inference) must not use the MTP modules"


def test_training_with_mtp_lowers_the_main_loss():
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny", mtp_depth=1))
    batches = list(make_dataset(MarkovLanguage(), 8 * 32 * 20 + 1, 32, seed=1).batches(8, shuffle=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    main, mtp = [], []
    for x, y in batches:
        terms = model.loss_terms(x, y)
        loss = terms["main"] + model.mtp_weight * terms["mtp_1"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        main.append(terms["main"].item())
        mtp.append(terms["mtp_1"].item())
    assert all(math.isfinite(v) for v in main + mtp), f"non-finite losses: main {main}, mtp {mtp}"
    first, last = sum(main[:3]) / 3, sum(main[-3:]) / 3
    # ln(64) = 4.16 at the start; the unigram floor 2.77 (course_lib.data) is reached in ~10 steps
    assert last < first - 1.0, f"20 AdamW steps with MTP: main loss {first:.3f} -> {last:.3f}, expected a drop > 1 nat"
    assert sum(mtp[-3:]) / 3 < sum(mtp[:3]) / 3 - 1.0, f"the MTP loss must fall too: {mtp[:3]} -> {mtp[-3:]}"
    with torch.no_grad():
        torch.testing.assert_close(  # the same ops in the same order: equal up to the last bits
            model.loss_terms(x, y)["main"], next_token_loss(model(x), y), msg="'main' is forward's next-token loss"
        )


# ------------------------------------------------------------------------------ GRPO


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    a = group_advantages(rewards)
    s = math.sqrt(1 / 3)  # sample std of (1, 0, 0, 1): sqrt(4 · 0.25 / 3)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]) / torch.tensor([[s + 1e-4], [1e-4]])
    torch.testing.assert_close(a, expected, msg="Â = (r − group mean)/(group sample std + eps), per prompt (row)")
    with pytest.raises(ValueError, match="group"):
        group_advantages(torch.ones(4))


def test_grpo_loss_gradient_clip_and_kl():
    old = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.3, 0.2, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # output 2 has 2 tokens
    adv = torch.tensor([1.0, -2.0])
    new = old.clone().requires_grad_(True)
    grpo_loss(new, old, adv, mask).backward()
    # at ρ = 1 the gradient of −J w.r.t. log π is −Â_i / (|o_i| · B) on the output's tokens
    expected = torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [1 / 2, 1 / 2, 0.0]])
    torch.testing.assert_close(new.grad, expected, msg="−J's gradient: −Â_i/(|o_i|·G) per token, 0 on padding")

    moved = (old + math.log(1.5)).requires_grad_(True)  # ρ = 1.5, beyond 1 + ε = 1.2
    grpo_loss(moved, old, adv, mask).backward()
    assert torch.all(moved.grad[0] == 0), "Â > 0 and ρ > 1 + ε: the clipped term is the min, no gradient"
    assert torch.all(moved.grad[1, :2] != 0), "Â < 0 and ρ > 1 + ε: min keeps the unclipped ρ·Â (pessimistic)"

    # k3: π_ref/π − log(π_ref/π) − 1; its expectation under π is exactly KL(π ‖ π_ref)
    p, p_ref = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.25, 0.25, 0.5])
    assert math.isclose(kl_k3(p.log(), p_ref.log())[0].item(), 0.5 - math.log(0.5) - 1, rel_tol=1e-6)
    torch.testing.assert_close((p * kl_k3(p.log(), p_ref.log())).sum(), (p * (p / p_ref).log()).sum())
    with_kl = grpo_loss(new, old, adv, mask, kl_coef=0.04, logprobs_ref=old + 0.1)
    kl_term = (with_kl - grpo_loss(new, old, adv, mask)).item()
    # fp32 difference of two O(1) losses: ~1e-7 absolute error on a 2e-4 term
    assert math.isclose(kl_term, 0.04 * (math.exp(0.1) - 0.1 - 1), rel_tol=1e-2), (
        f"the KL term must add β · k3 per token, averaged like the surrogate: got {kl_term}"
    )


def test_grpo_teaches_a_toy_policy_its_rewarded_token():
    rewards = train_toy(steps=30, seed=0)
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert end > start + 0.4, (
        f"GRPO on the toy policy: mean reward {start:.2f} -> {end:.2f} over 30 steps; expected a rise of > 0.4 "
        f"(check the sign of the advantage and that grpo_loss is minimised, i.e. −J)"
    )
    frozen = train_toy(steps=10, lr=0.0, seed=0)  # control: no learning, no rise (the test can fail)
    assert abs(sum(frozen[-5:]) - sum(frozen[:5])) / 5 < 0.15, f"with lr=0 the reward must stay flat: {frozen}"
