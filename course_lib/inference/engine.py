"""A serving engine: continuous batching over the paged cache, with preemption; static batching beside it.

Static batching (the way a training loop batches) admits ``max_batch`` requests, runs them until
the longest one finishes, then admits the next batch: a request that finishes early leaves its slot
idle, and a request that arrives waits for the whole batch. Continuous batching (Yu et al. 2022,
"Orca: A Distributed Serving System for Transformer-Based Generative Models", §3.2: *iteration-level
scheduling*) decides at every step: finished requests leave, waiting ones join while there is room.

Every step of :meth:`Engine.step`:

1. the running sequences each need a slot for one more token; when the pool cannot give them all,
   the most recently admitted one is *preempted* (vLLM's policy, Kwon et al. 2023 §4.5): with
   ``"recompute"`` its blocks are freed and it returns to the head of the queue, its generated
   tokens appended to its prompt, to be prefilled again later; with ``"swap"`` its blocks are copied
   out of the pool and copied back in when there is room (on a GPU: to host memory over PCIe);
2. swapped, then waiting requests are admitted in arrival order while fewer than ``max_batch`` run
   and the pool has the blocks their prompt needs (a prefix-cache hit needs fewer);
3. each admitted request's prompt is prefilled as it is admitted (one forward each; the next
   admission then finds its full blocks in the prefix cache) and gives its first token; the other
   running sequences decode one token in one batched forward;
4. requests with all their tokens leave, and their blocks go back to the pool.

``reserve="max_len"`` makes every admitted request reserve ``max_len`` slots at once, the contiguous
allocation of systems before vLLM, so the same engine measures both allocators' waste.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from course_lib.dist.timing import clock
from course_lib.inference.cache import check_device
from course_lib.inference.paged import PagedCache
from course_lib.inference.sampling import sample

__all__ = ["Engine", "EngineStats", "Request"]


@dataclass
class Request:
    """A prompt (token ids), how many tokens to generate, and how to sample them (greedy by default)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    forwards: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    wall_seconds: float = 0.0
    allocated_slots: list[int] = field(default_factory=list)  # after each step
    used_slots: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    prefix_hit_rate: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def waste(self) -> float:
        """(allocated − used) / allocated, summed over steps: the share of reserved slots holding nothing."""
        allocated = sum(self.allocated_slots)
        return (allocated - sum(self.used_slots)) / allocated if allocated else 0.0


class _Live:
    """A request in flight: its sequence id in the cache, its generated tokens, its sampler."""

    def __init__(self, index: int, request: Request):
        self.index, self.request = index, request
        self.generated: list[int] = []
        self.sid: int | None = None
        self.swapped: dict | None = None
        # host: sampling runs on the host (Engine._emit), so one seed draws the same tokens on any machine
        self.generator = torch.Generator().manual_seed(request.seed)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.max_new_tokens


class Engine:
    """Serve :class:`Request` s with ``model`` from a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    ``batching``: ``"continuous"`` or ``"static"``; ``preemption``: ``"recompute"`` or ``"swap"``;
    ``reserve``: ``"paged"`` (a block at a time) or ``"max_len"`` (``max_len`` slots at admission).
    The pool and every token tensor live on the model's device; a ready ``cache`` must be built there.
    """

    def __init__(
        self,
        model,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_batch: int = 8,
        *,
        batching: str = "continuous",
        preemption: str = "recompute",
        reserve: str = "paged",
        max_len: int | None = None,
        prefix_caching: bool = True,
        cache: PagedCache | None = None,
    ):
        for name, value, choices in (
            ("batching", batching, ("continuous", "static")),
            ("preemption", preemption, ("recompute", "swap")),
            ("reserve", reserve, ("paged", "max_len")),
        ):
            if value not in choices:
                raise ValueError(f"{name}={value!r}: choose one of {choices}")
        self.model, self.max_batch = model, max_batch
        self.device = next(model.parameters()).device
        self.batching, self.preemption, self.reserve = batching, preemption, reserve
        self.max_len = max_len or model.cfg.max_seq_len
        # ``cache``: a ready pool to serve from (lab 09 passes the learner's); num_blocks and block_size are then its own
        if cache is None and num_blocks is None:
            raise ValueError("Engine needs num_blocks (the pool's size) or a ready cache=PagedCache(...)")
        if cache is None:
            cache = PagedCache(num_blocks, block_size, prefix_caching=prefix_caching, device=self.device)
        elif hasattr(cache, "device"):  # a cache without one (a learner's) meets the model's K/V first
            check_device(cache, self.device)
        self.cache = cache
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.finished: dict[int, list[int]] = {}
        self.stats = EngineStats()
        self._count = 0

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its index (the key of its output in :meth:`run`'s result)."""
        total = len(request.prompt) + request.max_new_tokens
        if total > min(self.max_len, self.model.cfg.max_seq_len):
            raise ValueError(
                f"request of {len(request.prompt)} prompt + {request.max_new_tokens} new tokens exceeds "
                f"max_len={min(self.max_len, self.model.cfg.max_seq_len)}; shorten it or raise max_len"
            )
        bs = self.cache.block_size
        blocks = -(-(self.max_len if self.reserve == "max_len" else total) // bs)
        if blocks > self.cache.pool.num_blocks:
            raise ValueError(
                f"one request needs {blocks} blocks, the pool has "
                f"{self.cache.pool.num_blocks}: it could never run. Build the engine with more blocks"
            )
        live = _Live(self._count, request)
        self._count += 1
        self.waiting.append(live)
        return live.index

    def _reserved_tokens(self, live: _Live) -> int:
        """Slots taken at admission: the tokens to prefill (paged), or max_len (contiguous reservation)."""
        return self.max_len if self.reserve == "max_len" else len(live.request.prompt) + len(live.generated)

    # ------------------------------------------------------------------ one iteration
    @torch.no_grad()
    def step(self) -> None:
        self._make_room_for_decode()
        admitted = self._admit()
        decoding = [live for live in self.running if live not in admitted]
        if decoding:  # every running sequence's last token, in one batched forward
            self.cache.batch = [live.sid for live in decoding]
            last = torch.tensor([[self.cache.tokens(live.sid)[-1]] for live in decoding], device=self.device)
            self._emit(decoding, self.model(last, cache=self.cache)[:, -1])
        for live in [live for live in self.running if live.done]:
            self.running.remove(live)
            self.finished[live.index] = live.generated
            self.cache.free_sequence(live.sid)
        self.stats.steps += 1
        self.stats.allocated_slots.append(self.cache.allocated_slots())
        self.stats.used_slots.append(self.cache.used_slots())
        self.stats.running.append(len(self.running))

    def _emit(self, lives: list[_Live], logits: torch.Tensor) -> None:
        self.stats.forwards += 1
        # The tokens become Python ints for the scheduler anyway: one copy of the step's logits to the host,
        # where each request's CPU generator samples (the same draws as on a laptop for the same logits).
        for live, row in zip(lives, logits.cpu()):
            r = live.request
            token = int(sample(row[None], r.temperature, r.top_k, r.top_p, live.generator)[0])
            live.generated.append(token)
            self.stats.generated_tokens += 1
            if not live.done:
                self.cache.append_token(live.sid, token)  # the next step computes its K/V

    def _make_room_for_decode(self) -> None:
        """Preempt the most recently admitted sequences until every other running one has its next slot."""
        while self.running:
            need = sum(self.cache.blocks_needed(live.sid, 1) for live in self.running)
            if need <= self.cache.pool.num_free:
                return
            victim = self.running.pop()
            self.stats.preemptions += 1
            if self.preemption == "swap":
                victim.swapped = self.cache.swap_out(victim.sid)
            else:  # recompute: forget its K/V; its prompt becomes prompt + what it generated so far
                self.cache.free_sequence(victim.sid)
            victim.sid = None
            self.waiting.appendleft(victim)

    def _admit(self) -> list[_Live]:
        if self.batching == "static" and self.running:
            return []  # a static batch runs to its end before the next one starts
        admitted: list[_Live] = []
        # the blocks the running sequences' next decode takes are spoken for
        spoken_for = sum(self.cache.blocks_needed(live.sid, 1) for live in self.running)
        while self.waiting and len(self.running) < self.max_batch:
            live = self.waiting[0]
            if live.swapped is not None:
                if live.swapped["n_blocks"] + 1 > self.cache.pool.num_free - spoken_for:
                    break
                live.sid = self.cache.swap_in(live.swapped)
                live.swapped = None
                spoken_for += self.cache.blocks_needed(live.sid, 1)
                self.waiting.popleft()
                self.running.append(live)  # resumes decoding: it already has its last token's K/V pending
                continue
            tokens = live.request.prompt + live.generated
            sid = self.cache.add_sequence(tokens)
            reserve = self._reserved_tokens(live) - self.cache.num_computed(sid)
            # (a prefix hit on a free cached block has just taken it out of the free list)
            if self.cache.blocks_needed(sid, reserve) > self.cache.pool.num_free - spoken_for:
                self.cache.free_sequence(sid)  # gives back the prefix blocks it took
                break
            self.cache.reserve(sid, self._reserved_tokens(live))
            live.sid = sid
            self.waiting.popleft()
            self.running.append(live)
            admitted.append(live)
            self._prefill(live)  # now, so that the next admission already finds this prompt's blocks cached
        return admitted

    def _prefill(self, live: _Live) -> None:
        """Run the uncached part of a newly admitted sequence's prompt (one forward) and emit its first token."""
        self.cache.batch = [live.sid]
        done = self.cache.num_computed(live.sid)
        rest = torch.tensor(self.cache.tokens(live.sid)[done:], device=self.device)[None]
        self._emit([live], self.model(rest, cache=self.cache)[:, -1])

    # ------------------------------------------------------------------ a whole workload
    def run(self, requests: list[Request]) -> tuple[list[list[int]], EngineStats]:
        """Serve ``requests`` to the end; the generated tokens of each, in request order, and the stats."""
        indices = [self.add_request(r) for r in requests]
        start = clock()
        while self.waiting or self.running:
            before = (len(self.waiting), len(self.running), self.stats.generated_tokens)
            self.step()
            if (len(self.waiting), len(self.running), self.stats.generated_tokens) == before:
                raise RuntimeError(
                    f"the engine made no progress: {len(self.waiting)} waiting, {len(self.running)} running, "
                    f"{self.cache.pool.num_free} free blocks. The pool is too small for the requests' prompts"
                )
        self.stats.wall_seconds = clock() - start
        self.stats.prefix_hit_rate = self.cache.prefix_hit_rate()
        return [self.finished[i] for i in indices], self.stats
