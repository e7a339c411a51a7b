"""Point-to-point exchanges that are safe on every backend: sends and receives posted together.

Two ranks that each ``isend`` to the other and then ``recv`` from it form a *crossing* pair. On gloo
it works: the send is buffered on the host. Under NCCL it can deadlock once the message is larger
than NCCL's internal buffer (its eager threshold; the exact size depends on the transport): each
rank's send kernel waits for the peer's receive, and both receives are queued on the same stream
behind the sends. NCCL's user guide ("Point-to-point communication") says that calls which must
progress at the same time belong in one group (``ncclGroupStart`` / ``ncclGroupEnd``), its
"Sendrecv" example being exactly this exchange; ``torch.distributed.batch_isend_irecv`` does that,
and on gloo it posts the same calls one by one, so the CPU results are unchanged.

The operations stay ``dist.isend`` / ``dist.irecv`` (``batch_isend_irecv`` calls them through the
module), so the communication counter and the timeline see the same calls as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
) -> list:
    """Post every ``(tensor, peer)`` send and receive as one batch; return the works to ``wait()``.

    ``peer`` is a global rank, as for ``dist.isend``. Receive buffers must be contiguous and on the
    same device as the sends (``course_lib.dist.device()``).
    """
    ops = [dist.P2POp(dist.isend, t, peer, group, tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer in recvs]
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def exchange_and_wait(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
) -> None:
    """:func:`exchange`, then wait until every send has left and every receive has arrived."""
    for work in exchange(sends, recvs, group, tag):
        work.wait()
