"""Tensors in, logits out: builds the model on its device and dtype, owns the paged KV cache,
turns a scheduled batch into input tensors and `AttentionMetadata`, runs the forward pass (as a
CUDA graph for decode steps on CUDA) and the sampler.

On CUDA a step's inputs go through preallocated pinned host buffers copied non_blocking, and
greedy batches sample on the device, so the only host sync of a step is reading its sampled
token ids (`SampledTokens.token_ids`), which the overlapped loop does one step later. A token
id below zero in a batch's inputs is a *future token*: `-(i + 1)` stands for row `i` of the
previous step's sampled ids, still on the device, and is resolved there."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from seedance.engine.attention.metadata import AttentionMetadata
from seedance.engine.attention.selector import select_backend
from seedance.engine.config import EngineConfig
from seedance.engine.cuda_graphs import DecodeGraphInputs, DecodeGraphs, decode_buckets
from seedance.engine.errors import EngineError
from seedance.engine.layers.sampler import Sampler, SamplerOutput, SamplingRow
from seedance.engine.loader import iter_weights
from seedance.engine.model_config import ModelConfig
from seedance.engine.models.registry import model_class
from seedance.engine.scheduler import SchedulerOutput
from seedance.engine.sequence import Sequence

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CUDA_ACTIVATION_SLACK_BYTES = 512 << 20
"""Kept free on CUDA beyond the profiled peak (allocator fragmentation, cuBLAS workspaces)."""


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise EngineError(
            "invalid_request", "device: 'cuda' requested but CUDA is not available", param="device"
        )
    return device


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
    resolved = _DTYPES[dtype]
    if device == "cpu" and resolved is torch.float16:
        raise EngineError(
            "invalid_request",
            "dtype: float16 is not supported on the CPU (use float32 or bfloat16)",
            param="dtype",
        )
    return resolved


@dataclass
class PreparedBatch:
    """The tensors of one step, ready for the forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor
    sampling_seqs: list[Sequence]
    has_future_tokens: bool = False
    """Some input ids are future tokens (< 0): rows of the previous step's sampled ids."""


@dataclass
class SampledTokens:
    """One step's sampled token ids: on the model's device (`device_ids`, what the next step's
    future tokens read) and on the host, read lazily by `token_ids()` (the step's one sync)."""

    device_ids: torch.Tensor
    logprobs: list[dict[int, float] | None]
    host_ids: list[int] | None = None
    pinned: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def token_ids(self) -> list[int]:
        if self.host_ids is None:
            assert self.pinned is not None and self.event is not None
            self.event.synchronize()
            self.host_ids = self.pinned.tolist()
        return self.host_ids


class StepStaging:
    """Preallocated host buffers for a step's integer inputs, copied to the device in two
    non_blocking transfers (one int64, one int32). On CUDA the host buffers are pinned and
    double-buffered: a set is rewritten only after the copy that last read it has run (its
    event). On the CPU the host buffers are the step's tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: list[dict[torch.dtype, torch.Tensor]] = [{}, {}]
        self._dev: dict[torch.dtype, torch.Tensor] = {}
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _buffer(
        self,
        pool: dict[torch.dtype, torch.Tensor],
        dtype: torch.dtype,
        n: int,
        device: torch.device | None,
        pin: bool,
    ) -> torch.Tensor:
        buf = pool.get(dtype)
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (0 if buf is None else buf.numel()), 4096)
            buf = torch.empty(size, dtype=dtype, device=device, pin_memory=pin)
            pool[dtype] = buf
        return buf

    def upload(self, i64: list[int], i32: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The two lists as device tensors (views of reused buffers)."""
        if not self.cuda:
            return (torch.tensor(i64, dtype=torch.int64), torch.tensor(i32, dtype=torch.int32))
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this set has run (normally long ago)
        out = []
        for values, dtype in ((i64, torch.int64), (i32, torch.int32)):
            n = len(values)
            host = self._buffer(self._host[turn], dtype, n, None, True)[:n]
            host.copy_(torch.tensor(values, dtype=dtype))
            # a fresh device buffer per dtype grows only; kernels of the previous step that read
            # it are ordered before this copy on the stream
            dev = self._buffer(self._dev, dtype, n, self.device, False)[:n]
            dev.copy_(host, non_blocking=True)
            out.append(dev)
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record()
        self._events[turn] = ev
        return out[0], out[1]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_path: Path) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.device = torch.device(resolve_device(config.device))
        self.dtype = resolve_dtype(config.dtype, self.device.type, model_cfg.torch_dtype)
        self.kv_dtype = (
            self.dtype if config.kv_cache_dtype == "auto" else _KV_DTYPES[config.kv_cache_dtype]
        )
        self.block_size = config.block_size
        self.backend = select_backend(config.attention_backend, self.device.type)
        with torch.device("meta"):
            model = model_class(model_cfg.architecture)(model_cfg, self.backend)
        model = model.to(self.dtype).to_empty(device=self.device)
        if model_cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.load_weights(iter_weights(model_path))
        self.max_positions = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        model.model.rotary.build_tables(self.device, self.max_positions)
        self.model = model.eval()
        self.staging = StepStaging(self.device)
        self._pinned_ids = (
            [
                torch.empty(config.max_batch_size, dtype=torch.int64, pin_memory=True)
                for _ in range(2)
            ]
            if self.device.type == "cuda"
            else []
        )
        self._ids_turn = 0
        self.use_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.backend.name == "triton"
        )
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.sampler = Sampler(config.seed)
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            self.graphs = self._capture_decode_graphs()

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        c = self.model_cfg
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        return per_token * self.block_size * torch.tensor([], dtype=self.kv_dtype).element_size()

    def _num_kv_blocks(self) -> int:
        if self.device.type == "cuda":
            peak = self._profile_peak_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # weights, this process's cached blocks, other processes
            budget = (
                int(total * self.config.gpu_memory_utilization)
                - used
                - peak
                - self._graph_reserve_bytes()
                - CUDA_ACTIVATION_SLACK_BYTES
            )
        else:
            budget = int(self.config.kv_cache_gb * (1 << 30))
        num_blocks = budget // self.kv_block_bytes()
        if num_blocks < 1:
            raise EngineError(
                "internal",
                "no memory left for the KV cache: raise kv_cache_gb / gpu_memory_utilization",
            )
        return int(num_blocks)

    def _graph_reserve_bytes(self) -> int:
        """Memory the decode graphs keep (their pool: the largest bucket's activations and
        logits), estimated generously; 0 without graphs."""
        if not self.use_graphs:
            return 0
        c = self.model_cfg
        rows = self.config.max_batch_size
        per_row = (4 * c.hidden_size + 2 * c.intermediate_size) * 4 + 3 * c.vocab_size * 4
        return rows * per_row + (64 << 20)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak activation memory of the largest step (`max_num_batched_tokens` tokens of one
        prompt, logits for `max_batch_size` rows), measured by running it on a scratch cache
        just large enough, before the real cache is allocated."""
        c = self.model_cfg
        n = self.config.max_num_batched_tokens
        bs = self.block_size
        nblocks = math.ceil(n / bs)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        scratch = torch.zeros(
            (2, c.num_hidden_layers, nblocks, bs, c.num_key_value_heads, c.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        scratch_bytes = scratch.numel() * scratch.element_size()
        self._attach_cache(scratch)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nblocks, dtype=torch.int32, device=dev).unsqueeze(0),
            max_query_len=n,
            max_seq_len=n,
            block_size=bs,
            query_lens_list=(n,),
            seq_lens_list=(n,),
        )
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        pos = torch.arange(n, dtype=torch.int64, device=dev) % self.max_positions
        hidden = self.model(ids, pos, meta)
        rows = min(n, self.config.max_batch_size)
        logits = self.model.compute_logits(hidden[:rows]).float()
        torch.softmax(logits, dim=-1).argmax(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - scratch_bytes
        del scratch, hidden, logits, meta, ids, pos
        self._attach_cache(torch.empty(0, device=dev))
        torch.cuda.empty_cache()
        log.info("profiled step peak: %.2f GiB of activations", peak / (1 << 30))
        return max(0, int(peak))

    def _attach_cache(self, cache: torch.Tensor) -> None:
        for i, attn in enumerate(self.model.attention_layers()):
            if cache.numel():
                attn.k_cache = cache[0, i]
                attn.v_cache = cache[1, i]
            else:
                attn.k_cache = attn.v_cache = cache

    def _allocate_kv_cache(self) -> None:
        c = self.model_cfg
        shape = (
            2,
            c.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self._attach_cache(self.kv_cache)
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 30),
        )

    # ---- CUDA graphs ------------------------------------------------------------------------

    def _capture_decode_graphs(self) -> DecodeGraphs:
        from seedance.engine.attention.decode_attention import choose_num_splits
        from seedance.engine.attention.triton_backend import TritonBackend

        backend = self.backend
        assert isinstance(backend, TritonBackend)
        max_blocks = min(self.num_blocks, math.ceil(self.max_positions / self.block_size))
        buckets = decode_buckets(self.config.max_batch_size)
        inputs = DecodeGraphInputs(buckets[-1], max_blocks, self.block_size, self.device)
        kvh = self.model_cfg.num_key_value_heads
        max_len = min(self.max_positions, self.num_blocks * self.block_size)

        def set_splits(n: int | None) -> None:
            backend.decode_num_splits = n

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            logits: torch.Tensor = self.model.compute_logits(self.model(ids, pos, meta)).float()
            return logits

        graphs = DecodeGraphs(
            forward,
            inputs,
            buckets,
            max_len,
            set_splits,
            lambda bucket: choose_num_splits(bucket, kvh, max_len),
        )
        graphs.capture()
        log.info("captured decode CUDA graphs for batch sizes %s", buckets)
        return graphs

    # ---- a step -----------------------------------------------------------------------------

    def prepare(self, batch: SchedulerOutput) -> PreparedBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qstart = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_index: list[int] = []
        sampling: list[Sequence] = []
        future = False
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_ids
            if n == 1:
                token = seq.token_ids[start]
                future = future or token < 0
                input_ids.append(token)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qstart.append(qstart[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if end == seq.num_tokens:
                logits_index.append(qstart[-1] - 1)
                sampling.append(seq)
        width = max(len(s.block_ids) for s in batch.seqs)
        tables: list[int] = []
        for s in batch.seqs:
            tables.extend(s.block_ids)
            tables.extend([0] * (width - len(s.block_ids)))
        ntok, nseq = len(input_ids), len(seq_lens)
        i64, i32 = self.staging.upload(
            input_ids + positions + slots + logits_index, qstart + seq_lens + tables
        )
        meta = AttentionMetadata(
            slot_mapping=i64[2 * ntok : 3 * ntok],
            query_start_loc=i32[: nseq + 1],
            seq_lens=i32[nseq + 1 : 2 * nseq + 1],
            block_tables=i32[2 * nseq + 1 :].view(nseq, width),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
        )
        return PreparedBatch(
            input_ids=i64[:ntok],
            positions=i64[ntok : 2 * ntok],
            meta=meta,
            logits_index=i64[3 * ntok :],
            sampling_seqs=sampling,
            has_future_tokens=future,
        )

    @torch.inference_mode()
    def forward(
        self, batch: PreparedBatch, previous: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Logits `(len(sampling_seqs), vocab)` in float32, or None when nothing samples.
        `previous`: the previous step's sampled ids on the device, which future tokens read."""
        ids = batch.input_ids
        if batch.has_future_tokens:
            if previous is None:
                raise RuntimeError("a batch with future tokens needs the previous step's ids")
            index = (-ids - 1).clamp_(0, previous.shape[0] - 1)
            ids = torch.where(ids < 0, previous.index_select(0, index), ids)
        meta = batch.meta
        graphs = self.graphs
        if graphs is not None and meta.is_decode_only:
            bucket = graphs.bucket_for(meta.num_seqs)
            if bucket is not None and ids.shape[0] == meta.num_seqs:
                if not batch.sampling_seqs:
                    return None
                logits = graphs.replay(bucket, ids, batch.positions, meta)
                return logits.index_select(0, batch.logits_index)
        hidden = self.model(ids, batch.positions, meta)
        if not batch.sampling_seqs:
            return None
        computed: torch.Tensor = self.model.compute_logits(
            hidden.index_select(0, batch.logits_index)
        ).float()
        return computed

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledTokens:
        """The next token of each row. On CUDA a greedy batch without penalties or logprobs
        samples on the device (argmax) and its ids reach the host through a pinned buffer and
        an event, read when `token_ids()` is called; other batches sample on the host."""
        if self.device.type == "cuda" and all(_device_greedy(s) for s in seqs):
            ids = logits.argmax(dim=-1)
            pinned = self._pinned_ids[self._ids_turn][: ids.shape[0]]
            self._ids_turn ^= 1
            pinned.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return SampledTokens(ids, [None] * len(seqs), pinned=pinned, event=event)
        rows = [SamplingRow(s.params, s.token_ids, s.num_prompt_tokens, s.generator) for s in seqs]
        out: SamplerOutput = self.sampler(logits.cpu(), rows)
        device_ids = torch.tensor(out.token_ids, dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        return SampledTokens(device_ids, out.logprobs, host_ids=out.token_ids)


def needs_history(seq: Sequence) -> bool:
    """Whether sampling `seq` reads its earlier tokens (penalties)."""
    p = seq.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _device_greedy(seq: Sequence) -> bool:
    return seq.params.greedy and seq.params.logprobs is None and not needs_history(seq)
