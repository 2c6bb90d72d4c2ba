"""The protocol over WebSocket at `/v2/infer` (protocol-v1 §8): the upgrade handshake with
wsproto from the request h11 already parsed (subprotocols `seedance.v1.msgpack`, the default,
and `seedance.v1.json`; a bad handshake gets a plain HTTP 400/426), then binary messages
carrying the protocol's byte stream, and the close codes of §8."""

from __future__ import annotations

import contextlib

import h11
import trio
import wsproto
import wsproto.events as ws
from wsproto.utilities import RemoteProtocolError as WsRemoteProtocolError

from seedance.protocol import ErrorCode, RemoteProtocolError
from seedance.protocol.messages import Codec
from seedance.server.gateway.protocol_session import ProtocolConnection
from seedance.server.gateway.socket_writer import WrittenTransport
from seedance.server.ops.structured_log import log_event
from seedance.server.server_context import ServerContext
from seedance.transport import SendLimits

SUBPROTOCOLS: dict[str, Codec] = {"seedance.v1.msgpack": "msgpack", "seedance.v1.json": "json"}
DEFAULT_SUBPROTOCOL = "seedance.v1.msgpack"
RECEIVE_BYTES = 65536
HANDSHAKE_SECONDS = 10.0


def _raw_request(request: h11.Request) -> bytes:
    """The request head again, for wsproto's handshake parser."""
    lines = [b"%s %s HTTP/1.1" % (request.method, request.target)]
    lines.extend(b"%s: %s" % (name, value) for name, value in request.headers)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def choose_subprotocol(offered: list[str]) -> str | None:
    """The first offered subprotocol we speak; the default when none is offered; None when
    every offered one is unknown."""
    if not offered:
        return DEFAULT_SUBPROTOCOL
    for name in offered:
        if name in SUBPROTOCOLS:
            return name
    return None


class WebSocketTransport(WrittenTransport):
    """Binary WebSocket messages as a byte pipe (messages may split or join frames freely)."""

    def __init__(self, stream: trio.abc.Stream, connection: wsproto.WSConnection,
                 limits: SendLimits | None = None) -> None:
        super().__init__(stream, limits)
        self.ws = connection
        self._pending: list[bytes] = []
        self._peer_closed = False
        self._clean = False

    @property
    def closed_cleanly(self) -> bool:
        return self._clean

    async def _send_raw(self, data: bytes) -> None:
        await self._writer.send(data)

    async def receive(self) -> bytes:
        while True:
            await self._take_events()
            if self._pending:
                data = b"".join(self._pending)
                self._pending.clear()
                return data
            if self._peer_closed:
                return b""
            received = await self.stream.receive_some(RECEIVE_BYTES)
            if not received:
                self._peer_closed = True
                return b""
            self.ws.receive_data(bytes(received))

    async def _take_events(self) -> None:
        try:
            events = list(self.ws.events())
        except WsRemoteProtocolError as exc:
            raise RemoteProtocolError(ErrorCode.PROTOCOL_VIOLATION, f"WebSocket: {exc}") from None
        for event in events:
            if isinstance(event, ws.BytesMessage):
                if event.data:
                    self._pending.append(bytes(event.data))
            elif isinstance(event, ws.TextMessage):
                raise RemoteProtocolError(
                    ErrorCode.PROTOCOL_VIOLATION,
                    "text messages are not part of the protocol: frames travel in binary "
                    "messages",
                )
            elif isinstance(event, ws.Ping):
                await self._send_raw(self.ws.send(event.response()))
            elif isinstance(event, ws.CloseConnection):
                if self.ws.state is wsproto.connection.ConnectionState.OPEN:
                    # no close frame arrived: wsproto reports a framing violation (unmasked
                    # frame, reserved opcode, oversized control frame) this way; answer with
                    # an `error` and close 1002 instead of dropping the connection
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_VIOLATION,
                                              f"WebSocket: {event.reason}")
                self._peer_closed = True
                self._clean = event.code == 1000
                if self.ws.state is wsproto.connection.ConnectionState.REMOTE_CLOSING:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await self._send_raw(self.ws.send(event.response()))

    def send_nowait(self, data: bytes) -> bool:
        if self.ws.state is not wsproto.connection.ConnectionState.OPEN:
            return False  # the next `send` raises
        return self._writer.write_nowait(self.ws.send(ws.Message(data=data)))

    async def send(self, data: bytes) -> None:
        if self.ws.state is not wsproto.connection.ConnectionState.OPEN:
            raise trio.ClosedResourceError("the WebSocket is closing")
        await self._send_raw(self.ws.send(ws.Message(data=data)) if data else b"")

    async def close(self, code: int, reason: str) -> None:
        """Send the close frame, then wait (bounded by the caller) for the peer's."""
        if self.ws.state is not wsproto.connection.ConnectionState.OPEN:
            return
        try:
            await self._send_raw(self.ws.send(ws.CloseConnection(code=code, reason=reason)))
            while not self._peer_closed:
                data = await self.stream.receive_some(RECEIVE_BYTES)
                if not data:
                    return
                self.ws.receive_data(bytes(data))
                for event in self.ws.events():
                    if isinstance(event, ws.CloseConnection):
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError, WsRemoteProtocolError):
            return


async def _reject(stream: trio.abc.Stream, connection: wsproto.WSConnection,
                  event: ws.RejectConnection, message: str) -> None:
    body = message.encode()
    reject = ws.RejectConnection(
        status_code=event.status_code,
        headers=[*event.headers, (b"content-type", b"text/plain; charset=utf-8")],
        has_body=True,
    )
    data = connection.send(reject) + connection.send(ws.RejectData(data=body))
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(data)


async def serve_websocket(
    ctx: ServerContext, stream: trio.abc.Stream, request: h11.Request, trailing: bytes
) -> None:
    """Handshake, then serve the protocol on `stream` until it closes."""
    connection = wsproto.WSConnection(wsproto.ConnectionType.SERVER)
    try:
        connection.receive_data(_raw_request(request))
        upgrade = next(
            (e for e in connection.events() if isinstance(e, ws.Request)), None
        )
    except WsRemoteProtocolError as exc:
        hint = exc.event_hint
        if not isinstance(hint, ws.RejectConnection):
            hint = ws.RejectConnection(status_code=400)
        log_event(ctx.log, "bad_websocket_handshake", reason=str(exc))
        await _reject(stream, connection, hint, f"bad WebSocket handshake: {exc}\n")
        return
    if upgrade is None:
        await _reject(stream, connection, ws.RejectConnection(status_code=400),
                      "bad WebSocket handshake\n")
        return
    subprotocol = choose_subprotocol(list(upgrade.subprotocols))
    if subprotocol is None:
        await _reject(
            stream, connection, ws.RejectConnection(status_code=400),
            "unsupported WebSocket subprotocol: offer seedance.v1.msgpack or seedance.v1.json\n",
        )
        return
    offered = subprotocol if upgrade.subprotocols else None
    with trio.fail_after(HANDSHAKE_SECONDS):
        await stream.send_all(connection.send(ws.AcceptConnection(subprotocol=offered)))
    transport = WebSocketTransport(stream, connection,
                                   SendLimits(timeout=ctx.config.server.send_timeout))
    if trailing:
        connection.receive_data(trailing)
    ctx.metrics.ws_connections += 1
    try:
        await ProtocolConnection(ctx, transport, SUBPROTOCOLS[subprotocol]).serve()
    finally:
        ctx.metrics.ws_connections -= 1
