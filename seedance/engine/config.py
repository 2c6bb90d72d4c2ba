"""The engine's configuration: one msgspec Struct with defaults and validation, shared by the
CLI, the TOML config file, the server and the offline `LLM` API."""

from __future__ import annotations

from typing import Literal

import msgspec

DEFAULT_MODEL = "seedance-tiny"
NULL_MODEL = "null"

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
KVCacheDType = Literal["auto", "fp32", "fp16", "bf16"]
AttentionBackendName = Literal["auto", "torch", "triton"]
BatchWindow = Literal["adaptive", "static"]


class ConfigError(ValueError):
    """A configuration value is invalid; `field` names the setting (and so the CLI flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, f"{field}: {message}")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the engine loads and how it schedules: model, precision, KV cache and batch limits."""

    model: str = DEFAULT_MODEL
    """A local Hugging Face directory, a hub id, `seedance-tiny` (embedded) or `null`."""
    device: Device = "auto"
    dtype: DType = "auto"
    kv_cache_dtype: KVCacheDType = "auto"
    attention_backend: AttentionBackendName = "auto"
    block_size: int = 64
    max_batch_size: int = 64
    max_num_batched_tokens: int = 2048
    max_queued_requests: int = 1024
    """Requests that may wait beyond the batch's free slots (max_batch_size - running); 0 means
    requests are accepted only while the batch has room."""
    max_model_len: int | None = None
    """Context limit; None means the model's own `max_position_embeddings`."""
    kv_cache_gb: float = 1.0
    """KV cache size on CPU, in GiB."""
    gpu_memory_utilization: float = 0.90
    """Fraction of the GPU's memory the engine may use (weights + KV cache) on CUDA."""
    enable_prefix_caching: bool = True
    batch_window: BatchWindow = "static"
    """`static`: up to max_batch_size sequences per step. `adaptive`: the seed's window that
    narrows under sparse traffic (lower time per token, much higher time to first token on a
    slow engine; see docs/engine.md), so it is opt-in."""
    enforce_eager: bool = False
    """Turn off CUDA graphs."""
    overlap: bool | None = None
    """Overlap the CPU's scheduling and emitting with the device's compute (tokens are read back
    one step late); None means on for CUDA, off on the CPU."""
    no_torch_compile_fallback: bool = False
    """Never fall back to torch.compile'd paths at run time (accepted; seedance compiles nothing lazily)."""
    trace_output: str | None = None
    """Write a Chrome trace-event JSON of every step and token to this file."""
    seed: int = 0
    max_stop_strings: int = 16
    """Most stop strings one request may give (each is matched against every output token)."""
    max_stop_string_bytes: int = 256
    """Longest stop string, in UTF-8 bytes: the per-token stop scan costs about this much."""

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must not be empty")
        _require(self.block_size in (16, 32, 64, 128), "block_size", "must be 16, 32, 64 or 128")
        _require(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        _require(
            self.max_num_batched_tokens >= self.block_size,
            "max_num_batched_tokens",
            f"must be >= block_size ({self.block_size})",
        )
        _require(self.max_queued_requests >= 0, "max_queued_requests", "must be >= 0")
        _require(
            self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1"
        )
        _require(self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0")
        _require(self.max_stop_strings >= 0, "max_stop_strings", "must be >= 0")
        _require(self.max_stop_string_bytes >= 1, "max_stop_string_bytes", "must be >= 1")
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "must be in (0, 1]",
        )
