"""Tensors in, logits out: builds the model on its device and dtype, owns the paged KV cache,
turns a scheduled batch into input tensors and `AttentionMetadata`, runs the forward pass and
the sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from seedance.engine.attention.metadata import AttentionMetadata
from seedance.engine.attention.selector import select_backend
from seedance.engine.config import EngineConfig
from seedance.engine.errors import EngineError
from seedance.engine.layers.sampler import Sampler, SamplerOutput, SamplingRow
from seedance.engine.loader import ModelConfig, iter_weights
from seedance.engine.models.registry import model_class
from seedance.engine.scheduler import SchedulerOutput
from seedance.engine.sequence import Sequence

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CUDA_ACTIVATION_SLACK_BYTES = 512 << 20


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
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.sampler = Sampler(config.seed)

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        c = self.model_cfg
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        return per_token * self.block_size * torch.tensor([], dtype=self.kv_dtype).element_size()

    def _num_kv_blocks(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            c = self.model_cfg
            act = (
                self.config.max_num_batched_tokens
                * (6 * c.hidden_size + 4 * c.intermediate_size)
                * 4
                + self.config.max_batch_size * c.vocab_size * 8
            )
            budget = (
                int(total * self.config.gpu_memory_utilization)
                - used
                - act
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
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / (1 << 30),
        )

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
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_ids
            if n == 1:
                slots.append(table[start // bs] * bs + start % bs)
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qstart.append(qstart[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            if end == seq.num_tokens:
                logits_index.append(qstart[-1] - 1)
                sampling.append(seq)
        width = max(len(s.block_ids) for s in batch.seqs)
        tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qstart, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
        )
        return PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            logits_index=torch.tensor(logits_index, dtype=torch.int64, device=dev),
            sampling_seqs=sampling,
        )

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor | None:
        """Logits `(len(sampling_seqs), vocab)` in float32, or None when nothing samples."""
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        if not batch.sampling_seqs:
            return None
        return self.model.compute_logits(hidden.index_select(0, batch.logits_index)).float()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        rows = [SamplingRow(s.params, s.token_ids, s.num_prompt_tokens, s.generator) for s in seqs]
        return self.sampler(logits.cpu(), rows)
