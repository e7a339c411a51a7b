"""One small training run for every experiment: the data factory and the loop.

The lectures' experiments train the course model for tens to hundreds of steps on the synthetic
language of :mod:`course_lib.data` (a Markov chain with a known entropy rate, so a loss can be set
beside its floor). Their data and their loop are written here once:

* :func:`windows` — ``n_sequences`` windows of ``seq_len`` tokens cut from one stream of the language;
* :func:`batches` — the first ``steps`` global batches of such windows (a rank's share of each when
  ``world_size`` > 1), the order drawn from ``seed``: data-parallel ranks together see exactly the
  batches one process sees (:meth:`course_lib.data.TokenDataset.batches`);
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
from collections.abc import Callable, Iterable

import torch

from course_lib.data import MarkovLanguage, TokenDataset, make_dataset

__all__ = ["batches", "peaked_language", "train", "windows"]


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
