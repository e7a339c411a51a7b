"""A census of what a rank holds: bytes of the distinct storages behind parameters, gradients and
optimizer state. The algorithms themselves report with it (ZeRO's ``model_state_bytes``), so it
lives low, beside the counter; the formulas it is checked against are in :mod:`course_lib.cost.memory`.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def held_bytes(*roots, max_depth: int = 6) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots``: a census of what is held.

    ``nn.Module`` roots contribute their parameters and the parameters' ``.grad`` (not buffers:
    the RoPE tables are neither parameters, gradients nor optimizer state). Any other object is
    searched through tensors, lists, tuples, dicts and its ``__dict__``. Storages are counted once
    each, at their allocated size (``untyped_storage().nbytes()``): a view costs nothing extra, a
    freed ZeRO-3 buffer (storage resized to 0) costs 0, padding costs what it costs.
    """
    seen_storages: dict[int, int] = {}
    seen_objects: set[int] = set()

    def add(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or t.is_meta:  # a meta tensor has a shape and no memory (DeepSpeed keeps some)
            return
        seen_storages[storage.data_ptr()] = max(seen_storages.get(storage.data_ptr(), 0), storage.nbytes())

    def visit(obj, depth: int) -> None:
        if id(obj) in seen_objects or depth > max_depth:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            add(obj)
            if obj.grad is not None:
                add(obj.grad)
        elif isinstance(obj, nn.Module):
            for p in obj.parameters():
                visit(p, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                visit(v, depth + 1)

    for root in roots:
        visit(root, 0)
    return sum(seen_storages.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes actually held in ``optimizer.state`` by tensors with at least one dimension.

    0-dim tensors (torch's step counters) are skipped, to match :func:`state_bytes`.
    """
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total
