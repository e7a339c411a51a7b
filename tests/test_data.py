"""Tests for course_lib.data: the entropy floor is exact, samples obey it, batches shard exactly.

Entropies are checked against chains whose entropy rate can be worked out by hand; samples are
checked against those exact numbers with a stated statistical tolerance; the data-parallel batch
property is checked as the identity it promises (concatenated rank batches == global batch).
"""

import math
import time

import pytest
import torch

from course_lib import data
from course_lib.data import MarkovLanguage, TokenDataset, make_dataset
from course_lib.model.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB,
    VOCAB_SIZE,
    decode,
    encode,
    save_hf_tokenizer,
)


def h2(p: float) -> float:
    """Binary entropy in nats, written out by hand."""
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


# ------------------------------------------------------------------------------------------
# vocabulary
# ------------------------------------------------------------------------------------------


def test_vocabulary_layout():
    assert VOCAB_SIZE == 64 and VOCAB_SIZE % 8 == 0, "VOCAB_SIZE is 64, a multiple of 8 (lec. 01)"
    assert len(VOCAB) == VOCAB_SIZE and len(set(VOCAB)) == VOCAB_SIZE, "one distinct string per id"
    assert (BOS_ID, EOS_ID, PAD_ID, UNK_ID) == (60, 61, 62, 63), "special tokens sit after the 60 symbol slots"
    assert all(" " not in t for t in VOCAB), "no spaces inside tokens"


def test_encode_decode_round_trip():
    ids = list(range(VOCAB_SIZE))
    assert encode(decode(ids)) == ids, "encode must invert decode on every id"
    assert decode(torch.tensor([0, 6, EOS_ID])) == "ba de <eos>", "symbol s prints as VOCAB[s]"
    assert encode("  ba\nde   <eos> ") == [0, 6, EOS_ID], "any whitespace separates tokens"


def test_encode_decode_errors_name_the_constraint():
    with pytest.raises(ValueError, match="'xo' is not a token"):
        encode("ba xo")
    with pytest.raises(ValueError, match="0..63"):
        decode([0, 64])
    with pytest.raises(ValueError, match="one sequence"):
        decode(torch.zeros(2, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------
# exact entropy rates of hand-made chains
# ------------------------------------------------------------------------------------------


def test_uniform_transitions_have_entropy_log_n():
    n, order = 4, 2
    lang = MarkovLanguage.from_transitions(torch.full((n**order, n), 1.0 / n))
    assert lang.entropy_rate() == pytest.approx(math.log(n), abs=1e-12), (
        "uniform next-symbol distributions carry log(n) nats per token whatever the context"
    )
    assert lang.entropy_rate_bits() == pytest.approx(2.0, abs=1e-12), "log2(4) = 2 bits"
    for j in range(4):
        assert lang.conditional_entropy(j) == pytest.approx(math.log(n), abs=1e-12)


def test_deterministic_cycle_has_entropy_zero():
    # 0 -> 1 -> 2 -> 0: a periodic chain, the case that plain power iteration cannot solve
    lang = MarkovLanguage.from_transitions(torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]]))
    assert lang.entropy_rate() == pytest.approx(0.0, abs=1e-12), "a deterministic source has H = 0"
    assert lang.stationary.tolist() == pytest.approx([1 / 3] * 3, abs=1e-12), (
        "the cycle spends a third of its time in each state"
    )
    s = lang.sample(50, seed=0)
    assert torch.equal(s[1:], (s[:-1] + 1) % 3), "samples of the cycle must follow 0 -> 1 -> 2 -> 0"


def test_periodic_chain_still_has_a_stationary_distribution():
    # 0 -> 1, 1 -> 0 or 2 (1/2 each), 2 -> 1: period 2. From the uniform start, plain power
    # iteration flips between (1/3, 1/3, 1/3) and (1/6, 2/3, 1/6) for ever.
    p = torch.tensor([[0.0, 1, 0], [0.5, 0, 0.5], [0, 1, 0]], dtype=torch.float64)
    lang = MarkovLanguage.from_transitions(p)
    assert lang.stationary.tolist() == pytest.approx([0.25, 0.5, 0.25], abs=1e-12), (
        "half the time in state 1, a quarter in each of 0 and 2; if the solver oscillates, "
        "it is not iterating the lazy chain (I + T)/2"
    )
    assert lang.entropy_rate() == pytest.approx(0.5 * math.log(2), abs=1e-12), (
        "only state 1 has a choice (log 2 nats) and it holds half the time"
    )


def test_two_state_chain_computed_by_hand():
    # P(0->1) = a, P(1->0) = b.  Balance pi0 a = pi1 b gives pi = (b, a) / (a + b) = (0.75, 0.25).
    a, b = 0.1, 0.3
    p = torch.tensor([[1 - a, a], [b, 1 - b]], dtype=torch.float64)
    lang = MarkovLanguage.from_transitions(p)
    pi0, pi1 = b / (a + b), a / (a + b)
    assert lang.stationary.tolist() == pytest.approx([pi0, pi1], abs=1e-12), "pi0 a = pi1 b"
    expected = pi0 * h2(a) + pi1 * h2(b)  # = 0.75 h(0.1) + 0.25 h(0.3) = 0.3968 nats
    assert lang.entropy_rate() == pytest.approx(expected, abs=1e-12), (
        "H = sum_s pi(s) H(P(.|s)): the entropy of each row weighted by how often its state occurs"
    )
    assert lang.conditional_entropy(0) == pytest.approx(h2(pi0), abs=1e-12), (
        "with no context, the best guess is the stationary marginal: H(X) = h(pi0)"
    )


def test_order_two_xor_chain():
    # next = x_{t-2} XOR x_{t-1} with probability 0.9; context c = 2 x_{t-2} + x_{t-1}
    rows = []
    for c in range(4):
        xor = (c >> 1) ^ (c & 1)
        rows.append([0.9, 0.1] if xor == 0 else [0.1, 0.9])
    lang = MarkovLanguage.from_transitions(torch.tensor(rows, dtype=torch.float64))
    assert lang.order == 2
    assert lang.entropy_rate() == pytest.approx(h2(0.1), abs=1e-12), (
        "every context has the same row entropy h(0.1), so H = h(0.1) whatever pi is"
    )
    assert lang.conditional_entropy(1) == pytest.approx(math.log(2), abs=1e-12), (
        "one symbol of context says nothing about an XOR of two: a bigram model is stuck at log 2"
    )


def test_stationary_distribution_of_default_language():
    lang = MarkovLanguage()
    n, contexts = lang.n_symbols, lang.n_contexts
    # the dense context-to-context matrix, built here independently of the library's bookkeeping:
    # context c = (x_{t-2}, x_{t-1}) = x_{t-2} n + x_{t-1} goes to (x_{t-1}, x) = (c n + x) mod n^2
    dense = torch.zeros(contexts, contexts, dtype=torch.float64)
    for c in range(contexts):
        for x in range(n):
            dense[c, (c * n + x) % contexts] += lang.transition_probs[c, x]
    assert torch.allclose(lang.stationary @ dense, lang.stationary, atol=1e-13, rtol=0), "pi must satisfy pi T = pi"
    assert lang.stationary.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert (lang.stationary > 0).all(), "Dirichlet rows are positive, so every context is visited"


def test_default_language_numbers_in_the_docstring():
    lang = MarkovLanguage()
    assert (lang.order, lang.n_symbols, lang.seed, lang.concentration) == (2, 16, 0, 0.3)
    # the numbers quoted in the module docstring; if the defaults change, update both
    assert lang.entropy_rate() == pytest.approx(1.842, abs=5e-4), "H (nats)"
    assert lang.entropy_rate_bits() == pytest.approx(2.657, abs=5e-4), "H (bits)"
    assert lang.conditional_entropy(0) == pytest.approx(2.766, abs=5e-4), "unigram floor"
    assert lang.conditional_entropy(1) == pytest.approx(2.673, abs=5e-4), "bigram floor"
    assert lang.loss_floor(64) == pytest.approx(1.869, abs=5e-4), "floor of 64-token windows"
    assert 1.5 < lang.entropy_rate() < math.log(16) - 0.5, "well below log(n), not trivial"


def test_conditional_entropies_decrease_to_the_entropy_rate():
    lang = MarkovLanguage(order=3, n_symbols=6, seed=3, concentration=0.5)
    hs = [lang.conditional_entropy(j) for j in range(6)]
    assert all(x >= y - 1e-12 for x, y in zip(hs, hs[1:])), f"conditioning cannot add entropy: {hs}"
    assert hs[3] == pytest.approx(lang.entropy_rate(), abs=1e-12), (
        "with `order` symbols of context, H(X_t | context) is exactly sum_c pi(c) H(P(.|c))"
    )
    assert hs[5] == hs[3], "beyond `order` symbols, older context adds nothing (Markov property)"


def test_loss_floor_counts_the_short_contexts_at_a_window_start():
    lang = MarkovLanguage()
    c = [lang.conditional_entropy(j) for j in range(3)]
    assert lang.loss_floor(1) == pytest.approx(c[0], abs=1e-12), "position 0 sees no context"
    assert lang.loss_floor(3) == pytest.approx((c[0] + c[1] + c[2]) / 3, abs=1e-12)
    assert lang.loss_floor(10_000) == pytest.approx(lang.entropy_rate(), abs=2e-4), (
        "long windows approach H: the excess is (c0 + c1 - 2H) / T"
    )


# ------------------------------------------------------------------------------------------
# drawing tables: Gamma and Dirichlet with a torch.Generator
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [0.3, 2.5])
def test_gamma_variates_have_the_gamma_mean_and_variance(shape):
    n = 200_000
    x = data._log_gamma_variates(shape, n, torch.Generator().manual_seed(0)).exp()
    # Gamma(a, 1) has mean a and variance a. Standard errors: sqrt(a/n) for the mean and
    # a sqrt((2 + 6/a)/n) for the variance (excess kurtosis 6/a); we allow 5 of them.
    assert x.mean().item() == pytest.approx(shape, abs=5 * math.sqrt(shape / n)), "E[Gamma(a)] = a"
    assert x.var().item() == pytest.approx(shape, abs=5 * shape * math.sqrt((2 + 6 / shape) / n)), (
        "Var[Gamma(a)] = a; a wrong Marsaglia-Tsang acceptance test shows up here first"
    )


def test_dirichlet_mean_row_entropy_matches_closed_form():
    n, alpha, rows = 16, 0.3, 20_000
    p = data.sample_dirichlet(alpha, rows, n, torch.Generator().manual_seed(1))
    assert torch.allclose(p.sum(1), torch.ones(rows, dtype=torch.float64)), "rows must sum to 1"
    mean_h = data._entropy(p).mean().item()
    psi = torch.special.digamma
    expected = (psi(torch.tensor(n * alpha + 1.0)) - psi(torch.tensor(alpha + 1.0))).item()
    # E[H] = psi(n a + 1) - psi(a + 1) for a symmetric Dirichlet; row entropies have SD ~0.25,
    # so the mean of 20,000 has SE ~0.002 and 0.01 is 5 SE.
    assert mean_h == pytest.approx(expected, abs=0.01), (
        f"mean row entropy {mean_h:.4f} vs closed form {expected:.4f}: the Dirichlet draw is off"
    )


# ------------------------------------------------------------------------------------------
# samples obey the exact numbers
# ------------------------------------------------------------------------------------------


def empirical_conditional_entropy(s: torch.Tensor, n: int, j: int) -> float:
    """Plug-in estimate of H(X_t | previous j tokens) = H(block of j+1) - H(block of j)."""
    m = s.numel() - j
    code = torch.zeros(m, dtype=torch.long)
    for i in range(j + 1):
        code = code * n + s[i : i + m]
    joint = torch.bincount(code, minlength=n ** (j + 1)).double()
    context = joint.view(n**j, n).sum(1)
    return (data._entropy(joint / m) - data._entropy(context / m)).item()


def test_empirical_conditional_entropy_approaches_the_exact_value():
    lang = MarkovLanguage()
    s = lang.sample(1_000_000, seed=5)
    assert s.dtype == torch.long and s.min() >= 0 and s.max() < lang.n_symbols
    # Tolerance 0.01 nats: the plug-in estimator is biased low by about (cells - contexts)/(2N)
    # = (4096 - 256)/2e6 = 0.002 for j = 2, and its sampling SD at N = 1e6 is ~0.001 (the chain
    # mixes in a few steps, so the tokens are nearly independent draws given their context).
    for j in range(3):
        exact = lang.conditional_entropy(j)
        seen = empirical_conditional_entropy(s, lang.n_symbols, j)
        assert seen == pytest.approx(exact, abs=0.01), (
            f"with {j} tokens of context a 1M-token sample has {seen:.4f} nats, the exact value is "
            f"{exact:.4f}: sample() does not draw from transition_probs, or pi is wrong"
        )


def test_first_tokens_follow_the_stationary_marginal():
    lang = MarkovLanguage(order=2, n_symbols=4, seed=2, concentration=0.3)
    runs = 4000
    first = torch.stack([lang.sample(1, seed=s) for s in range(runs)]).flatten()
    freq = torch.bincount(first, minlength=4).double() / runs
    marginal = lang.stationary.view(4, 4).sum(1)  # oldest symbol of the context
    se = (marginal * (1 - marginal) / runs).sqrt()
    assert ((freq - marginal).abs() <= 5 * se + 1e-12).all(), (
        f"first tokens {freq.tolist()} vs stationary {marginal.tolist()}: a sample must start "
        "from pi, or the start of every stream is off-distribution"
    )


def test_sampling_is_deterministic_per_seed_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b = MarkovLanguage(seed=7), MarkovLanguage(seed=7)
    assert torch.equal(a.transition_probs, b.transition_probs), "same seed, same language"
    assert not torch.equal(a.transition_probs, MarkovLanguage(seed=8).transition_probs)
    assert torch.equal(a.sample(1000, seed=1), b.sample(1000, seed=1)), "same seed, same sample"
    assert not torch.equal(a.sample(1000, seed=1), a.sample(1000, seed=2)), "seeds must differ"
    assert torch.equal(a.sample(300, seed=1), a.sample(1000, seed=1)[:300]), "a prefix is a prefix"
    list(make_dataset(a, 2000, 16, seed=0).batches(4))
    assert torch.equal(torch.get_rng_state(), state), (
        "course_lib.data must use its own torch.Generator, never the global RNG: the model's "
        "initialisation would otherwise depend on how much data was drawn first"
    )


def test_a_million_tokens_is_fast():
    lang = MarkovLanguage()
    start = time.perf_counter()
    lang.sample(1_000_000, seed=0)
    seconds = time.perf_counter() - start
    assert seconds < 3.0, f"1M tokens took {seconds:.2f} s (about 0.3 s expected on 2 cores)"


def test_language_errors_name_the_constraint():
    with pytest.raises(ValueError, match="MAX_CONTEXTS"):
        MarkovLanguage(order=4, n_symbols=16)
    with pytest.raises(ValueError, match="n_symbols must be an int in 2..60"):
        MarkovLanguage(n_symbols=61)
    with pytest.raises(ValueError, match="concentration must be a positive"):
        MarkovLanguage(concentration=0.0)
    with pytest.raises(ValueError, match="seed must be an int"):
        MarkovLanguage(seed=-1)
    with pytest.raises(ValueError, match="not a power of n_symbols"):
        MarkovLanguage.from_transitions(torch.full((5, 2), 0.5))
    with pytest.raises(ValueError, match="probability distribution"):
        MarkovLanguage.from_transitions(torch.full((2, 2), 0.6))


# ------------------------------------------------------------------------------------------
# datasets, shards, data-parallel batches
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return make_dataset(MarkovLanguage(), n_tokens=24 * 16 + 1, seq_len=16, seed=0)  # 24 sequences


def test_make_dataset_windows_are_the_stream_shifted_by_one():
    lang = MarkovLanguage()
    ds = make_dataset(lang, n_tokens=1000, seq_len=32, seed=3)
    stream = lang.sample(1000, seed=3)
    assert ds.inputs.shape == (999 // 32, 32) and ds.seq_len == 32
    assert torch.equal(ds.inputs.flatten(), stream[: ds.inputs.numel()]), "inputs tile the stream"
    assert torch.equal(ds.targets.flatten(), stream[1 : ds.inputs.numel() + 1]), (
        "targets[i, t] must be the token after inputs[i, t]"
    )
    x, y = ds[0]
    assert torch.equal(x[1:], y[:-1])
    with pytest.raises(ValueError, match="at least seq_len \\+ 1"):
        make_dataset(lang, n_tokens=32, seq_len=32, seed=0)


def test_shards_are_disjoint_and_complete(dataset):
    for world in (1, 2, 3, 4, 6):
        shards = [dataset.shard(r, world) for r in range(world)]
        assert all(len(s) == len(dataset) // world for s in shards), "equal shards, or ranks hang"
        assert torch.equal(torch.cat([s.inputs for s in shards]), dataset.inputs), (
            f"at world_size={world} the shards in rank order must be the dataset, each row once"
        )
        assert torch.equal(torch.cat([s.targets for s in shards]), dataset.targets)


def test_shard_refuses_an_uneven_split_unless_asked(dataset):
    uneven = "24 sequences cannot be split evenly over world_size=5"
    with pytest.raises(ValueError, match=uneven) as e:
        dataset.shard(0, 5)
    assert "drop_last=True" in str(e.value), "the error must name the way out"
    shards = [dataset.shard(r, 5, drop_last=True) for r in range(5)]
    assert torch.equal(torch.cat([s.inputs for s in shards]), dataset.inputs[:20]), (
        "drop_last drops the last n_seq mod world_size sequences, nothing else"
    )
    with pytest.raises(ValueError, match="rank must be an int in 0..world_size-1"):
        dataset.shard(2, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_batches_concatenate_to_the_single_process_batch(dataset, world_size):
    batch_size = 2  # global batch 2 * world_size; 24 sequences -> 12, 6, 4, 3 steps per epoch
    global_batches = list(dataset.batches(batch_size * world_size, seed=11, epochs=2))
    per_rank = [list(dataset.batches(batch_size, r, world_size, seed=11, epochs=2)) for r in range(world_size)]
    assert all(len(b) == len(global_batches) for b in per_rank), "every rank runs the same steps"
    for step, (gx, gy) in enumerate(global_batches):
        x = torch.cat([per_rank[r][step][0] for r in range(world_size)])
        y = torch.cat([per_rank[r][step][1] for r in range(world_size)])
        assert torch.equal(x, gx) and torch.equal(y, gy), (
            f"step {step}: the {world_size} rank batches, concatenated in rank order, must equal "
            f"the single-process batch of {batch_size * world_size}; DDP is checked against "
            "single-process training on exactly this identity"
        )


def test_an_epoch_visits_each_sequence_at_most_once(dataset):
    rows = {tuple(r) for r in dataset.inputs.tolist()}
    assert len(rows) == len(dataset), "fixture sequences should be distinct for this test"
    for epoch_batches in (list(dataset.batches(5, seed=0)), list(dataset.batches(8, seed=0))):
        seen = [tuple(r) for x, _ in epoch_batches for r in x.tolist()]
        assert len(seen) == len(set(seen)), "within an epoch no sequence may repeat"
        assert set(seen) <= rows
    assert len(list(dataset.batches(5))) == 24 // 5, "the last incomplete global batch is dropped"
    two_epochs = list(dataset.batches(8, seed=0, epochs=2))  # 3 steps each
    e1, e2 = two_epochs[:3], two_epochs[3:]
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(e1, e2)), "each epoch reshuffles"


def test_batches_are_deterministic_and_seeded(dataset):
    def first(seed, **kw):
        return next(iter(dataset.batches(4, seed=seed, **kw)))[0]

    assert torch.equal(first(1), first(1)), "same seed, same batches"
    assert not torch.equal(first(1), first(2)), "different seeds must shuffle differently"
    assert torch.equal(first(1, shuffle=False), dataset.inputs[:4]), "shuffle=False keeps order"
    forever = dataset.batches(12, epochs=None)
    assert len([next(forever) for _ in range(7)]) == 7, "epochs=None never stops"


def test_batch_errors_name_the_constraint(dataset):
    with pytest.raises(ValueError, match="global batch batch_size \\* world_size = 8 \\* 4 = 32"):
        next(iter(dataset.batches(8, rank=0, world_size=4)))
    with pytest.raises(ValueError, match="rank must be an int in 0..world_size-1 = 0..1"):
        next(iter(dataset.batches(2, rank=2, world_size=2)))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        next(iter(dataset.batches(0)))


# ------------------------------------------------------------------------------------------
# Hugging Face tokenizer
# ------------------------------------------------------------------------------------------


def test_hf_tokenizer_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    save_hf_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(tok) == VOCAB_SIZE, "the HF tokenizer must have exactly the course vocabulary"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        UNK_ID,
    ), "special token ids must match course_lib's"
    sample = MarkovLanguage().sample(200, seed=0).tolist() + [EOS_ID, BOS_ID, 3]
    text = decode(sample)
    assert tok.encode(text) == encode(text) == sample, (
        "AutoTokenizer must give course_lib's ids, with no <bos> added: vLLM and transformers "
        "generation are compared token by token against course_lib"
    )
    assert tok.decode(sample) == text, "HF decode must print the same text as course_lib.decode"
    assert tok.encode("ba xo") == [0, UNK_ID], "HF maps unknown words to <unk> (course_lib raises)"


def test_hf_tokenizer_padded_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    save_hf_tokenizer(tmp_path / "tok", vocab_size=72)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(tok) == 72 and tok.convert_ids_to_tokens(71) == "<reserved_71>", (
        "ids past VOCAB_SIZE in a padded embedding become reserved special tokens"
    )
    assert tok.encode("ba de") == [0, 6]
    with pytest.raises(ValueError, match="vocab_size must be an int >= VOCAB_SIZE = 64"):
        save_hf_tokenizer(tmp_path / "bad", vocab_size=32)
