"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training", §3.2)."""

from __future__ import annotations

import math

import torch


class DynamicLossScaler:
    """Dynamic loss scaling with the rules of ``torch.amp.GradScaler`` (Micikevicius et al. 2018, §3.2).

    Backward of ``scale(loss)`` gives gradients multiplied by S, lifting small fp16 gradients out of
    the subnormal/zero range. Before the optimizer step they are multiplied by 1/S. Then:

        some gradient inf/NaN  ->  skip the step, S ← S · backoff_factor (0.5), reset the count
        otherwise              ->  step; after growth_interval clean steps in a row, S ← S · growth_factor (2)

    Same call pattern as GradScaler: ``scale(loss).backward(); scaler.step(opt); scaler.update()``
    (``unscale_(opt)`` before ``step`` when you clip gradients). ``history`` records every update.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        if not (growth_factor > 1 and 0 < backoff_factor < 1):
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                f"{backoff_factor}: the scale must grow after clean steps and shrink after overflow"
            )
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0  # clean steps since the last change of scale (GradScaler's "growth tracker")
        self.history: list[dict] = []
        self._found_inf: bool | None = None  # None: this step's gradients are not unscaled yet

    def get_scale(self) -> float:
        return self.scale_value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient by S (exactly, S being a power of two) and return whether any is inf/NaN."""
        if self._found_inf is not None:
            raise RuntimeError(
                "unscale_() was already called since the last update(): a second call would "
                "divide the gradients by the scale twice"
            )
        inv_scale = 1.0 / self.scale_value
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inv_scale)
                    found = found or not bool(torch.isfinite(p.grad).all())
        self._found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet; call optimizer.step() unless a gradient overflowed. True if it stepped."""
        if self._found_inf is None:
            self.unscale_(optimizer)
        if not self._found_inf:
            optimizer.step()
        return not self._found_inf

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() before step(): call scaler.step(optimizer) first, once per iteration")
        before = self.scale_value
        if self._found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps, action = 0, "overflow: skip step, back off"
        else:
            self.good_steps += 1
            action = "step"
            if self.good_steps == self.growth_interval:
                grown = self.scale_value * self.growth_factor
                if math.isfinite(grown):  # GradScaler keeps the old scale rather than grow to inf
                    self.scale_value = grown
                self.good_steps, action = 0, "step, grow"
        self.history.append(
            dict(scale_used=before, found_inf=self._found_inf, action=action, next_scale=self.scale_value)
        )
        self._found_inf = None
