"""Pipeline parallelism in numbers: the bubble, the activations a stage keeps in flight, the bytes
sent between stages. Pure arithmetic; :mod:`course_lib.parallel.pipeline` builds the schedules, and
tests/parallel/pipeline/test_pipeline.py checks every formula here against them (simulated and run).

A pipeline of ``p`` ranks feeds ``m`` micro-batches through its stages each step.

**Bubble** (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM*, §2.2): with equal stages, a forward of t_f and a backward of t_b per
micro-batch, GPipe and 1F1B keep every rank idle for (p - 1)(t_f + t_b) of a step that lasts
(m + p - 1)(t_f + t_b): a fraction (p - 1)/(m + p - 1). Interleaving v chunks per rank divides the
idle time by v: (p - 1)/(v·m + p - 1) (§2.2.2). ZB-H1 (Qi et al. 2023, *Zero Bubble Pipeline
Parallelism*, §3.1) splits the backward into I (input gradient) and W (weight gradient) and fills
idle time with W's, leaving (p - 1)(t_f + t_i - t_w).

**In flight.** A stage keeps a micro-batch's activations from its forward pass until its (last)
backward pass, so what rank r holds is (activations of one micro-batch through one stage) x

    gpipe        m: every forward runs before any backward (Huang et al. 2019; GPipe itself trims
                 this with re-materialisation)
    1f1b         min(p - r, m): p - r - 1 warm-up forwards, then one forward and one backward in
                 turn (PipeDream-Flush, Narayanan et al. 2021, §2.2.1). The first rank holds p.
    interleaved  min(2(p - r - 1) + (v - 1)·p + 1, v·m) stage-micro-batches, each 1/v of a rank's
                 layers (Megatron-LM's warm-up count plus the one in steady state)
    zb-h1        min(p, m) on every rank: rank r holds p - r like 1F1B plus r whose W it delayed
    dualpipev    2p + 1 stage-micro-batches on every rank (m >= 2p), each through one of its two
                 stages: p + 1/2 micro-batches' worth of the rank's layers, counted from the schedule

Korthikanti et al. 2022 (*Reducing Activation Recomputation in Large Transformer Models*, §4.2.3)
draw the consequence: under 1F1B the first rank keeps p micro-batches of its L/p layers, L layers'
worth of one micro-batch whatever p is; interleaved, L·(1 + (p - 1)/(p·v)) layers' worth.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")


def _check(p: int, m: int | None, v: int = 1) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"p (pipeline ranks) must be a positive int, got {p!r}")
    if m is not None and (not isinstance(m, int) or m < 1):
        raise ValueError(f"a step needs at least one micro-batch, got m={m}")
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"v (stages per rank) must be a positive int, got {v!r}")


def in_flight_microbatches(schedule: str, p: int, stage: int, m: int | None = None, v: int = 1) -> int:
    """Micro-batches whose activations rank ``stage`` (0-indexed) of a ``p``-rank pipeline holds at once.

    ``m`` is the number of micro-batches per step: required for "gpipe" (all m are in flight), an
    upper bound for the others (None means m large enough, the steady state). For "interleaved" and
    "dualpipev" the count is of stage-micro-batches, each through one of the rank's ``v`` chunks.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: use one of {SCHEDULES}")
    _check(p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} does not exist in a pipeline of {p} stages: stages are 0 ... {p - 1}")
    if schedule == "gpipe":
        if m is None:
            raise ValueError("GPipe keeps all m micro-batches in flight: pass m, the micro-batches per step")
        return m
    in_flight = {
        "1f1b": p - stage,
        "zb-h1": p,
        "interleaved": 2 * (p - stage - 1) + (v - 1) * p + 1,
        "dualpipev": 2 * p + 1,
    }[schedule]
    cap = None if m is None else m * (v if schedule in ("interleaved", "dualpipev") else 1)
    return in_flight if cap is None else min(in_flight, cap)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a step for GPipe and 1F1B (v = 1) or interleaved 1F1B: (p - 1)/(v·m + p - 1)."""
    _check(p, m, v)
    return (p - 1) / (v * m + p - 1)


def zero_bubble_h1_fraction(p: int, m: int, t_f: float = 1.0, t_i: float = 1.0, t_w: float = 1.0) -> float:
    """Idle share of a ZB-H1 step: (p - 1)(t_f + t_i - t_w) / (m(t_f + t_i + t_w) + (p - 1)(t_f + t_i - t_w))."""
    _check(p, m)
    idle = (p - 1) * (t_f + t_i - t_w)
    return idle / (m * (t_f + t_i + t_w) + idle)


def p2p_bytes_per_step(m: int, boundaries: int, activation_bytes: int) -> int:
    """Bytes all ranks send between stages in one step: each micro-batch crosses each stage boundary
    that joins two ranks twice (its activation forward, the gradient back), each message one
    micro-batch's hidden state (batch x sequence x d_model x bytes per element). A pipeline of p·v
    stages has p·v - 1 boundaries, all between ranks except DualPipeV's turn of the V (stages
    p - 1 and p share the last rank): 2p - 2 there."""
    _check(1, m)
    if not isinstance(boundaries, int) or boundaries < 0:
        raise ValueError(f"boundaries (stage boundaries between two ranks) must be an int >= 0, got {boundaries!r}")
    return 2 * m * boundaries * activation_bytes
