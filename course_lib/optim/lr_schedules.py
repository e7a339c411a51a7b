"""Learning-rate schedules as pure functions of the step (lecture 08a, Systematic challenges part 1).

A schedule here is a *factor* f(step) that multiplies the optimizer's base learning rate η:
lr(step) = η · f(step). ``torch.optim.lr_scheduler.LambdaLR`` does the plumbing (it sets each
group's lr to base_lr · f(step) and keeps the step count in its state_dict, so a resumed run
continues the schedule), so this file holds only the arithmetic:

    warm-up   f(s) = (s + 1) / W                                  for s < W
    cosine    f(s) = m + (1 − m) · ½ (1 + cos(π · (s − W) / (T − W)))   for W ≤ s < T
              f(s) = m                                            for s ≥ T

with W = ``warmup_steps``, T = ``total_steps``, m = ``min_ratio``. Step s is the s-th call of
``optimizer.step()``, counted from 0: LambdaLR evaluates f(0) when it is built and f(s + 1) at
each ``scheduler.step()``, so the update number s uses f(s).

* Warm-up: Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", §2.2
  (gradual warm-up: ramp the rate linearly over the first epochs, because the full rate applied
  to a freshly initialised network makes its first steps diverge).
* Cosine decay: Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm Restarts",
  eq. (5), one cycle and no restart: η_t = η_min + ½(η_max − η_min)(1 + cos(π T_cur / T_i)).
  LLM recipes usually stop the decay well above zero; Llama 2 (Touvron et al. 2023, §2.2) decays
  to 10% of the peak, the default ``min_ratio`` here.

    >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine_lambda(warmup_steps=20, total_steps=200))
    >>> for x, y in batches: ...; opt.step(); sched.step()
"""

from __future__ import annotations

import functools
import math

__all__ = ["warmup_cosine", "warmup_cosine_lambda"]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> float:
    """f(step): linear warm-up to 1 over ``warmup_steps``, then cosine down to ``min_ratio`` at
    ``total_steps`` (and ``min_ratio`` after it). ``warmup_steps=0`` is a plain cosine decay."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0 (the number of optimizer steps taken), got {step!r}")
    if not isinstance(warmup_steps, int) or not isinstance(total_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"need integers 0 <= warmup_steps <= total_steps, got warmup_steps={warmup_steps!r}, "
            f"total_steps={total_steps!r}: the warm-up is part of the run"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio={min_ratio} must be in [0, 1]: the final rate is min_ratio x the peak")
    if step < warmup_steps:
        # (s + 1) / W, not s / W: the first update already moves the weights; a factor 0 would waste it
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_lambda(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """:func:`warmup_cosine` with its settings bound: the ``lr_lambda`` that ``LambdaLR`` takes.

    A ``functools.partial`` (not a lambda) so that the scheduler, and a checkpoint of it, pickles."""
    warmup_cosine(0, warmup_steps, total_steps, min_ratio)  # check the settings now, not at step 0 of a run
    return functools.partial(_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio)


def _factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    return warmup_cosine(int(step), warmup_steps, total_steps, min_ratio)
