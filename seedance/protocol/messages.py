"""The wire messages of protocol v1 (docs/protocol.md §3) as frozen msgspec Structs, a tagged
union on `t`, and the MessagePack and JSON payload codecs that decode them with the errors of
§12 (`unknown_type`, `invalid_message` naming the field)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal

import msgspec

from ._nesting import MAX_JSON_DEPTH, exceeds_json_depth
from .errors import ErrorCode, RemoteProtocolError

__all__ = [
    "RELIABLE_TYPES",
    "Accept",
    "Ack",
    "Batch",
    "Cancel",
    "ChatMessage",
    "Codec",
    "Credit",
    "Delta",
    "End",
    "Error",
    "GoAway",
    "Heartbeat",
    "Hello",
    "Message",
    "Open",
    "PayloadCodec",
    "Ping",
    "Pong",
    "ReliableMessage",
    "SamplingOptions",
    "StreamError",
    "Usage",
    "Welcome",
]

Codec = Literal["msgpack", "json"]
Tier = Literal["connection", "session", "stream"]
EndReason = Literal["stop", "length", "cancelled", "timeout", "error"]

Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
StreamId = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
WindowSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


class _Wire(msgspec.Struct, frozen=True, tag_field="t", omit_defaults=True):
    """Base of every message: the tag `t` is the message type."""


# -- parts -------------------------------------------------------------------------------------


class Heartbeat(msgspec.Struct, frozen=True):
    """Heartbeat intervals in seconds, one per tier (§10)."""

    connection: Seconds
    session: Seconds
    stream: Seconds


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class SamplingOptions(msgspec.Struct, frozen=True, omit_defaults=True):
    """`open.params` (§3.2.1); absent fields take the server's defaults. Only types are checked
    here: a value out of range is the request's fault, answered with a stream `invalid_request`
    by the server, never a connection error (§3.2.1)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    ignore_eos: bool | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_tokens: Count = 0


class StreamError(msgspec.Struct, frozen=True):
    """`end.error`: a stream error code (§12.2) and a human-readable message."""

    code: str
    message: str = ""


# -- control messages (§3.1) -------------------------------------------------------------------


class Hello(_Wire, frozen=True, tag="hello"):
    v: int
    ack: Seq
    window: WindowSize = 256
    session: str | None = None
    heartbeat: Heartbeat | None = None
    api_key: str | None = None
    client: str | None = None


class Welcome(_Wire, frozen=True, tag="welcome"):
    v: int
    session: str
    resumed: bool
    ack: Seq
    window: WindowSize
    heartbeat: Heartbeat
    max_frame: Annotated[int, msgspec.Meta(ge=64, le=2**32 - 1)]
    max_streams: Annotated[int, msgspec.Meta(ge=1)]
    resume_grace: Annotated[float, msgspec.Meta(ge=0)]


class Ack(_Wire, frozen=True, tag="ack"):
    ack: Seq
    sack: Annotated[tuple[tuple[Seq, Seq], ...], msgspec.Meta(max_length=16)] = ()
    window: WindowSize | None = None


class Credit(_Wire, frozen=True, tag="credit"):
    stream: StreamId
    limit: Count


class Ping(_Wire, frozen=True, tag="ping"):
    tier: Tier
    nonce: Count
    stream: StreamId | None = None


class Pong(_Wire, frozen=True, tag="pong"):
    tier: Tier
    nonce: Count
    stream: StreamId | None = None


class Error(_Wire, frozen=True, tag="error"):
    code: str
    message: str = ""


class GoAway(_Wire, frozen=True, tag="goaway"):
    reason: str = ""


class Batch(_Wire, frozen=True, tag="batch"):
    codec: Literal["none", "brotli"]
    data: bytes


# -- reliable messages (§3.2) ------------------------------------------------------------------


class Open(_Wire, frozen=True, tag="open"):
    seq: Seq
    stream: StreamId
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    model: str | None = None
    params: SamplingOptions | None = None
    priority: int = 0
    deadline_ms: Count | None = None
    credit: Count | None = None
    expected_tokens: Count | None = None
    max_latency_ms: Count | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` and `messages` is required - at `$.prompt`")


class Accept(_Wire, frozen=True, tag="accept"):
    seq: Seq
    stream: StreamId
    token_quota: Count
    batch_size: Count


class Delta(_Wire, frozen=True, tag="delta"):
    seq: Seq
    stream: StreamId
    index: Count
    text: str
    tokens: tuple[TokenId, ...]


class End(_Wire, frozen=True, tag="end"):
    seq: Seq
    stream: StreamId
    reason: EndReason
    usage: Usage
    error: StreamError | None = None


class Cancel(_Wire, frozen=True, tag="cancel"):
    seq: Seq
    stream: StreamId


ReliableMessage = Open | Accept | Delta | End | Cancel
Message = Hello | Welcome | Ack | Credit | Ping | Pong | Error | GoAway | Batch | ReliableMessage
RELIABLE_TYPES: Final = (Open, Accept, Delta, End, Cancel)

_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def _remote_error(exc: msgspec.MsgspecError) -> RemoteProtocolError:
    text = str(exc)
    match = _AT.search(text)
    path = match.group(1) if match else ""
    if path == "t" and text.startswith("Invalid value"):
        return RemoteProtocolError(ErrorCode.UNKNOWN_TYPE, text, field="t")
    if text == "Object missing required field `t`":
        return RemoteProtocolError(ErrorCode.INVALID_MESSAGE, text, field="t")
    missing = re.match(r"Object missing required field `([^`]*)`( - at `\$\.?([^`]*)`)?$", text)
    if missing:
        prefix = missing.group(3)
        path = f"{prefix}.{missing.group(1)}" if prefix else missing.group(1)
    return RemoteProtocolError(ErrorCode.INVALID_MESSAGE, text, field=path or "$")


class PayloadCodec:
    """Encodes messages to frame payloads and decodes payloads to messages for one encoding."""

    __slots__ = ("_decode", "_encode_into", "name", "raw_decode", "raw_encode")

    def __init__(self, name: Codec) -> None:
        self.name: Codec = name
        if name == "msgpack":
            encoder = msgspec.msgpack.Encoder()
            self._encode_into = encoder.encode_into
            self.raw_encode = encoder.encode
            self._decode = msgspec.msgpack.Decoder(Message).decode
            self.raw_decode = self._decode
        elif name == "json":
            json_encoder = msgspec.json.Encoder()
            self._encode_into = json_encoder.encode_into
            self.raw_encode = json_encoder.encode
            self._decode = msgspec.json.Decoder(Message).decode
            self.raw_decode = self._decode
        else:
            raise ValueError(f"codec: unknown codec {name!r} (msgpack or json)")

    def encode_into(self, message: Message, buffer: bytearray, offset: int) -> None:
        """Write the payload of `message` into `buffer` at `offset` (growing it)."""
        self._encode_into(message, buffer, offset)

    raw_encode: Callable[[Message], bytes]
    """The msgspec encoder's `encode` itself (the per-frame hot path)."""
    raw_decode: Callable[[bytes | bytearray | memoryview], Message]
    """The msgspec decoder itself: raises `msgspec.MsgspecError` instead of protocol errors."""

    def encode(self, message: Message) -> bytes:
        """The payload of `message`."""
        return self.raw_encode(message)

    def decode(self, payload: bytes | bytearray | memoryview) -> Message:
        """Decode one payload; raise `RemoteProtocolError` (§12) when it is not a message."""
        if self.name == "json" and exceeds_json_depth(payload):
            raise RemoteProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"payload nests deeper than {MAX_JSON_DEPTH} levels",
                field="$",
            )
        try:
            message: Message = self._decode(payload)
        except msgspec.MsgspecError as exc:
            raise _remote_error(exc) from None
        except RecursionError:  # msgpack: msgspec gives up near Python's recursion limit
            raise RemoteProtocolError(
                ErrorCode.INVALID_MESSAGE, "payload nests too deeply to decode", field="$"
            ) from None
        return message


def to_builtins(message: Message) -> dict[str, Any]:
    """A message as plain Python data (for logs and tests)."""
    data: dict[str, Any] = msgspec.to_builtins(message)
    return data
