"""An all-reduce whose sum has one fixed order: rank 0 + rank 1 + ... + rank N-1, on every rank.

Floating-point addition is not associative, and a collective library chooses the order of a sum
for speed: gloo's ring starts each chunk of the buffer at a different rank, NCCL picks ring or tree
by message size and topology, so the same contributions can sum to different bits depending on
the algorithm, the world size or an element's position in the buffer (lecture 08b measures it;
:func:`course_lib.experiments.lecture08.reproducibility.allreduce_orders` shows the orders). Deterministic
training needs the order fixed. The plain way: gather every rank's tensor and add them in rank
order, as a single process accumulating micro-batch 0, 1, ... would.

    result = ((x_0 + x_1) + x_2) + ... + x_{N-1}

It costs an all-gather, (N-1)·S bytes received and N·S held per rank, against 2(N-1)/N·S for a
ring all-reduce: about N/2 times the traffic, which is why production stacks fix the order inside
their kernels instead (NCCL's ``NCCL_ALGO``/``NCCL_PROTO`` pin the algorithm; batch-invariant
kernels, Thinking Machines 2025). Fine for the course's models and for the fault-tolerance lab.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_in_rank_order(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in rank order, in place on every rank; return it.

    Every rank gets the same bits: each adds the same gathered tensors in the same order.
    """
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0].clone()
    for part in parts[1:]:  # left to right: ((x0 + x1) + x2) + ...
        total += part
    tensor.copy_(total)
    return tensor
