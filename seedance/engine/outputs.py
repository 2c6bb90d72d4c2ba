"""What the engine hands back: per-step batches of per-request deltas, and finished results."""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]


class Usage(msgspec.Struct, frozen=True):
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class RequestDelta(msgspec.Struct, frozen=True):
    """New output of one request in one engine step.

    `index` is the position (in generated tokens) of the first token in `token_ids`; `text` is
    valid UTF-8 and excludes anything that may still become a stop string. When `finished` is
    set, `finish_reason` and `usage` are too, and `error_code`/`error_message` when it failed.
    The engine loop makes a final itself only for a request the core never ran or lost track
    of (the loop's death with the request still in its inbox, say): index 0, no tokens, and
    usage counting the prompt and no generated token.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error_code: str | None = None
    error_message: str | None = None
    logprobs: list[dict[int, float]] | None = None
    first_token_time: float | None = None
    """time.monotonic() at which the first generated token was sampled (set on its delta)."""
    queue_time: float | None = None
    """Seconds the request waited before it was first scheduled (set on its first delta)."""


class StepOutput(msgspec.Struct, frozen=True):
    """Everything one engine step produced: delivered to the output callback in one call."""

    step: int
    deltas: list[RequestDelta]
    timestamp: float
    """time.monotonic() when the step's outputs were emitted."""


class CompletionOutput(msgspec.Struct, frozen=True):
    """A finished request, as the offline `LLM.generate` returns it, in prompt order."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[dict[int, float]] | None = None


class EngineStats(msgspec.Struct, frozen=True):
    """A snapshot of the engine's counters and gauges, read by the metrics endpoint."""

    num_running: int
    num_waiting: int
    num_paused: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    steps: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use."""
        if self.kv_blocks_total == 0:
            return 0.0
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total
