"""Plots of lecture 05: the rounding error of each quantization recipe, and bytes against quality."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from course_lib.plots.common import axes

__all__ = ["bytes_vs_quality", "error_histograms"]


def error_histograms(
    errors: Mapping[str, Sequence[float]],
    ax=None,
    bins: int = 60,
    title: str | None = None,
    xlabel: str = "log10 |relative error|",
    floor: float = 1e-12,
    figsize=(6.4, 3.6),
):
    """One step histogram per recipe of log10 |error| (errors below ``floor`` — exact round trips —
    are drawn at ``floor`` so they stay visible). Shared bins, so the recipes can be compared."""
    if not errors:
        raise ValueError("error_histograms needs at least one recipe's errors, e.g. {'tensor': [...]}")
    logs = {name: np.log10(np.maximum(np.abs(np.asarray(e, dtype=np.float64)), floor)) for name, e in errors.items()}
    lo = min(v.min() for v in logs.values())
    hi = max(v.max() for v in logs.values())
    edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    ax = axes(ax, figsize)
    for name, values in logs.items():
        ax.hist(values, bins=edges, histtype="step", linewidth=1.4, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("elements")
    if title:
        ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return ax


def bytes_vs_quality(
    points: Mapping[str, tuple[float, float]],
    ax=None,
    title: str | None = None,
    xlabel: str = "bytes sent per step",
    ylabel: str = "final loss",
    logx: bool = True,
    figsize=(6.0, 3.8),
):
    """One labelled marker per method at (bytes, quality): the trade-off of a compression scheme."""
    if not points:
        raise ValueError("bytes_vs_quality needs at least one (bytes, quality) point")
    ax = axes(ax, figsize)
    for name, (x, y) in points.items():
        ax.scatter([x], [y], s=40, label=name)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    return ax
