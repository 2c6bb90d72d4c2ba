"""How one request is sampled and when it stops (vLLM-compatible names and defaults)."""

from __future__ import annotations

import msgspec

from seedance.engine.errors import invalid


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling and stopping parameters of one request; invalid values raise `EngineError`
    (`invalid_request`) naming the parameter."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    """Return this many top logprobs per generated token (0 = only the chosen token's)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # accept a single string like the OpenAI API
            msgspec.structs.force_setattr(self, "stop", [self.stop])
        if self.max_tokens < 1:
            raise invalid("max_tokens", "must be >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise invalid("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise invalid("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise invalid("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise invalid("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise invalid("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise invalid("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise invalid("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise invalid("logprobs", "must be in [0, 20]")
        if self.stop is not None and any(not s for s in self.stop):
            raise invalid("stop", "stop strings must not be empty")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise invalid("stop_token_ids", "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1
