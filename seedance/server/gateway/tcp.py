"""The protocol over raw TCP (`--tcp-port`, protocol-v1 §8): the same framed byte stream as
the WebSocket, MessagePack only. TCP_NODELAY, keepalive and buffer sizes are set by the server
on every accepted socket (`transport_security.apply_socket_options`), TLS too."""

from __future__ import annotations

import trio

from seedance.server.gateway.protocol_session import ProtocolConnection
from seedance.server.gateway.socket_writer import WrittenTransport
from seedance.server.server_context import ServerContext
from seedance.transport import SendLimits

RECEIVE_BYTES = 65536


class TcpTransport(WrittenTransport):
    """A trio stream as the protocol's byte pipe."""

    closed_cleanly = False
    """A raw TCP peer cannot say it is done on purpose: its session waits for a resume."""

    def __init__(self, stream: trio.abc.Stream, limits: SendLimits | None = None) -> None:
        super().__init__(stream, limits)

    async def receive(self) -> bytes:
        return bytes(await self.stream.receive_some(RECEIVE_BYTES))

    def send_nowait(self, data: bytes) -> bool:
        return self._writer.write_nowait(data)

    async def send(self, data: bytes) -> None:
        await self._writer.send(data)

    async def close(self, code: int, reason: str) -> None:
        """Half-close and discard what the peer still sends until it closes too (bounded by
        the caller), so the last frames are read rather than lost to a reset."""
        try:
            await self._writer.send()
            if isinstance(self.stream, trio.SocketStream):
                await self.stream.send_eof()
            while await self.stream.receive_some(RECEIVE_BYTES):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def serve_tcp(ctx: ServerContext, stream: trio.abc.Stream) -> None:
    """Serve the protocol on one accepted TCP (or TLS) connection until it closes."""
    transport = TcpTransport(stream, SendLimits(timeout=ctx.config.server.send_timeout))
    await ProtocolConnection(ctx, transport, "msgpack").serve()
