"""Request body validation: every refusal is a 400 naming the parameter."""

from __future__ import annotations

from typing import Any

import pytest

from seedance.protocol import MAX_JSON_DEPTH
from seedance.server.http.errors import HttpError
from seedance.server.http.openai_params import (
    decode_body,
    header_int,
    parse_chat,
    parse_completion,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**extra: Any) -> dict[str, Any]:
    return {**CHAT, **extra}


def refused(fn: Any, body: dict[str, Any], streaming_enabled: bool = True) -> HttpError:
    with pytest.raises(HttpError) as info:
        fn(body, streaming_enabled=streaming_enabled)
    assert info.value.status == 400
    return info.value


def test_body_must_be_a_json_object() -> None:
    assert decode_body(b'{"a": 1}') == {"a": 1}
    for body in (b"{", b"[1]", b"", b"\xff"):
        with pytest.raises(HttpError) as info:
            decode_body(body)
        assert info.value.code == "invalid_json"


def test_chat_parses_messages_and_sampling() -> None:
    parsed = parse_chat(chat(max_tokens=5, temperature=0.5, top_k=3, min_p=0.1, seed=7,
                             stop="x", presence_penalty=1.0, frequency_penalty=-1.0,
                             repetition_penalty=1.2, priority=-2, user="ignored",
                             unknown_field=True), streaming_enabled=True)
    assert parsed.messages == [{"role": "user", "content": "hi"}]
    p = parsed.params
    assert (p.max_tokens, p.temperature, p.top_k, p.min_p, p.seed, p.stop) == (
        5, 0.5, 3, 0.1, 7, ["x"])
    assert parsed.priority == -2 and not parsed.stream


def test_text_parts_are_joined() -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": "b"}]}])
    assert parse_chat(body, streaming_enabled=True).messages == [{"role": "user",
                                                                   "content": "ab"}]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    parsed = parse_chat(chat(max_tokens=5, max_completion_tokens=9), streaming_enabled=True)
    assert parsed.max_tokens == 9


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 3}, "n"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"frequency_penalty": 5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_bad_chat_parameter_names_it(extra: dict[str, Any], param: str) -> None:
    assert refused(parse_chat, chat(**extra)).param == param


def test_stream_is_refused_when_streaming_is_disabled() -> None:
    error = refused(parse_chat, chat(stream=True), streaming_enabled=False)
    assert error.param == "stream" and error.code == "streaming_disabled"


def test_include_usage_needs_stream() -> None:
    parsed = parse_chat(chat(stream=True, stream_options={"include_usage": True}),
                        streaming_enabled=True)
    assert parsed.stream and parsed.include_usage


def test_completion_prompt_forms() -> None:
    assert parse_completion({"model": "m", "prompt": "x"}, streaming_enabled=True).prompt == "x"
    assert parse_completion({"model": "m", "prompt": ["x"]}, streaming_enabled=True).prompt == "x"
    assert parse_completion({"model": "m", "prompt": [1, 2]},
                            streaming_enabled=True).prompt == [1, 2]
    assert parse_completion({"model": "m", "prompt": [[3]]}, streaming_enabled=True).prompt == [3]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "s"}, "suffix"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_completion_parameter_names_it(extra: dict[str, Any], param: str) -> None:
    body = {"model": "m", "prompt": "x", **extra}
    assert refused(parse_completion, body).param == param


def test_header_int() -> None:
    assert header_int({"x-expected-tokens": " 12 "}, "X-Expected-Tokens", minimum=1) == 12
    assert header_int({}, "X-Expected-Tokens", minimum=1) is None
    for value in ("0", "abc"):
        with pytest.raises(HttpError) as info:
            header_int({"x-expected-tokens": value}, "X-Expected-Tokens", minimum=1)
        assert info.value.param == "X-Expected-Tokens"


# -- booleans are JSON booleans (issue 12, hole 8) ---------------------------------------------

NOT_BOOLEANS = [0, 1, "", "true", [], {}, [True]]
CHAT_BOOLEANS = ["stream", "logprobs", "ignore_eos", "include_stop_str_in_output",
                 "skip_special_tokens"]
COMPLETION_BOOLEANS = ["stream", "echo", "ignore_eos", "include_stop_str_in_output",
                       "skip_special_tokens"]


@pytest.mark.parametrize("value", NOT_BOOLEANS)
@pytest.mark.parametrize("name", CHAT_BOOLEANS)
def test_chat_boolean_must_be_a_json_boolean(name: str, value: Any) -> None:
    error = refused(parse_chat, chat(**{name: value}))
    assert (error.param, error.code) == (name, "invalid_type")


@pytest.mark.parametrize("value", NOT_BOOLEANS)
@pytest.mark.parametrize("name", COMPLETION_BOOLEANS)
def test_completion_boolean_must_be_a_json_boolean(name: str, value: Any) -> None:
    error = refused(parse_completion, {"model": "m", "prompt": "x", name: value})
    assert (error.param, error.code) == (name, "invalid_type")


@pytest.mark.parametrize("value", NOT_BOOLEANS)
def test_include_usage_must_be_a_json_boolean(value: Any) -> None:
    error = refused(parse_chat, chat(stream=True, stream_options={"include_usage": value}))
    assert (error.param, error.code) == ("include_usage", "invalid_type")


def test_boolean_sampling_flags_reach_the_params() -> None:
    parsed = parse_chat(chat(ignore_eos=True, include_stop_str_in_output=True,
                             skip_special_tokens=False), streaming_enabled=True)
    p = parsed.params
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (
        True, True, False)
    defaults = parse_chat(chat(ignore_eos=None, skip_special_tokens=None),
                          streaming_enabled=True).params
    assert (defaults.ignore_eos, defaults.include_stop_str_in_output,
            defaults.skip_special_tokens) == (False, False, True)


# -- nesting is bounded before decoding (issue 12, hole 7) -------------------------------------


def test_deeply_nested_body_is_refused_before_decoding() -> None:
    deep = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(HttpError) as info:
        decode_body(deep)
    assert (info.value.status, info.value.code) == (400, "nesting_too_deep")
    at_limit = b'{"x": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_body(at_limit)["x"]
