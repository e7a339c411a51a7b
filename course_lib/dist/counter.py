"""Count what each rank communicates: calls and bytes per collective type and process group.

    with counter.count() as c:
        dist.all_reduce(t, group=mesh.group("dp"))
    c.calls("all_reduce", "dp"), c.bytes("all_reduce")      # -> 1, t.numel() * t.element_size()

The formula-versus-measurement checks of the course (ring all-reduce sends 2(N-1)/N·S bytes per
rank, ZeRO-3 moves 3Ψ, a vocab-parallel cross-entropy needs exactly three all-reduces) rest on
these counts.

What "bytes" means, per call on this rank: the payload this rank hands to the operation —
the tensor of ``all_reduce``/``broadcast``/``send``/``recv``, the input of ``reduce_scatter*``,
``all_gather*`` (this rank's shard) and ``all_to_all*``. It is *not* the traffic on the wire, which
depends on the algorithm the backend picks (ring, tree, ...); lecture 02 and lab 01 derive wire
traffic from these payloads, or measure it by building the algorithm from send/recv.

How: :mod:`~course_lib.dist.intercept` reports each call of ``torch.distributed`` while a count is
active (call collectives through the module, ``dist.all_reduce(...)``, as all course code does).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from course_lib.dist import intercept


class CommCounter:
    """Calls and bytes per (operation, group) on this rank."""

    def __init__(self):
        self.counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, op: str, group: str, nbytes: int, **info) -> None:  # info (peer, tag): not counted
        entry = self.counts[(op, group)]
        entry[0] += 1
        entry[1] += nbytes

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return sum(c for (o, g), (c, _) in self.counts.items() if op in (None, o) and group in (None, g))

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        return sum(b for (o, g), (_, b) in self.counts.items() if op in (None, o) and group in (None, g))

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{"all_reduce@dp": {"calls": 2, "bytes": 4096}, ...} — picklable, for launch() results."""
        return {f"{o}@{g}": {"calls": c, "bytes": b} for (o, g), (c, b) in sorted(self.counts.items())}


@contextlib.contextmanager
def count():
    """Count this rank's communication until the block ends; yields the :class:`CommCounter`.

    Counts nest: an outer count sees everything an inner one sees.
    """
    c = CommCounter()
    with intercept.observe(c.add):  # each call: one more of ``op`` on ``group``
        yield c
