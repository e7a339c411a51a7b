"""Plots for lectures 08a (stability) and 08b (reproducibility).

    remedy_panels({"baseline": losses, "clip 1.0": losses, ...}, floor=1.215)
                                        one panel per remedy, the baseline in grey behind it
    step_curves({"baseline": norms, ...}, ylabel="gradient norm", level=1.0)
                                        any per-step quantity, log scale (gradient norms, log Z)
    order_spread({"float32": sums, "float64": sums}, exact=s, bound=b)
                                        sums of one set of numbers in many orders, minus the exact sum
    lineage_matrix(z, labels, threshold=3.9)
                                        pairwise lineage z-scores, cells above the threshold outlined

Same conventions as :mod:`course_lib.plots`: numbers in, the ``Axes`` out (a list of them for
``remedy_panels``), a new figure when ``ax`` is None, never ``plt.show()``. A curve shorter than
the others is a run that diverged: it is drawn up to its last finite loss and ends in a cross.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from course_lib.plots.common import axes

__all__ = ["lineage_matrix", "order_spread", "remedy_panels", "step_curves"]


def _finite_prefix(values: Sequence[float]) -> list[float]:
    out = []
    for v in values:
        if not math.isfinite(v):
            break
        out.append(float(v))
    return out


def remedy_panels(
    runs: Mapping[str, Sequence[float]],
    baseline: str = "baseline",
    floor: float | None = None,
    logy: bool = True,
    figsize=None,
):
    """One panel per remedy: its loss curve over the baseline's (grey), and the entropy ``floor``.

    ``runs`` maps a name to its per-step losses and must contain ``baseline``. Returns the list of
    Axes, one per remedy, in the order of ``runs``."""
    if baseline not in runs:
        raise ValueError(f"runs has no {baseline!r} curve to compare against; got {list(runs)}")
    remedies = [name for name in runs if name != baseline]
    if not remedies:
        raise ValueError("remedy_panels needs at least one remedy beside the baseline")
    cols = min(2, len(remedies))
    rows = math.ceil(len(remedies) / cols)
    fig, grid = plt.subplots(rows, cols, figsize=figsize or (4.2 * cols, 2.8 * rows), sharex=True, sharey=True)
    panels = list(np.atleast_1d(grid).flat)
    base = _finite_prefix(runs[baseline])
    for ax, name in zip(panels, remedies, strict=False):
        ax.plot(range(len(base)), base, color="lightgrey", linewidth=1.5, label=baseline)
        if len(base) < len(runs[baseline]):
            ax.plot([len(base) - 1], [base[-1]], marker="x", color="grey")
        curve = _finite_prefix(runs[name])
        ax.plot(range(len(curve)), curve, color="tab:blue", linewidth=1.2, label=name)
        if len(curve) < len(runs[name]):
            ax.plot([len(curve) - 1], [curve[-1]], marker="x", color="tab:red")
        if floor is not None:
            ax.axhline(floor, color="black", linestyle="--", linewidth=0.8, label=f"floor {floor:.3f}")
        if logy:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in panels[len(remedies) :]:
        ax.set_visible(False)
    for ax in panels[: len(remedies)]:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
    fig.tight_layout()
    return panels[: len(remedies)]


def step_curves(
    curves: Mapping[str, Sequence[float]],
    ylabel: str,
    level: float | None = None,
    level_label: str = "",
    logy: bool = True,
    ax=None,
    title: str | None = None,
    figsize=(6.0, 3.4),
):
    """One line per curve of a per-step quantity (x = step), with an optional horizontal ``level``
    (the clipping threshold for gradient norms, 0 for log Z)."""
    if not curves:
        raise ValueError("step_curves needs at least one curve, e.g. {'baseline': [51.0, 31.2, ...]}")
    ax = axes(ax, figsize)
    for label, values in curves.items():
        ys = _finite_prefix(values)
        ax.plot(range(len(ys)), ys, label=label)
    if level is not None:
        ax.axhline(level, color="black", linestyle=":", linewidth=1, label=level_label or f"{level:g}")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return ax


def order_spread(
    sums: Mapping[str, Sequence[float]],
    exact: float,
    bound: float | None = None,
    ax=None,
    title: str | None = None,
    figsize=(6.0, 2.6),
):
    """Each sum minus ``exact``, one row of points per arithmetic; the band ±``bound`` (the rounding
    error bound of one order) shaded. Exact arithmetic is a single point at 0."""
    if not sums:
        raise ValueError("order_spread needs at least one row of sums, e.g. {'float32': [...], 'float64': [...]}")
    ax = axes(ax, figsize)
    names = list(sums)
    for row, name in enumerate(names):
        errors = [float(s) - exact for s in sums[name]]
        ax.scatter(errors, [row] * len(errors), label=name, alpha=0.7)
    if bound is not None:
        ax.axvspan(-bound, bound, color="tab:green", alpha=0.1, label="error bound of one order")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.5, len(names) - 0.5)
    ax.set_xlabel("sum − exact sum")
    ax.axvline(0, color="black", linewidth=0.8)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    return ax


def lineage_matrix(
    z: Sequence[Sequence[float]],
    labels: Sequence[str],
    threshold: float | None = None,
    ax=None,
    title: str | None = None,
    figsize=(5.0, 4.2),
):
    """Heat map of pairwise lineage z-scores (row = reference, column = candidate); cells at or above
    ``threshold`` ("relatives") outlined in black. The diagonal (a model against itself) is left blank."""
    values = np.array(z, dtype=float)
    if values.ndim != 2 or values.shape[0] != values.shape[1] or values.shape[0] != len(labels):
        raise ValueError(f"z must be square with one row per label; got shape {values.shape} and {len(labels)} labels")
    ax = axes(ax, figsize)
    shown = values.copy()
    np.fill_diagonal(shown, np.nan)
    image = ax.imshow(shown, cmap="viridis")
    ax.figure.colorbar(image, ax=ax, label="z (null standard deviations)")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    if threshold is not None:
        for i in range(len(labels)):
            for j in range(len(labels)):
                if i != j and values[i, j] >= threshold:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.5))
    ax.set_xlabel("candidate")
    ax.set_ylabel("reference")
    if title:
        ax.set_title(title, fontsize=9)
    return ax
