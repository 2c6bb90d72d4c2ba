"""How one request is sampled and when it stops (vLLM-compatible names and defaults)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from seedance.engine.errors import invalid

SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
"""A seed is a 64-bit signed integer (vLLM's range); torch's generator takes all of it."""
MAX_TOKENS_MAX = 2**31 - 1
TOP_K_MAX = 2**31 - 1
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids one request may give."""
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def is_int(value: object) -> bool:
    """A Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling and stopping parameters of one request; invalid values raise `EngineError`
    (`invalid_request`) naming the parameter. Checks that depend on the engine (stop-string
    limits, token ids in the vocabulary) are made at submit (`request_checks`)."""

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
        self.validate()

    def validate(self) -> None:
        """Every field's type and range (run at construction and again at submit)."""
        _int_in(self.max_tokens, "max_tokens", 1, MAX_TOKENS_MAX)
        _number_in(self.temperature, "temperature", 0.0, math.inf, "a finite number >= 0")
        if not 0.0 < _number(self.top_p, "top_p") <= 1.0:
            raise invalid("top_p", "must be in (0, 1]")
        _int_in(self.top_k, "top_k", -1, TOP_K_MAX, f"-1, 0 (disabled) or a positive integer <= {TOP_K_MAX}")
        _number_in(self.min_p, "min_p", 0.0, 1.0)
        if not _number(self.repetition_penalty, "repetition_penalty") > 0.0:
            raise invalid("repetition_penalty", "must be > 0")
        _number_in(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _number_in(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        if self.seed is not None:
            _int_in(self.seed, "seed", SEED_MIN, SEED_MAX)
        if self.logprobs is not None:
            _int_in(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        stop: Any = self.stop
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise invalid("stop", "must be a string or a list of strings")
            if any(not s for s in stop):
                raise invalid("stop", "stop strings must not be empty")
        ids: Any = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, list) or not all(is_int(t) for t in ids):
                raise invalid("stop_token_ids", "must be a list of integers")
            if len(ids) > MAX_STOP_TOKEN_IDS:
                raise invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
            if any(t < 0 for t in ids):
                raise invalid("stop_token_ids", "token ids must be >= 0")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise invalid(name, "must be a boolean (true or false)")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1


def _int_in(value: object, name: str, low: int, high: int, what: str | None = None) -> None:
    if not is_int(value):
        raise invalid(name, "must be an integer")
    assert isinstance(value, int)
    if not low <= value <= high:
        raise invalid(name, f"must be {what}" if what else f"must be in [{low}, {high}]")


def _number(value: object, name: str) -> float:
    if not _is_number(value):
        raise invalid(name, "must be a number")
    assert isinstance(value, int | float)
    number = float(value) if isinstance(value, float) or abs(value) < 2**1023 else math.inf
    if math.isnan(number):
        raise invalid(name, "must be a number (not NaN)")
    return number


def _number_in(
    value: object, name: str, low: float, high: float, what: str | None = None
) -> None:
    number = _number(value, name)
    if not (low <= number <= high and math.isfinite(number)):
        raise invalid(name, f"must be {what}" if what else f"must be in [{low:g}, {high:g}]")
