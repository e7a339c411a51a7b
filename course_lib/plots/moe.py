"""Plots for lecture 03, Part 3 (mixture of experts).

    expert_load(load, capacity)             one bar per expert: assignments kept, and those dropped
    balance_over_training(curves)           max/mean expert load per step, one line per method

Same conventions as :mod:`course_lib.plots.basics`: numbers in, draws on ``ax`` (a new figure when
None), returns the ``Axes``, never calls ``plt.show()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from course_lib.plots.common import axes

__all__ = ["balance_over_training", "expert_load"]


def expert_load(
    wanted: Sequence[int],
    capacity: int | None = None,
    ax=None,
    title: str | None = None,
    figsize=(5.0, 2.8),
):
    """Bars of the assignments each expert was *sent* (``wanted``, before dropping): the part up to
    ``capacity`` in blue (kept), the part above in red (dropped: those tokens skip this expert and
    keep only their residual); a dashed line at the capacity. ``capacity=None``: no limit, all kept."""
    ax = axes(ax, figsize)
    experts = range(len(wanted))
    kept = [w if capacity is None else min(w, capacity) for w in wanted]
    dropped = [w - k for w, k in zip(wanted, kept)]
    ax.bar(experts, kept, color="tab:blue", label="kept")
    ax.bar(experts, dropped, bottom=kept, color="tab:red", label="dropped")
    if capacity is not None:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity}")
    ax.set(xlabel="expert", ylabel="assignments", xticks=list(experts))
    if title:
        ax.set_title(title)
    ax.legend(fontsize=7, loc="upper right")
    return ax


def balance_over_training(curves: Mapping[str, Sequence[float]], ax=None, title: str | None = None, figsize=(6, 3)):
    """One line per balancing method: the max/mean load ratio of the experts at each step (1 = perfect)."""
    if not curves:
        raise ValueError("balance_over_training got no curves: pass {method name: [max/mean load per step]}")
    ax = axes(ax, figsize)
    for name, ratio in curves.items():
        ax.plot(range(1, len(ratio) + 1), ratio, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set(xlabel="step", ylabel="max / mean expert load")
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    return ax
