"""Plots of lecture 07: the accelerator table as a scatter, and rooflines with kernels placed on them.

    spec_scatter([{"name": "H100", "bytes_per_second": 3.35e12, "flops_per_second": 989e12}, ...])
    rooflines({"H100": (intensities, attainable FLOP/s), ...}, kernels=[("decode GEMV", 1.0), ...])
    rooflines({"this CPU": curve}, measured=[("train w1", 109.3, 9.1e10), ...], unit="GFLOP/s")

Numbers in, Axes out: the figures come from ``course_lib.cost.hardware`` and the curves from
``course_lib.cost.roofline`` (the lecture computes them; this module only draws).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.lines import Line2D

from course_lib.plots.common import axes

__all__ = ["rooflines", "spec_scatter"]

UNITS = {"TFLOP/s": 1e12, "GFLOP/s": 1e9}


def spec_scatter(
    points: Sequence[Mapping],
    ridge_lines: Sequence[float] = (100, 300),
    ax=None,
    title: str = "Dense bf16 peak against memory bandwidth",
    figsize=(6.8, 4.4),
):
    """One marker per accelerator: x = memory bandwidth (TB/s), y = dense peak (TFLOP/s), log-log.

    Each point is a mapping with ``name``, ``bytes_per_second``, ``flops_per_second`` and optionally
    ``estimate`` (True: drawn hollow, a figure no vendor document gives) and ``disputed`` (True: a
    dashed ring around it and "?" after the name, sources disagree). ``ridge_lines`` draws dotted
    lines of constant peak/bandwidth (FLOP/byte): a part above a line needs kernels of at least that
    intensity to reach its peak.
    """
    if not points:
        raise ValueError("spec_scatter needs points, e.g. [{'name': 'H100', 'bytes_per_second': 3.35e12, ...}]")
    ax = axes(ax, figsize)
    xs = [p["bytes_per_second"] / 1e12 for p in points]
    ys = [p["flops_per_second"] / 1e12 for p in points]
    names: dict[tuple[float, float], list[str]] = {}  # parts at the same point share one label
    for p, x, y in zip(points, xs, ys):
        estimate = bool(p.get("estimate"))
        ax.scatter(
            [x], [y], s=60, marker="o", facecolors="none" if estimate else "tab:blue", edgecolors="tab:blue", zorder=3
        )
        if p.get("disputed"):
            ax.scatter([x], [y], s=220, marker="o", facecolors="none", edgecolors="grey", linestyles="--", zorder=2)
        names.setdefault((x, y), []).append(p["name"] + ("?" if p.get("disputed") else ""))
    placed = []  # a label near an earlier one moves down a line
    for (x, y), label in names.items():
        near = sum(1 for px, py in placed if 0.6 < px / x < 1.6 and 0.8 < py / y < 1.25)
        placed.append((x, y))
        ax.annotate(" / ".join(label), (x, y), xytext=(6, 4 - 11 * near), textcoords="offset points", fontsize=8)
    lo, hi = min(xs) / 1.5, max(xs) * 1.5
    for ridge in ridge_lines:  # peak = ridge · bandwidth, in TFLOP/s against TB/s
        ax.plot([lo, hi], [ridge * lo, ridge * hi], color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{ridge:g} FLOP/byte", (hi, ridge * hi), fontsize=8, color="grey", ha="right", va="bottom")
    ax.set(xscale="log", yscale="log", xlabel="memory bandwidth (TB/s)", ylabel="dense peak (TFLOP/s)", title=title)
    ax.set_ylim(min(ys) / 2, max(ys) * 2)
    handles = [
        Line2D([], [], marker="o", linestyle="", color="tab:blue", label="published"),
        Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="tab:blue", label="estimate"),
        Line2D(
            [], [], marker="o", linestyle="", markerfacecolor="none", color="grey", markersize=12, label="disputed (?)"
        ),
    ]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return ax


def rooflines(
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    kernels: Sequence[tuple[str, float]] = (),
    measured: Sequence[tuple[str, float, float]] = (),
    unit: str = "TFLOP/s",
    ax=None,
    title: str = "Roofline: attainable FLOP/s against arithmetic intensity",
    figsize=(7.2, 4.6),
):
    """Rooflines on log-log axes, with kernels placed on them.

    ``curves``: {device: (intensities in FLOP/byte, attainable FLOP/s)}, one line each (compute them
    with ``cost.roofline.Roofline.attainable``). ``kernels``: (label, intensity) pairs drawn as dotted
    verticals, numbered, with the numbers keyed in a box right of the axes: where a kernel sits on
    every device at once. ``measured``: (label, intensity, FLOP/s)
    points, e.g. the kernels timed by ``measure.cpu_roofline``. ``unit`` scales the y-axis.
    """
    if not curves:
        raise ValueError("rooflines needs at least one curve: {device: (intensities, attainable FLOP/s)}")
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r}: choose one of {sorted(UNITS)}")
    scale = UNITS[unit]
    ax = axes(ax, figsize)
    for name, (xs, ys) in curves.items():
        if len(xs) != len(ys):
            raise ValueError(f"curve {name!r}: {len(xs)} intensities but {len(ys)} FLOP/s values")
        ax.plot(list(xs), [y / scale for y in ys], label=name)
    for i, (_, intensity) in enumerate(kernels, start=1):  # numbered verticals, keyed in a box
        ax.axvline(intensity, color="grey", linestyle=":", linewidth=1)
        near = sum(1 for _, other in kernels[: i - 1] if 0.75 < other / intensity < 1.33)  # stack close numbers
        ax.annotate(
            str(i),
            (intensity, 1),
            xycoords=("data", "axes fraction"),
            xytext=(0, -2 - 8 * near),
            textcoords="offset points",
            fontsize=7,
            color="dimgrey",
            ha="center",
            va="top",
        )
    if kernels:
        key = "\n".join(f"{i}  {label}" for i, (label, _) in enumerate(kernels, start=1))
        box = dict(boxstyle="round", facecolor="white", alpha=0.85, edgecolor="lightgrey")
        ax.text(1.02, 1.0, key, transform=ax.transAxes, fontsize=7, va="top", ha="left", bbox=box)  # right of the axes
    for label, intensity, flops in measured:
        ax.scatter([intensity], [flops / scale], marker="x", color="black", zorder=3)
        ax.annotate(label, (intensity, flops / scale), xytext=(4, -10), textcoords="offset points", fontsize=7)
    ax.set(
        xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel=f"attainable {unit}", title=title
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    return ax
