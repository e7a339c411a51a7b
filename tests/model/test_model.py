"""The course model: each test checks an invariant that defines a piece, against a plain reference."""

import math

import pytest
import torch

from course_lib.inference.generate import generate
from course_lib.model import configs
from course_lib.model.layers import apply_rope, rope_cos_sin
from course_lib.model.transformer import Attention, Transformer, next_token_loss


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return Transformer(configs.get("tiny", **overrides))


def _tokens(batch=2, seq=16, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, configs.get("tiny").vocab_size, (batch, seq), generator=generator)


def test_output_shape():
    logits = _model()(_tokens(batch=3, seq=11))
    assert logits.shape == (3, 11, configs.get("tiny").vocab_size), "logits are [batch, seq, vocab_size]"


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_is_exact(tie):
    model = _model(tie_embeddings=tie)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == model.cfg.n_params(), (
        f"ModelConfig.n_params() = {model.cfg.n_params()} but the model holds {counted} parameters "
        f"(tie_embeddings={tie}); the formula in configs.py and the modules in model.py disagree"
    )

    layer = sum(p.numel() for p in model.layers[0].parameters())
    assert layer == model.cfg.layer_params(0), (
        f"ModelConfig.layer_params(0) = {model.cfg.layer_params(0)} but block 0 holds {layer} parameters"
    )
    with pytest.raises(ValueError, match="layer 99 does not exist"):
        model.cfg.layer_params(99)


def test_causality():
    model, tokens = _model(), _tokens()
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % model.cfg.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], rtol=0, atol=1e-6), (
        "changing token 10 changed the logits at positions 0..9: attention is looking at the future "
        "(is_causal=True in scaled_dot_product_attention is what forbids it)"
    )
    assert not torch.allclose(a[:, 10:], b[:, 10:]), "positions >= 10 must see the change, else this shows nothing"


def _reference_attention(attn, x, cos, sin):
    """Textbook GQA, head by head: softmax(q kᵀ/√d + causal mask)·v; query head h uses K/V head h // group."""
    b, t, _ = x.shape
    hd = attn.head_dim
    q = apply_rope(attn.wq(x).view(b, t, -1, hd).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(x).view(b, t, -1, hd).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(b, t, -1, hd).transpose(1, 2)
    group = q.shape[1] // k.shape[1]
    mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
    heads = []
    for h in range(q.shape[1]):
        scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(hd) + mask
        heads.append(scores.softmax(-1) @ v[:, h // group])
    return attn.wo(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_attention_matches_textbook_reference(n_kv_heads):
    torch.manual_seed(0)
    cfg = configs.get("tiny", n_kv_heads=n_kv_heads)
    attn = Attention(cfg)
    x = torch.randn(2, 12, cfg.d_model)
    cos, sin = rope_cos_sin(12, cfg.head_dim, cfg.rope_theta)
    torch.testing.assert_close(
        attn(x, cos, sin),
        _reference_attention(attn, x, cos, sin),
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: f"Attention (n_kv_heads={n_kv_heads}) differs from the per-head reference: {m}",
    )


def test_gqa_equals_mha_with_shared_kv_heads():
    """GQA is MHA whose K/V heads come in groups of identical copies; build that MHA and compare."""
    gqa = _model(n_kv_heads=2)
    mha = _model(n_kv_heads=4)
    state = gqa.state_dict()
    group = gqa.cfg.n_heads // gqa.cfg.n_kv_heads
    hd = gqa.cfg.head_dim
    for name, w in list(state.items()):
        if name.endswith(("wk.weight", "wv.weight")):  # [n_kv*hd, d] -> each head's rows repeated `group` times
            state[name] = w.view(-1, hd, w.shape[1]).repeat_interleave(group, dim=0).reshape(-1, w.shape[1])
    mha.load_state_dict(state)
    tokens = _tokens()
    torch.testing.assert_close(
        gqa(tokens),
        mha(tokens),
        rtol=1e-5,
        atol=1e-6,
        msg=lambda m: (
            "a GQA model must equal the MHA model whose K/V heads are its K/V heads copied "
            f"n_heads/n_kv_heads times (query head h reads K/V head h // group): {m}"
        ),
    )


def test_rope_depends_on_relative_position_only():
    cos, sin = rope_cos_sin(32, 16, 10_000.0)
    q, k = torch.randn(16), torch.randn(16)
    rot = lambda x, m: apply_rope(x.view(1, 1, 1, -1), cos[m : m + 1], sin[m : m + 1]).flatten()
    dots = [rot(q, m + 5) @ rot(k, m) for m in range(0, 20, 4)]
    assert torch.allclose(torch.stack(dots), dots[0].expand(len(dots)), atol=1e-4), (
        f"RoPE: q at position m+5 dotted with k at position m must not depend on m; got {dots}"
    )


def test_adamw_reduces_loss_on_a_fixed_batch():
    model = _model()
    tokens = _tokens(batch=4, seq=32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = model.loss(inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    uniform = math.log(model.cfg.vocab_size)
    assert abs(losses[0] - uniform) < 0.1, (
        f"first loss {losses[0]:.3f} should be close to ln(vocab_size) = {uniform:.3f}: with N(0, 0.02) "
        f"weights the logits start near zero, i.e. a uniform prediction"
    )
    assert losses[-1] < 0.7 * losses[0], (
        f"25 AdamW steps on one fixed batch should memorise it: loss went {losses[0]:.3f} -> {losses[-1]:.3f}"
    )


def test_seeded_init_is_reproducible_and_scaled():
    a, b, c = _model(seed=0), _model(seed=0), _model(seed=1)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), f"{name} differs between two models built after torch.manual_seed(0)"
    assert not torch.equal(a.output.weight, c.output.weight), "a different seed must give different weights"
    std_wo = a.layers[0].attention.wo.weight.std().item()
    expected = 0.02 / math.sqrt(2 * a.cfg.n_layers)
    assert abs(std_wo - expected) / expected < 0.1, (
        f"wo std {std_wo:.4f}, expected 0.02/sqrt(2*n_layers) = {expected:.4f} (GPT-2's residual scaling)"
    )


def test_tied_embeddings_are_one_parameter():
    model = _model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    model.loss(_tokens()[:, :-1], _tokens()[:, 1:]).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert torch.equal(model.output.weight, model.tok_embeddings.weight), (
        "after an optimizer step the output head and the embedding must still be the same matrix"
    )


def test_next_token_loss_is_mean_cross_entropy():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 0] = -100
    manual = -logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    keep = targets != -100
    torch.testing.assert_close(next_token_loss(logits, targets), manual[keep].mean())
    with pytest.raises(ValueError, match="targets of shape logits.shape"):
        next_token_loss(logits, targets[:, :-1])


def test_generate_is_greedy():
    model, prompt = _model(), _tokens(batch=1, seq=5)[0]
    out = generate(model, prompt, 6)
    assert out.shape == (11,) and torch.equal(out[:5], prompt), "generate returns the prompt, then n_new tokens"
    for t in range(5, 11):
        expected = model(out[None, :t])[0, -1].argmax()
        assert out[t] == expected, f"token {t} is not the argmax of the model's logits given tokens 0..{t - 1}"
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        generate(model, prompt, 60)


def test_bad_inputs_raise_readable_errors():
    model = _model()
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(_tokens(seq=65))
    with pytest.raises(ValueError, match=r"tokens\[None\]"):
        model(_tokens()[0])
    with pytest.raises(TypeError, match="ModelConfig"):
        Transformer({"d_model": 64})


@pytest.mark.parametrize("name", [n for n in configs.names() if configs.get(n).n_params() > 10**9])
def test_published_sizes_are_refused_with_a_way_out(name):
    with pytest.raises(ValueError, match="meta device"):
        Transformer(configs.get(name))


@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_loss_goes_through_forward_so_wrappers_hooks_fire(mtp_depth):
    # FSDP2's fully_shard(model) gathers the root's parameters in a forward pre-hook: a loss that
    # bypassed forward() would meet sharded DTensors (lecture 02's FSDP2 cell).
    model = Transformer(configs.get("tiny", mtp_depth=mtp_depth))
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model.loss(x, x)
    assert calls == [1], "Transformer.loss must call the model (self(tokens)), not its pieces"
    assert ("mtp" in dict(model.named_children())) == bool(mtp_depth), "MTP modules exist only when mtp_depth > 0"
