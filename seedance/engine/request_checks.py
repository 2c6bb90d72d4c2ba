"""The one validation every engine runs at submit, in the caller's thread: each out-of-range
parameter is refused with EngineError('invalid_request') naming it, before the request reaches
the engine thread (where a bad value could only fail later, or worse, kill the loop)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from seedance.engine.config import EngineConfig
from seedance.engine.errors import EngineError, invalid
from seedance.engine.sampling_params import SamplingParams, is_int

PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1
"""`priority` is an int32 (docs/protocol.md: an int, lower is more urgent)."""
MAX_REQUEST_ID_CHARS = 512


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a request is checked against: the model's vocabulary and context, and the
    configured stop-string limits."""

    vocab_size: int
    max_model_len: int
    max_stop_strings: int
    max_stop_string_bytes: int

    @classmethod
    def of(cls, config: EngineConfig, *, vocab_size: int, max_model_len: int) -> RequestLimits:
        return cls(
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_bytes=config.max_stop_string_bytes,
        )


def check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise invalid("request_id", "must be a non-empty string")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")


def check_params(params: object, limits: RequestLimits) -> SamplingParams:
    """`params` re-validated (a Struct can be built around its checks) plus the limits that
    depend on the engine: stop strings (count, UTF-8 bytes) and stop token ids (vocabulary)."""
    if not isinstance(params, SamplingParams):
        raise invalid("params", "must be a SamplingParams")
    params.validate()
    stop = params.stop
    if stop:
        if len(stop) > limits.max_stop_strings:
            raise invalid("stop", f"at most {limits.max_stop_strings} stop strings")
        for s in stop:
            if len(s) * 4 > limits.max_stop_string_bytes and (
                len(s.encode("utf-8", "surrogatepass")) > limits.max_stop_string_bytes
            ):
                raise invalid(
                    "stop", f"each stop string must be at most {limits.max_stop_string_bytes} "
                    "UTF-8 bytes"
                )
    if params.stop_token_ids:
        vocab = limits.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise invalid("stop_token_ids", f"token ids must be in [0, {vocab}); got {t}")
    return params


def check_priority(priority: object) -> int:
    if not is_int(priority):
        raise invalid("priority", "must be an integer")
    assert isinstance(priority, int)
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise invalid("priority", f"must be in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return priority


def check_deadline(deadline_s: object) -> float | None:
    """A soft deadline in seconds from now: None, or a finite number >= 0."""
    if deadline_s is None:
        return None
    if not isinstance(deadline_s, int | float) or isinstance(deadline_s, bool):
        raise invalid("deadline_s", "must be a number of seconds")
    try:
        value = float(deadline_s)
    except OverflowError:
        value = math.inf
    if not (value >= 0 and math.isfinite(value)):
        raise invalid("deadline_s", "must be a finite number >= 0")
    return value


def check_text(text: str, param: str) -> str:
    """`text` as a tokenizer can take it: a lone surrogate (a str with no UTF-8 form, which
    JSON's \\ud800 escapes can produce) is refused naming `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(param, f"not valid Unicode (a lone surrogate at index {exc.start})") from None
    return text


def check_prompt_ids(prompt: object, limits: RequestLimits) -> list[int]:
    """A token-id prompt: a non-empty list of ints in the vocabulary that leaves room for one
    generated token."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        raise invalid("prompt", "must be a string or a list of token ids")
    ids = list(prompt)
    vocab = limits.vocab_size
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab:
            raise invalid("prompt", f"token ids must be integers in [0, {vocab}); got {t!r}")
    return check_prompt_length(ids, limits)


def check_prompt_length(ids: list[int], limits: RequestLimits) -> list[int]:
    if not ids:
        raise invalid("prompt", "must not be empty")
    if len(ids) >= limits.max_model_len:
        raise EngineError(
            "context_length_exceeded",
            f"the prompt has {len(ids)} tokens; the context limit is {limits.max_model_len} "
            "(prompt plus at least one generated token)",
            param="prompt",
        )
    return ids
