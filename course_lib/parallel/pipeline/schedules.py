"""Pipeline schedules as data: for each rank, the list of actions it runs in one training step.

A model cut into ``n_stages`` consecutive stages runs on ``p`` ranks; a step feeds ``m``
micro-batches through it. Each rank holds ``v = n_stages / p`` stages (model chunks), placed by
``placement[stage] = rank``. A schedule says, per rank, in which order to run

    F  forward of micro-batch i on stage s          I  backward for the input only (dL/dx)
    B  backward, input and weight gradients         W  backward for the weights only (dL/dθ)

and, where a neighbouring stage lives on another rank, the point-to-point messages:

    SEND_F / RECV_F   stage s's output activation, to / from the next stage's rank
    SEND_B / RECV_B   the gradient of stage s's input, to / from the previous stage's rank

Sends are non-blocking; a receive blocks until its message arrives. The same lists drive
:mod:`course_lib.parallel.pipeline.simulate` (a timeline from per-action costs, without a model)
and :mod:`course_lib.parallel.pipeline.runtime` (the course model over torch.distributed).

The schedules, each a function of (p, m[, v]):

    gpipe        all forwards, then all backwards (Huang et al. 2019, *GPipe*)
    1f1b         p - r - 1 warm-up forwards on rank r, then one forward, one backward in turn, then
                 the remaining backwards (PipeDream-Flush; Narayanan et al. 2021, §2.2.1)
    interleaved  1F1B over v chunks per rank, stage s on rank s mod p; forwards go through chunk
                 0 for p micro-batches, then chunk 1, ... (Narayanan et al. 2021, §2.2.2); m must be
                 a multiple of p
    zb-h1        1F1B with each backward split into I and W; rank r delays its W's by r
                 backwards so that they fill the idle time at the end of the step (Qi et al. 2023,
                 *Zero Bubble Pipeline Parallelism*, §3, ZB-H1: the same peak memory as 1F1B)
    dualpipev    two stages per rank in a V, forward of one paired with backward of the other
                 (DeepSeek-V3 technical report 2024, §3.2.1, DualPipe; its V-shaped variant); m >= 2p
"""

from __future__ import annotations

from dataclasses import dataclass

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 (the zero-bubble paper's names for the four passes)
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

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return Action(F, mb(k), ((k // p) % v) * p + r)

    def bwd(k: int) -> Action:
        return Action(B, mb(k), (v - 1 - (k // p) % v) * p + r)

    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    return out + [bwd(k) for k in range(total - warmup, total)]


def _dualpipe_v(p: int, m: int, r: int) -> list[Action]:
    """DualPipeV: DeepSeek's DualPipe (DeepSeek-V3 report, §3.2.1) folded into a V. Rank r holds
    stage r (chunk 0, going down) and stage 2p - 1 - r (chunk 1, coming back up), so the last rank
    holds the two middle stages and rank 0 both ends. In the main phase every forward of one chunk is
    paired with a backward of the other (written F then B here): on a GPU the pair runs together, one's
    computation hiding the other's communication (the MoE all-to-alls DualPipe was built for). Near the
    end, backwards split into I and W and queued W's fill the gaps. Eight phases per rank, following
    the open-source DualPipeV: F0 · F0 F1 · I1 W F1 · (F0 B1)(F1 B0) · B1 (F1 B0) · B1 B0 · W B0 · W."""
    down, up = r, 2 * p - 1 - r
    out: list[Action] = []
    count: dict[tuple, int] = {}
    queued_w: list[tuple[int, int]] = []
    split = False

    def add(op: str, stage: int) -> None:
        key = (stage, F if op == F else I)  # B, I share one counter: each micro-batch's backward once
        i = count.get(key, 0)
        count[key] = i + 1
        out.append(Action(op, i, stage))
        if op == I:
            queued_w.append((i, stage))

    def weight() -> None:
        if queued_w:
            i, stage = queued_w.pop(0)
            out.append(Action(W, i, stage))

    for _ in range(2 * (p - r - 1)):  # 1: fill chunk 0
        add(F, down)
    for _ in range(r + 1):  # 2: both chunks forward
        add(F, down)
        add(F, up)
    for _ in range(p - r - 1):  # 3: first backwards of chunk 1, zero-bubble style
        add(I, up)
        weight()
        add(F, up)
    for _ in range(m - 2 * p + r + 1):  # 4: the main phase, forward of one chunk with backward of the other
        add(F, down)
        add(B, up)
        add(F, up)
        add(B, down)
    for _ in range(p - r - 1):  # 5
        add(B, up)
        add(F, up)
        add(B, down)
    for i in range(r + 1):  # 6: drain both chunks; the second half splits off W
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        add(I if split else B, up)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        add(I if split else B, down)
    for _ in range(p - r - 1):  # 7
        weight()
        add(I if split else B, down)
    while queued_w:  # 8: the W's left
        weight()
    return out


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
