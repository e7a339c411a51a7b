"""Plots for lecture 06 (activation checkpointing).

    recompute_memory(rows)                          per policy: bytes kept after forward and at the peak,
                                                    the model's bar beside the measured one
    memory_budget({1.0: b1, 0.5: b2, 0.0: b3}, references={"eager none": b, ...})
                                                    bytes saved against torch.compile's memory budget

``rows`` are dicts with the keys of :func:`course_lib.experiments.lecture06.recompute_memory.model_vs_measurement`
("policy", "model_saved", "measured_saved", "model_peak", "measured_peak"). Same conventions as
:mod:`course_lib.plots`: each function draws on ``ax`` (a new figure when it is None), returns the
``Axes`` and never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from course_lib.plots.common import axes

__all__ = ["memory_budget", "recompute_memory"]

# (row key, legend label, colour, hatch): the model's bars hatched, the measurement's solid
_BARS = (
    ("model_saved", "kept after forward: model", "tab:blue", "//"),
    ("measured_saved", "kept after forward: measured", "tab:blue", ""),
    ("model_peak", "peak in backward: model", "tab:orange", "//"),
    ("measured_peak", "peak in backward: measured", "tab:orange", ""),
)


def recompute_memory(
    rows: Sequence[Mapping],
    ax=None,
    scale: float = 2**10,
    unit: str = "KiB",
    title: str | None = None,
    figsize=(6.4, 3.6),
):
    """Four bars per policy: bytes kept for backward and peak bytes, each as modelled and as measured."""
    if not rows:
        raise ValueError("recompute_memory needs at least one row, e.g. model_vs_measurement(cfg, 2, 16)")
    missing = {key for key, *_ in _BARS} - set(rows[0])
    if missing:
        raise ValueError(f"each row needs the keys {[k for k, *_ in _BARS]}; missing {sorted(missing)}")
    ax = axes(ax, figsize)
    x = np.arange(len(rows))
    width = 0.2
    for i, (key, label, color, hatch) in enumerate(_BARS):
        heights = [float(row[key]) / scale for row in rows]
        ax.bar(
            x + (i - 1.5) * width,
            heights,
            width=width,
            label=label,
            color=color if not hatch else "white",
            edgecolor=color,
            hatch=hatch,
        )
    ax.set_xticks(x, [str(row["policy"]) for row in rows])
    ax.set_ylabel(f"activation memory ({unit})")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def memory_budget(
    saved: Mapping[float, float],
    references: Mapping[str, float] | None = None,
    ax=None,
    scale: float = 2**10,
    unit: str = "KiB",
    title: str | None = None,
    figsize=(5.0, 3.4),
):
    """Bytes saved for backward against ``activation_memory_budget`` (one point per budget), with
    dotted horizontal lines for ``references`` (e.g. the eager policies' measured bytes)."""
    if not saved:
        raise ValueError("memory_budget needs at least one budget, e.g. {1.0: bytes, 0.5: bytes, 0.0: bytes}")
    ax = axes(ax, figsize)
    budgets = sorted(saved)
    ax.plot(budgets, [saved[b] / scale for b in budgets], marker="o", label="torch.compile")
    for i, (label, value) in enumerate((references or {}).items()):
        ax.axhline(value / scale, linestyle=":", color=f"C{i + 1}", label=label)
    ax.set_xlabel("activation_memory_budget")
    ax.set_ylabel(f"saved for backward ({unit})")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
