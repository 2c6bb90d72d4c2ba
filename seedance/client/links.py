"""The client's transports as byte links for the connection driver: binary WebSocket messages
(trio-websocket, `ws://` / `wss://`) or a TCP stream (`tcp://`, `tls://`), and how to open one
from the client's URL."""

from __future__ import annotations

import ssl
import urllib.parse
from typing import Protocol

import trio
import trio_websocket

from seedance.client.errors import ConnectFailed
from seedance.protocol import ErrorCode, RemoteProtocolError
from seedance.protocol.messages import Codec

SUBPROTOCOL = {"msgpack": "seedance.v1.msgpack", "json": "seedance.v1.json"}
RECEIVE_BYTES = 65536
MAX_MESSAGE_BYTES = 64 << 20


class ClientLink(Protocol):
    """A byte pipe to the server (`seedance.transport.Link`) that can also be closed."""

    async def receive(self) -> bytes: ...
    async def send(self, data: bytes) -> None: ...

    async def aclose(self) -> None:
        """Close normally (the server then ends the session)."""

    async def abort(self) -> None:
        """Drop a dead or unresponsive link without ending the session."""


class WebSocketLink:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws

    async def receive(self) -> bytes:
        try:
            message = await self.ws.get_message()
        except trio_websocket.ConnectionClosed:
            return b""
        if isinstance(message, str):
            raise RemoteProtocolError(ErrorCode.PROTOCOL_VIOLATION,
                                      "the server sent a text message")
        return message

    async def send(self, data: bytes) -> None:
        try:
            await self.ws.send_message(data)
        except trio_websocket.ConnectionClosed:
            raise trio.BrokenResourceError("WebSocket closed") from None

    async def aclose(self) -> None:
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            await self.ws.aclose(1000)

    async def abort(self) -> None:
        """Close with 1001, which keeps the session resumable."""
        with trio.move_on_after(0.5) as scope:
            scope.shield = True
            await self.ws.aclose(1001)


class TcpLink:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def receive(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some(RECEIVE_BYTES))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    async def abort(self) -> None:
        await trio.aclose_forcefully(self.stream)


async def open_link(url: str, codec: Codec, ssl_context: ssl.SSLContext | None,
                    timeout: float, nursery: trio.Nursery) -> ClientLink:
    """Connect to `url` within `timeout` seconds (`ConnectFailed` otherwise); a WebSocket's
    background task runs in `nursery`."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or "127.0.0.1"
    try:
        with trio.fail_after(timeout):
            if parsed.scheme in ("tcp", "tls"):
                if parsed.port is None:
                    raise ValueError(f"url: {url!r} needs a port")
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, parsed.port)
                if ssl_context is not None:
                    ssl_stream = trio.SSLStream(stream, ssl_context, server_hostname=host)
                    await ssl_stream.do_handshake()
                    stream = ssl_stream
                return TcpLink(stream)
            ws = await trio_websocket.connect_websocket_url(
                nursery, url, ssl_context, subprotocols=[SUBPROTOCOL[codec]],
                max_message_size=MAX_MESSAGE_BYTES, receive_buffer_size=RECEIVE_BYTES,
            )
            return WebSocketLink(ws)
    except trio.TooSlowError:
        raise ConnectFailed("connect_failed", f"{url}: timed out") from None
    except trio_websocket.ConnectionRejected as exc:
        body = (exc.body or b"").decode(errors="replace").strip()
        raise ConnectFailed(
            "connect_failed", f"{url}: HTTP {exc.status_code} {body}".strip()
        ) from None
    except (OSError, trio_websocket.HandshakeError, ssl.SSLError) as exc:
        raise ConnectFailed("connect_failed", f"{url}: {exc}") from None
