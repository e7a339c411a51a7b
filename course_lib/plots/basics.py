"""Small matplotlib helpers shared by the lectures (first used in lecture 01, Foundations).

    loss_curves({"AdamW": losses, ...}, floor=lang.loss_floor(64))   training curves over a floor line
    timeline([spans_rank0, spans_rank1, ...])                        per-rank Gantt chart of trace spans
    number_line({"fp4_e2m1": values, ...})                           where a format's values lie
    bars({"SGD": 0, "Adam": 8, ...}, ylabel="bytes per parameter")   one labelled bar per entry
    memory_timeline({"start": {"parameters": b, ...}, ...})          stacked bytes held, phase by phase

Each returns the ``matplotlib.axes.Axes`` it drew on (a new figure when ``ax`` is None), so a
lecture can add to it and a test can read back what was drawn. Nothing here calls ``plt.show()``:
a notebook shows the figure of a cell by itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

from course_lib.plots.common import KIND_COLORS, axes

__all__ = ["KIND_COLORS", "bars", "loss_curves", "memory_timeline", "number_line", "timeline"]


def loss_curves(
    curves: Mapping[str, Sequence[float] | tuple[Sequence[float], Sequence[float]]],
    floor: float | None = None,
    floor_label: str = "entropy floor",
    levels: Mapping[str, float] | None = None,
    ax=None,
    title: str | None = None,
    ylabel: str = "cross-entropy (nats/token)",
    xlabel: str = "step",
    logx: bool = False,
    figsize=(6.4, 4.0),
):
    """One line per curve; a curve is a list of losses (x = 0, 1, ...) or a pair (steps, losses).

    ``floor`` draws a dashed horizontal line: the loss no model can beat on the course data
    (``MarkovLanguage.loss_floor(seq_len)``), so the gap to it is what is left to learn. ``levels``
    adds dotted reference lines, e.g. {"bigram floor": lang.conditional_entropy(1)}.
    """
    if not curves:
        raise ValueError("loss_curves needs at least one curve, e.g. {'AdamW': [4.1, 3.2, ...]}")
    ax = axes(ax, figsize)
    for label, curve in curves.items():
        if isinstance(curve, tuple) and len(curve) == 2:
            xs, ys = list(curve[0]), list(curve[1])
        else:
            ys = list(curve)
            xs = list(range(len(ys)))
        if len(xs) != len(ys):
            raise ValueError(f"curve {label!r}: {len(xs)} steps but {len(ys)} losses")
        ax.plot(xs, ys, label=label)
    if floor is not None:
        ax.axhline(floor, color="black", linestyle="--", linewidth=1, label=f"{floor_label} = {floor:.3f}")
    for i, (label, level) in enumerate((levels or {}).items()):
        ax.axhline(
            level, color="grey", linestyle=":", linewidth=1, alpha=0.6 + 0.4 * (i % 2), label=f"{label} = {level:.3f}"
        )
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return ax


def _span_fields(span) -> tuple[str, str, float, float]:
    """(name, kind, start, end) of a course_lib.dist.trace.Span or of a tuple (name, kind, start, end[, meta])."""
    if hasattr(span, "start"):
        name, kind, start, end = span.name, span.kind, span.start, span.end
    else:
        name, kind, start, end = span[:4]
    if end < start:
        raise ValueError(
            f"span {name!r} ends before it starts ({start} > {end}); spans come from trace.span(), "
            "whose times are time.perf_counter() readings"
        )
    return name, kind, float(start), float(end)


def timeline(
    spans_per_rank: Sequence[Sequence] | Mapping[int, Sequence],
    ax=None,
    unit: str = "ms",
    color_by: str = "kind",
    label_min_fraction: float = 0.06,
    title: str | None = None,
    figsize=None,
):
    """Gantt chart: one row per rank, one bar per span, times relative to the earliest start.

    ``spans_per_rank``: a list indexed by rank (what ``launch`` returns when each rank returns
    ``tl.spans``) or a dict {rank: spans}. Each row has one lane per span kind (compute above
    comm), so a communication that overlaps computation shows as two bars one above the other:
    the picture of overlap. Bars are coloured by ``kind`` (compute blue, comm orange) or, with
    ``color_by="name"``, one colour per span name. A span wider than ``label_min_fraction`` of the
    whole chart gets its name written on it. Rank 0 is the top row.
    """
    rows = dict(spans_per_rank) if isinstance(spans_per_rank, Mapping) else dict(enumerate(spans_per_rank))
    fields = {rank: [_span_fields(s) for s in spans] for rank, spans in rows.items()}
    all_spans = [f for spans in fields.values() for f in spans]
    if not all_spans:
        raise ValueError("timeline got no spans: record them with `with trace.record() as tl:` and return tl.spans")
    if color_by not in ("kind", "name"):
        raise ValueError(f"color_by must be 'kind' or 'name', got {color_by!r}")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    t0 = min(f[2] for f in all_spans)
    total = max(f[3] for f in all_spans) - t0 or 1.0
    names = sorted({f[0] for f in all_spans})
    cmap = plt.get_cmap("tab10")
    name_colors = {n: cmap(i % 10) for i, n in enumerate(names)}
    kinds = sorted({f[1] for f in all_spans}, key=lambda k: (list(KIND_COLORS) + [k]).index(k))
    lane_height = 0.8 / len(kinds)
    ax = axes(ax, figsize or (8.0, 0.6 + 0.6 * len(rows)))
    ranks = sorted(rows)
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row  # rank 0 on top
        for name, kind, start, end in fields[rank]:
            color = KIND_COLORS.get(kind, "tab:green") if color_by == "kind" else name_colors[name]
            bottom = y + 0.4 - (kinds.index(kind) + 1) * lane_height
            ax.broken_barh(
                [((start - t0) * scale, (end - start) * scale)],
                (bottom, lane_height),
                facecolors=color,
                edgecolor="black",
                linewidth=0.3,
            )
            if (end - start) / total >= label_min_fraction:
                ax.text(
                    (start + end - 2 * t0) / 2 * scale,
                    bottom + lane_height / 2,
                    name,
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, total * scale)
    if color_by == "kind":
        handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS.get(k, "tab:green")) for k in kinds]
        ax.legend(handles, kinds, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if title:
        ax.set_title(title)
    return ax


def number_line(
    values: Mapping[str, Sequence[float]], ax=None, log: bool = True, title: str | None = None, figsize=(7.0, 2.5)
):
    """Tick marks at each representable positive value of each format, one row per format.

    On a log axis the gaps between ticks are the relative spacing: constant within a binade, which
    is why a float's relative rounding error is bounded; zero cannot be drawn there and is dropped.
    """
    if not values:
        raise ValueError("number_line needs at least one format, e.g. {'fp4_e2m1': representable_values('fp4_e2m1')}")
    ax = axes(ax, figsize)
    labels = list(values)
    for row, label in enumerate(labels):
        xs = [float(v) for v in values[label] if float(v) > 0 or not log]
        ax.vlines(xs, row - 0.3, row + 0.3, linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    if log:
        ax.set_xscale("log", base=2)
    ax.set_xlabel("value (positive half)")
    if title:
        ax.set_title(title)
    return ax


def bars(
    values: Mapping[str, float],
    ax=None,
    ylabel: str = "",
    title: str | None = None,
    fmt: str = "{:g}",
    figsize=(6.4, 3.2),
):
    """One bar per entry, its value written on top (e.g. optimizer state bytes per parameter)."""
    if not values:
        raise ValueError("bars needs at least one value")
    ax = axes(ax, figsize)
    labels, heights = list(values), [float(v) for v in values.values()]
    container = ax.bar(labels, heights, color="tab:blue")
    ax.bar_label(container, labels=[fmt.format(h) for h in heights], fontsize=8)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    return ax


def memory_timeline(
    phases: Mapping[str, Mapping[str, float]],
    ax=None,
    unit: float = 2**20,
    unit_name: str = "MiB",
    title: str | None = None,
    figsize=(7.0, 3.4),
):
    """One stacked bar per phase of a training step, one colour per kind of memory.

    ``phases`` maps a phase ("after forward", ...) to {kind: bytes}, e.g. what
    ``course_lib.measure.step_memory.training_step_memory`` returns; every phase names the same
    kinds. Heights are divided by ``unit`` (MiB by default); the total is written on top.
    """
    if not phases:
        raise ValueError("memory_timeline needs at least one phase, e.g. {'start': {'parameters': 4096}}")
    kinds = list(next(iter(phases.values())))
    if any(list(kinds_) != kinds for kinds_ in phases.values()):
        raise ValueError(f"every phase must name the same kinds, in the same order: {kinds}")
    ax = axes(ax, figsize)
    labels = list(phases)
    bottom = [0.0] * len(labels)
    for kind in kinds:
        heights = [float(phases[p][kind]) / unit for p in labels]
        ax.bar(labels, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)), [label.replace(" ", "\n") for label in labels])  # long phase names stack
    ax.set_ylabel(f"bytes held ({unit_name})")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return ax
