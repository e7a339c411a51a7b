"""Grader of lab 09: a paged KV cache — block pool, prefix sharing, block tables, the paged read.

Graded:

* Task 1, the pool: allocation hands out free blocks and raises NoFreeBlocks when none is left,
  release refuses a block that is already free, the least recently freed cached block is evicted
  first, and only blocks at count 0 ever are; a hit on a free cached block revives it;
* Task 2, prefix sharing: the chained hash (32 bytes of sha256, a function of the whole prefix), a
  shared prompt prefix allocated once and found again after its sequences are freed;
* Task 3, block tables: slots from positions, the model's greedy tokens through the learner's cache
  equal to decoding without a cache, copy-on-write after a fork (prefix caching off, so that Task 2
  is not needed here);
* Task 4, the paged read: ``gather_blocks`` against a loop over the table, exactly (a gather copies);
* all of it together: a seeded random stream of admit / extend / fork / free that never breaks the
  invariants, and the course's engine (continuous batching with preemption) serving a request stream
  from the learner's cache with the tokens of decoding without a cache and under 4% waste.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`:
the grader passes the learner's ``paged_cache.py``; tests/test_lab_checks.py passes
course_lib.inference.paged, and tests/test_paged_cache.py uses :func:`fake_step` and
:func:`check_invariants` on the library's cache directly.
"""

import random
from pathlib import Path

import torch

from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.inference.engine import Engine, Request
from course_lib.inference.generate import generate
from course_lib.model.config import get
from course_lib.model.transformer import Transformer

ROLES = ("block_hash", "slot_mapping", "gather_blocks", "BlockPool", "PagedCache")
# Every check runs in the grader's own process, not on ranks: on the host, where the tiny model, the learner's
# cache (built without a device: the CPU) and the drawn prompts give the same numbers on every machine.
GRADER = torch.device("cpu")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's pool, cache and functions, from ``paged_cache.py``."""
    return Adapter.of_file(Path(lab_dir) / "paged_cache.py", ROLES)


def fake_step(cache, sids: list[int], t: int) -> None:
    """Compute t more tokens of each sequence with (token id, position) standing in for K and V, and
    check that every sequence reads back exactly its own tokens at their positions."""
    cache.batch = list(sids)
    positions = cache.begin_step(t)
    rows = [cache.tokens(s)[p0 : p0 + t] for s, p0 in zip(sids, positions[:, 0].tolist())]
    tokens = torch.tensor(rows, device=positions.device)
    kv = torch.stack([tokens.float(), positions.float()], dim=-1)[:, None]  # [b, heads=1, t, 2]
    k_all, v_all, _ = cache.layer(0).update(kv, kv)
    cache.end_step()
    for row, sid in enumerate(sids):
        n = cache.num_computed(sid)
        ids, at = torch.tensor(cache.tokens(sid)[:n], device=k_all.device), torch.arange(n, device=k_all.device)
        want = torch.stack([ids.float(), at.float()], -1)
        assert torch.equal(k_all[row, 0, :n], want) and torch.equal(v_all[row, 0, :n], want), (
            f"sequence {sid} reads back other tokens than its own: a block was overwritten, evicted while in "
            f"use, or shared without copy-on-write"
        )


def check_invariants(cache, block_hash) -> None:
    """Counts equal the block tables' references; the free list is exactly the blocks at count 0; the
    cached map and each block's hash agree; every full block's hash chains over its whole prefix."""
    pool = cache.pool
    holders = [0] * pool.num_blocks
    for seq in cache.seqs.values():
        for block in seq.blocks:
            holders[block] += 1
    assert pool.ref_count == holders, "reference counts differ from the number of block tables holding each block"
    assert set(pool.free) == {b for b, c in enumerate(pool.ref_count) if c == 0}, (
        "the free list must hold exactly the blocks whose count is 0"
    )
    for key, block in pool.cached.items():
        assert pool.hash_of[block] == key, f"the prefix cache maps a hash to block {block}, which carries another"
    for sid, seq in cache.seqs.items():
        assert len(seq.blocks) * cache.block_size >= seq.num_computed, f"sequence {sid} has tokens beyond its blocks"
        parent = None
        for i, key in enumerate(seq.hashes):
            parent = block_hash(parent, seq.tokens[i * cache.block_size : (i + 1) * cache.block_size])
            assert key == parent, f"sequence {sid}: block {i}'s hash is not the chained hash of its prefix"


def _model(max_seq_len: int = 512) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get("tiny", max_seq_len=max_seq_len)).eval()


def _no_cache(model, requests) -> list[list[int]]:
    device = next(model.parameters()).device
    return [
        generate(model, torch.tensor(r.prompt, device=device), r.max_new_tokens)[len(r.prompt) :].tolist()
        for r in requests
    ]


def _workload(n, seed, prompt, new) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(60) for _ in range(rng.randint(*prompt))], rng.randint(*new)) for _ in range(n)]


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("PagedCache")
    for name in (*ROLES, "NoFreeBlocks"):
        assert getattr(module, name, None) is not None, f"paged_cache.py must define {name}"


def check_pool(impl: Adapter) -> None:
    pool = impl["BlockPool"](3, 2)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.ref_count == [1, 1, 1], (
        f"three allocations from a pool of 3 must give blocks 0, 1, 2 at count 1; got {blocks}, counts {pool.ref_count}"
    )
    try:
        pool.allocate()
    except RuntimeError as err:
        assert type(err).__name__ == "NoFreeBlocks", f"an empty pool must raise NoFreeBlocks, raised {err!r}"
    else:
        raise AssertionError("allocate() on a pool with no free block must raise NoFreeBlocks")
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]) * 32)
    pool.release(blocks[2])
    pool.release(blocks[0])
    assert list(pool.free) == [blocks[2], blocks[0]], "a released block joins the free list's end (least recent first)"
    try:
        pool.release(blocks[0])
    except RuntimeError:
        pass
    else:
        raise AssertionError("releasing a block whose count is already 0 must raise: the blocks were freed twice")
    assert pool.allocate() == blocks[2], "allocate() must take the least recently freed block"
    assert bytes([2]) * 32 not in pool.cached and pool.evictions == 1, (
        "taking a free block that holds a cached prefix evicts it: drop its hash from `cached` and count it"
    )
    assert pool.lookup(bytes([0]) * 32) == blocks[0] and blocks[0] not in pool.free, (
        "a hit on a free cached block takes it out of the free list (it is in use again) with count 1"
    )
    assert pool.lookup(b"unknown" * 4) is None, "a miss returns None"
    assert pool.ref_count == [1, 1, 1]
    try:
        pool.allocate()
    except RuntimeError:
        pass
    else:
        raise AssertionError("eviction must never take a block in use: every block has count 1 here")


def check_hash(impl: Adapter) -> None:
    block_hash = impl["block_hash"]
    block = [1, 2, 3, 4]
    h = block_hash(None, block)
    assert isinstance(h, bytes) and len(h) == 32, f"a sha256 digest is 32 bytes; got {h!r}"
    assert block_hash(None, list(block)) == h, "the hash must be a function of its arguments (no salt per call)"
    assert block_hash(None, [1, 2, 3, 5]) != h
    assert block_hash(block_hash(None, [9, 9, 9, 9]), block) != block_hash(block_hash(None, [8, 9, 9, 9]), block), (
        "the same tokens after different prefixes must hash differently: chain the parent block's hash in"
    )
    assert block_hash(None, [256]) != block_hash(None, [1, 0]), "hash the token ids, not bytes that collide"


def check_prefix_sharing(impl: Adapter) -> None:
    cache = impl["PagedCache"](16, 4)
    prefix = list(range(10))  # two full blocks and two tokens
    a = cache.add_sequence(prefix + [20, 21])
    fake_step(cache, [a], 12)
    b = cache.add_sequence(prefix + [30, 31, 32])
    assert cache.num_computed(b) == 8 and cache.block_table(b)[:2] == cache.block_table(a)[:2], (
        f"a second prompt sharing 10 tokens (2 full blocks of 4) must reuse both blocks: computed "
        f"{cache.num_computed(b)}, tables {cache.block_table(a)} and {cache.block_table(b)}"
    )
    fake_step(cache, [b], 5)
    check_invariants(cache, impl["block_hash"])
    assert cache.hit_tokens == 8 and cache.prefix_hit_rate() == 8 / 25
    cache.free_sequence(a)
    cache.free_sequence(b)
    c = cache.add_sequence(prefix + [40])
    assert cache.num_computed(c) == 8, "freed blocks keep their contents and hash: the prefix must hit again"
    full = cache.add_sequence(list(range(8)))
    assert cache.num_computed(full) == 4, (
        "a prompt of exactly 2 cached blocks reuses only the first: its last token must be computed for its logits"
    )


def check_block_table(impl: Adapter) -> None:
    slot_mapping = impl["slot_mapping"]
    positions = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], device=GRADER)
    got = slot_mapping([[7, 2], [3, 0, 5]], positions, 4)
    want = torch.tensor([[28, 29, 30, 31, 8], [1, 2, 3, 20, 21]], device=GRADER)
    assert torch.equal(got, want), (
        f"slot = table[p // block_size] * block_size + p % block_size: want {want}, got {got}"
    )
    # the model through the learner's cache (no prefix caching: this task needs only Tasks 1 and 3)
    model = _model(128)
    cache = impl["PagedCache"](64, 8, prefix_caching=False)
    g = torch.Generator(device=GRADER).manual_seed(0)
    for length in (1, 8, 13):
        prompt = torch.randint(0, 60, (length,), generator=g, device=GRADER)
        want = generate(model, prompt, 20)[length:].tolist()
        sid = cache.add_sequence(prompt.tolist())
        cache.batch = [sid]
        out = []
        with torch.no_grad():
            logits = model(prompt[None], cache=cache)[:, -1]
            for _ in range(20):
                out.append(int(logits.argmax()))
                cache.append_token(sid, out[-1])
                logits = model(torch.tensor([[out[-1]]], device=GRADER), cache=cache)[:, -1]
        assert out == want, f"prompt of {length}: greedy tokens through your cache differ from decoding without one"
        cache.free_sequence(sid)
    # copy-on-write: fork after a 10-token prompt (blocks of 8: the second block is shared, partly full)
    cache = impl["PagedCache"](16, 8, prefix_caching=False)  # fresh: fake_step stores [1 head, 2] per token
    parent = cache.add_sequence(list(range(10)))
    fake_step(cache, [parent], 10)
    child = cache.fork(parent)
    cache.append_token(parent, 5)
    cache.append_token(child, 50)
    fake_step(cache, [parent, child], 1)  # reads back each sequence: fails if one wrote into the other's block
    assert cache.block_table(parent)[0] == cache.block_table(child)[0], "the full first block stays shared"
    assert cache.block_table(parent)[1] != cache.block_table(child)[1], "the written block must be copied first"
    check_invariants(cache, impl["block_hash"])


def check_paged_read(impl: Adapter) -> None:
    g = torch.Generator(device=GRADER).manual_seed(0)
    store = torch.randn(10, 4, 2, 3, generator=g, device=GRADER)  # 10 blocks of 4 slots, 2 heads of width 3
    tables = [[3, 7], [1], [9, 0, 4]]
    got = impl["gather_blocks"](store, tables)
    assert tuple(got.shape) == (3, 2, 12, 3), (
        f"want [batch, heads, longest table x block_size, dim], got {tuple(got.shape)}"
    )
    for s, table in enumerate(tables):
        for j, block in enumerate(table):
            assert torch.equal(got[s, :, 4 * j : 4 * j + 4], store[block].transpose(0, 1)), (
                f"sequence {s}: positions {4 * j}..{4 * j + 3} must come from block {block} (its table's entry {j})"
            )
    assert torch.isfinite(got).all(), "padding must be finite: masked weights of 0 times NaN are NaN"


def check_random_stream(impl: Adapter) -> None:
    """400 seeded random operations on a 12-block pool with a 2-symbol alphabet (prefixes repeat)."""
    rng = random.Random(0)
    cache = impl["PagedCache"](12, 4)
    for _ in range(400):
        op = rng.choice(["admit", "extend", "fork", "free"] if cache.seqs else ["admit"])
        if op == "admit":
            sid = cache.add_sequence([rng.randrange(2) for _ in range(rng.randint(1, 14))])
            rest = len(cache.tokens(sid)) - cache.num_computed(sid)
            if cache.blocks_needed(sid, rest) > cache.pool.num_free:
                cache.free_sequence(sid)
            else:
                fake_step(cache, [sid], rest)
        elif op == "extend":
            sid = rng.choice(sorted(cache.seqs))
            new = [rng.randrange(2) for _ in range(rng.randint(1, 5))]
            if cache.blocks_needed(sid, len(new)) > cache.pool.num_free:
                cache.free_sequence(sid)
            else:
                for token in new:
                    cache.append_token(sid, token)
                fake_step(cache, [sid], len(new))
        elif op == "fork":
            cache.fork(rng.choice(sorted(cache.seqs)))
        else:
            cache.free_sequence(rng.choice(sorted(cache.seqs)))
        check_invariants(cache, impl["block_hash"])


def check_engine(impl: Adapter) -> None:
    model = _model()
    requests = _workload(8, seed=1, prompt=(4, 60), new=(8, 60))
    want = _no_cache(model, requests)
    for blocks in (200, 24):  # 24 blocks of 8: too few for all, the engine preempts
        engine = Engine(model, max_batch=6, cache=impl["PagedCache"](blocks, 8))
        got, stats = engine.run(requests)
        assert got == want, (
            f"the engine on your cache ({blocks} blocks) generated other tokens than decoding without one"
        )
    long = _workload(16, seed=0, prompt=(32, 256), new=(64, 256))
    _, stats = Engine(model, max_batch=8, cache=impl["PagedCache"](600, 16)).run(long)
    assert stats.waste < 0.04, (
        f"the paged cache wasted {stats.waste:.1%} of its slots over the stream; under 4% expected"
    )


TASKS = [
    Task("paged_cache.py imports and defines the classes and functions", 1, check_setup, setup=True),
    Task("Task 1: allocate, release, LRU eviction of free cached blocks, hits", 3, check_pool),
    Task("Task 2: the chained sha256 block hash", 1, check_hash),
    Task("Task 2: a shared prefix allocated once, found again after it is freed", 2, check_prefix_sharing),
    Task("Task 3: slots, tokens through your cache == no cache, copy-on-write", 3, check_block_table, timeout=120),
    Task("Task 4: the paged read", 2, check_paged_read),
    Task("Tasks 1-3: a random admit/extend/fork/free stream keeps every invariant", 2, check_random_stream),
    Task("All: the engine on your cache, tokens == no cache, waste < 4%", 2, check_engine, timeout=240),
]
