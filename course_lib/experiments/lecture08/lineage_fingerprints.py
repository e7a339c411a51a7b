"""Lineage from initialisation: a SeedPrints-style fingerprint of the course model (lecture 08b).

SeedPrints (Tong et al. 2025, arXiv:2509.26404) observes that a randomly initialised language model,
fed random tokens, already prefers some output tokens over others, that this preference is fixed
by the initialisation seed, and that enough of it survives training for a rank-correlation test to
tell whether two models grew from the same seed. This file builds that idea at the course's scale,
in its own way:

1. **Probe.** ``n_sequences`` sequences of uniformly random token ids (a fixed generator, so every
   model sees the same probe) of the model's full length.
2. **Fingerprint.** F[i, v] = mean over probe positions whose current token is i of log p(v | context):
   the model's token-selection bias, conditioned on the input token (:func:`fingerprint`).
3. **Compare** a candidate with a reference (:func:`lineage_score`):
   * keep the output tokens in the lowest ``tail_fraction`` of the reference's average log-probability,
     the tokens training has least reason to shape (here: the 48 ids the language never emits);
   * double-centre both tables (remove each row's and each column's mean: the data's unigram and the
     input's overall confidence, which every model trained on the same data shares) and rank the cells;
   * the score is the correlation of the ranks (Spearman's ρ over cells);
   * its null is the same correlation with the candidate's rows and columns shuffled (a stranger's token
     labels carry no relation to the reference's), and ``z`` = (ρ − mean of the null) / its standard
     deviation. Relatives score far out in the null's tail; strangers inside it.

Why the tail and the centring: the course language emits 16 of the 64 ids, so on the other 48 the
data leaves only a common push downwards, and the initialisation's imprint survives (the embedding
rows of never-seen ids get no gradient at all: AdamW's weight decay only shrinks them by 0.5%). On
the 16 emitted tokens every model trained on the
language agrees with every other, relative or not: with them, strangers correlate at ρ ≈ 0.6. This
makes our setting easier than SeedPrints', whose claim is that the bias survives on tokens training
*does* touch; at 64 tokens we lack the statistical power to test that (we tried a 60-symbol
language: relatives and strangers then look alike).

Measured on the course machine (``tiny``, 150 AdamW steps, relatives = same init, different data seed
and learning rate 3e-3 / 1e-2): relatives z 16-29, strangers between −2.7 and +3.6 over 48 pairs;
a 96-wide, 3-layer variant: relatives 6-12; trained on an order-2 language instead: relatives 6-9
(strangers below 2.1 in both); a trained model against its own untrained initialisation: 17-20
(SeedPrints' "birth to lifecycle"). ATEN_CPU_CAPABILITY=default with one thread moves individual
scores by up to ~2 (training rounds differently, see :mod:`course_lib.experiments.lecture08.reproducibility`)
and keeps every verdict of tests/experiments/test_lineage.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.data import MarkovLanguage
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer

__all__ = ["calibrate_threshold", "fingerprint", "lineage_language", "lineage_score", "train_model"]

BATCH, SEQ = 16, 32


def lineage_language() -> MarkovLanguage:
    """Order 1, 16 symbols, concentration 0.1: the tiny model reaches its floor (1.215) in ~150 steps."""
    return MarkovLanguage(order=1, n_symbols=16, concentration=0.1)


def train_model(
    init_seed: int | None,
    data_seed: int,
    lr: float,
    steps: int = 150,
    cfg: ModelConfig | None = None,
    language: MarkovLanguage | None = None,
    start: dict | None = None,
) -> Transformer:
    """A course model trained ``steps`` AdamW steps on ``language`` (batches from ``data_seed``).

    Initialised from ``torch.manual_seed(init_seed)``, or from the state dict ``start`` (a base model
    to fine-tune; ``init_seed`` is then unused and may be None). ``cfg`` defaults to ``tiny``.
    """
    language = lineage_language() if language is None else language
    cfg = configs.get("tiny") if cfg is None else cfg
    if start is None:
        if init_seed is None:
            raise ValueError("give init_seed (a fresh model) or start (a state dict to fine-tune)")
        torch.manual_seed(init_seed)
        model = Transformer(cfg)
    else:
        model = Transformer(cfg)
        model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = small_run.train(model, opt, small_run.batches(steps, BATCH, SEQ, data_seed, lang=language))
    model.final_loss = losses[-1]
    return model


@torch.no_grad()
def fingerprint(model: Transformer, n_sequences: int = 256, seq_len: int | None = None, probe_seed: int = 1234):
    """F [vocab, vocab]: F[i, v] = mean log p(v | context) over the probe positions whose token is i.

    The probe is ``n_sequences`` uniformly random sequences of ``seq_len`` tokens (default: the
    model's ``max_seq_len``, at most 64), drawn from ``probe_seed`` alone. Longer random contexts
    give a stronger signal than single tokens (measured over three families: relatives' z 6-29 at
    64 tokens, 1-22 at one token), presumably because attention then mixes many never-trained
    embeddings. The probe is drawn on the host (the same tokens on every machine) and run on the
    model's device, where F is returned.
    """
    vocab = model.cfg.vocab_size
    seq_len = min(model.cfg.max_seq_len, 64) if seq_len is None else seq_len
    on = next(model.parameters()).device
    # host: a CPU generator and its draw, so every machine probes with the same tokens (moved to `on`)
    g = torch.Generator().manual_seed(probe_seed)
    tokens = torch.randint(0, vocab, (n_sequences, seq_len), generator=g).to(on)  # host: drawn by g, then moved
    was_training = model.training
    model.eval()
    log_p = F.log_softmax(model(tokens).float(), dim=-1).flatten(0, 1)  # [positions, vocab]
    model.train(was_training)
    current = tokens.flatten()
    counts = torch.bincount(current, minlength=vocab).clamp_min(1).unsqueeze(1)
    return torch.zeros(vocab, vocab, device=on).index_add_(0, current, log_p) / counts


def _centred_ranks(table: torch.Tensor) -> torch.Tensor:
    """Double-centre, rank all cells, centre and scale the ranks to unit norm: then Σ a·b is Spearman's ρ."""
    t = table - table.mean(0) - table.mean(1, keepdim=True) + table.mean()
    r = t.flatten().argsort().argsort().double().view(t.shape)
    r = r - r.mean()
    return r / r.norm()


def lineage_score(
    reference: torch.Tensor,
    candidate: torch.Tensor,
    tail_fraction: float = 0.75,
    n_permutations: int = 500,
    seed: int = 0,
) -> dict:
    """{"rho": Spearman's ρ of the centred tail tables, "z": ρ in units of its permutation null,
    "p": the permutation p-value (1 + #{null ≥ ρ}) / (1 + n_permutations)}.

    Asymmetric on purpose: the tail is chosen from the *reference* alone. Choosing it from both
    tables (e.g. by their summed ranks) selects cells where both are low, which makes strangers
    anti-correlated (Berkson's paradox; we saw ρ down to −0.7 that way).
    """
    if reference.shape != candidate.shape or reference.dim() != 2:
        raise ValueError(
            f"fingerprints must be two tables of one shape [vocab, vocab]; got {tuple(reference.shape)} and "
            f"{tuple(candidate.shape)}: fingerprint models with the same vocabulary"
        )
    if not 0 < tail_fraction <= 1:
        raise ValueError(f"tail_fraction={tail_fraction} must be in (0, 1]")
    n_tail = max(2, int(tail_fraction * reference.shape[1]))
    tail = reference.mean(0).argsort()[:n_tail]  # the reference's least likely output tokens
    a, b = _centred_ranks(reference[:, tail]), _centred_ranks(candidate[:, tail])
    rho = float((a * b).sum())
    g = torch.Generator().manual_seed(seed)  # host: a CPU generator, so every machine draws the same null
    null = torch.empty(n_permutations, dtype=torch.float64, device=a.device)
    for k in range(n_permutations):
        # host: drawn by g (above), then moved to the fingerprints' device to index them
        rows, cols = torch.randperm(b.shape[0], generator=g), torch.randperm(b.shape[1], generator=g)
        null[k] = (a * b[rows.to(b.device)][:, cols.to(b.device)]).sum()
    z = (rho - null.mean().item()) / null.std().item()
    p = (1 + int((null >= rho).sum())) / (1 + n_permutations)
    return {"rho": rho, "z": z, "p": p}


def calibrate_threshold(relative_z, stranger_z, margin: float = 2.0) -> float:
    """The decision threshold on z from one calibration family: ``margin`` above its highest stranger.

    Relatives lie far above (z 16-29 in the calibration family), so the threshold is set by the
    strangers, the null: z is measured in null standard deviations, and a handful of strangers
    under-samples the null's tail (8 stranger pairs reach z ≈ 2; 48 reach 3.6), hence the margin
    of 2. Raises if the calibration family itself is not separated with that margin.
    """
    threshold = max(stranger_z) + margin
    if not min(relative_z) > threshold:
        raise ValueError(
            f"calibration failed: the lowest relative z {min(relative_z):.1f} is not above the highest "
            f"stranger z {max(stranger_z):.1f} + margin {margin}; the fingerprint does not separate this family"
        )
    return threshold
