"""Plots for lecture 03 (pipeline, sequence and expert parallelism), first used in its Part 2.

    causal_work_grid(chunk_owners(4))                    which rank computes each unmasked chunk pair
    work_per_rank({"contiguous": [...], "zigzag": [...]})  grouped bars of work per rank, mean dashed
    memory_vs_length([8192, ...], {"ring, N=8": [...]})     bytes per rank against sequence length, log-log
    ring_timeline([spans_rank0, ...])                       block compute and K/V transfers per rank, from a trace

Same conventions as :mod:`course_lib.plots.basics`: each function draws on ``ax`` (a new figure when it is
None), returns the ``Axes`` so a lecture can add to it and a test can read back what was drawn, and
never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from course_lib.plots.common import axes, span_bar, timeline_frame

__all__ = ["causal_work_grid", "comm_intervals", "memory_vs_length", "ring_timeline", "work_per_rank"]

RING_COLORS = {"ring.forward block": "tab:blue", "ring.backward block": "tab:cyan", "ring.dkv hop": "tab:red"}


def causal_work_grid(owners: Sequence[int], ax=None, title: str | None = None, figsize=(3.6, 3.4)):
    """The 2N x 2N grid of (query chunk, key chunk) pairs of causal attention over N ranks.

    ``owners[c]`` is the rank holding sequence chunk c (``ring_attention.chunk_owners`` gives the
    library's layouts). A pair above the diagonal is masked (blank). Every other pair is coloured by the rank that
    computes it — the owner of the query chunk, since in ring attention the queries stay and the
    K/V blocks travel. Diagonal pairs are half masked and drawn lighter. Counting the coloured
    cells of one colour (diagonals as halves) is that rank's share of the work.
    """
    n = len(owners)
    if n < 2 or n % 2:
        raise ValueError(f"owners must list the owner rank of each of the 2N chunks, got {len(owners)} entries")
    grid = np.full((n, n), np.nan)
    alpha = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            grid[i, j] = owners[i]
            alpha[i, j] = 0.55 if i == j else 1.0
    ax = axes(ax, figsize)
    cmap = plt.get_cmap("tab10")
    colors = np.ones((n, n, 4))
    for i in range(n):
        for j in range(i + 1):
            colors[i, j] = cmap(int(grid[i, j]) % 10)
            colors[i, j, 3] = alpha[i, j]
    ax.imshow(colors, interpolation="nearest")
    for i in range(n):
        for j in range(i + 1):
            ax.text(j, i, str(int(grid[i, j])), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xlabel("key chunk")
    ax.set_ylabel("query chunk")
    ax.set_title(title or f"N={n // 2}: rank computing each pair", fontsize=9)
    return ax


def work_per_rank(
    work: Mapping[str, Sequence[float]], ax=None, ylabel: str = "work", title: str | None = None, figsize=(5.0, 3.2)
):
    """Grouped bars: one group per rank, one bar per layout; a dashed line at each layout's mean.

    The slowest rank sets the pace of every ring step, so the gap between the tallest bar and the
    dashed mean is time the other ranks spend waiting.
    """
    if not work:
        raise ValueError("work_per_rank needs at least one layout, e.g. {'zigzag': [10, 10]}")
    sizes = {len(v) for v in work.values()}
    if len(sizes) != 1:
        raise ValueError(f"every layout needs one value per rank; got lengths {sorted(sizes)}")
    world = sizes.pop()
    ax = axes(ax, figsize)
    width = 0.8 / len(work)
    cmap = plt.get_cmap("tab10")
    for i, (label, values) in enumerate(work.items()):
        xs = [r - 0.4 + width * (i + 0.5) for r in range(world)]
        ax.bar(xs, [float(v) for v in values], width=width, label=label, color=cmap(i))
        mean = sum(float(v) for v in values) / world
        ax.axhline(mean, color=cmap(i), linestyle="--", linewidth=1)
    ax.set_xticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return ax


def memory_vs_length(
    seq_lens: Sequence[int],
    curves: Mapping[str, Sequence[float]],
    ax=None,
    ylabel: str = "bytes per rank",
    title: str | None = None,
    budget: float | None = None,
    budget_label: str = "budget",
    styles: Mapping[str, str] | None = None,
    figsize=(5.0, 3.4),
):
    """One line per method against sequence length, both axes logarithmic (base 2).

    On a log-log plot a term growing as s has slope 1 and one growing as s² slope 2, so the
    quadratic attention scores stand out. ``budget`` draws a horizontal line (e.g. a GPU's memory).
    A curve may hold ``None`` where the method cannot run (a degree that does not divide the heads):
    those points are left out.
    """
    if not curves:
        raise ValueError("memory_vs_length needs at least one curve")
    xs = [int(s) for s in seq_lens]
    ax = axes(ax, figsize)
    for label, ys in curves.items():
        if len(ys) != len(xs):
            raise ValueError(f"curve {label!r}: {len(ys)} values for {len(xs)} sequence lengths")
        points = [(x, float(y)) for x, y in zip(xs, ys) if y is not None]
        style = (styles or {}).get(label, "-")
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", markersize=3, label=label)
    if budget is not None:
        ax.axhline(budget, color="black", linestyle=":", linewidth=1, label=budget_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return ax


def comm_intervals(spans) -> list[tuple[float, float]]:
    """The union of a rank's "comm" spans, as sorted disjoint (start, end): when a transfer was in flight.

    Ring attention posts the sends and receives of a step together (K and V, to the right and from
    the left), so their spans overlap; the union is the time from posting a block to having it. Spans
    that only touch (a step waits, the next one posts) stay apart: one interval per step.
    """
    merged: list[list[float]] = []
    for start, end in sorted((s.start, s.end) for s in spans if s.kind == "comm"):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def ring_timeline(
    spans_per_rank: Sequence[Sequence],
    ax=None,
    title: str | None = None,
    unit: str = "ms",
    origin: float | None = None,
    figsize=(8.0, 2.8),
):
    """Two lanes per rank: each ring step's block compute above, the K/V transfers in flight below.

    Spans come from ``course_lib.dist.trace.record()`` around ring attention: "ring.forward block" and
    "ring.backward block" compute spans (``course_lib.parallel.context.ring_attention`` records them),
    a "ring.dkv hop" span where the backward passes dK/dV on and waits for them at once (drawn on the
    upper lane: the rank does nothing else meanwhile), and a "comm" span for every isend/irecv, from
    posting to the ``wait()`` that returns it. A transfer bar under a compute bar is hidden behind that
    compute; a transfer bar with nothing above it is time the rank spent only waiting for data.
    """
    ax, t0, scale = timeline_frame(spans_per_rank, ax, unit, origin, figsize, "ring_timeline")
    n = len(spans_per_rank)
    ticks, labels = [], []
    for rank, spans in enumerate(spans_per_rank):
        base = 2.2 * (n - 1 - rank)  # rank 0 on top
        for s in spans:
            if s.name in RING_COLORS:
                span_bar(ax, s.start, s.end, t0, scale, (base + 1.0, 0.8), RING_COLORS[s.name])
        bars = [((a - t0) * scale, (b - a) * scale) for a, b in comm_intervals(spans)]
        ax.broken_barh(bars, (base + 0.1, 0.8), facecolors="tab:orange", edgecolor="black", linewidth=0.2)
        ticks += [base + 1.4, base + 0.5]
        labels += [f"rank {rank} compute", f"rank {rank} in flight"]
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel(f"time ({unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*RING_COLORS.values(), "tab:orange")]
    names = ["forward block", "backward block", "dK/dV hop (waited at once)", "send/recv posted, not yet waited for"]
    ax.legend(handles, names, fontsize=6, loc="upper left", ncol=4, bbox_to_anchor=(0, -0.3))
    if title:
        ax.set_title(title, fontsize=9)
    return ax
