"""Merging fine-tunes by arithmetic on their weights: averaging and task vectors.

Two models fine-tuned from the same pretrained weights usually sit in one basin of the loss, so the
straight line between them stays low and their *average* is a good model too, often better than
either (Wortsman et al. 2022, "Model soups", §2: the uniform soup θ = (1/k) Σ θ_i). Task arithmetic
(Ilharco et al. 2023, "Editing Models with Task Arithmetic", §2) names the difference a fine-tune
made, τ = θ_ft − θ_base, a *task vector*, and edits the base with a sum of them:

    θ = θ_base + λ · Σ_i τ_i          (λ = 1/k and k fine-tunes of one base: the uniform soup again)

This is the "train independently, then merge" of Distributed Editing Models: k runs on k machines
never talk during training; one weighted sum at the end combines them. Both functions work on
``state_dict()``s, so the model class does not matter, only that all share one architecture.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["add_task_vectors", "average_weights", "task_vector"]

StateDict = Mapping[str, torch.Tensor]


def _same_keys(state_dicts: Sequence[StateDict]) -> None:
    if not state_dicts:
        raise ValueError("no state_dicts given: merging needs at least one model")
    keys = set(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], 1):
        if set(sd) != keys:
            raise ValueError(
                f"state_dict {i} has different entries than state_dict 0 (missing {sorted(keys - set(sd))[:3]}, "
                f"extra {sorted(set(sd) - keys)[:3]}): only models of one architecture can be merged"
            )


def average_weights(
    state_dicts: Sequence[StateDict], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """θ = Σ_i w_i θ_i for floating-point entries (uniform w_i = 1/k by default: the uniform soup);
    other entries (integer buffers) are copied from the first model."""
    _same_keys(state_dicts)
    k = len(state_dicts)
    weights = [1.0 / k] * k if weights is None else list(weights)
    if len(weights) != k:
        raise ValueError(f"{len(weights)} weights for {k} state_dicts")
    merged = {}
    for name, first in state_dicts[0].items():
        if first.is_floating_point():
            merged[name] = sum(w * sd[name] for w, sd in zip(weights, state_dicts))
        else:
            merged[name] = first.clone()
    return merged


def task_vector(finetuned: StateDict, base: StateDict) -> dict[str, torch.Tensor]:
    """τ = θ_ft − θ_base for floating-point entries (Ilharco et al. 2023, eq. 1)."""
    _same_keys([finetuned, base])
    return {name: finetuned[name] - base[name] for name in base if base[name].is_floating_point()}


def add_task_vectors(base: StateDict, vectors: Sequence[StateDict], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """θ = θ_base + λ Σ_i τ_i (λ = ``scale``); entries without a task vector are copied from the base."""
    merged = {name: tensor.clone() for name, tensor in base.items()}
    for tau in vectors:
        for name, delta in tau.items():
            merged[name] = merged[name] + scale * delta
    return merged
