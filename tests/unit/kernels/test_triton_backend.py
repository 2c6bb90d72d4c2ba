"""`TritonBackend` stores a step's K/V and dispatches decode-only steps to flash-decoding and
every other step to the prefill/extend kernel, with results equal to the torch references."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from seedance.engine.attention.backend import AttentionBackend
from seedance.engine.attention.decode_attention import decode_attention_reference
from seedance.engine.attention.prefill_attention import prefill_attention_reference
from seedance.engine.attention.triton_backend import TritonBackend
from tests.unit.kernels.paged_batch import PagedBatch, assert_close, make_paged_batch


def _batch(seqs: list[tuple[int, int]], dtype: torch.dtype = torch.float32) -> PagedBatch:
    return make_paged_batch(
        seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=7
    )


def _step(backend: AttentionBackend, batch: PagedBatch) -> torch.Tensor:
    """One layer's attention as the model runs it: the new slots start out as garbage, the
    backend stores the new K/V, then attends."""
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.meta.slot_mapping
    k_cache.view(-1, *k_cache.shape[2:])[slots] = 0
    v_cache.view(-1, *v_cache.shape[2:])[slots] = 0
    backend.store_kv(batch.new_keys, batch.new_values, k_cache, v_cache, slots)
    assert torch.equal(k_cache, batch.k_cache)
    assert torch.equal(v_cache, batch.v_cache)
    return backend.forward(batch.query, k_cache, v_cache, batch.meta, batch.scale)


def _reference(batch: PagedBatch) -> torch.Tensor:
    meta = batch.meta
    return prefill_attention_reference(
        batch.query,
        batch.k_cache,
        batch.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        batch.scale,
    )


def test_triton_backend_is_named_triton() -> None:
    assert TritonBackend.name == "triton"
    assert TritonBackend().name == "triton"


@pytest.mark.interpret
@pytest.mark.parametrize("decode_num_splits", [None, 1, 4])
def test_decode_only_step_matches_reference(decode_num_splits: int | None) -> None:
    batch = _batch([(0, 1), (40, 1), (129, 1)])
    assert batch.meta.is_decode_only
    out = _step(TritonBackend(decode_num_splits=decode_num_splits), batch)
    meta = batch.meta
    expected = decode_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    assert_close(out, expected, torch.float32)


@pytest.mark.interpret
def test_mixed_step_of_prefill_chunks_and_decodes_matches_reference() -> None:
    batch = _batch([(0, 33), (40, 1), (64, 20), (17, 1)])
    assert not batch.meta.is_decode_only
    assert_close(_step(TritonBackend(), batch), _reference(batch), torch.float32)


@pytest.mark.interpret
def test_backend_casts_new_kv_into_a_bf16_cache() -> None:
    batch = _batch([(5, 12), (0, 1)], dtype=torch.bfloat16)
    assert_close(_step(TritonBackend(), batch), _reference(batch), torch.bfloat16)


def test_decode_num_splits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="decode_num_splits"):
        TritonBackend(decode_num_splits=0)


@pytest.mark.gpu
def test_forward_on_cuda_makes_no_host_sync() -> None:
    backend = TritonBackend()
    for seqs in ([(4000, 1), (10, 1), (300, 1)], [(0, 700), (50, 1), (2000, 64)]):
        batch = make_paged_batch(
            seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=64, dtype=torch.bfloat16
        )
        k_cache, v_cache = batch.k_cache, batch.v_cache
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.store_kv(
                batch.new_keys, batch.new_values, k_cache, v_cache, batch.meta.slot_mapping
            )
            out = backend.forward(batch.query, k_cache, v_cache, batch.meta, batch.scale)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close(out, _reference(batch), torch.bfloat16)


@pytest.mark.gpu
def test_decode_replays_inside_a_cuda_graph() -> None:
    """With a fixed split count the decode launch is graph-capturable: replaying after the
    sequences grew by one token gives the eager answer."""
    backend = TritonBackend(decode_num_splits=8)
    batch = make_paged_batch(
        [(1000, 1), (63, 1), (4096, 1)],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=64,
        dtype=torch.float16,
    )
    meta = batch.meta
    static_query = batch.query.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(static_query, batch.k_cache, batch.v_cache, meta, batch.scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static_query, batch.k_cache, batch.v_cache, meta, batch.scale)
    static_query.copy_(torch.randn_like(static_query))
    meta.seq_lens.sub_(1)  # the same tables, one token shorter
    graph.replay()
    expected = decode_attention_reference(
        static_query, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale
    )
    assert_close(static_out, expected, torch.float16)
