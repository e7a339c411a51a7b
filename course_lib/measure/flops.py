"""Measured compute: count the matmul FLOPs of a training step, time it, find this machine's peak.

Set beside the formulas of :mod:`course_lib.cost.flops` (lecture 01, tests/test_flops.py).
"""

from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.measure.activations import sdpa_kernel


def count_training_flops(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, int]:
    """FLOPs of one forward + backward of ``model.loss(tokens, targets)``, per aten op, as
    ``FlopCounterMode`` counts them: 2 per multiply-add of every matmul (``mm``, ``bmm``, ...), nothing
    for elementwise ops.

    Attention runs on the "math" kernel, which writes softmax(QKᵀ)·V as two ``bmm`` over the whole
    T × T score matrix: FlopCounterMode has no formula for the CPU's fused causal kernel, and the math
    kernel's backward is exactly two ``bmm`` per forward ``bmm``, what the formula assumes.
    """
    with sdpa_kernel("math"), FlopCounterMode(display=False) as counter:
        model.loss(tokens, targets).backward()
    model.zero_grad(set_to_none=True)
    return {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


def best_seconds(fn, reps: int = 3) -> float:
    """The fastest of ``reps`` calls of ``fn()``, in seconds (the minimum is the least disturbed run)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops_per_second(n: int = 2048, reps: int = 3, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of one large n × n matmul on this CPU with the current thread count: the practical peak
    that MFU is measured against (the datasheet peak of a CPU is rarely reached even by BLAS)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g, dtype=dtype), torch.randn(n, n, generator=g, dtype=dtype)
    a @ b  # warm-up: first-touch of pages, BLAS thread start
    return 2 * n**3 / best_seconds(lambda: a @ b, reps)


def train_step_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, warmup: int = 2) -> float:
    """Median wall-clock seconds of one training step (forward, backward, optimizer step) over
    ``batches`` (a list of (tokens, targets)), after ``warmup`` steps that are not timed."""
    times = []
    for i, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if not times:
        raise ValueError(f"give more batches than warmup={warmup} steps")
    return sorted(times)[len(times) // 2]
