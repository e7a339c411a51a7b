"""Generation with and without a KV cache (lecture 06): the three paths give the same tokens.

Greedy decoding compares argmaxes. The cached paths compute the same dot products as the full pass
but in other groupings (one query row at a time, keys gathered from blocks, padded columns masked),
so logits differ by a few fp32 ulps; the tokens could differ only where the top two logits are that
close. ``_margins`` measures the smallest top-2 gap along every trajectory compared, and the test
requires it to be far above the logits' rounding error, so equal tokens are a real check.
"""

import pytest
import torch
from model_minis import MLA_MINI

from course_lib.inference.generate import generate
from course_lib.inference.sampling import sample
from course_lib.model.configs import get
from course_lib.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "GQA": ("tiny", dict(max_seq_len=96)),
    "MQA": ("tiny", dict(n_kv_heads=1, max_seq_len=96)),
    "MHA": ("tiny", dict(n_kv_heads=4, max_seq_len=96)),
    "sliding+full": ("tiny", dict(sliding_window=8, full_attention_interval=2, max_seq_len=96)),
    "MLA": ("deepseek-v3", MLA_MINI),
}
PROMPT_LENGTHS = (1, 3, 8, 15, 16, 17, 40)
# fp32 logits of size ~1 summed over <= 96 keys and 64 channels: reorderings move them by ~1e-6
ROUNDING = 1e-6


def _model(name):
    base, overrides = MODELS[name]
    torch.manual_seed(0)
    return Transformer(get(base, **overrides)).eval()


@torch.no_grad()
def _margins(model, tokens, prompt_length):
    """Smallest gap between the two largest logits at the positions that chose the generated tokens."""
    top2 = model(tokens[None, :-1])[0, prompt_length - 1 :].topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min().item()


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_without_cache_contiguous_and_paged(name):
    model = _model(name)
    g = torch.Generator().manual_seed(1)
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(0, 60, (length,), generator=g)
        reference = generate(model, prompt, 24)
        assert _margins(model, reference, length) > 10 * ROUNDING, "a near-tie would make the comparison meaningless"
        for cache in ("contiguous", "paged"):
            got = generate(model, prompt, 24, cache, block_size=8)
            assert torch.equal(got, reference), (
                f"{name}, prompt of {length}: the {cache} cache's greedy tokens differ from recomputing the "
                f"prefix: look at where positions and the mask come from (cache.begin_step, cached_attention_mask)"
            )


def test_batched_prompts_and_the_logits_themselves():
    model = _model("GQA")
    prompts = torch.randint(0, 60, (3, 11), generator=torch.Generator().manual_seed(2))
    reference = generate(model, prompts, 16)
    for cache in ("contiguous", "paged"):
        assert torch.equal(generate(model, prompts, 16, cache), reference)
    # the cached logits equal the full pass's to rounding: same sums, other groupings
    from course_lib.inference.cache import ContiguousCache

    store = ContiguousCache(3, 27)
    with torch.no_grad():
        full = model(reference[:, :-1])
        steps = [model(reference[:, :11], cache=store)]
        steps += [model(reference[:, i : i + 1], cache=store) for i in range(11, 26)]
    assert (torch.cat(steps, 1) - full).abs().max() < 10 * ROUNDING


def test_sampling_is_reproducible_and_equal_across_caches():
    model = _model("GQA")
    prompt = torch.randint(0, 60, (9,), generator=torch.Generator().manual_seed(3))
    runs = {
        cache: generate(model, prompt, 20, cache, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(7))
        for cache in (None, "contiguous", "paged")
    }
    assert torch.equal(runs[None], runs["contiguous"]) and torch.equal(runs[None], runs["paged"])
    greedy = generate(model, prompt, 20)
    assert not torch.equal(runs[None], greedy), "temperature 1 over 20 tokens should leave the greedy path"


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits).item() == 1
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, top_k=1, generator=g).item() for _ in range(20)} == {1}
    # top_p: p(1) = 0.64 alone reaches 0.5, so only token 1 remains
    assert {sample(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(20)} == {1}
    assert {sample(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)} == {1, 3}
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, 1.0, top_p=0.0)


def test_clear_errors():
    model = _model("GQA")
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, torch.zeros(90, dtype=torch.long), 10, "contiguous")
    with pytest.raises(ValueError, match="choose one of"):
        generate(model, torch.zeros(4, dtype=torch.long), 2, "blocks")
    torch.manual_seed(0)
    hybrid = Transformer(
        get(
            "tiny",
            full_attention_interval=2,
            linear_n_k_heads=2,
            linear_n_v_heads=2,
            linear_k_head_dim=16,
            linear_v_head_dim=16,
            linear_conv_kernel=4,
        )
    )
    with pytest.raises(NotImplementedError, match="Gated DeltaNet"):
        generate(hybrid, torch.zeros(4, dtype=torch.long), 2, "contiguous")


def test_a_cache_object_can_be_passed():
    """generate drives any cache whose sequences advance in step (ContiguousCache, QuantizedCache) given ready."""
    from course_lib.inference.cache import ContiguousCache
    from course_lib.inference.paged import PagedCache

    model = _model("GQA")
    prompt = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(4))
    store = ContiguousCache(2, 9 + 12)
    assert torch.equal(generate(model, prompt, 12, store), generate(model, prompt, 12))
    assert len(store) == 9 + 11  # the last token is generated, never fed
    with pytest.raises(ValueError, match="StepCache"):
        generate(model, prompt, 4, PagedCache(8, 16))  # a paged cache needs sequences added: use "paged"
