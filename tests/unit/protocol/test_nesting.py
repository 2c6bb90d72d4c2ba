"""seedance.protocol._nesting: the JSON depth scanner agrees with the real depth of a document
at every limit, ignores brackets inside strings (escapes honoured), stays linear on hostile
input, and the payload codecs refuse a deep payload as `invalid_message` before msgspec
recurses."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seedance.protocol import (
    MAX_JSON_DEPTH,
    ClientConnection,
    HelloReceived,
    PeerError,
    RemoteProtocolError,
    ServerConnection,
    Welcomed,
    exceeds_json_depth,
)
from seedance.protocol._framing import encode_frame
from seedance.protocol.messages import Ack, PayloadCodec


def depth_of(value: Any) -> int:
    """Arrays and objects nested in `value` (an empty one counts as a level)."""
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


def nested(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=6)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | TRICKY_TEXT,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(TRICKY_TEXT, children, max_size=3),
    max_leaves=40,
)


@given(JSON_VALUES, st.integers(min_value=0, max_value=10))
def test_agrees_with_the_real_depth(value: Any, limit: int) -> None:
    assert exceeds_json_depth(json.dumps(value).encode(), limit) == (depth_of(value) > limit)


@pytest.mark.parametrize(("open_", "close"), [(b"[", b"]"), (b'{"k":', b"}")])
def test_the_default_limit_is_inclusive(open_: bytes, close: bytes) -> None:
    assert not exceeds_json_depth(nested(MAX_JSON_DEPTH, open_, close))
    assert exceeds_json_depth(nested(MAX_JSON_DEPTH + 1, open_, close))


def test_mixed_arrays_and_objects_count_alike() -> None:
    doc = b'{"a":[{"b":[' * 16 + b"1" + b"]}]}" * 16  # 64 levels
    assert not exceeds_json_depth(doc)
    assert exceeds_json_depth(b"[" + doc + b"]")


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"content": "[" * 1000 + '\\" {{{ \\\\" [[['}).encode()
    assert not exceeds_json_depth(text)


def test_an_escaped_backslash_ends_the_string_before_real_brackets() -> None:
    doc = b'["x\\\\", ' + nested(MAX_JSON_DEPTH) + b"]"  # "x\\" is a whole string
    assert exceeds_json_depth(doc)
    quoted = b'["x\\", ' + nested(MAX_JSON_DEPTH) + b'"]'  # \" keeps the string open
    assert not exceeds_json_depth(quoted)


def test_unclosed_deep_nesting_counts() -> None:
    assert exceeds_json_depth(b"[" * 100_000)
    assert not exceeds_json_depth(b"[" * MAX_JSON_DEPTH)


def test_unterminated_string_hides_what_follows() -> None:
    """A decoder stops at the string it cannot end, so brackets after it never nest."""
    assert not exceeds_json_depth(b'["never ends ' + nested(1000))


def test_stops_at_a_close_that_opens_nothing() -> None:
    """A decoder refuses the document at a stray `]`: what follows is never parsed."""
    assert not exceeds_json_depth(b"[]]" + nested(1000))


@pytest.mark.parametrize(
    "hostile",
    [
        b'"\\"' * (1 << 19),  # unterminated escapes: a retrying regex would be quadratic
        b"[]" * (1 << 19),
        (b"[" * 64 + b"]" * 64) * (1 << 13),
        b"[" + b"[[]" * (1 << 18),
    ],
    ids=["escapes", "pairs", "blocks", "staircase"],
)
def test_hostile_megabyte_is_scanned_in_linear_time(hostile: bytes) -> None:
    started = time.perf_counter()
    exceeds_json_depth(hostile)
    assert time.perf_counter() - started < 2.0  # ~20 ms measured; quadratic would be hours


# -- the payload codecs ------------------------------------------------------------------------


def _deep_ack(codec: str, depth: int) -> bytes:
    if codec == "json":
        return b'{"t":"ack","ack":3,"x":' + nested(depth) + b"}"
    head = msgspec.msgpack.encode({"t": "ack", "ack": 3})
    return b"\x83" + head[1:] + b"\xa1x" + b"\x91" * depth + b"\xc0"


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_codec_refuses_deep_payload_as_invalid_message(codec: Any) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        PayloadCodec(codec).decode(_deep_ack(codec, 100_000))
    assert info.value.code == "invalid_message"
    assert info.value.close_code == 1002


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_codec_accepts_an_unknown_field_within_the_limit(codec: Any) -> None:
    message = PayloadCodec(codec).decode(_deep_ack(codec, MAX_JSON_DEPTH - 1))
    assert message == Ack(ack=3)


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_server_connection_answers_a_deep_frame_with_an_error(codec: Any) -> None:
    client, server = ClientConnection(codec=codec), ServerConnection(codec=codec)
    client.send_hello()
    server.receive_data(client.data_to_send(0.0), 0.0)
    assert isinstance(server.next_event(), HelloReceived)
    server.welcome(None)
    client.receive_data(server.data_to_send(0.0), 0.0)
    assert isinstance(client.next_event(), Welcomed)
    with pytest.raises(RemoteProtocolError) as info:
        server.receive_data(encode_frame(_deep_ack(codec, 100_000)), 0.0)
    assert info.value.code == "invalid_message"
    client.receive_data(server.data_to_send(0.0), 0.0)
    event = client.next_event()
    assert isinstance(event, PeerError)
    assert (event.code, event.close_code) == ("invalid_message", 1002)
