"""Decode speed with and without a KV cache as the context grows.

Without a cache, decoding one token after a context of L tokens runs the model on all L + 1 tokens:
its cost grows linearly with L (quadratically in attention) while a cached step costs one token's
projections plus one attention row over L cached keys. :func:`decode_speed` times both paths on the
same model and prompts, for lecture 06 and benchmarks/bench_kv_cache.py. Times are wall-clock on this machine: compare the
columns of one run, not runs on different days.

benchmarks/bench_kv_cache.py runs it at larger sizes; tests/measure/test_device_measure.py checks that it times with
the synchronising clock.
"""

from __future__ import annotations

import torch

from course_lib.dist.timing import clock
from course_lib.inference.cache import ContiguousCache
from course_lib.inference.paged import PagedCache

__all__ = ["decode_speed"]


@torch.no_grad()
def decode_speed(model, contexts, new_tokens: int = 16, caches=(None, "contiguous", "paged"), repeats: int = 3):
    """{cache: [decode tokens/s at each context length]}: the time of ``new_tokens`` decoding steps after a
    prompt of each length, prefill excluded, best of ``repeats`` (the least disturbed run). A step without
    a cache is the model on the whole sequence so far; with one, the model on the last token. The
    tokens go to the model's device; each run is timed until the device has finished it."""
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)  # host: the same prompts on every machine, then moved to dev
    results = {cache: [] for cache in caches}
    for length in contexts:
        # host: drawn on the CPU generator above (identical on any machine), then moved to the model's device
        prompt = torch.randint(0, model.cfg.vocab_size, (1, length), generator=g).to(dev)
        # host: drawn on the CPU generator like the prompt, then moved to the model's device
        follow = torch.randint(0, model.cfg.vocab_size, (1, new_tokens), generator=g).to(dev)
        for cache in caches:
            best = float("inf")
            for _ in range(repeats):
                store = _fresh(cache, length + new_tokens, dev)
                if store is not None:
                    model(prompt, cache=store)  # prefill, not timed
                start = clock()
                for i in range(new_tokens):
                    if store is None:
                        model(torch.cat([prompt, follow[:, : i + 1]], dim=1))
                    else:
                        model(follow[:, i : i + 1], cache=store)
                best = min(best, clock() - start)
            results[cache].append(new_tokens / best)
    return results


def _fresh(cache, total: int, device: torch.device):
    """A new cache of the kind asked for, on the model's ``device`` (None: no cache)."""
    if cache is None:
        return None
    if cache == "contiguous":
        return ContiguousCache(1, total, device)
    store = PagedCache(-(-total // 16), 16, device=device)
    store.batch = [store.add_sequence([0] * total)]  # token ids only matter for prefix hashes
    return store
