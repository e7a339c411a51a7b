"""Multi-token prediction in miniature (DeepSeek-V3 §2.2): the quality recipe with and without one MTP module.

The MTP module predicts token i+2 from the main model's hidden state h_i and the embedding of token
i+1. On an order-2 Markov source, token i+2 depends on tokens i and i+1, so the module's loss has the
same floors as the main loss, and it can only get *below the bigram floor* H(X_{i+2} | X_{i+1}) by
reading token i out of h_i: the embedding it is handed carries token i+1 alone. That is the check
this run makes. The other question, whether the extra loss improves the main model at equal steps
(the report's Table 4 ablation says yes, at 15.7B-228.7B parameters), is answered against a seed
band: the main loss with and without the module over the same seeds.

Tested in tests/experiments/test_quality_runs.py.
"""

from __future__ import annotations

import torch

from course_lib.experiments import small_run
from course_lib.experiments.small_run import RECIPE
from course_lib.model.transformer import Transformer

__all__ = ["train_mtp"]


def train_mtp(mtp_depth: int, seed: int) -> dict[str, list[float]]:
    """The recipe's run of the ``tiny`` model with ``mtp_depth`` MTP modules (0 or 1), initialised and fed from
    ``seed``; trained on main + λ·MTP (λ = ``model.mtp_weight`` = 0.3, the report's first-phase value).

    Returns ``{"main": [next-token loss per step], "mtp": [the module's loss per step, empty without one],
    "extra_params": parameters the module adds}``.
    """
    if mtp_depth not in (0, 1):
        raise ValueError(
            f"mtp_depth must be 0 (no module) or 1 (one, predicting the token after next), got {mtp_depth}"
        )
    torch.manual_seed(seed)
    model = Transformer(RECIPE.model_config(mtp_depth=mtp_depth))
    curves: dict[str, list[float]] = {"main": [], "mtp": []}

    def objective(model, x, y):
        terms = model.loss_terms(x, y)
        curves["main"].append(terms["main"].item())
        if mtp_depth == 0:
            return terms["main"]
        curves["mtp"].append(terms["mtp_1"].item())
        return terms["main"] + model.mtp_weight * terms["mtp_1"]

    small_run.train(model, RECIPE.optimizer(model.parameters()), RECIPE.batches(seed), objective=objective)
    extra = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    return {**curves, "extra_params": extra}
