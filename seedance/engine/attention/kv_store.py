"""Writing each new token's key and value into its slot of the paged KV cache: a Triton kernel
and its plain-torch reference.

A token with slot `s` goes to block `s // block_size`, offset `s % block_size` of `k_cache` and
`v_cache` (layout `(num_blocks, block_size, num_kv_heads, head_dim)`), cast to the cache dtype.
A negative slot means "padding token, store nothing" (batches padded to a CUDA-graph size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_TILE = 2048
"""Elements of one token's `num_kv_heads * head_dim` row copied by one program."""


@triton.jit  # type: ignore[untyped-decorator]  # triton reads the signature itself
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
        mask = offs < ROW
        head = offs // HEAD_DIM
        dim = offs % HEAD_DIM
        block = slot // BLOCK_SIZE
        in_block = slot % BLOCK_SIZE
        src = token.to(tl.int64)
        k = tl.load(key_ptr + src * stride_key_t + head * stride_key_h + dim, mask=mask)
        v = tl.load(value_ptr + src * stride_value_t + head * stride_value_h + dim, mask=mask)
        k_dst = k_cache_ptr + block * stride_kc_block + in_block * stride_kc_slot
        v_dst = v_cache_ptr + block * stride_vc_block + in_block * stride_vc_slot
        tl.store(k_dst + head * stride_kc_head + dim, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + head * stride_vc_head + dim, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_shapes(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be (num_tokens, num_kv_heads, head_dim); got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim); "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key rows {tuple(key.shape[1:])} do not match the cache's (num_kv_heads, head_dim) "
            f"{tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be ({key.shape[0]},) to match key; got {tuple(slot_mapping.shape)}"
        )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `key`/`value` `(num_tokens, num_kv_heads, head_dim)` into the cache slots given by
    `slot_mapping` (int32 or int64; negative entries are skipped). Any strides are accepted for
    the token and head dims of `key`/`value` (e.g. views of a fused QKV projection); the last dim
    must be contiguous."""
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    row = num_kv_heads * head_dim
    tile = min(triton.next_power_of_2(row), _MAX_TILE)
    grid = (num_tokens, triton.cdiv(row, tile))
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        ROW=row,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        TILE=tile,
        num_warps=4 if tile >= 1024 else 1,
    )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The same writes in plain torch (indexing the flattened slot dimension)."""
    _check_shapes(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)
