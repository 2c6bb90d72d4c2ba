"""The torch attention backend against a naive per-sequence reference: decode batches (with
blocks shared between sequences and grouped-query heads), prefill chunks and mixed steps."""

from __future__ import annotations

import pytest
import torch

from seedance.engine.attention.metadata import AttentionMetadata
from seedance.engine.attention.torch_backend import TorchBackend

BS = 4


def reference(q, k_cache, v_cache, tables, seq_lens, query_lens, scale):
    out = []
    start = 0
    kvh = k_cache.shape[2]
    for table, s_len, q_len in zip(tables, seq_lens, query_lens, strict=True):
        slots = [table[p // BS] * BS + p % BS for p in range(s_len)]
        k = k_cache.flatten(0, 1)[slots]
        v = v_cache.flatten(0, 1)[slots]
        for i in range(q_len):
            pos = s_len - q_len + i
            qi = q[start + i]  # (H, D)
            group = qi.shape[0] // kvh
            kk = k[: pos + 1].repeat_interleave(group, dim=1)  # (L, H, D)
            vv = v[: pos + 1].repeat_interleave(group, dim=1)
            w = torch.softmax(torch.einsum("hd,lhd->hl", qi, kk) * scale, dim=-1)
            out.append(torch.einsum("hl,lhd->hd", w, vv))
        start += q_len
    return torch.stack(out)


def run(tables, seq_lens, query_lens, heads=4, kv_heads=2, dim=8, num_blocks=16):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, BS, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, BS, kv_heads, dim, generator=gen)
    q = torch.randn(sum(query_lens), heads, dim, generator=gen)
    width = max(len(t) for t in tables)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=BS,
        query_lens_list=tuple(query_lens),
        seq_lens_list=tuple(seq_lens),
    )
    got = TorchBackend().forward(q, k_cache, v_cache, meta, 0.3)
    want = reference(q, k_cache, v_cache, tables, seq_lens, query_lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_decode_batch(heads, kv_heads):
    run([[3, 7], [1], [9, 2, 5]], [6, 1, 12], [1, 1, 1], heads=heads, kv_heads=kv_heads)


def test_decode_with_blocks_shared_between_sequences():
    run([[3, 7, 8], [3, 7, 11], [3, 4]], [10, 9, 5], [1, 1, 1])


def test_prefill_chunks_and_mixed_step():
    run([[3, 7, 8], [5], [2, 6]], [10, 3, 8], [4, 1, 8])


def test_store_kv_writes_the_slots():
    backend = TorchBackend()
    k_cache = torch.zeros(4, BS, 2, 3)
    v_cache = torch.zeros(4, BS, 2, 3)
    key = torch.arange(12.0).view(2, 2, 3)
    backend.store_kv(key, -key, k_cache, v_cache, torch.tensor([5, 14]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[3, 2], -key[1])


def test_decode_over_scattered_blocks_uses_segments():
    from seedance.engine.attention.torch_backend import _segments

    assert _segments([0, 1, 2, 40, 41, 90]) == [(0, 3, 0), (40, 42, 3), (90, 91, 5)]
    assert _segments([5, 7, 9]) == [(5, 10, 0)]  # small gaps are not worth a split
    run([[0, 1], [60], [61, 2], [30, 95]], [8, 3, 7, 6], [1, 1, 1, 1], num_blocks=100)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_decode_without_the_cpu_flash_kernel(monkeypatch, heads, kv_heads):
    """The portable per-block path (other devices, torch builds without ATen's CPU flash
    kernel) gives the same result."""
    import seedance.engine.attention.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "_FLASH_CPU", None)
    run([[3, 7, 8], [3, 7, 11], [3, 4]], [10, 9, 5], [1, 1, 1], heads=heads, kv_heads=kv_heads)
