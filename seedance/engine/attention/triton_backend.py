"""The Triton attention backend: KV store, flash-decoding for decode-only steps and the paged
prefill/extend kernel for every other step. No host sync in `forward`: sizes come from the
metadata's host-side ints."""

from __future__ import annotations

import torch

from seedance.engine.attention.decode_attention import decode_attention
from seedance.engine.attention.kv_store import store_kv
from seedance.engine.attention.metadata import AttentionMetadata
from seedance.engine.attention.prefill_attention import prefill_attention


class TritonBackend:
    """Implements `AttentionBackend` with the Triton kernels (CUDA tensors, or CPU tensors under
    `TRITON_INTERPRET=1`).

    `decode_num_splits` fixes flash-decoding's split count (a CUDA graph replays one launch
    configuration); `None` picks it per step from the batch size and the longest sequence."""

    name = "triton"

    def __init__(self, decode_num_splits: int | None = None) -> None:
        if decode_num_splits is not None and decode_num_splits < 1:
            raise ValueError(f"decode_num_splits must be >= 1; got {decode_num_splits}")
        self.decode_num_splits = decode_num_splits

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.is_decode_only and query.shape[0] == meta.num_seqs:
            return decode_attention(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
                num_splits=self.decode_num_splits,
            )
        return prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            max_query_len=meta.max_query_len,
        )
