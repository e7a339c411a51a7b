"""Pipeline parallelism's effect on activation memory: how many micro-batches a stage keeps in flight.

A pipeline of ``p`` stages feeds ``m`` micro-batches through its layers. A stage keeps a
micro-batch's activations from its forward pass until its backward pass, so what one stage holds
is (activations of its layers for one micro-batch) x (micro-batches in flight on that stage):

    gpipe   every forward runs before any backward (Huang et al. 2019, *GPipe*; as Narayanan et al.
            2021, §2.2.1, put it, it stashes the activations of all m micro-batches): all m are in
            flight on every stage (GPipe itself trims this with re-materialisation).
    1f1b    one forward, one backward (PipeDream-Flush, Narayanan et al. 2021, *Efficient Large-Scale
            Language Model Training on GPU Clusters Using Megatron-LM*, §2.2.1): stage i (0-indexed)
            runs p - i forwards before its first backward (p - i - 1 warm-up forwards, then one
            forward and one backward in turn), so at most min(p - i, m) micro-batches are in flight.
            The first stage holds p of them, the last one.

Korthikanti et al. 2022 (*Reducing Activation Recomputation in Large Transformer Models*, §4.2.3)
draw the consequence for memory: under 1F1B the first stage keeps p micro-batches of its L/p layers,
that is L layers' worth of one micro-batch, whatever p is. Pipeline parallelism divides the weights
by p but, on the first stage, not the activations. (Their interleaved schedule with v model chunks
per stage holds L·(1 + (p - 1)/(p·v)) layers' worth on the first stage; the course's schedules module
will count it from the action lists.)

Pure arithmetic, nothing launched; the pipeline schedules themselves arrive with Part 1 of lecture 03.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b")


def in_flight_microbatches(schedule: str, p: int, stage: int, m: int | None = None) -> int:
    """Micro-batches whose activations stage ``stage`` (0-indexed) of a ``p``-stage pipeline holds at once.

    ``m`` is the number of micro-batches per step: required for "gpipe" (all m are in flight), an upper
    bound for "1f1b" (``min(p - stage, m)``; None means m ≥ p, the steady state every schedule aims for).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: use one of {SCHEDULES}")
    if p < 1 or not 0 <= stage < p:
        raise ValueError(f"stage {stage} does not exist in a pipeline of {p} stages: stages are 0 ... {p - 1}")
    if m is not None and m < 1:
        raise ValueError(f"a step needs at least one micro-batch, got m={m}")
    if schedule == "gpipe":
        if m is None:
            raise ValueError("GPipe keeps all m micro-batches in flight: pass m, the micro-batches per step")
        return m
    in_flight = p - stage
    return in_flight if m is None else min(in_flight, m)
