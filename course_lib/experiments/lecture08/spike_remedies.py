"""A loss spike provoked on the course model, then tamed by one remedy at a time (lecture 08a).

The provocation (``BASELINE``): the ``tiny`` model on a quickly learnable language, trained with SGD
and momentum 0.9 at lr 0.05, no warm-up, no clipping, and its output layer initialised 20× too
large (std 0.4 instead of GPT-2's 0.02, so the first logits have a standard deviation of 3.3
instead of 0.16, and reach ±13). The first steps overshoot: the loss falls, jumps back up above
where it started, and the run is left far above the entropy floor for the rest of its 120 steps
(mostly near the unigram loss, 2.65), while each remedy reaches the floor.

Why SGD and why the output layer:

* Adam divides each step by the running RMS of the gradient, so a gradient 100× too large moves
  the weights about as far as a normal one; the mechanism that clipping addresses, a step
  proportional to a huge gradient, is hidden. SGD shows it bare (Pascanu et al. 2013 introduced
  clipping for it, and Goyal et al. 2017 introduced warm-up for SGD).
* Every matrix of the body sits behind an RMSNorm, which undoes its scale: a larger body init only
  makes the effective step lr/‖W‖² *smaller* (we measured it: PyTorch's default init, 50× larger
  for the embedding, trains fine here). The output layer is the one matrix whose scale reaches the
  loss unnormalised: the logits, and with them the curvature the first SGD steps face, grow with it.

The remedies, each alone (``REMEDIES``): clip the global gradient norm to 1; warm-up over the first
60 steps then cosine decay to 10%; the standard init of the output layer; and the output-logit
z-loss at PaLM's coefficient. The last one does *not* tame this spike, and the lecture says so:
z-loss fixes the level of the logits (log Z), which cross-entropy leaves free, not their spread,
which is what blew up here. :func:`logit_level_runs` shows what z-loss does do.

Measured on the course machine (AVX-512; ATEN_CPU_CAPABILITY=default with one thread gives the
same to 2 decimals), seed 1, the default: the baseline's loss goes 8.36 → 4.17 → 8.62 → 11.96 in
its first four steps (largest rise 7.8 nats) and its last 20 steps average 2.09; clip 0.29 / 1.24;
warm-up + cosine 0.23 / 1.25; standard init 0.22 / 1.22 (the floor is 1.215); z-loss 1e-4 7.8 / 2.14.
Multiplying every initial weight by (1 + 10⁻³ noise) moves these by at most 0.15, so a CPU's
rounding cannot flip them. The seed matters more: over seeds 0-5 the baseline's largest rise is
0.2-7.8 nats (it drops straight onto the plateau on three of them) and its last-20 mean 1.34-2.50,
while every remedy stays within a 0.30 rise and ends at 1.22-1.28. Seed 1 shows the spike best;
the lecture says so. Each run takes about a second on one core.

* :func:`train_recipe` — one run: per-step loss, gradient norm before clipping, learning rate, log Z;
* :func:`spike_and_remedies` — the baseline and every remedy on the same seed and batches;
* :func:`largest_rise`, :func:`final_loss` — the two numbers the tests and the lecture judge by;
* :func:`logit_level_runs` — AdamW with and without z-loss: log Z pulled to 0, cross-entropy unchanged.

The runs use the shared loop (:func:`course_lib.experiments.small_run.train`): the objective records the
cross-entropy and log Z and adds the z-loss, ``after_backward`` clips or measures the gradient norm, the
scheduler steps after the optimizer; the run stops at the first non-finite loss. Tested in
tests/optim/test_stability.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from course_lib.data import MarkovLanguage
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.optim.lr_schedules import warmup_cosine_lambda
from course_lib.optim.stability import clip_grad_norm_, global_grad_norm, logit_z_loss

__all__ = [
    "BASELINE",
    "REMEDIES",
    "Recipe",
    "final_loss",
    "largest_rise",
    "logit_level_runs",
    "spike_and_remedies",
    "stability_language",
    "train_recipe",
]

BATCH, SEQ, STEPS = 16, 32, 120


def stability_language() -> MarkovLanguage:
    """:func:`course_lib.experiments.small_run.peaked_language`: entropy rate 1.169 nats, floor at 32 tokens
    1.215. A well-behaved run reaches the floor within ~100 steps and a damaged one is told apart by its
    end point (the course's default order-2 language keeps the tiny model on its plateau for ~150 steps,
    stable or not)."""
    return small_run.peaked_language()


@dataclass(frozen=True)
class Recipe:
    """How one run trains: SGD with momentum, optionally clipped, scheduled and z-regularised.

    ``head_init_scale`` multiplies the output layer's initial weights (std 0.02 × scale);
    ``warmup_steps`` > 0 switches on warm-up + cosine decay to ``min_lr_ratio`` (0: constant lr);
    ``clip`` is the max global gradient norm (None: no clipping); ``z_loss`` the coefficient of
    :func:`~course_lib.optim.stability.logit_z_loss` (0: off)."""

    lr: float = 0.05
    momentum: float = 0.9
    head_init_scale: float = 20.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    clip: float | None = None
    z_loss: float = 0.0


class _Diverged(Exception):
    """A loss that is no longer finite: the run stops there."""


BASELINE = Recipe()
REMEDIES = {
    "clip 1.0": dataclasses.replace(BASELINE, clip=1.0),
    "warm-up + cosine": dataclasses.replace(BASELINE, warmup_steps=60),
    "standard init": dataclasses.replace(BASELINE, head_init_scale=1.0),
    "z-loss 1e-4": dataclasses.replace(BASELINE, z_loss=1e-4),
}


def _batches(steps: int, data_seed: int) -> list:
    return small_run.batches(steps, BATCH, SEQ, data_seed, lang=stability_language())


def train_recipe(recipe: Recipe, steps: int = STEPS, seed: int = 1, data_seed: int = 0, batches=None) -> dict:
    """One run of the ``tiny`` model under ``recipe``.

    Returns {"loss", "grad_norm", "lr", "log_z": one float per step; "diverged": bool}. ``grad_norm``
    is the global norm *before* clipping; ``log_z`` the mean logsumexp of the logits. A run stops at
    the first non-finite loss (its lists are then shorter than ``steps`` and ``diverged`` is True).
    The model comes from ``torch.manual_seed(seed)``; the batches from ``data_seed``.
    """
    batches = _batches(steps, data_seed) if batches is None else batches[:steps]
    torch.manual_seed(seed)
    model = Transformer(configs.get("tiny"))
    with torch.no_grad():
        model.output.weight.mul_(recipe.head_init_scale)
    opt = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum)
    factor = warmup_cosine_lambda(recipe.warmup_steps, steps, recipe.min_lr_ratio) if recipe.warmup_steps else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor) if factor else None
    out = {"loss": [], "grad_norm": [], "lr": [], "log_z": [], "diverged": False}

    def objective(model, x, y):  # records the cross-entropy and log Z; returns what is backpropagated
        logits = model(x)
        loss = next_token_loss(logits, y)
        if not math.isfinite(loss.item()):
            raise _Diverged
        out["loss"].append(loss.item())
        out["log_z"].append(torch.logsumexp(logits.detach().float(), -1).mean().item())
        return loss + logit_z_loss(logits, recipe.z_loss) if recipe.z_loss else loss

    def after_backward(step):  # the norm before clipping, and the rate this step uses
        if recipe.clip is not None:
            norm = clip_grad_norm_(model.parameters(), recipe.clip)
        else:
            norm = global_grad_norm(model.parameters())
        out["grad_norm"].append(norm.item())
        out["lr"].append(opt.param_groups[0]["lr"])

    try:
        small_run.train(model, opt, batches, objective=objective, after_backward=after_backward, scheduler=sched)
    except _Diverged:
        out["diverged"] = True
    return out


def spike_and_remedies(steps: int = STEPS, seed: int = 1, data_seed: int = 0, remedies=None) -> dict[str, dict]:
    """{"baseline": run, name: run for each remedy}: :func:`train_recipe` on one seed, one stream of batches."""
    batches = _batches(steps, data_seed)
    runs = {"baseline": train_recipe(BASELINE, steps, seed, batches=batches)}
    for name, recipe in (REMEDIES if remedies is None else remedies).items():
        runs[name] = train_recipe(recipe, steps, seed, batches=batches)
    return runs


def largest_rise(losses) -> float:
    """max over t of (loss_t − min_{s ≤ t} loss_s): how far the loss climbed above its best so far.

    A loss spike is a large rise; a healthy curve rises only by batch-to-batch noise (≤ 0.45 nats
    here). A diverged run (a non-finite loss, or none at all) counts as an infinite rise."""
    best, rise = math.inf, 0.0
    for value in losses:
        if not math.isfinite(value):
            return math.inf
        best = min(best, value)
        rise = max(rise, value - best)
    return rise if losses else math.inf


def final_loss(run: dict, last: int = 20) -> float:
    """Mean loss of the last ``last`` steps; infinite for a run that diverged."""
    if run["diverged"] or len(run["loss"]) < last:
        return math.inf
    return sum(run["loss"][-last:]) / last


def logit_level_runs(coefficients=(0.0, 1e-4, 1e-2), steps: int = 150, lr: float = 3e-2, seed: int = 0) -> dict:
    """{coefficient: {"loss", "log_z"}}: AdamW (no weight decay) with the output-logit z-loss at each
    coefficient, the standard init, the same seed and batches.

    What z-loss does, measured: log Z is ~7 without it and is pulled towards 0 with it, at almost
    no cost in cross-entropy. Measured (last 20 steps): log Z 6.44 at c = 0, 6.33 at PaLM's 1e-4,
    0.20 at 1e-2, with cross-entropy 1.273, 1.295 and 1.266. PaLM's coefficient pulls slowly; over
    its hundreds of thousands of steps that is enough, over our 150 it takes 1e-2 to see the pull.
    """
    batches = _batches(steps, data_seed=seed)
    out = {}
    for c in coefficients:
        torch.manual_seed(seed)
        model = Transformer(configs.get("tiny"))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        run = out[c] = {"loss": [], "log_z": []}

        def objective(model, x, y, c=c, run=run):
            logits = model(x)
            loss = next_token_loss(logits, y)
            run["loss"].append(loss.item())
            run["log_z"].append(torch.logsumexp(logits.detach().float(), -1).mean().item())
            return loss + logit_z_loss(logits, c)

        small_run.train(model, opt, batches, objective=objective)
    return out
