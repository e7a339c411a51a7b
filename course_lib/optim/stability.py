"""Training-stability tools: the output-logit z-loss, global-norm gradient clipping, a loss-spike guard
(lecture 08a, Systematic challenges part 1).

    z-loss            L_z = c · mean over positions of (log Z)²,   log Z = logsumexp(logits)
                      (PaLM, Chowdhery et al. 2022, §5 "Loss function": c = 1e-4)
    clipping          g ← g · min(1, c / ‖g‖₂),  ‖g‖₂ over *all* parameters at once
                      (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks", §3.2)
    spike guard       skip the update when the loss is not finite or exceeds factor × the median of
                      the recent accepted losses (a light form of PaLM §5.1's "skip the batches
                      around the spike")

The z-loss here pulls the *output* softmax normaliser towards log Z = 0. It is not the router
z-loss of :mod:`course_lib.model.moe` (ST-MoE), which penalises the router's logits. Cross-entropy
does not care where the logits sit (adding a constant to every logit changes nothing), so without
a pull they may drift; near log Z = 0 they stay where bf16 still resolves them (its spacing is
2⁻⁸ of the magnitude). Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
training instabilities") reproduce on small models the divergence z-loss prevents, which they call
output-logit divergence.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist

__all__ = ["SpikeGuard", "clip_grad_norm_", "global_grad_norm", "logit_z_loss"]

PALM_Z_LOSS = 1e-4  # PaLM §5: "z_loss = 10^-4 · log² Z"


def logit_z_loss(logits: torch.Tensor, coefficient: float = PALM_Z_LOSS) -> torch.Tensor:
    """c · mean((log Z)²) with log Z = logsumexp over the last (vocabulary) dimension, in fp32.

    Add it to the cross-entropy: ``loss = next_token_loss(logits, y) + logit_z_loss(logits)``. Its
    gradient with respect to logit i is 2c · log Z · softmax_i: at log Z > 0 it pushes the likely
    logits down, at log Z < 0 it lifts them, so it fixes the level that cross-entropy leaves free.
    """
    if coefficient < 0:
        raise ValueError(f"coefficient={coefficient} must be >= 0 (PaLM uses {PALM_Z_LOSS})")
    log_z = torch.logsumexp(logits.float(), dim=-1)
    return coefficient * log_z.pow(2).mean()


def _grads(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def global_grad_norm(parameters: Iterable[torch.Tensor], group=None) -> torch.Tensor:
    """‖g‖₂ over every gradient of ``parameters`` (fp32 scalar): √(Σ_tensors ‖g_t‖²).

    ``group``: a process group whose ranks each hold a *disjoint shard* of the gradients (ZeRO-2/3,
    tensor-parallel slices): the squared local norms are summed over the group, so every rank gets
    the norm of the whole gradient. Leave it None when each rank holds the full gradient (plain DDP
    after its all-reduce): summing replicas would count each element world_size times.
    """
    grads = _grads(parameters)
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares = squares + torch.linalg.vector_norm(g.float()).pow(2)
    if group is not None:
        dist.all_reduce(squares, group=group)  # Σ over shards of Σ over local elements
    return squares.sqrt()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, group=None) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (‖g‖₂ + 1e-6)) in place; return ‖g‖₂ before clipping.

    Global-norm clipping keeps the *direction* of the update and bounds its length: one bad batch
    cannot throw the weights further than ``max_norm`` × lr (for SGD; Adam divides by its running
    RMS, so there clipping mainly keeps a single outlier out of the moment estimates).

    Why not just ``torch.nn.utils.clip_grad_norm_``? With ``group=None`` this *is* that function:
    it computes the same norm with fused kernels, so the course uses it rather than a copy. It
    cannot see gradients that live on other ranks, though: under ZeRO or tensor parallelism each
    rank would clip by the norm of its own shard and the ranks would scale differently. With
    ``group`` the squared norms are all-reduced first (:func:`global_grad_norm`), so every shard is
    scaled by the same factor, the one the unsharded model would use (the 1e-6 is torch's, so both
    paths agree).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm} must be > 0 (a typical LLM setting is 1.0)")
    if group is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
    total = global_grad_norm(parameters, group)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in _grads(parameters):
        g.mul_(scale.to(g.device, g.dtype))
    return total


class SpikeGuard:
    """Decide, before each update, whether the loss is a spike to skip rather than learn from.

        skip  ⇔  loss is NaN or ±inf,  or  (len(history) ≥ min_history  and  loss > factor · median(history))

    ``history`` holds the last ``window`` *accepted* losses (a skipped spike never raises the
    median). Call :meth:`check` with the batch's loss — the global mean over data-parallel ranks,
    so that every rank takes the same decision — before ``backward``: a skipped step then costs no
    backward and leaves the optimizer state untouched.

        guard = SpikeGuard()
        loss = model.loss(x, y)
        if guard.check(loss.item()):
            loss.backward(); opt.step()
        opt.zero_grad()

    PaLM (Chowdhery et al. 2022, §5.1) saw about 20 spikes in its largest run despite clipping; it
    restarted ~100 steps before each and skipped 200–500 batches. Skipping the one batch is the
    cheap first line; the fault-tolerance lab adds the restart. ``state_dict`` goes into a
    checkpoint so a resumed run judges spikes against the same history.
    """

    def __init__(self, factor: float = 2.0, window: int = 50, min_history: int = 10):
        if not factor > 1:
            raise ValueError(f"factor={factor} must be > 1: a loss equal to the median is not a spike")
        if not (isinstance(window, int) and isinstance(min_history, int) and 1 <= min_history <= window):
            raise ValueError(f"need integers 1 <= min_history <= window, got {min_history!r}, {window!r}")
        self.factor, self.window, self.min_history = factor, window, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.steps = 0
        self.skipped: list[int] = []  # step numbers (calls of check, from 0) that were skipped

    def is_spike(self, loss: float) -> bool:
        """Whether ``loss`` would be skipped now (no state changes)."""
        loss = float(loss)
        if not math.isfinite(loss):
            return True
        return len(self.history) >= self.min_history and loss > self.factor * statistics.median(self.history)

    def check(self, loss: float) -> bool:
        """True: take the step (the loss joins the history). False: skip it (recorded in ``skipped``)."""
        spike = self.is_spike(loss)
        if spike:
            self.skipped.append(self.steps)
        else:
            self.history.append(float(loss))
        self.steps += 1
        return not spike

    def state_dict(self) -> dict:
        return {"history": list(self.history), "steps": self.steps, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.steps, self.skipped = state["steps"], list(state["skipped"])
