"""Inference on a GPU, checked on a CPU: tokens, positions, masks and pools on the model's device.

Two ways to see a device on a laptop. A trap: under ``torch.device("meta")`` as the default device,
a tensor made without ``device=`` is a meta tensor, and it fails as soon as it meets the CPU model,
as a CPU tensor fails against a CUDA one; the same calls must then give the same tokens as without
the trap. And ``device="meta"`` itself: a cache built for it must make its positions and slots there,
and refuse a K/V from elsewhere with the fix named (the GPU error would be a stack trace in attention).
"""

from __future__ import annotations

import pytest
import torch

from course_lib.inference.cache import ContiguousCache
from course_lib.inference.engine import Engine, Request
from course_lib.inference.generate import generate
from course_lib.inference.paged import PagedCache
from course_lib.inference.quantized_cache import QuantizedCache
from course_lib.model.configs import get
from course_lib.model.transformer import Transformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(get("tiny", max_seq_len=64)).eval()


@pytest.mark.parametrize("cache", [None, "contiguous", "paged"])
def test_generate_makes_its_tokens_and_positions_on_the_models_device(model, cache):
    prompt = torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    want = generate(model, prompt, 6, cache)
    with torch.device("meta"):  # a factory without device= would now make a meta tensor
        got = generate(model, prompt, 6, cache)
    assert got.device.type == "cpu" and torch.equal(got, want)


def test_generate_refuses_input_ids_on_another_device(model):
    with pytest.raises(ValueError, match="input_ids are on meta"):
        generate(model, torch.zeros(4, dtype=torch.long, device="meta"), 2)


REQUESTS = [
    Request([1, 2, 3, 4, 5, 6, 7, 8, 9], 8),
    Request([1, 2, 3, 4, 5, 6, 7, 8, 2, 2], 7, temperature=1.0, seed=3),  # sampled: the generator's draws
    Request([4, 4, 4], 9, temperature=0.8, top_k=5, seed=1),
]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_engine_serves_from_the_models_device(model, preemption):
    """6 blocks of 4 slots for 3 requests of up to 17 tokens: the engine must preempt (and swap)."""
    run = lambda: Engine(model, num_blocks=6, block_size=4, max_batch=3, preemption=preemption).run(REQUESTS)
    want, stats = run()
    assert stats.preemptions > 0, "the pool must be small enough to preempt"
    with torch.device("meta"):
        got, _ = run()
    assert got == want, "the same tokens, sampled ones included (CPU generators, on the host)"
    assert Engine(model, num_blocks=6).cache.device == torch.device("cpu"), "the pool goes where the model is"


def test_engine_refuses_a_cache_built_for_another_device(model):
    with pytest.raises(ValueError, match="built for meta"):
        Engine(model, cache=PagedCache(8, 4, device="meta"))


@pytest.mark.parametrize("make", [ContiguousCache, QuantizedCache])
def test_step_caches_make_positions_on_their_device_and_refuse_others(make):
    cache = make(2, 16, device="meta")
    assert cache.begin_step(3).device.type == "meta", "positions index the model's RoPE tables: on its device"
    k = torch.zeros(2, 1, 3, 8)  # a CPU K for a cache built for meta
    with pytest.raises(ValueError, match="built for meta"):
        cache.layer(0).update(k, k)


def test_paged_cache_makes_positions_and_slots_on_its_device_and_refuses_others():
    cache = PagedCache(8, 4, device="meta")
    cache.batch = [cache.add_sequence([1, 2, 3, 4, 5, 6])]
    positions = cache.begin_step(6)
    _, _, slots, _ = cache._step
    assert positions.device.type == "meta" and slots.device.type == "meta", (
        "positions make the attention mask and slots index the pool: both on the cache's device"
    )
    k = torch.zeros(1, 1, 6, 8)
    with pytest.raises(ValueError, match="built for meta"):
        cache.layer(0).update(k, k)


def test_swapped_blocks_go_to_host_memory(model):
    cache = PagedCache(8, 4)
    cache.batch = [sid := cache.add_sequence([1, 2, 3, 4, 5, 6])]
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache=cache)
    before = [x[cache.block_table(sid)].clone() for x in cache._layers[0]]
    swapped = cache.swap_out(sid)
    assert all(y.device.type == "cpu" for pair in swapped["blocks"].values() for y in pair)
    back = cache.swap_in(swapped)
    assert all(torch.equal(x[cache.block_table(back)], y) for x, y in zip(cache._layers[0], before))
