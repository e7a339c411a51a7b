"""Merging fine-tunes, measured: a model soup of one task, and task arithmetic over two different tasks.

The pretrained model learns the quality language P (:func:`course_lib.experiments.small_run.quality_language`)
with :data:`~course_lib.experiments.small_run.RECIPE`. Two *tasks* then edit different halves of P: task A
replaces the next-token distributions of the contexts whose last symbol is 0-3 with those of another
language (seed 1), task B those whose last symbol is 4-7 (seed 2). Their union AB has both edits. A
fine-tune on A learns A's half and forgets nothing it needs there, but it has never seen B's edits; if
fine-tuning wrote each task into its own weights, the sum of the two task vectors (Ilharco et al. 2023,
"Editing Models with Task Arithmetic", §2) would know both, and the merged model would do well on AB.

* :func:`task_languages` — P, A, B and AB (``MarkovLanguage.from_transitions`` on edited tables);
* :func:`merging_study` — the base, two fine-tunes on A (different data: their average is a *model soup*,
  Wortsman et al. 2022), one on B, the soup, task arithmetic at λ = 1/2 (= the uniform average) and
  λ = 0.7, and a model trained on AB itself from the same base, each evaluated on every language; and
  the negative control: the average of the base and a second model pretrained on P from *another*
  initialisation, which share no basin.

Tested in tests/optim/test_distill_merge.py.
"""

from __future__ import annotations

import copy

import torch

from course_lib.data import MarkovLanguage
from course_lib.experiments import small_run
from course_lib.experiments.lecture05.qlora_finetune import val_loss
from course_lib.experiments.small_run import RECIPE
from course_lib.model.merge import add_task_vectors, average_weights, task_vector
from course_lib.model.transformer import Transformer

__all__ = ["merging_study", "task_languages"]

LAMBDAS = (0.5, 0.7)  # 0.5: the uniform average of the two fine-tunes; 0.7: a scale tuned on AB, as the paper tunes λ


def task_languages() -> dict[str, MarkovLanguage]:
    """{"P", "A", "B", "AB"}: the pretraining language and the two tasks' edits of it (module docstring)."""
    base = small_run.quality_language().transition_probs
    donors = [MarkovLanguage(order=2, n_symbols=8, concentration=0.1, seed=s).transition_probs for s in (1, 2)]
    # host: the languages' tables are float64 on the CPU, like every MarkovLanguage (course_lib.data)
    first_half = torch.arange(base.shape[0]) % 8 < 4  # row c = 8·x_{t-2} + x_{t-1}: last symbol 0..3
    edited = {"A": (first_half,), "B": (~first_half,), "AB": (first_half, ~first_half)}
    out = {"P": small_run.quality_language()}
    for name, masks in edited.items():
        table = base.clone()
        for mask in masks:
            donor = donors[0] if mask is first_half else donors[1]
            table[mask] = donor[mask]
        out[name] = MarkovLanguage.from_transitions(table)
    return out


def _finetune(base: Transformer, lang: MarkovLanguage, seed: int) -> Transformer:
    model = copy.deepcopy(base)
    data = small_run.batches(RECIPE.steps, RECIPE.batch, RECIPE.seq_len, seed, lang=lang)
    small_run.train(model, RECIPE.optimizer(model.parameters()), data)
    return model


def merging_study(seed: int = 0) -> dict:
    """Train the base on P, fine-tune it (the recipe's 100 steps each), merge, and evaluate.

    Returns ``{"loss": {model: {language: held-out loss}}, "pretrain": [per-step losses on P]}``, the
    models being "base", "average of two inits", "A", "A'" (a second fine-tune on A, other data),
    "soup A+A'", "B", "average A+B" (λ = 1/2), "task arithmetic λ=0.7" and "trained on AB".
    """
    langs = task_languages()
    torch.manual_seed(seed)
    base = Transformer(RECIPE.model_config())
    pretrain = small_run.train(base, RECIPE.optimizer(base.parameters()), RECIPE.batches(seed))
    tuned = {
        "A": _finetune(base, langs["A"], seed + 1),
        "A'": _finetune(base, langs["A"], seed + 3),
        "B": _finetune(base, langs["B"], seed + 2),
        "trained on AB": _finetune(base, langs["AB"], seed + 4),
    }
    states = {name: m.state_dict() for name, m in tuned.items()}
    vectors = [task_vector(states[t], base.state_dict()) for t in ("A", "B")]
    merged = {
        "soup A+A'": average_weights([states["A"], states["A'"]]),
        "average A+B": add_task_vectors(base.state_dict(), vectors, scale=LAMBDAS[0]),
        f"task arithmetic λ={LAMBDAS[1]}": add_task_vectors(base.state_dict(), vectors, scale=LAMBDAS[1]),
    }
    torch.manual_seed(seed + 5)
    stranger = Transformer(RECIPE.model_config())  # pretrained on P like the base, from another initialisation
    small_run.train(stranger, RECIPE.optimizer(stranger.parameters()), RECIPE.batches(seed + 5))
    merged["average of two inits"] = average_weights([base.state_dict(), stranger.state_dict()])
    models = {"base": base, **tuned}
    for name, state in merged.items():
        models[name] = Transformer(RECIPE.model_config())
        models[name].load_state_dict(state)
    order = ["base", "average of two inits", "A", "A'", "soup A+A'", "B", "average A+B"]
    order += [f"task arithmetic λ={LAMBDAS[1]}", "trained on AB"]
    with torch.no_grad():  # held-out windows of each language, qlora_finetune's (seed 10 000, never a training seed)
        loss = {name: {k: val_loss(models[name], lang, sequences=128) for k, lang in langs.items()} for name in order}
    return {"loss": loss, "pretrain": pretrain}
