"""What one training step holds, phase by phase: parameters, gradients, optimizer state, and the
activations autograd saves for the backward pass (lecture 01, tests/lectures/test_lecture01.py).

The formulas are :mod:`course_lib.cost.memory` (model states) and :mod:`course_lib.cost.activations`
(activations per layer); the census is :mod:`course_lib.dist.census`.
"""

from __future__ import annotations

import torch

from course_lib.dist import census
from course_lib.measure.saved_tensors import SavedTensorMeter

PHASES = ("start", "after forward", "after backward", "after optimizer step", "after zero_grad")
KINDS = ("parameters", "gradients", "optimizer state", "activations")


def training_step_memory(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> dict[str, dict[str, int]]:
    """Bytes of each kind held at the end of each phase of one step: {phase: {kind: bytes}}.

    Parameters and gradients are the storages behind ``model.parameters()`` and their ``.grad``;
    optimizer state is :func:`course_lib.dist.census.optimizer_state_bytes`; activations are the
    storages autograd saves during the forward pass (:class:`SavedTensorMeter`, which leaves out
    parameters and buffers), held until the backward pass consumes and frees them. Gradients are
    dropped (``set_to_none``) before the step starts, so the first phase holds parameters only
    (plus the optimizer state of earlier steps).
    """
    params = list(model.parameters())
    activations = 0

    def snapshot() -> dict[str, int]:
        return {
            "parameters": census.held_bytes([p.detach() for p in params]),  # detached: without .grad
            "gradients": census.held_bytes([p.grad for p in params if p.grad is not None]),
            "optimizer state": census.optimizer_state_bytes(optimizer),
            "activations": activations,
        }

    optimizer.zero_grad(set_to_none=True)
    rows = {"start": snapshot()}
    with SavedTensorMeter(exclude=model) as meter:
        loss = model.loss(tokens, targets)
    activations = meter.bytes
    rows["after forward"] = snapshot()
    loss.backward()  # frees the graph and, with it, every saved tensor
    try:
        loss.backward()
    except RuntimeError:  # "Trying to backward through the graph a second time": the saved tensors are gone
        activations = 0
    else:
        raise AssertionError("the graph survived backward: its saved tensors are still held")
    rows["after backward"] = snapshot()
    optimizer.step()
    rows["after optimizer step"] = snapshot()
    optimizer.zero_grad(set_to_none=True)
    rows["after zero_grad"] = snapshot()
    return rows
