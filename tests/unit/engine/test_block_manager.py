"""BlockManager: allocation and ref counts, the prefix hash chain with token verification,
LRU eviction of free cached blocks, counters."""

from __future__ import annotations

import pytest

from seedance.engine import block_manager as bm_module
from seedance.engine.block_manager import BlockManager
from seedance.engine.sampling_params import SamplingParams
from seedance.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival_time=0.0)


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Allocate for all of `s`'s tokens, mark them computed and register full blocks."""
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)
    return s


def test_allocate_and_free_restore_every_block():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    s = seq(list(range(10)))
    bm.allocate(s, 10)
    assert len(s.block_ids) == 3 and bm.free_block_count == 5
    assert bm.blocks_needed(s, 13) == 1
    bm.free(s)
    assert bm.free_block_count == 8 and s.block_ids == []
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_allocate_beyond_capacity_raises():
    bm = BlockManager(2, BS, enable_prefix_caching=False)
    with pytest.raises(RuntimeError):
        bm.allocate(seq(list(range(12))), 12)


def test_shared_prefix_is_reused_with_ref_counts():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = computed(bm, seq(list(range(10)), "a"))
    b = seq([*range(8), 99, 98, 97], "b")
    hit = bm.match_prefix(b)
    assert hit == 8 and b.block_ids == a.block_ids[:2]
    assert [bm.blocks[i].ref_count for i in a.block_ids] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1]
    bm.free(b)
    assert bm.free_block_count == 16


def test_match_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, seq(list(range(8)), "a"))
    b = seq(list(range(8)), "b")
    assert bm.match_prefix(b) == 4  # the second block is full, but its last token must run
    bm.free(b)


def test_hash_chain_includes_the_parent():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 0], "a"))
    # same second block, different first block: no hit at all
    b = seq([9, 9, 9, 9, 5, 6, 7, 8, 0], "b")
    assert bm.match_prefix(b) == 0
    bm.free(b)


def test_hash_hit_is_verified_by_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    computed(bm, seq([1, 2, 3, 4, 0], "a"))
    b = seq([5, 6, 7, 8, 0], "b")
    assert bm.match_prefix(b) == 0
    c = seq([1, 2, 3, 4, 0], "c")
    assert bm.match_prefix(c) == 4
    bm.free(b)
    bm.free(c)


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = computed(bm, seq([1, 1, 1, 1, 0], "a"))  # 2 blocks, first one hashed
    b = computed(bm, seq([2, 2, 2, 2, 0], "b"))
    a_block, b_block = a.block_ids[0], b.block_ids[0]
    bm.free(a)
    bm.free(b)
    # plain free blocks go first, then the LRU cached block (a's), keeping b's prefix
    c = seq(list(range(100, 113)), "c")
    bm.allocate(c, 12)
    assert a_block in c.block_ids and b_block not in c.block_ids
    d = seq([2, 2, 2, 2, 7], "d")
    assert bm.match_prefix(d) == 4
    e = seq([1, 1, 1, 1, 7], "e")
    assert bm.match_prefix(e) == 0
    for s in (c, d, e):
        bm.free(s)
    assert bm.free_block_count == 4


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    computed(bm, seq(list(range(9)), "a"))
    b = seq(list(range(9)), "b")
    assert bm.match_prefix(b) == 0


def test_counters_and_reset():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = computed(bm, seq(list(range(9)), "a"))
    bm.free(a)
    bm.record_prefix_query(9, 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9, 8)
    bm.reset_prefix_cache()
    b = seq(list(range(9)), "b")
    assert bm.match_prefix(b) == 0
    assert bm.free_block_count == 8
