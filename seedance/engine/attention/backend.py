"""The interface every attention backend implements; the model code calls nothing else."""

from __future__ import annotations

from typing import Protocol

import torch

from seedance.engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores new K/V into the paged cache and computes causal attention over it."""

    name: str

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write `key`/`value` `(num_tokens, num_kv_heads, head_dim)` into the slots given by
        `slot_mapping` (cast to the cache dtype)."""

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of `query` `(num_tokens, num_heads, head_dim)` over each sequence's cached
        tokens (its prefix and this step's new tokens, already stored), causally: the new token
        at position `seq_len - query_len + i` sees positions `<=` its own. Grouped-query
        attention: query head h reads KV head `h // (num_heads // num_kv_heads)`. Returns
        `(num_tokens, num_heads, head_dim)` in the query's dtype."""
