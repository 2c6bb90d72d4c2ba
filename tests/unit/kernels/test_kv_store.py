"""The KV-store kernel writes each new token's K/V into its slot, cast to the cache dtype,
exactly as the torch reference does."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from seedance.engine.attention.kv_store import store_kv, store_kv_reference
from seedance.engine.attention.triton_interpret import interpreting
from tests.unit.kernels.paged_batch import device


def _caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, 7.0, dtype=dtype, device=device())
    return k, k.clone()


def _random_slots(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_slots, generator=gen)[:num_tokens].to(device())


def _assert_same_store(
    actual: torch.Tensor, expected: torch.Tensor, src_dtype: torch.dtype
) -> None:
    """A store is a copy plus one rounding to the cache dtype: bit-exact, except that triton's
    interpreter rounds fp32 -> bf16 toward zero where GPUs and torch round to nearest even
    (at most one bf16 ulp, a relative 2^-7)."""
    if actual.dtype == torch.bfloat16 and src_dtype == torch.float32 and interpreting():
        torch.testing.assert_close(actual.float(), expected.float(), atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(actual, expected)


def _store_both(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
) -> None:
    k_cache, v_cache = caches
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_reference(key, value, k_ref, v_ref, slots)
    _assert_same_store(k_cache, k_ref, key.dtype)
    _assert_same_store(v_cache, v_ref, value.dtype)


@pytest.mark.interpret
@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 64, 16), (2, 128, 64)])
def test_store_kv_matches_reference_and_casts(
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> None:
    num_tokens = 37
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device()).to(src_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device()).to(src_dtype)
    caches = _caches(5, block_size, num_kv_heads, head_dim, cache_dtype)
    slots = _random_slots(num_tokens, 5 * block_size, seed=1)
    _store_both(key, value, slots, caches)
    k_cache = caches[0]
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    _assert_same_store(flat[slots], key.to(cache_dtype), src_dtype)


@pytest.mark.interpret
def test_store_kv_reads_strided_views_of_a_fused_qkv_projection() -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 8, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device())
    _, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    key = k.view(num_tokens, num_kv_heads, head_dim)
    value = v.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    caches = _caches(2, 16, num_kv_heads, head_dim, torch.float32)
    _store_both(key, value, _random_slots(num_tokens, 32, seed=2), caches)


@pytest.mark.interpret
def test_store_kv_skips_negative_slots_and_touches_nothing_else() -> None:
    key = torch.randn(4, 1, 16, device=device())
    value = torch.randn(4, 1, 16, device=device())
    k_cache, v_cache = _caches(2, 16, 1, 16, torch.float32)
    slots = torch.tensor([3, -1, 20, -1], device=device())
    store_kv(key, value, k_cache, v_cache, slots)
    written = torch.zeros(32, dtype=torch.bool)
    written[[3, 20]] = True
    flat_k = k_cache.view(32, 16).cpu()
    assert torch.equal(flat_k[3], key[0, 0].cpu())
    assert torch.equal(flat_k[20], key[2, 0].cpu())
    assert bool((flat_k[~written] == 7.0).all())
    assert torch.equal(v_cache.view(32, 16)[20].cpu(), value[2, 0].cpu())


@pytest.mark.interpret
def test_store_kv_accepts_int32_slots_and_empty_batches() -> None:
    key = torch.randn(3, 2, 32, device=device())
    caches = _caches(1, 16, 2, 32, torch.float32)
    _store_both(key, key + 1, torch.tensor([0, 15, 8], dtype=torch.int32, device=device()), caches)
    empty = torch.empty(0, 2, 32, device=device())
    store_kv(empty, empty, *caches, torch.empty(0, dtype=torch.int64, device=device()))


@pytest.mark.parametrize(
    ("key_shape", "cache_shape", "num_slots", "message"),
    [
        ((4, 2, 32), (1, 16, 2, 64), 4, "do not match"),
        ((4, 64), (1, 16, 2, 32), 4, "key and value"),
        ((4, 2, 32), (16, 2, 32), 4, "k_cache and v_cache"),
        ((4, 2, 32), (1, 16, 2, 32), 3, "slot_mapping"),
    ],
)
def test_store_kv_rejects_mismatched_shapes(
    key_shape: tuple[int, ...], cache_shape: tuple[int, ...], num_slots: int, message: str
) -> None:
    key = torch.zeros(key_shape)
    cache = torch.zeros(cache_shape)
    with pytest.raises(ValueError, match=message):
        store_kv(key, key, cache, cache, torch.zeros(num_slots, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_on_cuda_at_llama_8b_sizes(dtype: torch.dtype) -> None:
    num_tokens, num_kv_heads, head_dim, block_size, num_blocks = 8192, 8, 128, 64, 512
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    caches = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    _store_both(key, value, _random_slots(num_tokens, num_blocks * block_size, seed=3), caches)
