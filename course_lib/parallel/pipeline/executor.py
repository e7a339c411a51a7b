"""Execute a pipeline schedule over torch.distributed point-to-point: one training step.

Each rank walks its action list from :mod:`course_lib.parallel.pipeline.schedules`:

    F       run the stage on the micro-batch (tokens on stage 0, the received or local hidden state
            elsewhere); the last stage computes the loss divided by m, so that the gradients summed
            over the m micro-batches are those of the mean loss of the whole batch
    B       backward through the stage from the received gradient (from the loss on the last stage)
    I, W    the same backward in two passes: first to the stage's input only (what the previous
            stage waits for), later to the weights (what nobody waits for). Here W runs autograd a
            second time from the stage's output, so its gradients are exact but it re-does part of
            I's work; torch.distributed.pipelining keeps I's intermediate gradients instead.
    SEND_*  ``dist.isend``, posted together with this rank's next receive (below); completed
            before the step returns
    RECV_*  ``dist.irecv``, waited for at once. NCCL ignores tags and matches a pair's messages in
            the order they were sent, and a schedule may need them in another order (DualPipeV at
            p >= 3: a rank sends chunk 0's activations and chunk 1's gradients down the same link).
            So a rank receives each neighbour's messages in *the sender's* order — every rank knows
            every list — and keeps the ones that come early until their action needs them. Each
            message also carries a tag per (kind, micro-batch, stage), which gloo checks.

A send that a receive follows goes out with it. In 1F1B's steady state two neighbours each send
to the other and then receive from it (stage s sends F(i) and waits for B(j); stage s+1 sends B(j)
and waits for F(i+1)): a *crossing* pair. Gloo buffers the sends, but under NCCL a send kernel
waits for its receive, and both receives would queue behind the sends on the same stream: a
deadlock once the message is larger than NCCL's eager buffer. So a send is held until the rank's
next receive or compute action: every held send and that receive are posted as one
``dist.batch_isend_irecv`` (one NCCL group, see :mod:`course_lib.dist.p2p`; torch.distributed.
pipelining's 1F1B fuses its sends and receives the same way), and before a compute action the held
sends are posted alone — as early as an immediate ``isend``, so the pipeline's timing is unchanged.
Every pair's messages keep their order. The calls are the same ``isend`` / ``irecv`` with the same
tags (``p2p.exchange`` takes one tag per batch, so the batch is built here with each message's
own), and on gloo the numbers are bit for bit those of a blocking receive.

A stage's saved input and output are dropped when its last backward action for that micro-batch
has run: that is the moment its activations are freed, and ``peak_in_flight`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import trace
from course_lib.parallel.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F, B, F, I, Schedule, W


@dataclass
class StepResult:
    losses: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss (ranks with the last stage)
    peak_in_flight: int = 0  # most (micro-batch, stage) activations held at once on this rank
    peak_activation_bytes: int = 0  # most bytes autograd kept saved for backward at once on this rank
    activation_bytes: dict[int, int] = field(default_factory=dict)  # stage -> bytes one micro-batch saves


def arrival_order(schedule: Schedule, src: int, dst: int) -> list[tuple[str, int, int]]:
    """The messages rank ``src`` sends to rank ``dst``, in the order it sends them:
    ("F" | "B", micro-batch, the sending stage)."""
    out = []
    for a in schedule.actions[src]:
        if a.op in (SEND_F, SEND_B) and schedule.placement[a.stage + (1 if a.op == SEND_F else -1)] == dst:
            out.append((a.op[-1], a.microbatch, a.stage))
    return out


def _tag(kind: str, microbatch: int, stage: int, n_stages: int) -> int:
    return 2 * (microbatch * n_stages + stage) + (kind == "B")


def run_step(
    schedule: Schedule,
    stages: dict[int, nn.Module],
    microbatches: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    group=None,
) -> StepResult:
    """Run this rank's actions of ``schedule``; ``stages`` maps each stage index it holds to its module.

    ``hidden_shape`` is one micro-batch's hidden state, [batch, seq, d_model]: what a receiver
    allocates. Gradients accumulate in the stages' ``.grad``, as with a plain backward.
    """
    rank = dist.get_rank(group)
    mine = schedule.stages_of(rank)
    if sorted(stages) != mine:
        raise ValueError(f"rank {rank} holds stages {mine} under this schedule; got modules for {sorted(stages)}")
    if len(microbatches) != schedule.m or len(targets) != schedule.m:
        raise ValueError(
            f"the schedule has m={schedule.m} micro-batches; got {len(microbatches)} inputs and {len(targets)} targets"
        )
    n, m = schedule.n_stages, schedule.m
    device = next(stages[mine[0]].parameters()).device

    def peer(stage: int) -> int:
        r = schedule.placement[stage]
        return dist.get_global_rank(group, r) if group is not None else r

    inbox: dict[tuple, torch.Tensor] = {}  # ("F" | "B", micro-batch, stage it is for) -> tensor
    saved: dict[tuple, tuple] = {}  # (micro-batch, stage) -> (input, output)
    held: dict[tuple, int] = {}  # (micro-batch, stage) -> bytes autograd saved in its forward
    weights = {p.untyped_storage()._cdata for st in stages.values() for p in st.parameters()}
    weights |= {b.untyped_storage()._cdata for st in stages.values() for b in st.buffers()}

    def counting(key: tuple):
        """Count the distinct storages autograd saves for backward (weights and RoPE tables are not activations)."""
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st._cdata not in weights:
                storages[st._cdata] = st.nbytes()
            held[key] = sum(storages.values())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    outbox: list[dist.P2POp] = []  # sends not posted yet: they go with the next receive (module doc)
    posted: list = []  # every batch's works, waited for before the step returns

    def post(receive: dist.P2POp | None = None) -> None:
        """Post the held sends and ``receive`` as one batch; wait for the receive, keep the rest."""
        ops = [*outbox, *([receive] if receive is not None else [])]
        outbox.clear()
        works = dist.batch_isend_irecv(ops) if ops else []
        if receive is not None:  # its work is the last: gloo returns one per op, NCCL one for the batch
            works.pop().wait()  # (a gloo work must not be waited for twice: the second wait never returns)
        posted.extend(works)

    result = StepResult()
    arrivals = {src: arrival_order(schedule, src, rank) for src in range(schedule.p) if src != rank}
    for a in schedule.actions[rank]:
        key, s = (a.microbatch, a.stage), a.stage
        if a.op not in (SEND_F, SEND_B, RECV_F, RECV_B):
            post()  # compute next: the held sends leave now, as early as an isend would have
        if a.op in (RECV_F, RECV_B):
            kind, src = a.op[-1], s - 1 if a.op == RECV_F else s + 1
            sender = schedule.placement[src]
            while (kind, a.microbatch, s) not in inbox:  # receive in the sender's order until ours is in
                k, mb, their = arrivals[sender].pop(0)
                t = torch.empty(hidden_shape, dtype=dtype, device=device)
                post(dist.P2POp(dist.irecv, t, peer(their), group, _tag(k, mb, their, n)))
                inbox[(k, mb, their + 1 if k == "F" else their - 1)] = t
        elif a.op == F:
            with trace.span("F", mb=a.microbatch, stage=s), counting(key):
                if s == 0:
                    x = microbatches[a.microbatch].to(device)
                else:
                    x = inbox.pop(("F", *key)).detach().requires_grad_()
                y = stages[s](x)
                if s == n - 1:
                    loss = loss_fn(y, targets[a.microbatch].to(device))
                    result.losses[a.microbatch] = loss.item()
                    y = loss / m
                elif schedule.placement[s + 1] == rank:
                    inbox["F", a.microbatch, s + 1] = y.detach()
            saved[key] = (x, y)
            result.peak_in_flight = max(result.peak_in_flight, len(saved))
            result.activation_bytes[s] = held.get(key, 0)
            result.peak_activation_bytes = max(result.peak_activation_bytes, sum(held.values()))
        elif a.op == SEND_F:
            outbox.append(dist.P2POp(dist.isend, saved[key][1].detach(), peer(s + 1), group, _tag("F", *key, n)))
        elif a.op in (B, I):
            x, y = saved[key] if a.op == I else saved.pop(key)
            if a.op == B:
                held.pop(key, None)  # the backward frees what the forward saved
            grad = None if s == n - 1 else inbox.pop(("B", *key))
            with trace.span(a.op, mb=a.microbatch, stage=s):
                if a.op == B:
                    torch.autograd.backward(y, grad)
                elif s > 0:  # I on stage 0 has no input to differentiate: W does all the work
                    torch.autograd.backward(y, grad, inputs=[x], retain_graph=True)
            if a.op == I:
                saved[key] = (x, y, grad)
            if s > 0:  # the gradient of the stage's input, for the previous stage: sent, or kept here
                local = schedule.placement[s - 1] == rank
                inbox[("B", a.microbatch, s - 1) if local else ("dx", *key)] = x.grad
        elif a.op == W:
            x, y, grad = saved.pop(key)
            held.pop(key, None)
            params = [p for p in stages[s].parameters() if p.requires_grad]
            with trace.span("W", mb=a.microbatch, stage=s):
                torch.autograd.backward(y, grad, inputs=params)
        elif a.op == SEND_B:
            dx = inbox.pop(("dx", *key))
            outbox.append(dist.P2POp(dist.isend, dx, peer(s - 1), group, _tag("B", *key, n)))
        else:
            raise ValueError(f"unknown action {a!r}")
    post()  # the last sends: no receive left to pair them with
    for work in posted:
        work.wait()
    return result


def tied_group(schedule: Schedule):
    """The process group of the first and the last stage's ranks, for tied embeddings (collective:
    every rank calls it, in the same order); None when one rank holds both."""
    ranks = sorted({schedule.placement[0], schedule.placement[-1]})
    return dist.new_group(ranks) if len(ranks) == 2 else None


def sum_tied_gradients(schedule: Schedule, stages: dict[int, nn.Module], group) -> None:
    """With tied embeddings the first stage's embedding and the last stage's output layer are two
    copies of one matrix: give both the sum of their gradients (call after the step's backward)."""
    last = schedule.n_stages - 1
    ends = [stages[s] for s in (0, last) if s in stages]
    if not ends or not ends[0].tied:
        return
    weights = [stages[0].tok_embeddings.weight] if 0 in stages else []
    weights += [stages[last].output.weight] if last in stages else []
    for w in weights:
        if w.grad is None:
            w.grad = torch.zeros_like(w)
    if len(weights) == 2:  # one rank holds both ends
        total = weights[0].grad + weights[1].grad
        for w in weights:
            w.grad.copy_(total)
    else:
        dist.all_reduce(weights[0].grad, group=group)
