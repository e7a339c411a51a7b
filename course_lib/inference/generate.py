"""Autoregressive generation with no cache, a contiguous cache or a paged cache.

Without a cache every new token runs the whole sequence through the model again: step t costs
O(t) per layer for the projections and O(t²) for attention, so n tokens cost O(n²) (O(n³) in
attention). With a cache the prompt runs once (*prefill*, compute-bound: a matrix of tokens per
GEMM) and each new token runs alone (*decode*, memory-bound: every weight and the whole cache read
for one token's GEMVs). The three paths compute the same function of the same numbers, so their
greedy tokens agree; tests/inference/test_generate.py checks it over prompts of many lengths for GQA and MLA.
"""

from __future__ import annotations

import torch

from course_lib.inference.cache import ContiguousCache, StepCache
from course_lib.inference.paged import PagedCache
from course_lib.inference.sampling import sample

__all__ = ["CACHES", "generate"]

CACHES = (None, "contiguous", "paged")


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    cache=None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    block_size: int = 16,
) -> torch.Tensor:
    """``input_ids`` [seq] or [batch, seq] followed by ``max_new_tokens`` generated tokens (same rank).

    ``cache``: None (recompute the prefix every step), ``"contiguous"`` (:class:`ContiguousCache`,
    ``seq + max_new_tokens`` slots per sequence), ``"paged"`` (:class:`PagedCache` with blocks of
    ``block_size``), or an empty cache object whose sequences advance in step (a
    :class:`~course_lib.inference.cache.StepCache`: a ``ContiguousCache`` or ``QuantizedCache`` built by
    the caller, with ``device=`` the model's). Decoding is greedy unless ``temperature > 0`` (see
    :func:`sample`; a ``generator`` is then on the model's device, ``torch.Generator(device=...)``).
    ``input_ids`` are on the model's device too; every token and position made here is put there.
    """
    if (isinstance(cache, str) and cache not in CACHES) or not isinstance(cache, (str, StepCache, type(None))):
        raise ValueError(f"cache={cache!r}: choose one of {CACHES} or pass a StepCache (e.g. QuantizedCache)")
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise ValueError(
            f"input_ids are on {input_ids.device}, the model on {device}: pass input_ids.to({str(device)!r})"
        )
    tokens = input_ids[None] if input_ids.dim() == 1 else input_ids
    batch, t = tokens.shape
    total = t + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt length {t} + max_new_tokens {max_new_tokens} exceeds max_seq_len={model.cfg.max_seq_len}; "
            f"shorten the prompt or generate fewer tokens"
        )
    pick = lambda logits: sample(logits, temperature, top_k, top_p, generator)
    out = [tokens]
    if cache is None:
        for _ in range(max_new_tokens):
            out.append(pick(model(torch.cat(out, dim=1))[:, -1])[:, None])
    elif cache == "contiguous" or isinstance(cache, StepCache):
        store = ContiguousCache(batch, total, device) if cache == "contiguous" else cache
        logits = model(tokens, cache=store)[:, -1]
        for step in range(max_new_tokens):
            out.append(pick(logits)[:, None])
            if step + 1 < max_new_tokens:
                logits = model(out[-1], cache=store)[:, -1]
    else:
        store = PagedCache(batch * -(-total // block_size), block_size, device=device)
        ids = [store.add_sequence(row.tolist()) for row in tokens]
        for sid in ids:  # prefill one sequence at a time: a prefix hit may leave each a different part to compute
            store.batch = [sid]
            done = store.num_computed(sid)
            rest = torch.tensor(store.tokens(sid)[done:], device=device)[None]
            last = model(rest, cache=store)[:, -1]
            logits = last if sid == ids[0] else torch.cat([logits, last])
        store.batch = ids
        for step in range(max_new_tokens):
            out.append(pick(logits)[:, None])
            for sid, token in zip(ids, out[-1][:, 0].tolist()):
                store.append_token(sid, token)
            if step + 1 < max_new_tokens:
                logits = model(out[-1], cache=store)[:, -1]
    result = torch.cat(out, dim=1)
    return result[0] if input_ids.dim() == 1 else result
