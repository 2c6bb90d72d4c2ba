"""Decode steps captured as CUDA graphs, one per bucketed batch size: static input buffers
(token ids, positions, slot mapping, block tables, sequence lengths) that each step copies its
inputs into, padding the rows past its batch (slot -1: nothing stored; seq_len 0: zero output),
and the graph replayed instead of launching every kernel from Python."""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from seedance.engine.attention.metadata import AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids, positions, meta) -> float32 logits, one row per token."""


def decode_buckets(max_batch_size: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 8, and `max_batch_size`."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def bucket_for(buckets: list[int], num_seqs: int) -> int | None:
    """The smallest bucket holding `num_seqs` sequences, or None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class DecodeGraphInputs:
    """The static buffers a captured decode reads, sized for the largest bucket."""

    def __init__(
        self, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> None:
        self.max_batch = max_batch
        self.block_size = block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            max_batch, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def meta(self, bucket: int, max_seq_len: int) -> AttentionMetadata:
        """The metadata of a `bucket`-row decode over the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            query_lens_list=(1,) * bucket,
        )

    def fill(
        self,
        bucket: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Copy one decode step's inputs (n <= bucket rows) into the buffers and pad rows
        n..bucket: token 0 at position 0, slot -1 (stores nothing), seq_len 0 (zero output).
        Device-to-device copies only, no host sync."""
        n = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        if n > bucket or bucket > self.max_batch or width > self.block_tables.shape[1]:
            raise ValueError(
                f"a decode of {n} rows x {width} blocks does not fit bucket {bucket} "
                f"(buffers: {self.max_batch} x {self.block_tables.shape[1]})"
            )
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].zero_()


class DecodeGraphs:
    """Captures `forward` for each bucket (CUDA only) and replays the smallest bucket that
    holds a decode step. `set_num_splits(bucket)` is called before each capture so that the
    attention backend bakes a fixed flash-decoding split count into that graph."""

    def __init__(
        self,
        forward: Forward,
        inputs: DecodeGraphInputs,
        buckets: list[int],
        max_seq_len: int,
        set_num_splits: Callable[[int | None], None],
        num_splits_for: Callable[[int], int],
    ) -> None:
        self.forward = forward
        self.inputs = inputs
        self.buckets = buckets
        self.max_seq_len = max_seq_len
        self._set_num_splits = set_num_splits
        self._num_splits_for = num_splits_for
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        pool = None
        try:
            for bucket in reversed(self.buckets):
                self._set_num_splits(self._num_splits_for(bucket))
                meta = self.inputs.meta(bucket, self.max_seq_len)
                ids = self.inputs.input_ids[:bucket]
                pos = self.inputs.positions[:bucket]
                self.forward(ids, pos, meta)  # warm-up: compiles the kernels outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bucket] = self.forward(ids, pos, meta)
                if pool is None:
                    pool = graph.pool()
                self.graphs[bucket] = graph
        finally:
            self._set_num_splits(None)
        torch.cuda.synchronize()

    def bucket_for(self, num_seqs: int) -> int | None:
        return bucket_for(self.buckets, num_seqs)

    def replay(
        self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits `(n, vocab)` of a decode step of n <= bucket sequences (a view of the graph's
        static output: valid until the next replay)."""
        self.inputs.fill(bucket, input_ids, positions, meta)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.logits[bucket][: input_ids.shape[0]]
