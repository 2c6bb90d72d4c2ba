"""docs/protocol.md §2 Encodings and §3 Messages: every message in MessagePack and JSON,
unknown types, mistyped fields, forward compatibility, and the byte-level examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from seedance.protocol import (
    Accept,
    Ack,
    Batch,
    Cancel,
    ChatMessage,
    Credit,
    Delta,
    End,
    Error,
    ErrorCode,
    GoAway,
    Heartbeat,
    Hello,
    Message,
    Open,
    PayloadCodec,
    Ping,
    Pong,
    RemoteProtocolError,
    SamplingOptions,
    StreamError,
    Usage,
    Welcome,
    encode_frame,
)

EVERY_MESSAGE: list[Message] = [
    Hello(v=1, ack=0),
    Hello(v=1, ack=12, window=64, session="s-1", heartbeat=Heartbeat(30, 15, 8),
          api_key="key", client="seedance-py/0.1"),
    Welcome(v=1, session="s-1", resumed=True, ack=3, window=256, heartbeat=Heartbeat(30, 15, 8),
            max_frame=1 << 20, max_streams=256, resume_grace=30.0),
    Ack(ack=5),
    Ack(ack=5, sack=((7, 9), (11, 12)), window=128),
    Credit(stream=1, limit=64),
    Ping(tier="connection", nonce=1),
    Ping(tier="stream", nonce=2, stream=3),
    Pong(tier="session", nonce=4),
    Pong(tier="stream", nonce=5, stream=3),
    Error(code="protocol_violation", message="no"),
    GoAway(reason="draining"),
    Batch(codec="none", data=encode_frame(b"\x81\xa1t\xa3ack")),
    Batch(codec="brotli", data=b"\x0b\x02\x80hi\x03"),
    Open(seq=0, stream=1, prompt="Hello"),
    Open(seq=1, stream=2, messages=(ChatMessage("user", "Hi"),), model="tiny",
         params=SamplingOptions(max_tokens=8, temperature=0.5, top_p=0.9, top_k=40, seed=1,
                                stop=("\n",), ignore_eos=False),
         priority=-1, deadline_ms=500, credit=32, expected_tokens=20, max_latency_ms=50),
    Accept(seq=0, stream=1, token_quota=512, batch_size=8),
    Delta(seq=1, stream=1, index=0, text="Hé", tokens=(1, 2)),
    Delta(seq=2, stream=1, index=2, text="", tokens=()),
    End(seq=3, stream=1, reason="stop", usage=Usage(5, 2, 1)),
    End(seq=4, stream=2, reason="error", usage=Usage(),
        error=StreamError(code="unknown_model", message="no such model")),
    Cancel(seq=2, stream=1),
]

TYPES = {type(m) for m in EVERY_MESSAGE}


def encode(message: Message, codec: str) -> bytes:
    buffer = bytearray()
    PayloadCodec(codec).encode_into(message, buffer, 0)  # type: ignore[arg-type]
    return bytes(buffer)


def raw(payload: dict[str, Any], codec: str) -> bytes:
    return msgspec.msgpack.encode(payload) if codec == "msgpack" else msgspec.json.encode(payload)


def test_2_every_message_type_is_covered() -> None:
    assert len(TYPES) == 14


@pytest.mark.parametrize("codec", ["msgpack", "json"])
@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_2_every_message_round_trips(message: Message, codec: str) -> None:
    assert PayloadCodec(codec).decode(encode(message, codec)) == message  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_2_payload_is_a_map_with_t_naming_the_type(codec: str) -> None:
    decoded = (msgspec.msgpack.decode if codec == "msgpack" else msgspec.json.decode)(
        encode(Credit(stream=1, limit=2), codec)
    )
    assert decoded == {"t": "credit", "stream": 1, "limit": 2}


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_2_unknown_type_is_unknown_type(codec: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        PayloadCodec(codec).decode(raw({"t": "teleport", "seq": 1}, codec))  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.UNKNOWN_TYPE


@pytest.mark.parametrize("codec", ["msgpack", "json"])
@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"t": "delta", "seq": "7", "stream": 1, "index": 0, "text": "", "tokens": []}, "seq"),
        ({"t": "delta", "seq": 7, "stream": 1, "index": 0, "text": 5, "tokens": []}, "text"),
        ({"t": "delta", "seq": 7, "stream": 1, "index": 0, "text": "", "tokens": ["a"]},
         "tokens[0]"),
        ({"t": "delta", "seq": -1, "stream": 1, "index": 0, "text": "", "tokens": []}, "seq"),
        ({"t": "delta", "seq": 1, "stream": 0, "index": 0, "text": "", "tokens": []}, "stream"),
        ({"t": "delta", "seq": 1, "stream": 1, "index": 0, "text": ""}, "tokens"),
        ({"t": "credit", "stream": 1, "limit": 1.5}, "limit"),
        ({"t": "ping", "tier": "planet", "nonce": 1}, "tier"),
        ({"t": "hello", "v": 1, "ack": 0, "heartbeat": {"connection": "x", "session": 1,
                                                     "stream": 1}}, "heartbeat.connection"),
        ({"t": "hello", "v": 1, "ack": 0, "window": 0}, "window"),
        ({"t": "ack", "ack": 1, "sack": [[2, 3]] * 17}, "sack"),
        ({"t": "end", "seq": 0, "stream": 1, "reason": "bored", "usage": {}}, "reason"),
        ({"t": "open", "seq": 0, "stream": 1}, "prompt"),
        ({"t": "open", "seq": 0, "stream": 1, "prompt": "a", "messages": []}, "prompt"),
        ({"t": "open", "seq": 0, "stream": 1, "messages": [{"role": "user"}]},
         "messages[0].content"),
        ({"t": "batch", "codec": "zip", "data": b"" if False else "eA=="}, "codec"),
        ({"t": 7}, "t"),
        ({"seq": 1}, "t"),
    ],
)
def test_2_mistyped_field_is_invalid_message_naming_it(
    payload: dict[str, Any], field: str, codec: str
) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        PayloadCodec(codec).decode(raw(payload, codec))  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.INVALID_MESSAGE
    assert info.value.field == field
    assert field.split("[")[0].split(".")[-1] in info.value.message


@pytest.mark.parametrize("codec", ["msgpack", "json"])
@pytest.mark.parametrize("payload", [b"\xc1", b"\x93\x01\x02\x03", b"not json at all", b"\x81"])
def test_2_malformed_payload_is_invalid_message(codec: str, payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        PayloadCodec(codec).decode(payload)  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.INVALID_MESSAGE


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_2_unknown_extra_keys_are_ignored(codec: str) -> None:
    payload = {"t": "credit", "stream": 1, "limit": 9, "future": {"x": [1, 2]}, "z": None}
    assert PayloadCodec(codec).decode(raw(payload, codec)) == Credit(stream=1, limit=9)  # type: ignore[arg-type]


def test_2_optional_fields_may_be_absent_or_null() -> None:
    codec = PayloadCodec("msgpack")
    absent = raw({"t": "hello", "v": 1, "ack": 0}, "msgpack")
    null = raw({"t": "hello", "v": 1, "ack": 0, "session": None, "heartbeat": None,
                "api_key": None, "client": None}, "msgpack")
    assert codec.decode(absent) == codec.decode(null) == Hello(v=1, ack=0, window=256)


def test_2_messages_are_immutable() -> None:
    delta = Delta(seq=1, stream=1, index=0, text="a", tokens=(1,))
    with pytest.raises(AttributeError):
        delta.seq = 2  # type: ignore[misc]


def test_2_json_carries_batch_data_as_base64() -> None:
    assert b'"data":"AQI="' in encode(Batch(codec="none", data=b"\x01\x02"), "json")


def test_2_unknown_codec_is_refused() -> None:
    with pytest.raises(ValueError, match="codec"):
        PayloadCodec("cbor")  # type: ignore[arg-type]


# -- docs/protocol.md Appendix A: byte-level examples -----------------------------------------

HELLO_HEX = (
    "ca fe ba be 00 00 00 1d 84 a1 74 a5 68 65 6c 6c 6f a1 76 01 a3 61 63 6b 00 a6 63 6c 69 65 "
    "6e 74 a4 64 65 6d 6f"
)
DELTA_HEX = (
    "ca fe ba be 00 00 00 34 86 a1 74 a5 64 65 6c 74 61 a3 73 65 71 07 a6 73 74 72 65 61 6d 01 "
    "a5 69 6e 64 65 78 06 a4 74 65 78 74 a6 20 77 6f 72 6c 64 a6 74 6f 6b 65 6e 73 91 cd 07 7d"
)
DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _doc_hex(label: str) -> str:
    text = DOC.read_text()
    block = text.split(f"<!-- hex:{label} -->", 1)[1].split("```", 2)[1]
    return " ".join(line.split("|")[0].strip() for line in block.strip().splitlines()[1:])


def test_appendix_a_hello_frame_bytes() -> None:
    frame = encode_frame(encode(Hello(v=1, ack=0, client="demo"), "msgpack"))
    assert frame.hex(" ") == HELLO_HEX
    assert _doc_hex("hello") == HELLO_HEX


def test_appendix_a_delta_frame_bytes() -> None:
    message = Delta(seq=7, stream=1, index=6, text=" world", tokens=(1917,))
    frame = encode_frame(encode(message, "msgpack"))
    assert frame.hex(" ") == DELTA_HEX
    assert _doc_hex("delta") == DELTA_HEX
    assert len(frame) == 60


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_2_text_that_is_not_utf8_is_invalid_message(codec: str) -> None:
    if codec == "msgpack":
        payload = (b"\x86\xa1t\xa5delta\xa3seq\x00\xa6stream\x01\xa5index\x00"
                   b"\xa4text\xa2\xc3\x28\xa6tokens\x90")
    else:
        payload = b'{"t":"delta","seq":0,"stream":1,"index":0,"text":"\xc3\x28","tokens":[]}'
    with pytest.raises(RemoteProtocolError) as info:
        PayloadCodec(codec).decode(payload)  # type: ignore[arg-type]
    assert info.value.code == ErrorCode.INVALID_MESSAGE
