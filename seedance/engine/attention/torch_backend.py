"""The portable attention backend: paged-cache store and attention in plain PyTorch.

Decode rows (one new token per sequence) are computed for the whole batch at once and without
copying the cache: for each KV head, one batched matmul multiplies every cache block in use by
the query of the sequence that owns it (Q·Kᵀ), the scores are gathered per sequence for a
masked softmax, and a second batched matmul weights each block's values (P·V) before the
per-block partial outputs are summed per sequence. Blocks shared by several sequences of the
step (a common prefix) are handled for the extra sequences by an explicit gather. Prefill
chunks (few per step, many tokens each) run one masked SDPA per sequence."""

from __future__ import annotations

import itertools
from collections.abc import Callable

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

        owner = [self.num_seqs] * self.n_range  # row num_seqs is a zero query
        for b, s in zip(prim_b, prim_s, strict=True):
            owner[virtual[b]] = s
        self.owner = t(owner)
        self.prim_v = t([virtual[b] for b in prim_b])
        self.prim_pair, self.prim_s = t(prim_pair), t(prim_s)
        self.has_dups = bool(dup_b)
        self.dup_b, self.dup_pair, self.dup_s = t(dup_b), t(dup_pair), t(dup_s)
        pos = torch.arange(self.max_blocks * bs, device=device)
        self.invalid = pos.unsqueeze(0) >= t(lens).unsqueeze(1)  # (S, max_blocks * bs)
        self.token_index = t([starts[r] for r in rows])


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
    q_len, num_heads, head_dim = q.shape
    kvh = k_cache.shape[2]
    group = num_heads // kvh
    k = k_cache[blocks].flatten(0, 1)[:s_len].to(q.dtype)  # (s_len, KVH, D)
    v = v_cache[blocks].flatten(0, 1)[:s_len].to(q.dtype)
    # fold the query heads of a KV head into the query axis: (KVH, q_len*group, D)
    qg = (
        q.view(q_len, kvh, group, head_dim)
        .permute(1, 0, 2, 3)
        .reshape(kvh, q_len * group, head_dim)
    )
    m = mask.repeat_interleave(group, dim=0) if group > 1 else mask
    o = F.scaled_dot_product_attention(
        qg, k.transpose(0, 1), v.transpose(0, 1), attn_mask=m, scale=scale
    )
    return (
        o.view(kvh, q_len, group, head_dim).permute(1, 0, 2, 3).reshape(q_len, num_heads, head_dim)
    )


def _paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lay: _DecodeLayout,
    scale: float,
) -> torch.Tensor:
    """One new token for each of S sequences, reading the cache in place (see module doc)."""
    s, num_heads, head_dim = query.shape
    _, bs, kvh, _ = k_cache.shape
    g = num_heads // kvh
    n, nb = lay.n_range, lay.max_blocks
    cdt = k_cache.dtype
    q = (query.to(cdt) * scale).view(s, kvh, g, head_dim)
    q_owner = torch.cat([q, q.new_zeros(1, kvh, g, head_dim)]).index_select(0, lay.owner)
    segs = lay.segments

    def per_segment(
        op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        rows: torch.Tensor,
        cache: torch.Tensor,
        h: int,
    ) -> torch.Tensor:
        """`op` of each segment's rows against its blocks' head-h cache view (no copy)."""
        parts = [op(rows[off : off + hi - lo, h], cache[lo:hi, :, h, :]) for lo, hi, off in segs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def qk(rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.bmm(rows, k.transpose(1, 2))

    # scores of every block in the segments against its owner's query: (n, KVH, g, bs)
    scores_pool = torch.stack(
        [per_segment(qk, q_owner, k_cache, h) for h in range(kvh)], dim=1
    ).float()
    pair = scores_pool.new_full((s * nb, kvh, g, bs), float("-inf"))
    pair[lay.prim_pair] = scores_pool.index_select(0, lay.prim_v)
    if lay.has_dups:
        kd = k_cache[lay.dup_b]  # (m, bs, KVH, D)
        pair[lay.dup_pair] = torch.einsum(
            "mhgd,mthd->mhgt", q.index_select(0, lay.dup_s), kd
        ).float()
    scores = pair.view(s, nb, kvh, g, bs).permute(0, 2, 3, 1, 4).reshape(s, kvh, g, nb * bs)
    probs = torch.softmax(scores.masked_fill(lay.invalid[:, None, None, :], float("-inf")), dim=-1)
    p_pair = (
        probs.view(s, kvh, g, nb, bs).permute(0, 3, 1, 2, 4).reshape(s * nb, kvh, g, bs).to(cdt)
    )
    p_pool = p_pair.new_zeros(n, kvh, g, bs)
    p_pool[lay.prim_v] = p_pair.index_select(0, lay.prim_pair)
    out_pool = torch.stack(
        [per_segment(torch.bmm, p_pool, v_cache, h) for h in range(kvh)], dim=1
    )  # (n, KVH, g, D)
    out = out_pool.new_zeros(s, kvh, g, head_dim)
    out.index_add_(0, lay.prim_s, out_pool.index_select(0, lay.prim_v))
    if lay.has_dups:
        vd = v_cache[lay.dup_b]
        out.index_add_(
            0, lay.dup_s, torch.einsum("mhgt,mthd->mhgd", p_pair.index_select(0, lay.dup_pair), vd)
        )
    return out.view(s, num_heads, head_dim).to(query.dtype)
