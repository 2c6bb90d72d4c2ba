"""Paged decode attention (one new token per sequence) as flash-decoding, in Triton, with its
plain-torch reference.

Stage 1 splits each sequence's cached tokens into `num_splits` contiguous ranges; program
(sequence, kv head, split) loads each K/V tile of its range once for all the query heads of that
KV group (grouped-query attention: the group's heads are the rows of one `tl.dot`, padded to 16
rows, the smallest `tl.dot` tile on GPUs), runs an online softmax in fp32 and writes the split's
normalised partial output and its log-sum-exp (base 2). Stage 2 merges a sequence's splits:
`out = sum_s 2^(lse_s - lse) * out_s` with `lse = log2 sum_s 2^lse_s`. With one split, stage 1
writes the final output directly and stage 2 is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from seedance.engine.attention.triton_interpret import dot_precision, upcast_dot_operands

LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16
_TARGET_PROGRAMS = 1024
"""Stage-1 programs wanted per launch: several waves over the ~132 SMs of an H100/H200, so that
small batches still fill the GPU."""
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit  # type: ignore[untyped-decorator]  # triton reads the signature itself
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_splits,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Split length rounded up to whole tiles: the last split may be short or empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_h[:, None],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        # K is loaded transposed, (HEAD_DIM, BLOCK_N), ready for q @ k^T.
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_k_block
            + in_block[None, :] * stride_k_slot
            + kv_head * stride_k_head
            + offs_d[:, None],
            mask=mask_n[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_v_block
            + in_block[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + offs_d[None, :],
            mask=mask_n[:, None],
            other=0.0,
        )
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p_v = p.to(v.dtype)
        if UPCAST_DOT:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (or a padded sequence of length 0) has l_i == 0 and acc == 0.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    if DIRECT_OUT:
        tl.store(
            out_ptr
            + seq.to(tl.int64) * stride_o_seq
            + heads[:, None] * stride_o_head
            + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_h[:, None],
        )
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(
            part_out_ptr
            + seq.to(tl.int64) * stride_po_seq
            + heads[:, None] * stride_po_head
            + split * stride_po_split
            + offs_d[None, :],
            out,
            mask=mask_h[:, None],
        )
        tl.store(
            part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head + split,
            lse,
            mask=mask_h,
        )


@triton.jit  # type: ignore[untyped-decorator]  # triton reads the signature itself
def _decode_merge_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < num_splits

    lse = tl.load(
        part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)
    total = tl.sum(weight, axis=0)
    total = tl.where(total > 0.0, total, 1.0)
    parts = tl.load(
        part_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
    )


def output_buffer(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked against the query's shape and dtype, or a new contiguous buffer."""
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be a {query.dtype} tensor of shape {tuple(query.shape)} with a contiguous "
            f"last dim; got {out.dtype} {tuple(out.shape)} with strides {out.stride()}"
        )
    return out


def check_head_dim(head_dim: int) -> None:
    """The kernels tile the head dim whole (no masking, vectorised loads): a power of two >= 16
    (`tl.dot`'s smallest inner size)."""
    if head_dim < _MIN_DOT_ROWS or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16; got {head_dim}")


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per sequence: enough stage-1 programs to fill the GPU, at least
    `_MIN_TOKENS_PER_SPLIT` tokens per split, a power of two (few kernel variants, and a fixed
    value can be reused for every step of a CUDA graph)."""
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    by_occupancy = max(1, _TARGET_PROGRAMS // max(1, num_seqs * num_kv_heads))
    splits = min(by_length, by_occupancy, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


@dataclass(frozen=True)
class DecodeTiles:
    """Stage-1 launch shape: KV tokens per loop iteration, warps, software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(head_dim: int) -> DecodeTiles:
    """The default stage-1 shape (not yet timed on hardware: `tools/bench_kernels.py` sweeps the
    alternatives). 64 tokens keep a K and a V tile of head dim <= 128 on chip; three stages keep
    two tiles' loads in flight (compiled for sm_90 they become `cp.async` 16-byte copies)."""
    return DecodeTiles(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=3)


def _check(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be (num_seqs, num_heads, head_dim); got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim); "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    check_head_dim(head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if (
        seq_lens.shape != (num_seqs,)
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
    ):
        raise ValueError(
            f"decode needs one query row per sequence: query has {num_seqs} rows, seq_lens "
            f"{tuple(seq_lens.shape)}, block_tables {tuple(block_tables.shape)}"
        )


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, `query` `(num_seqs, num_heads, head_dim)`, over
    the sequence's `seq_lens[s]` cached tokens read through `block_tables` (int32, padded). The
    new token is already in the cache. `max_seq_len` (a host int, >= every seq_len) sizes the
    split count without a device sync; pass `num_splits` to fix it (CUDA graphs), `out` to write
    into a given tensor, `tiles` to override the launch shape. Returns `(num_seqs, num_heads,
    head_dim)` in the query's dtype."""
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = output_buffer(query, out)
    if num_seqs == 0:
        return out
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    if query.stride(2) != 1:
        query = query.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len)
    block_h = max(_MIN_DOT_ROWS, triton.next_power_of_2(group))
    if tiles is None:
        tiles = decode_tiles(head_dim)
    direct = num_splits == 1
    if direct:
        part_out = out
        part_lse = out
    else:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        num_splits,
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
        part_out.stride(0) if not direct else 0,
        part_out.stride(1) if not direct else 0,
        part_out.stride(2) if not direct else 0,
        part_lse.stride(0) if not direct else 0,
        part_lse.stride(1) if not direct else 0,
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=tiles.block_n,
        DIRECT_OUT=direct,
        UPCAST_DOT=upcast_dot_operands(k_cache.dtype),
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out


def gather_sequence_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first `seq_len` cached keys and values, `(seq_len, num_kv_heads,
    head_dim)` each, read through its block table row (reference helper)."""
    block_size = k_cache.shape[1]
    num_blocks = math.ceil(seq_len / block_size)
    blocks = block_table[:num_blocks].long()
    keys = k_cache[blocks].flatten(0, 1)[:seq_len]
    values = v_cache[blocks].flatten(0, 1)[:seq_len]
    return keys, values


def decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time, computed in fp32."""
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    num_heads = query.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(query)
    for s, seq_len in enumerate(seq_lens.tolist()):
        keys, values = gather_sequence_kv(k_cache, v_cache, block_tables[s], seq_len)
        keys = keys.float().repeat_interleave(group, dim=1)  # (L, H, D)
        values = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[s].float(), keys) * scale
        probs = torch.softmax(scores, dim=-1)
        out[s] = torch.einsum("hl,lhd->hd", probs, values).to(query.dtype)
    return out
