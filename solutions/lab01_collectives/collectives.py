"""Lab 01 — collectives built from point-to-point messages.

Your task: write ring reduce-scatter, ring all-gather and ring all-reduce using only
point-to-point messages: the given ``_exchange`` (``dist.isend`` / ``dist.irecv`` posted together),
or ``dist.isend`` / ``dist.send`` / ``dist.recv`` (no torch.distributed collective).

The ring (Patarasuk & Yuan, 2009; the algorithm of NCCL and of Baidu's ring all-reduce): the N
ranks sit on a ring, each sends only to its right neighbour and receives only from its left one.
The tensor is cut into N chunks. In every step each rank sends one chunk and receives one chunk,
so every link is busy all the time and no rank is a bottleneck.

    reduce-scatter: N-1 steps; a rank sends (N-1)/N·S bytes and ends with one fully summed chunk
    all-gather:     N-1 steps; a rank sends (N-1)/N·S bytes and ends with every chunk
    all-reduce  =   reduce-scatter + all-gather: 2(N-1)/N·S bytes per rank, independent of N

(S = the bytes of the whole tensor.) Chunks follow ``tensor.flatten().tensor_split(N)``, so sizes
that N does not divide work too: the first chunks are one element longer.
"""

import torch
import torch.distributed as dist


def ring_neighbours(group=None) -> tuple[int, int, int, int]:
    """(my index in the group, group size, global rank of my right neighbour, of my left one)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % n, (rank - 1) % n
    if group is not None:
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    return rank, n, right, left


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group=None) -> None:
    """Send ``send`` to the right while receiving ``recv`` from the left, both posted as one batch.

    Every rank sends and receives at once, so neither call may wait for the other: with a blocking
    send first, every rank would wait for a receiver that is itself still sending. A non-blocking
    ``isend`` then a blocking ``recv`` is not enough under NCCL: at N = 2 the right and the left
    neighbour are the same rank, the two ranks' sends cross on one link, and once a message is
    larger than NCCL's internal buffer each send waits for a receive queued behind it — a deadlock
    (gloo buffers the send on the host, so the CPU hides it). NCCL's user guide ("Point-to-point
    communication") says calls that must progress together belong in one group;
    ``dist.batch_isend_irecv`` forms that group from ``dist.P2POp(dist.isend / dist.irecv, ...)``
    and on gloo posts the same two calls one after the other (``course_lib.dist.p2p.exchange``
    does the same for the course's own code).
    """
    ops = [dist.P2POp(dist.isend, send, right, group), dist.P2POp(dist.irecv, recv, left, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def ring_reduce_scatter_(chunks: list[torch.Tensor], group=None) -> None:
    """In place: afterwards ``chunks[rank]`` holds the sum over all ranks of that chunk.

    Step s (s = 0 .. N-2): rank r sends chunk (r - s - 1) mod N and receives chunk
    (r - s - 2) mod N, which it adds to its own copy. At the last step the chunk received is r.
    """
    # BEGIN SOLUTION Task 1: ring reduce-scatter, in place: chunks[rank] ends as the sum; returns None
    rank, n, right, left = ring_neighbours(group)
    for step in range(n - 1):
        send = chunks[(rank - step - 1) % n]
        into = chunks[(rank - step - 2) % n]
        buffer = torch.empty_like(into)
        _exchange(send.contiguous(), buffer, right, left, group)
        into += buffer
    # END SOLUTION


def ring_all_gather_(chunks: list[torch.Tensor], group=None) -> None:
    """In place: every rank starts owning ``chunks[rank]`` and ends with every chunk.

    Step s (s = 0 .. N-2): rank r sends chunk (r - s) mod N, which it owns or has just received,
    and receives chunk (r - s - 1) mod N.
    """
    # BEGIN SOLUTION Task 2: ring all-gather, in place: every chunk ends filled; returns None
    rank, n, right, left = ring_neighbours(group)
    for step in range(n - 1):
        send = chunks[(rank - step) % n]
        into = chunks[(rank - step - 1) % n]
        buffer = torch.empty_like(into)
        _exchange(send.contiguous(), buffer, right, left, group)
        into.copy_(buffer)
    # END SOLUTION


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks and return this rank's chunk of the sum (a new tensor)."""
    n = dist.get_world_size(group)
    chunks = [c.clone() for c in tensor.flatten().tensor_split(n)]
    ring_reduce_scatter_(chunks, group)
    return chunks[dist.get_rank(group)]


def ring_all_gather(shard: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's equally sized ``shard`` in rank order (a new flat tensor)."""
    n = dist.get_world_size(group)
    out = torch.zeros(n * shard.numel(), dtype=shard.dtype, device=shard.device)
    chunks = list(out.tensor_split(n))
    chunks[dist.get_rank(group)].copy_(shard.flatten())
    ring_all_gather_(chunks, group)
    return out


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place like ``dist.all_reduce``; returns ``tensor``."""
    # BEGIN SOLUTION Task 3: all-reduce = your reduce-scatter, then all-gather; sums into tensor, returns it
    n = dist.get_world_size(group)
    flat = tensor.reshape(-1)  # a view when the tensor is contiguous, a copy otherwise
    chunks = list(flat.tensor_split(n))
    ring_reduce_scatter_(chunks, group)
    ring_all_gather_(chunks, group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor
    # END SOLUTION
