"""TLS for every listening port (HTTP/WebSocket and raw TCP): a server SSLContext with TLS 1.3
as the minimum version, and the socket options applied to each accepted connection."""

from __future__ import annotations

import socket
import ssl

import trio

from seedance.config import ServerConfig


def server_ssl_context(cert: str, key: str, *, alpn: list[str] | None = None) -> ssl.SSLContext:
    """TLS 1.3 only, no compression, the given certificate chain and key (PEM files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.options |= ssl.OP_NO_COMPRESSION
    context.load_cert_chain(cert, key)
    if alpn:
        context.set_alpn_protocols(alpn)
    return context


def socket_stream_of(stream: trio.abc.Stream) -> trio.SocketStream | None:
    """The TCP socket under `stream` (unwrapping TLS), if any."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    return stream if isinstance(stream, trio.SocketStream) else None


def apply_socket_options(stream: trio.abc.Stream, config: ServerConfig) -> None:
    """TCP_NODELAY, SO_KEEPALIVE, SO_SNDBUF and SO_RCVBUF as configured."""
    sock = socket_stream_of(stream)
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(config.tcp_nodelay))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(config.tcp_keepalive))
    if config.tcp_sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.tcp_sndbuf)
    if config.tcp_rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.tcp_rcvbuf)
