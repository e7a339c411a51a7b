"""Lab 09 — a paged KV cache: the block pool, prefix sharing, block tables and the paged read.

You write the parts of PagedAttention (Kwon et al. 2023, §4) that make its memory work. Each task's
code is in one place, in task order; everything outside the task sections is given:

* Task 1 — ``BlockPool.allocate``, ``lookup`` and ``release``: reference counts, an LRU free list
  of blocks that keep their cached prefix, eviction of the least recently freed one, and a double
  release refused with ``RuntimeError``;
* Task 2 — prefix sharing: ``block_hash`` (sha256 of the parent block's hash and this block's
  tokens), ``cached_prefix`` (the blocks of a new prompt already in the cache) and
  ``register_full_blocks`` (make blocks that just became full findable);
* Task 3 — block tables: ``slot_mapping`` (position → slot) and ``grow_table`` (new blocks as a
  sequence grows, copy-on-write when the block it writes next is shared);
* Task 4 — the paged read: ``gather_blocks``, each sequence's K or V in position order from its blocks.

Given, at the end: ``PagedCache``, which calls your functions (the model's side of the cache
protocol, forking, swapping, accounting). README.md has the points; each task is graded on its own
(the grader pairs it with course_lib's version of the other tasks). course_lib/inference/paged.py
is the course's version: write yours first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch

from course_lib.inference.cache import LayerView, check_device


class NoFreeBlocks(RuntimeError):
    """The pool has no free block: the scheduler must preempt a sequence (or wait) before it can grow."""


# ====================================================================================== Task 1: the block pool
# (given: the pool's state, ``num_free``, ``share``, ``register``; yours: ``allocate``, ``lookup``, ``release``)


class BlockPool:
    """``num_blocks`` physical blocks: reference counts, the prefix-cache map and an LRU free list.

    Invariants, true after every call (the grader checks them after each operation):

    * ``ref_count[b]`` is the number of references handed out for block b and never negative;
    * ``free`` holds exactly the blocks whose count is 0 — no block is both free and in use —
      least recently freed first;
    * ``cached[key] == b`` exactly when ``hash_of[b] == key`` (a block's hash and the map agree);
      a free block keeps its hash (its prefix can still be hit) until ``allocate`` evicts it.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that prefix's K/V
        # Free blocks, least recently freed first: the next allocation evicts the first one.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def share(self, block: int) -> None:
        """One more reference to a block in use (a forked sequence's table)."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} is free; only a block in use can be shared")
        self.ref_count[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """Make a full block findable by its chained hash (a second copy of a known prefix stays private)."""
        if key not in self.cached:
            self.cached[key] = block
            self.hash_of[block] = key

    # ------------------------------------------------------------------------ Task 1: your code

    def allocate(self) -> int:
        """A block for new tokens, with count 1: the least recently freed one (the free list's first).

        If it still holds a cached prefix, that prefix is evicted: its hash leaves ``cached`` and
        ``hash_of``, and ``evictions`` counts it. Raises :class:`NoFreeBlocks` when no block is free.
        """
        # BEGIN SOLUTION Task 1: return the free list's first block at count 1, evicting its hash (cached, hash_of, evictions += 1); raise NoFreeBlocks if none is free
        if not self.free:
            raise NoFreeBlocks(
                f"all {self.num_blocks} blocks are in use; free or preempt a sequence, or build the pool with more blocks"
            )
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:  # eviction: the block's cached prefix is forgotten
            del self.cached[old]
            self.hash_of[block] = None
            self.evictions += 1
        self.ref_count[block] = 1
        return block
        # END SOLUTION

    def lookup(self, key: bytes) -> int | None:
        """The block registered under ``key`` with one more reference, or None on a miss.

        A hit on a free block (count 0) takes it out of the free list: it is in use again.
        """
        # BEGIN SOLUTION Task 1: return the block registered under key with one more reference (out of the free list if its count was 0), or None on a miss
        block = self.cached.get(key)
        if block is None:
            return None
        if self.ref_count[block] == 0:
            del self.free[block]  # back in use: no longer evictable
        self.ref_count[block] += 1
        return block
        # END SOLUTION

    def release(self, block: int) -> None:
        """One reference fewer; at 0 the block joins the free list's recent end, contents and hash kept.

        Raises ``RuntimeError`` if the block's count is already 0: the caller released it twice (the
        engine relies on that error to catch a sequence freed twice; a ``ValueError`` is not it).
        """
        # BEGIN SOLUTION Task 1: count - 1, at 0 append the block to the free list's end (hash kept); returns nothing; raise RuntimeError if its count is already 0
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released while free: a sequence's blocks were freed twice")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None
        # END SOLUTION


# ====================================================================================== Task 2: prefix sharing


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """sha256(parent hash ‖ the block's token ids as int64): the key of a full block in the prefix cache.

    ``parent`` is the previous block's hash (``None`` for a sequence's first block), which makes the
    key identify the whole prefix up to and including this block.
    """
    # BEGIN SOLUTION Task 2: return the 32-byte sha256 digest of the parent's hash (a fixed root for None) and the tokens as int64
    digest = hashlib.sha256(parent or b"root")
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()
    # END SOLUTION


def cached_prefix(pool: BlockPool, tokens: Sequence[int], block_size: int) -> tuple[list[int], list[bytes]]:
    """A new prompt's longest run of whole blocks already in the prefix cache, from its first block.

    Block i (tokens i·block_size ... (i+1)·block_size - 1) is looked up under its chained hash with
    ``pool.lookup`` (which takes a reference on a hit); the walk stops at the first miss, and never
    includes the block holding the prompt's last token: that token must be computed, its logits give
    the first new token. Returns (the blocks found, their chained hashes), in order.
    """
    # BEGIN SOLUTION Task 2: return (blocks, hashes): the prompt's whole blocks found by pool.lookup in order, up to the first miss, never the last token's block
    blocks, hashes, parent = [], [], None
    for i in range((len(tokens) - 1) // block_size):
        key = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        block = pool.lookup(key)
        if block is None:
            break
        blocks.append(block)
        hashes.append(key)
        parent = key
    return blocks, hashes
    # END SOLUTION


def register_full_blocks(
    pool: BlockPool,
    tokens: Sequence[int],
    blocks: Sequence[int],
    hashes: Sequence[bytes],
    num_computed: int,
    block_size: int,
) -> list[bytes]:
    """After a step: the chained hashes of the sequence's blocks that have just become full, each registered.

    ``hashes`` holds the hashes of the blocks already full before (blocks 0 ... len(hashes) - 1);
    now ``num_computed`` tokens are computed, so blocks len(hashes) ... num_computed // block_size - 1
    are full too. Each gets ``block_hash(previous block's hash, its tokens)`` and
    ``pool.register(block, key)``. Returns the new hashes, in order (the caller appends them).
    """
    # BEGIN SOLUTION Task 2: return the chained hashes of blocks len(hashes) .. num_computed // block_size - 1, each registered with pool.register
    new, parent = [], hashes[-1] if hashes else None
    for i in range(len(hashes), num_computed // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        pool.register(blocks[i], parent)
        new.append(parent)
    return new
    # END SOLUTION


# ====================================================================================== Task 3: block tables


def slot_mapping(block_tables: Sequence[Sequence[int]], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each (sequence, position): ``block_tables[s][p // block_size] · block_size + p % block_size``.

    ``positions`` is [batch, t]; the result has its shape and indexes the pool viewed as
    [num_blocks · block_size, ...].
    """
    # BEGIN SOLUTION Task 3: return a tensor shaped like positions: table[p // block_size] * block_size + p % block_size for each sequence
    slots = torch.empty_like(positions)
    for s, table in enumerate(block_tables):
        blocks = torch.tensor(table, dtype=torch.long, device=positions.device)[positions[s] // block_size]
        slots[s] = blocks * block_size + positions[s] % block_size
    return slots
    # END SOLUTION


def grow_table(
    pool: BlockPool,
    blocks: list[int],
    num_computed: int,
    n_tokens: int,
    block_size: int,
    stores: Sequence[torch.Tensor],
) -> bool:
    """Make a sequence's block table ``blocks`` (changed in place) hold ``n_tokens`` tokens.

    First, copy-on-write: the next token (position ``num_computed``) goes into block
    ``num_computed // block_size``; if the table has that block and another table shares it (count
    > 1), the writer takes a private copy — a block from ``pool.allocate()``, into which every
    store in ``stores`` (each layer's K and V pool, [num_blocks, block_size, heads, dim]) copies the
    shared block's contents — releases its reference to the shared block, and puts the copy in its
    table. A block only this table holds (count 1) is written in place, and full blocks before it
    stay shared. Then new blocks from ``pool.allocate()`` are appended until
    len(blocks) · block_size ≥ n_tokens (no more). Returns True when it made a copy.
    """
    # BEGIN SOLUTION Task 3: copy-on-write of a shared block that takes the next token (copy its contents, release it, replace the entry), then append blocks until they hold n_tokens; return True if it copied
    first, copied = num_computed // block_size, False
    if first < len(blocks) and pool.ref_count[blocks[first]] > 1:
        shared, private = blocks[first], pool.allocate()
        for x in stores:
            x[private] = x[shared]
        pool.release(shared)
        blocks[first] = private
        copied = True
    while len(blocks) * block_size < n_tokens:
        blocks.append(pool.allocate())
    return copied
    # END SOLUTION


# ====================================================================================== Task 4: the paged read


def gather_blocks(store: torch.Tensor, block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """The paged read: sequence s's K (or V) as [batch, heads, n, dim], from its blocks in table order.

    ``store`` is the pool of one layer, [num_blocks, block_size, heads, dim]. Tables are padded with
    block 0 to the longest, so n = longest table · block_size; column j of row s is position j of
    sequence s, and the padding columns are hidden by the causal mask (their positions are past every
    query). The padding reads real, finite numbers (the pool starts at zero), so a masked weight of 0
    times them stays 0.
    """
    # BEGIN SOLUTION Task 4: return [batch, heads, longest table * block_size, dim]: each row its table's blocks in order, padded with block 0
    width = max(len(table) for table in block_tables)
    rows = [list(table) + [0] * (width - len(table)) for table in block_tables]
    padded = torch.tensor(rows, dtype=torch.long, device=store.device)  # the index lives with the pool
    blocks = store[padded]  # [batch, width, block_size, heads, dim]
    b, _, _, heads, dim = blocks.shape
    return blocks.reshape(b, width * store.shape[1], heads, dim).transpose(1, 2)
    # END SOLUTION


# ====================================================================================== given: the cache
# Everything below is given: it calls your BlockPool (Task 1), cached_prefix and register_full_blocks
# (Task 2), slot_mapping and grow_table (Task 3), and gather_blocks (Task 4).


class _Sequence:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.blocks: list[int] = []  # the block table
        self.hashes: list[bytes] = []  # chained hashes of the full, computed blocks (with prefix caching)
        self.num_computed = 0  # tokens whose K/V are in the cache


class PagedCache:
    """K/V of any number of sequences in one :class:`BlockPool`; the model sees the sequences of ``batch``.

    The caller (:func:`~course_lib.inference.generate.generate`, :class:`~course_lib.inference.engine.Engine`)
    adds sequences, appends the tokens it wants computed, chooses the batch, and runs the model on
    each batch sequence's next t uncomputed tokens; the cache reserves blocks, maps slots and registers
    full blocks for prefix caching. Each layer's pool, [num_blocks, block_size, heads, dim] for K and
    for V, is allocated by its first update, on ``device`` (the model's; the CPU by default), where
    the positions and slots the model's attention meets are made too.
    """

    def __init__(
        self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True, *, device: torch.device | str = "cpu"
    ):
        self.device = torch.device(device)
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.seqs: dict[int, _Sequence] = {}
        self.batch: list[int] = []
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._next_id = 0
        self._step: tuple[int, torch.Tensor, torch.Tensor, list[list[int]]] | None = None
        self.queried_tokens = self.hit_tokens = self.cow_copies = 0

    # ---------------------------------------------------------------- sequences
    def add_sequence(self, tokens: Sequence[int]) -> int:
        """A new sequence; its longest cached prefix (whole blocks) is reused at once. Returns its id."""
        seq = _Sequence(list(tokens))
        if not seq.tokens:
            raise ValueError("a sequence needs at least one token (its prompt)")
        if self.prefix_caching:
            seq.blocks, seq.hashes = cached_prefix(self.pool, seq.tokens, self.block_size)
            seq.num_computed = len(seq.blocks) * self.block_size
            self.queried_tokens += len(seq.tokens)
            self.hit_tokens += seq.num_computed
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = seq
        return sid

    def append_token(self, sid: int, token: int) -> None:
        self.seqs[sid].tokens.append(int(token))

    def tokens(self, sid: int) -> list[int]:
        return list(self.seqs[sid].tokens)

    def num_computed(self, sid: int) -> int:
        return self.seqs[sid].num_computed

    def block_table(self, sid: int) -> list[int]:
        return list(self.seqs[sid].blocks)

    def fork(self, sid: int) -> int:
        """A child that shares every block of ``sid`` (parallel sampling); writes copy on demand."""
        parent = self.seqs[sid]
        child = _Sequence(list(parent.tokens))
        child.blocks, child.hashes, child.num_computed = list(parent.blocks), list(parent.hashes), parent.num_computed
        for block in child.blocks:
            self.pool.share(block)
        cid = self._next_id
        self._next_id += 1
        self.seqs[cid] = child
        return cid

    def free_sequence(self, sid: int) -> None:
        """Release a finished (or preempted) sequence's blocks, last block first: the LRU list then
        evicts a prefix's tail before its head, which more requests share."""
        seq = self.seqs.pop(sid)
        for block in reversed(seq.blocks):
            self.pool.release(block)
        if sid in self.batch:
            self.batch.remove(sid)

    def blocks_needed(self, sid: int, t: int) -> int:
        """Fresh blocks that computing ``t`` more tokens of ``sid`` takes (new blocks + a copy-on-write)."""
        seq, bs = self.seqs[sid], self.block_size
        need = max(0, -(-(seq.num_computed + t) // bs) - len(seq.blocks))
        first = seq.num_computed // bs
        if first < len(seq.blocks) and self.pool.ref_count[seq.blocks[first]] > 1:
            need += 1
        return need

    # ---------------------------------------------------------------- the model's side
    def begin_step(self, t: int) -> torch.Tensor:
        if not self.batch:
            raise ValueError("no sequence in the batch: set cache.batch = [sequence ids] before running the model")
        tables, positions = [], []
        for sid in self.batch:
            seq = self.seqs[sid]
            if seq.num_computed + t > len(seq.tokens):
                raise ValueError(
                    f"sequence {sid} has {len(seq.tokens) - seq.num_computed} uncomputed tokens, the step asks "
                    f"for {t}: append the tokens (append_token) before running the model on them"
                )
            self._reserve(seq, seq.num_computed + t)
            tables.append(seq.blocks)
            positions.append(torch.arange(seq.num_computed, seq.num_computed + t, device=self.device))
        positions = torch.stack(positions)
        self._step = (t, positions, slot_mapping(tables, positions, self.block_size), tables)
        return positions

    def reserve(self, sid: int, n_tokens: int) -> None:
        """Make room for ``n_tokens`` tokens of ``sid`` now (an allocator that reserves up front)."""
        self._reserve(self.seqs[sid], n_tokens)

    def _reserve(self, seq: _Sequence, n_tokens: int) -> None:
        stores = [x for pair in self._layers.values() for x in pair]
        if grow_table(self.pool, seq.blocks, seq.num_computed, n_tokens, self.block_size, stores):
            self.cow_copies += 1

    def layer(self, i: int) -> LayerView:
        return LayerView(self, i)

    def _update(self, i: int, k: torch.Tensor, v: torch.Tensor):
        _, positions, slots, tables = self._step
        check_device(self, k.device)  # the positions above were made on self.device
        if i not in self._layers:
            n = self.pool.num_blocks
            self._layers[i] = tuple(x.new_zeros(n, self.block_size, x.shape[1], x.shape[3]) for x in (k, v))
        out = []
        for store, x in zip(self._layers[i], (k, v)):
            flat = store.view(-1, x.shape[1], x.shape[3])  # [slots, heads, dim]
            flat[slots.flatten()] = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
            out.append(gather_blocks(store, tables))
        return out[0], out[1], positions

    def end_step(self) -> None:
        t = self._step[0]
        for sid in self.batch:
            seq = self.seqs[sid]
            seq.num_computed += t
            if self.prefix_caching:  # blocks that just became full: hashed and registered
                seq.hashes += register_full_blocks(
                    self.pool, seq.tokens, seq.blocks, seq.hashes, seq.num_computed, self.block_size
                )
        self._step = None

    # ---------------------------------------------------------------- swapping (preemption by swap)
    def swap_out(self, sid: int) -> dict:
        """Copy a sequence's blocks out of the pool to host memory (vLLM's swap space) and free them."""
        seq = self.seqs[sid]
        saved = {i: tuple(x[seq.blocks].to("cpu", copy=True) for x in store) for i, store in self._layers.items()}
        state = {"tokens": list(seq.tokens), "num_computed": seq.num_computed, "hashes": list(seq.hashes)}
        self.free_sequence(sid)
        return {"state": state, "blocks": saved, "n_blocks": len(seq.blocks)}

    def swap_in(self, swapped: dict) -> int:
        """Bring a swapped-out sequence back into fresh blocks; returns its new id."""
        state = swapped["state"]
        seq = _Sequence(state["tokens"])
        seq.num_computed, seq.hashes = state["num_computed"], state["hashes"]
        seq.blocks = [self.pool.allocate() for _ in range(swapped["n_blocks"])]
        for i, saved in swapped["blocks"].items():
            for x, y in zip(self._layers[i], saved):
                x[seq.blocks] = y.to(x.device)  # back from host memory
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = seq
        return sid

    # ---------------------------------------------------------------- accounting
    def bytes_per_slot(self) -> int:
        """Bytes one token slot takes across all layers (K and V): the model's KV bytes per token."""
        return sum(x[0, 0].numel() * x.element_size() for store in self._layers.values() for x in store)

    def allocated_slots(self) -> int:
        """Token slots in blocks that some sequence holds."""
        return sum(1 for c in self.pool.ref_count if c > 0) * self.block_size

    def used_slots(self) -> int:
        """Token slots that hold a computed token, each shared block counted once."""
        filled: dict[int, int] = {}
        for seq in self.seqs.values():
            for j, block in enumerate(seq.blocks):
                n = min(self.block_size, max(0, seq.num_computed - j * self.block_size))
                filled[block] = max(filled.get(block, 0), n)
        return sum(filled.values())

    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens looked up (vLLM reports the same ratio)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
