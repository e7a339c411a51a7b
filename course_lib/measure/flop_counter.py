"""Measured compute: count the matmul FLOPs of a training step, time it, find this machine's peak.

Set beside the formulas of :mod:`course_lib.cost.flops` (lecture 01, tests/cost/test_flops.py).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.dist.timing import clock
from course_lib.measure.saved_tensors import sdpa_kernel


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
    """The fastest of ``reps`` calls of ``fn()``, in seconds (the minimum is the least disturbed run);
    each call is timed until the device has finished its work (:func:`course_lib.dist.timing.clock`)."""
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def matmul_flops_per_second(
    n: int = 2048, reps: int = 3, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> float:
    """FLOP/s of one large n × n matmul on ``device`` (default this CPU, with the current thread count):
    the practical peak that MFU is measured against (the datasheet peak of a CPU is rarely reached even
    by BLAS). Measure on the device the training step ran on."""
    g = torch.Generator().manual_seed(0)  # host: the same matrices on every machine, then moved
    a = torch.randn(n, n, generator=g, dtype=dtype).to(device)  # host: drawn on the CPU generator above
    b = torch.randn(n, n, generator=g, dtype=dtype).to(device)  # host: drawn on the CPU generator above
    a @ b  # warm-up: first-touch of pages, BLAS thread start
    return 2 * n**3 / best_seconds(lambda: a @ b, reps)


def train_step_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, warmup: int = 2) -> float:
    """Median wall-clock seconds of one training step (forward, backward, optimizer step) over
    ``batches`` (a list of (tokens, targets), on the model's device), after ``warmup`` steps that are
    not timed. Each step is timed until the device has finished it."""
    times = []
    for i, (x, y) in enumerate(batches):
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        optimizer.step()
        if i >= warmup:
            times.append(clock() - t0)
    if not times:
        raise ValueError(f"give more batches than warmup={warmup} steps")
    return sorted(times)[len(times) // 2]
