"""Plots for lecture 02 (data and tensor parallelism), first used in its Part 1.

    ddp_timeline([spans_rank0, spans_rank1])                 compute lane and all-reduce lane per rank
    measured_vs_formula({"stage 0": 1.7e6, ...}, {...})      a measured bar next to its formula bar
    memory_timeline(allocated, gathered, phases)             bytes allocated through one step, by phase

Same conventions as :mod:`course_lib.plots`: each function draws on ``ax`` (a new figure when it is
None), returns the ``Axes`` so a lecture can add to it and a test can read back what was drawn, and
never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from course_lib.plots.common import axes, span_bar, timeline_frame

__all__ = ["compute_segments", "ddp_timeline", "measured_vs_formula", "memory_timeline"]

PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:cyan", "optimizer step": "tab:green"}
COMPUTE_COLORS = {"forward": "tab:blue", "backward": "tab:cyan", "ddp.wait": "lightgrey", "optimizer": "tab:green"}


def compute_segments(spans) -> list[tuple[str, float, float]]:
    """(name, start, end) of the compute spans, with "ddp.wait" cut out of the "backward" that encloses it.

    ``course_lib.parallel.data.ddp`` waits for its buckets in a callback at the very end of autograd, so the
    "backward" span contains the "ddp.wait" span; autograd's own work is what comes before it.
    """
    compute = [(s.name, s.start, s.end) for s in spans if s.kind == "compute"]
    waits = [(a, b) for n, a, b in compute if n == "ddp.wait"]
    out = []
    for name, start, end in compute:
        if name == "backward":
            inside = [a for a, b in waits if start <= a and b <= end]
            if inside:
                end = min(inside)
        out.append((name, start, end))
    return out


def ddp_timeline(
    spans_per_rank: Sequence[Sequence],
    ax=None,
    title: str | None = None,
    unit: str = "ms",
    origin: float | None = None,
    figsize=(8.0, 2.6),
):
    """Two lanes per rank: compute spans above, each all-reduce below as a bar from launch to completion.

    An all-reduce span ends where the rank waited for it; if the span's ``meta["done"]`` holds the
    moment the collective actually completed (``course_lib.parallel.data.ddp`` records it), the bar ends there.
    Bars are labelled with their bucket number (``meta["bucket"]``) when there is one.
    """
    ax, t0, scale = timeline_frame(spans_per_rank, ax, unit, origin, figsize, "ddp_timeline")
    n = len(spans_per_rank)
    ticks, labels = [], []
    for rank, spans in enumerate(spans_per_rank):
        base = 2.5 * (n - 1 - rank)  # rank 0 on top
        for name, start, end in compute_segments(spans):
            span_bar(ax, start, end, t0, scale, (base + 1.0, 0.8), COMPUTE_COLORS.get(name, "tab:purple"))
        comms = [s for s in spans if s.kind == "comm"]
        height = 0.9 / max(1, len(comms))  # one thin row per collective, first at the top: a staircase
        for k, s in enumerate(comms):
            end = s.meta.get("done", s.end)
            lane = base + 0.9 - (k + 1) * height
            span_bar(ax, s.start, end, t0, scale, (lane, height * 0.85), "tab:orange", width=0.2)
            if "bucket" in s.meta:
                ax.text(
                    (s.start - t0) * scale,
                    lane + height / 2,
                    f"{s.meta['bucket']} ",
                    va="center",
                    ha="right",
                    fontsize=5,
                )
        ticks += [base + 1.4, base + 0.45]
        labels += [f"rank {rank} compute", f"rank {rank} all-reduce"]
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel(f"time ({unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COMPUTE_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="tab:orange"))
    names = ["forward", "backward (autograd)", "waiting for buckets", "optimizer", "all-reduce (bucket no.)"]
    ax.legend(handles, names, fontsize=6, loc="upper left", ncol=5, bbox_to_anchor=(0, -0.35))
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def measured_vs_formula(
    measured: Mapping[str, float],
    formula: Mapping[str, float],
    ax=None,
    ylabel: str = "",
    title: str | None = None,
    scale: float = 1.0,
    fmt: str = "{:.0f}",
    figsize=(5.0, 3.2),
):
    """Grouped bars: for each label, the measured value and the formula's prediction side by side."""
    if list(measured) != list(formula):
        raise ValueError(
            f"measured and formula must have the same labels in the same order: {list(measured)} vs {list(formula)}"
        )
    if not measured:
        raise ValueError("measured_vs_formula needs at least one label")
    ax = axes(ax, figsize)
    x = np.arange(len(measured))
    for offset, values, label, color in (
        (-0.2, measured, "measured", "tab:blue"),
        (0.2, formula, "formula", "tab:grey"),
    ):
        heights = [float(v) / scale for v in values.values()]
        bars = ax.bar(x + offset, heights, width=0.4, label=label, color=color)
        ax.bar_label(bars, labels=[fmt.format(h) for h in heights], fontsize=7)
    ax.set_xticks(x, list(measured))
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def memory_timeline(
    allocated: tuple[Sequence[float], Sequence[int]],
    gathered: tuple[Sequence[float], Sequence[int]],
    phases: Mapping[str, tuple[float, float]],
    ax=None,
    title: str | None = None,
    scale: float = 1e3,
    unit: str = "kB",
    xlabel: str = "allocations and frees into the step",
    figsize=(6.0, 3.0),
):
    """Bytes allocated through one step (a line) with the gathered ZeRO-3 parameters under it (filled),
    on shaded phase bands. ``allocated`` and ``gathered`` are (x, bytes) step curves, x the allocator's
    event number (or a time); ``phases`` maps a name to its (start, end) on the same axis."""
    if not allocated[0]:
        raise ValueError("memory_timeline got an empty allocation curve: was the step run inside the trace?")
    ax = axes(ax, figsize)
    for name, (start, end) in phases.items():
        ax.axvspan(start, end, color=PHASE_COLORS.get(name, "lightgrey"), alpha=0.12, label=name)
    ax.step(allocated[0], [b / scale for b in allocated[1]], where="post", color="black", lw=1, label="allocated")
    if gathered[0]:
        ax.fill_between(
            gathered[0],
            [b / scale for b in gathered[1]],
            step="post",
            color="tab:orange",
            alpha=0.7,
            label="gathered parameters",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{unit} above the step's start")
    ax.legend(fontsize=7, loc="upper left")
    if title:
        ax.set_title(title, fontsize=9)
    return ax
