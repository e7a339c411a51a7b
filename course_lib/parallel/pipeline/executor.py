"""The pipeline executor: one training step, this rank walking its action list of a schedule.

A schedule (:mod:`course_lib.parallel.pipeline.schedules`) cuts the model into ``p·v`` stages on
``p`` ranks (``v`` stages per rank) and feeds ``m`` micro-batches through them (the symbols of
Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM*, §2.2). Each action of a rank's list is one of these, with one handler below each:

    F       forward of micro-batch i on stage s: tokens on stage 0, the received (or local) hidden
            state elsewhere; the last stage computes the loss divided by m, so that the gradients
            summed over the m micro-batches are those of the mean loss of the whole batch
    B       backward of (i, s) from the received gradient (from the loss on the last stage):
            gradients of the stage's input and of its weights in one pass
    I, W    the same backward in two passes (Qi et al. 2023, *Zero Bubble Pipeline Parallelism*,
            §2): I to the stage's input only (what the previous stage waits for), W later to the
            weights (what nobody waits for). Here W runs autograd a second time from the stage's
            output, so its gradients are exact but it re-does part of I's work;
            torch.distributed.pipelining keeps I's intermediate gradients instead
    SEND_F  stage s's output, for stage s + 1 on another rank
    SEND_B  the gradient of stage s's input, for stage s - 1 on another rank
    RECV_*  wait until the message this rank's next compute needs is here

When each send and receive is really posted, so that crossing sends deadlock on no backend, is
decided in one place, :mod:`course_lib.parallel.pipeline.messages`, and explained there.

Between stages on the same rank (the interleaved schedule's chunks, the tip of DualPipeV's V) the
tensor is handed over in memory, through the same inbox the received messages land in. A stage's
saved input and output are dropped by its last backward action for that micro-batch (B, or W): the
activations freed, which ``peak_in_flight`` counts. An optional ``observer`` sees each forward and
each release: :class:`course_lib.measure.stage_activations.StageActivationMeter` counts the bytes
autograd saves with it (the executor itself measures nothing).

Tested in tests/parallel/pipeline/test_pipeline.py (every schedule's losses and gradients bit for bit those of the
unpipelined model and of torch.distributed.pipelining, at p = 2 and 4) and by the grader checks of
course_lib/grading/labs/lab05_pipeline.py (_lab05_step.py), run through tests/grading/test_lab_checks.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import trace
from course_lib.parallel.pipeline.messages import Mailbox
from course_lib.parallel.pipeline.schedules import COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Schedule, W


@dataclass
class StepResult:
    losses: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss (ranks with the last stage)
    peak_in_flight: int = 0  # most (micro-batch, stage) activations held at once on this rank


class StepObserver(Protocol):
    """What an instrument may watch: each forward (as a context around it) and each release."""

    def forward(self, microbatch: int, stage: int) -> contextlib.AbstractContextManager: ...

    def freed(self, microbatch: int, stage: int) -> None: ...


@dataclass
class _Step:
    """The state of one step on this rank, shared by the handlers."""

    schedule: Schedule
    rank: int
    stages: dict[int, nn.Module]
    microbatches: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    mailbox: Mailbox
    observer: StepObserver | None
    result: StepResult = field(default_factory=StepResult)
    # ("F" | "B", micro-batch, the stage it is for) -> tensor, received or handed over on this rank;
    # ("dx", micro-batch, stage) -> an input gradient waiting for its SEND_B
    inbox: dict[tuple, torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple, tuple] = field(default_factory=dict)  # (micro-batch, stage) -> (input, output[, grad])

    def observe(self, microbatch: int, stage: int) -> contextlib.AbstractContextManager:
        return self.observer.forward(microbatch, stage) if self.observer else contextlib.nullcontext()

    def free(self, key: tuple[int, int]) -> None:
        if self.observer:
            self.observer.freed(*key)


# ----------------------------------------------------------------------------- the handlers


def _forward(step: _Step, a: Action) -> None:
    """F: run stage s on micro-batch i; keep its input and output for the backward. On the last
    stage the output is the loss / m; an output for a stage on this rank goes to the inbox."""
    key, s, last = (a.microbatch, a.stage), a.stage, step.schedule.n_stages - 1
    with trace.span("F", mb=a.microbatch, stage=s), step.observe(*key):
        if s == 0:
            x = step.microbatches[a.microbatch].to(step.device)
        else:
            x = step.inbox.pop(("F", *key)).detach().requires_grad_()
        y = step.stages[s](x)
        if s == last:
            loss = step.loss_fn(y, step.targets[a.microbatch].to(step.device))
            step.result.losses[a.microbatch] = loss.item()
            y = loss / step.schedule.m
        elif step.schedule.placement[s + 1] == step.rank:
            step.inbox["F", a.microbatch, s + 1] = y.detach()
    step.saved[key] = (x, y)
    step.result.peak_in_flight = max(step.result.peak_in_flight, len(step.saved))


def _output_gradient(step: _Step, a: Action) -> torch.Tensor | None:
    """The gradient a backward of (i, s) starts from: received from stage s + 1 (None on the last
    stage, whose output is the loss)."""
    return None if a.stage == step.schedule.n_stages - 1 else step.inbox.pop(("B", a.microbatch, a.stage))


def _pass_input_gradient(step: _Step, a: Action, x: torch.Tensor) -> None:
    """Leave dL/dx of (i, s) for stage s - 1: in the inbox if this rank holds it, else for SEND_B."""
    if a.stage > 0:
        local = step.schedule.placement[a.stage - 1] == step.rank
        step.inbox[("B", a.microbatch, a.stage - 1) if local else ("dx", a.microbatch, a.stage)] = x.grad


def _backward(step: _Step, a: Action) -> None:
    """B: backward of (i, s), to the input and the weights at once; its activations are freed."""
    key = (a.microbatch, a.stage)
    x, y = step.saved.pop(key)
    step.free(key)
    grad = _output_gradient(step, a)
    with trace.span(B, mb=a.microbatch, stage=a.stage):
        torch.autograd.backward(y, grad)
    _pass_input_gradient(step, a, x)


def _backward_input(step: _Step, a: Action) -> None:
    """I: backward of (i, s) to the stage's input only, keeping the graph for W. Stage 0's input is
    tokens: nothing to differentiate, so its W does all the work."""
    key = (a.microbatch, a.stage)
    x, y = step.saved[key]
    grad = _output_gradient(step, a)
    with trace.span(I, mb=a.microbatch, stage=a.stage):
        if a.stage > 0:
            torch.autograd.backward(y, grad, inputs=[x], retain_graph=True)
    step.saved[key] = (x, y, grad)
    _pass_input_gradient(step, a, x)


def _backward_weights(step: _Step, a: Action) -> None:
    """W: backward of (i, s) to the stage's weights, from the output gradient I used; the
    activations are freed."""
    key = (a.microbatch, a.stage)
    _, y, grad = step.saved.pop(key)
    step.free(key)
    params = [p for p in step.stages[a.stage].parameters() if p.requires_grad]
    with trace.span(W, mb=a.microbatch, stage=a.stage):
        torch.autograd.backward(y, grad, inputs=params)


def _send_activation(step: _Step, a: Action) -> None:
    """SEND_F: stage s's output of micro-batch i, for stage s + 1 on another rank."""
    step.mailbox.send("F", step.saved[(a.microbatch, a.stage)][1].detach(), a.microbatch, a.stage)


def _send_gradient(step: _Step, a: Action) -> None:
    """SEND_B: the gradient of stage s's input for micro-batch i, for stage s - 1 on another rank."""
    step.mailbox.send("B", step.inbox.pop(("dx", a.microbatch, a.stage)), a.microbatch, a.stage)


def _receive(step: _Step, a: Action) -> None:
    """RECV_F / RECV_B: wait until the activation from stage s - 1 (F) or the gradient from stage
    s + 1 (B) of micro-batch i is in the inbox. Messages arrive in their sender's order: those that
    come first wait in the inbox for their own action."""
    kind = a.op[-1]
    sender = step.schedule.placement[a.stage - 1 if kind == F else a.stage + 1]
    while (kind, a.microbatch, a.stage) not in step.inbox:
        key, tensor = step.mailbox.receive_next(sender)
        step.inbox[key] = tensor


HANDLERS: dict[str, Callable[[_Step, Action], None]] = {
    F: _forward,
    B: _backward,
    I: _backward_input,
    W: _backward_weights,
    SEND_F: _send_activation,
    SEND_B: _send_gradient,
    RECV_F: _receive,
    RECV_B: _receive,
}


# ----------------------------------------------------------------------------- the step


def run_step(
    schedule: Schedule,
    stages: dict[int, nn.Module],
    microbatches: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    group=None,
    observer: StepObserver | None = None,
) -> StepResult:
    """Run this rank's actions of ``schedule``; ``stages`` maps each stage index it holds to its module.

    ``hidden_shape`` is one micro-batch's hidden state, [batch, seq, d_model]: what a receiver
    allocates. Gradients accumulate in the stages' ``.grad``, as with a plain backward. ``group``:
    the pipeline's process group (ranks of the schedule are ranks in it); ``observer``: an
    instrument that watches each forward and each release of activations (:class:`StepObserver`).
    """
    rank = dist.get_rank(group)
    mine = schedule.stages_of(rank)
    if sorted(stages) != mine:
        raise ValueError(f"rank {rank} holds stages {mine} under this schedule; got modules for {sorted(stages)}")
    if len(microbatches) != schedule.m or len(targets) != schedule.m:
        raise ValueError(
            f"the schedule has m={schedule.m} micro-batches; got {len(microbatches)} inputs and {len(targets)} targets"
        )
    device = next(stages[mine[0]].parameters()).device
    mailbox = Mailbox(schedule, rank, group, hidden_shape, dtype, device)
    step = _Step(schedule, rank, stages, microbatches, targets, loss_fn, device, mailbox, observer)
    for action in schedule.actions[rank]:
        if action.op not in HANDLERS:
            raise ValueError(f"unknown action {action!r}")
        if action.op in COMPUTE:
            mailbox.post()  # the held sends leave before this rank computes (messages.py, rule 2)
        HANDLERS[action.op](step, action)
    mailbox.close()
    return step.result
