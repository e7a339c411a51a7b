"""Plots for lecture 03, Part 1 (pipeline parallelism).

    schedule_gantt(spans_per_rank)       one row per rank, one bar per F/B/I/W action, micro-batch inside

Spans are :class:`course_lib.dist.trace.Span` with ``meta`` {"mb": micro-batch, "stage": stage}, as
the simulator (:mod:`course_lib.parallel.pipeline.simulate`) and the runtime's trace both produce them.
Same conventions as :mod:`course_lib.plots.basics`: draws on ``ax`` (a new figure when None), returns
the ``Axes``, never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.patches import Patch

from course_lib.plots.common import span_bar, timeline_frame

__all__ = ["OP_COLORS", "schedule_gantt"]

OP_COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}


def schedule_gantt(
    spans_per_rank: Sequence[Sequence],
    ax=None,
    title: str | None = None,
    unit: str = "s",
    chunk_shade: bool = True,
    xlabel: str | None = None,
    figsize=(8.0, 2.4),
):
    """Rank 0 at the top; each action a bar coloured by its kind, labelled with its micro-batch.
    With ``chunk_shade``, actions on a rank's second (third, ...) stage are drawn lighter, so the
    chunks of interleaved and V schedules can be told apart. ``unit``: "s", "ms" or "us" for a trace
    in seconds; simulator spans are in the cost's own units: draw them with unit="s" and an ``xlabel``."""
    ax, t0, scale = timeline_frame(spans_per_rank, ax, unit, None, figsize, "schedule_gantt")
    p = len(spans_per_rank)
    for rank, spans in enumerate(spans_per_rank):
        stages = sorted({s.meta.get("stage", 0) for s in spans})
        lane = (p - 1 - rank - 0.4, 0.8)
        for s in spans:
            if s.name not in OP_COLORS:
                continue
            light = chunk_shade and stages.index(s.meta.get("stage", 0)) > 0
            span_bar(ax, s.start, s.end, t0, scale, lane, OP_COLORS[s.name], width=0.3)
            if light:
                span_bar(ax, s.start, s.end, t0, scale, lane, (1, 1, 1, 0.45), width=0)
            if "mb" in s.meta:
                mid = ((s.start + s.end) / 2 - t0) * scale
                ax.text(mid, p - 1 - rank, str(s.meta["mb"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p - 1, -1, -1)])
    ax.set_xlabel(xlabel or f"time ({unit})")
    handles = [Patch(color=c, label=op) for op, c in OP_COLORS.items()]
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.005, 1.0))  # outside the bars
    if title:
        ax.set_title(title, fontsize=9)
    return ax
