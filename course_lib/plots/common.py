"""What every plot of the course shares: an Axes to draw on, and the colours of span kinds.

Every function in :mod:`course_lib.plots` takes numbers (or spans) in, draws on ``ax`` (a new
figure when it is None), returns the ``Axes`` so a lecture can add to it and a test can read back
what was drawn, and never calls ``plt.show()``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

KIND_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "idle": "lightgrey"}


def axes(ax, figsize):
    """``ax`` itself, or the Axes of a new figure of ``figsize``."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


UNIT_SCALE = {"s": 1.0, "ms": 1e3, "us": 1e6}


def timeline_frame(spans_per_rank, ax, unit: str, origin: float | None, figsize, what: str):
    """(ax, t0, scale) for a per-rank timeline: time 0 at ``origin`` or the earliest span, in ``unit``."""
    if not spans_per_rank or not any(spans_per_rank):
        raise ValueError(f"{what} got no spans: return tl.spans from each rank of a traced run")
    t0 = origin if origin is not None else min(s.start for spans in spans_per_rank for s in spans)
    return axes(ax, figsize), t0, UNIT_SCALE[unit]


def span_bar(ax, start: float, end: float, t0: float, scale: float, lane: tuple[float, float], color, width=0.3):
    """One bar from ``start`` to ``end`` (seconds) on ``lane`` = (bottom, height)."""
    ax.broken_barh(
        [((start - t0) * scale, (end - start) * scale)], lane, facecolors=color, edgecolor="black", linewidth=width
    )
