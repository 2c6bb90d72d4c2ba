"""Random paged-KV batches for the kernel tests: caches full of random values (so a read of the
wrong slot shows), shuffled block tables padded with 0, packed queries, and the metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from seedance.engine.attention.metadata import AttentionMetadata

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
"""(atol, rtol) of a kernel's output against the fp32 torch reference, per dtype: fp32 is exact
up to summation order; fp16/bf16 round the softmax weights to the KV dtype before `p @ v` and
the output once more."""


def device() -> torch.device:
    """CUDA when present, else the CPU (kernels then run under the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor
    """(num_new_tokens, num_heads, head_dim)"""
    new_keys: torch.Tensor
    new_values: torch.Tensor
    """(num_new_tokens, num_kv_heads, head_dim): the new tokens' K/V (already in the caches)."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata

    @property
    def scale(self) -> float:
        return float(self.query.shape[-1]) ** -0.5


def make_paged_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """`seqs` is one `(cached_prefix_len, new_tokens)` pair per sequence. The new tokens' K/V are
    written into the caches as the backend's `store_kv` would have done."""
    dev = device()
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=dev).manual_seed(seed)
    seq_lens = [ctx + new for ctx, new in seqs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=dev_gen, device=dev).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=dev).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(max(blocks_per_seq), 1)
    block_tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = order[used : used + n]
        used += n

    new_counts = [new for _, new in seqs]
    num_new = sum(new_counts)
    query = torch.randn((num_new, num_heads, head_dim), generator=dev_gen, device=dev).to(dtype)
    slots = []
    for s, (ctx, new) in enumerate(seqs):
        for pos in range(ctx, ctx + new):
            slots.append(int(block_tables[s, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    new_keys = flat_k[slot_mapping].clone()
    new_values = flat_v[slot_mapping].clone()

    starts = [0]
    for n in new_counts:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),  # int32, shuffled, padded with block 0
        max_query_len=max(new_counts),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_list=tuple(new_counts),
        seq_lens_list=tuple(seq_lens),
    )
    return PagedBatch(query, new_keys, new_values, k_cache, v_cache, meta)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)
