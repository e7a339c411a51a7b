"""What a DDP communication hook sees: the course's stand-in for ``torch.distributed.GradBucket``.

Torch's DDP calls ``hook(state, bucket)`` for every full bucket instead of all-reducing it
(``DistributedDataParallel.register_comm_hook``); the course DDP does the same with this class,
which has the methods of torch's GradBucket that hooks use, so one hook function (torch's own
``allreduce_hook`` and ``powerSGD_hook``, or those of :mod:`course_lib.optim.compression`) runs
under both. Tests also use it to call a hook on hand-made gradients, without any DDP.
"""

from __future__ import annotations

import torch


class GradBucket:
    """One bucket: a flat ``buffer`` holding the gradients of ``parameters`` back to back, in order."""

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list[torch.Tensor], is_last: bool):
        if buffer.numel() != sum(p.numel() for p in parameters):
            raise ValueError(
                f"a bucket buffer of {buffer.numel()} elements cannot hold parameters of "
                f"{sum(p.numel() for p in parameters)} elements"
            )
        self._index, self._buffer, self._parameters, self._is_last = index, buffer, list(parameters), is_last

    def index(self) -> int:
        """Position in launch order: 0 is the first bucket reduced in a step (the output layer's)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """This rank's flat gradients, *not* divided by the world size (torch's convention for hooks)."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor the bucket refers to (the gradients are then views of the new one)."""
        self._buffer = buffer

    def is_last(self) -> bool:
        """Whether this is the last bucket of the step: hooks count steps with it."""
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view of ``buffer()``: writing one writes the buffer."""
        views, offset = [], 0
        for p in self._parameters:
            views.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views
