"""Grader of lab 09: a paged KV cache — block pool, prefix sharing, block tables, the paged read.

Graded, each task on its own (:func:`~._lab09_invariants.only_task` runs the learner's given
``PagedCache`` with course_lib's code for the other tasks, so a mistake costs its own task's row):

* Task 1, the pool: allocation hands out free blocks and raises NoFreeBlocks when none is left,
  a double release raises RuntimeError (the type the lab states), the least recently freed cached
  block is evicted first, and only blocks at count 0 ever are; a hit on a free cached block revives
  it; and over a seeded random run of calls, in lockstep with course_lib's pool, the invariants of
  the ``BlockPool`` docstring after every call (counts, free list = blocks at count 0, no block both
  free and in use, prefix map and block hashes agreeing, eviction dropping the hash);
* Task 2, prefix sharing: the chained hash (32 bytes of sha256, a function of the whole prefix), the
  blocks that become full registered, a shared prompt prefix allocated once and found again after
  its sequences are freed;
* Task 3, block tables: slots from positions, the model's greedy tokens through the learner's cache
  equal to decoding without a cache (prefix caching off: Task 2 is not needed), a table only as long
  as its tokens need, and copy-on-write after a fork — the writer's private copy with the shared
  block's contents, the other table and the shared block untouched, the counts moved;
* Task 4, the paged read: ``gather_blocks`` against a loop over the table, exactly (a gather copies);
* Tasks 1-3 and all of it together (their ``needs`` name the tasks' own rows, so a failure there
  blames the task that fails its row): a seeded random stream of admit / extend / fork / free that
  never breaks the invariants, and the course's engine (continuous batching with preemption) serving
  a request stream from the learner's cache with the tokens of decoding without a cache and under
  4% waste.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`:
the grader passes the learner's ``paged_cache.py``; tests/grading/test_lab_checks.py passes
course_lib.inference.paged, and tests/inference/test_paged_cache.py uses :func:`fake_step` and
:func:`check_invariants` on the library's cache directly.
"""

import random
from pathlib import Path

import torch

from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab09_invariants import (
    check_copy_on_write,
    check_invariants,
    check_pool_invariants,
    fake_step,
    only_task,
)
from course_lib.inference.engine import Engine, Request
from course_lib.inference.generate import generate
from course_lib.model.configs import get
from course_lib.model.transformer import Transformer

ROLES = ("block_hash", "slot_mapping", "gather_blocks", "BlockPool", "PagedCache")
# Every check runs in the grader's own process, not on ranks: on the host, where the tiny model, the learner's
# cache (built without a device: the CPU) and the drawn prompts give the same numbers on every machine.
GRADER = torch.device("cpu")
__all__ = ["ROLES", "TASKS", "adapter", "check_copy_on_write", "check_invariants", "check_pool_invariants", "fake_step"]


def adapter(lab_dir: Path) -> Adapter:
    """The learner's pool, cache and functions, from ``paged_cache.py``."""
    return Adapter.of_file(Path(lab_dir) / "paged_cache.py", ROLES)


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
    for name in (*ROLES, "NoFreeBlocks", "cached_prefix", "register_full_blocks", "grow_table"):
        assert getattr(module, name, None) is not None, f"paged_cache.py must define {name}"


def check_pool(impl: Adapter) -> None:
    """The pool's contract call by call: fresh blocks at count 1, NoFreeBlocks on an empty pool, a
    double release refused with RuntimeError, LRU order of the free list, eviction of the least
    recently freed cached block (its hash dropped, counted), a hit reviving a free block and adding a
    reference to a block in use, a miss None, and never a block in use evicted."""
    pool = impl["BlockPool"](3, 2)
    no_free = impl.module("BlockPool").NoFreeBlocks
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.ref_count == [1, 1, 1], (
        f"three allocations from a pool of 3 must give blocks 0, 1, 2 at count 1; got {blocks}, counts {pool.ref_count}"
    )
    raises(no_free, pool.allocate, what="allocate() on a pool with no free block")
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]) * 32)
    pool.release(blocks[2])
    pool.release(blocks[0])
    assert list(pool.free) == [blocks[2], blocks[0]], (
        f"after release({blocks[2]}) then release({blocks[0]}), the free list is {list(pool.free)}: a block whose "
        f"count reaches 0 joins the free list's end (least recently freed first): {[blocks[2], blocks[0]]}"
    )
    raises(RuntimeError, pool.release, blocks[0], what="releasing a block whose count is already 0 (a double release)")
    assert pool.ref_count[blocks[0]] == 0 and list(pool.free) == [blocks[2], blocks[0]], (
        "a refused double release must leave the pool as it was (count 0, the free list unchanged)"
    )
    assert pool.allocate() == blocks[2], "allocate() must take the least recently freed block"
    assert bytes([2]) * 32 not in pool.cached and pool.evictions == 1, (
        "taking a free block that holds a cached prefix evicts it: drop its hash from `cached` and count it"
    )
    assert pool.lookup(bytes([0]) * 32) == blocks[0] and blocks[0] not in pool.free, (
        "a hit on a free cached block takes it out of the free list (it is in use again) with count 1"
    )
    assert pool.lookup(bytes([1]) * 32) == blocks[1] and pool.ref_count[blocks[1]] == 2, (
        f"a hit on a block in use (count 1) adds a reference: count 2, got {pool.ref_count[blocks[1]]}"
    )
    assert pool.lookup(b"unknown" * 4) is None, "a miss returns None"
    assert pool.ref_count == [c + (b == blocks[1]) for b, c in enumerate([1, 1, 1])], (
        f"counts {pool.ref_count}: allocate sets 1, a hit adds 1"
    )
    raises(no_free, pool.allocate, what="allocate() when every block is in use (eviction takes only blocks at count 0)")


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
    """The learner's block_hash, cached_prefix and register_full_blocks (course_lib's pool, tables and
    read): the blocks that became full are registered under their chained hashes, a second prompt
    reuses a shared prefix's full blocks, freed blocks are hit again, and a fully cached prompt still
    computes its last token."""
    block_hash = impl["block_hash"]
    with only_task(impl, 2) as make:
        cache = make(16, 4)
        prefix = list(range(10))  # two full blocks and two tokens
        a = cache.add_sequence(prefix + [20, 21])
        fake_step(cache, [a], 10)
        table, keys = cache.block_table(a), [block_hash(None, prefix[:4])]
        keys.append(block_hash(keys[0], prefix[4:8]))
        registered = {cache.pool.cached.get(k) for k in keys}
        assert registered == set(table[:2]) and len(cache.pool.cached) == 2, (
            f"after 10 tokens in blocks of 4, blocks {table[:2]} are full and must be registered under their "
            f"chained hashes (block_hash(previous hash, tokens)), and only they: the prefix map sends those hashes "
            f"to {[cache.pool.cached.get(k) for k in keys]} and holds {len(cache.pool.cached)} hashes"
        )
        fake_step(cache, [a], 2)
        b = cache.add_sequence(prefix + [30, 31, 32])
        assert cache.num_computed(b) == 8 and cache.block_table(b)[:2] == cache.block_table(a)[:2], (
            f"a second prompt sharing 10 tokens (2 full blocks of 4) must reuse both blocks: computed "
            f"{cache.num_computed(b)}, tables {cache.block_table(a)} and {cache.block_table(b)}"
        )
        fake_step(cache, [b], 5)
        check_invariants(cache, block_hash)
        assert cache.hit_tokens == 8 and cache.prefix_hit_rate() == 8 / 25, (
            f"cached_prefix found {cache.hit_tokens} of 25 prompt tokens; 8 expected"
        )
        cache.free_sequence(a)
        cache.free_sequence(b)
        c = cache.add_sequence(prefix + [40])
        assert cache.num_computed(c) == 8, "freed blocks keep their contents and hash: the prefix must hit again"
        full = cache.add_sequence(list(range(8)))
        assert cache.num_computed(full) == 4, (
            "a prompt of exactly 2 cached blocks reuses only the first: its last token must be computed for its logits"
        )


def check_block_table(impl: Adapter) -> None:
    """The learner's slot_mapping, then the model's greedy tokens through a cache whose tables the
    learner's grow_table builds (course_lib's pool and read, no prefix caching): equal to decoding
    without a cache, for prompts of 1, 8 (one full block) and 13 tokens."""
    slot_mapping = impl["slot_mapping"]
    positions = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], device=GRADER)
    got = slot_mapping([[7, 2], [3, 0, 5]], positions, 4)
    want = torch.tensor([[28, 29, 30, 31, 8], [1, 2, 3, 20, 21]], device=GRADER)
    assert torch.equal(got, want), (
        f"slot = table[p // block_size] * block_size + p % block_size: want {want}, got {got}"
    )
    model = _model(128)
    g = torch.Generator(device=GRADER).manual_seed(0)
    with only_task(impl, 3) as make:
        cache = make(64, 8, prefix_caching=False)
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


TASKS_1_TO_3 = (check_pool, check_pool_invariants, check_hash, check_prefix_sharing, check_block_table)
TASKS = [
    Task("paged_cache.py imports and defines the classes and functions", 1, check_setup, setup=True),
    Task("Task 1: allocate, release, LRU eviction of free cached blocks, hits", 3, check_pool),
    Task("Task 1: the pool's invariants after every call of a random run", 2, check_pool_invariants),
    Task("Task 2: the chained sha256 block hash", 1, check_hash),
    Task("Task 2: full blocks registered, a shared prefix allocated once and found again", 2, check_prefix_sharing),
    Task("Task 3: slots; tokens through your cache == no cache", 2, check_block_table, timeout=120),
    Task("Task 3: tables grow as needed; copy-on-write after a fork", 2, check_copy_on_write),
    Task("Task 4: the paged read", 2, check_paged_read),
    Task(
        "Tasks 1-3: a random admit/extend/fork/free stream keeps every invariant",
        2,
        check_random_stream,
        needs=(*TASKS_1_TO_3, check_copy_on_write, check_paged_read),
    ),
    Task(
        "All: the engine on your cache, tokens == no cache, waste < 4%",
        2,
        check_engine,
        timeout=240,
        needs=(*TASKS_1_TO_3, check_copy_on_write, check_paged_read),
    ),
]
