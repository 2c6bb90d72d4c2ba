"""Flash-decoding over the paged cache equals the torch reference: GQA ratios 1/4/8, head dims
64/128, block sizes 16-128, lengths 1 to 300 (block multiples and not), forced and chosen split
counts, every dtype."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from seedance.engine.attention.decode_attention import (
    DecodeTiles,
    choose_num_splits,
    decode_attention,
    decode_attention_reference,
)
from tests.unit.kernels.paged_batch import PagedBatch, assert_close, make_paged_batch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
LENGTHS = [1, 63, 64, 65, 300]


def _decode_batch(
    lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    return make_paged_batch(
        [(n - 1, 1) for n in lengths],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )


def _check_decode(
    batch: PagedBatch,
    dtype: torch.dtype,
    num_splits: int | None = None,
    tiles: DecodeTiles | None = None,
) -> None:
    meta = batch.meta
    out = decode_attention(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        meta.block_tables,
        meta.seq_lens,
        batch.scale,
        max_seq_len=meta.max_seq_len,
        num_splits=num_splits,
        tiles=tiles,
    )
    expected = decode_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    assert out.dtype == batch.query.dtype
    assert out.shape == batch.query.shape
    assert_close(out, expected, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (F32, 2, 2, 64, 16),
        (F32, 8, 2, 128, 32),
        (F32, 8, 1, 64, 64),
        (F16, 2, 2, 128, 64),
        (F16, 4, 1, 64, 128),
        (F16, 8, 1, 128, 16),
        (BF16, 1, 1, 128, 128),
        (BF16, 8, 2, 64, 32),
        (BF16, 8, 1, 128, 64),
    ],
)
def test_decode_matches_reference_on_mixed_lengths(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    batch = _decode_batch(LENGTHS, num_heads, num_kv_heads, head_dim, block_size, dtype)
    _check_decode(batch, dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 64])
def test_decode_split_merge_is_exact_for_any_split_count(num_splits: int) -> None:
    """64 splits of a 65-token sequence leave most splits empty: the merge must ignore them."""
    batch = _decode_batch([1, 65, 300], 4, 1, 64, 16, F32, seed=1)
    _check_decode(batch, F32, num_splits=num_splits)


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("tiles", "block_size", "num_splits"),
    [
        (DecodeTiles(16, 1, 1), 64, 3),  # token tiles smaller than a block
        (DecodeTiles(128, 4, 3), 16, 2),  # token tiles spanning 8 blocks
        (DecodeTiles(32, 8, 2), 32, 1),
    ],
)
def test_decode_is_right_for_other_tile_shapes(
    tiles: DecodeTiles, block_size: int, num_splits: int
) -> None:
    """The benchmark sweeps launch shapes; each must be exact, whatever the block size."""
    batch = _decode_batch([1, 65, 300], 8, 2, 64, block_size, F16, seed=2)
    _check_decode(batch, F16, num_splits=num_splits, tiles=tiles)


@pytest.mark.interpret
@pytest.mark.parametrize("seed", range(4))
def test_decode_matches_reference_on_random_shapes(seed: int) -> None:
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2])
    group = rng.choice([1, 4, 8])
    dtype = rng.choice([F32, F16, BF16])
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 4))]
    batch = _decode_batch(
        lengths,
        num_kv_heads * group,
        num_kv_heads,
        rng.choice([64, 128]),
        rng.choice([16, 32, 64, 128]),
        dtype,
        seed=seed,
    )
    _check_decode(batch, dtype, num_splits=rng.choice([None, 1, 2, 4]))


@pytest.mark.interpret
def test_decode_reads_a_strided_query_view() -> None:
    batch = _decode_batch([40, 7], 4, 2, 64, 16, F32)
    wide = torch.zeros(2, 4, 3 * 64, device=batch.query.device)
    wide[:, :, 64:128] = batch.query
    strided = wide[:, :, 64:128]
    assert not strided.is_contiguous()
    meta = batch.meta
    out = decode_attention(
        strided, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale, 40
    )
    expected = decode_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    assert_close(out, expected, F32)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_seq_len", "expected"),
    [
        (1, 8, 100, 1),  # too short to split
        (1, 8, 600, 2),  # >= 256 tokens per split
        (1, 8, 32768, 64),  # capped
        (256, 8, 32768, 1),  # the batch alone fills the GPU
        (16, 8, 4096, 8),  # 1024 programs / 128 rows
        (3, 1, 100_000, 64),
    ],
)
def test_choose_num_splits_fills_the_gpu_in_powers_of_two(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, expected: int
) -> None:
    assert choose_num_splits(num_seqs, num_kv_heads, max_seq_len) == expected


@pytest.mark.parametrize(
    ("query_shape", "cache_shape", "message"),
    [
        ((2, 4, 48), (3, 16, 2, 48), "power-of-two head_dim"),
        ((2, 3, 64), (3, 16, 2, 64), "not a multiple"),
        ((2, 4, 64), (3, 16, 2, 128), "head_dim"),
        ((3, 4, 64), (3, 16, 2, 64), "one query row per sequence"),
        ((2, 4, 64, 1), (3, 16, 2, 64), "num_seqs, num_heads, head_dim"),
    ],
)
def test_decode_rejects_bad_shapes(
    query_shape: tuple[int, ...], cache_shape: tuple[int, ...], message: str
) -> None:
    query = torch.zeros(query_shape)
    cache = torch.zeros(cache_shape)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        decode_attention(query, cache, cache, tables, lens, 1.0, 1)


@pytest.mark.interpret
def test_decode_writes_into_a_given_buffer_and_checks_it() -> None:
    batch = _decode_batch([5, 70], 4, 2, 64, 16, F32)
    meta = batch.meta
    args = (batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens)
    out = torch.full_like(batch.query, float("nan"))
    assert decode_attention(*args, batch.scale, 70, out=out) is out
    expected = decode_attention_reference(*args, batch.scale)
    assert_close(out, expected, F32)
    with pytest.raises(ValueError, match="out must be"):
        decode_attention(*args, batch.scale, 70, out=out[:1])
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(*args, batch.scale, 70, num_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(32, 8, 128, 64), (32, 8, 128, 16), (32, 32, 128, 128), (16, 2, 64, 32)],
)
def test_decode_on_cuda_at_real_sizes(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    lengths = [1, 511, 4095, 4096, 4097, 20_000, 32_768]
    batch = _decode_batch(lengths, num_heads, num_kv_heads, head_dim, block_size, dtype)
    _check_decode(batch, dtype)


@pytest.mark.gpu
def test_decode_on_cuda_with_a_large_batch_of_short_sequences() -> None:
    rng = random.Random(5)
    lengths = [rng.randint(1, 2048) for _ in range(256)]
    batch = _decode_batch(lengths, 32, 8, 128, 64, BF16)
    _check_decode(batch, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4, 64])
def test_decode_on_cuda_fp32_is_exact_with_forced_splits(num_splits: int) -> None:
    batch = _decode_batch([1, 65, 3000, 9000], 32, 8, 128, 64, F32)
    _check_decode(batch, F32, num_splits=num_splits)
