"""The point-to-point messages of one pipeline step, posted in an order no backend deadlocks on.

A pipeline rank sends two kinds of message to a neighbouring stage's rank: "F", the activation of
micro-batch i that stage s computed, for stage s + 1; and "B", the gradient of stage s's input, for
stage s - 1. Every message carries the tag ``2·(i·n_stages + s) + (kind == "B")``, which gloo checks
and NCCL ignores. This module is the one place that decides *when* each ``dist.isend`` and
``dist.irecv`` is posted; :mod:`course_lib.parallel.pipeline.executor` only says what to send and
what it needs next. Two rules:

1. Receive in the sender's order. NCCL matches a pair of ranks' messages in the order they were
   sent, whatever their tags, and a schedule may need them in another order (DualPipeV at p >= 3:
   a rank sends chunk 0's activations and chunk 1's gradients down the same link). Every rank knows
   every action list, so it knows the order each neighbour sends in (:func:`arrival_order`): it
   receives in that order and keeps the messages that come early until an action needs them.

2. Post a held send together with the next receive. In 1F1B's steady state two neighbours each send
   to the other and then receive from it (stage s sends F(i) and waits for B(j); stage s + 1 sends
   B(j) and waits for F(i + 1)): a *crossing* pair. Gloo buffers the sends, but under NCCL a send
   kernel waits for its receive, and both receives queue behind the sends on the same stream: a
   deadlock once the message is larger than NCCL's eager buffer (see :mod:`course_lib.dist.p2p`).
   So a send is held until the rank's next receive or compute action: the held sends and that
   receive are posted as one ``dist.batch_isend_irecv`` (one NCCL group; torch.distributed.
   pipelining's 1F1B fuses its sends and receives the same way), and before a compute action the
   held sends are posted alone — as early as an immediate ``isend``, so the pipeline's timing is
   unchanged. Every pair's messages keep their order. The calls are the same ``isend`` / ``irecv``
   with the same tags (``p2p.exchange`` takes one tag per batch, so the batch is built here with
   each message's own), and on gloo the numbers are bit for bit those of a blocking receive.

Tested in tests/parallel/pipeline/test_pipeline.py (``test_messages_are_received_in_the_order_they_were_sent``; every
schedule run at p = 2 and 4) and tests/parallel/test_device_parallel.py (the batches NCCL sees).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel.pipeline.schedules import SEND_B, SEND_F, Schedule

Message = tuple[str, int, int]  # ("F" | "B", micro-batch, the stage that sends it)


def arrival_order(schedule: Schedule, src: int, dst: int) -> list[Message]:
    """The messages rank ``src`` sends to rank ``dst``, in the order it sends them:
    ("F" | "B", micro-batch, the sending stage)."""
    out = []
    for a in schedule.actions[src]:
        if a.op in (SEND_F, SEND_B) and schedule.placement[a.stage + (1 if a.op == SEND_F else -1)] == dst:
            out.append((a.op[-1], a.microbatch, a.stage))
    return out


def tag(kind: str, microbatch: int, stage: int, n_stages: int) -> int:
    """The tag of message (``kind``, ``microbatch``, sending ``stage``): one per message of a step."""
    return 2 * (microbatch * n_stages + stage) + (kind == "B")


class Mailbox:
    """This rank's sends and receives for one step of ``schedule`` over ``group`` (rules 1 and 2 above)."""

    def __init__(self, schedule: Schedule, rank: int, group, hidden_shape, dtype: torch.dtype, device):
        self.schedule, self.group = schedule, group
        self.hidden_shape, self.dtype, self.device = hidden_shape, dtype, device
        self.arrivals = {src: arrival_order(schedule, src, rank) for src in range(schedule.p) if src != rank}
        self.held: list[dist.P2POp] = []  # sends not posted yet: they go with the next receive (rule 2)
        self.posted: list = []  # every batch's works, waited for when the step ends

    def _global_rank(self, stage: int) -> int:
        """The global rank of the rank holding ``stage`` (schedules number ranks within ``group``)."""
        r = self.schedule.placement[stage]
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def send(self, kind: str, tensor: torch.Tensor, microbatch: int, stage: int) -> None:
        """Hold the message (``kind``, ``microbatch``, ``stage``) for stage s + 1 ("F") or s - 1 ("B")."""
        to = stage + 1 if kind == "F" else stage - 1
        t = tag(kind, microbatch, stage, self.schedule.n_stages)
        self.held.append(dist.P2POp(dist.isend, tensor, self._global_rank(to), self.group, t))

    def receive_next(self, sender: int) -> tuple[tuple[str, int, int], torch.Tensor]:
        """Receive the next message rank ``sender`` sends this rank (rule 1), posted with the held
        sends (rule 2), and wait for it. Returns (kind, micro-batch, the stage it is for), tensor."""
        kind, microbatch, their = self.arrivals[sender].pop(0)
        t = torch.empty(self.hidden_shape, dtype=self.dtype, device=self.device)
        n = self.schedule.n_stages
        self.post(dist.P2POp(dist.irecv, t, self._global_rank(their), self.group, tag(kind, microbatch, their, n)))
        return (kind, microbatch, their + 1 if kind == "F" else their - 1), t

    def post(self, receive: dist.P2POp | None = None) -> None:
        """Post the held sends and ``receive`` as one batch; wait for the receive, keep the rest.
        Called with no receive before each compute action: the held sends leave as early as an
        ``isend`` would have."""
        ops = [*self.held, *([receive] if receive is not None else [])]
        self.held.clear()
        works = dist.batch_isend_irecv(ops) if ops else []
        if receive is not None:  # its work is the last: gloo returns one per op, NCCL one for the batch
            works.pop().wait()  # (a gloo work must not be waited for twice: the second wait never returns)
        self.posted.extend(works)

    def close(self) -> None:
        """Post the last sends (no receive is left to pair them with) and wait for every send."""
        self.post()
        for work in self.posted:
            work.wait()
