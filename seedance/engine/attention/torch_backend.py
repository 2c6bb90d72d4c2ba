"""The portable attention backend: paged-cache store and attention in plain PyTorch.

Decode rows (one new token per sequence) are computed for the whole batch at once and without
copying the cache, as split-K attention with one split per cache block: the blocks in use are
read in place over a few contiguous ranges of block ids, each block attends its owner's query
(the query heads of a KV head are the query rows of one problem) through ATen's CPU flash
kernel, which returns the block's normalised output and log-sum-exp, and the blocks of a
sequence are merged with weights `exp(lse_b - max lse)`. Blocks shared by several sequences of
the step (a common prefix) are gathered for the extra sequences. Prefill chunks (few per step,
many tokens each) run one masked SDPA per sequence (4-D inputs: ATen's CPU flash kernel)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from seedance.engine.attention.metadata import AttentionMetadata


class _DecodeLayout:
    """Per-step indexing of the decode rows' blocks, shared by every layer."""

    def __init__(
        self, rows: list[int], meta: AttentionMetadata, starts: list[int], seq_lens: tuple[int, ...]
    ) -> None:
        bs = meta.block_size
        tables = meta.block_tables.tolist()
        self.num_seqs = len(rows)
        lens = [seq_lens[r] for r in rows]
        nblocks = [-(-n // bs) for n in lens]
        self.max_blocks = max(nblocks)
        seen: set[int] = set()
        prim_b: list[int] = []
        prim_pair: list[int] = []
        prim_s: list[int] = []
        dup_b: list[int] = []
        dup_pair: list[int] = []
        dup_s: list[int] = []
        for s, (r, nb) in enumerate(zip(rows, nblocks, strict=True)):
            table = tables[r]
            for j in range(nb):
                b = table[j]
                if b in seen:
                    dup_b.append(b)
                    dup_pair.append(s * self.max_blocks + j)
                    dup_s.append(s)
                else:
                    seen.add(b)
                    prim_b.append(b)
                    prim_pair.append(s * self.max_blocks + j)
                    prim_s.append(s)
        device = meta.block_tables.device
        # The cache is read in place over a few contiguous segments of block ids that cover
        # every primary block; a "virtual" index numbers the blocks of the segments in order.
        self.segments = _segments(sorted(prim_b))
        virtual: dict[int, int] = {}
        for lo, hi, offset in self.segments:
            for b in range(lo, hi):
                virtual[b] = offset + b - lo
        self.n_range = self.segments[-1][2] + self.segments[-1][1] - self.segments[-1][0]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        owner = [self.num_seqs] * self.n_range  # row num_seqs collects the unused blocks
        valid = [bs] * self.n_range  # unused blocks: unmasked, their output is discarded
        for b, p, s in zip(prim_b, prim_pair, prim_s, strict=True):
            owner[virtual[b]] = s
            valid[virtual[b]] = min(bs, lens[s] - (p % self.max_blocks) * bs)
        self.owner = t(owner)
        self.mask = _tail_mask(valid, bs, device)
        self.has_dups = bool(dup_b)
        self.dup_b, self.dup_s = t(dup_b), t(dup_s)
        self.dup_mask = _tail_mask(
            [
                min(bs, lens[s] - (p % self.max_blocks) * bs)
                for p, s in zip(dup_pair, dup_s, strict=True)
            ],
            bs,
            device,
        )
        self.token_index = t([starts[r] for r in rows])


def _tail_mask(valid: list[int], bs: int, device: torch.device) -> torch.Tensor:
    """Additive mask `(n, 1, 1, bs)`: 0 for the first `valid[i]` slots of block i, -inf after."""
    pos = torch.arange(bs, device=device)
    lens = torch.tensor(valid, dtype=torch.long, device=device)
    mask = torch.zeros(len(valid), bs, device=device)
    return mask.masked_fill_(pos.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))[:, None, None]


MAX_SEGMENTS = 4
MIN_GAP_BLOCKS = 8


def _segments(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(lo, hi, offset) ranges covering the sorted block ids, split at the largest gaps (at
    most MAX_SEGMENTS ranges, gaps of MIN_GAP_BLOCKS or more) so that blocks not in the batch
    are mostly skipped; offset is the range's start in the virtual index."""
    gaps = sorted(
        (
            (b - a, i)
            for i, (a, b) in enumerate(itertools.pairwise(blocks))
            if b - a > MIN_GAP_BLOCKS
        ),
        reverse=True,
    )[: MAX_SEGMENTS - 1]
    cuts = sorted(i + 1 for _, i in gaps)
    out: list[tuple[int, int, int]] = []
    offset, start = 0, 0
    for end in [*cuts, len(blocks)]:
        lo, hi = blocks[start], blocks[end - 1] + 1
        out.append((lo, hi, offset))
        offset += hi - lo
        start = end
    return out


class _StepLayout:
    """Index tensors derived once per step from the metadata and shared by every layer."""

    def __init__(self, meta: AttentionMetadata) -> None:
        qlens = meta.query_lens_list or tuple(
            (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        )
        slens = meta.seq_lens_list or tuple(meta.seq_lens.tolist())
        self.meta = meta
        starts = meta.query_start_loc.tolist()
        decode_rows = [i for i, q in enumerate(qlens) if q == 1]
        self.decode = _DecodeLayout(decode_rows, meta, starts, slens) if decode_rows else None
        self.all_decode = len(decode_rows) == len(qlens)
        self.prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
        bs = meta.block_size
        for i, q_len in enumerate(qlens):
            if q_len == 1:
                continue
            s_len = slens[i]
            blocks = meta.block_tables[i, : -(-s_len // bs)].long()
            # query j (absolute position s_len - q_len + j) sees keys at positions <= its own
            qpos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
            kpos = torch.arange(s_len).unsqueeze(0)
            self.prefills.append((starts[i], q_len, s_len, blocks, kpos <= qpos))


class TorchBackend:
    """AttentionBackend in PyTorch; runs on any device, the CPU path of the engine."""

    name = "torch"

    def __init__(self) -> None:
        self._layout: _StepLayout | None = None

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        nb, bs, h, d = k_cache.shape
        # padding rows (slot < 0, as in a batch padded to a CUDA-graph size) store nothing,
        # as in the Triton kv_store kernel
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:
            keep = slot_mapping >= 0
            slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def _layout_for(self, meta: AttentionMetadata) -> _StepLayout:
        if self._layout is None or self._layout.meta is not meta:
            self._layout = _StepLayout(meta)
        return self._layout

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        layout = self._layout_for(meta)
        decode = layout.decode
        if decode is not None and layout.all_decode:
            return _paged_decode(query, k_cache, v_cache, decode, scale)
        out = torch.empty_like(query)
        if decode is not None:
            idx = decode.token_index
            out[idx] = _paged_decode(query.index_select(0, idx), k_cache, v_cache, decode, scale)
        for start, q_len, s_len, blocks, mask in layout.prefills:
            out[start : start + q_len] = _prefill(
                query[start : start + q_len], k_cache, v_cache, blocks, s_len, mask, scale
            )
        return out


def _prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    s_len: int,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk `q` (q_len, H, D) over its first s_len cached
    tokens."""
    group = q.shape[1] // k_cache.shape[2]
    k = k_cache[blocks].flatten(0, 1)[:s_len].to(q.dtype)  # (s_len, KVH, D)
    v = v_cache[blocks].flatten(0, 1)[:s_len].to(q.dtype)
    if group > 1:  # grouped-query heads: each query head reads its KV head
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # 4-D (1, H, L, D) inputs reach ATen's CPU flash kernel (3-D ones fall back to the math path)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
    )
    return o[0].transpose(0, 1)


def _paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lay: _DecodeLayout,
    scale: float,
) -> torch.Tensor:
    """One new token for each of S sequences, reading the cache in place (see module doc)."""
    s, num_heads, head_dim = query.shape
    kvh = k_cache.shape[2]
    g = num_heads // kvh
    cdt = k_cache.dtype
    # the g query heads of a KV head are the query rows of one attention problem per block
    q = query.to(cdt).view(s, kvh, g, head_dim)
    q_owner = torch.cat([q, q.new_zeros(1, kvh, g, head_dim)]).index_select(0, lay.owner)
    outs, lses = [], []
    for lo, hi, off in lay.segments:
        o, lse = _block_attention(
            q_owner[off : off + hi - lo],
            k_cache[lo:hi],
            v_cache[lo:hi],
            lay.mask[off : off + hi - lo],
            scale,
        )
        outs.append(o)
        lses.append(lse)
    owner = lay.owner
    if lay.has_dups:
        o, lse = _block_attention(
            q.index_select(0, lay.dup_s),
            k_cache[lay.dup_b],
            v_cache[lay.dup_b],
            lay.dup_mask,
            scale,
        )
        outs.append(o)
        lses.append(lse)
        owner = torch.cat([owner, lay.dup_s])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (n, KVH, g, D), normalised per block
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses)).float()  # (n, KVH, g)
    # merge the blocks of each sequence: weights exp(lse_b - max_b lse_b), normalised
    idx = owner.view(-1, 1, 1).expand_as(lse)
    top = lse.new_full((s + 1, kvh, g), float("-inf")).scatter_reduce_(0, idx, lse, "amax")
    w = torch.exp(lse - top.index_select(0, owner))
    num = w.new_zeros(s + 1, kvh, g, head_dim).index_add_(0, owner, out.float() * w.unsqueeze(-1))
    den = w.new_zeros(s + 1, kvh, g).index_add_(0, owner, w)
    return (num[:s] / den[:s].unsqueeze(-1)).view(s, num_heads, head_dim).to(query.dtype)


def _block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` `(n, KVH, g, D)` over the `(n, bs, KVH, D)` blocks `k`/`v` (strided
    views are fine), one block per row: the block-normalised output `(n, KVH, g, D)` and its
    natural-log sum-exp `(n, KVH, g)`."""
    mask = mask.to(q.dtype)
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(
            q, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse
    scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale + mask  # (n, KVH, g, bs)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)), lse


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""ATen's CPU flash-attention kernel (reads strided K/V in place, returns the log-sum-exp)."""
