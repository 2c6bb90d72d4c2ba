"""Paged prefill/extend attention equals the torch reference: fresh prompts, cached prefix + new
tokens (chunked prefill, prefix reuse), decodes mixed into the batch, GQA ratios 1/4/8, head
dims 64/128, block sizes 16-128, every dtype."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from seedance.engine.attention.prefill_attention import (
    PrefillTiles,
    prefill_attention,
    prefill_attention_reference,
)
from tests.unit.kernels.paged_batch import PagedBatch, assert_close, make_paged_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

MIXED = [(0, 1), (0, 63), (0, 64), (0, 65), (236, 64), (64, 1), (0, 300), (130, 37)]
"""(cached prefix, new tokens): fresh prompts of lengths 1/63/64/65/300, a 300-token sequence
whose last 64 tokens are new, a decode, a prefix that ends mid-block."""


def _check_prefill(
    batch: PagedBatch, dtype: torch.dtype, tiles: PrefillTiles | None = None
) -> None:
    meta = batch.meta
    out = prefill_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        batch.scale,
        max_query_len=meta.max_query_len,
        tiles=tiles,
    )
    expected = prefill_attention_reference(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        batch.scale,
    )
    assert out.dtype == batch.query.dtype
    assert out.shape == batch.query.shape
    assert_close(out, expected, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (F32, 2, 2, 64, 16),
        (F32, 4, 1, 128, 64),
        (F32, 8, 1, 64, 128),
        (F16, 1, 1, 128, 32),
        (F16, 4, 1, 64, 16),
        (F16, 8, 1, 128, 128),
        (BF16, 2, 2, 64, 64),
        (BF16, 4, 1, 128, 16),
        (BF16, 8, 1, 64, 32),
    ],
)
def test_prefill_matches_reference_on_a_mixed_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    batch = make_paged_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    _check_prefill(batch, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("seed", range(4))
def test_prefill_matches_reference_on_random_shapes(seed: int) -> None:
    rng = random.Random(100 + seed)
    num_kv_heads = rng.choice([1, 2])
    group = rng.choice([1, 4, 8])
    dtype = rng.choice([F32, F16, BF16])
    seqs = [(rng.choice([0, rng.randint(1, 200)]), rng.randint(1, 100)) for _ in range(3)]
    batch = make_paged_batch(
        seqs,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([64, 128]),
        block_size=rng.choice([16, 32, 64, 128]),
        dtype=dtype,
        seed=seed,
    )
    _check_prefill(batch, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("tiles", "block_size"),
    [
        (PrefillTiles(16, 16, 1, 1), 64),  # key tiles smaller than a block
        (PrefillTiles(32, 128, 4, 2), 16),  # key tiles spanning 8 blocks
        (PrefillTiles(64, 32, 4, 3), 32),  # query tiles taller than key tiles
    ],
)
def test_prefill_is_right_for_other_tile_shapes(tiles: PrefillTiles, block_size: int) -> None:
    """The benchmark sweeps launch shapes; each must be exact, whatever the block size."""
    batch = make_paged_batch(
        [(0, 70), (100, 45), (31, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=F16,
    )
    _check_prefill(batch, F16, tiles)


@pytest.mark.interpret
def test_prefill_of_decode_steps_equals_decode() -> None:
    """Query length 1 everywhere: the prefill kernel gives decode's answer (the backend relies on
    either kernel being right for any step)."""
    batch = make_paged_batch(
        [(0, 1), (99, 1), (127, 1)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=32,
        dtype=F32,
    )
    _check_prefill(batch, F32)


@pytest.mark.parametrize(
    ("query_shape", "cache_shape", "num_starts", "message"),
    [
        ((5, 4, 96), (3, 16, 2, 96), 3, "power-of-two head_dim"),
        ((5, 6, 64), (3, 16, 4, 64), 3, "not a multiple"),
        ((5, 4, 64), (3, 16, 2, 64), 2, "query_start_loc"),
        ((5, 4, 64), (3, 16, 2), 3, "k_cache and v_cache"),
    ],
)
def test_prefill_rejects_bad_shapes(
    query_shape: tuple[int, ...], cache_shape: tuple[int, ...], num_starts: int, message: str
) -> None:
    query = torch.zeros(query_shape)
    cache = torch.zeros(cache_shape)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    starts = torch.zeros(num_starts, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        prefill_attention(query, cache, cache, tables, lens, starts, 1.0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(32, 8, 128, 64), (32, 8, 128, 16), (32, 32, 128, 128), (16, 2, 64, 32)],
)
def test_prefill_on_cuda_at_real_sizes(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    seqs = [(0, 2048), (30_000, 512), (4095, 1), (0, 1), (1000, 3000), (64, 63)]
    batch = make_paged_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    _check_prefill(batch, dtype)


@pytest.mark.gpu
def test_prefill_on_cuda_fp32_is_exact() -> None:
    batch = make_paged_batch(
        [(0, 700), (2000, 300), (5, 1)],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=64,
        dtype=F32,
    )
    _check_prefill(batch, F32)
