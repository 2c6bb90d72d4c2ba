"""The `null` engine: the real engine loop, scheduler, block manager and detokenizer over a
step core whose "model" emits instant deterministic tokens (`null_core.NullCore`). It measures
the server alone and makes server tests fast and reproducible.

Tokenizer: byte level (`byte_tokenizer`: token id = byte value, plus BOS/EOS/PAD specials),
with a plain chat template. Output: a fixed English text read from an offset that depends only
on the prompt (greedy) or on the prompt and seed (sampled), so the same request always yields
the same text. KV blocks are simulated (`block_size` tokens each, `BLOCKS_PER_GIB` per GiB of
`kv_cache_gb`) so that block accounting and preemption are observable."""

from __future__ import annotations

from seedance.engine.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer
from seedance.engine.config import EngineConfig
from seedance.engine.engine_loop import EngineLoop
from seedance.engine.null_core import BLOCKS_PER_GIB, DEFAULT_MAX_MODEL_LEN, OUTPUT_TEXT, NullCore

__all__ = [
    "BLOCKS_PER_GIB",
    "BOS_ID",
    "DEFAULT_MAX_MODEL_LEN",
    "EOS_ID",
    "OUTPUT_TEXT",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "NullEngine",
]


class NullEngine(EngineLoop):
    """EngineInterface with instant deterministic tokens; see the module docstring.

    `eos_after`: emit EOS as the n-th generated token (unless `ignore_eos`); None = never, so
    requests end by `max_tokens`, a stop string/token, the context limit or an abort."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        eos_after: int | None = None,
        served_name: str = "null",
    ) -> None:
        self.null_core = NullCore(config, eos_after=eos_after)
        self.config = config
        self.tokenizer: ByteTokenizer = self.null_core.tokenizer
        super().__init__(self.null_core, model_name=served_name, thread_name="seedance-null-engine")
