"""The course data: a synthetic language whose entropy rate is known exactly.

Real text has no known floor: nobody knows the entropy of English, so a falling loss curve never
says how far it still has to go. The course trains on a random order-k Markov source instead. Its
entropy rate H (nats per token) is computed exactly below, and no model's expected cross-entropy on
the source can be below H (cross-entropy = H + a KL divergence >= 0), so every training curve in
the course is plotted against a line it can approach but, up to sampling noise, never cross
(lecture 01: AdamW vs SGD+momentum against the floor).

Reading order: ``MarkovLanguage`` (the source, its transition table drawn from a Dirichlet by
:mod:`course_lib.dirichlet`, its stationary distribution, its entropies, sampling) -> ``TokenDataset``
(next-token windows, sharding, data-parallel batches). The vocabulary, its text form and its Hugging
Face tokenizer are in :mod:`course_lib.model.tokenizer`. Tested in tests/data/test_data.py (the language)
and tests/data/test_token_dataset.py (windows and batches).

Vocabulary (:mod:`course_lib.model.tokenizer`): 64 ids, of which 0..59 are symbol slots; a language with
n_symbols = m emits symbol s as token id s, so it uses ids 0..m-1. Sixty slots let a lecture build a harder language (more symbols) without changing the model's
vocabulary; ids a language never emits cost the model nothing at the floor, it learns to give them
probability ~0 within the first few dozen steps. Samples contain symbols only: the source is
stationary, so a window cut anywhere in a stream needs no <bos>.

Default language, ``MarkovLanguage()``: order 2, 16 symbols (256 contexts), Dirichlet concentration
0.3, seed 0. Entropy rate 1.842 nats/token (2.657 bits), against log(16) = 2.773 for uniform
symbols; a unigram model's floor is 2.766 and a bigram model's 2.673, so a model must use two tokens
of context to get near 1.842. Measured on the course's 2-core CPU machine: a 0.82M-parameter
decoder-only transformer (4 layers, width 128, 4 heads, learned positions), AdamW lr 3e-3 with 30
warm-up steps, batch 32 x 64 tokens, sits on the bigram plateau (~2.67) for ~150 steps, then drops;
its validation loss is within 0.1 nats of the window floor ``loss_floor(64)`` = 1.869 after ~350
steps (~25 s) and within 0.03 after 800.

Everything here lives on the host: the language is drawn with CPU generators, so every machine (a
laptop, a GPU node) gets the same tokens bit for bit, and ``TokenDataset.batches`` yields CPU
tensors. The caller moves each batch to its rank's device, ``x.to(course_lib.dist.device())``.
"""

# device-guard: host-only: the language and its batches are drawn on the host so any machine gets the same tokens; callers move batches to course_lib.dist.device()

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator

import torch

from course_lib.dirichlet import sample_dirichlet
from course_lib.model.tokenizer import N_SYMBOL_SLOTS, VOCAB_SIZE

# ----------------------------------------------------------------------------------------------
# Randomness: one torch.Generator per use, never the global RNG
# ----------------------------------------------------------------------------------------------

# Each use of randomness gets its own stream, so MarkovLanguage(seed=0).sample(n, seed=0) does not
# reuse the bits that drew the transition table, and no call here moves torch's global RNG.
_STREAM_TABLE, _STREAM_SAMPLE, _STREAM_SHUFFLE = range(3)
_N_STREAMS = 3


def _generator(seed: int, stream: int) -> torch.Generator:
    if not isinstance(seed, int) or not 0 <= seed < 2**60:
        raise ValueError(f"seed must be an int in [0, 2**60), got {seed!r}")
    return torch.Generator().manual_seed(seed * _N_STREAMS + stream)


# ----------------------------------------------------------------------------------------------
# The language: a random order-k Markov source
# ----------------------------------------------------------------------------------------------

MAX_CONTEXTS = 4096


def _entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """H(p) = -sum_i p_i log p_i in nats, with 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(dim)


class MarkovLanguage:
    """A stationary order-k Markov source over ``n_symbols`` symbols (token ids 0..n_symbols-1).

    A context is the last k symbols (x_{t-k}, ..., x_{t-1}), stored as the base-n number
    c = sum_i x_{t-k+i} n^(k-1-i) (oldest symbol most significant), so the next context after
    emitting x is (c n + x) mod n^k. ``transition_probs[c, x]`` = P(x_t = x | context c); each row
    is drawn from a symmetric Dirichlet(concentration) with a torch.Generator seeded by ``seed``.
    Dirichlet draws are positive, so every context reaches every other in k steps: the chain on
    contexts is irreducible and aperiodic and has one stationary distribution pi. (At a tiny
    concentration some probabilities underflow to 0 in float64; the solver's convergence check
    is what guards that case.)

    Entropy rate (Cover & Thomas, Elements of Information Theory, Thm 4.2.4):
        H = sum_c pi(c) H(P(. | c)),   H(p) = -sum_x p(x) log p(x)  (nats/token).

    Defaults give H = 1.842 nats (see the module docstring for what a small model reaches).
    """

    def __init__(self, order: int = 2, n_symbols: int = 16, seed: int = 0, concentration: float = 0.3):
        if not isinstance(order, int) or order < 0:
            raise ValueError(f"order must be an int >= 0 (symbols of context), got {order!r}")
        if not isinstance(n_symbols, int) or not 2 <= n_symbols <= N_SYMBOL_SLOTS:
            raise ValueError(
                f"n_symbols must be an int in 2..{N_SYMBOL_SLOTS} (the symbol slots of a "
                f"VOCAB_SIZE={VOCAB_SIZE} vocabulary), got {n_symbols!r}"
            )
        if n_symbols**order > MAX_CONTEXTS:
            raise ValueError(
                f"n_symbols**order = {n_symbols}**{order} = {n_symbols**order} contexts, more than "
                f"MAX_CONTEXTS = {MAX_CONTEXTS}: the stationary distribution is solved over all "
                "contexts and a small model could not learn that many; lower order or n_symbols."
            )
        if not (isinstance(concentration, (int, float)) and 0 < concentration < math.inf):
            raise ValueError(
                f"concentration must be a positive finite number, got {concentration!r} "
                "(try 0.1 for a peaked, low-entropy language, 1.0 for a flatter one)"
            )
        probs = sample_dirichlet(float(concentration), n_symbols**order, n_symbols, _generator(seed, _STREAM_TABLE))
        self.seed = seed
        self.concentration = float(concentration)
        self._setup(probs, order)

    @classmethod
    def from_transitions(cls, transition_probs: torch.Tensor) -> MarkovLanguage:
        """A language with a hand-made table [n_symbols**order, n_symbols] (order is inferred).

        For tests and lectures: uniform rows give H = log n, a deterministic cycle gives H = 0.
        The table should make the context chain irreducible (one stationary distribution);
        otherwise pi, and so H, is the one reached from the uniform start.
        """
        p = torch.as_tensor(transition_probs, dtype=torch.float64)
        if p.dim() != 2 or p.shape[1] < 2:
            raise ValueError(
                f"transition_probs must be [n_symbols**order, n_symbols] with n_symbols >= 2, "
                f"got shape {tuple(p.shape)}"
            )
        n_contexts, n = p.shape
        order = round(math.log(n_contexts, n))
        if n**order != n_contexts:
            raise ValueError(
                f"transition_probs has {n_contexts} rows, which is not a power of n_symbols = {n}; "
                "row c is the context (x_{t-k}..x_{t-1}) read as a base-n number, so it needs "
                "n**order rows."
            )
        if n > N_SYMBOL_SLOTS or n_contexts > MAX_CONTEXTS:
            raise ValueError(
                f"need n_symbols <= {N_SYMBOL_SLOTS} and n_symbols**order <= {MAX_CONTEXTS}, "
                f"got {n} symbols and {n_contexts} contexts"
            )
        if (p < 0).any() or not torch.allclose(p.sum(1), torch.ones(n_contexts, dtype=p.dtype)):
            raise ValueError(
                "each row of transition_probs must be a probability distribution (non-negative, summing to 1)"
            )
        # Rows typed as float32 (0.9 + 0.1 != 1 in float64) would leak mass in every step of the
        # float64 power iteration and stop it converging, so make them sum to 1 in float64.
        p = p / p.sum(1, keepdim=True)
        lang = cls.__new__(cls)
        lang.seed, lang.concentration = None, None
        lang._setup(p, order)
        return lang

    def _setup(self, probs: torch.Tensor, order: int) -> None:
        self.order = order
        self.n_symbols = probs.shape[1]
        self.n_contexts = probs.shape[0]
        self.transition_probs = probs  # float64 [n_contexts, n_symbols]
        contexts = torch.arange(self.n_contexts).unsqueeze(1)
        # next_context[c, x]: the context after emitting x in context c
        symbols = torch.arange(self.n_symbols)
        self.next_context = (contexts * self.n_symbols + symbols) % self.n_contexts
        self.stationary = self._solve_stationary()

    def _solve_stationary(self, tol: float = 1e-14, max_iters: int = 200_000) -> torch.Tensor:
        """pi with pi T = pi, by power iteration in float64 on the context chain T.

        One step moves the mass pi(c) P(x|c) from c to next_context[c, x]. We iterate the lazy
        chain (I + T)/2: same stationary distribution, but aperiodic even when T is not (the
        period-2 chain in the tests), so the iteration converges instead of oscillating.
        """
        pi = torch.full((self.n_contexts,), 1.0 / self.n_contexts, dtype=torch.float64)
        for _ in range(max_iters):
            new = 0.5 * (pi + self._step(pi))
            change = (new - pi).abs().sum().item()
            pi = new
            if change < tol:
                break
        residual = (self._step(pi) - pi).abs().sum().item()
        if not residual < 1e-10:
            raise RuntimeError(
                f"power iteration did not converge: |pi T - pi|_1 = {residual:.2e} after "
                f"{max_iters} iterations; the chain mixes too slowly or is reducible "
                "(concentration too low?): raise concentration."
            )
        return pi / pi.sum()

    def _step(self, pi: torch.Tensor) -> torch.Tensor:
        """pi T: the law of the next context when the current one has law pi."""
        mass = (pi[:, None] * self.transition_probs).flatten()
        return torch.zeros_like(pi).index_add_(0, self.next_context.flatten(), mass)

    # -- entropies --------------------------------------------------------------------------

    def entropy_rate(self) -> float:
        """H = sum_c pi(c) H(P(. | c)) in nats per token: the floor of the mean cross-entropy."""
        return float((self.stationary * _entropy(self.transition_probs)).sum())

    def entropy_rate_bits(self) -> float:
        """The entropy rate in bits per token: H / ln 2."""
        return self.entropy_rate() / math.log(2)

    def conditional_entropy(self, context_len: int) -> float:
        """H(X_t | X_{t-j}, ..., X_{t-1}) for j = context_len, in nats, under the stationary law.

        The floor of a model that sees only the last j tokens: j = 0 is the unigram floor,
        j >= order the entropy rate. Computed as a difference of block entropies,
        H(X_{t-j..t}) - H(X_{t-j..t-1}), where the joint law of k+1 consecutive symbols is
        pi(c) P(x|c) and shorter blocks are its marginals (stationarity makes any k+1-block do).
        """
        if not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len must be an int >= 0, got {context_len!r}")
        j = min(context_len, self.order)
        k, n = self.order, self.n_symbols
        joint = (self.stationary[:, None] * self.transition_probs).reshape((n,) * (k + 1))

        def block_entropy(m: int) -> float:  # entropy of the last m symbols of the k+1 block
            if m == 0:
                return 0.0
            marginal = joint.sum(dim=tuple(range(k + 1 - m))) if m < k + 1 else joint
            return float(_entropy(marginal.flatten()))

        return block_entropy(j + 1) - block_entropy(j)

    def loss_floor(self, seq_len: int) -> float:
        """The lowest mean cross-entropy a model can reach on windows of ``seq_len`` tokens.

        Position t of a window sees only t earlier tokens, so for t < order its floor is
        conditional_entropy(t), higher than H:
            floor(T) = (1/T) sum_{t=0}^{T-1} conditional_entropy(min(t, order)).
        This is the line to plot under a training curve on ``make_dataset(..., seq_len=T)``.
        """
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        short = [self.conditional_entropy(t) for t in range(min(seq_len, self.order))]
        return (sum(short) + (seq_len - len(short)) * self.entropy_rate()) / seq_len

    # -- sampling ---------------------------------------------------------------------------

    def sample(self, n_tokens: int, seed: int) -> torch.Tensor:
        """One stationary stream of ``n_tokens`` token ids (LongTensor), deterministic per seed.

        The first context is drawn from pi, so every position has the stationary law and a window
        cut anywhere is as good as any other. Then x_t = F_c^{-1}(u_t), the inverse CDF of the
        current context's row at a uniform u_t. A Markov chain is sequential, so the loop is plain
        Python over pre-drawn uniforms with bisect on small lists (~0.4 s per 1M tokens), which
        beats per-step torch calls by ~10x.
        """
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
        k, n = self.order, self.n_symbols
        generator = _generator(seed, _STREAM_SAMPLE)
        u = torch.rand(n_tokens + 1, generator=generator, dtype=torch.float64).tolist()
        cdf = self.transition_probs.cumsum(1)
        cdf[:, -1] = 1.0  # rounding may leave the last entry at 1 - 1e-16; u < 1 must land inside
        cdf_rows = cdf.tolist()
        pi_cdf = self.stationary.cumsum(0)
        pi_cdf[-1] = 1.0
        context = bisect.bisect_right(pi_cdf.tolist(), u[0])
        first = [(context // n ** (k - 1 - i)) % n for i in range(k)]  # its digits, oldest first
        out = first[:n_tokens] + [0] * max(0, n_tokens - k)
        for t in range(k, n_tokens):
            x = bisect.bisect_right(cdf_rows[context], u[t + 1])
            out[t] = x
            context = (context * n + x) % self.n_contexts
        return torch.tensor(out, dtype=torch.long)

    def __repr__(self) -> str:
        return (
            f"MarkovLanguage(order={self.order}, n_symbols={self.n_symbols}, seed={self.seed}, "
            f"concentration={self.concentration})  # entropy rate {self.entropy_rate():.4f} nats"
        )


# ----------------------------------------------------------------------------------------------
# Next-token windows, sharding and data-parallel batches
# ----------------------------------------------------------------------------------------------


class TokenDataset(torch.utils.data.Dataset):
    """Windows for next-token prediction: ``inputs`` and ``targets`` LongTensors [n_seq, seq_len],
    ``targets[i, t]`` the token after ``inputs[i, t]``."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if inputs.dim() != 2 or inputs.shape != targets.shape:
            raise ValueError(
                "inputs and targets must both be [n_seq, seq_len], got "
                f"{tuple(inputs.shape)} and {tuple(targets.shape)}"
            )
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i], self.targets[i]

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[1]

    def shard(self, rank: int, world_size: int, drop_last: bool = False) -> TokenDataset:
        """Rank ``rank``'s contiguous block of n_seq / world_size sequences.

        Every sequence is in exactly one shard. Unequal shards would make ranks run different
        numbers of steps and hang in a collective, so a count that world_size does not divide is
        an error unless ``drop_last=True`` drops the last n_seq mod world_size sequences.
        """
        _check_rank(rank, world_size)
        n = len(self)
        if n % world_size and not drop_last:
            raise ValueError(
                f"{n} sequences cannot be split evenly over world_size={world_size} "
                f"({n} mod {world_size} = {n % world_size}): make a dataset whose size "
                f"world_size divides, or call shard(rank, world_size, drop_last=True) to drop "
                f"the last {n % world_size}."
            )
        per_rank = n // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return TokenDataset(self.inputs[rows], self.targets[rows])

    def batches(
        self,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        epochs: int | None = 1,
        shuffle: bool = True,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield (x, y) of [batch_size, seq_len]: rank ``rank``'s part of each global batch.

        Each epoch draws one permutation of all sequences from ``seed`` alone (every rank draws
        the same one) and cuts it into global batches of G = batch_size * world_size; rank r takes
        rows [r * batch_size, (r + 1) * batch_size) of each. So the global batches depend only on
        (seed, G): torch.cat of the W ranks' batches at step s equals step s of
        ``batches(G, rank=0, world_size=1, seed)``, and data-parallel training at any world size
        sees exactly the batches of single-process training (lecture 02 checks DDP against it;
        lecture 08b reshards a resumed run to another world size). A last, incomplete global
        batch is dropped: it could not be split evenly. ``epochs=None`` repeats forever; to resume
        at step s, ``itertools.islice(ds.batches(...), s, None)``.
        """
        _check_rank(rank, world_size)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be an int >= 1 or None (forever), got {epochs!r}")
        global_batch = batch_size * world_size
        n = len(self)
        steps_per_epoch = n // global_batch
        if steps_per_epoch == 0:
            raise ValueError(
                f"the global batch batch_size * world_size = {batch_size} * {world_size} = "
                f"{global_batch} is larger than the dataset ({n} sequences): make more sequences "
                "or use a smaller batch."
            )
        generator = _generator(seed, _STREAM_SHUFFLE)
        epoch = 0
        while epochs is None or epoch < epochs:
            order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
            for step in range(steps_per_epoch):
                start = step * global_batch + rank * batch_size
                rows = order[start : start + batch_size]
                yield self.inputs[rows], self.targets[rows]
            epoch += 1


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in 0..world_size-1 = 0..{world_size - 1}, got {rank!r}")


def make_dataset(lang: MarkovLanguage, n_tokens: int, seq_len: int, seed: int) -> TokenDataset:
    """Cut one stream ``lang.sample(n_tokens, seed)`` into (n_tokens - 1) // seq_len windows.

    Window i is inputs = stream[i T : (i+1) T], targets = stream[i T + 1 : (i+1) T + 1] (T =
    seq_len): windows do not overlap, each token is a target at most once, and leftover tokens
    at the end are dropped. Use different seeds for the training and validation sets.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if not isinstance(n_tokens, int) or n_tokens < seq_len + 1:
        raise ValueError(
            f"n_tokens must be at least seq_len + 1 = {seq_len + 1} (a window's targets are its "
            f"inputs shifted by one), got {n_tokens!r}"
        )
    stream = lang.sample(n_tokens, seed)
    n_seq = (n_tokens - 1) // seq_len
    used = n_seq * seq_len
    inputs = stream[:used].view(n_seq, seq_len)
    targets = stream[1 : used + 1].view(n_seq, seq_len)
    return TokenDataset(inputs, targets)
