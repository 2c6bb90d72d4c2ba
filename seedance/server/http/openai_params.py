"""Parsing and validation of OpenAI-style request bodies (`/v1/chat/completions`,
`/v1/completions`) into token ids and SamplingParams; every refusal is an HttpError(400)
naming the parameter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from seedance.engine.errors import EngineError
from seedance.engine.sampling_params import SamplingParams
from seedance.protocol import MAX_JSON_DEPTH, exceeds_json_depth
from seedance.server.http.errors import bad_request, from_engine_error

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class ParsedRequest:
    """What a generation endpoint needs from its body."""

    model: str
    params: SamplingParams
    max_tokens: int | None
    """As given by the client (None: up to the token quota)."""
    stream: bool
    include_usage: bool
    priority: int
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body, its nesting checked before it is decoded (the
    decoder recurses once per level)."""
    if exceeds_json_depth(body):
        raise bad_request(
            f"request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels",
            code="nesting_too_deep",
        )
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"{name}: must be an integer", name, "invalid_type")
    return int(value)


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name}: must be a number", name, "invalid_type")
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A JSON `true`/`false` (absent or null: `default`); 0, "", [] and {} are refused."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: must be a boolean", name, "invalid_type")
    return value


def _stop(body: dict[str, Any]) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("stop: must be a string or a list of strings", "stop", "invalid_type")
    return value or None


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: a model name is required", "model", "missing_required_parameter")
    return model


def _common(body: dict[str, Any], *, streaming_enabled: bool) -> dict[str, Any]:
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad_request("n: only n=1 is supported", "n", "unsupported_value")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("best_of: only best_of=1 is supported", "best_of", "unsupported_value")
    stream = _bool(body, "stream")
    if stream and not streaming_enabled:
        raise bad_request(
            "stream: streaming is disabled on this server (--streaming-enabled false)",
            "stream",
            "streaming_disabled",
        )
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options: only allowed with stream=true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request("stream_options: must be an object", "stream_options", "invalid_type")
        include_usage = _bool(options, "include_usage")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (
        not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids)
    ):
        raise bad_request(
            "stop_token_ids: must be a list of integers", "stop_token_ids", "invalid_type"
        )
    sampling: dict[str, Any] = {
        "temperature": _number(body, "temperature"),
        "top_p": _number(body, "top_p"),
        "top_k": _int(body, "top_k"),
        "min_p": _number(body, "min_p"),
        "seed": _int(body, "seed"),
        "stop": _stop(body),
        "stop_token_ids": stop_token_ids,
        "presence_penalty": _number(body, "presence_penalty"),
        "frequency_penalty": _number(body, "frequency_penalty"),
        "repetition_penalty": _number(body, "repetition_penalty"),
        "ignore_eos": _bool(body, "ignore_eos"),
        "include_stop_str_in_output": _bool(body, "include_stop_str_in_output"),
        "skip_special_tokens": _bool(body, "skip_special_tokens", default=True),
    }
    return {
        "sampling": {k: v for k, v in sampling.items() if v is not None},
        "stream": stream,
        "include_usage": include_usage,
        "priority": _int(body, "priority") or 0,
    }


def _params(
    sampling: dict[str, Any], max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            logprobs=logprobs,
            **sampling,
        )
    except EngineError as exc:
        raise from_engine_error(exc) from None
    except (TypeError, ValueError) as exc:
        raise bad_request(f"invalid sampling parameters: {exc}") from None


def _message_content(index: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(
                    f"messages[{index}].content: only text parts are supported", "messages"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(
        f"messages[{index}].content: must be a string or a list of text parts",
        "messages",
        "invalid_type",
    )


def parse_chat(body: dict[str, Any], *, streaming_enabled: bool) -> ParsedRequest:
    """A `/v1/chat/completions` body."""
    model = _model(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty list", "messages")
    messages: list[dict[str, str]] = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}]: must be an object with a string role", "messages")
        messages.append(
            {"role": message["role"], "content": _message_content(i, message.get("content"))}
        )
    common = _common(body, streaming_enabled=streaming_enabled)
    max_tokens = _int(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _int(body, "max_tokens"), "max_tokens"
    logprobs: int | None = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs") or 0
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs: requires logprobs=true", "top_logprobs")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{name}: must be >= 1", name, "invalid_value")
    params = _params(common["sampling"], max_tokens, logprobs)
    return ParsedRequest(
        model=model,
        params=params,
        max_tokens=max_tokens,
        stream=common["stream"],
        include_usage=common["include_usage"],
        priority=common["priority"],
        messages=messages,
    )


def parse_completion(body: dict[str, Any], *, streaming_enabled: bool) -> ParsedRequest:
    """A `/v1/completions` body."""
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise bad_request(
                "prompt: must be a string or one list of token ids "
                "(batched prompts are not supported)",
                "prompt",
            )
    elif not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt: must be a non-empty string or a list of token ids", "prompt")
    if _bool(body, "echo"):
        raise bad_request("echo: not supported", "echo", "unsupported_value")
    if body.get("suffix") is not None:
        raise bad_request("suffix: not supported", "suffix", "unsupported_value")
    common = _common(body, streaming_enabled=streaming_enabled)
    max_tokens = _int(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("max_tokens: must be >= 1", "max_tokens", "invalid_value")
    logprobs = _int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    params = _params(common["sampling"], max_tokens, logprobs)
    return ParsedRequest(
        model=model,
        params=params,
        max_tokens=max_tokens,
        stream=common["stream"],
        include_usage=common["include_usage"],
        priority=common["priority"],
        prompt=prompt,
    )


def header_int(headers: dict[str, str], name: str, *, minimum: int) -> int | None:
    """An integer request header (e.g. X-Expected-Tokens), or 400 naming it."""
    value = headers.get(name.lower())
    if value is None:
        return None
    try:
        number = int(value.strip())
    except ValueError:
        raise bad_request(f"{name}: must be an integer", name) from None
    if number < minimum:
        raise bad_request(f"{name}: must be >= {minimum}", name)
    return number
