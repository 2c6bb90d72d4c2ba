"""Paged prefill / extend attention in Triton, with its plain-torch reference: a varlen batch of
new tokens attends causally to itself and to its sequence's cached prefix.

The new tokens' K/V are already in the cache (the backend stores them first), so every key is
read through the block table, one code path for prefix and new tokens: the just-written K/V are
still in L2, and chunked prefill and prefix reuse need no special case. Program
(query tile, sequence, head) holds `BLOCK_M` query rows of one head; with `ctx = seq_len -
query_len` cached tokens before them, query row `i` sits at position `ctx + i`. Keys below the
tile's first position are visible to every row and run without a causal mask (whole `BLOCK_N`
tiles, no masking at all); the remaining keys up to the tile's last position run with it. Online
softmax in fp32, base 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from seedance.engine.attention.decode_attention import (
    LOG2E,
    check_head_dim,
    gather_sequence_kv,
    output_buffer,
)
from seedance.engine.attention.triton_interpret import dot_precision, upcast_dot_operands


@triton.jit  # type: ignore[untyped-decorator]  # triton reads the signature itself
def _attend_tile(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    tile_start,
    kv_end,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    scale_log2,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    offs_d,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = tile_start + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = pos < kv_end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
    in_block = pos % BLOCK_SIZE
    k_ptrs = (
        k_cache_ptr
        + block[None, :] * stride_k_block
        + in_block[None, :] * stride_k_slot
        + kv_head * stride_k_head
        + offs_d[:, None]
    )
    v_ptrs = (
        v_cache_ptr
        + block[:, None] * stride_v_block
        + in_block[:, None] * stride_v_slot
        + kv_head * stride_v_head
        + offs_d[None, :]
    )
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_v = p.to(v.dtype)
    if UPCAST_DOT:
        p_v = p_v.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit  # type: ignore[untyped-decorator]  # triton reads the signature itself
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_o_token,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_len = seq_len - q_len
        kv_head = head // GROUP

        offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        mask_m = offs_m < q_len
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :],
            mask=mask_m[:, None],
            other=0.0,
        )
        if UPCAST_DOT:
            q = q.to(tl.float32)
        q_pos = ctx_len + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

        # Whole tiles every row of this query tile sees: no mask.
        diag_start = ctx_len + q_tile * BLOCK_M
        unmasked_end = (diag_start // BLOCK_N) * BLOCK_N
        for tile_start in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile_start, seq_len,
                k_cache_ptr, v_cache_ptr, bt_row, kv_head, scale_log2,
                stride_k_block, stride_k_slot, stride_k_head,
                stride_v_block, stride_v_slot, stride_v_head,
                offs_d,
                BLOCK_SIZE, BLOCK_N, False, UPCAST_DOT, DOT_PRECISION,
            )  # fmt: skip
        # The diagonal: keys up to the tile's last query position, causally masked.
        kv_end = tl.minimum(diag_start + BLOCK_M, seq_len)
        for tile_start in range(unmasked_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile_start, kv_end,
                k_cache_ptr, v_cache_ptr, bt_row, kv_head, scale_log2,
                stride_k_block, stride_k_slot, stride_k_head,
                stride_v_block, stride_v_slot, stride_v_head,
                offs_d,
                BLOCK_SIZE, BLOCK_N, True, UPCAST_DOT, DOT_PRECISION,
            )  # fmt: skip

        # Every real row saw at least key 0 of the first tile, so l_i > 0 there.
        safe_l = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / safe_l[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_o_token + head * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None],
        )


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape: query rows and keys per tile, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> PrefillTiles:
    """The default launch shape (untuned on hardware yet: `tools/bench_kernels.py` sweeps the
    alternatives). 16-bit: 128x64 tiles, the usual flash-attention shape on A100/H100; fp32 and
    head dims above 128 use smaller tiles to stay within registers and shared memory."""
    if dtype == torch.float32:
        return PrefillTiles(32, 32, 4, 2)
    if head_dim > 128:
        return PrefillTiles(64, 32, 4, 2)
    return PrefillTiles(128, 64, 4 if head_dim <= 64 else 8, 3)


def _check(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(
            f"query must be (num_tokens, num_heads, head_dim); got {tuple(query.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim); "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    check_head_dim(head_dim)
    if num_heads % k_cache.shape[2]:
        raise ValueError(
            f"num_heads {num_heads} is not a multiple of num_kv_heads {k_cache.shape[2]}"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc must be ({num_seqs + 1},) and block_tables ({num_seqs}, ...) for "
            f"{num_seqs} sequences; got {tuple(query_start_loc.shape)} and "
            f"{tuple(block_tables.shape)}"
        )


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of the packed new tokens `query` `(num_tokens, num_heads, head_dim)`
    (sequence `s` owns rows `query_start_loc[s]:query_start_loc[s+1]`) over each sequence's
    `seq_lens[s]` cached tokens (prefix + these new tokens, already stored). `max_query_len` is a
    host int >= every query length (sizes the grid without a device sync); `tiles` overrides the
    launch shape. Returns
    `(num_tokens, num_heads, head_dim)` in the query's dtype."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    out = output_buffer(query, out)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    if tiles is None:
        tiles = prefill_tiles(head_dim, k_cache.dtype)
    grid = (triton.cdiv(max_query_len, tiles.block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // k_cache.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        UPCAST_DOT=upcast_dot_operands(k_cache.dtype),
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out


def prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time, computed in fp32."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    group = query.shape[1] // k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[s] : starts[s + 1]].float()  # (Q, H, D)
        q_len = q.shape[0]
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(k_cache, v_cache, block_tables[s], seq_len)
        keys = keys.float().repeat_interleave(group, dim=1)
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        visible = torch.arange(seq_len).unsqueeze(0) <= q_pos  # (Q, L)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[s] : starts[s + 1]] = torch.einsum("hql,lhd->qhd", probs, values).to(query.dtype)
    return out
