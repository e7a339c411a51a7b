"""The accelerator table (course_lib.cost.hardware): every figure has a source, flagged figures say
why, and the rooflines of course_lib.cost.roofline read their numbers from the table."""

from __future__ import annotations

import pytest

from course_lib.cost import hardware, roofline
from course_lib.cost.hardware import PRECISIONS, Figure

DOMESTIC = ("Huawei", "Cambricon", "Hygon")


def all_figures():
    return [(acc, key, fig) for acc in hardware.ACCELERATORS.values() for key, fig in acc.figures.items()]


def test_every_figure_names_a_source():
    for acc, key, fig in all_figures():
        assert isinstance(fig, Figure), f"{acc.name}.{key} is not a Figure: every figure carries its source"
        assert len(fig.source.split()) >= 2, f"{acc.name}.{key}: source {fig.source!r} does not name a document"
    for row in hardware.rows():
        assert row["source"], f"rows(): {row['accelerator']} {row['figure']} lost its source"
    with pytest.raises(ValueError, match="names its source"):
        Figure(1.0, "")
    with pytest.raises(ValueError, match="positive"):
        Figure(-1.0, "a datasheet")


def test_flagged_figures_give_their_reason():
    """A disputed figure states the competing values (so it holds a digit); an estimate says where the
    number comes from in its source or note; the domestic parts, documented far less openly than
    NVIDIA's, each have flagged figures (the table's docstring says so, the lecture repeats it)."""
    for acc, key, fig in all_figures():
        assert fig.flagged == (fig.estimate or bool(fig.disputed))
        if fig.disputed:
            assert any(c.isdigit() for c in fig.disputed), f"{acc.name}.{key}: disputed {fig.disputed!r} gives no range"
        if fig.estimate:
            assert fig.note or len(fig.source.split()) >= 2, f"{acc.name}.{key}: an estimate must say where it is from"
    for acc in hardware.ACCELERATORS.values():
        if acc.vendor in DOMESTIC:
            assert any(f.flagged for f in acc.figures.values()), (
                f"{acc.name}: no figure flagged, for a part with no public datasheet?"
            )


def test_rooflines_are_read_from_the_table():
    """Tolerance 0: a roofline is the table's two figures, not a copy of them."""
    for acc in hardware.ACCELERATORS.values():
        bandwidth = acc.hbm_bytes_per_s.value
        for precision in PRECISIONS:
            value = acc.flops[precision].value
            if value is None:
                continue
            roof = roofline.of(acc, precision)
            assert (roof.peak_flops_per_second, roof.bytes_per_second) == (value, bandwidth), acc.name
            assert roof.ridge_point == acc.ridge_point(precision) == value / bandwidth
            assert roof.attainable(1.0) == bandwidth, "at 1 FLOP/byte a kernel runs at the memory roof"
            assert roof.attainable(1e6) == value, "far right of the ridge: the compute roof"
            assert roof.bound(roof.ridge_point / 2) == "memory" and roof.bound(roof.ridge_point * 2) == "compute"
    have, lack = roofline.rooflines(hardware.ACCELERATORS.values(), "bf16")
    assert set(have) | set(lack) == set(hardware.ACCELERATORS) and not set(have) & set(lack)
    assert lack == [a.name for a in hardware.ACCELERATORS.values() if a.flops["bf16"].value is None]
    assert 290 < have["H100"].ridge_point < 300, "989.4 TFLOP/s over 3.35 TB/s"


def test_h800_is_an_h100_with_less_nvlink():
    """Zhao et al., Insights into DeepSeek-V3 (ISCA 2025) §4.1: the H800's NVLink is cut from 900 GB/s to
    400 GB/s (both directions), compute as
    the H100's; §4.3: 'NVLink provides 200GB/s' (one direction), each 400 Gb/s IB NIC 50 GB/s."""
    h100, h800 = hardware.get("H100"), hardware.get("H800")
    assert h100.scale_up_bytes_per_s.value == 450e9 and 2 * h100.scale_up_bytes_per_s.value == 900e9
    assert h800.scale_up_bytes_per_s.value == 200e9 and 2 * h800.scale_up_bytes_per_s.value == 400e9
    assert h800.scale_out_bytes_per_s.value == 400e9 / 8, "one 400 Gb/s NIC per GPU = 50 GB/s"
    assert h100.scale_up_bytes_per_s.value / h800.scale_up_bytes_per_s.value == 2.25
    for precision in PRECISIONS:
        assert h800.flops[precision].value == h100.flops[precision].value, f"{precision}: Hopper compute, unchanged"


def test_dense_figures_halve_nvidias_sparse_ones():
    """The table holds dense peaks: within one NVIDIA part halving the precision doubles the rate, and a
    'with sparsity' figure (twice the dense one) mixed into a row would break the pattern. Tolerance:
    NVIDIA rounds each figure to 0.1 TFLOP/s (H100: 1978.9 fp8 against 2 x 989.4 = 1978.8)."""
    for name in ("H100", "H200", "B200"):
        f = {p: hardware.get(name).flops[p].value for p in PRECISIONS}
        assert f["fp8"] == pytest.approx(2 * f["bf16"], rel=1e-4) and f["bf16"] == f["fp16"], name
    b200 = hardware.get("B200").flops
    assert b200["fp4"].value == 2 * b200["fp8"].value


def test_a_missing_precision_or_part_is_a_clear_error():
    with pytest.raises(ValueError, match="A100 has no published dense fp8"):
        hardware.A100.peak_flops("fp8")
    with pytest.raises(ValueError, match="no published dense bf16"):
        roofline.of(hardware.get("DCU Z100"), "bf16")
    with pytest.raises(ValueError, match="not one of"):
        hardware.H100.peak_flops("int4")
    with pytest.raises(KeyError, match="known"):
        hardware.get("H900")

    assert hardware.get(hardware.H800) is hardware.H800, "an Accelerator passes through get() unchanged"
