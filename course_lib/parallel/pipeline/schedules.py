"""Pipeline schedules as data: for each rank, the list of actions it runs in one training step.

The symbols are those of Narayanan et al. 2021 (*Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM*, §2.2): a model cut into ``n_stages`` consecutive stages runs on
``p`` ranks (the pipeline's ``pp_size``); a step feeds ``m`` micro-batches through it; each rank
holds ``v = n_stages / p`` stages (model chunks), placed by ``placement[stage] = rank``. A schedule
says, per rank, in which order to run the passes of Qi et al. 2023 (*Zero Bubble Pipeline
Parallelism*, §2, whose B is our I; we follow torch.distributed.pipelining's names)

    F  forward of micro-batch i on stage s          I  backward for the input only (dL/dx)
    B  backward, input and weight gradients         W  backward for the weights only (dL/dθ)

and, where a neighbouring stage lives on another rank, the point-to-point messages:

    SEND_F / RECV_F   stage s's output activation, to / from the next stage's rank
    SEND_B / RECV_B   the gradient of stage s's input, to / from the previous stage's rank

Sends are non-blocking; a receive blocks until its message arrives. The same lists drive
:mod:`course_lib.parallel.pipeline.simulate` (a timeline from per-action costs, without a model)
and :mod:`course_lib.parallel.pipeline.executor` (the course model over torch.distributed).

The schedules, each a function of (p, m[, v]):

    gpipe        all forwards, then all backwards (Huang et al. 2019, *GPipe*)
    1f1b         p - r - 1 warm-up forwards on rank r, then one forward, one backward in turn, then
                 the remaining backwards (PipeDream-Flush; Narayanan et al. 2021, §2.2.1)
    interleaved  1F1B over v chunks per rank, stage s on rank s mod p; forwards go through chunk
                 0 for p micro-batches, then chunk 1, ... (Narayanan et al. 2021, §2.2.2); m must be
                 a multiple of p
    zb-h1        1F1B with each backward split into I and W; rank r delays its W's by r backwards
                 so that they fill the idle time at the end of the step (Qi et al. 2023, §2.1, ZB-H1:
                 the same peak memory as 1F1B)
    dualpipev    two stages per rank in a V, forward of one paired with backward of the other
                 (DeepSeek-V3 technical report 2024, §3.2.1, DualPipe; its V-shaped variant); m >= 2p

Tested in tests/parallel/pipeline/test_pipeline.py (lists valid, no deadlock, bubble and in-flight = cost/pipeline.py)
and by the grader checks of course_lib/grading/labs/lab05_pipeline.py, via tests/grading/test_lab_checks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 (the four passes of the module docstring)
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, I, W)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")


@dataclass(frozen=True)
class Action:
    """One step of a rank's list: ``op`` on ``microbatch`` at (virtual) ``stage``."""

    op: str
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.op}{self.microbatch}@s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists (compute and messages) for one step of a ``p``-rank pipeline."""

    name: str
    p: int
    m: int
    v: int
    placement: tuple[int, ...]  # placement[stage] = the rank that holds it
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in order

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        """The rank's compute actions only, in order."""
        return [a for a in self.actions[rank] if a.op in COMPUTE]


# ----------------------------------------------------------------------------- the compute orders


def _gpipe(p: int, m: int, r: int) -> list[Action]:
    return [Action(F, i, r) for i in range(m)] + [Action(B, i, r) for i in range(m)]


def _one_f_one_b(p: int, m: int, r: int, backward: str = B) -> list[Action]:
    warmup = min(p - r - 1, m)
    out = [Action(F, i, r) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action(F, warmup + i, r), Action(backward, i, r)]
    return out + [Action(backward, i, r) for i in range(m - warmup, m)]


def _zb_h1(p: int, m: int, r: int) -> list[Action]:
    """1F1B's order with B split into I and W; W of the k-th backward runs after the (k + r)-th I,
    and every W left over follows the last I. Rank r's end-of-step idle time is about r backwards
    long under 1F1B, which is what the delayed W's fill."""
    out, done_w = [], 0
    for a in _one_f_one_b(p, m, r, backward=I):
        out.append(a)
        if a.op == I and a.microbatch >= r:
            out.append(Action(W, done_w, r))
            done_w += 1
    return out + [Action(W, i, r) for i in range(done_w, m)]


def _interleaved(p: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): the k-th
    forward of a rank is micro-batch (k // pv)·p + k mod p on chunk (k // p) mod v; backwards
    walk the chunks in reverse. Warm-up: 2(p - r - 1) + (v - 1)·p forwards."""
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Action:
        return Action(F, microbatch(k), ((k // p) % v) * p + r)

    def backward(k: int) -> Action:
        return Action(B, microbatch(k), (v - 1 - (k // p) % v) * p + r)

    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    return out + [backward(k) for k in range(total - warmup, total)]


class _VRank:
    """One rank's DualPipeV list, written an action at a time: each (stage, pass) takes the next
    micro-batch in order, and each I queues its W until a W slot comes (``add(W)``: the oldest)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[int, bool], int] = {}  # (stage, forward?) -> its next micro-batch
        self.queued_w: list[tuple[int, int]] = []  # (micro-batch, stage) of each I whose W has not run

    def add(self, op: str, stage: int | None) -> None:
        if op == W:
            if self.queued_w:
                self.actions.append(Action(W, *self.queued_w.pop(0)))
            return
        key = (stage, op == F)  # B and I share one count: each micro-batch's backward runs once
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        self.actions.append(Action(op, i, stage))
        if op == I:
            self.queued_w.append((i, stage))


def _dualpipe_v(p: int, m: int, r: int) -> list[Action]:
    """DualPipeV: DualPipe (DeepSeek-V3 technical report, §3.2.1) cut in half into a V (Sea AI Lab's
    "Cut-in-half"; the open-source DualPipeV, whose eight steps the table below follows).

    The V: rank r holds stage r (chunk 0, on the way down) and stage 2p - 1 - r (chunk 1, on the way
    back up): the last rank holds the two middle stages (the tip), rank 0 both ends (embedding, loss).
    The F/B pairing: in the steady state every forward of one chunk comes with a backward of the
    other (two cells in one black border in the report's Fig. 5), which a GPU runs overlapped, one's
    computation hiding the other's communication (Fig. 4); written F then B here. Near the end the
    backwards split into I and W, and the queued W's fill the gaps (Qi et al. 2023, §2)."""
    down, up = r, 2 * p - 1 - r
    below = p - r - 1  # ranks between this one and the tip of the V
    F0, F1, B0, B1, I0, I1 = (F, down), (F, up), (B, down), (B, up), (I, down), (I, up)
    W_ = (W, None)  # the W of the oldest I still queued
    # the cool-down's 2(r + 1) backwards, chunk 1 and chunk 0 in turn: the first half whole, the second split
    drain = [(B if k <= r else I, up if k % 2 == 0 else down) for k in range(2 * r + 2)]
    phases = (  # (rounds, one round): the open-source DualPipeV's steps 1 to 8 on rank r
        # 1 warm-up: chunk 0 alone, while the first micro-batch goes down to the tip and back up here
        (2 * below, [F0]),
        # 2 both chunks forward, until chunk 1's first gradient comes back from the loss on rank 0
        (r + 1, [F0, F1]),
        # 3 chunk 1's first backwards, I first (its gradient leaves for rank r + 1 before the W)
        (below, [I1, W_, F1]),
        # 4 steady state, the pairs of the report's figure: F0 with B1, then F1 with B0
        (m - 2 * p + r + 1, [F0, B1, F1, B0]),
        # 5 chunk 0's forwards are done: B1 alone, then the pair F1 with B0
        (below, [B1, F1, B0]),
        # 6 cool-down: the last backwards of both chunks, the second half split into I and W
        (1, drain),
        # 7 the queued W's fill the wait for chunk 0's last gradients
        (below, [W_, I0]),
        # 8 the W's left
        (r + 1, [W_]),
    )
    rank = _VRank()
    for rounds, pattern in phases:
        for _ in range(rounds):
            for op, stage in pattern:
                rank.add(op, stage)
    assert not rank.queued_w, "every I has its W"
    return rank.actions


# ----------------------------------------------------------------------------- messages


def with_messages(compute: list[Action], placement: tuple[int, ...]) -> tuple[Action, ...]:
    """Insert a blocking receive before each compute that needs another rank's tensor, and a send
    after each compute whose result another rank needs."""
    n, rank = len(placement), placement[compute[0].stage] if compute else None
    out = []
    for a in compute:
        s, i = a.stage, a.microbatch
        prev_remote = s > 0 and placement[s - 1] != rank
        next_remote = s < n - 1 and placement[s + 1] != rank
        if a.op == F and prev_remote:
            out.append(Action(RECV_F, i, s))
        if a.op in (B, I) and next_remote:
            out.append(Action(RECV_B, i, s))
        out.append(a)
        if a.op == F and next_remote:
            out.append(Action(SEND_F, i, s))
        if a.op in (B, I) and prev_remote:
            out.append(Action(SEND_B, i, s))
    return tuple(out)


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` for ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: choose one of {SCHEDULES}")
    for what, value in (("p (pipeline ranks)", p), ("m (micro-batches per step)", m), ("v (stages per rank)", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    if name == "interleaved":
        if v < 2:
            raise ValueError(f"the interleaved schedule needs v >= 2 stages per rank, got v={v}; v=1 is plain 1f1b")
        if m % p:
            raise ValueError(
                f"the interleaved schedule sends micro-batches through each chunk in groups of p={p}: "
                f"m={m} is not a multiple of p; use m={-(-m // p) * p}"
            )
    elif name == "dualpipev":
        if v != 2:
            raise ValueError(f"dualpipev holds two stages per rank, in a V: use v=2, got v={v}")
        if m < 2 * p:
            raise ValueError(f"dualpipev needs m >= 2p micro-batches to fill both arms of the V: m={m} < {2 * p}")
    elif v != 1:
        raise ValueError(f"schedule {name!r} holds one stage per rank: use v=1, or 'interleaved' for v={v}")
    if name == "dualpipev":  # the V: down the ranks, then back up
        placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    else:
        placement = tuple(s % p for s in range(p * v))
    order = {
        "gpipe": lambda r: _gpipe(p, m, r),
        "1f1b": lambda r: _one_f_one_b(p, m, r),
        "zb-h1": lambda r: _zb_h1(p, m, r),
        "interleaved": lambda r: _interleaved(p, m, v, r),
        "dualpipev": lambda r: _dualpipe_v(p, m, r),
    }[name]
    actions = tuple(with_messages(order(r), placement) for r in range(p))
    return Schedule(name, p, m, v, placement, actions)


def check(schedule: Schedule) -> None:
    """Raise ValueError unless every (micro-batch, stage) is computed exactly once, on its rank, forward
    before backward (and I before W), and every message sent is received by the rank that needs it."""
    need = {(i, s) for i in range(schedule.m) for s in range(schedule.n_stages)}
    sent, received = [], []
    for rank, actions in enumerate(schedule.actions):
        seen: dict[tuple, list[str]] = {}
        for a in actions:
            key = (a.microbatch, a.stage)
            if a.op in COMPUTE:
                if schedule.placement[a.stage] != rank:
                    raise ValueError(
                        f"rank {rank} runs {a!r}, but stage {a.stage} lives on rank {schedule.placement[a.stage]}"
                    )
                done = seen.setdefault(key, [])
                if a.op != F and F not in done:
                    raise ValueError(f"rank {rank}: {a!r} comes before the forward {Action(F, *key)!r}")
                if a.op == W and I not in done:
                    raise ValueError(f"rank {rank}: {a!r} comes before its input-gradient pass I")
                if a.op in done:
                    raise ValueError(f"rank {rank} runs {a!r} twice")
                done.append(a.op)
            elif a.op in (SEND_F, SEND_B):
                dst = schedule.placement[a.stage + (1 if a.op == SEND_F else -1)]
                sent.append((a.op[-1], a.microbatch, a.stage, rank, dst))
            else:
                src = schedule.placement[a.stage + (1 if a.op == RECV_B else -1)]
                received.append((a.op[-1], a.microbatch, a.stage + (-1 if a.op == RECV_F else 1), src, rank))
        for key, done in seen.items():
            if sorted(done) not in (["B", "F"], ["F", "I", "W"]):
                raise ValueError(
                    f"rank {rank}: micro-batch {key[0]} on stage {key[1]} ran {done}; needs F and B, or F, I and W"
                )
        need -= set(seen)
    if need:
        raise ValueError(f"no rank computes (micro-batch, stage) {sorted(need)[:6]}")
    if sorted(sent) != sorted(received):
        unmatched = sorted(set(sent) ^ set(received))[:6]
        raise ValueError(f"sends and receives do not pair up: {unmatched} (kind, micro-batch, stage, src, dst)")
