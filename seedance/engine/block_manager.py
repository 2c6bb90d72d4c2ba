"""The KV cache's block accounting: ref-counted blocks of `block_size` tokens (for all layers at
once), each sequence's block table, and prefix reuse through a hash chain over full blocks."""

from __future__ import annotations

import heapq
from collections import OrderedDict

from seedance.engine.sequence import Sequence


class Block:
    """One block of cache slots. `block_hash` is set once the block is full and its tokens are
    computed; then `token_ids` hold those tokens so a hash hit can be verified."""

    __slots__ = ("block_hash", "block_id", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The hash of a full block: its tokens and its parent block's hash."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Allocates blocks to sequences and shares computed full blocks between them.

    Free blocks live in two pools: never-hashed ones (used first, lowest id first, which keeps
    the blocks in use packed at the start of the cache) and cached ones, which still hold a
    reusable prefix and are evicted least-recently-freed first. `free_block_count` counts
    both. A block's `Block` is made the first time it is handed out (`blocks` holds ids
    0..n-1 of the blocks ever used), so a huge cache costs nothing until it fills."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = []
        self._free_plain: list[int] = []  # a heap of freed plain ids, all < len(self.blocks)
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0
        """Prompt tokens looked up in the prefix cache."""
        self.prefix_cache_hits = 0
        """Of those, tokens found."""

    # ---- accounting -------------------------------------------------------------------------

    @property
    def free_block_count(self) -> int:
        return (
            len(self._free_plain) + len(self._free_cached) + self.num_blocks - len(self.blocks)
        )

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.free_block_count

    # ---- allocation -------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = heapq.heappop(self._free_plain)
        elif len(self.blocks) < self.num_blocks:  # a never-used block: the lowest plain id
            block_id = len(self.blocks)
            self.blocks.append(Block(block_id))
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict the LRU cached block
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self._hash_to_block.get(block.block_hash) == block_id:
                    del self._hash_to_block[block.block_hash]
                block.block_hash = None
                block.token_ids = ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` enough blocks for its first `num_tokens` tokens (caller checked space)."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.free_block_count:
            raise RuntimeError(f"allocate: {needed} blocks needed, {self.free_block_count} free")
        for _ in range(needed):
            seq.block_ids.append(self._take_free_block())

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the cached blocks that hold a prefix of `seq` (a fresh or recomputed sequence
        with no blocks); returns how many tokens they cover. At least one token is always left
        to compute, since the step needs its logits."""
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        tokens = seq.token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        parent: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
            seq.block_ids.append(block_id)
            parent = h
        seq.num_hashed_blocks = len(seq.block_ids)
        seq.last_block_hash = parent
        cached = len(seq.block_ids) * self.block_size
        seq.num_computed_tokens = cached
        return cached

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.last_block_hash
        for i in range(seq.num_hashed_blocks, num_full):
            chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, chunk)
            block = self.blocks[seq.block_ids[i]]
            block.block_hash = h
            block.token_ids = chunk
            self._hash_to_block.setdefault(h, block.block_id)
            parent = h
        if num_full > seq.num_hashed_blocks:
            seq.num_hashed_blocks = num_full
            seq.last_block_hash = parent

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks reaching zero return to a free pool. Blocks are
        released last-first so that a prefix's tail is evicted before its head."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._free_cached[block_id] = None
                else:
                    heapq.heappush(self._free_plain, block_id)
        seq.block_ids = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (free cached blocks become plain free blocks)."""
        for block_id in list(self._free_cached):
            block = self.blocks[block_id]
            block.block_hash = None
            block.token_ids = ()
            heapq.heappush(self._free_plain, block_id)
        self._free_cached.clear()
        self._hash_to_block = {
            h: b for h, b in self._hash_to_block.items() if self.blocks[b].ref_count > 0
        }
