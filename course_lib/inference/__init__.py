"""Serving the course model: KV caches, generation and the engine (lecture 06, lab 09).

* :mod:`~course_lib.inference.cache`     — the cache protocol the model calls and the contiguous cache
* :mod:`~course_lib.inference.paged`     — PagedAttention's block pool: block tables, prefix caching, copy-on-write
* :mod:`~course_lib.inference.quantized_cache` — KIVI's INT8/INT4/INT2 cache (per-channel keys, per-token values, full-precision window)
* :mod:`~course_lib.inference.cachegen` — a CacheGen-style delta + entropy codec for sending a cache
* :mod:`~course_lib.inference.engine`    — continuous batching over the paged cache, preemption by recompute or swap, static batching beside it
* :mod:`~course_lib.inference.sampling`  — greedy, temperature, top-k, top-p
* :mod:`~course_lib.inference.generate`  — ``generate(model, input_ids, max_new_tokens, cache=None | "contiguous" | "paged")``
"""
