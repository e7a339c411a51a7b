"""Lab 06's overlap timeline: did a K/V block travel while a block of attention was computed?

The ring's point of sending K and V around is to hide each hop behind a block's computation. On each
rank the grader wraps torch's receives and ``block_attention`` and records, in order, when each receive
was posted, when it completed and when a block was computed; a receive is *hidden* when a computation
falls between its posting and its completion (lab06_sequence_parallel.py's overlap checks).
"""

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class _Timeline:
    """This rank's receives (posted, then complete) and block computations, in the order they happen.

    A receive is complete when ``wait()`` returns on its work (a blocking ``recv``: when it returns). Under
    NCCL ``batch_isend_irecv`` returns one work for the whole batch: waiting on it completes the batch's
    receives. Installed in a rank's process before the communication counter, which wraps these again.
    """

    def __init__(self):
        self.events: list[tuple] = []  # ("post", id), ("done", id), ("compute",), ("phase", name)
        self.batch: list[int] | None = None  # the receives posted by the batch_isend_irecv running now
        self.blocking = False  # inside a blocking recv
        for name, wrapper in (("irecv", self._irecv), ("recv", self._recv), ("batch_isend_irecv", self._batch)):
            original = getattr(c10d, name)
            wrapped = wrapper(original)
            setattr(c10d, name, wrapped)  # torch's P2POp compares its op with c10d's irecv: keep them one function
            setattr(dist, name, wrapped)

    def _post(self) -> int:
        rid = sum(1 for e in self.events if e[0] == "post")
        self.events.append(("post", rid))
        return rid

    def _done_on_wait(self, work, rids):
        events = self.events

        class Done:
            def wait(self, *args, **kwargs):
                out = work.wait(*args, **kwargs)
                events.extend(("done", rid) for rid in rids if ("done", rid) not in events)
                return out

            def __getattr__(self, name):
                return getattr(work, name)

        return Done()

    def _irecv(self, original):
        def irecv(*args, **kwargs):
            if self.blocking:  # torch's recv is irecv + wait: recorded once, as the recv
                return original(*args, **kwargs)
            rid = self._post()
            if self.batch is not None:
                self.batch.append(rid)
            work = original(*args, **kwargs)
            return None if work is None else self._done_on_wait(work, [rid])

        return irecv

    def _recv(self, original):
        def recv(*args, **kwargs):
            rid, self.blocking = self._post(), True
            try:
                out = original(*args, **kwargs)
            finally:
                self.blocking = False
            self.events.append(("done", rid))
            return out

        return recv

    def _batch(self, original):
        def batch_isend_irecv(ops):
            self.batch = []
            try:
                works = original(ops)
            finally:
                posted, self.batch = self.batch, None
            if len(works) == len(ops):  # one work per operation (gloo): each receive's own work completes it
                return works
            return [self._done_on_wait(w, posted) for w in works]  # coalesced (NCCL): the batch's work does

        return batch_isend_irecv

    def compute(self, fn):
        def recorded(*args, **kwargs):
            self.events.append(("compute",))
            return fn(*args, **kwargs)

        return recorded

    def overlap(self, phase: str) -> tuple[int, int]:
        """(receives posted in ``phase``, those with a block computed between their posting and completion)."""
        marks = [i for i, e in enumerate(self.events) if e[0] == "phase"] + [len(self.events)]
        names = [e[1] for e in self.events if e[0] == "phase"]
        i = names.index(phase)
        events = self.events[marks[i] : marks[i + 1]]
        posted = {e[1]: k for k, e in enumerate(events) if e[0] == "post"}
        done = {e[1]: k for k, e in enumerate(events) if e[0] == "done"}
        computes = [k for k, e in enumerate(events) if e[0] == "compute"]
        hidden = [rid for rid, k in posted.items() if any(k < c < done.get(rid, len(events)) for c in computes)]
        return len(posted), len(hidden)
