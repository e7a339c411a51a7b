"""course_lib.plots.precision: the helpers draw what they are given (read back from the Axes)."""

import numpy as np
import pytest

from course_lib.plots import precision as plots_precision


def test_error_histograms_share_bins_and_count_every_element():
    ax = plots_precision.error_histograms({"a": [1e-3, 1e-2, 0.0], "b": [1e-4, 1e-1]}, bins=10)
    a, b = ax.patches  # one step polygon per recipe
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    xa, xb = a.get_xy()[:, 0], b.get_xy()[:, 0]
    assert np.isclose(xa.min(), -12) and np.isclose(xa.max(), -1), "shared bins span both: exact zeros at 1e-12"
    assert np.allclose(xa, xb), "the recipes share bins"
    with pytest.raises(ValueError, match="at least one"):
        plots_precision.error_histograms({})


def test_bytes_vs_quality_puts_one_marker_per_method():
    ax = plots_precision.bytes_vs_quality({"plain": (4e5, 2.8), "sign": (1.3e4, 2.9)})
    offsets = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert offsets == [(4e5, 2.8), (1.3e4, 2.9)]
    assert ax.get_xscale() == "log"
    with pytest.raises(ValueError, match="at least one"):
        plots_precision.bytes_vs_quality({})
