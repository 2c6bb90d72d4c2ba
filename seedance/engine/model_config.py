"""`ModelConfig`: the architecture facts the engine reads from a checkpoint's config.json
(its own module so that model code can name it without importing the loader)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, from a Hugging Face config.json."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    mlp_bias: bool = False
    torch_dtype: str | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    bos_token_id: int | None = None
