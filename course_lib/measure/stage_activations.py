"""Activation bytes a pipeline rank holds during one step, measured: for each (micro-batch, stage),
the distinct storages autograd saves in its forward, held until its last backward action frees them.

An observer of :func:`course_lib.parallel.pipeline.executor.run_step`: the executor opens
:meth:`StageActivationMeter.forward` around each forward F and calls :meth:`~StageActivationMeter.freed`
when B (or W, for a backward split into I and W: Qi et al. 2023, *Zero Bubble Pipeline
Parallelism*, §2) drops that micro-batch's activations. Saved storages are counted by identity
(:class:`course_lib.measure.saved_tensors.SavedTensorMeter`), leaving out the rank's weights, buffers
and RoPE tables, which are not activations.

    meter = StageActivationMeter(mine)
    run_step(schedule, mine, xs, ys, loss_fn, hidden_shape, observer=meter)
    meter.peak_bytes, meter.bytes_per_microbatch

The peak is the in-flight count of the schedule (``cost.pipeline.in_flight_microbatches``) times
one micro-batch's bytes, and a middle stage's bytes are ``cost.activations.activation_bytes_per_layer``
per block: tests/parallel/pipeline/test_pipeline.py sets them side by side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from course_lib.measure.saved_tensors import SavedTensorMeter


class StageActivationMeter:
    """Saved-activation bytes of the stages ``stages`` (stage index -> module) that one rank holds."""

    def __init__(self, stages: dict[int, nn.Module]):
        self._weights = tuple(t for st in stages.values() for t in (*st.parameters(), *st.buffers()))
        self.held: dict[tuple[int, int], int] = {}  # (micro-batch, stage) -> bytes its forward saved
        self.peak_bytes = 0  # most bytes held at once, after a forward
        self.bytes_per_microbatch: dict[int, int] = {}  # stage -> bytes one micro-batch's forward saves

    @contextlib.contextmanager
    def forward(self, microbatch: int, stage: int) -> Iterator[None]:
        """Around the forward of (``microbatch``, ``stage``): count what autograd saves in it."""
        with SavedTensorMeter(constants=self._weights) as meter:
            yield
        self.held[(microbatch, stage)] = meter.bytes
        self.bytes_per_microbatch[stage] = meter.bytes
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))

    def freed(self, microbatch: int, stage: int) -> None:
        """The backward of (``microbatch``, ``stage``) has dropped its saved activations."""
        self.held.pop((microbatch, stage), None)
