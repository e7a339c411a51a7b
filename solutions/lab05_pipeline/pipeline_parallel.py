"""Lab 05 — pipeline parallelism: the 1F1B schedule (and interleaved 1F1B for extra credit).

A model cut into consecutive stages runs on p ranks; a training step feeds m micro-batches through
it. A *schedule* says, for each rank, in which order to run the forward (F) and backward (B) of
each micro-batch on each stage it holds, and where the activations and gradients travel between
ranks. Here a schedule is data — one list of :class:`Action` per rank — and course_lib runs it:

    Action(op, microbatch, stage)       op: "F" | "B" | "SEND_F" | "RECV_F" | "SEND_B" | "RECV_B"

    F       forward of micro-batch i on stage s (needs stage s-1's output of micro-batch i)
    B       backward of micro-batch i on stage s (needs the gradient of stage s's output, from s+1)
    SEND_F  send stage s's output of micro-batch i to the rank of stage s+1   (non-blocking)
    RECV_F  receive stage s-1's output of micro-batch i, for stage s           (blocks until it arrives)
    SEND_B  send the gradient of stage s's input to the rank of stage s-1     (non-blocking)
    RECV_B  receive the gradient of stage s's output from the rank of stage s+1 (blocks)

Stage s lives on rank placement[s] = s mod p: one stage per rank for 1F1B (stage = rank), v stages
("model chunks") per rank for interleaved 1F1B (rank r holds stages r, p + r, 2p + r, ...).

You write the compute orders (Tasks 1 and 3) and the send/receive pairing (Task 2);
:func:`build_schedule` (given) puts them together. Given, from course_lib.parallel.pipeline (read
their docstrings; the grader uses them too):

    check(schedule)              raises ValueError if a micro-batch is missing, doubled, backward
                                 before forward, or a send has no matching receive
    simulate(schedule, cost)     plays the lists with cost = {"F": 1, "B": 2} time units; raises
                                 Deadlock (naming what each rank waits on) if no rank can move;
                                 .bubble_fraction(), .peak_in_flight(), .spans (the timeline)
    run_step(schedule, ...)      runs one training step of the course model over torch.distributed

Try yours as you go: ``check(build_schedule(4, 8))``, ``simulate(build_schedule(4, 8), {"F": 1, "B": 2})``.
Source: D. Narayanan et al., *Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM*, SC21, §2.2 (2.2.1: 1F1B, the PipeDream-Flush schedule; 2.2.2: the interleaved one).
"""

from course_lib.parallel.pipeline.schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, Schedule

# ------------------------------------------------------------------------------ Task 1


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """The compute order of 1F1B (Narayanan et al. 2021, §2.2.1) on ``rank`` of a ``p``-rank pipeline.

    Rank r holds stage r. In three phases:

      warm-up      w = min(p - r - 1, m) forwards: F0, F1, ..., F(w-1)
      steady       one forward, one backward, in turn: F(w), B0, F(w+1), B1, ... until every
                   micro-batch has had its forward
      cool-down    the backwards left: ..., B(m-1)

    Backwards run in micro-batch order. The last rank has no warm-up (it can start a backward as soon
    as a forward is done); the first waits longest. So rank r holds at most min(p - r, m)
    micro-batches' activations at once — p on the first rank, whatever m is — where GPipe (all F, then
    all B) holds m. The bubble is the same: (p - 1)/(m + p - 1) of the step.
    Return only F and B actions (``Action(F, i, rank)``, ``Action(B, i, rank)``): messages are Task 2.
    """
    # BEGIN SOLUTION Task 1: return this rank's 1F1B order, a list of Action(F or B, microbatch, rank): min(p - rank - 1, m) forwards, then one forward and one backward in turn, then the backwards left
    warmup = min(p - rank - 1, m)
    order = [Action(F, i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(F, warmup + i, rank), Action(B, i, rank)]
    return order + [Action(B, i, rank) for i in range(m - warmup, m)]
    # END SOLUTION


# ------------------------------------------------------------------------------ Task 2


def with_messages(compute: list[Action], placement: tuple[int, ...]) -> tuple[Action, ...]:
    """One rank's full action list: its ``compute`` order with the messages it needs, in place.

    ``placement[s]`` is the rank of stage s; this rank is the one that holds ``compute``'s stages.
    For each compute action on stage s of micro-batch i, in order:

      * F, when stage s-1 is on another rank: RECV_F right before it (its input comes from there);
      * B, when stage s+1 is on another rank: RECV_B right before it (its output's gradient does);
      * F, when stage s+1 is on another rank: SEND_F right after it;
      * B, when stage s-1 is on another rank: SEND_B right after it.

    (All four with the same microbatch and stage as the compute action.) Nothing is sent between two
    stages of the same rank, and the first stage receives no input, the last no gradient: the
    runtime hands those over in memory. Why right before and right after? A receive blocks: placed
    earlier, the rank waits for a tensor it does not need yet; a send placed later keeps a
    neighbour waiting. Either can stretch the bubble, or deadlock the pipeline.
    """
    # BEGIN SOLUTION Task 2: return a tuple: compute's actions in their order, each with its RECV_F / RECV_B right before it and its SEND_F / SEND_B right after it where the neighbouring stage is on another rank
    n = len(placement)
    rank = placement[compute[0].stage] if compute else None
    out = []
    for a in compute:
        s, i = a.stage, a.microbatch
        prev_remote = s > 0 and placement[s - 1] != rank
        next_remote = s < n - 1 and placement[s + 1] != rank
        if a.op == F and prev_remote:
            out.append(Action(RECV_F, i, s))
        if a.op == B and next_remote:
            out.append(Action(RECV_B, i, s))
        out.append(a)
        if a.op == F and next_remote:
            out.append(Action(SEND_F, i, s))
        if a.op == B and prev_remote:
            out.append(Action(SEND_B, i, s))
    return tuple(out)
    # END SOLUTION


# --------------------------------------------------------------- Task 3 (extra credit): interleaved


def interleaved(p: int, m: int, v: int, rank: int) -> list[Action]:
    """The compute order of interleaved 1F1B (Narayanan et al. 2021, §2.2.2; Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``) with ``v`` chunks per rank; m is a multiple of p.

    Rank r holds chunks c = 0 ... v-1, chunk c being stage c·p + r. A rank runs m·v forwards and m·v
    backwards; number them k = 0, 1, ..., m·v - 1. Micro-batches go through the chunks in groups of p:

      the k-th forward   micro-batch (k // (p·v))·p + k mod p   on chunk (k // p) mod v
      the k-th backward  the same micro-batch                   on chunk v - 1 - (k // p) mod v

    (backwards walk the chunks from the last one back). The phases are 1F1B's, with
      warm-up  w = min(2(p - r - 1) + (v - 1)·p, m·v) forwards,
    then the k-th backward after the (w + k)-th forward, then the backwards left.
    Each chunk is 1/v of a stage's work, so the bubble shrinks to (p - 1)/(v·m + p - 1).
    """
    # BEGIN SOLUTION Task 3: return this rank's interleaved order, a list of m·v forwards and m·v backwards Action(F or B, microbatch, chunk·p + rank): warm-up, one forward and one backward in turn, cool-down
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action(F, microbatch(k), ((k // p) % v) * p + rank)

    def backward(k: int) -> Action:
        return Action(B, microbatch(k), (v - 1 - (k // p) % v) * p + rank)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]
    # END SOLUTION


# ------------------------------------------------------------------------------ given


def build_schedule(p: int, m: int, v: int = 1) -> Schedule:
    """Given: your compute orders with your messages, as a course_lib Schedule — 1F1B for v = 1,
    interleaved 1F1B for v > 1. (The grader builds its schedules the same way.)"""
    placement = tuple(s % p for s in range(p * v))
    order = (lambda r: one_f_one_b(p, m, r)) if v == 1 else (lambda r: interleaved(p, m, v, r))
    actions = tuple(tuple(with_messages(order(r), placement)) for r in range(p))
    return Schedule("1f1b" if v == 1 else "interleaved", p, m, v, placement, actions)
