"""Gradient compression: the bytes one rank hands to the collective per bucket (lecture 05).

Each is the payload this rank hands to the collective for one bucket, what :mod:`course_lib.dist.counter`
counts: this rank's message for an all-gather (it *receives* world_size - 1 such messages;
:func:`course_lib.cost.collective_bytes.received_bytes` converts), the whole tensor for an all-reduce.
Uncompressed, a bucket of ``numel`` fp32 gradients is 4·numel bytes:

    Top-K (Stich et al. 2018; Lin et al. 2018, DGC §3)   k·(value + index)   all-gathered
    QSGD (Alistarh et al. 2017, §3.1)                     numel + 4           int8 levels + fp32 norm
    1-bit sign (Seide et al. 2014)                        ⌈numel/8⌉ + 4       packed bits + fp32 scale
    PowerSGD (Vogels et al. 2019, Alg. 1)                 r·(n + m) per n×m   all-reduced

The hooks themselves are :mod:`course_lib.optim.compression`. Tested in tests/optim/test_compression.py.
"""

from __future__ import annotations

import math


def topk_comm_bytes(k: int, value_bytes: int = 4, index_bytes: int = 4) -> int:
    """Top-K (Stich et al. 2018; Lin et al. 2018, DGC §3): k (value, index) pairs, k·(value + index)
    bytes, all-gathered (indices differ per rank, so the messages cannot be summed on the way)."""
    if k < 0:
        raise ValueError(f"k={k} coordinates must be >= 0")
    return k * (value_bytes + index_bytes)


def qsgd_comm_bytes(numel: int, level_bytes: int = 1, norm_bytes: int = 4) -> int:
    """QSGD (Alistarh et al. 2017, §3.1) with s ≤ 127 levels: one int8 signed level per coordinate
    and one fp32 norm per bucket, numel + 4 bytes (the paper's Elias coding of the levels, §3.2, would
    send fewer; this is the fixed-width version)."""
    return numel * level_bytes + norm_bytes


def sign_comm_bytes(numel: int, scale_bytes: int = 4) -> int:
    """1-bit sign (Seide et al. 2014; 1-bit Adam, Tang et al. 2021): numel bits packed 8 per byte and
    one fp32 scale, ⌈numel/8⌉ + 4 bytes: 32× less than fp32 for large numel."""
    return -(-numel // 8) + scale_bytes


def powersgd_comm_bytes(
    shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2.0, bytes_per_element: int = 4
) -> int:
    """PowerSGD (Vogels et al. 2019, Alg. 1), one bucket holding gradients of ``shapes``: each seen as
    an n × m matrix (n = shape[0], m = the rest) is sent as P (n × r) and Q (m × r), r = min(n, m, rank),
    r·(n + m) elements, when r(n + m)·min_compression_rate < nm (torch's rule); else as its n·m
    elements. All three are all-reduced, so the bytes do not grow with world_size."""
    total = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        total += r * (n + m) if r * (n + m) * min_compression_rate < n * m else n * m
    return total * bytes_per_element
