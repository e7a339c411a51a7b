"""What every plot of the course shares: an Axes to draw on, and the colours of span kinds.

Every function in :mod:`course_lib.plots` takes numbers (or spans) in, draws on ``ax`` (a new
figure when it is None), returns the ``Axes`` so a lecture can add to it and a test can read back
what was drawn, and never calls ``plt.show()``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

KIND_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "idle": "lightgrey"}


def axes(ax, figsize):
    """``ax`` itself, or the Axes of a new figure of ``figsize``."""
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax
