"""One small training run for every experiment: the data factory and the loop.

The lectures' experiments train the course model for tens to hundreds of steps on the synthetic
language of :mod:`course_lib.data` (a Markov chain with a known entropy rate, so a loss can be set
beside its floor). Their data and their loop are written here once:

* :func:`windows` — ``n_sequences`` windows of ``seq_len`` tokens cut from one stream of the language;
* :func:`batches` — the first ``steps`` global batches of such windows (a rank's share of each when
  ``world_size`` > 1), the order drawn from ``seed``: data-parallel ranks together see exactly the
  batches one process sees (:meth:`course_lib.data.TokenDataset.batches`);
* :data:`RECIPE`, :func:`quality_language`, :func:`floor_lines`, :func:`check_learned` — the one recipe
  for every run whose point is training *quality*: a language, a model, an optimizer and a step count
  that get well below the language's bigram floor in a few seconds on 2 cores, the floors drawn on the
  plot, and the check that the run learned context (its loss ends below the bigram floor);
* :func:`peaked_language` — the language lecture 08's runs learn (one token of context, peaked
  transitions: a healthy run reaches its floor in ~100 steps, a damaged one is told apart);
* :func:`train` — the loop: for each batch the objective, ``zero_grad``, ``backward``, an optional
  look at the gradients, the optimizer's step, an optional scheduler step; it returns the loss of
  every step. Hooks let a run add what it is about (distillation's objective, autocast around the
  forward, clipping, per-step records) without writing its own loop.

A run that wraps the whole step in something (a counter of the bytes sent, a trace of the
collectives, a framework's own backward) keeps its own loop and says why in its docstring; it
still takes its batches from :func:`batches`. Tested in tests/experiments/test_small_run.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from course_lib.data import MarkovLanguage, TokenDataset, make_dataset
from course_lib.model import configs
from course_lib.model.config import ModelConfig

__all__ = [
    "RECIPE",
    "Recipe",
    "batches",
    "check_learned",
    "final_loss",
    "floor_lines",
    "peaked_language",
    "quality_language",
    "train",
    "windows",
]


# ----------------------------------------------------------------------------------------------
# The recipe for runs whose point is training quality
# ----------------------------------------------------------------------------------------------


def quality_language() -> MarkovLanguage:
    """Order 2 over 8 symbols, Dirichlet concentration 0.1, seed 0: the language of every quality run.

    Its floors (nats/token): unigram 2.010, bigram 1.682, entropy rate 0.717 (0.788 on 32-token
    windows). A model that learns only token frequencies stops at the unigram floor, one that reads
    one token back at the bigram floor; only a model that uses both tokens of context, through
    attention and the MLPs, gets below 1.682. The course's default language (16 symbols,
    concentration 0.3) keeps the ``tiny`` model on its unigram/bigram plateau for ~150 steps, so a
    30-step run there measures nothing but the output head's frequency table; on this one
    :data:`RECIPE` is below the bigram floor by step ~40 and near 1.0 by step 100.
    """
    return MarkovLanguage(order=2, n_symbols=8, concentration=0.1)


@dataclass(frozen=True)
class Recipe:
    """The training recipe of the quality runs: the ``config`` model at ``seq_len`` tokens, AdamW at
    ``lr`` (no decay, no warm-up), ``steps`` global batches of ``batch`` windows of :func:`quality_language`.

    Measured on the course's 2-core CPU (``tests/experiments/test_quality_runs.py`` holds it): the
    ``tiny`` model (2 layers, width 64, 106,816 parameters) takes ~1.3 s for the 100 steps and ends
    near 1.0 nats, 0.7 below the bigram floor, with a seed-to-seed spread of a few hundredths.
    """

    steps: int = 100
    batch: int = 16
    seq_len: int = 32
    lr: float = 3e-3
    config: str = "tiny"

    def model_config(self, **overrides) -> ModelConfig:
        """The model's config: ``configs.get(config, max_seq_len=seq_len, **overrides)``."""
        return configs.get(self.config, **{"max_seq_len": self.seq_len, **overrides})

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr)

    def batches(self, seed: int, *, rank: int = 0, world_size: int = 1, steps: int | None = None) -> list:
        """:func:`batches` of :func:`quality_language` with this recipe's sizes (``steps`` overrides)."""
        n = self.steps if steps is None else steps
        return batches(n, self.batch, self.seq_len, seed, lang=quality_language(), rank=rank, world_size=world_size)


RECIPE = Recipe()


def floor_lines(lang: MarkovLanguage) -> dict[str, float]:
    """{"unigram floor": H(X_t), "bigram floor": H(X_t | X_{t-1})}: the ``levels`` a quality run's plot
    draws (:func:`course_lib.plots.loss_curves`), computed from the language."""
    return {"unigram floor": lang.conditional_entropy(0), "bigram floor": lang.conditional_entropy(1)}


def final_loss(losses: Sequence[float], last: int = 10) -> float:
    """The mean of the last ``last`` per-step losses. Every window is fresh (:func:`batches` sees each
    once), so a training loss here is an unbiased estimate of the held-out loss; the mean of ten
    steps cuts its batch-to-batch noise by ~3x."""
    if len(losses) < last:
        raise ValueError(f"need at least {last} losses to average, got {len(losses)}")
    return sum(losses[-last:]) / last


def check_learned(losses: Sequence[float], lang: MarkovLanguage, what: str, last: int = 10) -> float:
    """The run's :func:`final_loss`; an AssertionError when it is not below ``lang``'s bigram floor.

    A run whose point is training quality must have learned more than token frequencies and the
    previous token; above the bigram floor its comparisons measure nothing of the model's context."""
    final, bigram = final_loss(losses, last), lang.conditional_entropy(1)
    if not final < bigram:
        raise AssertionError(
            f"{what}: final loss {final:.3f} (mean of the last {last} steps) is not below the bigram floor "
            f"{bigram:.3f}: the run learned at most the previous token. Train longer, raise the learning "
            "rate, or use the recipe's language (small_run.quality_language())."
        )
    return final


def peaked_language() -> MarkovLanguage:
    """Order 1, 16 symbols, Dirichlet concentration 0.1: entropy rate 1.169 nats, floor at 32 tokens 1.215.

    Peaked transitions and one token of context, so the ``tiny`` model reaches the floor within 100-150
    steps (the course's default order-2 language keeps it on its plateau for ~150 steps, learning or
    not). Lecture 08's stability and lineage runs learn it."""
    return MarkovLanguage(order=1, n_symbols=16, concentration=0.1)


def windows(lang: MarkovLanguage, n_sequences: int, seq_len: int, seed: int) -> TokenDataset:
    """``n_sequences`` windows of ``seq_len`` tokens of ``lang`` (inputs and their next tokens), cut from
    the one stream ``lang.sample(n_sequences * seq_len + 1, seed)``: :func:`course_lib.data.make_dataset`."""
    return make_dataset(lang, n_sequences * seq_len + 1, seq_len, seed=seed)


def batches(
    steps: int,
    batch: int,
    seq_len: int,
    seed: int,
    *,
    lang: MarkovLanguage | None = None,
    rank: int = 0,
    world_size: int = 1,
    stream_batches: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``steps`` global batches of ``batch`` windows of ``seq_len`` tokens: [(x, y)], each [batch, seq_len],
    or rank ``rank``'s [batch / world_size, seq_len] share of each.

    The windows: :func:`windows` of ``lang`` (default: the course language, ``MarkovLanguage()``), as many as
    ``stream_batches`` global batches hold (default ``steps``: every window is seen once); their order: a
    permutation drawn from ``seed``, a new one each time the windows run out. On the host (the CPU): a run
    moves them to its device.
    """
    if batch % world_size:
        raise ValueError(f"a global batch of {batch} sequences does not split over world_size={world_size} ranks")
    n_batches = steps if stream_batches is None else stream_batches
    data = windows(MarkovLanguage() if lang is None else lang, n_batches * batch, seq_len, seed)
    order = data.batches(batch // world_size, rank, world_size, seed=seed, epochs=None)
    return list(itertools.islice(order, steps))


def _model_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model.loss(x, y)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    objective: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = _model_loss,
    after_backward: Callable[[int], None] | None = None,
    scheduler=None,
    after_step: Callable[[int, torch.Tensor], None] | None = None,
) -> list[float]:
    """Train ``model`` one step per batch (x, y) of ``data``; the loss of every step.

    Each step: ``loss = objective(model, x, y)`` (default ``model.loss(x, y)``, the mean next-token
    cross-entropy); ``optimizer.zero_grad()``; ``loss.backward()``; ``after_backward(step)`` (the
    gradients are there: clip them, measure them); ``optimizer.step()``; ``scheduler.step()``; then the
    loss is recorded and ``after_step(step, loss)`` called. Steps count from 0. An objective may raise
    to stop the run (lecture 08 stops at the first non-finite loss).
    """
    losses = []
    for step, (x, y) in enumerate(data):
        loss = objective(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step, loss)
    return losses
