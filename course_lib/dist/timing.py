"""The course's one clock for measuring speed: a wall-clock reading taken after the device is idle.

A GPU runs its kernels asynchronously: ``out = a @ b`` returns as soon as the work is queued, so two
``time.perf_counter()`` readings around it measure the queueing, not the matmul. Reading the clock
only after :func:`course_lib.dist.runtime.synchronize` (``torch.accelerator.synchronize``, a no-op
on CPU) makes the difference of two readings the time the device took. Every timing in
``course_lib``, the labs and the benchmarks goes through :func:`clock` (``tests/test_device_guard.py``
fails on a bare ``time.perf_counter()`` in rank-side code)::

    start = clock()
    step()
    seconds = clock() - start
"""

from __future__ import annotations

import time
from collections.abc import Callable

from course_lib.dist.runtime import synchronize


def clock() -> float:
    """Seconds on a monotonic clock, read once the device's queued work has finished."""
    synchronize()
    return time.perf_counter()


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, each call timed
    on its own with :func:`clock` (so each sample includes the device finishing its work)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_calls needs repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return samples
