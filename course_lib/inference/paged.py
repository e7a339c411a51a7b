"""PagedAttention's KV cache: a fixed pool of blocks, block tables, prefix caching and copy-on-write.

Kwon et al. 2023 ("Efficient Memory Management for Large Language Model Serving with PagedAttention",
§4) store K/V the way an operating system stores a process's pages. The cache is a pool of
``num_blocks`` physical blocks of ``block_size`` token slots each; a sequence owns a *block table*,
the list of its blocks in order, so token position p lives in slot

    block_table[p // block_size] · block_size + p % block_size.

A sequence takes a new block only when its last one is full, so at most ``block_size − 1`` slots per
sequence are reserved and empty, against ``max_len − length`` for the contiguous layout
(:mod:`.cache`). Attention reads a sequence's K/V by gathering its blocks (:func:`gather_blocks`;
vLLM's kernel does the same gather inside the attention kernel).

Blocks are reference-counted, which buys two kinds of sharing:

* **prefix caching** (vLLM's automatic prefix caching; SGLang's RadixAttention does the same with a
  tree): a full block is registered under a hash of its tokens *chained* with its parent block's hash,
  ``h_i = sha256(h_{i−1} ‖ tokens of block i)``, so equal hashes mean an equal whole prefix, not just
  equal 16 tokens. A new request whose first blocks hash to registered blocks reuses them and skips
  their prefill. Freed blocks keep their contents and hash and sit in an LRU list; they are evicted
  (their hash dropped) only when a fresh block is needed.
* **copy-on-write** for parallel sampling: ``fork`` gives a child the parent's block table (every
  count + 1); the first write into a shared, partially filled block copies it first.

Why the hash must be strong and chained (lecture 06): in a server shared by many users, a block hit
returns *another user's* K/V. A weak hash (Python's ``hash()``, a 32-bit checksum) lets an attacker
craft a prompt that collides with a victim's block and then read the victim's context through the
model's answers — or poison the cache. An unchained hash of 16 tokens alone matches the same 16
tokens under any prefix, whose K/V differ (attention mixes in the prefix), so outputs silently go
wrong. vLLM moved to sha256 of the chained key for this reason (its security advisory
GHSA-rm76-4mrf-v9r8, 2025); it also seeds the root hash per server so hits cannot be probed
across deployments.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch

from course_lib.inference.cache import LayerView, check_device

__all__ = [
    "BlockPool",
    "NoFreeBlocks",
    "PagedCache",
    "block_hash",
    "gather_blocks",
    "slot_mapping",
]


class NoFreeBlocks(RuntimeError):
    """The pool has no free block: the scheduler must preempt a sequence (or wait) before it can grow."""


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """sha256(parent hash ‖ the block's token ids as int64): the key of a full block in the prefix cache.

    ``parent`` is the previous block's hash (``None`` for a sequence's first block), which makes the
    key identify the whole prefix up to and including this block.
    """
    digest = hashlib.sha256(parent or b"root")
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


def slot_mapping(block_tables: Sequence[Sequence[int]], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot of each (sequence, position): ``block_tables[s][p // block_size] · block_size + p % block_size``.

    ``positions`` is [batch, t]; the result has its shape and indexes the pool viewed as
    [num_blocks · block_size, ...].
    """
    slots = torch.empty_like(positions)
    for s, table in enumerate(block_tables):
        blocks = torch.tensor(table, dtype=torch.long, device=positions.device)[positions[s] // block_size]
        slots[s] = blocks * block_size + positions[s] % block_size
    return slots


def gather_blocks(store: torch.Tensor, block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """The paged read: sequence s's K (or V) as [batch, heads, n, dim], from its blocks in table order.

    ``store`` is the pool of one layer, [num_blocks, block_size, heads, dim]. Tables are padded with
    block 0 to the longest, so n = longest table · block_size; column j of row s is position j of
    sequence s, and the padding columns are hidden by the causal mask (their positions are past every
    query). The padding reads real, finite numbers (the pool starts at zero), so a masked weight of 0
    times them stays 0.
    """
    width = max(len(table) for table in block_tables)
    rows = [list(table) + [0] * (width - len(table)) for table in block_tables]
    padded = torch.tensor(rows, dtype=torch.long, device=store.device)
    blocks = store[padded]  # [batch, width, block_size, heads, dim]
    b, _, _, heads, dim = blocks.shape
    return blocks.reshape(b, width * store.shape[1], heads, dim).transpose(1, 2)


class BlockPool:
    """``num_blocks`` physical blocks: reference counts, the prefix-cache map and an LRU free list.

    Invariants (tests/inference/test_paged_cache.py checks them after every operation):
    a block is in the free list exactly when its count is 0; a registered hash maps to a block that
    carries it; a block is freed only while its count is positive.
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

    def allocate(self) -> int:
        """A block for new tokens (count 1), evicting the least recently freed cached block if it has to."""
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

    def lookup(self, key: bytes) -> int | None:
        """The block registered under ``key`` with one more reference, or None on a miss."""
        block = self.cached.get(key)
        if block is None:
            return None
        if self.ref_count[block] == 0:
            del self.free[block]  # back in use: no longer evictable
        self.ref_count[block] += 1
        return block

    def share(self, block: int) -> None:
        """One more reference to a block in use (a forked sequence's table)."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} is free; only a block in use can be shared")
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        """One reference fewer; at 0 the block joins the free list's recent end, contents and hash kept."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released while free: a sequence's blocks were freed twice")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free[block] = None

    def register(self, block: int, key: bytes) -> None:
        """Make a full block findable by its chained hash (a second copy of a known prefix stays private)."""
        if key not in self.cached:
            self.cached[key] = block
            self.hash_of[block] = key


class _Sequence:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.blocks: list[int] = []  # the block table
        self.hashes: list[bytes] = []  # chained hashes of the full, computed blocks
        self.num_computed = 0  # tokens whose K/V are in the cache


class PagedCache:
    """K/V of any number of sequences in one :class:`BlockPool`; the model sees the sequences of ``batch``.

    The caller (:func:`~course_lib.inference.generate.generate`, :class:`~course_lib.inference.engine.Engine`)
    adds sequences, appends the tokens it wants computed, chooses the batch, and runs the model on
    each batch sequence's next t uncomputed tokens; the cache reserves blocks, maps slots and registers
    full blocks for prefix caching. Each layer's pool, [num_blocks, block_size, heads, dim] for K and
    for V, is allocated by its first update, on ``device`` (the model's; the CPU by default), where
    the positions, slot mapping and block tables the model's attention meets are made too.
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
            bs, parent = self.block_size, None
            # at least the last prompt token is computed: its logits give the first new token
            for i in range((len(seq.tokens) - 1) // bs):
                key = block_hash(parent, seq.tokens[i * bs : (i + 1) * bs])
                block = self.pool.lookup(key)
                if block is None:
                    break
                seq.blocks.append(block)
                seq.hashes.append(key)
                parent = key
            seq.num_computed = len(seq.blocks) * bs
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
        bs, first = self.block_size, seq.num_computed // self.block_size
        if first < len(seq.blocks) and self.pool.ref_count[seq.blocks[first]] > 1:
            # copy-on-write: the block that takes the next token is shared with another sequence
            shared, private = seq.blocks[first], self.pool.allocate()
            for store in self._layers.values():
                for x in store:
                    x[private] = x[shared]
            self.pool.release(shared)
            seq.blocks[first] = private
            self.cow_copies += 1
        while len(seq.blocks) * bs < n_tokens:
            seq.blocks.append(self.pool.allocate())

    def layer(self, i: int) -> LayerView:
        return LayerView(self, i)

    def _update(self, i: int, k: torch.Tensor, v: torch.Tensor):
        _, positions, slots, tables = self._step
        check_device(self, k.device)
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
        bs = self.block_size
        for sid in self.batch:
            seq = self.seqs[sid]
            seq.num_computed += t
            while len(seq.hashes) < seq.num_computed // bs:  # blocks that just became full
                i = len(seq.hashes)
                key = block_hash(seq.hashes[-1] if seq.hashes else None, seq.tokens[i * bs : (i + 1) * bs])
                seq.hashes.append(key)
                if self.prefix_caching:
                    self.pool.register(seq.blocks[i], key)
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
