"""Plots for lecture 10 (the capstone): one composed DP × TP × PP step on a timeline.

    mesh_timeline(spans_per_rank, coords)   one row per rank, a lane for compute and one per mesh axis
    predicted_vs_measured(names, predicted, measured, fitted)   the planner's step times against the clock's

Spans are :class:`course_lib.dist.trace.Span`: the pipeline runtime's "F"/"B" actions (meta "mb")
and the communication spans the interception records, whose meta "group" is the mesh axis
("tp", "pp", "dp") that :class:`course_lib.dist.Mesh` named. Same conventions as
:mod:`course_lib.plots.basics`: draws on ``ax``, returns the ``Axes``, never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter, ScalarFormatter

from course_lib.plots.common import axes, span_bar, timeline_frame
from course_lib.plots.pipeline import OP_COLORS

__all__ = ["AXIS_COLORS", "mesh_timeline", "predicted_vs_measured"]

AXIS_COLORS = {"tp": "tab:purple", "pp": "tab:green", "dp": "tab:red"}
LANES = ("compute", "tp", "pp", "dp")


def mesh_timeline(
    spans_per_rank: Sequence[Sequence],
    coords: Sequence[Mapping[str, int]],
    ax=None,
    unit: str = "ms",
    title: str | None = None,
    figsize=(11.0, 5.5),
):
    """Rank 0 on top, each row labelled with the rank's mesh coordinates (dp, pp, tp) and split into
    four lanes: compute (F and B actions, micro-batch written inside), then the communication on the
    tp, pp and dp groups. A collective that runs inside a compute span (tensor parallelism's
    all-reduces) sits under it; one that waits for all compute to end (the dp reduction) stands alone."""
    if len(coords) != len(spans_per_rank):
        raise ValueError(f"one coordinate dict per rank: got {len(coords)} for {len(spans_per_rank)} ranks")
    ax, t0, scale = timeline_frame(spans_per_rank, ax, unit, None, figsize, "mesh_timeline")
    n, height = len(spans_per_rank), 0.8 / len(LANES)
    for rank, spans in enumerate(spans_per_rank):
        top = n - 1 - rank + 0.4
        for s in spans:
            lane = "compute" if s.kind == "compute" else s.meta.get("group")
            if lane not in LANES:
                continue
            bottom = top - (LANES.index(lane) + 1) * height
            color = OP_COLORS.get(s.name, "tab:blue") if lane == "compute" else AXIS_COLORS[lane]
            span_bar(ax, s.start, s.end, t0, scale, (bottom, height), color, width=0.2)
            if lane == "compute" and "mb" in s.meta:
                ax.text(
                    ((s.start + s.end) / 2 - t0) * scale,
                    bottom + height / 2,
                    str(s.meta["mb"]),
                    fontsize=6,
                    ha="center",
                    va="center",
                )
    labels = [f"rank {r}  (dp {c['dp']}, pp {c['pp']}, tp {c['tp']})" for r, c in enumerate(coords)]
    ax.set_yticks(range(n), list(reversed(labels)), fontsize=7)
    ax.set_xlabel(f"time ({unit})")
    handles = [Patch(color=OP_COLORS[op], label=f"{op} (compute)") for op in ("F", "B")]
    handles += [Patch(color=c, label=f"{axis} comm") for axis, c in AXIS_COLORS.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if title:
        ax.set_title(title)
    return ax


def predicted_vs_measured(
    names: Sequence[str],
    predicted: Sequence[float],
    measured: Sequence[float],
    fitted: Sequence[bool],
    ax=None,
    unit: str = "ms",
    title: str | None = None,
    figsize=(7.5, 6.0),
):
    """One point per layout, predicted step time (x) against measured (y), on log axes with the
    diagonal; the layouts whose times fitted the model's constants hollow, the predicted ones filled,
    each labelled. Points near the diagonal in the same order as along it: a ranking that holds."""
    if not len(names) == len(predicted) == len(measured) == len(fitted):
        raise ValueError("predicted_vs_measured needs one name, prediction, measurement and flag per layout")
    ax = axes(ax, figsize)
    scale = {"s": 1.0, "ms": 1e3}[unit]
    px, my = [p * scale for p in predicted], [m * scale for m in measured]
    for x, y, name, probe in zip(px, my, names, fitted):
        ax.scatter([x], [y], s=36, facecolors="none" if probe else "tab:blue", edgecolors="tab:blue")
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    low, high = min(px + my) * 0.8, max(px + my) * 1.25
    ax.plot([low, high], [low, high], color="0.6", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not powers of ten, on a range this narrow
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel(f"predicted step time ({unit})")
    ax.set_ylabel(f"measured step time ({unit})")
    ax.scatter([], [], facecolors="none", edgecolors="tab:blue", label="fitted the constants")
    ax.scatter([], [], color="tab:blue", label="predicted")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or "the planner against the clock")
    return ax
