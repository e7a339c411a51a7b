"""Plots for lecture 03 (pipeline, sequence and expert parallelism), first used in its Part 2.

    causal_work_grid(4, "zigzag")                       which rank computes each unmasked chunk pair
    work_per_rank({"contiguous": [...], "zigzag": [...]})  grouped bars of work per rank, mean dashed
    memory_vs_length([8192, ...], {"ring, N=8": [...]})     bytes per rank against sequence length, log-log

Same conventions as :mod:`course_lib.plots`: each function draws on ``ax`` (a new figure when it is
None), returns the ``Axes`` so a lecture can add to it and a test can read back what was drawn, and
never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["chunk_owners", "causal_work_grid", "work_per_rank", "memory_vs_length"]


def _axes(ax, figsize):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def chunk_owners(world: int, layout: str = "zigzag") -> list[int]:
    """Owner rank of each of the 2N sequence chunks (queries stay on their owner in ring attention).

    Read from :func:`course_lib.ring_attention.positions` with one token per chunk, so the picture
    is the library's layout, not a second copy of it: contiguous gives rank r chunks 2r and 2r+1,
    zigzag gives it chunks r and 2N-1-r.
    """
    from course_lib.ring_attention import positions

    owners = [0] * (2 * world)
    for rank in range(world):
        for chunk in positions(2 * world, rank, world, layout).tolist():
            owners[chunk] = rank
    return owners


def causal_work_grid(world: int, layout: str = "zigzag", ax=None, title: str | None = None, figsize=(3.6, 3.4)):
    """The 2N x 2N grid of (query chunk, key chunk) pairs of causal attention over N ranks.

    A pair above the diagonal is masked (blank). Every other pair is coloured by the rank that
    computes it — the owner of the query chunk, since in ring attention the queries stay and the
    K/V blocks travel. Diagonal pairs are half masked and drawn lighter. Counting the coloured
    cells of one colour (diagonals as halves) is that rank's share of the work.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    owners = chunk_owners(world, layout)
    n = 2 * world
    grid = np.full((n, n), np.nan)
    alpha = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            grid[i, j] = owners[i]
            alpha[i, j] = 0.55 if i == j else 1.0
    ax = _axes(ax, figsize)
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
    ax.set_title(title or f"{layout}, N={world}: rank computing each pair", fontsize=9)
    return ax


def work_per_rank(work: Mapping[str, Sequence[float]], ax=None, ylabel: str = "work", title: str | None = None,
                  figsize=(5.0, 3.2)):
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
    ax = _axes(ax, figsize)
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


def memory_vs_length(seq_lens: Sequence[int], curves: Mapping[str, Sequence[float]], ax=None,
                     ylabel: str = "bytes per rank", title: str | None = None, budget: float | None = None,
                     budget_label: str = "budget", styles: Mapping[str, str] | None = None, figsize=(5.0, 3.4)):
    """One line per method against sequence length, both axes logarithmic (base 2).

    On a log-log plot a term growing as s has slope 1 and one growing as s² slope 2, so the
    quadratic attention scores stand out. ``budget`` draws a horizontal line (e.g. a GPU's memory).
    A curve may hold ``None`` where the method cannot run (a degree that does not divide the heads):
    those points are left out.
    """
    if not curves:
        raise ValueError("memory_vs_length needs at least one curve")
    xs = [int(s) for s in seq_lens]
    ax = _axes(ax, figsize)
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
