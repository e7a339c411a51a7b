"""Plots of lecture 06: decode speed against context, and slots allocated against used over a stream."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from course_lib.plots.common import axes

__all__ = ["decode_speed", "slots_over_time"]


def decode_speed(contexts: Sequence[int], tokens_per_second: Mapping, ax=None, figsize=(6.4, 3.6)):
    """Decode tokens/s against context length, one line per cache (None is drawn as 'no cache')."""
    if not tokens_per_second:
        raise ValueError(
            "decode_speed needs {cache: [tokens/s per context]}, e.g. experiments.lecture06.decode_speed.decode_speed's"
        )
    ax = axes(ax, figsize)
    for cache, speeds in tokens_per_second.items():
        if len(speeds) != len(contexts):
            raise ValueError(f"{cache!r}: {len(speeds)} speeds for {len(contexts)} contexts")
        ax.plot(contexts, speeds, marker="o", label="no cache" if cache is None else f"{cache} cache")
    ax.set(xlabel="context length (tokens)", ylabel="decode tokens / s", yscale="log", title="Decoding one token")
    ax.legend()
    return ax


def slots_over_time(runs: Mapping[str, tuple[Sequence[int], Sequence[int]]], ax=None, figsize=(6.4, 3.6)):
    """Allocated (solid) and used (dashed) KV slots after each engine step, one colour per run."""
    if not runs:
        raise ValueError("slots_over_time needs {name: (allocated per step, used per step)}")
    ax = axes(ax, figsize)
    for (name, (allocated, used)), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        ax.plot(allocated, color=color, label=f"{name}: allocated")
        ax.plot(used, color=color, linestyle="--", label=f"{name}: used")
    ax.set(xlabel="engine step", ylabel="KV slots (tokens)", title="KV memory over a request stream")
    ax.legend(fontsize=8)
    return ax
