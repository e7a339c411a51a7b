"""Lecture 07's plots draw what they are given (from the table) and refuse what they cannot draw."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from course_lib.cost import hardware, roofline
from course_lib.plots import hardware as plots


def table_points():
    points = []
    for acc in hardware.ACCELERATORS.values():
        peak, bw = acc.flops["bf16"], acc.hbm_bytes_per_s
        if peak.value is None:
            continue
        points.append(
            dict(
                name=acc.name,
                bytes_per_second=bw.value,
                flops_per_second=peak.value,
                estimate=peak.estimate or bw.estimate,
                disputed=bool(peak.disputed or bw.disputed),
            )
        )
    return points


def test_spec_scatter_marks_estimates_hollow_and_disputed_with_a_ring():
    points = table_points()
    ax = plots.spec_scatter(points)
    labels = [t.get_text() for t in ax.texts if "FLOP/byte" not in t.get_text()]
    assert "H100 / H800" in labels, "parts at the same point (the H800 has the H100's compute and HBM) share a label"
    assert sorted(" / ".join(labels).split(" / ")) == sorted(p["name"] + ("?" if p["disputed"] else "") for p in points)
    rings = sum(p["disputed"] for p in points)
    assert len(ax.collections) == len(points) + rings, "one marker per part, one ring per disputed part"
    hollow = [c for c in ax.collections[: len(points) + rings] if len(c.get_facecolors()) == 0]
    assert len(hollow) == sum(p["estimate"] for p in points) + rings
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="needs points"):
        plots.spec_scatter([])


def test_rooflines_draw_one_line_per_device_and_place_kernels():
    intensities = [0.1, 1, 10, 100, 1000, 10000]
    curves = {}
    for name in ("H100", "H800", "Ascend 910B"):
        roof = roofline.of(hardware.get(name))
        curves[name] = (intensities, [roof.attainable(i) for i in intensities])
    ax = plots.rooflines(curves, kernels=[("decode GEMV", 1.0), ("training GEMM", 4096.0)])
    assert [line.get_label() for line in ax.get_lines()[:3]] == list(curves)
    assert len(ax.get_lines()) == 3 + 2, "three roofs and two kernel verticals"
    assert "1  decode GEMV\n2  training GEMM" in [t.get_text() for t in ax.texts], "the key of the numbered verticals"
    assert list(ax.get_lines()[0].get_ydata()) == [y / 1e12 for y in curves["H100"][1]]
    plt.close(ax.figure)
    ax = plots.rooflines({"cpu": ([1, 10], [1e9, 1e10])}, measured=[("w1", 5.0, 4e9)], unit="GFLOP/s")
    assert ax.collections[0].get_offsets().tolist() == [[5.0, 4.0]]
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="2 intensities but 1"):
        plots.rooflines({"bad": ([1, 2], [1.0])})
    with pytest.raises(ValueError, match="unit"):
        plots.rooflines({"cpu": ([1], [1.0])}, unit="PFLOP/s")
    with pytest.raises(ValueError, match="at least one curve"):
        plots.rooflines({})
