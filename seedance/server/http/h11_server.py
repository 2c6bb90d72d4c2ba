"""HTTP/1.1 on h11, one connection per call of `serve_http_connection`: keep-alive, a request
body limit enforced while reading (413 without buffering the rest), routing with OpenAI-style
404/405 errors, client-disconnect detection while a response is produced (the handler is
cancelled, so its engine request is aborted), and the WebSocket upgrade hand-off at
`/v2/infer` to the registered gateway."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import h11
import msgspec
import trio

from seedance.server.http.errors import HttpError, unavailable
from seedance.server.ops.structured_log import log_event
from seedance.server.server_context import ServerContext

RECEIVE_BYTES = 65536
MAX_HEAD_BYTES = 64 * 1024
"""Largest request line + headers (431 beyond)."""
REQUEST_TIMEOUT = 30.0
"""Seconds to receive a whole request (head and body) once it started: slowloris guard."""
KEEPALIVE_TIMEOUT = 75.0
"""Seconds an idle keep-alive connection is kept."""
LINGER_SECONDS = 2.0
"""After a 413, unread body bytes are discarded for up to this long before closing, so the
client reads the 413 instead of a connection reset."""
PIPELINE_LIMIT = 256 * 1024
"""Bytes of a pipelined next request accepted while a response is produced."""
WEBSOCKET_PATH = "/v2/infer"
SERVER_HEADER = ("server", "seedance")

log = logging.getLogger("seedance.server.http")


class HttpExchange:
    """One request and its response, handed to a route handler."""

    def __init__(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        request: h11.Request,
        body: bytes,
        close_after: bool,
    ) -> None:
        self._conn = conn
        self._stream = stream
        self.request = request
        self.method = request.method.decode("ascii")
        target = request.target.decode("ascii", errors="replace")
        self.path, _, self.query = target.partition("?")
        self.headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers
        }
        self.body = body
        self.status: int | None = None
        self.bytes_sent = 0
        self._close_after = close_after
        self._chunked = False
        """The streamed response's head says `Transfer-Encoding: chunked` (see `send`)."""

    @property
    def started(self) -> bool:
        return self.status is not None

    def _head(self, status: int, headers: Iterable[tuple[str, str]]) -> bytes:
        self.status = status
        out = [SERVER_HEADER, *headers]
        if self._close_after:
            out.append(("connection", "close"))
        return self._conn.send(h11.Response(status_code=status, headers=out))

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Send a whole response."""
        head = self._head(
            status,
            [("content-type", content_type), ("content-length", str(len(body))), *headers],
        )
        data = head + self._conn.send(h11.Data(data=body)) + self._conn.send(h11.EndOfMessage())
        self.bytes_sent += len(data)
        await self._stream.send_all(data)

    async def respond_json(
        self, status: int, obj: Any, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        await self.respond(status, msgspec.json.encode(obj), headers=headers)

    async def respond_error(self, error: HttpError) -> None:
        await self.respond(error.status, error.body(), headers=error.headers)

    async def start_stream(
        self, status: int, content_type: str, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        """Send the head of a streamed (chunked) response."""
        data = self._head(status, [("content-type", content_type), *headers])
        self._chunked = b"\r\ntransfer-encoding: chunked\r\n" in data.lower()
        self.bytes_sent += len(data)
        await self._stream.send_all(data)

    async def send(self, payload: bytes) -> None:
        """Send one piece of a streamed response. Chunked framing is written here rather than
        by h11 (whose chunked writer keeps no state between chunks; it still writes the head
        and the last chunk): this runs once per stream per delivery pass."""
        if not payload:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(payload), payload)
        else:  # HTTP/1.0 peer: close-delimited, h11 frames it
            data = self._conn.send(h11.Data(data=payload))
        self.bytes_sent += len(data)
        await self._stream.send_all(data)

    async def end_stream(self) -> None:
        await self._stream.send_all(self._conn.send(h11.EndOfMessage()))


RouteHandler = Callable[[ServerContext, HttpExchange], Awaitable[None]]
Routes = dict[str, dict[str, RouteHandler]]
"""path -> method -> handler"""


class _BodyTooLarge(Exception):
    pass


async def _next_event(conn: h11.Connection, stream: trio.abc.Stream) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        conn.receive_data(bytes(data))


async def _read_body(conn: h11.Connection, stream: trio.abc.Stream, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await _next_event(conn, stream)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:  # ConnectionClosed mid-body
            raise trio.BrokenResourceError("client closed the connection mid-body")


def _content_length(request: h11.Request) -> int | None:
    for name, value in request.headers:
        if name == b"content-length":
            return int(value)
    return None


def _is_websocket_upgrade(request: h11.Request) -> bool:
    upgrade = connection = False
    for name, value in request.headers:
        if name == b"upgrade" and value.lower() == b"websocket":
            upgrade = True
        elif name == b"connection" and b"upgrade" in value.lower():
            connection = True
    return upgrade and connection


async def _linger_and_close(stream: trio.abc.Stream) -> None:
    """Discard what the client still sends (bounded in time, constant memory), then close."""
    with trio.move_on_after(LINGER_SECONDS):
        if isinstance(stream, trio.SocketStream):
            await stream.send_eof()
        while await stream.receive_some(RECEIVE_BYTES):
            pass
    await trio.aclose_forcefully(stream)


async def _watch_disconnect(
    stream: trio.abc.Stream, conn: h11.Connection, scope: trio.CancelScope, gone: list[bool]
) -> None:
    """While a response is produced: cancel `scope` when the client goes away; keep (up to
    PIPELINE_LIMIT) what a pipelining client already sends for its next request."""
    received = 0
    while received < PIPELINE_LIMIT:
        try:
            data = await stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            gone.append(True)
            scope.cancel()
            return
        conn.receive_data(bytes(data))
        received += len(data)


async def serve_http_connection(
    ctx: ServerContext, stream: trio.abc.Stream, routes: Routes
) -> None:
    """Serve HTTP/1.1 requests on `stream` until the client or the server closes it."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    max_body = ctx.config.server.max_body_bytes
    served = 0
    try:
        while True:
            request = await _receive_request_head(ctx, conn, stream, idle_closable=served > 0)
            if request is None:
                return
            started = time.monotonic()
            path = request.target.split(b"?", 1)[0]
            if path == WEBSOCKET_PATH.encode() and _is_websocket_upgrade(request):
                await _hand_off_websocket(ctx, conn, stream, request)
                return
            close_after = ctx.drain.draining
            length = _content_length(request)
            try:
                if length is not None and length > max_body:
                    raise _BodyTooLarge
                if conn.they_are_waiting_for_100_continue:
                    await stream.send_all(
                        conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                    )
                with trio.fail_after(REQUEST_TIMEOUT):
                    body = await _read_body(conn, stream, max_body)
            except _BodyTooLarge:
                exchange = HttpExchange(conn, stream, request, b"", close_after=True)
                await exchange.respond_error(
                    HttpError(
                        413,
                        f"request body is larger than the limit of {max_body} bytes",
                        code="request_too_large",
                    )
                )
                _log_request(exchange, started)
                await _linger_and_close(stream)
                return
            except trio.TooSlowError:
                return
            exchange = HttpExchange(conn, stream, request, body, close_after)
            gone: list[bool] = []
            broken = False
            handler_scope = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_disconnect, stream, conn, handler_scope, gone)
                with handler_scope:
                    try:
                        await _dispatch(ctx, exchange, routes)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        broken = True
                nursery.cancel_scope.cancel()
            _log_request(exchange, started, client_gone=bool(gone))
            if gone or broken or not exchange.started:
                return
            if conn.our_state is h11.MUST_CLOSE or close_after or ctx.drain.draining:
                return
            if conn.their_state is not h11.DONE or conn.our_state is not h11.DONE:
                return
            conn.start_next_cycle()
            served += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        return
    finally:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)


async def _receive_request_head(
    ctx: ServerContext, conn: h11.Connection, stream: trio.abc.Stream, *, idle_closable: bool
) -> h11.Request | None:
    """The next request's head, or None (client closed, idle timeout, bad request — then the
    4xx has been sent — or, for a keep-alive connection that already served a request
    (`idle_closable`), the drain)."""
    try:
        first = conn.next_event()
        if first is h11.NEED_DATA:
            with trio.move_on_after(KEEPALIVE_TIMEOUT) as idle:
                if idle_closable:
                    ctx.drain.idle_scopes.add(idle)
                    if ctx.drain.draining:
                        idle.cancel()
                try:
                    data = await stream.receive_some(RECEIVE_BYTES)
                finally:
                    ctx.drain.idle_scopes.discard(idle)
            if idle.cancelled_caught:
                return None
            conn.receive_data(bytes(data))
        with trio.fail_after(REQUEST_TIMEOUT):
            event = first if first is not h11.NEED_DATA else await _next_event(conn, stream)
    except trio.TooSlowError:
        return None
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return None
    except h11.RemoteProtocolError as exc:
        status = exc.error_status_hint
        error = HttpError(status, f"malformed HTTP request: {exc}", code="bad_http_request")
        try:
            body = error.body()
            data = conn.send(
                h11.Response(
                    status_code=status,
                    headers=[
                        SERVER_HEADER,
                        ("content-type", "application/json"),
                        ("content-length", str(len(body))),
                        ("connection", "close"),
                    ],
                )
            )
            await stream.send_all(data + conn.send(h11.Data(data=body)))
        except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        log_event(log, "bad_request", level=logging.INFO, status=status, reason=str(exc))
        return None
    if isinstance(event, h11.Request):
        return event
    return None


async def _hand_off_websocket(
    ctx: ServerContext, conn: h11.Connection, stream: trio.abc.Stream, request: h11.Request
) -> None:
    handler = ctx.gateways.websocket
    if handler is None or ctx.drain.draining or not ctx.config.server.streaming_enabled:
        if handler is None:
            error = HttpError(
                501,
                "the WebSocket gateway is not available in this build",
                type="server_error",
                code="not_implemented",
            )
        elif ctx.drain.draining:
            error = unavailable("server is shutting down", code="draining")
        else:
            error = HttpError(
                403,
                "streaming is disabled on this server (--streaming-enabled)",
                code="streaming_disabled",
            )
        exchange = HttpExchange(conn, stream, request, b"", close_after=True)
        await exchange.respond_error(error)
        return
    trailing, _closed = conn.trailing_data
    await handler(ctx, stream, request, bytes(trailing))


async def _dispatch(ctx: ServerContext, exchange: HttpExchange, routes: Routes) -> None:
    methods = routes.get(exchange.path)
    try:
        if methods is None:
            raise HttpError(
                404, f"no route for {exchange.method} {exchange.path}", code="not_found"
            )
        handler = methods.get(exchange.method)
        if handler is None:
            allow = ", ".join(sorted(methods))
            raise HttpError(
                405,
                f"method {exchange.method} is not allowed on {exchange.path} (allowed: {allow})",
                code="method_not_allowed",
                headers=[("Allow", allow)],
            )
        await handler(ctx, exchange)
    except HttpError as error:
        if exchange.started:
            raise trio.BrokenResourceError("error after the response started") from error
        await exchange.respond_error(error)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise
    except Exception as exc:
        log.exception("handler failed", extra={"seedance_fields": {"path": exchange.path}})
        if exchange.started:
            raise trio.BrokenResourceError("handler failed after the response started") from exc
        await exchange.respond_error(
            HttpError(500, "internal server error", type="server_error", code="internal")
        )


def _log_request(exchange: HttpExchange, started: float, *, client_gone: bool = False) -> None:
    log_event(
        log,
        "http_request",
        method=exchange.method,
        path=exchange.path,
        status=exchange.status,
        bytes=exchange.bytes_sent,
        ms=round((time.monotonic() - started) * 1000, 2),
        client_gone=client_gone,
    )
