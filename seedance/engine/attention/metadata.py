"""Per-step attention inputs shared by every layer: where new tokens' K/V go and which cached
blocks each sequence reads.

Cache layout (per layer): `k_cache`, `v_cache` of shape
`(num_blocks, block_size, num_kv_heads, head_dim)`; token `p` of a sequence lives in block
`block_tables[s, p // block_size]` at offset `p % block_size`, i.e. flat slot
`block_id * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's batch layout. The step's new tokens are packed sequence after sequence."""

    slot_mapping: torch.Tensor
    """int64 `(num_tokens,)`: flat cache slot of each new token."""
    query_start_loc: torch.Tensor
    """int32 `(num_seqs + 1,)`: cumulative new-token counts; seq s owns rows
    `query_start_loc[s]:query_start_loc[s+1]` of q."""
    seq_lens: torch.Tensor
    """int32 `(num_seqs,)`: tokens in the cache for each sequence after this step's store
    (cached prefix + new tokens)."""
    block_tables: torch.Tensor
    """int32 `(num_seqs, max_blocks_per_seq)`: block ids, padded with 0 past each sequence's end."""
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_list: tuple[int, ...] = ()
    """Host copies of the per-sequence new-token counts (avoid device syncs in Python loops)."""
    seq_lens_list: tuple[int, ...] = ()
    """Host copies of `seq_lens`."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every sequence adds exactly one token (the decode fast path)."""
        return self.max_query_len == 1
