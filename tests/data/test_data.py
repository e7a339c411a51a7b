"""Tests for course_lib.data's language and course_lib.dirichlet: the entropy floor is exact, samples obey it.

Entropies are checked against chains whose entropy rate can be worked out by hand; the Dirichlet
tables against the closed-form mean row entropy; samples against those exact numbers with a stated
statistical tolerance. The windows and batches cut from the samples: tests/data/test_token_dataset.py.
"""

import math
import time

import pytest
import torch

from course_lib import data, dirichlet
from course_lib.data import MarkovLanguage, make_dataset


def h2(p: float) -> float:
    """Binary entropy in nats, written out by hand."""
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


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
    x = dirichlet._log_gamma_variates(shape, n, torch.Generator().manual_seed(0)).exp()
    # Gamma(a, 1) has mean a and variance a. Standard errors: sqrt(a/n) for the mean and
    # a sqrt((2 + 6/a)/n) for the variance (excess kurtosis 6/a); we allow 5 of them.
    assert x.mean().item() == pytest.approx(shape, abs=5 * math.sqrt(shape / n)), "E[Gamma(a)] = a"
    assert x.var().item() == pytest.approx(shape, abs=5 * shape * math.sqrt((2 + 6 / shape) / n)), (
        "Var[Gamma(a)] = a; a wrong Marsaglia-Tsang acceptance test shows up here first"
    )


def test_dirichlet_mean_row_entropy_matches_closed_form():
    n, alpha, rows = 16, 0.3, 20_000
    p = dirichlet.sample_dirichlet(alpha, rows, n, torch.Generator().manual_seed(1))
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
