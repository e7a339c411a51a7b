"""Plots for lecture 03 (pipeline, sequence and expert parallelism), first used in its Part 2.

    causal_work_grid(chunk_owners(4))                    which rank computes each unmasked chunk pair
    work_per_rank({"contiguous": [...], "zigzag": [...]})  grouped bars of work per rank, mean dashed
    memory_vs_length([8192, ...], {"ring, N=8": [...]})     bytes per rank against sequence length, log-log

Same conventions as :mod:`course_lib.plots.basics`: each function draws on ``ax`` (a new figure when it is
None), returns the ``Axes`` so a lecture can add to it and a test can read back what was drawn, and
never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from course_lib.plots.common import axes

__all__ = ["causal_work_grid", "memory_vs_length", "work_per_rank"]


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
