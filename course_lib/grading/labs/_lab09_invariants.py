"""Lab 09's invariants: of the block pool (Task 1) and of copy-on-write (Task 3), each failing in its own task.

The rest of lab 09's grader lives in lab09_kv_cache.py. Here:

* :func:`only_task` — the learner's (given) ``PagedCache`` with course_lib's version of every task
  but one: course_lib's ``BlockPool`` (Task 1), ``PagedCache._reserve`` (growing the table, Task 3),
  ``slot_mapping`` (Task 3) and ``gather_blocks`` (Task 4). The lab's given cache and course_lib's
  share their state (``pool``, ``_layers``, each sequence's ``blocks`` and ``num_computed``), so a
  task's check grades that task's code alone: a wrong ``gather_blocks`` cannot fail Task 2's row.
* :func:`fake_step` and :func:`check_invariants` — a step with (token id, position) for K and V,
  and the invariants of a whole cache (tests/inference/test_paged_cache.py uses both on course_lib's cache);
* :func:`check_pool_invariants` — the learner's pool and course_lib's in lockstep over a seeded
  random run of allocate / release / lookup / share / register, the pool's invariants after each;
* :func:`check_copy_on_write` — a fork, then each sequence's write, one at a time, with what each
  write must and must not change.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from types import MethodType

import torch

from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.inference import paged as course

# the functions of other tasks that the given PagedCache calls through the module, by task
MODULE_FUNCTIONS = {3: ("slot_mapping",), 4: ("gather_blocks",)}


@contextmanager
def only_task(impl: Adapter, task: int):
    """Yield ``make(num_blocks, block_size, prefix_caching)``: the learner's PagedCache running the
    learner's code of ``task`` only, course_lib's for the others (Task 2's code runs only with
    prefix caching on: Tasks 1, 3 and 4 are graded with it off)."""
    module = impl.module("PagedCache")
    saved = {}
    for t, names in MODULE_FUNCTIONS.items():
        for name in names if t != task else ():
            saved[name] = getattr(module, name, None)
            setattr(module, name, getattr(course, name))

    def make(num_blocks: int, block_size: int, prefix_caching: bool = True):
        cache = impl["PagedCache"](num_blocks, block_size, prefix_caching=prefix_caching)
        if task != 1:
            cache.pool = course.BlockPool(num_blocks, block_size)
        if task != 3:
            cache._reserve = MethodType(course.PagedCache._reserve, cache)
        return cache

    try:
        yield make
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


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


# ------------------------------------------------------------------------------ Task 1: the pool's invariants


def _pool_invariant_broken(pool) -> str | None:
    """The first invariant of the BlockPool docstring that ``pool`` breaks, in the task's words."""
    counts, free = list(pool.ref_count), list(pool.free)
    for b, c in enumerate(counts):
        if c < 0:
            return f"block {b}'s count is {c}: a count never goes below 0"
    for b in free:
        if counts[b] > 0:
            return (
                f"block {b} is in the free list with count {counts[b]}: a block in use must never be free "
                "(allocate would hand it to a second sequence)"
            )
    for b, c in enumerate(counts):
        if c == 0 and b not in pool.free:
            return f"block {b} has count 0 but is not in the free list: no allocate can ever take it again"
    for key, b in pool.cached.items():
        if pool.hash_of[b] != key:
            return f"the prefix map sends a hash to block {b}, whose hash_of is another: the two must agree"
    for b, key in enumerate(pool.hash_of):
        if key is not None and pool.cached.get(key) != b:
            return (
                f"block {b} still carries a hash (hash_of[{b}]) that the prefix map no longer sends to it: "
                "an eviction clears both cached[hash] and hash_of[block]"
            )
    return None


def _pool_differs(got, want) -> str | None:
    """What the learner's pool ``got`` does otherwise than course_lib's ``want`` after the same calls."""
    for b, (g, w) in enumerate(zip(got.ref_count, want.ref_count)):
        if g != w:
            return (
                f"block {b}'s count is {g}, expected {w}: allocate sets 1, a lookup hit and share add 1, release "
                "takes 1"
            )
    if list(got.free) != list(want.free):
        return (
            f"the free list is {list(got.free)}, expected {list(want.free)}: least recently freed first (release "
            "appends a block at count 0 to the end, allocate takes the first)"
        )
    if got.cached != want.cached:
        return (
            f"the prefix map holds {len(got.cached)} hashes, expected {len(want.cached)}: release keeps a block's "
            "hash, allocate evicts the hash of the block it takes"
        )
    if got.evictions != want.evictions:
        return f"evictions is {got.evictions}, expected {want.evictions}: count each hash allocate evicts"
    return None


# the mix of a random run: at seed 0, its 300 calls make ~45 lookup hits (9 on free blocks), ~20 evictions and
# ~18 allocations from an empty pool, so every rule of the pool is exercised several times
OPS = ["allocate"] * 3 + ["release"] * 3 + ["lookup"] * 3 + ["share"] + ["register"] * 2


def check_pool_invariants(impl: Adapter) -> None:
    """300 seeded random calls on the learner's BlockPool and course_lib's in lockstep (5 blocks, so the
    pool runs dry and evicts often): after each call, the invariants of the BlockPool docstring hold
    and the learner's pool returns and holds what course_lib's does."""
    rng = random.Random(0)
    mine, ref = impl["BlockPool"](5, 2), course.BlockPool(5, 2)
    no_free = impl.module("BlockPool").NoFreeBlocks
    held: list[int] = []  # one entry per reference handed out
    keys: list[bytes] = []  # every hash ever registered (some evicted since)
    done: list[str] = []
    for n in range(300):
        op = "release" if len(held) > 6 else rng.choice(OPS)  # a bounded number of references: the pool refills
        if op == "allocate" and not ref.free:
            raises(no_free, mine.allocate, what="allocate() on a pool whose blocks are all in use")
            done.append("allocate() -> NoFreeBlocks")
        elif op == "allocate":
            got, want = mine.allocate(), ref.allocate()
            done.append(f"allocate() -> {got}")
            assert got == want, (
                f"after {'; '.join(done[-4:])}: allocate() must take the least recently freed block, {want}"
            )
            held.append(want)
        elif op == "release" and held:
            block = held.pop(rng.randrange(len(held)))
            mine.release(block), ref.release(block)
            done.append(f"release({block})")
        elif op == "lookup" and keys:
            revive = sorted(k for k, b in ref.cached.items() if ref.ref_count[b] == 0)  # hits on free blocks
            r = rng.random()
            if revive and r < 0.5:
                key = rng.choice(revive)
            else:
                key = rng.choice(sorted(ref.cached) if ref.cached and r < 0.8 else keys + [b"miss" * 8])
            got, want = mine.lookup(key), ref.lookup(key)
            done.append(f"lookup(hash {keys.index(key) if key in keys else 'never registered'}) -> {got}")
            assert got == want, (
                f"after {'; '.join(done[-4:])}: the lookup must return {want} (the block registered under the "
                "hash, or None once it is evicted or never was)"
            )
            if want is not None:
                held.append(want)
        elif op == "share" and held:
            block = rng.choice(held)
            mine.share(block), ref.share(block)
            held.append(block)
            done.append(f"share({block})")
        elif op == "register" and [b for b in held if ref.hash_of[b] is None]:
            block, key = rng.choice([b for b in held if ref.hash_of[b] is None]), bytes([n % 256]) * 32
            mine.register(block, key), ref.register(block, key)
            keys.append(key)
            done.append(f"register({block}, hash {len(keys) - 1})")
        else:
            continue
        problem = _pool_invariant_broken(mine) or _pool_differs(mine, ref)
        assert problem is None, f"after {'; '.join(done[-4:])}: {problem}"


# ------------------------------------------------------------------------------ Task 3: copy-on-write


def _contents(cache) -> list[torch.Tensor]:
    return [x.clone() for pair in cache._layers.values() for x in pair]


def check_copy_on_write(impl: Adapter) -> None:
    """A table takes only the blocks its tokens need; after a fork, the first sequence to write into a
    shared, partly full block gets a private copy of it (same contents, in every layer's K and V) in
    its own table, the other table and the shared block's contents stay as they were, and the counts
    move (shared block - 1, copy 1); the full blocks before it stay shared; a block one table holds is
    written in place; a fork at a block boundary copies nothing."""
    with only_task(impl, 3) as make:
        cache = make(16, 8, prefix_caching=False)
        sid = cache.add_sequence(list(range(9)))
        for n, want in ((8, 1), (9, 2), (16, 2), (17, 3)):
            cache.reserve(sid, n)
            got = len(cache.block_table(sid))
            assert got == want, (
                f"room for {n} tokens in blocks of 8 takes {want} blocks; your table has {got}: append blocks "
                "only until len(blocks) · block_size ≥ n_tokens"
            )
        cache.free_sequence(sid)

        cache = make(16, 8, prefix_caching=False)
        parent = cache.add_sequence(list(range(10)))
        fake_step(cache, [parent], 10)
        child = cache.fork(parent)
        (full, shared), before = cache.block_table(parent), _contents(cache)
        cache.append_token(parent, 5)
        cache.append_token(child, 50)
        cache.reserve(child, 11)  # the child writes first: position 10 goes into the shared block
        table, count = cache.block_table(child), cache.pool.ref_count
        assert table[1] != shared, (
            f"the child's next token goes into block {shared}, which the parent holds too (count 2): copy-on-write "
            f"must put a private copy in the child's table first; its table is still {table}"
        )
        private = table[1]
        assert table[0] == full, (
            f"only the block that takes the next token is copied; the full block {full} before it stays shared, "
            f"but the child's table became {table}"
        )
        assert cache.block_table(parent) == [full, shared], (
            f"copy-on-write changes the writer's table only; the parent's table changed from {[full, shared]} "
            f"to {cache.block_table(parent)}"
        )
        after = _contents(cache)
        assert all(torch.equal(x[shared], y[shared]) for x, y in zip(after, before)), (
            f"copy-on-write changed the contents of the shared block {shared}: copy from it into the new block, "
            "not the other way round"
        )
        assert all(torch.equal(x[private], y[shared]) for x, y in zip(after, before)), (
            f"the private copy {private} must start with the contents of the shared block {shared} (positions 8 "
            "and 9) in every layer's K and V store: copy them before the write"
        )
        assert (count[full], count[shared], count[private]) == (2, 1, 1), (
            f"after the copy: block {full} is held by 2 tables, {shared} by the parent alone, the copy {private} "
            f"by the child; their counts must be 2, 1, 1, are {count[full]}, {count[shared]}, {count[private]} "
            "(the writer releases its reference to the shared block)"
        )
        assert cache.cow_copies == 1, "grow_table must return True when it copied a block (the cache counts copies)"
        cache.reserve(parent, 11)  # the parent now holds its block alone: it writes in place
        assert cache.block_table(parent) == [full, shared] and cache.cow_copies == 1, (
            f"block {shared} is the parent's alone now (count 1): write it in place, no copy; the parent's table "
            f"became {cache.block_table(parent)}"
        )
        fake_step(cache, [parent, child], 1)  # each reads back its own tokens

        cache = make(16, 8, prefix_caching=False)
        parent = cache.add_sequence(list(range(8)))
        fake_step(cache, [parent], 8)
        child = cache.fork(parent)
        cache.append_token(child, 50)
        cache.reserve(child, 9)
        table = cache.block_table(child)
        assert table[0] == cache.block_table(parent)[0] and cache.cow_copies == 0, (
            f"after a fork at 8 tokens (one full block of 8), the next token goes into a new block: the full "
            f"block stays shared, nothing to copy; the child's table became {table}"
        )
