"""The quantized KV cache (lecture 06): KIVI's INT8/INT4 cache, its bytes, its error, CacheGen's codec, and
transformers' quantized cache beside it.

Each check is the invariant that defines the piece: a code comes back within half a step; the cache built
token by token holds what quantizing the whole sequence at once gives; its bytes are the formula's to the
byte; the attention output moves less than the bound derived from the steps (course_lib.experiments.lecture06.kv_quantization_error);
a constant key channel, which attention ignores, costs per-token keys their accuracy and per-channel keys
nothing; our cache configured as transformers' holds the same bytes and gives the same logits.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_minis import MLA_MINI

from course_lib.cost.memory import kv_window_tokens, quantized_kv_bytes_per_token, quantized_kv_cache_bytes
from course_lib.data import MarkovLanguage
from course_lib.experiments.lecture06 import kv_quantization_error, quanto_side_by_side
from course_lib.inference.cache import ContiguousCache
from course_lib.inference.cachegen import cachegen_compress, cachegen_decompress, cachegen_error_bound
from course_lib.inference.generate import generate
from course_lib.inference.quantized_cache import (
    QuantizedCache,
    dequantize,
    error_bound,
    fake_quantize_kv,
    pack_codes,
    quantize,
    unpack_codes,
)
from course_lib.model.configs import get
from course_lib.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "GQA small": ("small", {}),
    "GQA tiny (head 16 < group 32)": ("tiny", dict(max_seq_len=96)),
    "MQA": ("tiny", dict(n_kv_heads=1, max_seq_len=96)),
    "MLA": ("deepseek-v3", MLA_MINI),
}
# fp32 rounding of x̂ = m + s·code: a few units in the last place of the values (~1e-7 relative)
ROUNDING = 1e-6


def _model(name):
    base, overrides = CONFIGS[name]
    torch.manual_seed(0)
    return Transformer(get(base, **overrides)).eval()


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return Transformer(get("small")).eval()


@pytest.fixture(scope="module")
def small_qkv(small):
    return kv_quantization_error.record_qkv(small, MarkovLanguage().sample(96, seed=5)[None])


# ---------------------------------------------------------------------------------------------------- quantization
def test_packing_layout_is_low_bits_first():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0xF3]], "INT4: element 2j in the low nibble, 2j+1 in the high one"
    assert pack_codes(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[0b00111001]]


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 5), width=st.sampled_from([4, 8, 12]), seed=st.integers(0, 99)
)
def test_packing_round_trips_exactly(bits, rows, width, seed):
    codes = torch.randint(0, 2**bits, (rows, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == width * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes), f"{bits}-bit codes changed through pack/unpack"


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([1, 2, 4, 8]),
    dim=st.sampled_from([-1, -2]),
    magnitude=st.sampled_from([1e-3, 1.0, 300.0]),
    constant=st.booleans(),
    seed=st.integers(0, 999),
)
def test_round_trip_within_half_a_step(bits, group, dim, magnitude, constant, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 8, generator=g) * magnitude + torch.randn(1, generator=g) * magnitude
    if constant:
        x[0, 0] = 0.5  # constant groups: step 0, every element exact
    q = quantize(x, bits, group, dim)
    x_hat = dequantize(q)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    # the bound itself: s/2 = (max - min) / (2 (2^b - 1)) of each group
    groups = x.movedim(dim, -1).unflatten(-1, (-1, group))
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    assert torch.allclose(q.scale.movedim(dim, -1), step, rtol=1e-6, atol=0), "scale must be (max - min)/(2^b - 1)"
    slack = ROUNDING * x.abs().amax()
    assert ((x_hat - x).abs() <= error_bound(q) + slack).all(), "an element came back further than half a step"
    if constant:
        assert torch.equal(x_hat[0, 0], x[0, 0]), "a constant group must come back exactly"
    elements, groups_n = x.numel(), x.numel() // group
    assert q.nbytes() == elements * bits // 8 + 2 * groups_n * 4, "bytes: packed codes + one fp32 (s, m) per group"


def test_bf16_scales_keep_the_bound():
    """Scales stored in bf16 are rounded outward (minimum down, step up), so the grid still covers each group."""
    x = (torch.randn(4, 64, 32, generator=torch.Generator().manual_seed(1)) * 3 + 7).bfloat16()
    q = quantize(x, 4, 32, dim=-2)
    x_hat = dequantize(q).float()
    ulp = torch.finfo(torch.bfloat16).eps * x_hat.abs()  # the cast of x̂ to bf16: half an ulp, at most
    assert ((x_hat - x.float()).abs() <= error_bound(q) + ulp).all()


def test_errors_name_the_constraint():
    with pytest.raises(ValueError, match="whole number of groups"):
        quantize(torch.zeros(3, 10), 4, 4)
    with pytest.raises(ValueError, match="choose one of"):
        quantize(torch.zeros(3, 8), 3, 4)
    with pytest.raises(ValueError, match="per-token groups"):
        fake_quantize_kv(torch.zeros(1, 1, 16, 24), torch.zeros(1, 1, 16, 24), 4, 16, 0, "per_token")
    cache = QuantizedCache(1, 4)
    with pytest.raises(ValueError, match="max_len"):
        cache.begin_step(5)


# ---------------------------------------------------------------------------------------------------- the cache
@pytest.mark.parametrize("key_mode, value_mode", [("per_channel", "per_token"), ("per_token", "per_channel")])
@pytest.mark.parametrize("residual", [0, 5, 32])
def test_cache_built_step_by_step_holds_the_sequence_quantized_at_once(key_mode, value_mode, residual):
    g = torch.Generator().manual_seed(residual)
    k, v = torch.randn(2, 2, 90, 16, generator=g), torch.randn(2, 2, 90, 16, generator=g)
    cache = QuantizedCache(2, 90, bits=4, group_size=8, residual=residual, key_mode=key_mode, value_mode=value_mode)
    steps = [13, 1, 1, 7, 1, 20] + [1] * 47
    end = 0
    for t in steps:
        before = cache.dequantized(0) if len(cache) else (k[:, :, :0], v[:, :, :0])
        cache.begin_step(t)
        k_all, v_all, positions = cache.layer(0).update(k[:, :, end : end + t], v[:, :, end : end + t])
        cache.end_step()
        assert torch.equal(positions[0], torch.arange(end, end + t))
        for got, old, new in ((k_all, before[0], k), (v_all, before[1], v)):
            assert torch.equal(got[:, :, :end], old), "update must return the stored tokens as the cache holds them"
            assert torch.equal(got[:, :, end:], new[:, :, end : end + t]), "the new tokens attend in full precision"
        end += t
        at_once = fake_quantize_kv(k[:, :, :end], v[:, :, :end], 4, 8, residual, key_mode, value_mode)
        held = cache.dequantized(0)
        assert torch.equal(held[0], at_once[0]) and torch.equal(held[1], at_once[1]), (
            f"after {end} tokens the cache differs from quantizing them at once: a group must be quantized "
            f"exactly when the window holds {residual} + {8} tokens, and only once"
        )


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize(
    "bits, group_size, residual, key_mode, value_mode",
    [
        (4, 32, 32, "per_channel", "per_token"),
        (8, 16, 0, "per_token", "per_channel"),
        (2, 8, 5, "per_channel", "per_token"),
    ],
)
def test_stored_bytes_equal_the_formula(name, bits, group_size, residual, key_mode, value_mode):
    model = _model(name)
    cfg = model.cfg
    cache = QuantizedCache(2, 90, bits, group_size, residual, key_mode, value_mode)
    g = torch.Generator().manual_seed(0)
    sizes = []
    with torch.no_grad():
        model(torch.randint(0, 60, (2, 23), generator=g), cache=cache)
        for _ in range(60):
            model(torch.randint(0, 60, (2, 1), generator=g), cache=cache)
            formula = quantized_kv_cache_bytes(cfg, len(cache), bits, group_size, residual, 4, 4, key_mode, value_mode)
            assert cache.stored_bytes() == 2 * formula, (
                f"{name}, {len(cache)} tokens: measured {cache.bytes_by_part()} vs formula {formula} per sequence"
            )
            sizes.append((len(cache), cache.stored_bytes()))
    assert cache.full_precision_bytes() == 2 * cfg.kv_cache_bytes(len(cache), 4)
    # steady state: G more tokens add G quantized tokens' bytes (the window's size repeats with period G)
    (n0, b0), (n1, b1) = sizes[-1 - group_size], sizes[-1]
    assert kv_window_tokens(n0, group_size, residual) == kv_window_tokens(n1, group_size, residual)
    per_token = quantized_kv_bytes_per_token(cfg, bits, group_size, 4, key_mode, value_mode)
    assert b1 - b0 == 2 * group_size * per_token


def test_bytes_per_token_of_kivi_settings():
    """b + 2·16/G bits per element with fp16 scales: INT4/G32 is 5 bits (3.2x below bf16), INT8/G32 9, INT2/G32 3."""
    cfg = get("small")
    bf16 = cfg.kv_cache_bytes_per_token(2)
    for bits, bits_per_element in ((8, 9), (4, 5), (2, 3)):
        assert quantized_kv_bytes_per_token(cfg, bits, 32, scale_bytes=2) == bf16 * bits_per_element / 16


# ---------------------------------------------------------------------------------------------------- error
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("residual", [0, 32])
def test_attention_output_within_the_derived_bound(small_qkv, bits, residual):
    """|ô − o| ≤ max δv + (e^{2ε} − 1)·range(v)/2 with ε = max_j Σ|q|·δk/√d (course_lib.experiments.lecture06.kv_quantization_error):
    a rigorous bound per output element, checked at every decode step of every layer of the course model."""
    for layer, (q, k, v) in enumerate(small_qkv):
        r = kv_quantization_error.decode_attention_error(
            q, k, v, prompt_len=16, bits=bits, group_size=32, residual=residual
        )
        over = r["error"] - r["bound"] * (1 + 1e-4) - ROUNDING * r["bound"].amax()
        assert (over <= 0).all(), (
            f"layer {layer}, INT{bits}, residual {residual}: attention moved {r['error'].max():.3g}, more than the "
            f"bound allows (worst error/bound {r['worst_ratio']:.3f}); look at error_bound and the cache's window"
        )
        assert r["worst_ratio"] > 0.01, "a bound 100x above every error would not test anything"


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_bf16_model_caches_within_their_bound_and_bf16_rounding_is_the_floor(small_qkv, bits):
    """As in a bf16 model (lecture 06's table): the K/V reach the cache in bf16, the reference is exact fp32 attention.
    The bound adds u·|k| for the rounding (and 2u·|k̂| where a dequantized value is cast back); ``bits=None`` is the
    plain bf16 cache, and every quantized cache errs more than it, layer by layer."""
    for layer, (q, k, v) in enumerate(small_qkv):
        kw = dict(prompt_len=16, dtype=torch.bfloat16, group_size=32, residual=32)
        r = kv_quantization_error.decode_attention_error(q, k, v, bits=bits, **kw)
        assert r["worst_ratio"] <= 1 + 1e-4, (
            f"layer {layer}, bits {bits}: attention moved {r['worst_ratio']:.3f}x its bound; look at how "
            "decode_attention_error adds the rounding to bf16 to the cache's error bounds"
        )
        assert r["worst_ratio"] > 0.01, "a bound 100x above every error would not test anything"
        if bits is not None:
            plain = kv_quantization_error.decode_attention_error(q, k, v, bits=None, **kw)["relative"]
            assert r["relative"] > plain, f"layer {layer}: INT{bits} on bf16 K/V erred less than bf16 alone"
    with pytest.raises(ValueError, match="dtype"):
        kv_quantization_error.decode_attention_error(q, k, v, bits=None)


def test_logit_error_scales_with_the_step(small):
    """To first order the error is proportional to the step s = range/(2^b − 1): INT4's logits move about 255/15 = 17
    times as far as INT8's. Measured: 16.6 (no window) and 18.2 (window of 32); the test allows a factor 2 either way."""
    tokens = MarkovLanguage().sample(96, seed=5)[None]
    for residual in (0, 32):
        e8 = kv_quantization_error.logit_error(small, tokens, 16, bits=8, group_size=32, residual=residual)["max_abs"]
        e4 = kv_quantization_error.logit_error(small, tokens, 16, bits=4, group_size=32, residual=residual)["max_abs"]
        assert 17 / 2 < e4 / e8 < 17 * 2, f"INT4/INT8 logit error {e4 / e8:.1f}, expected ~17 (residual {residual})"


@pytest.mark.parametrize("residual", [0, 32])
def test_int8_greedy_tokens_equal_full_precision(small, residual):
    """INT8 moves the logits by less than half the smallest top-2 gap along the trajectory, so no argmax can change;
    the tokens are equal, and the margin check makes sure that is a consequence, not luck."""
    prompt = MarkovLanguage().sample(40, seed=1)[None]
    full = generate(small, prompt, 40, ContiguousCache(1, 80))
    got = generate(small, prompt, 40, QuantizedCache(1, 80, bits=8, group_size=32, residual=residual))
    err = kv_quantization_error.logit_error(small, full[:, :-1], 40, bits=8, group_size=32, residual=residual)
    assert err["min_margin"] > 2 * err["max_abs"], "a near-tie on this trajectory: the comparison would prove nothing"
    assert torch.equal(got, full), f"INT8 (residual {residual}) changed greedy tokens: {got[0, 40:]} vs {full[0, 40:]}"
    # INT4: an argmax may change, but only where the full-precision top two are closer than twice the logit error
    reference = kv_quantization_error.decode_logits(small, full[:, :-1], 40, ContiguousCache(1, 80))
    int4 = kv_quantization_error.decode_logits(small, full[:, :-1], 40, QuantizedCache(1, 80, 4, 32, residual))
    top2 = reference.topk(2, dim=-1).values
    flipped = int4.argmax(-1) != reference.argmax(-1)
    assert (top2[..., 0] - top2[..., 1])[flipped].le(2 * (int4 - reference).abs().max()).all()


def test_per_channel_keys_absorb_an_outlier_channel(small_qkv):
    """A key channel that is the same large number for every token changes no attention weight (softmax ignores a
    score offset shared by all keys) but, per token, it sets every group's step: the other channels lose their
    resolution. Per channel (KIVI), the offset goes into the channel's zero point and nothing else changes."""
    plain = kv_quantization_error.compare_key_modes(small_qkv, bits=4, group_size=32)
    outlier = [(q, k + 4 * k.abs().amax() * torch.eye(k.shape[-1])[7], v) for q, k, v in small_qkv]
    shifted = kv_quantization_error.compare_key_modes(outlier, bits=4, group_size=32)
    for layer in range(len(small_qkv)):
        per_channel = shifted["per_channel"]["attention_error"][layer]
        per_token = shifted["per_token"]["attention_error"][layer]
        assert per_channel == pytest.approx(plain["per_channel"]["attention_error"][layer], rel=1e-3), (
            "per-channel quantization commutes with a per-channel offset: the error must not change"
        )
        assert per_token > 3 * per_channel, (
            f"layer {layer}: with an outlier channel per-token keys err {per_token:.2e}, per-channel {per_channel:.2e}"
        )


# ---------------------------------------------------------------------------------------------------- CacheGen
@pytest.mark.parametrize("coder", ["lzma", "zlib"])
def test_cachegen_beats_plain_quantization_on_smooth_data(coder):
    """Nearby tokens close together (a random walk along tokens: the token-wise locality CacheGen §5 observes in real K/V): deltas from
    the group's anchor, entropy-coded, take fewer bytes than INT4 codes with their scales; each element within its
    bound (half the delta's step, half the anchor's)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 128, 32, generator=g).cumsum(2) * 0.05 + torch.randn(1, 2, 1, 32, generator=g)
    sizes = kv_quantization_error.cachegen_sizes(x, bits=4, tokens_per_group=16, group_size=32, coder=coder)
    assert sizes["cachegen"] < sizes["quantized"] < sizes["raw"], sizes
    c = cachegen_compress(x, 4, 16, coder)
    x_hat = cachegen_decompress(c)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert ((x_hat - x).abs() <= cachegen_error_bound(c) + ROUNDING * x.abs().amax()).all()
    assert sizes["cachegen_worst_ratio"] <= 1 + 1e-4 and sizes["quantized_worst_ratio"] <= 1 + 1e-4


# ---------------------------------------------------------------------------------------------------- transformers
def test_transformers_quanto_cache_side_by_side(small, tmp_path):
    """transformers' QuantizedCache (backend quanto, INT4, groups of 32, window of 32) on the exported model. Ours with
    keys per token and no window quantizes the same tokens the same way: same bytes, same logits. Ours in KIVI's
    configuration keeps the newest 32-63 tokens in full precision: more bytes, smaller error."""
    prompt = MarkovLanguage().sample(64, seed=3)[None]
    r = quanto_side_by_side.hf_side_by_side(small, prompt, 24, tmp_path / "hf", nbits=4, group_size=32, residual=32)
    assert torch.equal(r["tokens"]["hf_full"], r["tokens"]["full"]), "the exported model must generate our tokens"
    assert r["hf_full_vs_full"] < 1e-4
    assert r["bytes"]["as_hf"] == r["bytes"]["hf"], (
        f"same tokens quantized the same way must hold the same bytes: {r['bytes']}"
    )
    assert r["hf_vs_as_hf"] < 1e-4, (
        f"our cache in transformers' configuration moved the logits by {r['hf_vs_as_hf']:.2e}"
    )
    assert r["bytes"]["hf"] < r["bytes"]["kivi"] < r["bytes"]["full"]
    assert r["logit_error"]["kivi"]["max_abs"] < r["logit_error"]["hf"]["max_abs"]
