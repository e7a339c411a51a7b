"""Plots for the communication model (lectures 07 and 08).

    collective_fit(measured, model, held_out)        one collective: measured times and the fitted α-β line, log-log
    collective_fits({name: measured}, {name: model})  the same for several collectives, one panel each
    step_time_bars({"H100": {"TP": s, "EP": s}, ...}) grouped bars of step times per accelerator

Same conventions as :mod:`course_lib.plots`: numbers in (seconds against bytes, plain dicts), draws
on ``ax`` (a new figure when None), returns the ``Axes``, never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import matplotlib.pyplot as plt
import numpy as np

from course_lib.plots.common import UNIT_SCALE, axes

__all__ = ["collective_fit", "collective_fits", "step_time_bars"]


def collective_fit(
    measured: Mapping[float, float],
    model: Mapping[float, float],
    held_out: Collection[float] = (),
    ax=None,
    title: str | None = None,
    unit: str = "us",
    figsize=(4.0, 3.0),
):
    """Measured seconds per message size as points — filled where the model was fitted, open where it
    was held out — and the model's seconds as a line, on log-log axes (bytes span seven decades)."""
    if not measured or not model:
        raise ValueError("collective_fit needs measured {bytes: seconds} and model {bytes: seconds}, both non-empty")
    ax = axes(ax, figsize)
    scale = UNIT_SCALE[unit]
    xs = sorted(model)
    ax.loglog(xs, [model[x] * scale for x in xs], "-", color="tab:grey", label="α-β model")
    fit = sorted(s for s in measured if s not in held_out)
    held = sorted(s for s in measured if s in held_out)
    ax.loglog(fit, [measured[s] * scale for s in fit], "o", color="tab:blue", ms=4, label="measured, fitted")
    if held:
        ax.loglog(
            held,
            [measured[s] * scale for s in held],
            "o",
            mfc="none",
            color="tab:red",
            ms=6,
            label="measured, held out",
        )
    ax.set(xlabel="message bytes", ylabel=unit.replace("us", "µs"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def collective_fits(
    measured: Mapping[str, Mapping[float, float]],
    model: Mapping[str, Mapping[float, float]],
    held_out: Collection[float] = (),
    axs=None,
    unit: str = "us",
    ncols: int = 3,
):
    """:func:`collective_fit` for each collective of ``measured`` (keys of ``model`` alike), one panel each;
    ``axs`` a sequence of Axes or None for a new grid. Returns the list of Axes used."""
    if set(measured) != set(model):
        raise ValueError(f"measured and model must name the same collectives: {sorted(measured)} vs {sorted(model)}")
    if axs is None:
        rows = -(-len(measured) // ncols)
        _, grid = plt.subplots(rows, ncols, figsize=(3.4 * ncols, 2.7 * rows), squeeze=False)
        axs = list(grid.flat)
        for extra in axs[len(measured) :]:
            extra.set_visible(False)
    axs = list(axs)
    if len(axs) < len(measured):
        raise ValueError(f"{len(measured)} collectives need as many Axes, got {len(axs)}")
    for ax, name in zip(axs, measured):
        collective_fit(measured[name], model[name], held_out, ax=ax, title=name.replace("_", " "), unit=unit)
    return axs[: len(measured)]


def step_time_bars(
    times: Mapping[str, Mapping[str, float]],
    ax=None,
    title: str | None = None,
    unit: str = "ms",
    figsize=(5.0, 3.0),
):
    """Grouped bars: for each part (an accelerator), one bar per quantity (e.g. "TP", "EP") in ``unit``,
    labelled with its value; ``times`` = {part: {quantity: seconds}}, every part with the same quantities."""
    if not times:
        raise ValueError("step_time_bars needs {accelerator: {quantity: seconds}}")
    parts = list(times)
    quantities = list(times[parts[0]])
    if any(list(times[p]) != quantities for p in parts):
        raise ValueError(f"every accelerator needs the same quantities in the same order: {quantities}")
    ax = axes(ax, figsize)
    scale = UNIT_SCALE[unit]
    x = np.arange(len(quantities))
    width = 0.8 / len(parts)
    for i, part in enumerate(parts):
        heights = [times[part][q] * scale for q in quantities]
        bars = ax.bar(x + (i - (len(parts) - 1) / 2) * width, heights, width=width, label=part)
        ax.bar_label(bars, labels=[f"{h:.3g}" for h in heights], fontsize=7)
    ax.set_xticks(x, quantities)
    ax.set_ylabel(unit.replace("us", "µs"))
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return ax
